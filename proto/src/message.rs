//! Messages larger than one frame. What a move carries per connection (an outcome, a
//! description) outgrows a frame's 64 KiB at several hundred connections, so any message
//! that does not fit travels as a run of [`Piece`] frames whose texts make its JSON; one that
//! fits is a single frame, as every other message is. Every channel that carries per-connection
//! lists sends with [`encode`] and receives through an [`Assembler`], which bounds what it
//! assembles: a peer cannot make the receiver hold more than it agreed to.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::frame::{Frame, FrameError, MAX_FRAME_LEN};

/// The largest message sent in pieces, and the most a receiver may be set to assemble: a
/// move's lists for thousands of connections take a few MiB.
pub const MAX_MESSAGE_LEN: usize = 16 * 1024 * 1024;

/// How much of a message's JSON one piece carries: escaped into a JSON string it at most
/// doubles, so a piece always fits in a frame.
const PIECE_LEN: usize = 24 * 1024;

/// One frame of a message too large for one: a run of pieces, the last one marked, whose
/// texts make the message's JSON.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Piece {
    piece: String,
    last: bool,
}

/// Why a message could not be encoded or assembled.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MessageError {
    /// A message is larger than the sender sends or the receiver takes.
    #[error("a message of {len} bytes or more is larger than the limit of {limit} bytes")]
    TooLarge {
        /// Its encoded size (so far, for one being assembled).
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A frame of the run, or the assembled message, is not what was expected.
    #[error(transparent)]
    Malformed(FrameError),
}

impl MessageError {
    /// Whether the stream can go on after this error: a message past the limit is skipped
    /// to its end, and a malformed one was consumed; a broken framing cannot go on.
    pub fn is_recoverable(&self) -> bool {
        match self {
            MessageError::TooLarge { .. } => true,
            MessageError::Malformed(e) => e.is_recoverable(),
        }
    }
}

/// Encodes `message` as one frame if it fits, as a run of pieces otherwise (up to
/// [`MAX_MESSAGE_LEN`]).
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, MessageError> {
    let text = serde_json::to_string(message).map_err(|e| {
        MessageError::Malformed(FrameError::Malformed {
            reason: format!("cannot encode a message: {e}"),
        })
    })?;
    if text.len() > MAX_MESSAGE_LEN {
        return Err(MessageError::TooLarge {
            len: text.len(),
            limit: MAX_MESSAGE_LEN,
        });
    }
    if text.len() <= MAX_FRAME_LEN {
        return Ok(Frame::encode(message));
    }
    let mut bytes = Vec::with_capacity(text.len() + text.len() / 8);
    let mut rest = text.as_str();
    while !rest.is_empty() {
        let mut cut = rest.len().min(PIECE_LEN);
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        let (piece, after) = rest.split_at(cut);
        rest = after;
        bytes.extend(Frame::encode(&Piece {
            piece: piece.into(),
            last: rest.is_empty(),
        }));
    }
    Ok(bytes)
}

/// Turns frames back into messages, assembling runs of pieces up to a limit.
#[derive(Debug)]
pub struct Assembler {
    state: State,
    /// The largest message assembled.
    limit: usize,
}

/// Where an [`Assembler`] is in the stream.
#[derive(Debug)]
enum State {
    /// Between messages.
    Idle,
    /// The JSON so far of a message under way.
    Assembling(String),
    /// Dropping the rest of a message that grew past the limit, up to its last piece.
    Skipping,
}

impl Assembler {
    /// An assembler of messages of up to `limit` bytes (at most [`MAX_MESSAGE_LEN`]); with
    /// `limit` at most [`MAX_FRAME_LEN`] it takes single frames only.
    pub fn new(limit: usize) -> Assembler {
        Assembler {
            state: State::Idle,
            limit: limit.min(MAX_MESSAGE_LEN),
        }
    }

    /// Whether a message's pieces are under way (being assembled or skipped).
    pub fn is_assembling(&self) -> bool {
        !matches!(self.state, State::Idle)
    }

    /// Takes the next frame of the stream: the message once it is whole, `None` while more
    /// pieces must come. A message past the limit is refused once, at the piece that takes
    /// it past, and its other pieces are dropped; a message in the middle of another's
    /// pieces ends that one with an error.
    pub fn take<T: DeserializeOwned>(&mut self, frame: Frame) -> Result<Option<T>, MessageError> {
        let Ok(piece) = frame.decode::<Piece>() else {
            if !matches!(std::mem::replace(&mut self.state, State::Idle), State::Idle) {
                return Err(malformed(
                    "a message came in the middle of another's pieces".into(),
                ));
            }
            return frame.decode().map(Some).map_err(MessageError::Malformed);
        };
        let mut text = match std::mem::replace(&mut self.state, State::Idle) {
            State::Skipping if piece.last => return Ok(None),
            State::Skipping => {
                self.state = State::Skipping;
                return Ok(None);
            }
            State::Idle => String::new(),
            State::Assembling(text) => text,
        };
        let len = text.len() + piece.piece.len();
        if len > self.limit {
            if !piece.last {
                self.state = State::Skipping;
            }
            return Err(MessageError::TooLarge {
                len,
                limit: self.limit,
            });
        }
        text.push_str(&piece.piece);
        if !piece.last {
            self.state = State::Assembling(text);
            return Ok(None);
        }
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| malformed(e.to_string()))
    }
}

fn malformed(reason: String) -> MessageError {
    MessageError::Malformed(FrameError::Malformed { reason })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FrameBuffer;

    /// A message of the tests' own.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Note {
        reason: String,
    }

    /// Every message `bytes` holds, through a frame buffer and `assembler`.
    fn receive(bytes: &[u8], assembler: &mut Assembler) -> Vec<Result<Note, MessageError>> {
        let mut frames = FrameBuffer::new();
        frames.push(bytes);
        let mut out = Vec::new();
        while let Ok(frame) = frames.pop() {
            match assembler.take(frame) {
                Ok(Some(note)) => out.push(Ok(note)),
                Ok(None) => {}
                Err(e) => out.push(Err(e)),
            }
        }
        out
    }

    #[test]
    fn a_message_that_fits_is_one_frame() {
        let note = Note {
            reason: "busy".into(),
        };
        let bytes = encode(&note).unwrap();
        assert_eq!(bytes, Frame::encode(&note));
        assert_eq!(
            receive(&bytes, &mut Assembler::new(MAX_FRAME_LEN)),
            [Ok(note)]
        );
    }

    #[test]
    fn a_larger_message_goes_in_pieces_and_the_receiver_bounds_it() {
        // Quotes and backslashes double when a piece escapes them; a multi-byte character
        // must not be cut.
        let big = Note {
            reason: "\"\\é".repeat(100_000),
        };
        let next = Note {
            reason: "next".into(),
        };
        let mut bytes = encode(&big).unwrap();
        assert!(bytes.len() > 2 * MAX_FRAME_LEN);
        bytes.extend(encode(&next).unwrap());
        let mut wide = Assembler::new(MAX_MESSAGE_LEN);
        let got = receive(&bytes, &mut wide);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap(), &big);
        assert_eq!(got[1].as_ref().unwrap(), &next);
        assert!(!wide.is_assembling());

        // A receiver of single frames refuses the run once, then takes the next message.
        let got = receive(&bytes, &mut Assembler::new(MAX_FRAME_LEN));
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            matches!(
                got[0],
                Err(MessageError::TooLarge {
                    limit: MAX_FRAME_LEN,
                    ..
                })
            ),
            "{got:?}"
        );
        assert_eq!(got[1].as_ref().unwrap(), &next);
    }

    #[test]
    fn a_message_in_the_middle_of_pieces_and_a_message_too_large_to_send_are_errors() {
        let big = encode(&Note {
            reason: "x".repeat(3 * PIECE_LEN),
        })
        .unwrap();
        let mut frames = FrameBuffer::new();
        frames.push(&big);
        let mut assembler = Assembler::new(MAX_MESSAGE_LEN);
        assert_eq!(
            assembler.take::<Note>(frames.pop().unwrap()),
            Ok(None),
            "the first piece"
        );
        let intruder = Frame {
            payload: serde_json::to_vec(&Note { reason: "x".into() }).unwrap(),
        };
        assert!(matches!(
            assembler.take::<Note>(intruder),
            Err(MessageError::Malformed(_))
        ));
        assert!(!assembler.is_assembling());

        let huge = Note {
            reason: "x".repeat(MAX_MESSAGE_LEN),
        };
        assert!(matches!(encode(&huge), Err(MessageError::TooLarge { .. })));
    }
}
