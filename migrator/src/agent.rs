//! The host side of the guest-agent protocol: framed requests and answers over the agent
//! channel the VMM opens.
//!
//! The guest is untrusted. Every answer is checked against the request it claims to answer:
//! the id must match, the kind must fit the command, and an outcome may only name a
//! connection the host itself listed. A bad answer is an error that says what was wrong; no
//! answer can make the host panic or act on something it did not ask about. Each request has
//! a deadline; an answer that arrives after its request was given up is recognised by its id
//! and dropped.

use std::collections::HashSet;
use std::time::Duration;

use rdmamig_proto::agent::{
    AgentCommand, AgentRequest, AgentResponse, AgentResult, ConnectionInfo, ConnectionOutcome,
    DeviceHolder, QuiesceMode, ReleaseScope, UnmanagedProgram,
};
use rdmamig_proto::clock::millis;
use rdmamig_proto::message::{Assembler, MessageError};
use rdmamig_proto::{ConnectionId, Frame, FrameBuffer, FrameError};
use rdmamig_vmm::AgentStream;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Why an exchange with the guest agent failed.
#[derive(Debug, Error)]
pub enum AgentError {
    /// Writing the request failed.
    #[error("cannot send {request} to the guest agent")]
    Send {
        /// The request.
        request: &'static str,
        /// What write said.
        #[source]
        source: std::io::Error,
    },
    /// Reading the answer failed.
    #[error("cannot read the guest agent's answer to {request}")]
    Receive {
        /// The request.
        request: &'static str,
        /// What read said.
        #[source]
        source: std::io::Error,
    },
    /// The channel closed before the answer.
    #[error("the agent channel closed while waiting for the answer to {request}")]
    Closed {
        /// The request.
        request: &'static str,
    },
    /// No answer before the deadline.
    #[error("the guest agent did not answer {request} within {deadline_ms} ms")]
    TimedOut {
        /// The request.
        request: &'static str,
        /// The deadline.
        deadline_ms: u64,
    },
    /// The bytes from the guest are not frames or not an answer, or an answer larger than
    /// the host takes ([`MAX_AGENT_ANSWER_LEN`]).
    #[error("the guest agent's answer to {request} is malformed")]
    Malformed {
        /// The request.
        request: &'static str,
        /// What the decoder said.
        #[source]
        source: MessageError,
    },
    /// An answer to a request that was never sent.
    #[error(
        "the guest agent answered request {got} while {request} (request {expected}) was pending"
    )]
    WrongId {
        /// The request.
        request: &'static str,
        /// The id sent.
        expected: u64,
        /// The id answered.
        got: u64,
    },
    /// An answer of the wrong kind.
    #[error("the guest agent answered {request} with a {got} answer")]
    UnexpectedAnswer {
        /// The request.
        request: &'static str,
        /// The kind of answer received.
        got: &'static str,
    },
    /// The agent reported that the command failed.
    #[error("the guest agent could not {request}: {message}")]
    Refused {
        /// The request.
        request: &'static str,
        /// The agent's words.
        message: String,
    },
    /// An answer named a connection the host did not list, or named one twice.
    #[error("the guest agent's answer to {request} names connection {id:016x}, which {why}")]
    UnknownConnection {
        /// The request.
        request: &'static str,
        /// The connection.
        id: ConnectionId,
        /// `was not listed` or `appears twice`.
        why: &'static str,
    },
}

impl AgentError {
    /// Whether the error is a deadline that passed.
    pub fn is_timeout(&self) -> bool {
        matches!(self, AgentError::TimedOut { .. })
    }
}

/// What a quiesce or resume reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcomes {
    /// One entry per connection the agent touched (each one the host listed).
    pub outcomes: Vec<ConnectionOutcome>,
    /// The agent's own time, ms.
    pub elapsed_ms: u64,
}

impl Outcomes {
    /// The connections that failed.
    pub fn failed(&self) -> impl Iterator<Item = &ConnectionOutcome> {
        self.outcomes.iter().filter(|o| !o.ok)
    }
}

/// What a move asks of the guest agent: the seam between the mover and the agent protocol,
/// so that the mover's failure paths are tested with an agent that misbehaves on cue.
#[async_trait::async_trait]
pub trait GuestAgent: Send {
    /// Liveness check; returns the agent's version.
    async fn ping(&mut self, deadline: Duration) -> Result<String, AgentError>;
    /// Every migratable connection in the guest.
    async fn list_connections(
        &mut self,
        deadline: Duration,
    ) -> Result<Vec<ConnectionInfo>, AgentError>;
    /// Every process in the guest that holds an RDMA device without the library.
    async fn list_unmanaged(
        &mut self,
        deadline: Duration,
    ) -> Result<Vec<UnmanagedProgram>, AgentError>;
    /// Quiesces every connection; `known` are the connections the host listed.
    async fn quiesce(
        &mut self,
        known: &[ConnectionId],
        deadline: Duration,
        mode: QuiesceMode,
    ) -> Result<Outcomes, AgentError>;
    /// Resumes every connection; `known` as for quiesce.
    async fn resume(
        &mut self,
        known: &[ConnectionId],
        deadline: Duration,
    ) -> Result<Outcomes, AgentError>;

    /// Makes the holders of the RDMA device in `scope` let go (see
    /// [`AgentClient::release_device`]).
    async fn release_device(
        &mut self,
        scope: ReleaseScope,
        grace: Duration,
        deadline: Duration,
    ) -> Result<Vec<DeviceHolder>, AgentError>;
}

#[async_trait::async_trait]
impl GuestAgent for AgentClient {
    async fn ping(&mut self, deadline: Duration) -> Result<String, AgentError> {
        AgentClient::ping(self, deadline).await
    }

    async fn list_connections(
        &mut self,
        deadline: Duration,
    ) -> Result<Vec<ConnectionInfo>, AgentError> {
        AgentClient::list_connections(self, deadline).await
    }

    async fn list_unmanaged(
        &mut self,
        deadline: Duration,
    ) -> Result<Vec<UnmanagedProgram>, AgentError> {
        AgentClient::list_unmanaged(self, deadline).await
    }

    async fn quiesce(
        &mut self,
        known: &[ConnectionId],
        deadline: Duration,
        mode: QuiesceMode,
    ) -> Result<Outcomes, AgentError> {
        AgentClient::quiesce(self, known, deadline, mode).await
    }

    async fn resume(
        &mut self,
        known: &[ConnectionId],
        deadline: Duration,
    ) -> Result<Outcomes, AgentError> {
        AgentClient::resume(self, known, deadline).await
    }

    async fn release_device(
        &mut self,
        scope: ReleaseScope,
        grace: Duration,
        deadline: Duration,
    ) -> Result<Vec<DeviceHolder>, AgentError> {
        AgentClient::release_device(self, scope, grace, deadline).await
    }
}

/// The most the host assembles of one agent answer. An answer lists every connection of
/// the VM (about 200 bytes each), so a few hundred connections outgrow a frame and their
/// answers arrive in pieces; 4,096 connections take about 1 MiB. A guest cannot make the
/// host hold more than this.
pub const MAX_AGENT_ANSWER_LEN: usize = 8 * 1024 * 1024;

/// A session with one guest agent.
pub struct AgentClient {
    stream: Box<dyn AgentStream>,
    buffer: FrameBuffer,
    /// Answers larger than a frame come in pieces.
    assembler: Assembler,
    /// This session's first request id: the clock in µs when it began, so that every
    /// session's ids are above those of the sessions before it.
    first_id: u64,
    next_id: u64,
    /// Requests given up on; their late answers are dropped.
    abandoned: HashSet<u64>,
}

impl AgentClient {
    /// Wraps a connected agent channel.
    pub fn new(stream: Box<dyn AgentStream>) -> AgentClient {
        let first_id = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        AgentClient {
            stream,
            buffer: FrameBuffer::new(),
            assembler: Assembler::new(MAX_AGENT_ANSWER_LEN),
            first_id,
            next_id: first_id,
            abandoned: HashSet::new(),
        }
    }

    /// Liveness check; returns the agent's version.
    pub async fn ping(&mut self, deadline: Duration) -> Result<String, AgentError> {
        match self.request(AgentCommand::Ping, deadline).await? {
            AgentResult::Pong { version } => Ok(version),
            other => Err(unexpected("ping", &other)),
        }
    }

    /// Every migratable connection in the guest.
    pub async fn list_connections(
        &mut self,
        deadline: Duration,
    ) -> Result<Vec<ConnectionInfo>, AgentError> {
        const REQUEST: &str = "list connections";
        match self
            .request(
                AgentCommand::ListConnections {
                    deadline_ms: Some(deadline.as_millis() as u64),
                },
                deadline,
            )
            .await?
        {
            AgentResult::Connections { connections } => {
                let mut seen = HashSet::new();
                for c in &connections {
                    if !seen.insert(c.id) {
                        return Err(AgentError::UnknownConnection {
                            request: REQUEST,
                            id: c.id,
                            why: "appears twice",
                        });
                    }
                }
                Ok(connections)
            }
            other => Err(unexpected(REQUEST, &other)),
        }
    }

    /// Every process in the guest that holds an RDMA device without the library (its
    /// command lines made printable again, like every text of an answer).
    pub async fn list_unmanaged(
        &mut self,
        deadline: Duration,
    ) -> Result<Vec<UnmanagedProgram>, AgentError> {
        match self.request(AgentCommand::ListUnmanaged, deadline).await? {
            AgentResult::Unmanaged { programs } => Ok(programs),
            other => Err(unexpected("list unmanaged programs", &other)),
        }
    }

    /// Quiesces every connection; `known` are the connections the host listed.
    ///
    /// The agent is given a little less than `deadline` so that its answer arrives in time.
    pub async fn quiesce(
        &mut self,
        known: &[ConnectionId],
        deadline: Duration,
        mode: QuiesceMode,
    ) -> Result<Outcomes, AgentError> {
        let (bridge, hot) = mode.flags();
        let command = AgentCommand::Quiesce {
            deadline_ms: agent_budget(deadline),
            bridge,
            hot,
        };
        let answer = self.request(command, deadline).await?;
        outcomes("quiesce", answer, known)
    }

    /// Resumes every connection on the new device; `known` as for [`AgentClient::quiesce`].
    pub async fn resume(
        &mut self,
        known: &[ConnectionId],
        deadline: Duration,
    ) -> Result<Outcomes, AgentError> {
        let command = AgentCommand::Resume {
            deadline_ms: agent_budget(deadline),
        };
        let answer = self.request(command, deadline).await?;
        outcomes("resume", answer, known)
    }

    /// The forced release: has every guest process that still holds an RDMA device let go
    /// (see [`AgentCommand::ReleaseDevice`]); returns the holders as the agent reports them
    /// (untrusted: for the timeline only, the host acts on none of them).
    pub async fn release_device(
        &mut self,
        scope: ReleaseScope,
        grace: Duration,
        deadline: Duration,
    ) -> Result<Vec<DeviceHolder>, AgentError> {
        let command = AgentCommand::ReleaseDevice {
            grace_ms: millis(grace),
            deadline_ms: agent_budget(deadline),
            scope,
        };
        match self.request(command, deadline).await? {
            AgentResult::Released { holders } => Ok(holders),
            other => Err(unexpected("release the device", &other)),
        }
    }

    async fn request(
        &mut self,
        command: AgentCommand,
        deadline: Duration,
    ) -> Result<AgentResult, AgentError> {
        let name = command_name(&command);
        let id = self.next_id;
        self.next_id += 1;
        let bytes = Frame::encode(&AgentRequest { id, command });
        let exchange = async {
            self.stream
                .write_all(&bytes)
                .await
                .map_err(|source| AgentError::Send {
                    request: name,
                    source,
                })?;
            loop {
                let response = self.read_response(name).await?;
                if response.id == id {
                    return Ok(response.result);
                }
                // A virtio-serial port is one stream whoever is connected: an answer to a
                // request of an earlier session (a migrator killed while the agent worked on
                // it) arrives on this one, and is nobody's now.
                if response.id < self.first_id {
                    tracing::debug!(id = response.id, "dropped an earlier session's answer");
                    continue;
                }
                if !self.abandoned.remove(&response.id) {
                    return Err(AgentError::WrongId {
                        request: name,
                        expected: id,
                        got: response.id,
                    });
                }
                tracing::debug!(id = response.id, "dropped a late agent answer");
            }
        };
        match tokio::time::timeout(deadline, exchange).await {
            Ok(Ok(result)) => match result.into_printable() {
                AgentResult::Error { message } => Err(AgentError::Refused {
                    request: name,
                    message,
                }),
                result => Ok(result),
            },
            Ok(Err(e)) => Err(e),
            Err(_) => {
                self.abandoned.insert(id);
                Err(AgentError::TimedOut {
                    request: name,
                    deadline_ms: millis(deadline),
                })
            }
        }
    }

    async fn read_response(&mut self, request: &'static str) -> Result<AgentResponse, AgentError> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.buffer.pop() {
                Ok(frame) => match self.assembler.take::<AgentResponse>(frame) {
                    Ok(Some(response)) => return Ok(response),
                    Ok(None) => continue,
                    Err(source) => return Err(AgentError::Malformed { request, source }),
                },
                Err(FrameError::Incomplete { .. }) => {}
                Err(e) => {
                    let source = MessageError::Malformed(e);
                    return Err(AgentError::Malformed { request, source });
                }
            }
            let n = self
                .stream
                .read(&mut chunk)
                .await
                .map_err(|source| AgentError::Receive { request, source })?;
            if n == 0 {
                return Err(AgentError::Closed { request });
            }
            self.buffer.push(&chunk[..n]);
        }
    }
}

fn command_name(command: &AgentCommand) -> &'static str {
    match command {
        AgentCommand::Ping => "ping",
        AgentCommand::ListConnections { .. } => "list connections",
        AgentCommand::ListUnmanaged => "list unmanaged programs",
        AgentCommand::Quiesce { .. } => "quiesce",
        AgentCommand::Resume { .. } => "resume",
        AgentCommand::ReleaseDevice { .. } => "release the device",
    }
}

fn result_kind(result: &AgentResult) -> &'static str {
    match result {
        AgentResult::Pong { .. } => "pong",
        AgentResult::Connections { .. } => "connections",
        AgentResult::Unmanaged { .. } => "unmanaged programs",
        AgentResult::Outcomes { .. } => "outcomes",
        AgentResult::Released { .. } => "released",
        AgentResult::Error { .. } => "error",
    }
}

fn unexpected(request: &'static str, got: &AgentResult) -> AgentError {
    AgentError::UnexpectedAnswer {
        request,
        got: result_kind(got),
    }
}

/// Checks an Outcomes answer against the connections the host listed.
fn outcomes(
    request: &'static str,
    answer: AgentResult,
    known: &[ConnectionId],
) -> Result<Outcomes, AgentError> {
    let AgentResult::Outcomes {
        outcomes,
        elapsed_ms,
    } = answer
    else {
        return Err(unexpected(request, &answer));
    };
    let mut seen = HashSet::new();
    for outcome in &outcomes {
        if !known.contains(&outcome.id) {
            return Err(AgentError::UnknownConnection {
                request,
                id: outcome.id,
                why: "was not listed",
            });
        }
        if !seen.insert(outcome.id) {
            return Err(AgentError::UnknownConnection {
                request,
                id: outcome.id,
                why: "appears twice",
            });
        }
    }
    Ok(Outcomes {
        outcomes,
        elapsed_ms,
    })
}

/// The agent's share of a deadline: a tenth (at most half a second) is kept for the answer
/// to travel back.
fn agent_budget(deadline: Duration) -> u64 {
    let margin = (deadline / 10).min(Duration::from_millis(500));
    millis(deadline - margin)
}

#[cfg(test)]
mod tests {
    //! The client against a scripted agent on the other end of an in-memory pipe: the logic
    //! under test is the checking of untrusted answers.

    use super::*;
    use rdmamig_proto::agent::{ConnectionState, Role};
    use tokio::io::{duplex, DuplexStream};

    fn client() -> (AgentClient, DuplexStream) {
        let (host, guest) = duplex(1 << 16);
        (AgentClient::new(Box::new(host)), guest)
    }

    /// Reads one request from the guest end.
    async fn read_request(guest: &mut DuplexStream) -> AgentRequest {
        let mut fb = FrameBuffer::new();
        let mut chunk = [0u8; 1024];
        loop {
            if let Ok(frame) = fb.pop() {
                return frame.decode().unwrap();
            }
            let n = guest.read(&mut chunk).await.unwrap();
            fb.push(&chunk[..n]);
        }
    }

    async fn answer(guest: &mut DuplexStream, id: u64, result: AgentResult) {
        let bytes = rdmamig_proto::message::encode(&AgentResponse { id, result }).unwrap();
        guest.write_all(&bytes).await.unwrap();
    }

    fn info(id: ConnectionId) -> ConnectionInfo {
        ConnectionInfo {
            id,
            pid: 1,
            role: Role::Active,
            local: "10.77.0.11:1".into(),
            peer: "10.77.0.12:2".into(),
            state: ConnectionState::Established,
            last_sent: 0,
            last_received: 0,
            unacked: 0,
            bridge: false,
            qp: None,
        }
    }

    fn ok(id: ConnectionId) -> ConnectionOutcome {
        ConnectionOutcome {
            id,
            ok: true,
            elapsed_ms: 1,
            error: None,
            fell_back: None,
        }
    }

    const SECOND: Duration = Duration::from_secs(1);

    /// The ids of the connections the agent lists.
    async fn listed_ids(host: &mut AgentClient) -> Vec<ConnectionId> {
        let listed = host.list_connections(SECOND).await.unwrap();
        listed.iter().map(|c| c.id).collect()
    }

    #[tokio::test]
    async fn ping_list_quiesce_resume() {
        let (mut host, mut guest) = client();
        let agent = tokio::spawn(async move {
            let req = read_request(&mut guest).await;
            assert_eq!(req.command, AgentCommand::Ping);
            answer(
                &mut guest,
                req.id,
                AgentResult::Pong {
                    version: "0.1.0".into(),
                },
            )
            .await;
            let req = read_request(&mut guest).await;
            let connections = vec![info(7), info(9)];
            answer(&mut guest, req.id, AgentResult::Connections { connections }).await;
            let req = read_request(&mut guest).await;
            assert!(matches!(
                req.command,
                AgentCommand::Quiesce {
                    deadline_ms: 900,
                    bridge: false,
                    hot: false
                }
            ));
            let outcomes = vec![ok(7), ok(9)];
            answer(
                &mut guest,
                req.id,
                AgentResult::Outcomes {
                    outcomes,
                    elapsed_ms: 3,
                },
            )
            .await;
            let req = read_request(&mut guest).await;
            let mut failed = ok(9);
            failed.ok = false;
            failed.error = Some("peer gone".into());
            answer(
                &mut guest,
                req.id,
                AgentResult::Outcomes {
                    outcomes: vec![ok(7), failed],
                    elapsed_ms: 4,
                },
            )
            .await;
        });
        assert_eq!(host.ping(SECOND).await.unwrap(), "0.1.0");
        let ids = listed_ids(&mut host).await;
        assert_eq!(ids, [7, 9]);
        let q = host
            .quiesce(&ids, SECOND, QuiesceMode::Release)
            .await
            .unwrap();
        assert_eq!(
            (q.outcomes.len(), q.elapsed_ms, q.failed().count()),
            (2, 3, 0)
        );
        let r = host.resume(&ids, SECOND).await.unwrap();
        assert_eq!(r.failed().map(|o| o.id).collect::<Vec<_>>(), [9]);
        agent.await.unwrap();
    }

    #[tokio::test]
    async fn an_unlisted_connection_is_rejected() {
        let (mut host, mut guest) = client();
        tokio::spawn(async move {
            let req = read_request(&mut guest).await;
            answer(
                &mut guest,
                req.id,
                AgentResult::Outcomes {
                    outcomes: vec![ok(7), ok(666)],
                    elapsed_ms: 1,
                },
            )
            .await;
            let req = read_request(&mut guest).await;
            answer(
                &mut guest,
                req.id,
                AgentResult::Outcomes {
                    outcomes: vec![ok(7), ok(7)],
                    elapsed_ms: 1,
                },
            )
            .await;
        });
        let err = host
            .quiesce(&[7], SECOND, QuiesceMode::Release)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::UnknownConnection {
                    id: 666,
                    why: "was not listed",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("000000000000029a"));
        let err = host.resume(&[7], SECOND).await.unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::UnknownConnection {
                    id: 7,
                    why: "appears twice",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_answer_to_an_earlier_sessions_request_is_dropped() {
        let (mut host, mut guest) = client();
        tokio::spawn(async move {
            let req = read_request(&mut guest).await;
            // The answer to what a killed migrator had asked, then this session's.
            answer(
                &mut guest,
                2,
                AgentResult::Pong {
                    version: "old".into(),
                },
            )
            .await;
            answer(
                &mut guest,
                req.id,
                AgentResult::Pong {
                    version: "new".into(),
                },
            )
            .await;
        });
        assert_eq!(host.ping(SECOND).await.unwrap(), "new");
    }

    #[tokio::test]
    async fn wrong_ids_kinds_and_errors_are_typed() {
        let (mut host, mut guest) = client();
        tokio::spawn(async move {
            let req = read_request(&mut guest).await;
            answer(
                &mut guest,
                req.id + 40,
                AgentResult::Pong {
                    version: "x".into(),
                },
            )
            .await;
            let req = read_request(&mut guest).await;
            answer(
                &mut guest,
                req.id,
                AgentResult::Pong {
                    version: "x".into(),
                },
            )
            .await;
            let req = read_request(&mut guest).await;
            answer(
                &mut guest,
                req.id,
                AgentResult::Error {
                    message: "no RDMA device".into(),
                },
            )
            .await;
        });
        let err = host.ping(SECOND).await.unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::WrongId {
                    expected,
                    got,
                    ..
                } if got == expected + 40
            ),
            "{err}"
        );
        let err = host.list_connections(SECOND).await.unwrap_err();
        assert!(
            matches!(err, AgentError::UnexpectedAnswer { got: "pong", .. }),
            "{err}"
        );
        let err = host.resume(&[], SECOND).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "the guest agent could not resume: no RDMA device"
        );
    }

    /// Thousands of connections: their list and their outcomes outgrow a frame, come in
    /// pieces and are taken whole; an answer past [`MAX_AGENT_ANSWER_LEN`] is refused.
    #[tokio::test]
    async fn answers_for_thousands_of_connections_come_in_pieces_and_are_bounded() {
        const MANY: u64 = 4096;
        let (mut host, mut guest) = client();
        let agent = tokio::spawn(async move {
            let req = read_request(&mut guest).await;
            let connections = (1..=MANY).map(info).collect();
            answer(&mut guest, req.id, AgentResult::Connections { connections }).await;
            let req = read_request(&mut guest).await;
            let outcomes = (1..=MANY).map(ok).collect();
            let result = AgentResult::Outcomes {
                outcomes,
                elapsed_ms: 5,
            };
            assert!(serde_json::to_vec(&result).unwrap().len() > rdmamig_proto::MAX_FRAME_LEN);
            answer(&mut guest, req.id, result).await;
            let req = read_request(&mut guest).await;
            let message = "x".repeat(MAX_AGENT_ANSWER_LEN + 1);
            let result = AgentResult::Error { message };
            let bytes = rdmamig_proto::message::encode(&AgentResponse { id: req.id, result });
            // The host stops reading at the piece past its limit, and then goes.
            let _ = guest.write_all(&bytes.unwrap()).await;
        });
        let ids = listed_ids(&mut host).await;
        assert_eq!(ids.len(), MANY as usize);
        let q = host
            .quiesce(&ids, SECOND, QuiesceMode::Release)
            .await
            .unwrap();
        assert_eq!(q.outcomes.len(), MANY as usize);
        assert_eq!(q.failed().count(), 0);
        let err = host.ping(SECOND).await.unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::Malformed {
                    source: MessageError::TooLarge {
                        limit: MAX_AGENT_ANSWER_LEN,
                        ..
                    },
                    ..
                }
            ),
            "{err}"
        );
        drop(host);
        agent.await.unwrap();
    }

    #[tokio::test]
    async fn garbage_and_oversized_frames_are_errors_not_panics() {
        let (mut host, mut guest) = client();
        guest.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap();
        let err = host.ping(SECOND).await.unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::Malformed {
                    source: MessageError::Malformed(FrameError::BadMagic { .. }),
                    ..
                }
            ),
            "{err}"
        );

        let (mut host, mut guest) = client();
        let mut header = b"RMG".to_vec();
        header.push(rdmamig_proto::PROTOCOL_VERSION);
        header.extend_from_slice(&u32::MAX.to_be_bytes());
        guest.write_all(&header).await.unwrap();
        let err = host.ping(SECOND).await.unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::Malformed {
                    source: MessageError::Malformed(FrameError::TooLarge { .. }),
                    ..
                }
            ),
            "{err}"
        );

        let (mut host, mut guest) = client();
        let mut frame = b"RMG".to_vec();
        frame.push(rdmamig_proto::PROTOCOL_VERSION);
        frame.extend_from_slice(&9u32.to_be_bytes());
        frame.extend_from_slice(br#"{"id":1}}"#);
        guest.write_all(&frame).await.unwrap();
        let err = host.ping(SECOND).await.unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::Malformed {
                    source: MessageError::Malformed(FrameError::Malformed { .. }),
                    ..
                }
            ),
            "{err}"
        );

        let (mut host, guest) = client();
        drop(guest);
        assert!(matches!(
            host.ping(SECOND).await.unwrap_err(),
            AgentError::Send { .. } | AgentError::Closed { .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_agent_times_out_and_its_late_answer_is_dropped() {
        let (mut host, mut guest) = client();
        let err = host.ping(Duration::from_millis(300)).await.unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::TimedOut {
                    request: "ping",
                    deadline_ms: 300
                }
            ),
            "{err}"
        );
        assert!(err.is_timeout());
        let late = read_request(&mut guest).await;
        answer(
            &mut guest,
            late.id,
            AgentResult::Pong {
                version: "late".into(),
            },
        )
        .await;
        let agent = tokio::spawn(async move {
            let req = read_request(&mut guest).await;
            answer(
                &mut guest,
                req.id,
                AgentResult::Pong {
                    version: "fresh".into(),
                },
            )
            .await;
            guest
        });
        assert_eq!(host.ping(SECOND).await.unwrap(), "fresh");
        drop(agent.await.unwrap());
    }

    #[test]
    fn the_agent_gets_most_of_the_deadline() {
        assert_eq!(agent_budget(Duration::from_millis(1000)), 900);
        assert_eq!(agent_budget(Duration::from_secs(30)), 29_500);
        assert_eq!(agent_budget(Duration::ZERO), 0);
    }
}
