//! The mutual-TLS identity of a migrator towards its peers: this host's certificate and
//! key, the CA, the known peers and their certificates ([`PeerTls`]); where a named peer is
//! reached ([`PeerTarget`]); and every way a peer exchange fails ([`PeerError`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use thiserror::Error;

use crate::channel::ChannelError;
use crate::config::KnownPeer;

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
    /// The destination presented a certificate the CA signed but no configured peer has.
    #[error(
        "the migrator at {address} presented a certificate that is not {expected}'s in the \
         [[peer.known]] list"
    )]
    UnknownServer {
        /// The address.
        address: String,
        /// Whose certificate was expected.
        expected: String,
    },
    /// The server name is not a valid DNS name or address.
    #[error("{name:?} is not a valid peer name")]
    ServerName {
        /// The name.
        name: String,
    },
    /// `--destination-migrator` names no configured peer and is not `host:port`.
    #[error(
        "destination migrator {target:?} is neither a [[peer.known]] name in the config ({known}) \
         nor host:port"
    )]
    UnknownPeer {
        /// What was given.
        target: String,
        /// The configured names.
        known: String,
    },
    /// The named peer has no address to reach it at.
    #[error("peer {name} has no address in the config ([[peer.known]] address = \"host:port\")")]
    NoAddress {
        /// The peer.
        name: String,
    },
    /// This daemon has no `[peer]` table, so it cannot authenticate to another migrator.
    #[error("this daemon has no [peer] table in its config: it cannot talk to other migrators")]
    NotConfigured,
    /// The exchange did not end within its deadline.
    #[error("the peer migrator at {address} did not answer within {deadline_ms} ms")]
    TimedOut {
        /// The peer.
        address: String,
        /// The deadline.
        deadline_ms: u64,
    },
    /// Framing or transport failed.
    #[error("talking to the peer migrator failed")]
    Channel(#[from] ChannelError),
    /// The peer closed before answering.
    #[error("the peer migrator closed the connection without an answer")]
    NoAnswer,
    /// The destination migrator did not do what was asked.
    #[error("{peer} refused: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// Its reason.
        reason: String,
    },
    /// The answer does not answer the call.
    #[error("{peer} answered {call} with something else")]
    Unexpected {
        /// The peer.
        peer: String,
        /// The call.
        call: &'static str,
    },
}

impl PeerError {
    /// Whether the exchange ran out of time.
    pub fn is_timeout(&self) -> bool {
        matches!(self, PeerError::TimedOut { .. })
    }
}

/// A configured peer's identity.
#[derive(Clone)]
struct Known {
    name: String,
    cert: CertificateDer<'static>,
    address: Option<String>,
}

/// This host's TLS identity and whom it trusts.
#[derive(Clone)]
pub struct PeerTls {
    certs: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    roots: Arc<RootCertStore>,
    /// The peers this host talks to, with their certificates and addresses.
    peers: Vec<Known>,
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
    /// Loads this host's certificate chain and key, the CA, and the peers' certificates,
    /// all PEM.
    pub fn load(
        cert: &Path,
        key: &Path,
        ca: &Path,
        peers: &[KnownPeer],
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
        for peer in peers {
            for cert in load_certs(&peer.cert)? {
                known.push(Known {
                    name: peer.name.clone(),
                    cert,
                    address: peer.address.clone(),
                });
            }
        }
        Ok(PeerTls {
            certs,
            key: Arc::new(key_der),
            roots: Arc::new(roots),
            peers: known,
        })
    }

    pub(super) fn server_config(&self) -> Result<ServerConfig, PeerError> {
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

    pub(super) fn client_config(&self) -> Result<ClientConfig, PeerError> {
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(PeerError::Config)?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.certs.clone(), self.key.clone_key())
            .map_err(PeerError::Config)
    }

    /// The configured name of the peer presenting `cert`, if it is one.
    pub(super) fn known(&self, cert: &CertificateDer<'_>) -> Option<&str> {
        self.peers
            .iter()
            .find(|k| k.cert.as_ref() == cert.as_ref())
            .map(|k| k.name.as_str())
    }

    /// Where `target` (a configured peer's name, or `host:port`) is reached.
    pub fn resolve(&self, target: &str) -> Result<PeerTarget, PeerError> {
        if let Some(peer) = self.peers.iter().find(|k| k.name == target) {
            let address = peer.address.clone().ok_or_else(|| PeerError::NoAddress {
                name: peer.name.clone(),
            })?;
            return Ok(PeerTarget {
                server_name: host_of(&address).to_string(),
                address,
                name: Some(peer.name.clone()),
            });
        }
        let port_ok = target
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            let mut names: Vec<&str> = self.peers.iter().map(|k| k.name.as_str()).collect();
            names.dedup();
            return Err(PeerError::UnknownPeer {
                target: target.into(),
                known: if names.is_empty() {
                    "none configured".into()
                } else {
                    names.join(", ")
                },
            });
        }
        Ok(PeerTarget {
            server_name: host_of(target).to_string(),
            address: target.into(),
            name: None,
        })
    }
}

/// The host part of `host:port` (`[v6]:port` without the brackets).
fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A destination migrator, resolved from `--destination-migrator`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTarget {
    /// `host:port`.
    pub address: String,
    /// The name its certificate must carry (the host part of the address).
    pub server_name: String,
    /// Its configured name; `None` when given as `host:port` (then any configured peer's
    /// certificate is accepted from it).
    pub name: Option<String>,
}

impl std::fmt::Display for PeerTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.name {
            Some(name) => write!(f, "migrator {name} ({})", self.address),
            None => write!(f, "migrator at {}", self.address),
        }
    }
}
