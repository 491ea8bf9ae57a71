//! The daemon's API: what `rdmamig migrate` and the daemon say to each other.
//!
//! One connection carries one request. For a move the client sends
//! [`ClientRequest::Migrate`]; the daemon answers with a stream of [`DaemonMessage::Event`]s
//! and ends with exactly one [`DaemonMessage::Report`] or [`DaemonMessage::Rejected`]. The
//! other requests get exactly one answer. Every message travels in rdmamig-proto's frames
//! through a [`Channel`], so that answers which grow with the host (a long history, a large
//! pool, the report of a move with thousands of connections) are streamed, never cut. A
//! receiver bounds what it assembles: the daemon takes requests of one frame, a client
//! takes answers up to [`MAX_ANSWER_LEN`].

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::channel::{Channel, MAX_MESSAGE_LEN};
use crate::machine::Phase;
use crate::plan::MovePlan;
use crate::pool::FunctionStatus;
use crate::report::{MoveEvent, MoveReport};

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
    /// Record that a VM started outside any move holds a free function (the orchestrator
    /// that created the VM gave it that VF), so that no move hands it out, and a move of
    /// that VM gives it back.
    PoolAssign {
        /// The function's name.
        function: String,
        /// The VM.
        vm: String,
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
    /// The answer to [`ClientRequest::PoolAssign`]: the function is attached to the VM.
    Assigned {
        /// The function.
        function: String,
        /// The VM.
        vm: String,
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

/// The largest answer a client assembles from pieces.
pub const MAX_ANSWER_LEN: usize = MAX_MESSAGE_LEN;

/// A client's channel to the daemon: it receives answers of up to [`MAX_ANSWER_LEN`] (the
/// daemon's own end takes requests of one frame).
pub fn to_daemon<S: AsyncRead + AsyncWrite + Unpin>(stream: S) -> Channel<S> {
    Channel::with_receive_limit(stream, MAX_ANSWER_LEN)
}
