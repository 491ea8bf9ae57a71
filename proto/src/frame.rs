//! Framing: `b"RMG"` magic, a version byte, a big-endian `u32` payload length, then the
//! payload (one JSON-encoded message).
//!
//! Decoding is split into a cheap [`check`] that says whether a whole frame is buffered
//! (or why the bytes can never be a frame) and a parse of the payload. The buffer only
//! advances after a successful check, so a partial read never loses bytes.
//!
//! [`read_message`] reads one message from a blocking stream by a deadline, for channels
//! that carry one request and one answer per connection.

use std::io::Read;
use std::net::TcpStream;
use std::time::Instant;

use serde::{de::DeserializeOwned, Serialize};
use thiserror::Error;

use crate::PROTOCOL_VERSION;

/// The first three bytes of every frame.
pub const MAGIC: [u8; 3] = *b"RMG";
/// Bytes before the payload: magic, version, length.
pub const HEADER_LEN: usize = 8;
/// Largest payload accepted on any channel. Every message rdmamig sends is far smaller;
/// anything larger is refused before it is buffered.
pub const MAX_FRAME_LEN: usize = 64 * 1024;

/// Why bytes could not be turned into a message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    /// Not enough bytes yet: read more and try again. Not a protocol error.
    #[error("incomplete frame: {needed} more bytes needed")]
    Incomplete {
        /// How many more bytes the frame needs, at least.
        needed: usize,
    },
    /// The bytes do not start with the frame magic.
    #[error("bad frame magic {found:02x?}: not an rdmamig peer")]
    BadMagic {
        /// The bytes found where the magic should be.
        found: [u8; 3],
    },
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {found} (this side speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion {
        /// The version byte received.
        found: u8,
    },
    /// The announced payload is larger than [`MAX_FRAME_LEN`].
    #[error("frame of {len} bytes exceeds the limit of {MAX_FRAME_LEN}")]
    TooLarge {
        /// The announced payload length.
        len: usize,
    },
    /// The payload is not a valid message of the expected type.
    #[error("malformed message: {reason}")]
    Malformed {
        /// What the JSON decoder said.
        reason: String,
    },
}

impl FrameError {
    /// Whether the stream can go on after this error: only [`FrameError::Malformed`] leaves the
    /// framing intact (the bad frame was consumed); the others mean the byte stream itself is
    /// not trustworthy.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            FrameError::Malformed { .. } | FrameError::Incomplete { .. }
        )
    }
}

/// One frame's payload, still encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The JSON payload.
    pub payload: Vec<u8>,
}

impl Frame {
    /// Encodes `message` into a complete frame, header included.
    ///
    /// # Panics
    /// If the message encodes to more than [`MAX_FRAME_LEN`] bytes: every message type in this
    /// crate is bounded well below it, so that is a programming error.
    pub fn encode<T: Serialize>(message: &T) -> Vec<u8> {
        let payload = serde_json::to_vec(message).expect("rdmamig messages always serialize");
        assert!(
            payload.len() <= MAX_FRAME_LEN,
            "message larger than a frame"
        );
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        out.extend_from_slice(&MAGIC);
        out.push(PROTOCOL_VERSION);
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&payload);
        out
    }

    /// Parses the payload as a message of type `T`.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, FrameError> {
        serde_json::from_slice(&self.payload).map_err(|e| FrameError::Malformed {
            reason: e.to_string(),
        })
    }
}

/// Checks whether `buf` starts with a whole, well-formed frame header and payload.
///
/// Returns the total length of that frame (header included).
pub fn check(buf: &[u8]) -> Result<usize, FrameError> {
    let magic_seen = buf.len().min(MAGIC.len());
    if buf[..magic_seen] != MAGIC[..magic_seen] {
        let mut found = [0u8; 3];
        found[..magic_seen].copy_from_slice(&buf[..magic_seen]);
        return Err(FrameError::BadMagic { found });
    }
    if buf.len() < HEADER_LEN {
        return Err(FrameError::Incomplete {
            needed: HEADER_LEN - buf.len(),
        });
    }
    if buf[3] != PROTOCOL_VERSION {
        return Err(FrameError::UnsupportedVersion { found: buf[3] });
    }
    let len = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge { len });
    }
    let total = HEADER_LEN + len;
    if buf.len() < total {
        return Err(FrameError::Incomplete {
            needed: total - buf.len(),
        });
    }
    Ok(total)
}

/// Accumulates bytes from a stream and yields whole frames.
///
/// Used the same way by blocking and async readers: push what was read, then pop frames
/// until [`FrameError::Incomplete`].
#[derive(Debug, Default)]
pub struct FrameBuffer {
    buf: Vec<u8>,
}

impl FrameBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Removes and returns the next whole frame.
    ///
    /// On a framing error other than `Incomplete` the buffered bytes cannot be trusted; the
    /// caller reports the error and either closes the stream or calls [`FrameBuffer::resync`].
    pub fn pop(&mut self) -> Result<Frame, FrameError> {
        let total = check(&self.buf)?;
        let payload = self.buf[HEADER_LEN..total].to_vec();
        self.buf.drain(..total);
        Ok(Frame { payload })
    }

    /// Drops bytes up to the next possible frame start (the next magic after the first
    /// byte). For streams that outlive their peers, such as a virtio-serial port where a
    /// host may disconnect mid-frame.
    pub fn resync(&mut self) {
        let next = self.buf[1.min(self.buf.len())..]
            .windows(MAGIC.len())
            .position(|w| w == MAGIC)
            .map(|p| p + 1);
        match next {
            Some(start) => drop(self.buf.drain(..start)),
            None => {
                // Keep only a tail that may be the beginning of a magic split across reads.
                let keep = (1..MAGIC.len())
                    .rev()
                    .find(|&k| k <= self.buf.len() && self.buf.ends_with(&MAGIC[..k]))
                    .unwrap_or(0);
                let cut = self.buf.len() - keep;
                self.buf.drain(..cut);
            }
        }
    }

    /// Number of bytes buffered and not yet returned as frames.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether no bytes are buffered.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;

    #[test]
    fn read_message_gives_a_whole_frame_and_stops_a_trickle_at_the_deadline() {
        use std::io::Write;
        use std::net::TcpListener;
        use std::time::Duration;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let encoded = Frame::encode(&"hello".to_string());
        let sender = std::thread::spawn(move || {
            let mut whole = TcpStream::connect(addr).unwrap();
            whole.write_all(&encoded).unwrap();
            // One byte every 100 ms: each read is quick, the whole is too slow.
            let mut trickle = TcpStream::connect(addr).unwrap();
            for byte in &encoded {
                if trickle.write_all(&[*byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let (mut whole, _) = listener.accept().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let got: String = read_message(&mut whole, deadline).unwrap();
        assert_eq!(got, "hello");
        let (mut trickle, _) = listener.accept().unwrap();
        let started = Instant::now();
        let err =
            read_message::<String>(&mut trickle, started + Duration::from_millis(350)).unwrap_err();
        assert!(
            matches!(err, ReadError::TimedOut | ReadError::Io(_)),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(trickle);
        sender.join().unwrap();
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Sample {
        id: u64,
        text: String,
    }

    #[test]
    fn round_trip() {
        let msg = Sample {
            id: 7,
            text: "hi".into(),
        };
        let mut fb = FrameBuffer::new();
        fb.push(&Frame::encode(&msg));
        assert_eq!(fb.pop().unwrap().decode::<Sample>().unwrap(), msg);
        assert!(fb.is_empty());
    }

    #[test]
    fn oversized_length_is_refused_before_buffering_the_payload() {
        let mut bytes = MAGIC.to_vec();
        bytes.push(PROTOCOL_VERSION);
        bytes.extend_from_slice(&((MAX_FRAME_LEN as u32) + 1).to_be_bytes());
        assert_eq!(
            check(&bytes),
            Err(FrameError::TooLarge {
                len: MAX_FRAME_LEN + 1
            })
        );
    }

    #[test]
    fn wrong_version_and_magic() {
        let mut bytes = Frame::encode(&1u32);
        bytes[3] = 9;
        assert_eq!(
            check(&bytes),
            Err(FrameError::UnsupportedVersion { found: 9 })
        );
        assert!(matches!(
            check(b"GET / HTTP/1.1"),
            Err(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn malformed_payload_is_typed_and_consumes_the_frame() {
        let mut fb = FrameBuffer::new();
        let mut bytes = MAGIC.to_vec();
        bytes.push(PROTOCOL_VERSION);
        bytes.extend_from_slice(&3u32.to_be_bytes());
        bytes.extend_from_slice(b"{{{");
        fb.push(&bytes);
        fb.push(&Frame::encode(&5u32));
        let err = fb.pop().unwrap().decode::<Sample>().unwrap_err();
        assert!(matches!(err, FrameError::Malformed { .. }) && err.is_recoverable());
        assert_eq!(fb.pop().unwrap().decode::<u32>().unwrap(), 5);
    }

    #[test]
    fn resync_skips_garbage_to_the_next_frame() {
        let mut fb = FrameBuffer::new();
        fb.push(b"garbage\x00RM");
        fb.push(&Frame::encode(&42u32)[2..]); // completes "RMG..." split across pushes
        assert!(matches!(fb.pop(), Err(FrameError::BadMagic { .. })));
        fb.resync();
        assert_eq!(fb.pop().unwrap().decode::<u32>().unwrap(), 42);
    }

    proptest! {
        #[test]
        fn encode_then_decode_returns_the_original(id: u64, text in ".{0,200}") {
            let msg = Sample { id, text };
            let bytes = Frame::encode(&msg);
            let mut fb = FrameBuffer::new();
            fb.push(&bytes);
            prop_assert_eq!(fb.pop().unwrap().decode::<Sample>().unwrap(), msg);
        }

        #[test]
        fn every_truncated_prefix_is_incomplete(id: u64, text in ".{0,64}") {
            let bytes = Frame::encode(&Sample { id, text });
            for cut in 0..bytes.len() {
                let incomplete = matches!(check(&bytes[..cut]), Err(FrameError::Incomplete { .. }));
                prop_assert!(incomplete, "prefix of {} bytes", cut);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut fb = FrameBuffer::new();
            fb.push(&bytes);
            while let Ok(frame) = fb.pop() {
                let _ = frame.decode::<Sample>();
            }
            fb.resync();
        }
    }
}

/// Why [`read_message`] gave no message.
#[derive(Debug, Error)]
pub enum ReadError {
    /// Reading failed (a read timeout included).
    #[error("reading failed")]
    Io(#[source] std::io::Error),
    /// The stream ended before a whole frame.
    #[error("the stream closed before a whole frame")]
    Closed,
    /// No whole frame came before the deadline.
    #[error("no whole frame before the deadline")]
    TimedOut,
    /// The bytes are no frame, or the frame is not the message expected.
    #[error("not a message")]
    Frame(#[source] FrameError),
}

/// Reads from `stream` until one whole frame has come, by `deadline` however slowly the
/// bytes trickle in, and decodes it.
pub fn read_message<T: DeserializeOwned>(
    stream: &mut TcpStream,
    deadline: Instant,
) -> Result<T, ReadError> {
    let mut frames = FrameBuffer::new();
    let mut buf = [0u8; 4096];
    loop {
        match frames.pop() {
            Ok(frame) => return frame.decode().map_err(ReadError::Frame),
            Err(FrameError::Incomplete { .. }) => {}
            Err(e) => return Err(ReadError::Frame(e)),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ReadError::TimedOut);
        }
        stream.set_read_timeout(Some(left)).map_err(ReadError::Io)?;
        match stream.read(&mut buf) {
            Ok(0) => return Err(ReadError::Closed),
            Ok(n) => frames.push(&buf[..n]),
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
}
