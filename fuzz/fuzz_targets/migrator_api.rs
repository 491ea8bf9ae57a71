//! What another migrator and a local client send the daemon: a peer's request (then checked
//! against a peer's scope), a destination's answer, a client's request and the daemon's
//! messages. Decoding must never panic, and a scope must refuse or admit any request
//! without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_migrator::api::{ClientRequest, DaemonMessage};
use rdmamig_migrator::peer::{PeerAnswer, PeerRequest, Scope};

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = serde_json::from_slice::<PeerRequest>(data) {
        let scope = Scope::new(vec!["/run/vmms".into()]);
        for peer in ["a", "b", "a"] {
            let _ = scope.admit(peer, &request.call);
        }
    }
    let _ = serde_json::from_slice::<PeerAnswer>(data);
    let _ = serde_json::from_slice::<ClientRequest>(data);
    let _ = serde_json::from_slice::<DaemonMessage>(data);
});
