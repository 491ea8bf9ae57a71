//! Cloud Hypervisor's event monitor (`--event-monitor path=FILE`): how a migration's
//! outcome becomes known.
//!
//! `vm.send-migration` answers 204 as soon as its worker starts, so the answer says nothing
//! about the outcome. The VMM then writes events to the monitor: a stream of pretty-printed
//! JSON objects `{"timestamp":{..},"source":"vm","event":E,"properties":P}` with no
//! separator. [`EventReader`] reads the file from an offset (events from earlier migrations
//! are skipped), keeps an incomplete trailing object for the next read, and turns
//! `migration-*` events into [`MigrationProgress`] samples.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::{MigrationProgress, MigrationStatus};

/// Longest incomplete object kept between reads; a monitor that writes more without
/// finishing an object is not one.
const MAX_PENDING: usize = 1 << 20;

/// One event.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Event {
    /// `vm`, `vmm`, `virtio-device`, ...
    pub source: String,
    /// `migration-started`, `migration-finished`, ...
    pub event: String,
    /// Event-specific properties (`null` when none).
    #[serde(default)]
    pub properties: Value,
}

/// Why the event monitor could not be read.
#[derive(Debug, Error)]
pub enum EventError {
    /// Opening or reading the file failed.
    #[error("cannot read the event monitor {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What read said.
        #[source]
        source: std::io::Error,
    },
    /// The file holds something that is not a stream of events.
    #[error("the event monitor {path} holds something that is not an event: {reason}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Reads new events from an event monitor file.
#[derive(Debug)]
pub struct EventReader {
    path: PathBuf,
    offset: u64,
    pending: Vec<u8>,
}

impl EventReader {
    /// A reader that sees only what is written to `path` from now on (an absent file is
    /// read from its start once it appears).
    pub async fn from_end(path: &Path) -> Result<EventReader, EventError> {
        let offset = match tokio::fs::metadata(path).await {
            Ok(meta) => meta.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(source) => {
                return Err(EventError::Read {
                    path: path.into(),
                    source,
                })
            }
        };
        Ok(EventReader {
            path: path.into(),
            offset,
            pending: Vec::new(),
        })
    }

    /// The events completed since the last call.
    pub async fn poll(&mut self) -> Result<Vec<Event>, EventError> {
        let read = |source| EventError::Read {
            path: self.path.clone(),
            source,
        };
        let mut file = match tokio::fs::File::open(&self.path).await {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(read(e)),
        };
        file.seek(std::io::SeekFrom::Start(self.offset))
            .await
            .map_err(read)?;
        let mut fresh = Vec::new();
        file.read_to_end(&mut fresh).await.map_err(read)?;
        self.offset += fresh.len() as u64;
        self.pending.extend_from_slice(&fresh);
        let (events, used) =
            parse_events(&self.pending).map_err(|reason| EventError::Malformed {
                path: self.path.clone(),
                reason,
            })?;
        self.pending.drain(..used);
        if self.pending.len() > MAX_PENDING {
            return Err(EventError::Malformed {
                path: self.path.clone(),
                reason: format!("{} bytes without a complete event", self.pending.len()),
            });
        }
        Ok(events)
    }
}

/// Parses the complete events at the start of `bytes`; returns them and how many bytes they
/// took. An incomplete trailing object is left for later.
pub fn parse_events(bytes: &[u8]) -> Result<(Vec<Event>, usize), String> {
    let mut stream = serde_json::Deserializer::from_slice(bytes).into_iter::<Value>();
    let mut events = Vec::new();
    let mut used = 0;
    loop {
        match stream.next() {
            None => return Ok((events, bytes.len())),
            Some(Ok(value)) => {
                used = stream.byte_offset();
                let event = Event::deserialize(&value).map_err(|e| format!("{e}: {value}"))?;
                events.push(event);
            }
            Some(Err(e)) if e.is_eof() => return Ok((events, used)),
            Some(Err(e)) => return Err(e.to_string()),
        }
    }
}

/// What a VM event means for an outgoing migration, `None` for events that say nothing
/// about it.
pub fn migration_status(event: &Event) -> Option<MigrationStatus> {
    if event.source != "vm" {
        return None;
    }
    Some(match event.event.as_str() {
        "migration-started" | "migration-memory-iteration" => MigrationStatus::Active,
        // The stop-and-copy: vCPUs stopped, device state being sent.
        "pausing" | "paused" | "snapshotting" => MigrationStatus::Device,
        "migration-finished" => MigrationStatus::Completed,
        "migration-failed" => MigrationStatus::Failed,
        _ => return None,
    })
}

/// A progress sample for `event`, `elapsed_ms` after the migration was sent.
pub fn progress(event: &Event, elapsed_ms: u64) -> Option<MigrationProgress> {
    let status = migration_status(event)?;
    let error = (status == MigrationStatus::Failed).then(|| {
        match event.properties.get("error").and_then(Value::as_str) {
            Some(reason) => reason.to_string(),
            None => "Cloud Hypervisor reported migration-failed (its log has the cause)".into(),
        }
    });
    Some(MigrationProgress {
        status,
        total_time_ms: Some(elapsed_ms),
        setup_time_ms: None,
        downtime_ms: None,
        ram_transferred: None,
        ram_remaining: None,
        ram_total: None,
        mbps: None,
        ram_syncs: None,
        error,
        vm_stopped_at: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As Cloud Hypervisor writes them: pretty-printed, back to back.
    const STREAM: &str = r#"{
  "timestamp": {
    "secs": 0,
    "nanos": 5432
  },
  "source": "vm",
  "event": "migration-started",
  "properties": null
}{
  "timestamp": {
    "secs": 1,
    "nanos": 1
  },
  "source": "vm",
  "event": "migration-memory-iteration",
  "properties": {
    "id": "0"
  }
}
{
  "timestamp": {"secs": 2, "nanos": 0},
  "source": "vm",
  "event": "migration-finished",
  "properties": null
}
"#;

    #[test]
    fn parses_back_to_back_pretty_objects() {
        let (events, used) = parse_events(STREAM.as_bytes()).unwrap();
        assert_eq!(used, STREAM.len());
        let names: Vec<_> = events.iter().map(|e| e.event.as_str()).collect();
        assert_eq!(
            names,
            [
                "migration-started",
                "migration-memory-iteration",
                "migration-finished"
            ]
        );
        assert_eq!(events[1].properties["id"], "0");
        assert_eq!(
            migration_status(&events[2]),
            Some(MigrationStatus::Completed)
        );
    }

    #[test]
    fn every_prefix_yields_only_complete_events() {
        let full = parse_events(STREAM.as_bytes()).unwrap().0;
        for cut in 0..STREAM.len() {
            let (events, used) = parse_events(&STREAM.as_bytes()[..cut]).unwrap();
            assert!(used <= cut);
            assert_eq!(events[..], full[..events.len()], "cut at {cut}");
            // Continuing from `used` with the rest gives the remaining events.
            let (rest, _) = parse_events(&STREAM.as_bytes()[used..]).unwrap();
            assert_eq!(events.len() + rest.len(), full.len(), "cut at {cut}");
        }
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(parse_events(b"{\"source\": 3}").is_err());
        assert!(parse_events(b"]").is_err());
    }

    #[test]
    fn failure_carries_a_reason() {
        let event = Event {
            source: "vm".into(),
            event: "migration-failed".into(),
            properties: Value::Null,
        };
        let sample = progress(&event, 12).unwrap();
        assert_eq!(sample.status, MigrationStatus::Failed);
        assert!(sample.error.unwrap().contains("migration-failed"));
        let other = Event {
            source: "vm".into(),
            event: "migration-receive-started".into(),
            properties: Value::Null,
        };
        assert_eq!(migration_status(&other), None);
    }

    #[tokio::test]
    async fn reader_follows_a_growing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.json");
        tokio::fs::write(&path, &STREAM[..50]).await.unwrap();
        // Starts at the end: what was there before is not this migration's.
        let mut reader = EventReader::from_end(&path).await.unwrap();
        assert!(reader.poll().await.unwrap().is_empty());
        let fresh = r#"{"timestamp":{"secs":3,"nanos":0},"source":"vm","event":"migration-failed","properties":null}"#;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut file, &fresh.as_bytes()[..20]).unwrap();
        assert!(reader.poll().await.unwrap().is_empty());
        std::io::Write::write_all(&mut file, &fresh.as_bytes()[20..]).unwrap();
        let events = reader.poll().await.unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(migration_status(&events[0]), Some(MigrationStatus::Failed));
    }
}
