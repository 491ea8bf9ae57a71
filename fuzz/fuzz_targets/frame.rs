//! Arbitrary bytes on any framed channel (host <-> agent, agent <-> application) must yield
//! frames, typed errors or "incomplete", never a panic, and resynchronising must always
//! make progress.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_proto::agent::{AgentRequest, AgentResponse};
use rdmamig_proto::app::{AgentToApp, AppToAgent};
use rdmamig_proto::{FrameBuffer, FrameError};

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
                    let _ = frame.decode::<AgentResponse>();
                    let _ = frame.decode::<AgentToApp>();
                    let _ = frame.decode::<AppToAgent>();
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
