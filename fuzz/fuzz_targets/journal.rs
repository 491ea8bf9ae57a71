//! A journal on replay (after a crash, a torn last record is normal): any bytes yield a
//! replay or a typed "corrupt" error, never a panic; bytes after the last newline never
//! change the outcome.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use rdmamig_migrator::journal;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.journal");
    let whole = journal::parse(path, data);
    let complete = data
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |end| end + 1);
    let torn = journal::parse(path, &data[..complete]);
    assert_eq!(
        whole.as_ref().map(|r| r.records.len()).map_err(|e| e.to_string()),
        torn.as_ref().map(|r| r.records.len()).map_err(|e| e.to_string()),
        "a torn last record changed the replay"
    );
});
