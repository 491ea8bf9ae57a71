//! [`ControlError`]: why a quiesce, resume or close of a connection (or a listener's quiesce or
//! resume) did not complete. The worker answers a request with it, the registry reports it to
//! the agent as its text, and `ConnError::Control` carries it to
//! an application that quiesced, resumed or closed a connection itself. A leaf: it names only
//! the connection's failure types.

use std::net::SocketAddr;

use rdmamig_proto::agent::ConnectionState;
use rdmamig_proto::text::error_chain;
use rdmamig_verbs::VerbsError;
use thiserror::Error;

use crate::failure::{Failure, LinkEvent};

/// Why a quiesce, resume or close request did not complete.
#[derive(Debug, Error)]
pub enum ControlError {
    /// A quiesce arrived while a resume was still reconnecting; the resume is given up.
    #[error("a quiesce arrived before the resume completed")]
    QuiesceBeforeResume,
    /// A resume arrived while this side's quiesce was still pausing the link.
    #[error("cannot resume while a quiesce is in progress")]
    QuiesceInProgress,
    /// A later resume took this one's place.
    #[error("superseded by a newer resume")]
    Superseded,
    /// The connection's state machine does not allow the request's move (the connection
    /// failed instead).
    #[error("cannot {op} the connection while it is {state}")]
    InvalidState {
        /// quiesce or resume.
        op: &'static str,
        /// The worker's state.
        state: &'static str,
    },
    /// The link broke before the quiesce's handshake completed (everything was released all
    /// the same).
    #[error("the link broke during the quiesce ({why}); resources released")]
    LinkBroke {
        /// What broke it.
        why: LinkEvent,
    },
    /// The quiesce's deadline passed (everything was released all the same).
    #[error("quiesce timed out waiting for {what}; resources released anyway")]
    QuiesceTimedOut {
        /// What had not happened.
        what: &'static str,
    },
    /// The resume's deadline passed before a new link was up.
    #[error(
        "resume timed out (last error: {})",
        last_error.as_deref().unwrap_or("none; the peer did not reconnect")
    )]
    ResumeTimedOut {
        /// The last reconnect attempt's error, if one failed.
        last_error: Option<String>,
    },
    /// The close's deadline passed (everything was released all the same).
    #[error("close timed out; resources released")]
    CloseTimedOut,
    /// The connection failed for good while the request waited.
    #[error("{0}")]
    Failed(Failure),
    /// The worker took the request but did not answer by the deadline.
    #[error(
        "the connection did not answer in time (it was {state:?}{})",
        busy.map(|b| format!(", its worker busy {b}")).unwrap_or_default()
    )]
    NoAnswer {
        /// The connection's state when the wait ended.
        state: ConnectionState,
        /// What its worker was doing then, if it was blocked in something long.
        busy: Option<&'static str>,
    },
    /// The worker had ended (in `state`) before it took the request.
    #[error("connection worker has stopped ({state:?})")]
    WorkerStopped {
        /// The connection's state.
        state: ConnectionState,
    },
    /// The listener's thread had ended before it took the request.
    #[error("the listener thread has stopped")]
    ListenerStopped,
    /// The listener's thread did not answer by the deadline.
    #[error("the listener did not answer in time")]
    ListenerNoAnswer,
    /// The listener could not listen again on its address before the resume's deadline.
    #[error("re-listening on {addr} failed until the deadline: {}", error_chain(.error))]
    Relisten {
        /// The listener's address.
        addr: SocketAddr,
        /// The last rdma_listen attempt's error (its chain is in the message).
        error: VerbsError,
    },
    /// The thread that ran the request for the agent panicked.
    #[error("panicked")]
    Panicked,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_texts_are_the_ones_the_agent_reports() {
        assert_eq!(
            ControlError::ResumeTimedOut { last_error: None }.to_string(),
            "resume timed out (last error: none; the peer did not reconnect)"
        );
        assert_eq!(
            ControlError::ResumeTimedOut {
                last_error: Some("rejected by the peer: Busy".into())
            }
            .to_string(),
            "resume timed out (last error: rejected by the peer: Busy)"
        );
        assert_eq!(
            ControlError::QuiesceTimedOut {
                what: "the peer's PAUSE_ACK"
            }
            .to_string(),
            "quiesce timed out waiting for the peer's PAUSE_ACK; resources released anyway"
        );
        assert_eq!(
            ControlError::WorkerStopped {
                state: ConnectionState::Failed
            }
            .to_string(),
            "connection worker has stopped (Failed)"
        );
        assert_eq!(
            ControlError::LinkBroke {
                why: LinkEvent::DeviceRemoved
            }
            .to_string(),
            "the link broke during the quiesce (the RDMA device was removed); resources released"
        );
        assert_eq!(
            ControlError::NoAnswer {
                state: ConnectionState::Established,
                busy: Some("releasing the link"),
            }
            .to_string(),
            "the connection did not answer in time (it was Established, its worker busy releasing the link)"
        );
        assert_eq!(
            ControlError::NoAnswer {
                state: ConnectionState::Closed,
                busy: None,
            }
            .to_string(),
            "the connection did not answer in time (it was Closed)"
        );
    }
}
