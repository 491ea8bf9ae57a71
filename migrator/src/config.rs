//! The daemon's config file (`rdmamig daemon --config`, TOML): the pool of passthrough
//! functions (`[pool]`, see [`crate::pool`]), the identity towards other migrators (`[peer]`,
//! see [`crate::peer`]) and the defaults of moves (`[moves]`). Every table refuses keys it
//! does not know, so a typo is an error, not a silent default.
//!
//! ```toml
//! [pool]
//! reservation_s = 300
//!
//! [[pool.function]]
//! name = "vf0"
//! pci = "0000:3b:00.2"
//!
//! # Optional: talk to other migrators: serve the destination's duties on `listen`, and
//! # drive destinations named by `rdmamig migrate --destination-migrator`.
//! [peer]
//! listen = "0.0.0.0:7478"
//! cert = "/etc/rdmamig/tls/host.pem"
//! key = "/etc/rdmamig/tls/host.key"
//! ca = "/etc/rdmamig/tls/ca.pem"
//! # The VMM sockets (and log files) a peer may name when it moves a VM here.
//! vmm_paths = ["/run/rdmamig/vmms"]
//!
//! [[peer.known]]
//! name = "hostA"
//! cert = "/etc/rdmamig/tls/peers/hostA.pem"
//! address = "hostA.example:7478"
//!
//! [moves]
//! unmanaged = "refuse"
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

use crate::plan::UnmanagedPolicy;
use crate::pool::PoolConfig;

/// Why the config file cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The config file cannot be read.
    #[error("cannot read the config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid.
    #[error("the config file {path} is not valid")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: toml::de::Error,
    },
}

/// The daemon's config file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The pool of passthrough functions.
    #[serde(default)]
    pub pool: PoolConfig,
    /// Serving the destination's duties to other migrators (mutual TLS).
    #[serde(default)]
    pub peer: Option<PeerConfig>,
    /// Defaults of the moves this daemon runs.
    #[serde(default)]
    pub moves: MovesConfig,
}

/// The `[moves]` table: what a move does when its client does not say.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MovesConfig {
    /// What to do with programs that hold an RDMA device without the library
    /// (`refuse`, `release` or `ignore`; `refuse` when not given).
    #[serde(default)]
    pub unmanaged: UnmanagedPolicy,
}

/// The `[peer]` table: where to listen, this host's certificate, the CA, the known peers.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// `address:port` to serve the destination's duties on; a host that only sends moves
    /// need not listen.
    #[serde(default)]
    pub listen: Option<String>,
    /// This host's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA that signs every migrator's certificate (PEM).
    pub ca: PathBuf,
    /// The migrators this one talks to (either way), each with its certificate.
    #[serde(default, rename = "known")]
    pub known: Vec<KnownPeer>,
    /// Files or directories under which every socket and file of a VMM endpoint a peer
    /// names must be (see [`crate::peer::scope`]). None by default: peers can then only
    /// reserve and release functions, never drive a VMM here.
    #[serde(default)]
    pub vmm_paths: Vec<PathBuf>,
}

/// One migrator this one talks to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnownPeer {
    /// Its name, for logs and `--destination-migrator`.
    pub name: String,
    /// Its certificate (PEM); only this exact certificate is accepted from it, whichever
    /// side it is on.
    pub cert: PathBuf,
    /// `host:port` its `[peer] listen` is reached at (needed to send it moves); the host
    /// is the name its certificate must carry.
    #[serde(default)]
    pub address: Option<String>,
}

impl Config {
    /// Reads the config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_and_moves_tables_parse() {
        let text = "[peer]\nlisten = \"0.0.0.0:7478\"\ncert = \"/t/h.pem\"\nkey = \"/t/h.key\"\n\
                    ca = \"/t/ca.pem\"\nvmm_paths = [\"/run/vmms\"]\n\n[[peer.known]]\nname = \"hostA\"\ncert = \"/t/a.pem\"\n\
                    [moves]\nunmanaged = \"ignore\"\n";
        let config: Config = toml::from_str(text).unwrap();
        let peer = config.peer.unwrap();
        assert_eq!(peer.listen.as_deref(), Some("0.0.0.0:7478"));
        assert_eq!(peer.known[0].name, "hostA");
        assert_eq!(peer.vmm_paths, [PathBuf::from("/run/vmms")]);
        assert_eq!(config.moves.unmanaged, UnmanagedPolicy::Ignore);
        assert!(toml::from_str::<Config>("[peer]\nlisten = \"x\"\n").is_err());
        assert!(toml::from_str::<Config>("[moves]\nunmanaged = \"kill\"\n").is_err());
        assert_eq!(Config::default().moves.unmanaged, UnmanagedPolicy::Refuse);
    }

    #[test]
    fn a_missing_or_broken_file_says_which() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.toml");
        assert!(matches!(
            Config::load(&missing),
            Err(ConfigError::Read { .. })
        ));
        let broken = dir.path().join("broken.toml");
        std::fs::write(&broken, "[pool\n").unwrap();
        assert!(matches!(
            Config::load(&broken),
            Err(ConfigError::Parse { .. })
        ));
    }
}
