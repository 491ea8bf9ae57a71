//! `ch-remote`'s own syntax for a migration, so that a script that runs
//! `ch-remote --api-socket PATH send-migration destination_url=tcp:HOST:PORT,downtime_ms=200`
//! runs `rdmamig-vmm` with the same words.
//!
//! ch-remote takes one comma-separated `key=value` list after the verb
//! (../shared/cloud-hypervisor/NOTES.md, "ch-remote's own syntax"). The keys of
//! `send-migration` are the fields of Cloud Hypervisor's `vm.send-migration` body, which
//! [`MigrationLimits`] carries; an unknown key, a key given twice or a value out of range is
//! refused with the key's name, as ch-remote refuses it.

use std::path::PathBuf;
use std::time::Duration;

use rdmamig_vmm::{MigrationLimits, TimeoutStrategy, MAX_MIGRATION_CONNECTIONS};
use thiserror::Error;

/// The keys `send-migration` takes.
pub const SEND_MIGRATION_KEYS: &[&str] = &[
    "destination_url",
    "local",
    "downtime_ms",
    "timeout_s",
    "timeout_strategy",
    "connections",
    "tls_dir",
];

/// Keys of ch-remote's `send-migration` that rdmamig does not pass on yet, and why.
const NOT_YET: &[(&str, &str)] = &[("memory_mode", "rdmamig moves with precopy only")];

/// What is wrong with a ch-remote option list.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChRemoteError {
    /// A key the verb does not take.
    #[error("unknown option: {key} (send-migration takes {})", SEND_MIGRATION_KEYS.join(", "))]
    UnknownOption {
        /// The key.
        key: String,
    },
    /// An item without `=`.
    #[error("{item:?} is not key=value")]
    NotKeyValue {
        /// The item.
        item: String,
    },
    /// A key of ch-remote's that rdmamig does not pass on yet.
    #[error("{key} is not supported yet: {reason}")]
    NotYet {
        /// The key.
        key: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// The same key twice.
    #[error("{key} is given twice")]
    Repeated {
        /// The key.
        key: String,
    },
    /// A value the key cannot take.
    #[error("{key}={value}: {reason}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What the key takes.
        reason: &'static str,
    },
    /// `destination_url` is missing.
    #[error("destination_url is missing (destination_url=tcp:HOST:PORT or unix:PATH)")]
    NoDestination,
}

/// `send-migration`'s options: where the stream goes, and the migration's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendMigration {
    /// `tcp:HOST:PORT` or `unix:PATH`.
    pub destination_url: String,
    /// The bounds; a key not given leaves the VMM's default.
    pub limits: MigrationLimits,
    /// The source's TLS folder for the stream (a property of the source VMM's endpoint,
    /// not a bound).
    pub tls_dir: Option<PathBuf>,
    /// The keys that were given, so that a caller can refuse the same bound given twice
    /// (once here and once as a flag).
    pub given: Vec<&'static str>,
}

/// Whether `text` is a ch-remote option list rather than a bare URL (`tcp:`, `unix:`).
pub fn is_option_list(text: &str) -> bool {
    !(text.starts_with("tcp:") || text.starts_with("unix:")) && text.contains('=')
}

/// Parses `send-migration`'s option list.
pub fn parse_send_migration(options: &str) -> Result<SendMigration, ChRemoteError> {
    let mut destination_url = None;
    let mut limits = MigrationLimits::default();
    let mut tls_dir = None;
    let mut given: Vec<&'static str> = Vec::new();
    for item in options.split(',').filter(|item| !item.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| ChRemoteError::NotKeyValue {
                item: item.to_string(),
            })?;
        if let Some((key, reason)) = NOT_YET.iter().find(|(k, _)| *k == key) {
            return Err(ChRemoteError::NotYet { key, reason });
        }
        let key = *SEND_MIGRATION_KEYS
            .iter()
            .find(|known| **known == key)
            .ok_or_else(|| ChRemoteError::UnknownOption {
                key: key.to_string(),
            })?;
        if given.contains(&key) {
            return Err(ChRemoteError::Repeated { key: key.into() });
        }
        given.push(key);
        let bad = |reason| ChRemoteError::BadValue {
            key,
            value: value.to_string(),
            reason,
        };
        match key {
            "destination_url" if value.starts_with("tcp:") || value.starts_with("unix:") => {
                destination_url = Some(value.to_string());
            }
            "destination_url" => return Err(bad("not a tcp:HOST:PORT or unix:PATH URL")),
            "local" => limits.local = toggle(value).ok_or_else(|| bad("on or off"))?,
            "downtime_ms" => {
                let ms = positive(value).ok_or_else(|| bad("a whole number of ms, 1 or more"))?;
                limits.downtime = Some(Duration::from_millis(ms));
            }
            "timeout_s" => {
                let s = positive(value).ok_or_else(|| bad("a whole number of s, 1 or more"))?;
                limits.timeout = Some(Duration::from_secs(s));
            }
            "timeout_strategy" => {
                limits.timeout_strategy = value
                    .parse::<TimeoutStrategy>()
                    .map_err(|_| bad("cancel or ignore"))?;
            }
            "connections" => {
                let n = value
                    .parse::<u8>()
                    .ok()
                    .filter(|n| (1..=MAX_MIGRATION_CONNECTIONS).contains(n))
                    .ok_or_else(|| bad("1 to 128"))?;
                limits.connections = Some(n);
            }
            "tls_dir" if !value.is_empty() => tls_dir = Some(PathBuf::from(value)),
            "tls_dir" => return Err(bad("a folder")),
            _ => unreachable!("every key of SEND_MIGRATION_KEYS is matched"),
        }
    }
    let destination_url = destination_url.ok_or(ChRemoteError::NoDestination)?;
    Ok(SendMigration {
        destination_url,
        limits,
        tls_dir,
        given,
    })
}

/// ch-remote's on/off values.
fn toggle(value: &str) -> Option<bool> {
    match value {
        "on" | "true" => Some(true),
        "off" | "false" => Some(false),
        _ => None,
    }
}

fn positive(value: &str) -> Option<u64> {
    value.parse::<u64>().ok().filter(|n| *n >= 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_of_send_migration_reaches_the_limits() {
        let parsed = parse_send_migration(
            "destination_url=tcp:dst-host:6000,downtime_ms=200,timeout_s=3600,\
             timeout_strategy=ignore,connections=4,tls_dir=/etc/ch/tls,local=off",
        )
        .unwrap();
        assert_eq!(parsed.destination_url, "tcp:dst-host:6000");
        assert_eq!(
            parsed.limits,
            MigrationLimits {
                downtime: Some(Duration::from_millis(200)),
                timeout: Some(Duration::from_secs(3600)),
                timeout_strategy: TimeoutStrategy::Ignore,
                local: false,
                connections: Some(4),
            }
        );
        assert_eq!(parsed.tls_dir, Some(PathBuf::from("/etc/ch/tls")));
        assert_eq!(parsed.given.len(), SEND_MIGRATION_KEYS.len());
    }

    #[test]
    fn a_local_migration_to_a_unix_socket() {
        let parsed =
            parse_send_migration("destination_url=unix:/run/vm1/mig.sock,local=on").unwrap();
        assert_eq!(parsed.destination_url, "unix:/run/vm1/mig.sock");
        assert!(parsed.limits.local);
        assert_eq!(
            parsed.limits.downtime, None,
            "a key not given keeps the VMM's default"
        );
    }

    #[test]
    fn bad_option_lists_are_refused_naming_the_key() {
        for (options, error) in [
            (
                "destination_url=tcp:h:1,bandwidth=10",
                "unknown option: bandwidth",
            ),
            (
                "destination_url=tcp:h:1,memory_mode=postcopy",
                "memory_mode is not supported yet",
            ),
            ("destination_url=tcp:h:1,tls_dir=", "tls_dir=: a folder"),
            (
                "destination_url=tcp:h:1,downtime_ms",
                "\"downtime_ms\" is not key=value",
            ),
            (
                "destination_url=tcp:h:1,downtime_ms=5,downtime_ms=6",
                "downtime_ms is given twice",
            ),
            (
                "destination_url=tcp:h:1,downtime_ms=0",
                "downtime_ms=0: a whole number of ms",
            ),
            (
                "destination_url=tcp:h:1,timeout_s=-1",
                "timeout_s=-1: a whole number of s",
            ),
            (
                "destination_url=tcp:h:1,connections=129",
                "connections=129: 1 to 128",
            ),
            (
                "destination_url=tcp:h:1,connections=0",
                "connections=0: 1 to 128",
            ),
            (
                "destination_url=tcp:h:1,timeout_strategy=wait",
                "cancel or ignore",
            ),
            ("destination_url=tcp:h:1,local=yes", "local=yes: on or off"),
            (
                "destination_url=dst-host:6000",
                "not a tcp:HOST:PORT or unix:PATH URL",
            ),
            ("downtime_ms=200", "destination_url is missing"),
        ] {
            let e = parse_send_migration(options).unwrap_err().to_string();
            assert!(e.contains(error), "{options}: {e}");
        }
    }

    #[test]
    fn a_bare_url_is_not_an_option_list() {
        assert!(!is_option_list("tcp:dst-host:6000"));
        assert!(!is_option_list("unix:/run/a=b/mig.sock"));
        assert!(is_option_list("destination_url=tcp:dst-host:6000"));
        assert!(
            !is_option_list("dst-host:6000"),
            "neither: the URL check refuses it"
        );
    }
}
