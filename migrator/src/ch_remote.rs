//! `ch-remote`'s own syntax for a migration, so that a script that runs
//! `ch-remote --api-socket PATH send-migration destination_url=tcp:HOST:PORT,downtime_ms=200`
//! runs `rdmamig-vmm` with the same words.
//!
//! ch-remote takes one comma-separated `key=value` list after the verb
//! (../shared/cloud-hypervisor/NOTES.md, "ch-remote's own syntax"). The keys of
//! `send-migration` and `receive-migration` are the fields of Cloud Hypervisor's
//! `vm.send-migration` and `vm.receive-migration` bodies ([`MigrationLimits`] carries the
//! bounds); an unknown key, a key given twice or a value out of range is refused with the
//! key's name, as ch-remote refuses it, and so are ch-remote's keys rdmamig does not pass on
//! yet. `vfio_fds=[id@fd]` and `iommufd_fd=N` name descriptors the caller opened (ch-remote's
//! way: `exec 5<>/dev/vfio/devices/vfio0`); they are handed to the VMM with the request.

use std::os::fd::RawFd;
use std::path::PathBuf;
use std::time::Duration;

use rdmamig_vmm::{MigrationLimits, TimeoutStrategy, MAX_MIGRATION_CONNECTIONS};
use thiserror::Error;

/// One verb's option list: the keys it takes, and ch-remote's keys rdmamig refuses for now.
struct Verb {
    name: &'static str,
    keys: &'static [&'static str],
    not_yet: &'static [(&'static str, &'static str)],
}

/// `send-migration`: the fields of `vm.send-migration`.
const SEND_MIGRATION: Verb = Verb {
    name: "send-migration",
    keys: &[
        "destination_url",
        "local",
        "downtime_ms",
        "timeout_s",
        "timeout_strategy",
        "connections",
        "tls_dir",
    ],
    not_yet: &[("memory_mode", "rdmamig moves with precopy only")],
};

/// `receive-migration`: the fields of `vm.receive-migration`.
const RECEIVE_MIGRATION: Verb = Verb {
    name: "receive-migration",
    keys: &["receiver_url", "tls_dir", "vfio_fds", "iommufd_fd"],
    not_yet: &[],
};

/// What is wrong with a ch-remote option list.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChRemoteError {
    /// A key the verb does not take.
    #[error("unknown option: {key} ({verb} takes {})", takes.join(", "))]
    UnknownOption {
        /// The verb.
        verb: &'static str,
        /// The key.
        key: String,
        /// The keys the verb takes.
        takes: &'static [&'static str],
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
        key: &'static str,
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
    /// The URL is missing.
    #[error("{key} is missing ({key}=tcp:HOST:PORT or unix:PATH)")]
    NoUrl {
        /// `destination_url` or `receiver_url`.
        key: &'static str,
    },
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

/// `receive-migration`'s options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveMigration {
    /// `tcp:HOST:PORT` or `unix:PATH` to listen on.
    pub receiver_url: String,
    /// The destination's TLS folder (CA, server certificate and key).
    pub tls_dir: Option<PathBuf>,
    /// `vfio_fds=[id@fd,...]`: VFIO devices handed to the receiver, each by its id in the
    /// VM's config and a descriptor the caller opened (its VFIO cdev).
    pub vfio_fds: Vec<(String, RawFd)>,
    /// `iommufd_fd=N`: a `/dev/iommu` descriptor the caller opened.
    pub iommufd_fd: Option<RawFd>,
}

impl ReceiveMigration {
    /// Every descriptor number the options name.
    pub fn fds(&self) -> impl Iterator<Item = RawFd> + '_ {
        self.vfio_fds
            .iter()
            .map(|(_, fd)| *fd)
            .chain(self.iommufd_fd)
    }
}

/// Whether `text` is a ch-remote option list rather than a bare URL (`tcp:`, `unix:`).
pub fn is_option_list(text: &str) -> bool {
    !(text.starts_with("tcp:") || text.starts_with("unix:")) && text.contains('=')
}

/// Splits `options` into the verb's keys and their values: every key known, none twice.
fn items<'a>(verb: &Verb, options: &'a str) -> Result<Vec<(&'static str, &'a str)>, ChRemoteError> {
    let mut items: Vec<(&'static str, &str)> = Vec::new();
    for item in split_items(options).filter(|item| !item.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| ChRemoteError::NotKeyValue {
                item: item.to_string(),
            })?;
        if let Some((key, reason)) = verb.not_yet.iter().find(|(k, _)| *k == key) {
            return Err(ChRemoteError::NotYet { key, reason });
        }
        let key = *verb
            .keys
            .iter()
            .find(|known| **known == key)
            .ok_or_else(|| ChRemoteError::UnknownOption {
                verb: verb.name,
                key: key.to_string(),
                takes: verb.keys,
            })?;
        if items.iter().any(|(k, _)| *k == key) {
            return Err(ChRemoteError::Repeated { key });
        }
        items.push((key, value));
    }
    Ok(items)
}

/// The option list's items: split at commas outside brackets (`vfio_fds=[a@5,b@6]` is one).
fn split_items(options: &str) -> impl Iterator<Item = &str> {
    let mut depth = 0usize;
    let mut start = 0;
    let mut items = Vec::new();
    for (at, c) in options.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&options[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    items.push(&options[start..]);
    items.into_iter()
}

/// A descriptor number the caller opened: 3 or more (0-2 are the standard streams).
fn descriptor(key: &'static str, value: &str) -> Result<RawFd, ChRemoteError> {
    value
        .parse::<RawFd>()
        .ok()
        .filter(|fd| *fd >= 3)
        .ok_or_else(|| ChRemoteError::BadValue {
            key,
            value: value.to_string(),
            reason: "a descriptor number, 3 or more, open in the caller (exec 5<>/dev/...)",
        })
}

/// `vfio_fds=[id@fd,...]`.
fn vfio_fds(value: &str) -> Result<Vec<(String, RawFd)>, ChRemoteError> {
    let bad = || ChRemoteError::BadValue {
        key: "vfio_fds",
        value: value.to_string(),
        reason: "[id@fd,...] with ids and descriptor numbers (3 or more)",
    };
    let list = value
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .ok_or_else(bad)?;
    let mut devices: Vec<(String, RawFd)> = Vec::new();
    for entry in list.split(',') {
        let (id, fd) = entry.split_once('@').ok_or_else(bad)?;
        let fd = descriptor("vfio_fds", fd).map_err(|_| bad())?;
        if id.is_empty() || devices.iter().any(|(known, _)| known == id) {
            return Err(bad());
        }
        devices.push((id.to_string(), fd));
    }
    Ok(devices)
}

/// A migration URL, as Cloud Hypervisor takes it.
fn url(key: &'static str, value: &str) -> Result<String, ChRemoteError> {
    if value.starts_with("tcp:") || value.starts_with("unix:") {
        Ok(value.to_string())
    } else {
        Err(ChRemoteError::BadValue {
            key,
            value: value.to_string(),
            reason: "not a tcp:HOST:PORT or unix:PATH URL",
        })
    }
}

/// A TLS folder.
fn folder(key: &'static str, value: &str) -> Result<PathBuf, ChRemoteError> {
    if value.is_empty() {
        return Err(ChRemoteError::BadValue {
            key,
            value: String::new(),
            reason: "a folder",
        });
    }
    Ok(PathBuf::from(value))
}

/// Parses `send-migration`'s option list.
pub fn parse_send_migration(options: &str) -> Result<SendMigration, ChRemoteError> {
    let mut destination_url = None;
    let mut limits = MigrationLimits::default();
    let mut tls_dir = None;
    let items = items(&SEND_MIGRATION, options)?;
    for &(key, value) in &items {
        let bad = |reason| ChRemoteError::BadValue {
            key,
            value: value.to_string(),
            reason,
        };
        match key {
            "destination_url" => destination_url = Some(url(key, value)?),
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
            "tls_dir" => tls_dir = Some(folder(key, value)?),
            _ => unreachable!("every key of send-migration is matched"),
        }
    }
    Ok(SendMigration {
        destination_url: destination_url.ok_or(ChRemoteError::NoUrl {
            key: "destination_url",
        })?,
        limits,
        tls_dir,
        given: items.iter().map(|(key, _)| *key).collect(),
    })
}

/// Parses `receive-migration`'s option list.
pub fn parse_receive_migration(options: &str) -> Result<ReceiveMigration, ChRemoteError> {
    let mut receiver_url = None;
    let mut tls_dir = None;
    let mut devices = Vec::new();
    let mut iommufd_fd = None;
    for (key, value) in items(&RECEIVE_MIGRATION, options)? {
        match key {
            "receiver_url" => receiver_url = Some(url(key, value)?),
            "tls_dir" => tls_dir = Some(folder(key, value)?),
            "vfio_fds" => devices = vfio_fds(value)?,
            "iommufd_fd" => iommufd_fd = Some(descriptor(key, value)?),
            _ => unreachable!("every key of receive-migration is matched"),
        }
    }
    let parsed = ReceiveMigration {
        receiver_url: receiver_url.ok_or(ChRemoteError::NoUrl {
            key: "receiver_url",
        })?,
        tls_dir,
        vfio_fds: devices,
        iommufd_fd,
    };
    let mut seen = Vec::new();
    for fd in parsed.fds() {
        if seen.contains(&fd) {
            return Err(ChRemoteError::BadValue {
                key: "vfio_fds",
                value: fd.to_string(),
                reason: "each descriptor may be handed over once",
            });
        }
        seen.push(fd);
    }
    if !parsed.vfio_fds.is_empty() && parsed.iommufd_fd.is_none() {
        return Err(ChRemoteError::BadValue {
            key: "iommufd_fd",
            value: String::new(),
            reason: "needed with vfio_fds (a /dev/iommu descriptor for the devices)",
        });
    }
    Ok(parsed)
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
        assert_eq!(parsed.given.len(), SEND_MIGRATION.keys.len());
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
    fn receive_migration_takes_its_url_tls_folder_and_handed_devices() {
        assert_eq!(
            parse_receive_migration("receiver_url=tcp:0.0.0.0:6000,tls_dir=/etc/ch/tls").unwrap(),
            ReceiveMigration {
                receiver_url: "tcp:0.0.0.0:6000".into(),
                tls_dir: Some("/etc/ch/tls".into()),
                vfio_fds: Vec::new(),
                iommufd_fd: None,
            }
        );
        let handed = parse_receive_migration(
            "receiver_url=tcp:0.0.0.0:6000,vfio_fds=[vfio0@5,vfio1@7],iommufd_fd=6",
        )
        .unwrap();
        assert_eq!(
            handed.vfio_fds,
            [("vfio0".to_string(), 5), ("vfio1".to_string(), 7)]
        );
        assert_eq!(handed.iommufd_fd, Some(6));
        assert_eq!(handed.fds().collect::<Vec<_>>(), [5, 7, 6]);
        for (options, error) in [
            (
                "receiver_url=tcp:0.0.0.0:6000,vfio_fds=[vfio0@5]",
                "iommufd_fd=: needed with vfio_fds",
            ),
            (
                "receiver_url=tcp:0.0.0.0:6000,vfio_fds=vfio0@5,iommufd_fd=6",
                "vfio_fds=vfio0@5: [id@fd,...]",
            ),
            (
                "receiver_url=tcp:0.0.0.0:6000,vfio_fds=[vfio0@1],iommufd_fd=6",
                "vfio_fds=[vfio0@1]: [id@fd,...]",
            ),
            (
                "receiver_url=tcp:0.0.0.0:6000,vfio_fds=[a@5,a@7],iommufd_fd=6",
                "vfio_fds=[a@5,a@7]",
            ),
            (
                "receiver_url=tcp:0.0.0.0:6000,vfio_fds=[a@5],iommufd_fd=5",
                "vfio_fds=5: each descriptor may be handed over once",
            ),
            (
                "receiver_url=tcp:0.0.0.0:6000,iommufd_fd=x",
                "iommufd_fd=x: a descriptor number",
            ),
            (
                "receiver_url=tcp:0.0.0.0:6000,downtime_ms=5",
                "unknown option: downtime_ms (receive-migration takes receiver_url, tls_dir, \
                 vfio_fds, iommufd_fd)",
            ),
            ("tls_dir=/etc/ch/tls", "receiver_url is missing"),
        ] {
            let e = parse_receive_migration(options).unwrap_err().to_string();
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
