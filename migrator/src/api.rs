//! The daemon's API: what `rdmamig migrate` and the daemon say to each other.
//!
//! One connection carries one request. For a move the client sends
//! [`ClientRequest::Migrate`]; the daemon answers with a stream of [`DaemonMessage::Event`]s
//! and ends with exactly one [`DaemonMessage::Report`] or [`DaemonMessage::Rejected`]. The
//! other requests get exactly one answer. Every message travels in rdmamig-proto's frames
//! (magic, version, length, JSON; 64 KiB at most): one frame when it fits, otherwise a run
//! of [`Piece`] frames, so that answers which grow with the host (a long history, a large
//! pool, the report of a move with thousands of connections) are streamed, never cut. A
//! receiver bounds what it assembles: the daemon takes requests of one frame, a client
//! takes answers up to [`MAX_ANSWER_LEN`].

use rdmamig_proto::{Frame, FrameBuffer, FrameError, MAX_FRAME_LEN};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::machine::Phase;
use crate::mover::{MoveEvent, MoveReport};
use crate::plan::MovePlan;
use crate::pool::FunctionStatus;

/// What a client asks the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum ClientRequest {
    /// Run this move and stream its progress.
    Migrate {
        /// The move.
        plan: Box<MovePlan>,
    },
    /// The moves running now.
    Status,
    /// The moves that ended, newest first.
    History {
        /// At most this many.
        limit: usize,
    },
    /// The report of one move.
    Report {
        /// The move's id.
        id: String,
    },
    /// The pool's functions and their states.
    Pool,
    /// Put a quarantined function back into the pool (after it passes its reset).
    PoolReturn {
        /// The function's name.
        function: String,
    },
}

/// A running move, as `rdmamig status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningMove {
    /// The move's id.
    pub id: String,
    /// The VM.
    pub vm: String,
    /// The phase it is in.
    pub phase: Phase,
    /// When it started, ms since the epoch.
    pub started_unix_ms: u64,
    /// Whether a restarted daemon is finishing it from its journal.
    pub recovering: bool,
    /// The control sockets of the VMMs it drives on this host.
    #[serde(default)]
    pub vmms: Vec<String>,
}

/// A VM the daemon will not move: its unfinished move's journal cannot be read, so nobody
/// knows how far that move got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldVm {
    /// The VM.
    pub vm: String,
    /// The damaged journal.
    pub journal: String,
    /// What is wrong with it.
    pub reason: String,
}

/// An ended move, as `rdmamig history` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveSummary {
    /// The move's id.
    pub id: String,
    /// The VM.
    pub vm: String,
    /// `done`, `rolled_back` or `failed`.
    pub outcome: Phase,
    /// When it started, ms since the epoch.
    pub started_unix_ms: u64,
    /// How long it took, ms.
    pub total_ms: u64,
    /// The error, if it failed.
    pub error: Option<String>,
    /// Unmanaged programs the move ended or broke.
    #[serde(default)]
    pub casualties: usize,
}

/// What the daemon sends back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "message", rename_all = "snake_case")]
pub enum DaemonMessage {
    /// Progress of the running move.
    Event {
        /// The event.
        event: MoveEvent,
    },
    /// The move ended (successfully or not); nothing follows.
    Report {
        /// The report.
        report: Box<MoveReport>,
    },
    /// The answer to [`ClientRequest::Status`].
    Status {
        /// The running moves.
        moves: Vec<RunningMove>,
        /// How many moves may run at once.
        limit: usize,
        /// VMs held because their unfinished move's journal is damaged.
        #[serde(default)]
        held: Vec<HeldVm>,
    },
    /// The answer to [`ClientRequest::History`].
    History {
        /// The ended moves, newest first.
        moves: Vec<MoveSummary>,
    },
    /// The answer to [`ClientRequest::Pool`].
    Pool {
        /// Every function with its state.
        functions: Vec<FunctionStatus>,
    },
    /// The answer to [`ClientRequest::PoolReturn`]: the function is free again.
    Returned {
        /// The function.
        function: String,
        /// What its check did (e.g. `0000:3b:00.2 reset`).
        check: String,
    },
    /// The request was not run; nothing follows.
    Rejected {
        /// Why.
        reason: String,
    },
}

/// Why a message could not be sent or received.
#[derive(Debug, Error)]
pub enum ApiError {
    /// Writing failed.
    #[error("cannot send a message")]
    Send(#[source] std::io::Error),
    /// Reading failed.
    #[error("cannot receive a message")]
    Receive(#[source] std::io::Error),
    /// The peer closed the connection before a whole message arrived.
    #[error("the peer closed the connection")]
    Closed,
    /// The bytes are not a message.
    #[error("malformed message")]
    Malformed(#[source] FrameError),
    /// A message is larger than the receiver takes.
    #[error("a message of {len} bytes or more is larger than the limit of {limit} bytes")]
    TooLarge {
        /// Its encoded size (so far, for one being received).
        len: usize,
        /// The limit.
        limit: usize,
    },
}

/// The largest answer a client assembles from pieces.
pub const MAX_ANSWER_LEN: usize = 16 * 1024 * 1024;

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

/// A framed message stream over any byte stream.
pub struct Channel<S> {
    stream: S,
    buffer: FrameBuffer,
    /// The largest message [`Channel::receive`] assembles.
    receive_limit: usize,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Channel<S> {
    /// Wraps a connected stream; it receives messages of one frame at most.
    pub fn new(stream: S) -> Channel<S> {
        Channel {
            stream,
            buffer: FrameBuffer::new(),
            receive_limit: MAX_FRAME_LEN,
        }
    }

    /// Wraps a client's stream to the daemon, which receives answers of up to
    /// [`MAX_ANSWER_LEN`].
    pub fn to_daemon(stream: S) -> Channel<S> {
        Channel {
            receive_limit: MAX_ANSWER_LEN,
            ..Channel::new(stream)
        }
    }

    /// Sends one message: in one frame if it fits, in pieces otherwise, up to
    /// [`MAX_ANSWER_LEN`].
    pub async fn send<T: Serialize>(&mut self, message: &T) -> Result<(), ApiError> {
        let text = serde_json::to_string(message).map_err(|e| {
            ApiError::Send(std::io::Error::other(format!(
                "cannot encode a message: {e}"
            )))
        })?;
        if text.len() > MAX_ANSWER_LEN {
            return Err(ApiError::TooLarge {
                len: text.len(),
                limit: MAX_ANSWER_LEN,
            });
        }
        let mut bytes = Vec::new();
        if text.len() <= MAX_FRAME_LEN {
            bytes = Frame::encode(message);
        } else {
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
        }
        self.stream.write_all(&bytes).await.map_err(ApiError::Send)
    }

    /// Receives one message. `Ok(None)` when the peer closed cleanly between messages.
    pub async fn receive<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ApiError> {
        let mut assembled: Option<String> = None;
        loop {
            let Some(frame) = self.next_frame(assembled.is_some()).await? else {
                return Ok(None);
            };
            let Ok(piece) = frame.decode::<Piece>() else {
                if assembled.is_some() {
                    return Err(ApiError::Malformed(FrameError::Malformed {
                        reason: "a message came in the middle of another's pieces".into(),
                    }));
                }
                return frame.decode().map(Some).map_err(ApiError::Malformed);
            };
            let text = assembled.get_or_insert_with(String::new);
            if text.len() + piece.piece.len() > self.receive_limit {
                return Err(ApiError::TooLarge {
                    len: text.len() + piece.piece.len(),
                    limit: self.receive_limit,
                });
            }
            text.push_str(&piece.piece);
            if piece.last {
                return serde_json::from_str(text).map(Some).map_err(|e| {
                    ApiError::Malformed(FrameError::Malformed {
                        reason: e.to_string(),
                    })
                });
            }
        }
    }

    /// The next whole frame; `None` when the peer closed cleanly between frames and
    /// `within` is false (no message was under way).
    async fn next_frame(&mut self, within: bool) -> Result<Option<Frame>, ApiError> {
        let mut chunk = [0u8; 8192];
        loop {
            match self.buffer.pop() {
                Ok(frame) => return Ok(Some(frame)),
                Err(FrameError::Incomplete { .. }) => {}
                Err(e) => return Err(ApiError::Malformed(e)),
            }
            let n = self
                .stream
                .read(&mut chunk)
                .await
                .map_err(ApiError::Receive)?;
            if n == 0 {
                return if self.buffer.is_empty() && !within {
                    Ok(None)
                } else {
                    Err(ApiError::Closed)
                };
            }
            self.buffer.push(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn messages_cross_a_stream_and_limits_hold() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (mut a, mut b) = (Channel::new(a), Channel::new(b));
        let message = DaemonMessage::Rejected {
            reason: "busy".into(),
        };
        a.send(&message).await.unwrap();
        assert_eq!(b.receive::<DaemonMessage>().await.unwrap(), Some(message));

        let huge = DaemonMessage::Rejected {
            reason: "x".repeat(MAX_ANSWER_LEN),
        };
        assert!(matches!(
            a.send(&huge).await,
            Err(ApiError::TooLarge { .. })
        ));

        a.send(&"not a daemon message").await.unwrap();
        assert!(matches!(
            b.receive::<DaemonMessage>().await,
            Err(ApiError::Malformed(FrameError::Malformed { .. }))
        ));
        drop(a);
        assert!(b.receive::<DaemonMessage>().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_message_larger_than_a_frame_goes_in_pieces_and_the_receiver_bounds_it() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (mut daemon, mut client) = (Channel::new(a), Channel::to_daemon(b));
        // Quotes and backslashes double when a piece escapes them; a multi-byte character
        // must not be cut.
        let reason: String = "\"\\é".repeat(100_000);
        let message = DaemonMessage::Rejected { reason };
        let writer = tokio::spawn(async move {
            daemon.send(&message).await.unwrap();
            daemon
                .send(&DaemonMessage::Rejected {
                    reason: "next".into(),
                })
                .await
                .unwrap();
            (daemon, message)
        });
        let received = client.receive::<DaemonMessage>().await.unwrap().unwrap();
        let next = client.receive::<DaemonMessage>().await.unwrap().unwrap();
        let (mut daemon, message) = writer.await.unwrap();
        assert_eq!(received, message);
        assert_eq!(
            next,
            DaemonMessage::Rejected {
                reason: "next".into()
            }
        );
        // The daemon's side takes requests of one frame only.
        client.send(&message).await.unwrap();
        assert!(matches!(
            daemon.receive::<DaemonMessage>().await,
            Err(ApiError::TooLarge {
                limit: MAX_FRAME_LEN,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn a_cut_message_is_an_error() {
        let (a, b) = tokio::io::duplex(1024);
        let mut b = Channel::new(b);
        let bytes = Frame::encode(&DaemonMessage::Rejected { reason: "x".into() });
        let mut a = a;
        a.write_all(&bytes[..bytes.len() - 1]).await.unwrap();
        drop(a);
        assert!(matches!(
            b.receive::<DaemonMessage>().await,
            Err(ApiError::Closed)
        ));
    }
}
