//! The daemon's TOML config: any text yields a config or a parse error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_migrator::config::Config;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = toml::from_str::<Config>(text);
    }
});
