//! Arbitrary bytes on any framed channel (host <-> agent, agent <-> application, a
//! preloaded program's peer <-> agent) must yield frames, typed errors or "incomplete",
//! never a panic, and resynchronising must always make progress. Whatever the guest's answer says, once made printable it has no control
//! character left to reach a terminal.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_proto::agent::{AgentRequest, AgentResponse};
use rdmamig_proto::app::{AgentToApp, AppToAgent};
use rdmamig_proto::preload::{PeerAnswer, PeerRequest};
use rdmamig_proto::{FrameBuffer, FrameError};

/// No string anywhere in `value` has a control character.
fn printable(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => !s.chars().any(char::is_control),
        serde_json::Value::Array(items) => items.iter().all(printable),
        serde_json::Value::Object(fields) => fields.values().all(printable),
        _ => true,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut frames = FrameBuffer::new();
    // Feed in two pieces, as a stream would.
    let (a, b) = data.split_at(data.len() / 2);
    for piece in [a, b] {
        frames.push(piece);
        loop {
            let before = frames.len();
            match frames.pop() {
                Ok(frame) => {
                    let _ = frame.decode::<AgentRequest>();
                    if let Ok(response) = frame.decode::<AgentResponse>() {
                        let shown = serde_json::to_value(response.result.into_printable())
                            .expect("a result serializes");
                        assert!(printable(&shown), "{shown}");
                    }
                    let _ = frame.decode::<AgentToApp>();
                    let _ = frame.decode::<AppToAgent>();
                    let _ = frame.decode::<PeerRequest>();
                    let _ = frame.decode::<PeerAnswer>();
                }
                Err(FrameError::Incomplete { .. }) => break,
                Err(_) => {
                    frames.resync();
                    assert!(frames.len() < before, "resync made no progress");
                }
            }
        }
    }
});
