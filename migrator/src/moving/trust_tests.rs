//! The guest is untrusted: an agent that misbehaves at the quiesce, through the real
//! protocol client, only ever affects its own VM's move.

use super::*;
use crate::agent::AgentClient;
use crate::fakes::{FakeBackends, FakeHost, Where};
use crate::plan::tests::plan;
use crate::plan::Endpoint;
use async_trait::async_trait;
use rdmamig_proto::agent::{AgentCommand, AgentRequest, AgentResponse, AgentResult};
use rdmamig_proto::{Frame, FrameBuffer, MAX_FRAME_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    Garbage,
    Oversized,
    ForeignConnection,
}

/// The fake host's VMMs, and a scripted agent speaking the real framing.
struct ScriptedBackends {
    vmms: FakeBackends,
    misbehaviour: Misbehaviour,
}

#[async_trait]
impl Backends for ScriptedBackends {
    async fn connect(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError> {
        self.vmms.connect(endpoint).await
    }

    async fn agent(&self, _vmm: &dyn Vmm) -> Result<Box<dyn GuestAgent>, VmmError> {
        let (host, guest) = tokio::io::duplex(1 << 20);
        tokio::spawn(serve(guest, self.misbehaviour));
        Ok(Box::new(AgentClient::new(Box::new(host))))
    }
}

async fn serve(mut stream: DuplexStream, misbehaviour: Misbehaviour) {
    let mut buffer = FrameBuffer::new();
    let mut chunk = [0u8; 4096];
    loop {
        let frame = loop {
            match buffer.pop() {
                Ok(frame) => break frame,
                Err(_) => match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buffer.push(&chunk[..n]),
                },
            }
        };
        let Ok(request) = frame.decode::<AgentRequest>() else {
            return;
        };
        let result = match request.command {
            AgentCommand::Ping => AgentResult::Pong {
                version: "scripted".into(),
            },
            AgentCommand::ListConnections { .. } => AgentResult::Connections {
                connections: vec![],
            },
            AgentCommand::ListUnmanaged => AgentResult::Unmanaged { programs: vec![] },
            AgentCommand::Quiesce { .. } => {
                let bytes = match misbehaviour {
                    Misbehaviour::Garbage => b"\x00\x01garbage that is no frame".to_vec(),
                    Misbehaviour::Oversized => {
                        let mut b = b"RMG\x01".to_vec();
                        let len = u32::try_from(MAX_FRAME_LEN * 4).unwrap();
                        b.extend_from_slice(&len.to_be_bytes());
                        b
                    }
                    Misbehaviour::ForeignConnection => Frame::encode(&AgentResponse {
                        id: request.id,
                        result: AgentResult::Outcomes {
                            outcomes: vec![ConnectionOutcome {
                                id: 0xdead,
                                ok: true,
                                elapsed_ms: 1,
                                error: None,
                                fell_back: None,
                            }],
                            elapsed_ms: 1,
                        },
                    }),
                };
                let _ = stream.write_all(&bytes).await;
                return;
            }
            AgentCommand::Resume { .. } => AgentResult::Outcomes {
                outcomes: vec![],
                elapsed_ms: 1,
            },
            AgentCommand::ReleaseDevice { .. } => AgentResult::Released { holders: vec![] },
        };
        let answer = Frame::encode(&AgentResponse {
            id: request.id,
            result,
        });
        if stream.write_all(&answer).await.is_err() {
            return;
        }
    }
}

#[tokio::test]
async fn a_misbehaving_agent_only_forces_its_own_quiesce() {
    for misbehaviour in [
        Misbehaviour::Garbage,
        Misbehaviour::Oversized,
        Misbehaviour::ForeignConnection,
    ] {
        let host = FakeHost::new();
        let dir = tempfile::tempdir().unwrap();
        let plan = plan();
        let journal = Journal::create(dir.path(), "m", &plan).unwrap();
        let pool =
            Arc::new(Pool::open(&Default::default(), &dir.path().join("pool.json")).unwrap());
        let context = MoveContext {
            backends: Arc::new(ScriptedBackends {
                vmms: FakeBackends(host.clone()),
                misbehaviour,
            }),
            pool,
            peers: None,
            boundary: None,
        };
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let report = run_move(
            "m".into(),
            plan.clone(),
            Choice::asked(plan.strategy),
            journal,
            context,
            events,
        )
        .await;
        // The move went on through its forced path; the host acted on nothing the agent
        // named, and only on this VM's two VMMs.
        assert!(report.ok, "{misbehaviour:?}: {report:#?}");
        assert_eq!(report.forced.len(), 1, "{misbehaviour:?}");
        assert_eq!(report.forced[0].phase, Phase::Quiesce);
        let reason = &report.forced[0].reason;
        let expected = match misbehaviour {
            Misbehaviour::Garbage | Misbehaviour::Oversized => "malformed",
            Misbehaviour::ForeignConnection => "which was not listed",
        };
        assert!(reason.contains(expected), "{misbehaviour:?}: {reason}");
        assert!(report.quiesce.is_empty(), "{misbehaviour:?}");
        let state = host.state();
        assert_eq!(state.guest, Where::Destination);
        assert!(state
            .calls
            .iter()
            .all(|c| c.starts_with("src.") || c.starts_with("dst.")));
    }
}
