//! Host <-> guest agent messages.
//!
//! The host sends an [`AgentRequest`]; the agent answers each with exactly one
//! [`AgentResponse`] carrying the same `id`. The host must treat every answer as untrusted
//! input: it checks the id against its own request and never acts on a connection the
//! answer names unless it listed that connection itself.

use serde::{Deserialize, Serialize};

use crate::ConnectionId;

/// A request from the host migrator to the guest agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRequest {
    /// Chosen by the host; echoed in the response.
    pub id: u64,
    /// What to do.
    pub command: AgentCommand,
}

/// The operations the agent offers the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AgentCommand {
    /// Liveness and version check.
    Ping,
    /// Every migratable connection registered in the guest.
    ListConnections {
        /// Time the agent may take, in milliseconds. Processes that have not described
        /// their connections by half of it are listed as they last were. A host that sends
        /// none gets the agent's own bound, a few seconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
    },
    /// Every process that holds an RDMA device and is not a library user: the programs a
    /// move would break.
    ListUnmanaged,
    /// Quiesce every connection and release the RDMA device, within the deadline.
    Quiesce {
        /// Time the agent may take, in milliseconds.
        deadline_ms: u64,
        /// Strategy `bridge`: connections with a TCP bridge carry their messages over it
        /// until the RDMA path is back (the others quiesce as for `reconnect`).
        #[serde(default)]
        bridge: bool,
        /// Strategy `hot`: every connection stops posting at a sequence boundary and keeps
        /// its QP; nothing is released (the device moves with the VM).
        #[serde(default)]
        hot: bool,
    },
    /// Wait for the (new) RDMA device and reconnect every quiesced connection; a connection
    /// paused by a `hot` quiesce is confirmed on its own QP instead (a probe round trip),
    /// and reconnects only if that QP did not survive.
    Resume {
        /// Time the agent may take, in milliseconds.
        deadline_ms: u64,
    },
    /// Make every process that holds an RDMA device let go (policy `release`, before the
    /// unplug and again if it misses its deadline). Processes using the connection library
    /// are asked to quiesce again; any other is sent SIGTERM, then SIGKILL once `grace_ms`
    /// has passed.
    ReleaseDevice {
        /// Time a signalled process has between SIGTERM and SIGKILL, in milliseconds.
        grace_ms: u64,
        /// Time the agent may take, in milliseconds.
        deadline_ms: u64,
        /// Which holders.
        #[serde(default)]
        scope: ReleaseScope,
    },
}

/// What a quiesce does to each connection: the strategy's part in the guest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum QuiesceMode {
    /// PAUSE, PAUSE_ACK, disconnect and release the device (`reconnect`).
    #[default]
    Release,
    /// As `Release`, carrying the messages over the TCP bridge meanwhile (`bridge`).
    Bridge,
    /// PAUSE and PAUSE_ACK only: the QP, its CQ, MRs and PD stay (`hot`).
    Hot,
}

impl QuiesceMode {
    /// Every mode.
    pub const ALL: [QuiesceMode; 3] = [QuiesceMode::Release, QuiesceMode::Bridge, QuiesceMode::Hot];

    /// The mode the wire's two flags name (`hot` wins: it keeps everything).
    pub fn from_flags(bridge: bool, hot: bool) -> QuiesceMode {
        match (bridge, hot) {
            (_, true) => QuiesceMode::Hot,
            (true, false) => QuiesceMode::Bridge,
            (false, false) => QuiesceMode::Release,
        }
    }

    /// The wire's flags for this mode: (`bridge`, `hot`).
    pub fn flags(self) -> (bool, bool) {
        match self {
            QuiesceMode::Release => (false, false),
            QuiesceMode::Bridge => (true, false),
            QuiesceMode::Hot => (false, true),
        }
    }
}

/// Which processes a [`AgentCommand::ReleaseDevice`] makes let go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseScope {
    /// Every holder: library processes quiesce again, others are ended (after the unplug
    /// missed its deadline).
    #[default]
    AllHolders,
    /// Only the unmanaged programs (before the unplug): a quiesced library process still
    /// holds librdmacm's cached context until the unplug begins, and lets go of it then.
    Unmanaged,
}

/// The agent's answer to one [`AgentRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentResponse {
    /// The id of the request this answers.
    pub id: u64,
    /// The outcome.
    pub result: AgentResult,
}

/// Outcome of one agent command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AgentResult {
    /// Answer to [`AgentCommand::Ping`].
    Pong {
        /// The agent's crate version.
        version: String,
    },
    /// Answer to [`AgentCommand::ListConnections`].
    Connections {
        /// One entry per registered connection.
        connections: Vec<ConnectionInfo>,
    },
    /// Answer to [`AgentCommand::Quiesce`] and [`AgentCommand::Resume`]: per-connection results.
    Outcomes {
        /// One entry per connection the command touched.
        outcomes: Vec<ConnectionOutcome>,
        /// Wall time the agent spent, in milliseconds.
        elapsed_ms: u64,
    },
    /// Answer to [`AgentCommand::ListUnmanaged`].
    Unmanaged {
        /// One entry per process.
        programs: Vec<UnmanagedProgram>,
    },
    /// Answer to [`AgentCommand::ReleaseDevice`]: the processes that held an RDMA device.
    Released {
        /// One entry per holding process.
        holders: Vec<DeviceHolder>,
    },
    /// The command failed as a whole.
    Error {
        /// What went wrong, for the operator.
        message: String,
    },
}

/// The longest text other than a command line that an [`AgentResult`] carries to the
/// host once made [`printable`](crate::text::printable) (an error, an address, a name).
pub const TEXT_LEN: usize = 512;

impl AgentResult {
    /// The result with every text the guest wrote made printable and bounded: the host
    /// shows these to operators, and the guest is untrusted.
    pub fn into_printable(self) -> AgentResult {
        use crate::text::printable;
        let text = |t: String| printable(&t, TEXT_LEN);
        match self {
            AgentResult::Pong { version } => AgentResult::Pong {
                version: text(version),
            },
            AgentResult::Connections { connections } => AgentResult::Connections {
                connections: connections
                    .into_iter()
                    .map(|c| ConnectionInfo {
                        local: text(c.local),
                        peer: text(c.peer),
                        ..c
                    })
                    .collect(),
            },
            AgentResult::Outcomes {
                outcomes,
                elapsed_ms,
            } => AgentResult::Outcomes {
                outcomes: outcomes
                    .into_iter()
                    .map(ConnectionOutcome::into_printable)
                    .collect(),
                elapsed_ms,
            },
            AgentResult::Unmanaged { programs } => AgentResult::Unmanaged {
                programs: programs
                    .into_iter()
                    .map(|p| UnmanagedProgram {
                        command: printable(&p.command, COMMAND_LEN),
                        devices: p
                            .devices
                            .iter()
                            .map(|d| printable(d, COMMAND_LEN))
                            .collect(),
                        ..p
                    })
                    .collect(),
            },
            AgentResult::Released { holders } => AgentResult::Released {
                holders: holders
                    .into_iter()
                    .map(|h| DeviceHolder {
                        program: text(h.program),
                        action: text(h.action),
                        ..h
                    })
                    .collect(),
            },
            AgentResult::Error { message } => AgentResult::Error {
                message: text(message),
            },
        }
    }
}

impl ConnectionOutcome {
    /// The outcome with its error made printable and bounded ([`TEXT_LEN`]).
    pub fn into_printable(self) -> ConnectionOutcome {
        ConnectionOutcome {
            error: self.error.map(|e| crate::text::printable(&e, TEXT_LEN)),
            fell_back: self.fell_back.map(|e| crate::text::printable(&e, TEXT_LEN)),
            ..self
        }
    }
}

/// Which side of the connection set-up an endpoint played. The active side reconnects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Called rdma_connect.
    Active,
    /// Accepted from a listener.
    Passive,
}

/// Where a connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionState {
    /// Being set up.
    Connecting,
    /// Carrying traffic.
    Established,
    /// Quiescing: no new sends posted, waiting for the peer's PAUSE_ACK and the disconnect.
    Pausing,
    /// Paused by a `hot` quiesce: nothing posted on either side, the QP kept.
    Paused,
    /// Quiesced: every RDMA resource released, messages kept for replay.
    Quiesced,
    /// Waiting for the peer to come back (the peer moved or its path broke).
    AwaitingPeer,
    /// Reconnecting after a resume.
    Resuming,
    /// Closed by the application.
    Closed,
    /// Failed for good; the application has been told why.
    Failed,
}

/// A snapshot of one connection, as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionInfo {
    /// The connection's id.
    pub id: ConnectionId,
    /// The guest process that owns it.
    pub pid: u32,
    /// Active (connecting) or passive (accepted) side.
    pub role: Role,
    /// Local address, `ip:port`.
    pub local: String,
    /// Peer address, `ip:port`.
    pub peer: String,
    /// Current state.
    pub state: ConnectionState,
    /// Highest sequence number sent (assigned) so far.
    pub last_sent: u64,
    /// Highest sequence number delivered to the application so far.
    pub last_received: u64,
    /// Messages sent but not yet acknowledged by the peer.
    pub unacked: u64,
    /// A TCP bridge is open beside the RDMA path (strategy `bridge` can carry it).
    #[serde(default)]
    pub bridge: bool,
    /// The number of the QP that carries it now, if it has one (a `hot` move keeps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qp: Option<u32>,
}

/// A guest process that holds an RDMA device without rdmamig's library: a move breaks it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnmanagedProgram {
    /// The process.
    pub pid: u32,
    /// Its command line (arguments joined by spaces, control characters replaced, at most
    /// [`COMMAND_LEN`] characters).
    pub command: String,
    /// The RDMA device files it has open, by name (`uverbs0`, `rdma_cm`).
    pub devices: Vec<String>,
    /// It has a verbs context open (a `uverbs` node): the unplug cannot complete while it
    /// runs. A process with only `rdma_cm` open loses its connections but does not hold
    /// the unplug.
    pub open_context: bool,
}

/// The longest command line an [`UnmanagedProgram`] carries.
pub const COMMAND_LEN: usize = 200;

/// A guest process that held an RDMA device when the forced release came, and what the
/// agent did to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceHolder {
    /// The process.
    pub pid: u32,
    /// Its name (`/proc/<pid>/comm`).
    pub program: String,
    /// What was done: `asked to quiesce (rdmamig library)`, `SIGTERM`, `SIGTERM, SIGKILL`.
    pub action: String,
    /// Whether it no longer holds the device when the agent answers.
    pub released: bool,
}

/// What happened to one connection during a quiesce or resume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionOutcome {
    /// The connection.
    pub id: ConnectionId,
    /// Whether the step succeeded for this connection.
    pub ok: bool,
    /// Time this connection took, in milliseconds.
    pub elapsed_ms: u64,
    /// What failed, when `ok` is false.
    pub error: Option<String>,
    /// Why a connection paused by a `hot` quiesce did not go on on its QP and reconnected
    /// instead (the QP did not survive the move).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Frame;

    #[test]
    fn a_quiesce_mode_survives_the_wire_flags() {
        for mode in QuiesceMode::ALL {
            let (bridge, hot) = mode.flags();
            assert_eq!(QuiesceMode::from_flags(bridge, hot), mode);
        }
        // An older host sends no `hot`: a plain quiesce.
        let old: AgentCommand =
            serde_json::from_str(r#"{"op":"quiesce","deadline_ms":5,"bridge":true}"#).unwrap();
        assert_eq!(
            old,
            AgentCommand::Quiesce {
                deadline_ms: 5,
                bridge: true,
                hot: false
            }
        );
    }

    #[test]
    fn every_text_of_a_result_is_made_printable() {
        let evil = "x\x1b[2J\ny".to_string();
        let shown = "x?[2J?y";
        let result = AgentResult::Outcomes {
            outcomes: vec![ConnectionOutcome {
                id: 1,
                ok: false,
                elapsed_ms: 0,
                error: Some(evil.clone()),
                fell_back: None,
            }],
            elapsed_ms: 0,
        };
        let AgentResult::Outcomes { outcomes, .. } = result.into_printable() else {
            unreachable!()
        };
        assert_eq!(outcomes[0].error.as_deref(), Some(shown));
        let AgentResult::Error { message } = (AgentResult::Error {
            message: evil.repeat(1000),
        })
        .into_printable() else {
            unreachable!()
        };
        assert!(!message.contains('\x1b'));
        assert_eq!(
            message.chars().count(),
            TEXT_LEN + 1,
            "cut, with its ellipsis"
        );
        let AgentResult::Released { holders } = (AgentResult::Released {
            holders: vec![DeviceHolder {
                pid: 1,
                program: evil.clone(),
                action: evil,
                released: true,
            }],
        })
        .into_printable() else {
            unreachable!()
        };
        assert_eq!(
            (holders[0].program.as_str(), holders[0].action.as_str()),
            (shown, shown)
        );
    }

    #[test]
    fn requests_round_trip_through_a_frame() {
        for command in [
            AgentCommand::Ping,
            AgentCommand::ListConnections { deadline_ms: None },
            AgentCommand::ListConnections {
                deadline_ms: Some(60_000),
            },
            AgentCommand::ListUnmanaged,
            AgentCommand::Quiesce {
                deadline_ms: 5000,
                bridge: true,
                hot: false,
            },
            AgentCommand::Quiesce {
                deadline_ms: 5000,
                bridge: false,
                hot: true,
            },
            AgentCommand::Resume { deadline_ms: 9000 },
            AgentCommand::ReleaseDevice {
                grace_ms: 1000,
                deadline_ms: 4000,
                scope: ReleaseScope::Unmanaged,
            },
        ] {
            let req = AgentRequest { id: 3, command };
            let bytes = Frame::encode(&req);
            let mut fb = crate::FrameBuffer::new();
            fb.push(&bytes);
            assert_eq!(fb.pop().unwrap().decode::<AgentRequest>().unwrap(), req);
        }
    }

    #[test]
    fn unknown_operation_is_malformed() {
        let frame = crate::Frame {
            payload: br#"{"id":1,"command":{"op":"format_disk"}}"#.to_vec(),
        };
        assert!(frame.decode::<AgentRequest>().is_err());
    }
}
