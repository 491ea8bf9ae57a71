//! Migration progress, as a VMM reports it while a live migration runs.
//!
//! QEMU answers `query-migrate` with a status and, once the migration is under way, times and
//! RAM counters; fields appear as the migration advances, so every number is optional. The
//! parse is kept apart from the socket so that it is tested on QEMU's own answers.
//!
//! A VMM's `downtime` is the source's view only (stop to end of send). How long the guest
//! really did not run ends when the destination starts it: [`vm_paused`] measures it from
//! the source's stop to the destination's start, both stamped by the VMMs.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The bounds a migration is started with: Cloud Hypervisor's `vm.send-migration` fields
/// (`ch-remote send-migration` takes them), which both backends honour.
///
/// Cloud Hypervisor takes all of them as they are. QEMU takes the downtime
/// (`downtime-limit`); its backend enforces the timeout itself (`Cancel`: it cancels the
/// migration, the VM keeps running on the source; `Ignore`: it lifts the downtime limit so
/// the migration completes whatever its stop time) and refuses `local` and `connections`,
/// which have no QEMU counterpart it could set (multifd is configured on the VMM).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationLimits {
    /// The longest stop-and-copy the VMM may choose; `None` leaves the VMM's default
    /// (Cloud Hypervisor: 300 ms).
    #[serde(default, with = "optional_ms", rename = "downtime_ms")]
    pub downtime: Option<Duration>,
    /// The longest the whole migration may take; `None` leaves the VMM's default (Cloud
    /// Hypervisor: one hour; QEMU: none).
    #[serde(default, with = "optional_s", rename = "timeout_s")]
    pub timeout: Option<Duration>,
    /// What happens at the timeout.
    #[serde(default)]
    pub timeout_strategy: TimeoutStrategy,
    /// Same-host migration with the guest's memory handed over as file descriptors (Cloud
    /// Hypervisor, `unix:` URIs, memory `shared=on`).
    #[serde(default)]
    pub local: bool,
    /// Parallel connections for the migration stream (Cloud Hypervisor after v53, `tcp:`
    /// only, [`MAX_MIGRATION_CONNECTIONS`] at most); `None` leaves the VMM's one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<u8>,
}

/// The most parallel connections Cloud Hypervisor takes for one migration.
pub const MAX_MIGRATION_CONNECTIONS: u8 = 128;

/// What a migration does when it reaches its timeout (Cloud Hypervisor's `TimeoutStrategy`,
/// spelled as its API spells it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeoutStrategy {
    /// Abandon the migration; the VM keeps running on the source.
    #[default]
    Cancel,
    /// Finish the migration whatever the downtime.
    Ignore,
}

impl std::str::FromStr for TimeoutStrategy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.to_ascii_lowercase().as_str() {
            "cancel" => Ok(TimeoutStrategy::Cancel),
            "ignore" => Ok(TimeoutStrategy::Ignore),
            _ => Err(format!(
                "{text:?} is not a timeout strategy (cancel or ignore)"
            )),
        }
    }
}

impl std::fmt::Display for TimeoutStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TimeoutStrategy::Cancel => "cancel",
            TimeoutStrategy::Ignore => "ignore",
        })
    }
}

/// `Option<Duration>` as a whole number of ms (a plan is written and read by people).
mod optional_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        value
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

/// `Option<Duration>` as a whole number of s.
mod optional_s {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        value.map(|d| d.as_secs()).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_secs))
    }
}

/// `Option<SystemTime>` as whole µs since the epoch.
mod optional_unix_us {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        value
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SystemTime>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?
            .and_then(|us| UNIX_EPOCH.checked_add(Duration::from_micros(us))))
    }
}

/// Where a migration stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum MigrationStatus {
    /// No migration has been started.
    None,
    /// Connecting and setting up.
    Setup,
    /// Copying RAM while the guest runs.
    Active,
    /// Stop-and-copy of device state.
    Device,
    /// Done: the destination owns the VM.
    Completed,
    /// Ended with an error.
    Failed,
    /// Being cancelled.
    Cancelling,
    /// Cancelled by request.
    Cancelled,
    /// Any other status the VMM reports (postcopy, pre-switchover, wait-unplug, ...).
    Other(String),
}

impl MigrationStatus {
    fn parse(text: &str) -> MigrationStatus {
        match text {
            "none" => MigrationStatus::None,
            "setup" => MigrationStatus::Setup,
            "active" => MigrationStatus::Active,
            "device" => MigrationStatus::Device,
            "completed" => MigrationStatus::Completed,
            "failed" => MigrationStatus::Failed,
            "cancelling" => MigrationStatus::Cancelling,
            "cancelled" => MigrationStatus::Cancelled,
            other => MigrationStatus::Other(other.into()),
        }
    }

    /// Whether the migration has ended (one way or the other).
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            MigrationStatus::Completed | MigrationStatus::Failed | MigrationStatus::Cancelled
        )
    }
}

impl From<String> for MigrationStatus {
    fn from(text: String) -> Self {
        MigrationStatus::parse(&text)
    }
}

impl From<MigrationStatus> for String {
    fn from(status: MigrationStatus) -> Self {
        status.to_string()
    }
}

impl std::fmt::Display for MigrationStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = match self {
            MigrationStatus::None => "none",
            MigrationStatus::Setup => "setup",
            MigrationStatus::Active => "active",
            MigrationStatus::Device => "device",
            MigrationStatus::Completed => "completed",
            MigrationStatus::Failed => "failed",
            MigrationStatus::Cancelling => "cancelling",
            MigrationStatus::Cancelled => "cancelled",
            MigrationStatus::Other(other) => other,
        };
        f.write_str(text)
    }
}

/// One sample of a migration's progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationProgress {
    /// Where it stands.
    pub status: MigrationStatus,
    /// Time since the migration started, in ms.
    pub total_time_ms: Option<u64>,
    /// Time to set up, in ms.
    pub setup_time_ms: Option<u64>,
    /// The guest's stop time (once completed) or the expected one (while active), in ms.
    pub downtime_ms: Option<u64>,
    /// RAM bytes sent so far.
    pub ram_transferred: Option<u64>,
    /// RAM bytes still to send.
    pub ram_remaining: Option<u64>,
    /// The guest's RAM size.
    pub ram_total: Option<u64>,
    /// Throughput, in Mbit/s.
    pub mbps: Option<f64>,
    /// How many times the dirty memory was synchronised (QEMU's `dirty-sync-count`: 2 once
    /// the first pass over all memory is done).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_syncs: Option<u64>,
    /// Why the migration failed, when it did (QEMU's `error-desc`).
    pub error: Option<String>,
    /// On a completed migration's sample: when the source stopped the guest for the
    /// stop-and-copy, by the source host's clock (QEMU's `STOP` event). `None` for a VMM
    /// that does not tell, or a guest that was not running.
    #[serde(default, with = "optional_unix_us", rename = "vm_stopped_at_us")]
    pub vm_stopped_at: Option<SystemTime>,
}

impl MigrationProgress {
    /// Reads a QEMU `query-migrate` answer. Returns `None` if it has no status string.
    pub fn from_qemu(answer: &Value) -> Option<MigrationProgress> {
        let status = MigrationStatus::parse(answer.get("status")?.as_str()?);
        let number = |v: Option<&Value>| v.and_then(Value::as_u64);
        let ram = answer.get("ram");
        let ram_field = |name: &str| number(ram.and_then(|r| r.get(name)));
        let downtime =
            number(answer.get("downtime")).or_else(|| number(answer.get("expected-downtime")));
        Some(MigrationProgress {
            status,
            total_time_ms: number(answer.get("total-time")),
            setup_time_ms: number(answer.get("setup-time")),
            downtime_ms: downtime,
            ram_transferred: ram_field("transferred"),
            ram_remaining: ram_field("remaining"),
            ram_total: ram_field("total"),
            mbps: ram.and_then(|r| r.get("mbps")).and_then(Value::as_f64),
            ram_syncs: ram_field("dirty-sync-count"),
            error: answer
                .get("error-desc")
                .and_then(Value::as_str)
                .map(String::from),
            vm_stopped_at: None,
        })
    }
}

/// How long a migrated guest did not run: from the source stopping it (`stopped`) to the
/// destination starting it (`started`).
///
/// The two times come from two VMMs' wall clocks: on one host they share a clock; across
/// hosts the figure is only as good as their clock synchronisation. `None` when either
/// time is missing, or when the start comes before the stop (clocks apart): no figure
/// rather than a wrong one.
pub fn vm_paused(stopped: Option<SystemTime>, started: Option<SystemTime>) -> Option<Duration> {
    started?.duration_since(stopped?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::UNIX_EPOCH;

    #[test]
    fn reads_a_completed_answer() {
        // As QEMU 7.2 answered on the test bed.
        let answer = json!({"status": "completed", "setup-time": 0, "downtime": 2,
            "total-time": 15, "ram": {"total": 134750208, "remaining": 0,
            "mbps": 339.568, "transferred": 505019, "duplicate": 32847}});
        let p = MigrationProgress::from_qemu(&answer).unwrap();
        assert_eq!(p.status, MigrationStatus::Completed);
        assert!(p.status.is_final());
        assert_eq!(p.total_time_ms, Some(15));
        assert_eq!(p.downtime_ms, Some(2));
        assert_eq!(p.setup_time_ms, Some(0));
        assert_eq!(p.ram_transferred, Some(505019));
        assert_eq!(p.ram_remaining, Some(0));
        assert_eq!(p.ram_total, Some(134750208));
        assert_eq!(p.mbps, Some(339.568));
        assert_eq!(p.error, None);
    }

    #[test]
    fn reads_early_and_failed_answers() {
        let p = MigrationProgress::from_qemu(&json!({"status": "setup"})).unwrap();
        assert_eq!(p.status, MigrationStatus::Setup);
        assert!(!p.status.is_final());
        assert_eq!(p.total_time_ms, None);
        let p = MigrationProgress::from_qemu(
            &json!({"status": "failed", "error-desc": "Unable to write to socket: Broken pipe"}),
        )
        .unwrap();
        assert_eq!(p.status, MigrationStatus::Failed);
        assert_eq!(
            p.error.as_deref(),
            Some("Unable to write to socket: Broken pipe")
        );
        let p = MigrationProgress::from_qemu(
            &json!({"status": "active", "expected-downtime": 300, "ram": {"transferred": 1}}),
        )
        .unwrap();
        assert_eq!(p.downtime_ms, Some(300));
        let p = MigrationProgress::from_qemu(&json!({"status": "postcopy-active"})).unwrap();
        assert_eq!(p.status, MigrationStatus::Other("postcopy-active".into()));
        assert_eq!(p.status.to_string(), "postcopy-active");
        assert_eq!(
            serde_json::to_value(&p.status).unwrap(),
            json!("postcopy-active")
        );
        assert_eq!(
            serde_json::from_value::<MigrationStatus>(json!("cancelled")).unwrap(),
            MigrationStatus::Cancelled
        );
    }

    #[test]
    fn limits_read_as_the_api_writes_them() {
        let limits = MigrationLimits {
            downtime: Some(Duration::from_millis(250)),
            timeout: Some(Duration::from_secs(60)),
            timeout_strategy: TimeoutStrategy::Ignore,
            local: true,
            connections: Some(16),
        };
        let value = serde_json::to_value(limits).unwrap();
        assert_eq!(
            value,
            json!({"downtime_ms": 250, "timeout_s": 60, "timeout_strategy": "Ignore", "local": true,
                   "connections": 16})
        );
        assert_eq!(
            serde_json::from_value::<MigrationLimits>(value).unwrap(),
            limits
        );
        assert_eq!(
            serde_json::from_value::<MigrationLimits>(json!({})).unwrap(),
            MigrationLimits::default()
        );
        assert_eq!("IGNORE".parse(), Ok(TimeoutStrategy::Ignore));
        assert!("later".parse::<TimeoutStrategy>().is_err());
    }

    #[test]
    fn the_pause_runs_from_the_stop_to_the_start() {
        let stop = UNIX_EPOCH + Duration::from_micros(1_764_448_995_123_456);
        let start = stop + Duration::from_micros(151_250);
        assert_eq!(
            vm_paused(Some(stop), Some(start)),
            Some(Duration::from_micros(151_250))
        );
        assert_eq!(vm_paused(Some(stop), Some(stop)), Some(Duration::ZERO));
        // A start before the stop (two hosts' clocks apart) is no figure, never a negative.
        assert_eq!(vm_paused(Some(start), Some(stop)), None);
        assert_eq!(vm_paused(None, Some(start)), None);
        assert_eq!(vm_paused(Some(stop), None), None);
    }

    #[test]
    fn the_stop_time_travels_as_microseconds() {
        let mut p = MigrationProgress::from_qemu(&json!({"status": "completed"})).unwrap();
        assert_eq!(p.vm_stopped_at, None);
        p.vm_stopped_at = Some(UNIX_EPOCH + Duration::from_micros(1_764_448_995_123_456));
        let value = serde_json::to_value(&p).unwrap();
        assert_eq!(value["vm_stopped_at_us"], json!(1_764_448_995_123_456u64));
        assert_eq!(
            serde_json::from_value::<MigrationProgress>(value).unwrap(),
            p
        );
        let mut old = serde_json::to_value(&p).unwrap();
        old.as_object_mut().unwrap().remove("vm_stopped_at_us");
        assert_eq!(
            serde_json::from_value::<MigrationProgress>(old)
                .unwrap()
                .vm_stopped_at,
            None
        );
    }

    #[test]
    fn no_status_is_no_progress() {
        assert_eq!(MigrationProgress::from_qemu(&json!({})), None);
        assert_eq!(MigrationProgress::from_qemu(&json!({"status": 3})), None);
        assert_eq!(MigrationProgress::from_qemu(&json!([])), None);
    }
}
