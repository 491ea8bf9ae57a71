//! The connection as one state machine: where a connection's worker stands, and the one
//! [`transition`] function that says which moves are allowed.
//!
//! A connection starts `Connecting` (the first connect, or the accept of the peer's HELLO)
//! and is `Up` once a QP carries its traffic. From `Up`:
//! - the agent's quiesce makes it `Quiescing` (PAUSE, PAUSE_ACK, disconnect), which ends
//!   `Held`: no device, every message kept, waiting for the resume;
//! - a lost link (the peer moved, its QP broke, the device vanished) makes it
//!   `AwaitingPeer`: the active side reconnects, the passive side waits for the peer's RESUME;
//! - the application's close on a live link makes it `Closing` (drain, CLOSE, disconnect).
//!
//! A `hot` quiesce (the device moves with the VM) also goes through `Quiescing` (PAUSE with
//! the hot flag, PAUSE_ACK) but ends `Paused`: the link stays and nothing is posted on it.
//! The resume confirms it (a probe on the same QP, then CONTINUE) and makes it `Up`; a link
//! lost while paused (the QP did not survive the move) makes it `AwaitingPeer`, the
//! reconnect with replay. A resume that overtakes a `hot` quiesce confirms it the same way
//! (`Quiescing` to `Up`).
//!
//! A resume makes a connection that holds no link `Resuming` (reconnecting until
//! `peer_wait`); a new link makes `AwaitingPeer` or `Resuming` `Up` again, and so does a
//! peer's reconnect accepted while a quiesce was breaking off (`Held` to `Up`: the RESUME
//! arrived on the old link's heels; only a `Held` connection's own check refuses RESUMEs).
//! A hold that outlives `peer_wait` without a resume becomes `AwaitingPeer` (the forced
//! path). A quiesce of a connection without a link holds it at once.
//!
//! `Closed` and `Failed` are final; every other state may fail. A connection that holds no
//! link closes at once; one with a link closes through `Closing`, or directly when the peer
//! closed (its CLOSE arrived, then the link went).
//!
//! Bridging is not a state: carrying messages over the TCP bridge is how a connection goes
//! on while its RDMA path is down (`Quiescing`, `Held`, `AwaitingPeer`, `Resuming`) or its
//! peer paused, whatever the state, until the next link is installed.
//!
//! A state is what the agent sees of it through [`Phase::visible`]: `Closing` shows the
//! state it closes from (the agent sees no closing state).

use std::fmt;

use rdmamig_proto::agent::ConnectionState;
use thiserror::Error;

/// Where a connection's worker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Phase {
    /// The first connect (active side) or accept (passive side) is in progress.
    Connecting,
    /// A QP carries the connection's traffic.
    Up,
    /// The agent's quiesce on a live link: PAUSE sent, waiting for PAUSE_ACK and the
    /// disconnect.
    Quiescing,
    /// Quiesced: holds no device and does not reconnect before a resume (or `peer_wait`).
    Held,
    /// Paused by a `hot` quiesce: the link stays, nothing is posted on it until the resume
    /// confirms it (or `peer_wait` passes).
    Paused,
    /// The link was lost: waiting for the peer (the active side reconnects) until
    /// `peer_wait`.
    AwaitingPeer,
    /// Resumed without a link: reconnecting (or waiting for the peer's RESUME) until
    /// `peer_wait`.
    Resuming,
    /// The application's close on a live link: draining the outbox, CLOSE, disconnect.
    Closing,
    /// Closed (by the application or the peer); the worker has ended.
    Closed,
    /// Failed for good; the worker has ended.
    Failed,
}

impl Phase {
    /// Every state (for the tests that walk them all).
    #[cfg(test)]
    pub(crate) const ALL: [Phase; 10] = [
        Phase::Connecting,
        Phase::Up,
        Phase::Quiescing,
        Phase::Held,
        Phase::Paused,
        Phase::AwaitingPeer,
        Phase::Resuming,
        Phase::Closing,
        Phase::Closed,
        Phase::Failed,
    ];

    /// The state's name, as logs and errors write it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::Connecting => "connecting",
            Phase::Up => "up",
            Phase::Quiescing => "quiescing",
            Phase::Held => "held",
            Phase::Paused => "paused",
            Phase::AwaitingPeer => "awaiting_peer",
            Phase::Resuming => "resuming",
            Phase::Closing => "closing",
            Phase::Closed => "closed",
            Phase::Failed => "failed",
        }
    }

    /// Whether no move leads out of this state (the worker ends in it).
    pub(crate) fn is_final(self) -> bool {
        matches!(self, Phase::Closed | Phase::Failed)
    }

    /// What the agent and the application see of this state; `None` for `Closing`, which
    /// leaves the state it closes from in view.
    pub(crate) fn visible(self) -> Option<ConnectionState> {
        match self {
            Phase::Connecting => Some(ConnectionState::Connecting),
            Phase::Up => Some(ConnectionState::Established),
            Phase::Quiescing => Some(ConnectionState::Pausing),
            Phase::Held => Some(ConnectionState::Quiesced),
            Phase::Paused => Some(ConnectionState::Paused),
            Phase::AwaitingPeer => Some(ConnectionState::AwaitingPeer),
            Phase::Resuming => Some(ConnectionState::Resuming),
            Phase::Closing => None,
            Phase::Closed => Some(ConnectionState::Closed),
            Phase::Failed => Some(ConnectionState::Failed),
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// A move the machine does not allow.
#[derive(Debug, Clone, Copy, Error, PartialEq, Eq)]
#[error("invalid connection state transition from {from} to {to}")]
pub(crate) struct InvalidTransition {
    /// The state the connection is in.
    pub(crate) from: Phase,
    /// The state asked for.
    pub(crate) to: Phase,
}

/// The one transition function (see the module docs for the machine).
pub(crate) fn transition(from: Phase, to: Phase) -> Result<Phase, InvalidTransition> {
    use Phase::*;
    let allowed = match (from, to) {
        (Closed | Failed, _) => false,
        (_, Failed) => true,
        (Connecting, Up) => true,
        (Up, Quiescing | AwaitingPeer | Closing | Closed) => true,
        (Quiescing, Held | Paused | Up | Closing | Closed) => true,
        (Paused, Up | AwaitingPeer | Closing | Closed) => true,
        (Held, Up | AwaitingPeer | Resuming | Closed) => true,
        (AwaitingPeer, Up | Held | Resuming | Closed) => true,
        (Resuming, Up | Held | Closed) => true,
        (Closing, Closed) => true,
        _ => false,
    };
    if allowed {
        Ok(to)
    } else {
        Err(InvalidTransition { from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Phase::*;

    #[test]
    fn every_pair_is_checked() {
        let allowed = [
            (Connecting, Up),
            (Connecting, Failed),
            (Up, Quiescing),
            (Up, AwaitingPeer),
            (Up, Closing),
            (Up, Closed),
            (Up, Failed),
            (Quiescing, Held),
            (Quiescing, Paused),
            (Quiescing, Up),
            (Quiescing, Closing),
            (Quiescing, Closed),
            (Quiescing, Failed),
            (Paused, Up),
            (Paused, AwaitingPeer),
            (Paused, Closing),
            (Paused, Closed),
            (Paused, Failed),
            (Held, Up),
            (Held, AwaitingPeer),
            (Held, Resuming),
            (Held, Closed),
            (Held, Failed),
            (AwaitingPeer, Up),
            (AwaitingPeer, Held),
            (AwaitingPeer, Resuming),
            (AwaitingPeer, Closed),
            (AwaitingPeer, Failed),
            (Resuming, Up),
            (Resuming, Held),
            (Resuming, Closed),
            (Resuming, Failed),
            (Closing, Closed),
            (Closing, Failed),
        ];
        let mut checked = 0;
        for from in Phase::ALL {
            for to in Phase::ALL {
                checked += 1;
                let result = transition(from, to);
                if allowed.contains(&(from, to)) {
                    assert_eq!(result, Ok(to), "{from} -> {to}");
                } else {
                    assert_eq!(
                        result,
                        Err(InvalidTransition { from, to }),
                        "{from} -> {to}"
                    );
                }
            }
        }
        assert_eq!(checked, 100);
    }

    #[test]
    fn the_error_names_both_states() {
        assert_eq!(
            transition(Closed, Up).unwrap_err().to_string(),
            "invalid connection state transition from closed to up"
        );
        assert_eq!(
            transition(Held, Quiescing).unwrap_err().to_string(),
            "invalid connection state transition from held to quiescing"
        );
        assert!(transition(Failed, Failed).is_err());
        assert!(transition(Up, Up).is_err());
    }

    #[test]
    fn final_states_are_final_for_the_agent_too() {
        for phase in Phase::ALL {
            assert_eq!(
                phase.is_final(),
                matches!(phase, Closed | Failed),
                "{phase}"
            );
            // Only the final states are final in the agent's view too.
            assert_eq!(
                phase.visible().is_some_and(|v| matches!(
                    v,
                    ConnectionState::Closed | ConnectionState::Failed
                )),
                phase.is_final(),
                "{phase}"
            );
        }
        assert_eq!(Closing.visible(), None);
    }
}
