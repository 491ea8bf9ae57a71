//! [`ConnError`]: what the applications' calls on a connection or a listener report. A leaf
//! beside the modules that return it, so that none of them imports the crate root for it.

use std::net::SocketAddr;
use std::time::Duration;

use rdmamig_proto::agent::ConnectionState;
use rdmamig_proto::text::error_chain;
use rdmamig_proto::ConnectionId;
use rdmamig_verbs::VerbsError;
use thiserror::Error;

use crate::bridge::BridgeError;
use crate::control::ControlError;
use crate::failure::Failure;
use crate::wire::RejectReason;

/// Errors of the migratable connection.
#[derive(Debug, Error)]
pub enum ConnError {
    /// The peer closed the connection (and everything it sent has been received).
    #[error("connection {id:016x} was closed by the peer")]
    PeerClosed {
        /// The connection.
        id: ConnectionId,
    },
    /// The connection failed for good; every pending and later operation reports this.
    #[error("connection {id:016x} failed")]
    Failed {
        /// The connection.
        id: ConnectionId,
        /// What happened.
        #[source]
        cause: Failure,
    },
    /// A quiesce, resume or close did not complete.
    #[error("{op} of connection {id:016x} failed: {reason}")]
    Control {
        /// The connection.
        id: ConnectionId,
        /// quiesce, resume or close.
        op: &'static str,
        /// Why (names the deadline when one passed). In the message, not a `source`: the
        /// message has always said why, and error chains would say it twice.
        reason: ControlError,
    },
    /// The TCP bridge could not be set up (listening on, or connecting to, `addr`).
    #[error("the bridge at {addr} could not be set up: {}", error_chain(.reason))]
    Bridge {
        /// The bridge address.
        addr: SocketAddr,
        /// Why, with its causes (in the message, as it always was).
        reason: BridgeError,
    },
    /// Connecting did not succeed before the connect deadline.
    #[error("connecting to {peer} timed out after {after:?} (last error: {last})")]
    ConnectTimedOut {
        /// The peer.
        peer: SocketAddr,
        /// The deadline.
        after: Duration,
        /// The last attempt's error.
        last: String,
    },
    /// The peer refused the connection.
    #[error("{peer} rejected the connection: {reason:?}")]
    Rejected {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        reason: RejectReason,
    },
    /// `send` found the outbox full until its deadline.
    #[error(
        "send on connection {id:016x} timed out after {after:?}: {queued} messages unacknowledged"
    )]
    SendTimedOut {
        /// The connection.
        id: ConnectionId,
        /// The deadline.
        after: Duration,
        /// Messages waiting.
        queued: usize,
    },
    /// The message is larger than `max_message`.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    MessageTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `accept` found no connection before its deadline.
    #[error("no connection arrived at {addr} within {after:?}")]
    AcceptTimedOut {
        /// The listener's address.
        addr: SocketAddr,
        /// The deadline.
        after: Duration,
    },
    /// The listener failed or was shut down.
    #[error("listener on {addr} failed: {reason}")]
    ListenerFailed {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// A verbs or rdma_cm call failed while setting up.
    #[error("{op} failed")]
    Verbs {
        /// What was being done.
        op: &'static str,
        /// The cause.
        #[source]
        source: VerbsError,
    },
    /// An async operation was called outside a tokio runtime: the connection's worker runs
    /// as a task on the caller's runtime.
    #[error("{op} needs a tokio runtime to run the connection on")]
    NoRuntime {
        /// The operation.
        op: &'static str,
        /// What tokio said.
        #[source]
        source: tokio::runtime::TryCurrentError,
    },
    /// A thread, a runtime or a descriptor watch could not be created.
    #[error("could not start the connection's {what}")]
    Spawn {
        /// What.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The peer has not exposed a buffer under this handle (within the wait).
    #[error(
        "connection {id:016x}: the peer exposed no buffer with handle {handle} (waited {after:?})"
    )]
    UnknownHandle {
        /// The connection.
        id: ConnectionId,
        /// The handle.
        handle: u64,
        /// How long it waited for the peer's map.
        after: Duration,
    },
    /// A range outside the buffer.
    #[error("{len} bytes at offset {offset} are outside buffer {handle} of {size} bytes")]
    OutOfBounds {
        /// The buffer's handle.
        handle: u64,
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: usize,
        /// The buffer's size.
        size: u64,
    },
    /// The peer did not expose the buffer for this operation.
    #[error("buffer {handle} does not allow RDMA {op}")]
    NotPermitted {
        /// The buffer's handle.
        handle: u64,
        /// write or read.
        op: &'static str,
    },
    /// This side already exposed a buffer under the handle.
    #[error("a buffer with handle {handle} is already exposed")]
    HandleInUse {
        /// The handle.
        handle: u64,
    },
    /// This side already exposes as many buffers as a connection may.
    #[error("a connection exposes at most {limit} buffers")]
    TooManyExposed {
        /// The limit.
        limit: usize,
    },
    /// One-sided operations did not complete before the deadline.
    #[error("{op} on connection {id:016x} timed out after {after:?}: {pending} one-sided operations pending")]
    OneSidedTimedOut {
        /// The connection.
        id: ConnectionId,
        /// write (no room in the queue within send_timeout), read or flush_writes.
        op: &'static str,
        /// The deadline.
        after: Duration,
        /// Operations still queued.
        pending: usize,
    },
    /// The operation is not valid in the connection's state.
    #[error("connection {id:016x}: cannot {op} while {state:?}")]
    InvalidState {
        /// The connection.
        id: ConnectionId,
        /// The operation.
        op: &'static str,
        /// The state.
        state: ConnectionState,
    },
}
