//! What can happen to a connection's link, and why a connection fails for good.
//!
//! A link event (the peer's QP went into error, the device vanished, the peer disconnected)
//! is not an application error: the connection releases the link and waits, bounded by
//! `peer_wait`, for the peer to come back. Only when that wait expires, or the peer refuses
//! the resume, does the application see a [`Failure`], and it names the deadline and the
//! last link event, so that "the peer VM died" reads differently from "the device was
//! pulled" or "the peer refused our token".

use std::time::Duration;

use thiserror::Error;

use crate::wire::RejectReason;

/// Something that broke the current link (the connection itself may recover).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LinkEvent {
    /// A work completion failed: the QP is in error. Retry-exceeded and the remote-error
    /// statuses mean the peer's QP is gone or in error (ECONNRESET-like).
    #[error("the QP is in error: {status} completion ({which})")]
    QpError {
        /// ibv_wc_status_str of the completion.
        status: String,
        /// "send" or "receive".
        which: &'static str,
    },
    /// RDMA_CM_EVENT_DEVICE_REMOVAL: the device went away under the connection.
    #[error("the RDMA device was removed")]
    DeviceRemoved,
    /// RDMA_CM_EVENT_DISCONNECTED without a PAUSE or CLOSE before it.
    #[error("the peer disconnected without a pause")]
    PeerDisconnected,
    /// The peer sent something the protocol does not allow.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A local verbs call on the data path failed.
    #[error("{0}")]
    Local(String),
    /// A bounded wait of the quiesce or the close passed.
    #[error("the {deadline} deadline passed waiting for {what}")]
    Deadline {
        /// Which deadline.
        deadline: &'static str,
        /// What had not happened.
        what: &'static str,
    },
}

/// Why a connection failed for good (every pending and later operation reports it).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Failure {
    /// The peer did not come back within `peer_wait` (ETIMEDOUT-like).
    #[error("the peer did not come back within peer_wait ({after:?}); {}", describe_last(.cause, .last_attempt))]
    PeerWaitExpired {
        /// The configured bound.
        after: Duration,
        /// The link event that started the wait (none: a quiesce without resume).
        cause: Option<LinkEvent>,
        /// The last reconnect attempt's error, if any was made.
        last_attempt: Option<String>,
    },
    /// The peer refused a RESUME for good (unknown connection, bad token, gone).
    #[error("the peer refused to resume the connection: {0:?}")]
    ResumeRefused(RejectReason),
    /// The first connect or accept did not complete.
    #[error("setting up the connection failed: {0}")]
    Setup(String),
    /// The connection's worker asked for a state change its state machine does not allow (a
    /// bug in the library): the connection fails rather than go on in a state it cannot be
    /// in.
    #[error("the connection's worker made an invalid move from {from} to {to}")]
    InvalidTransition {
        /// The state it was in.
        from: &'static str,
        /// The state it asked for.
        to: &'static str,
    },
}

fn describe_last(cause: &Option<LinkEvent>, last_attempt: &Option<String>) -> String {
    let mut s = match cause {
        Some(c) => format!("the link broke because {c}"),
        None => "it was quiesced and never resumed".to_string(),
    };
    if let Some(a) = last_attempt {
        s.push_str(&format!("; last reconnect attempt: {a}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_wait_expiry_names_the_deadline_and_the_cause() {
        let f = Failure::PeerWaitExpired {
            after: Duration::from_secs(5),
            cause: Some(LinkEvent::QpError {
                status: "transport retry counter exceeded".into(),
                which: "send",
            }),
            last_attempt: Some("no CM event within 1s".into()),
        };
        let s = f.to_string();
        assert!(s.contains("peer_wait (5s)"), "{s}");
        assert!(s.contains("QP is in error"), "{s}");
        assert!(s.contains("transport retry counter exceeded"), "{s}");
        assert!(s.contains("last reconnect attempt: no CM event"), "{s}");
        let q = Failure::PeerWaitExpired {
            after: Duration::from_secs(1),
            cause: None,
            last_attempt: None,
        };
        assert!(q.to_string().contains("quiesced and never resumed"));
    }

    #[test]
    fn refusal_names_the_reason() {
        let s = Failure::ResumeRefused(RejectReason::BadToken).to_string();
        assert!(s.contains("BadToken"), "{s}");
        assert!(LinkEvent::DeviceRemoved.to_string().contains("removed"));
    }
}
