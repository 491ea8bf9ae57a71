//! Migrator ↔ migrator: the destination's duties, asked for over TCP with mutual TLS.
//!
//! A destination host reserves a passthrough function for an arriving VM, readies its VMM to
//! receive, plugs the function after the migration, and reports back; a source asks for each
//! of these. Both ends authenticate with certificates from one CA (rustls, TLS 1.2/1.3): a
//! peer without a certificate, or with one the CA did not sign, fails the handshake and
//! nothing is read from it. A certificate the CA signed is not enough either: the peer's
//! certificate must be one of the configured peers' (exact DER match), so that one host's
//! credentials cannot be replayed by a machine the operator did not list. Every request
//! carries the protocol version; another version is refused with its number, and nothing is
//! done for a refused request.
//!
//! Frames are rdmamig-proto frames (size limit included) through [`crate::api::Channel`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rdmamig_vmm::DeviceSpec;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::api::{ApiError, Channel};
use crate::mover::{error_chain, Backends};
use crate::plan::Endpoint;
use crate::pool::{Attachment, Pool};

/// The version of the peer protocol this build speaks.
pub const PEER_PROTOCOL_VERSION: u32 = 1;

/// One request from a source migrator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerRequest {
    /// [`PEER_PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// What is asked.
    pub call: PeerCall,
}

/// The destination's duties.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum PeerCall {
    /// Reserve a function from the destination's pool for a move.
    Reserve {
        /// The move.
        move_id: String,
    },
    /// Give a reservation (or an attached function, after a failed move) back.
    Release {
        /// The function.
        function: String,
        /// The move.
        move_id: String,
        /// The VM.
        vm: String,
    },
    /// Ready the destination VMM to receive the migration.
    PrepareReceive {
        /// The destination VMM's control socket on that host.
        qmp: PathBuf,
        /// Where the migration stream arrives.
        via: String,
    },
    /// Plug the reserved function into the arrived VM.
    Attach {
        /// The destination VMM's control socket on that host.
        qmp: PathBuf,
        /// The function.
        function: String,
        /// The move.
        move_id: String,
        /// The VM.
        vm: String,
        /// The device (id, bus, MAC) the function's own properties go over.
        device: DeviceSpec,
    },
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
    /// The call was done.
    Done,
    /// The call was not done.
    Refused {
        /// Why.
        reason: String,
    },
}

/// Why a peer exchange failed.
#[derive(Debug, Error)]
pub enum PeerError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("cannot load {what} from {path}")]
    Load {
        /// `certificates` or `private key`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// rustls refused the configuration.
    #[error("bad TLS configuration")]
    Config(#[source] rustls::Error),
    /// The client verifier could not be built from the CA.
    #[error("bad peer CA")]
    Verifier(#[source] rustls::server::VerifierBuilderError),
    /// The peer's address does not answer.
    #[error("cannot connect to the peer migrator at {address}")]
    Connect {
        /// The address.
        address: String,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake failed (a certificate was refused, on either side).
    #[error("TLS handshake with {address} failed")]
    Handshake {
        /// The peer.
        address: String,
        /// What rustls said.
        #[source]
        source: std::io::Error,
    },
    /// The server name is not a valid DNS name or address.
    #[error("{name:?} is not a valid peer name")]
    ServerName {
        /// The name.
        name: String,
    },
    /// Framing or transport failed.
    #[error("talking to the peer migrator failed")]
    Api(#[from] ApiError),
    /// The peer closed before answering.
    #[error("the peer migrator closed the connection without an answer")]
    NoAnswer,
}

/// This host's TLS identity and whom it trusts.
#[derive(Clone)]
pub struct PeerTls {
    certs: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    roots: Arc<RootCertStore>,
    /// The peers this host talks to, by name, with their certificates.
    peers: Vec<(String, CertificateDer<'static>)>,
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, PeerError> {
    let load = |source| PeerError::Load {
        what: "certificates",
        path: path.into(),
        source,
    };
    let file = std::fs::File::open(path).map_err(load)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut std::io::BufReader::new(file))
        .collect::<Result<_, _>>()
        .map_err(load)?;
    if certs.is_empty() {
        return Err(load(std::io::Error::other("no certificate in the file")));
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl PeerTls {
    /// Loads this host's certificate chain and key, the CA, and the peers' certificates
    /// (`name`, path), all PEM.
    pub fn load(
        cert: &Path,
        key: &Path,
        ca: &Path,
        peers: &[(String, PathBuf)],
    ) -> Result<PeerTls, PeerError> {
        let certs = load_certs(cert)?;
        let load_key = |source| PeerError::Load {
            what: "private key",
            path: key.into(),
            source,
        };
        let file = std::fs::File::open(key).map_err(load_key)?;
        let key_der = rustls_pemfile::private_key(&mut std::io::BufReader::new(file))
            .map_err(load_key)?
            .ok_or_else(|| load_key(std::io::Error::other("no private key in the file")))?;
        let mut roots = RootCertStore::empty();
        for c in load_certs(ca)? {
            roots.add(c).map_err(PeerError::Config)?;
        }
        let mut known = Vec::new();
        for (name, path) in peers {
            for c in load_certs(path)? {
                known.push((name.clone(), c));
            }
        }
        Ok(PeerTls {
            certs,
            key: Arc::new(key_der),
            roots: Arc::new(roots),
            peers: known,
        })
    }

    fn server_config(&self) -> Result<ServerConfig, PeerError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
            .build()
            .map_err(PeerError::Verifier)?;
        ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(PeerError::Config)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.certs.clone(), self.key.clone_key())
            .map_err(PeerError::Config)
    }

    fn client_config(&self) -> Result<ClientConfig, PeerError> {
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(PeerError::Config)?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.certs.clone(), self.key.clone_key())
            .map_err(PeerError::Config)
    }

    /// The configured name of the peer presenting `cert`, if it is one.
    fn known(&self, cert: &CertificateDer<'_>) -> Option<&str> {
        self.peers
            .iter()
            .find(|(_, c)| c.as_ref() == cert.as_ref())
            .map(|(name, _)| name.as_str())
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
}

/// Serves peer requests on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, destination: Arc<Destination>) -> Result<(), PeerError> {
    let acceptor = TlsAcceptor::from(Arc::new(destination.tls.server_config()?));
    loop {
        let Ok((stream, address)) = listener.accept().await else {
            // Out of descriptors or similar: do not spin.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let acceptor = acceptor.clone();
        let destination = destination.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(stream).await {
                Ok(tls) => tls,
                Err(e) => {
                    tracing::warn!(%address, "refused a peer: TLS handshake failed: {e}");
                    return;
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
                return;
            };
            let answer = match channel.receive::<PeerRequest>().await {
                Ok(Some(request)) if request.version != PEER_PROTOCOL_VERSION => {
                    PeerAnswer::Refused {
                        reason: format!(
                            "unsupported peer protocol version {} (this migrator speaks {})",
                            request.version, PEER_PROTOCOL_VERSION
                        ),
                    }
                }
                Ok(Some(request)) => {
                    tracing::info!(%peer, call = ?request.call, "peer request");
                    destination.handle(request.call).await
                }
                Ok(None) => return,
                Err(e) => PeerAnswer::Refused {
                    reason: format!("bad request: {}", error_chain(&e)),
                },
            };
            let _ = channel.send(&answer).await;
        });
    }
}

impl Destination {
    async fn handle(&self, call: PeerCall) -> PeerAnswer {
        let refused = |e: &dyn std::error::Error| PeerAnswer::Refused {
            reason: error_chain(e),
        };
        match call {
            PeerCall::Reserve { move_id } => match self.pool.reserve(&move_id) {
                Ok((function, attachment)) => PeerAnswer::Reserved {
                    function,
                    attachment,
                },
                Err(e) => refused(&e),
            },
            PeerCall::Release {
                function,
                move_id,
                vm,
            } => match self.pool.release(&function, &move_id, &vm) {
                Ok(()) => PeerAnswer::Done,
                Err(e) => refused(&e),
            },
            PeerCall::PrepareReceive { qmp, via } => {
                let endpoint = Endpoint { qmp, agent: None };
                match self.backends.connect(&endpoint).await {
                    Ok(vmm) => match vmm.prepare_incoming(&via).await {
                        Ok(()) => PeerAnswer::Done,
                        Err(e) => refused(&e),
                    },
                    Err(e) => refused(&e),
                }
            }
            PeerCall::Attach {
                qmp,
                function,
                move_id,
                vm,
                device,
            } => {
                let attachment = self
                    .pool
                    .list()
                    .into_iter()
                    .find(|f| f.name == function)
                    .map(|f| f.attachment);
                let Some(attachment) = attachment else {
                    return PeerAnswer::Refused {
                        reason: format!("no function {function} in the destination's pool"),
                    };
                };
                let endpoint = Endpoint { qmp, agent: None };
                let spec = crate::pool::device_for(&attachment, &device);
                let added = match self.backends.connect(&endpoint).await {
                    Ok(vmm) => vmm.add_device(&spec).await,
                    Err(e) => return refused(&e),
                };
                match added.map_err(|e| error_chain(&e)).and_then(|_| {
                    self.pool
                        .attach(&function, &move_id, &vm)
                        .map_err(|e| error_chain(&e))
                }) {
                    Ok(()) => PeerAnswer::Done,
                    Err(reason) => PeerAnswer::Refused { reason },
                }
            }
        }
    }
}

/// Sends one request to the destination migrator at `address` (`host:port`), which must
/// present a certificate for `server_name` signed by the CA.
pub async fn call(
    tls: &PeerTls,
    address: &str,
    server_name: &str,
    request: &PeerRequest,
) -> Result<PeerAnswer, PeerError> {
    let connector = TlsConnector::from(Arc::new(tls.client_config()?));
    let name =
        ServerName::try_from(server_name.to_string()).map_err(|_| PeerError::ServerName {
            name: server_name.into(),
        })?;
    let stream = TcpStream::connect(address)
        .await
        .map_err(|source| PeerError::Connect {
            address: address.into(),
            source,
        })?;
    let stream = connector
        .connect(name, stream)
        .await
        .map_err(|source| PeerError::Handshake {
            address: address.into(),
            source,
        })?;
    let mut channel = Channel::new(stream);
    channel.send(request).await?;
    channel
        .receive::<PeerAnswer>()
        .await?
        .ok_or(PeerError::NoAnswer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fakes::{FakeBackends, FakeHost};
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};

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

        /// Issues `name` (DNS name `localhost`); returns (cert, key) paths.
        fn issue(&self, name: &str) -> (PathBuf, PathBuf) {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec!["localhost".into()]).unwrap();
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

        fn tls(&self, (cert, key): &(PathBuf, PathBuf), peers: &[(&str, &PathBuf)]) -> PeerTls {
            let peers: Vec<(String, PathBuf)> = peers
                .iter()
                .map(|(n, p)| (n.to_string(), (*p).clone()))
                .collect();
            PeerTls::load(cert, key, &self.dir.path().join("ca.pem"), &peers).unwrap()
        }
    }

    /// A destination with one pool function, serving on a loopback port.
    async fn destination(tls: PeerTls) -> (String, Arc<Pool>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let config: crate::pool::Config =
            toml::from_str("[[pool.function]]\nname = \"vf0\"\npci = \"0000:3b:00.2\"\n").unwrap();
        let pool = Arc::new(Pool::open(&config.pool, &dir.path().join("pool.json")).unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let destination = Arc::new(Destination {
            tls,
            pool: pool.clone(),
            backends: Arc::new(FakeBackends(FakeHost::new())),
        });
        tokio::spawn(serve(listener, destination));
        (address, pool, dir)
    }

    fn reserve() -> PeerRequest {
        PeerRequest {
            version: PEER_PROTOCOL_VERSION,
            call: PeerCall::Reserve {
                move_id: "m1".into(),
            },
        }
    }

    #[tokio::test]
    async fn a_known_peer_reserves_prepares_and_attaches_over_mutual_tls() {
        let pki = Pki::new("rdmamig");
        let (src, dst) = (pki.issue("src"), pki.issue("dst"));
        let (address, pool, _dir) = destination(pki.tls(&dst, &[("src", &src.0)])).await;
        let client = pki.tls(&src, &[("dst", &dst.0)]);
        let answer = call(&client, &address, "localhost", &reserve())
            .await
            .unwrap();
        assert!(
            matches!(&answer, PeerAnswer::Reserved { function, .. } if function == "vf0"),
            "{answer:?}"
        );
        let prepare = PeerRequest {
            version: PEER_PROTOCOL_VERSION,
            call: PeerCall::PrepareReceive {
                qmp: "/d/qmp".into(),
                via: "tcp:10.0.0.2:4444".into(),
            },
        };
        assert_eq!(
            call(&client, &address, "localhost", &prepare)
                .await
                .unwrap(),
            PeerAnswer::Done
        );
        let attach = PeerRequest {
            version: PEER_PROTOCOL_VERSION,
            call: PeerCall::Attach {
                qmp: "/d/qmp".into(),
                function: "vf0".into(),
                move_id: "m1".into(),
                vm: "vm1".into(),
                device: DeviceSpec::parse("driver=virtio-net-pci,id=nic1,bus=rp1").unwrap(),
            },
        };
        assert_eq!(
            call(&client, &address, "localhost", &attach).await.unwrap(),
            PeerAnswer::Done
        );
        assert_eq!(
            pool.state("vf0"),
            Some(crate::pool::FunctionState::Attached { vm: "vm1".into() })
        );
    }

    #[tokio::test]
    async fn a_certificate_from_another_ca_is_refused_in_the_handshake() {
        let pki = Pki::new("rdmamig");
        let dst = pki.issue("dst");
        let (address, pool, _dir) = destination(pki.tls(&dst, &[])).await;
        let rogue = Pki::new("rogue");
        let intruder = rogue.issue("intruder");
        // The intruder trusts the real CA (so it accepts the server) but presents its own.
        let intruder_tls = PeerTls::load(
            &intruder.0,
            &intruder.1,
            &pki.dir.path().join("ca.pem"),
            &[],
        )
        .unwrap();
        let err = call(&intruder_tls, &address, "localhost", &reserve())
            .await
            .unwrap_err();
        // TLS 1.3: the server's refusal arrives as an alert when the client reads.
        assert!(
            matches!(err, PeerError::Handshake { .. } | PeerError::Api(_)),
            "{err:?}"
        );
        assert_eq!(pool.state("vf0"), Some(crate::pool::FunctionState::Free));
        // And a server the client's CA did not sign is refused by the client.
        let mismatched = rogue.tls(&intruder, &[]);
        let err = call(&mismatched, &address, "localhost", &reserve())
            .await
            .unwrap_err();
        assert!(matches!(err, PeerError::Handshake { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn a_signed_but_unknown_peer_and_another_version_are_refused() {
        let pki = Pki::new("rdmamig");
        let (src, dst, other) = (pki.issue("src"), pki.issue("dst"), pki.issue("other"));
        let (address, pool, _dir) = destination(pki.tls(&dst, &[("src", &src.0)])).await;
        let stranger = pki.tls(&other, &[]);
        let answer = call(&stranger, &address, "localhost", &reserve())
            .await
            .unwrap();
        assert!(
            matches!(&answer, PeerAnswer::Refused { reason } if reason.starts_with("unknown peer")),
            "{answer:?}"
        );
        let client = pki.tls(&src, &[]);
        let mut future = reserve();
        future.version = 2;
        let answer = call(&client, &address, "localhost", &future).await.unwrap();
        assert_eq!(
            answer,
            PeerAnswer::Refused {
                reason: "unsupported peer protocol version 2 (this migrator speaks 1)".into()
            }
        );
        assert_eq!(pool.state("vf0"), Some(crate::pool::FunctionState::Free));
    }
}
