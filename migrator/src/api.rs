//! The daemon's API: what `rdmamig migrate` and the daemon say to each other.
//!
//! One connection carries one request. For a move the client sends
//! [`ClientRequest::Migrate`]; the daemon answers with a stream of [`DaemonMessage::Event`]s
//! and ends with exactly one [`DaemonMessage::Report`] or [`DaemonMessage::Rejected`]. The
//! other requests get exactly one answer. Every message is one frame of
//! rdmamig-proto's framing (magic, version, length, JSON; 64 KiB at most).

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
    /// A message to send is larger than a frame.
    #[error("a message of {len} bytes does not fit in a frame ({MAX_FRAME_LEN} bytes)")]
    TooLarge {
        /// Its encoded size.
        len: usize,
    },
}

/// A framed message stream over any byte stream.
pub struct Channel<S> {
    stream: S,
    buffer: FrameBuffer,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Channel<S> {
    /// Wraps a connected stream.
    pub fn new(stream: S) -> Channel<S> {
        Channel {
            stream,
            buffer: FrameBuffer::new(),
        }
    }

    /// Sends one message; refuses one that does not fit in a frame instead of panicking.
    pub async fn send<T: Serialize>(&mut self, message: &T) -> Result<(), ApiError> {
        let len = serde_json::to_vec(message)
            .map(|payload| payload.len())
            .unwrap_or(usize::MAX);
        if len > MAX_FRAME_LEN {
            return Err(ApiError::TooLarge { len });
        }
        self.stream
            .write_all(&Frame::encode(message))
            .await
            .map_err(ApiError::Send)
    }

    /// Receives one message. `Ok(None)` when the peer closed cleanly between messages.
    pub async fn receive<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ApiError> {
        let mut chunk = [0u8; 8192];
        loop {
            match self.buffer.pop() {
                Ok(frame) => return frame.decode().map(Some).map_err(ApiError::Malformed),
                Err(FrameError::Incomplete { .. }) => {}
                Err(e) => return Err(ApiError::Malformed(e)),
            }
            let n = self
                .stream
                .read(&mut chunk)
                .await
                .map_err(ApiError::Receive)?;
            if n == 0 {
                return if self.buffer.is_empty() {
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
            reason: "x".repeat(MAX_FRAME_LEN),
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
