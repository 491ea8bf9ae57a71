//! What a VMM sends the migrator: QMP lines, Cloud Hypervisor's event-monitor stream and its
//! API error bodies. Any bytes yield values or errors, never a panic, and the event parser
//! never claims more bytes than it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_vmm::{ch_api, ch_events, qmp};

fuzz_target!(|data: &[u8]| {
    for line in data.split(|b| *b == b'\n') {
        let _ = qmp::classify(line);
    }
    if let Ok((events, used)) = ch_events::parse_events(data) {
        assert!(used <= data.len());
        for event in &events {
            let _ = ch_events::progress(event, 0);
        }
    }
    let _ = ch_api::error_message(data);
});
