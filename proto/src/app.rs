//! Guest agent <-> application (connection library) messages, over the agent's UNIX
//! socket inside the guest.
//!
//! Each process using the library opens one socket to the agent and says [`AppToAgent::Hello`].
//! The agent then drives it with [`AgentToApp`] requests; the library answers each with one
//! [`AppToAgent::Reply`] about all of the process's connections.

use serde::{Deserialize, Serialize};

use crate::agent::{ConnectionInfo, ConnectionOutcome};
use crate::preload::{PeerAnswer, PeerRequest};

/// Default path of the agent's socket for applications.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/rdmamig/agent.sock";

/// From the library to the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum AppToAgent {
    /// First message on a new socket: who is registering.
    Hello {
        /// The process id.
        pid: u32,
        /// The program name, for the operator.
        program: String,
    },
    /// Answer to one [`AgentToApp`] request.
    Reply {
        /// The request's id.
        request: u64,
        /// What the request produced.
        body: AppReply,
    },
    /// Whether a move can carry this process now. A process that cannot (a preloaded
    /// program with a listening rdma_cm id, say) stays registered, so that its peers'
    /// requests still reach it, but counts as unmanaged: the move's policy (refuse, release,
    /// ignore) applies to it, as to a program without the library.
    Carried {
        /// `None`: it can be carried; otherwise why not.
        not_because: Option<String>,
    },
}

/// The body of an [`AppToAgent::Reply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AppReply {
    /// Answer to [`AgentToApp::Describe`].
    Connections {
        /// The process's connections.
        connections: Vec<ConnectionInfo>,
    },
    /// Answer to [`AgentToApp::Quiesce`] and [`AgentToApp::Resume`].
    Outcomes {
        /// One entry per connection of the process.
        outcomes: Vec<ConnectionOutcome>,
    },
    /// Answer to [`AgentToApp::Peer`].
    Peer {
        /// What the process did ([`PeerAnswer::NotMine`] from all but the QP's holder).
        answer: PeerAnswer,
    },
}

/// From the agent to the library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum AgentToApp {
    /// List the process's connections.
    Describe {
        /// Echoed in the reply.
        request: u64,
    },
    /// Quiesce every connection and release the device within the deadline.
    Quiesce {
        /// Echoed in the reply.
        request: u64,
        /// Time allowed, in milliseconds.
        deadline_ms: u64,
        /// Carry messages over the TCP bridges until the RDMA path is back (strategy
        /// `bridge`).
        #[serde(default)]
        bridge: bool,
        /// Pause at a sequence boundary and keep every QP (strategy `hot`).
        #[serde(default)]
        hot: bool,
    },
    /// Reconnect every quiesced connection on the current device within the deadline.
    Resume {
        /// Echoed in the reply.
        request: u64,
        /// Time allowed, in milliseconds.
        deadline_ms: u64,
    },
    /// A preloaded program's peer asks about one of its QPs ([`crate::preload`]); only
    /// preloaded processes hold such QPs, every other answers [`PeerAnswer::NotMine`].
    Peer {
        /// Echoed in the reply.
        request: u64,
        /// The requester's IP address, as the agent's TCP connection saw it.
        from: String,
        /// What it asks.
        message: PeerRequest,
    },
    /// The agent could not use what this socket sent (a bad frame or message); nothing was
    /// changed. After a frame error the byte stream cannot be trusted, and the agent closes
    /// the socket after this answer; after a bad message it keeps reading.
    Refused {
        /// What was wrong.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Frame, FrameBuffer};

    #[test]
    fn messages_round_trip() {
        let msgs = [
            AppToAgent::Hello {
                pid: 9,
                program: "traffic".into(),
            },
            AppToAgent::Reply {
                request: 4,
                body: AppReply::Outcomes {
                    outcomes: vec![ConnectionOutcome {
                        id: 1,
                        ok: false,
                        elapsed_ms: 3,
                        error: Some("peer did not acknowledge PAUSE".into()),
                        fell_back: None,
                    }],
                },
            },
            AppToAgent::Carried {
                not_because: Some("an rdma_cm id listens on one address".into()),
            },
            AppToAgent::Carried { not_because: None },
        ];
        for m in msgs {
            let mut fb = FrameBuffer::new();
            fb.push(&Frame::encode(&m));
            assert_eq!(fb.pop().unwrap().decode::<AppToAgent>().unwrap(), m);
        }
    }

    #[test]
    fn refusals_round_trip() {
        let m = AgentToApp::Refused {
            reason: "frame of 4294967295 bytes exceeds the limit of 65536".into(),
        };
        let mut fb = FrameBuffer::new();
        fb.push(&Frame::encode(&m));
        assert_eq!(fb.pop().unwrap().decode::<AgentToApp>().unwrap(), m);
    }
}
