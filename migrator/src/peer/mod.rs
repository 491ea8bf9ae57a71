//! Migrator ↔ migrator: the destination's duties, asked for over TCP with mutual TLS.
//!
//! A source migrator whose move goes to another host drives the destination through
//! [`RemoteDestination`], the [`DestinationHost`] that sends each duty (reserve a function,
//! ready the VMM to receive, plug the function after the migration, resume the connections
//! through the arrived guest's agent, discard a migrated copy, release the reservation) to
//! the destination migrator; [`serve`] runs each request it accepts through a
//! [`LocalDestination`] on its own host and answers.
//!
//! Both ends authenticate with certificates from one CA (rustls, TLS 1.2/1.3): a peer without
//! a certificate, or with one the CA did not sign, fails the handshake and nothing is read
//! from it. A certificate the CA signed is not enough either: the other end's certificate
//! must be one of the configured peers' (exact DER match), on both sides, so that one host's
//! credentials cannot be replayed by a machine the operator did not list. An authenticated
//! peer is still trusted only with its own moves, on the VMMs this host allows ([`scope`]).
//! Every request
//! carries the protocol version and its deadline; another version is refused with its
//! number, and nothing is done for a refused request. Frames are rdmamig-proto frames (size
//! limit included) through [`crate::channel::Channel`]; the handshake and the request have
//! [`HANDSHAKE_TIMEOUT`], the work the request's deadline (at most [`MAX_CALL`]).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use rdmamig_proto::agent::{ConnectionOutcome, TEXT_LEN};
use rdmamig_proto::text::printable;
use rdmamig_proto::ConnectionId;
use rdmamig_vmm::DeviceSpec;
use rustls::pki_types::ServerName;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::agent::Outcomes;
use crate::backends::Backends;
use crate::channel::Channel;
use crate::destination::{DestinationHost, HandOver, LocalDestination, MoveRef, Plugged};
use crate::listen::{Admission, PEER_CONNECTIONS};
use crate::plan::Endpoint;
use crate::pool::{Attachment, Pool};
use crate::step::StepError;
use rdmamig_proto::text::error_chain;

pub mod scope;
pub mod tls;

pub use scope::{Scope, ScopeError};
pub use tls::{PeerError, PeerTarget, PeerTls};

/// The version of the peer protocol this build speaks (3: every call names its move).
pub const PEER_PROTOCOL_VERSION: u32 = 3;

/// Time a peer has to finish the TLS handshake and send its request.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a destination works on one request, whatever its deadline says: a bound on
/// what an authenticated peer can make this host do, above what real phases take. (It was
/// 120 s; a VF plugged into a nested VM took about that long to have carrier, and the
/// destination cut the source's 300 s resume short.)
pub const MAX_CALL: Duration = Duration::from_secs(15 * 60);

/// Time a source allows, beyond a call's deadline, for connecting, the handshake and the
/// answer's way back.
const CALL_SLACK: Duration = Duration::from_secs(5);

/// One request from a source migrator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerRequest {
    /// [`PEER_PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// How long the destination may work on it, ms.
    pub deadline_ms: u64,
    /// What is asked.
    pub call: PeerCall,
}

/// The destination's duties, one per [`DestinationHost`] method.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum PeerCall {
    /// Reserve a function from the destination's pool for a move.
    Reserve {
        /// The move.
        of: MoveRef,
    },
    /// Ready the destination VMM to receive the migration.
    PrepareReceive {
        /// The destination VMM on that host.
        endpoint: Endpoint,
        /// The move.
        of: MoveRef,
        /// Where the migration stream arrives.
        via: String,
        /// The reserved function handed to the receiving VMM (`hot` on Cloud Hypervisor).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hand_over: Option<HandOver>,
    },
    /// Plug the device (or the reserved function) into the arrived VM.
    Attach {
        /// The destination VMM on that host.
        endpoint: Endpoint,
        /// The move.
        of: MoveRef,
        /// The reserved function, if the move took one from the pool.
        function: Option<String>,
        /// The device (id, bus, MAC) the function's own properties go over.
        device: DeviceSpec,
        /// Do not plug a device that is already there.
        check_first: bool,
    },
    /// Resume the connections through the arrived guest's agent.
    Resume {
        /// The destination VMM on that host.
        endpoint: Endpoint,
        /// The move.
        of: MoveRef,
        /// The connections the source listed.
        connections: Vec<ConnectionId>,
    },
    /// Confirm that the VM arrived and runs (after the source saw the migration complete).
    ConfirmReceived {
        /// The destination VMM on that host.
        endpoint: Endpoint,
        /// The move.
        of: MoveRef,
    },
    /// Stop the destination VMM (a rollback after the migration completed).
    Discard {
        /// The destination VMM on that host.
        endpoint: Endpoint,
        /// The move.
        of: MoveRef,
    },
    /// Give a reservation (or an attached function, after a failed move) back.
    Release {
        /// The function.
        function: String,
        /// The move.
        of: MoveRef,
    },
}

impl PeerCall {
    /// The move the call is for (every call names one: see [`scope`]).
    pub fn of(&self) -> &MoveRef {
        match self {
            PeerCall::Reserve { of }
            | PeerCall::PrepareReceive { of, .. }
            | PeerCall::Attach { of, .. }
            | PeerCall::Resume { of, .. }
            | PeerCall::ConfirmReceived { of, .. }
            | PeerCall::Discard { of, .. }
            | PeerCall::Release { of, .. } => of,
        }
    }

    /// The VMM endpoint the call acts on, if it acts on one.
    pub fn endpoint(&self) -> Option<&Endpoint> {
        match self {
            PeerCall::Reserve { .. } | PeerCall::Release { .. } => None,
            PeerCall::PrepareReceive { endpoint, .. }
            | PeerCall::Attach { endpoint, .. }
            | PeerCall::Resume { endpoint, .. }
            | PeerCall::ConfirmReceived { endpoint, .. }
            | PeerCall::Discard { endpoint, .. } => Some(endpoint),
        }
    }
}

/// The destination's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum PeerAnswer {
    /// A function was reserved.
    Reserved {
        /// Its name.
        function: String,
        /// How it is plugged.
        attachment: Attachment,
    },
    /// A device was plugged.
    Plugged {
        /// What.
        plugged: Plugged,
    },
    /// The agent resumed the connections (some may have failed).
    Resumed {
        /// Per connection.
        outcomes: Vec<ConnectionOutcome>,
        /// The agent's own time, ms.
        elapsed_ms: u64,
    },
    /// The call was done.
    Done,
    /// The call was not done.
    Refused {
        /// Why.
        reason: String,
    },
}

impl PeerAnswer {
    /// The answer with every text the peer wrote made printable and bounded: it reaches the
    /// operator's terminal, and a peer is trusted only with its own moves.
    fn into_printable(self) -> PeerAnswer {
        let text = |t: &str| printable(t, TEXT_LEN);
        match self {
            PeerAnswer::Reserved {
                function,
                attachment,
            } => PeerAnswer::Reserved {
                function: text(&function),
                attachment,
            },
            PeerAnswer::Plugged { plugged } => PeerAnswer::Plugged {
                plugged: Plugged {
                    id: text(&plugged.id),
                    driver: text(&plugged.driver),
                    bdf: plugged.bdf.as_deref().map(text),
                    ..plugged
                },
            },
            PeerAnswer::Resumed {
                outcomes,
                elapsed_ms,
            } => PeerAnswer::Resumed {
                outcomes: outcomes
                    .into_iter()
                    .map(ConnectionOutcome::into_printable)
                    .collect(),
                elapsed_ms,
            },
            PeerAnswer::Done => PeerAnswer::Done,
            PeerAnswer::Refused { reason } => PeerAnswer::Refused {
                reason: text(&reason),
            },
        }
    }
}

/// What the destination side needs to do its duties.
pub struct Destination {
    /// The TLS identity and the known peers.
    pub tls: PeerTls,
    /// The pool functions come from.
    pub pool: Arc<Pool>,
    /// How the destination's VMMs are reached.
    pub backends: Arc<dyn Backends>,
    /// What each peer may ask for.
    pub scope: Scope,
}

/// Serves peer requests on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, destination: Arc<Destination>) -> Result<(), PeerError> {
    let acceptor = TlsAcceptor::from(Arc::new(destination.tls.server_config()?));
    let admission = Admission::new("peer", PEER_CONNECTIONS);
    loop {
        let ((stream, address), slot) = admission.next(|| listener.accept()).await;
        let acceptor = acceptor.clone();
        let destination = destination.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let opened = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
                let tls = match acceptor.accept(stream).await {
                    Ok(tls) => tls,
                    Err(e) => {
                        tracing::warn!(%address, "refused a peer: TLS handshake failed: {e}");
                        return None;
                    }
                };
                let peer = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|certs| certs.first())
                    .and_then(|cert| destination.tls.known(cert))
                    .map(str::to_string);
                let mut channel = Channel::new(tls);
                let Some(peer) = peer else {
                    tracing::warn!(%address, "refused a peer whose certificate is not configured");
                    let reason = "unknown peer: this certificate is not in the destination's \
                                  peers list"
                        .to_string();
                    let _ = channel.send(&PeerAnswer::Refused { reason }).await;
                    return None;
                };
                let request = channel.receive::<PeerRequest>().await;
                Some((peer, channel, request))
            })
            .await;
            let Ok(Some((peer, mut channel, request))) = opened else {
                return;
            };
            let answer = match request {
                Ok(Some(request)) => answer(&destination, &peer, request).await,
                Ok(None) => return,
                Err(e) => PeerAnswer::Refused {
                    reason: format!("bad request: {}", error_chain(&e)),
                },
            };
            if let PeerAnswer::Refused { reason } = &answer {
                tracing::warn!(%peer, "peer request refused: {reason}");
            }
            let _ = channel.send(&answer).await;
        });
    }
}

/// Answers one request from `peer`: refused if it speaks another version or asks for
/// something outside its scope, else done within its deadline (at most [`MAX_CALL`]).
async fn answer(destination: &Destination, peer: &str, request: PeerRequest) -> PeerAnswer {
    if request.version != PEER_PROTOCOL_VERSION {
        return PeerAnswer::Refused {
            reason: format!(
                "unsupported peer protocol version {} (this migrator speaks {})",
                request.version, PEER_PROTOCOL_VERSION
            ),
        };
    }
    if let Err(e) = destination.scope.admit(peer, &request.call) {
        return PeerAnswer::Refused {
            reason: format!("outside this peer's scope: {e}"),
        };
    }
    tracing::info!(%peer, call = ?request.call, "peer request");
    let asked = Duration::from_millis(request.deadline_ms);
    let deadline = asked.min(MAX_CALL);
    let local = LocalDestination::new(destination.backends.clone(), destination.pool.clone());
    let work = handle(&local, &destination.scope, request.call, deadline);
    match tokio::time::timeout(deadline, work).await {
        Ok(answer) => answer,
        Err(_) => PeerAnswer::Refused {
            reason: if asked > MAX_CALL {
                format!(
                    "not done within {} ms, the most this migrator gives one request (it \
                     asked {} ms)",
                    deadline.as_millis(),
                    asked.as_millis()
                )
            } else {
                format!(
                    "not done within the request's deadline of {} ms",
                    deadline.as_millis()
                )
            },
        },
    }
}

/// Does one duty on this host.
async fn handle(
    local: &LocalDestination,
    scope: &Scope,
    call: PeerCall,
    deadline: Duration,
) -> PeerAnswer {
    let result = match call {
        PeerCall::Reserve { of } => {
            local
                .reserve(&of, deadline)
                .await
                .map(|(function, attachment)| PeerAnswer::Reserved {
                    function,
                    attachment,
                })
        }
        PeerCall::PrepareReceive {
            endpoint,
            of,
            via,
            hand_over,
        } => local
            .prepare_receive(&endpoint, &of, &via, hand_over.as_ref(), deadline)
            .await
            .map(|()| PeerAnswer::Done),
        PeerCall::Attach {
            endpoint,
            of,
            function,
            device,
            check_first,
        } => local
            .attach(
                &endpoint,
                &of,
                function.as_deref(),
                &device,
                check_first,
                deadline,
            )
            .await
            .map(|plugged| PeerAnswer::Plugged { plugged }),
        PeerCall::Resume {
            endpoint,
            of,
            connections,
        } => local
            .resume(&endpoint, &of, &connections, deadline)
            .await
            .map(|result| PeerAnswer::Resumed {
                outcomes: result.outcomes,
                elapsed_ms: result.elapsed_ms,
            }),
        PeerCall::ConfirmReceived { endpoint, of } => local
            .confirm_received(&endpoint, &of, deadline)
            .await
            .map(|_| PeerAnswer::Done),
        PeerCall::Discard { endpoint, of } => {
            let discarded = local.discard(&endpoint, &of, deadline).await;
            if discarded.is_ok() {
                scope.discarded(&of);
            }
            discarded.map(|()| PeerAnswer::Done)
        }
        PeerCall::Release { function, of } => local
            .release(&function, &of, deadline)
            .await
            .map(|()| PeerAnswer::Done),
    };
    result.unwrap_or_else(|e| PeerAnswer::Refused {
        reason: error_chain(&e),
    })
}

/// Sends one request to the destination migrator `target` and returns its answer, all
/// within the request's deadline plus [`CALL_SLACK`]. The destination must present a
/// certificate the CA signed for `target.server_name` that is a configured peer's (the
/// named peer's, when `target` has a name).
pub async fn call(
    tls: &PeerTls,
    target: &PeerTarget,
    request: &PeerRequest,
) -> Result<PeerAnswer, PeerError> {
    let limit = Duration::from_millis(request.deadline_ms) + CALL_SLACK;
    tokio::time::timeout(limit, exchange(tls, target, request))
        .await
        .unwrap_or_else(|_| {
            Err(PeerError::TimedOut {
                address: target.address.clone(),
                deadline_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            })
        })
}

async fn exchange(
    tls: &PeerTls,
    target: &PeerTarget,
    request: &PeerRequest,
) -> Result<PeerAnswer, PeerError> {
    let connector = TlsConnector::from(Arc::new(tls.client_config()?));
    let name =
        ServerName::try_from(target.server_name.clone()).map_err(|_| PeerError::ServerName {
            name: target.server_name.clone(),
        })?;
    let stream = TcpStream::connect(&target.address)
        .await
        .map_err(|source| PeerError::Connect {
            address: target.address.clone(),
            source,
        })?;
    let stream = connector
        .connect(name, stream)
        .await
        .map_err(|source| PeerError::Handshake {
            address: target.address.clone(),
            source,
        })?;
    let presented = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .and_then(|cert| tls.known(cert));
    let expected_ok = match (&target.name, presented) {
        (Some(name), Some(presented)) => name == presented,
        (None, Some(_)) => true,
        (_, None) => false,
    };
    if !expected_ok {
        return Err(PeerError::UnknownServer {
            address: target.address.clone(),
            expected: target.name.clone().unwrap_or_else(|| "any peer".into()),
        });
    }
    let mut channel = Channel::new(stream);
    channel.send(request).await?;
    channel
        .receive::<PeerAnswer>()
        .await?
        .ok_or(PeerError::NoAnswer)
}

/// The destination is another migrator, reached over mutual TLS.
pub struct RemoteDestination {
    tls: PeerTls,
    target: PeerTarget,
}

impl RemoteDestination {
    /// A destination behind the migrator `target`.
    pub fn new(tls: PeerTls, target: PeerTarget) -> RemoteDestination {
        RemoteDestination { tls, target }
    }

    async fn ask(&self, duty: PeerCall, deadline: Duration) -> Result<PeerAnswer, StepError> {
        let request = PeerRequest {
            version: PEER_PROTOCOL_VERSION,
            deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
            call: duty,
        };
        match call(&self.tls, &self.target, &request)
            .await?
            .into_printable()
        {
            PeerAnswer::Refused { reason } => Err(PeerError::Refused {
                peer: self.target.to_string(),
                reason,
            }
            .into()),
            answer => Ok(answer),
        }
    }

    /// Asks for a duty whose only good answer is `Done`.
    async fn ask_done(
        &self,
        duty: PeerCall,
        deadline: Duration,
        name: &'static str,
    ) -> Result<(), StepError> {
        match self.ask(duty, deadline).await? {
            PeerAnswer::Done => Ok(()),
            _ => Err(self.unexpected(name)),
        }
    }

    fn unexpected(&self, call: &'static str) -> StepError {
        PeerError::Unexpected {
            peer: self.target.to_string(),
            call,
        }
        .into()
    }
}

#[async_trait]
impl DestinationHost for RemoteDestination {
    fn describe(&self) -> String {
        self.target.to_string()
    }

    async fn reserve(
        &self,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<(String, Attachment), StepError> {
        match self
            .ask(PeerCall::Reserve { of: of.clone() }, deadline)
            .await?
        {
            PeerAnswer::Reserved {
                function,
                attachment,
            } => Ok((function, attachment)),
            _ => Err(self.unexpected("reserve")),
        }
    }

    async fn prepare_receive(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        via: &str,
        hand_over: Option<&HandOver>,
        deadline: Duration,
    ) -> Result<(), StepError> {
        let call = PeerCall::PrepareReceive {
            endpoint: endpoint.clone(),
            of: of.clone(),
            via: via.into(),
            hand_over: hand_over.cloned(),
        };
        self.ask_done(call, deadline, "prepare_receive").await
    }

    async fn attach(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        function: Option<&str>,
        device: &DeviceSpec,
        check_first: bool,
        deadline: Duration,
    ) -> Result<Plugged, StepError> {
        let call = PeerCall::Attach {
            endpoint: endpoint.clone(),
            of: of.clone(),
            function: function.map(str::to_string),
            device: device.clone(),
            check_first,
        };
        match self.ask(call, deadline).await? {
            PeerAnswer::Plugged { plugged } => Ok(plugged),
            _ => Err(self.unexpected("attach")),
        }
    }

    async fn resume(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        connections: &[ConnectionId],
        deadline: Duration,
    ) -> Result<Outcomes, StepError> {
        let call = PeerCall::Resume {
            endpoint: endpoint.clone(),
            of: of.clone(),
            connections: connections.to_vec(),
        };
        match self.ask(call, deadline).await? {
            PeerAnswer::Resumed {
                outcomes,
                elapsed_ms,
            } => Ok(Outcomes {
                outcomes,
                elapsed_ms,
            }),
            _ => Err(self.unexpected("resume")),
        }
    }

    /// The guest's start time stays on the destination host: each peer request connects
    /// to its VMM anew, so none has watched the incoming side since it was readied.
    async fn confirm_received(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<Option<SystemTime>, StepError> {
        let call = PeerCall::ConfirmReceived {
            endpoint: endpoint.clone(),
            of: of.clone(),
        };
        self.ask_done(call, deadline, "confirm received")
            .await
            .map(|()| None)
    }

    async fn discard(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<(), StepError> {
        let call = PeerCall::Discard {
            endpoint: endpoint.clone(),
            of: of.clone(),
        };
        self.ask_done(call, deadline, "discard").await
    }

    async fn release(
        &self,
        function: &str,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<(), StepError> {
        let call = PeerCall::Release {
            function: function.into(),
            of: of.clone(),
        };
        self.ask_done(call, deadline, "release").await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KnownPeer;
    use crate::fakes::{FakeBackends, FakeHost, Where};
    use crate::journal::Journal;
    use crate::machine::Phase;
    use crate::moving::{run_move, MoveContext};
    use crate::plan::tests::plan;
    use crate::pool::FunctionState;
    use crate::report::VmLocation;
    use crate::strategy::Choice;
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    use std::path::{Path, PathBuf};

    /// A CA and certificates it signs, written as PEM files in a directory.
    struct Pki {
        dir: tempfile::TempDir,
        ca: rcgen::Certificate,
        ca_key: KeyPair,
    }

    impl Pki {
        fn new(name: &str) -> Pki {
            let dir = tempfile::tempdir().unwrap();
            let ca_key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec![format!("{name} CA")]).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let ca = params.self_signed(&ca_key).unwrap();
            std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
            Pki { dir, ca, ca_key }
        }

        /// Issues `name` (DNS name `localhost`, address 127.0.0.1); returns (cert, key)
        /// paths.
        fn issue(&self, name: &str) -> (PathBuf, PathBuf) {
            let key = KeyPair::generate().unwrap();
            let mut params =
                CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
            let cert_path = self.dir.path().join(format!("{name}.pem"));
            let key_path = self.dir.path().join(format!("{name}.key"));
            std::fs::write(&cert_path, cert.pem()).unwrap();
            std::fs::write(&key_path, key.serialize_pem()).unwrap();
            (cert_path, key_path)
        }

        /// `peers`: (name, certificate, address).
        fn tls(
            &self,
            (cert, key): &(PathBuf, PathBuf),
            peers: &[(&str, &PathBuf, Option<&str>)],
        ) -> PeerTls {
            let peers: Vec<KnownPeer> = peers
                .iter()
                .map(|(name, cert, address)| KnownPeer {
                    name: name.to_string(),
                    cert: (*cert).clone(),
                    address: address.map(str::to_string),
                })
                .collect();
            PeerTls::load(cert, key, &self.dir.path().join("ca.pem"), &peers).unwrap()
        }
    }

    /// A destination with one pool function on the fake host `host`, serving on a loopback
    /// port.
    async fn destination(tls: PeerTls, host: &FakeHost) -> (String, Arc<Pool>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let config: crate::config::Config =
            toml::from_str("[[pool.function]]\nname = \"vf0\"\npci = \"0000:3b:00.2\"\n").unwrap();
        let pool = Arc::new(Pool::open(&config.pool, &dir.path().join("pool.json")).unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let destination = Arc::new(Destination {
            tls,
            pool: pool.clone(),
            backends: Arc::new(FakeBackends(host.clone())),
            scope: Scope::new(vec!["/d".into()]),
        });
        tokio::spawn(serve(listener, destination));
        (address, pool, dir)
    }

    fn of() -> MoveRef {
        MoveRef {
            move_id: "m1".into(),
            vm: "vm1".into(),
        }
    }

    fn reserve() -> PeerRequest {
        PeerRequest {
            version: PEER_PROTOCOL_VERSION,
            deadline_ms: 1000,
            call: PeerCall::Reserve { of: of() },
        }
    }

    fn target(address: &str) -> PeerTarget {
        PeerTarget {
            address: address.into(),
            server_name: "localhost".into(),
            name: None,
        }
    }

    /// A source daemon's context whose `[peer]` knows the destination as `dst` at `address`.
    fn source_context(tls: PeerTls, host: &FakeHost, dir: &Path) -> MoveContext {
        MoveContext {
            backends: Arc::new(FakeBackends(host.clone())),
            pool: Arc::new(Pool::open(&Default::default(), &dir.join("pool.json")).unwrap()),
            peers: Some(tls),
            boundary: None,
        }
    }

    #[tokio::test]
    async fn a_move_to_another_migrator_runs_every_duty_over_mutual_tls() {
        let pki = Pki::new("rdmamig");
        let (src, dst) = (pki.issue("src"), pki.issue("dst"));
        let host = FakeHost::new();
        let (address, pool, _dir) =
            destination(pki.tls(&dst, &[("src", &src.0, None)]), &host).await;
        let dir = tempfile::tempdir().unwrap();
        let context = source_context(
            pki.tls(&src, &[("dst", &dst.0, Some(&address))]),
            &host,
            dir.path(),
        );
        let mut plan = plan();
        plan.from_pool = true;
        plan.destination_migrator = Some("dst".into());
        let journal = Journal::create(dir.path(), "m1", &plan).unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let report = run_move(
            "m1".into(),
            plan.clone(),
            Choice::asked(plan.strategy),
            journal,
            context,
            events,
        )
        .await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.function.as_deref(), Some("vf0"));
        let prepare = &report.timeline.phases[0].details;
        assert_eq!(
            prepare["destination"],
            format!("migrator dst ({address})").as_str()
        );
        let attach = &report.timeline.phases[4].details;
        assert_eq!(attach["driver"], "vfio-pci", "{attach:?}");
        // The destination's own pool has the function attached to the VM; the arrived guest
        // resumed its connections through the destination's agent.
        assert_eq!(
            pool.state("vf0"),
            Some(FunctionState::Attached { vm: "vm1".into() })
        );
        let state = host.state();
        assert_eq!(state.guest, Where::Destination);
        assert_eq!(state.resumed_on, [Where::Destination]);
    }

    #[tokio::test]
    async fn a_failed_remote_move_releases_the_destination_reservation_through_the_channel() {
        let pki = Pki::new("rdmamig");
        let (src, dst) = (pki.issue("src"), pki.issue("dst"));
        let host = FakeHost::new();
        let (address, pool, _dir) =
            destination(pki.tls(&dst, &[("src", &src.0, None)]), &host).await;
        host.fail("dst.add_device", crate::fakes::Fault::Refuse);
        let dir = tempfile::tempdir().unwrap();
        let context = source_context(pki.tls(&src, &[("dst", &dst.0, None)]), &host, dir.path());
        let mut plan = plan();
        plan.from_pool = true;
        plan.destination_migrator = Some(address.clone());
        let journal = Journal::create(dir.path(), "m1", &plan).unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let report = run_move(
            "m1".into(),
            plan.clone(),
            Choice::asked(plan.strategy),
            journal,
            context,
            events,
        )
        .await;
        assert_eq!(report.final_phase, Phase::RolledBack, "{report:#?}");
        assert_eq!(report.failed_phase, Some(Phase::Attach));
        assert_eq!(report.vm_location, VmLocation::Source);
        let error = report.error.unwrap();
        assert!(
            error.contains(&format!("migrator at {address} refused")),
            "{error}"
        );
        let steps = report.timeline.phases.last().unwrap().details["steps"].to_string();
        assert!(steps.contains("destination VMM stopped"), "{steps}");
        assert!(steps.contains("function vf0 released"), "{steps}");
        assert_eq!(pool.state("vf0"), Some(FunctionState::Free));
        assert!(host.state().destination_gone);
    }

    #[tokio::test]
    async fn a_restarted_source_finishes_or_rolls_back_a_remote_move_from_its_journal() {
        for (crash_at, done) in [(Phase::Detach, false), (Phase::Attach, true)] {
            let pki = Pki::new("rdmamig");
            let (src, dst) = (pki.issue("src"), pki.issue("dst"));
            let host = FakeHost::new();
            let (address, pool, _dir) =
                destination(pki.tls(&dst, &[("src", &src.0, None)]), &host).await;
            let dir = tempfile::tempdir().unwrap();
            let source_tls = pki.tls(&src, &[("dst", &dst.0, Some(&address))]);
            let mut plan = plan();
            plan.from_pool = true;
            plan.destination_migrator = Some("dst".into());
            let journal = Journal::create(dir.path(), "m1", &plan).unwrap();
            let mut context = source_context(source_tls.clone(), &host, dir.path());
            context.boundary = Some(Arc::new(move |phase| {
                assert!(phase != crash_at, "killed at {phase}");
            }));
            let (events, _received) = tokio::sync::mpsc::unbounded_channel();
            let killed = tokio::spawn(run_move(
                "m1".into(),
                plan.clone(),
                Choice::asked(plan.strategy),
                journal,
                context,
                events,
            ))
            .await;
            assert!(killed.is_err(), "the move was not killed at {crash_at}");
            // The restarted daemon has only its config and the journal.
            let (path, replay) = crate::journal::scan(dir.path())
                .map(|scan| scan.unfinished)
                .unwrap()
                .into_iter()
                .next()
                .unwrap();
            let context = source_context(source_tls, &host, dir.path());
            let (events, _received) = tokio::sync::mpsc::unbounded_channel();
            let journal = Journal::reopen(&path).unwrap();
            let report = crate::moving::recover(replay, journal, context, events).await;
            assert_eq!(report.ok, done, "{crash_at}: {report:#?}");
            let expected = if done {
                FunctionState::Attached { vm: "vm1".into() }
            } else {
                FunctionState::Free
            };
            assert_eq!(pool.state("vf0"), Some(expected), "{crash_at}");
        }
    }

    #[tokio::test]
    async fn a_certificate_from_another_ca_is_refused_in_the_handshake() {
        let pki = Pki::new("rdmamig");
        let dst = pki.issue("dst");
        let (address, pool, _dir) = destination(pki.tls(&dst, &[]), &FakeHost::new()).await;
        let rogue = Pki::new("rogue");
        let intruder = rogue.issue("intruder");
        // The intruder trusts the real CA (so it accepts the server) but presents its own.
        let intruder_tls = PeerTls::load(
            &intruder.0,
            &intruder.1,
            &pki.dir.path().join("ca.pem"),
            &[KnownPeer {
                name: "dst".into(),
                cert: dst.0.clone(),
                address: None,
            }],
        )
        .unwrap();
        let err = call(&intruder_tls, &target(&address), &reserve())
            .await
            .unwrap_err();
        // TLS 1.3: the server's refusal arrives as an alert when the client reads.
        assert!(
            matches!(err, PeerError::Handshake { .. } | PeerError::Channel(_)),
            "{err:?}"
        );
        assert_eq!(pool.state("vf0"), Some(FunctionState::Free));
        // And a server the client's CA did not sign is refused by the sending side.
        let mismatched = rogue.tls(&intruder, &[]);
        let err = call(&mismatched, &target(&address), &reserve())
            .await
            .unwrap_err();
        assert!(matches!(err, PeerError::Handshake { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn a_flood_of_idle_connections_holds_at_most_its_places_and_the_peer_is_served_after() {
        let pki = Pki::new("rdmamig");
        let (src, dst) = (pki.issue("src"), pki.issue("dst"));
        let (address, _pool, _dir) =
            destination(pki.tls(&dst, &[("src", &src.0, None)]), &FakeHost::new()).await;
        // Twice as many idle connections as there are places: the rest wait in the backlog.
        let mut flood = Vec::new();
        for _ in 0..2 * crate::listen::PEER_CONNECTIONS {
            flood.push(tokio::net::TcpStream::connect(&address).await.unwrap());
        }
        let client = pki.tls(&src, &[("dst", &dst.0, None)]);
        // While the flood holds every place, a real peer waits (each idle connection holds
        // its place for the handshake timeout at most)...
        let waiting = tokio::time::timeout(
            Duration::from_millis(500),
            call(&client, &target(&address), &reserve()),
        )
        .await;
        assert!(
            waiting.is_err(),
            "a call got a place the flood held: {waiting:?}"
        );
        // ...and is served once the flood ends.
        drop(flood);
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            call(&client, &target(&address), &reserve()),
        )
        .await
        .expect("the destination does not serve after a flood")
        .unwrap();
        assert!(matches!(answer, PeerAnswer::Reserved { .. }), "{answer:?}");
    }

    #[tokio::test]
    async fn a_signed_but_unknown_peer_and_another_version_are_refused() {
        let pki = Pki::new("rdmamig");
        let (src, dst, other) = (pki.issue("src"), pki.issue("dst"), pki.issue("other"));
        let (address, pool, _dir) =
            destination(pki.tls(&dst, &[("src", &src.0, None)]), &FakeHost::new()).await;
        let stranger = pki.tls(&other, &[("dst", &dst.0, None)]);
        let answer = call(&stranger, &target(&address), &reserve())
            .await
            .unwrap();
        assert!(
            matches!(&answer, PeerAnswer::Refused { reason } if reason.starts_with("unknown peer")),
            "{answer:?}"
        );
        let client = pki.tls(&src, &[("dst", &dst.0, None)]);
        let mut future = reserve();
        future.version = 4;
        let answer = call(&client, &target(&address), &future).await.unwrap();
        assert_eq!(
            answer,
            PeerAnswer::Refused {
                reason: "unsupported peer protocol version 4 (this migrator speaks 3)".into()
            }
        );
        assert_eq!(pool.state("vf0"), Some(FunctionState::Free));
    }

    #[test]
    fn a_peers_words_reach_the_terminal_printable() {
        let refused = PeerAnswer::Refused {
            reason: "no\x1b[2J\n".into(),
        };
        assert_eq!(
            refused.into_printable(),
            PeerAnswer::Refused {
                reason: "no?[2J?".into()
            }
        );
        let resumed = PeerAnswer::Resumed {
            outcomes: vec![ConnectionOutcome {
                id: 1,
                ok: false,
                elapsed_ms: 2,
                error: Some("\x07bell".into()),
                fell_back: None,
            }],
            elapsed_ms: 3,
        };
        let PeerAnswer::Resumed { outcomes, .. } = resumed.into_printable() else {
            panic!("not a resume's answer");
        };
        assert_eq!(outcomes[0].error.as_deref(), Some("?bell"));
    }

    /// The destination's endpoint in `plan()` (under the destination's `vmm_paths`, /d).
    fn dst_endpoint() -> Endpoint {
        plan().destination.unwrap()
    }

    fn request(call: PeerCall) -> PeerRequest {
        PeerRequest {
            version: PEER_PROTOCOL_VERSION,
            deadline_ms: 1000,
            call,
        }
    }

    async fn refusal(tls: &PeerTls, address: &str, call: PeerCall) -> String {
        match super::call(tls, &target(address), &request(call))
            .await
            .unwrap()
        {
            PeerAnswer::Refused { reason } => reason,
            answer => panic!("done, not refused: {answer:?}"),
        }
    }

    #[tokio::test]
    async fn an_authenticated_peer_acts_only_on_allowed_endpoints_and_its_own_moves() {
        let pki = Pki::new("rdmamig");
        let (src, dst, other) = (pki.issue("src"), pki.issue("dst"), pki.issue("other"));
        let host = FakeHost::new();
        let (address, _pool, _dir) = destination(
            pki.tls(&dst, &[("src", &src.0, None), ("other", &other.0, None)]),
            &host,
        )
        .await;
        let client = pki.tls(&src, &[("dst", &dst.0, None)]);
        let intruder = pki.tls(&other, &[("dst", &dst.0, None)]);
        // A VMM outside the destination's vmm_paths: another VM's QMP socket.
        let unrelated = Endpoint::Qemu {
            qmp: "/s/qmp".into(),
            agent: None,
        };
        let reason = refusal(
            &client,
            &address,
            PeerCall::Discard {
                endpoint: unrelated,
                of: of(),
            },
        )
        .await;
        assert!(reason.contains("/s/qmp is not under"), "{reason}");
        // An allowed VMM, but no move of this peer readied it.
        let reason = refusal(
            &client,
            &address,
            PeerCall::Discard {
                endpoint: dst_endpoint(),
                of: of(),
            },
        )
        .await;
        assert!(reason.contains("move m1 was not opened here"), "{reason}");
        // The peer opens its move; another peer cannot act in it.
        let prepare = PeerCall::PrepareReceive {
            endpoint: dst_endpoint(),
            of: of(),
            via: "unix:/d/mig.sock".into(),
            hand_over: None,
        };
        let answer = call(&client, &target(&address), &request(prepare.clone()))
            .await
            .unwrap();
        assert_eq!(answer, PeerAnswer::Done);
        let reason = refusal(
            &intruder,
            &address,
            PeerCall::Discard {
                endpoint: dst_endpoint(),
                of: of(),
            },
        )
        .await;
        assert!(reason.contains("opened here by peer src"), "{reason}");
        let reason = refusal(
            &intruder,
            &address,
            PeerCall::PrepareReceive {
                endpoint: dst_endpoint(),
                of: MoveRef {
                    move_id: "m2".into(),
                    vm: "vm2".into(),
                },
                via: "unix:/d/mig.sock".into(),
                hand_over: None,
            },
        )
        .await;
        assert!(
            reason.contains("receiving move m1 for peer src"),
            "{reason}"
        );
        // Without a pool function, no host device is plugged.
        let reason = refusal(
            &client,
            &address,
            PeerCall::Attach {
                endpoint: dst_endpoint(),
                of: of(),
                function: None,
                device: DeviceSpec::parse("driver=vfio-pci,id=x,host=0000:00:1f.0").unwrap(),
                check_first: false,
            },
        )
        .await;
        assert!(reason.contains("driver=vfio-pci"), "{reason}");
        let state = host.state();
        assert!(!state.destination_gone, "a refused discard stopped the VMM");
        assert!(state.plugged.is_empty(), "{:?}", state.plugged);
    }

    #[tokio::test]
    async fn the_sending_side_refuses_a_destination_that_is_not_the_listed_peer() {
        let pki = Pki::new("rdmamig");
        let (src, dst, other) = (pki.issue("src"), pki.issue("dst"), pki.issue("other"));
        // `other` serves, signed by the right CA, but the source expects `dst` there.
        let (address, pool, _dir) =
            destination(pki.tls(&other, &[("src", &src.0, None)]), &FakeHost::new()).await;
        let client = pki.tls(
            &src,
            &[("dst", &dst.0, Some(&address)), ("other", &other.0, None)],
        );
        let err = call(&client, &client.resolve("dst").unwrap(), &reserve())
            .await
            .unwrap_err();
        assert!(matches!(err, PeerError::UnknownServer { .. }), "{err:?}");
        assert!(err.to_string().contains("not dst's"), "{err}");
        assert_eq!(pool.state("vf0"), Some(FunctionState::Free));
    }

    #[test]
    fn destinations_resolve_by_name_or_address() {
        let pki = Pki::new("rdmamig");
        let (src, dst) = (pki.issue("src"), pki.issue("dst"));
        let tls = pki.tls(
            &src,
            &[
                ("dst", &dst.0, Some("hostb.example:7478")),
                ("nowhere", &dst.0, None),
            ],
        );
        assert_eq!(
            tls.resolve("dst").unwrap(),
            PeerTarget {
                address: "hostb.example:7478".into(),
                server_name: "hostb.example".into(),
                name: Some("dst".into()),
            }
        );
        let direct = tls.resolve("[::1]:7478").unwrap();
        assert_eq!((direct.server_name.as_str(), direct.name), ("::1", None));
        assert!(matches!(
            tls.resolve("nowhere"),
            Err(PeerError::NoAddress { .. })
        ));
        let err = tls.resolve("hostc").unwrap_err();
        assert_eq!(
            err.to_string(),
            "destination migrator \"hostc\" is neither a [[peer.known]] name in the config \
             (dst, nowhere) nor host:port"
        );
    }
}
