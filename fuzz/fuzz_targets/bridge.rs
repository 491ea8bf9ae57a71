//! What the other end sends on a TCP bridge: the greeting record, then a stream of frames
//! (header and payload). Any bytes, arriving in any two pieces, must yield whole frames or a
//! typed refusal, never a panic; frames never claim more bytes than arrived, a payload is
//! never above the limit, and only DATA and ACK get through.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_conn::fuzzing::bridge_frames;
use rdmamig_conn::wire::{Kind, PrivateData, HEADER_LEN, MAX_CONNECT_PRIVATE_DATA};
use rdmamig_conn::FrameError;

/// The limit a connection with 4 KiB messages gives its bridge.
const MAX_PAYLOAD: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let (greeting, stream) = data.split_at(data.len().min(MAX_CONNECT_PRIVATE_DATA));
    let _ = PrivateData::decode(greeting);

    let cut = stream.first().map_or(0, |b| usize::from(*b)).min(stream.len());
    let mut received = Vec::new();
    let mut last_received = 0u64;
    for piece in [&stream[..cut], &stream[cut..]] {
        received.extend_from_slice(piece);
        let result = bridge_frames(&received, MAX_PAYLOAD, |header, payload| {
            assert!(matches!(header.kind, Kind::Data | Kind::Ack), "{header:?}");
            assert!(payload.len() <= MAX_PAYLOAD);
            if header.kind == Kind::Data {
                // The receiver's rule: the next in order, a duplicate, or a gap that ends the bridge.
                if header.seq == last_received + 1 {
                    last_received = header.seq;
                } else if header.seq > last_received {
                    return Err(FrameError::OutOfOrder {
                        seq: header.seq,
                        expected: last_received + 1,
                    });
                }
            }
            Ok(())
        });
        match result {
            Ok(used) => {
                assert!(used <= received.len());
                assert!(received.len() - used < HEADER_LEN + MAX_PAYLOAD);
                received.drain(..used);
            }
            Err(_) => return,
        }
    }
});
