//! The QEMU backend of [`Vmm`]: QMP for control, a virtio-serial chardev socket for the agent.
//!
//! The mapping is direct: `query-status`, `stop`/`cont`, `device_del` + `DEVICE_DELETED`,
//! `netdev_add`, `device_add` (then `query-pci` for the address the guest sees),
//! `migrate-incoming`,
//! `migrate-set-parameters` + `migrate`, `query-migrate` (polled), `migrate_cancel`, `quit`.
//! QEMU has no migration timeout of its own: [`Vmm::wait_migration`] enforces
//! [`MigrationLimits::timeout`] with Cloud Hypervisor's strategies (cancel the migration, or
//! lift the downtime limit so it completes), so that both backends end it the same way.
//! QEMU's error classes are translated into [`VmmError`]'s kinds here and nowhere else.
//! How long the guest did not run during a migration comes from QEMU's own event stamps:
//! the source's `STOP` and the destination's `RESUME`, each watched from before the command
//! that starts that side's migration.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use rdmamig_proto::clock::millis;
use serde_json::{json, Value};
use tokio::net::UnixStream;

use crate::qmp::{EventStream, QmpClient, QmpError};
use crate::{AddedDevice, AgentStream, DeviceSpec, MigrationLimits, MigrationProgress};
use crate::{Held, MigrationStatus, ProgressFn, TimeoutStrategy, Vmm};
use crate::{VfioHandover, VmPhase, VmStatus, VmmError};

/// How to reach one QEMU process.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// The QMP socket (`-qmp unix:PATH,server=on,wait=off`).
    pub qmp: PathBuf,
    /// The agent's virtio-serial chardev socket, if the VM has one.
    pub agent: Option<PathBuf>,
    /// Wait for the QMP greeting.
    pub connect_timeout: Duration,
    /// Wait for the answer to each QMP command.
    pub answer_timeout: Duration,
    /// Interval between two `query-migrate` samples.
    pub poll_interval: Duration,
}

impl QemuConfig {
    /// Defaults for a QEMU on this host: 5 s to greet, 10 s per answer, 50 ms polling.
    pub fn new(qmp: impl Into<PathBuf>) -> QemuConfig {
        QemuConfig {
            qmp: qmp.into(),
            agent: None,
            connect_timeout: Duration::from_secs(5),
            answer_timeout: Duration::from_secs(10),
            poll_interval: Duration::from_millis(50),
        }
    }

    /// Sets the agent channel's socket.
    pub fn with_agent(mut self, agent: impl Into<PathBuf>) -> QemuConfig {
        self.agent = Some(agent.into());
        self
    }
}

/// The timeout limit of the outgoing migration.
#[derive(Debug, Clone, Copy)]
struct MigrationTimeout {
    at: Instant,
    limit: Duration,
    strategy: TimeoutStrategy,
}

/// The largest `downtime-limit` QEMU accepts (2000 s): with it any migration converges.
const UNLIMITED_DOWNTIME_MS: u64 = 2_000_000;

/// QEMU's default `downtime-limit`, which a released switchover goes back to when the
/// limits name none.
const DEFAULT_DOWNTIME: Duration = Duration::from_millis(300);

/// How a held migration keeps QEMU from switching over: it switches over once what is
/// left to send fits in `avail-switchover-bandwidth` x `downtime-limit`; 1000 B/s x 1 ms is
/// one byte, less than one page, so it switches over only after a pass in which the guest
/// dirtied no memory at all. (With less than one byte QEMU 10.0 switches over as soon as
/// its first pass is sent.)
const HOLD_SWITCHOVER_BANDWIDTH: u64 = 1000;
const HOLD_DOWNTIME_MS: u64 = 1;

/// The `max-bandwidth` of a held migration once its first pass is sent (QEMU's
/// `MIGRATION_PASS` 2): 100 bytes per 100 ms window, so every page sent makes QEMU wait for
/// the next window. Without it the passes after the first follow each other within a
/// millisecond when little is dirty, and one in which the guest happened to dirty nothing
/// switched over (seen on the test bed, with 200 messages/s each way). With it, each pass
/// spans at least 100 ms of the guest's activity. (QEMU divides by 10: below 10 B/s the
/// limit is 0, which means none.)
const HOLD_BANDWIDTH: u64 = 1000;

/// The switchover bandwidth a released migration assumes (10 GB/s): with it the little
/// that is left fits the downtime limit at QEMU's next check (every 100 ms), instead of
/// waiting for QEMU to measure its throughput again after the hold.
const RELEASE_SWITCHOVER_BANDWIDTH: u64 = 10_000_000_000;

/// QEMU's default `max-bandwidth` (128 MiB/s), which a released switchover goes back to
/// when the one before the hold could not be read.
const DEFAULT_BANDWIDTH: u64 = 128 << 20;

/// A QEMU process driven over QMP.
#[derive(Debug)]
pub struct QemuVmm {
    qmp: QmpClient,
    config: QemuConfig,
    /// Devices this session asked QEMU to unplug that have not gone yet. A second device_del
    /// for them would press the slot's attention button again, which a Linux guest (pciehp)
    /// takes as "cancel the unplug"; a second [`Vmm::remove_device`] therefore only waits.
    unplugging: std::sync::Mutex<std::collections::HashSet<String>>,
    /// When the outgoing migration reaches its timeout limit, if it has one, and what then.
    migration_end: std::sync::Mutex<Option<MigrationTimeout>>,
    /// QEMU's events since this connection started a migration's side (`migrate` at the
    /// source, `migrate-incoming` at the destination), until that migration ended: where
    /// the guest's stop and start times are read.
    migration_events: std::sync::Mutex<Option<EventStream>>,
    /// The `max-bandwidth` a held migration had before its hold, given back at the release.
    held_bandwidth: std::sync::Mutex<Option<u64>>,
}

impl QemuVmm {
    /// Connects to QEMU's QMP socket and negotiates capabilities.
    pub async fn connect(config: QemuConfig) -> Result<QemuVmm, VmmError> {
        let qmp = QmpClient::connect(&config.qmp, config.connect_timeout, config.answer_timeout)
            .await
            .map_err(|e| match e {
                QmpError::Connect { path, source } => VmmError::Connect {
                    path: path.display().to_string(),
                    source,
                },
                other => vmm_error("connect", "", other),
            })?;
        Ok(QemuVmm {
            qmp,
            config,
            unplugging: std::sync::Mutex::default(),
            migration_end: std::sync::Mutex::default(),
            migration_events: std::sync::Mutex::default(),
            held_bandwidth: std::sync::Mutex::default(),
        })
    }

    /// Adds a host network backend (`netdev_add`), e.g. the tap a destination's new NIC
    /// will use: `{"type": "tap", "id": "nd1", "ifname": "tap3", "script": "no", ...}`.
    pub async fn add_netdev(
        &self,
        properties: serde_json::Map<String, Value>,
    ) -> Result<(), VmmError> {
        let id = properties
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        self.run(
            "add netdev",
            &id,
            "netdev_add",
            Some(Value::Object(properties)),
        )
        .await
        .map(drop)
    }

    /// The QMP session, for commands beyond the [`Vmm`] trait (tests, diagnostics).
    pub fn qmp(&self) -> &QmpClient {
        &self.qmp
    }

    async fn run(
        &self,
        operation: &'static str,
        object: &str,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, VmmError> {
        self.qmp
            .execute(command, arguments)
            .await
            .map_err(|e| vmm_error(operation, object, e))
    }

    fn unplugging(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.unplugging
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether QEMU still has a device with this id.
    async fn device_exists(&self, id: &str) -> Result<bool, VmmError> {
        let list = self
            .run(
                "remove device",
                id,
                "qom-list",
                Some(json!({ "path": "/machine/peripheral" })),
            )
            .await?;
        let entries = list.as_array().ok_or_else(|| VmmError::Protocol {
            operation: "remove device",
            reason: format!("qom-list answered {list}"),
        })?;
        Ok(entries
            .iter()
            .any(|entry| entry.get("name").and_then(Value::as_str) == Some(id)))
    }

    /// The guest PCI address of device `id` (`query-pci`, bridges included).
    async fn pci_address(&self, id: &str) -> Result<Option<String>, VmmError> {
        let buses = self.run("add device", id, "query-pci", None).await?;
        Ok(buses.as_array().and_then(|buses| {
            buses.iter().find_map(|bus| {
                find_pci(bus.get("devices")?, id)
                    .map(|(b, s, f)| format!("0000:{b:02x}:{s:02x}.{f}"))
            })
        }))
    }

    /// Starts watching QEMU's events for the migration about to start on this side.
    fn watch_migration(&self) {
        *self.migration_events() = Some(self.qmp.subscribe());
    }

    fn migration_events(&self) -> std::sync::MutexGuard<'_, Option<EventStream>> {
        self.migration_events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// When QEMU emitted the first event `name` since [`Self::watch_migration`], and stops
    /// watching. QEMU writes an event before its answer to any later command, so an event
    /// that a state seen in an answer implies is already here: the short wait only bounds
    /// the search when there is none. A measurement, never a failure: `None` without it.
    async fn migration_event_time(&self, name: &str) -> Option<SystemTime> {
        let mut events = self.migration_events().take()?;
        match events
            .wait_for(self.config.poll_interval, |event| event.name == name)
            .await
        {
            Ok(Some(event)) => event.timestamp,
            Ok(None) | Err(_) => None,
        }
    }

    async fn query_migrate(&self) -> Result<MigrationProgress, VmmError> {
        let answer = self
            .run("query migration", "", "query-migrate", None)
            .await?;
        if answer.as_object().is_some_and(|o| o.is_empty()) {
            return Ok(MigrationProgress::from_qemu(&json!({"status": "none"}))
                .expect("a status string parses"));
        }
        MigrationProgress::from_qemu(&answer).ok_or_else(|| VmmError::Protocol {
            operation: "query migration",
            reason: format!("no status in {answer}"),
        })
    }
}

/// The reasons in a `query-migrate` answer why the VM cannot migrate (QEMU lists them
/// whether or not a migration runs: devices without migration state, explicit blockers
/// such as a vfio-pci device without a migration driver).
fn blocked_reasons(answer: &Value) -> Vec<String> {
    answer
        .get("blocked-reasons")
        .and_then(Value::as_array)
        .map(|reasons| {
            reasons
                .iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// Translates a QMP failure into the kinds callers act on.
fn vmm_error(operation: &'static str, object: &str, error: QmpError) -> VmmError {
    match error {
        QmpError::Command { class, desc, .. } if class == "DeviceNotFound" => VmmError::NotFound {
            operation,
            object: object.into(),
            message: desc,
        },
        QmpError::Command { class, desc, .. } => VmmError::Refused {
            operation,
            class,
            message: desc,
        },
        QmpError::NoAnswer { timeout_ms, .. } => VmmError::TimedOut {
            operation,
            deadline_ms: timeout_ms,
        },
        QmpError::Closed { .. } => VmmError::Gone { operation },
        QmpError::Connect { path, source } => VmmError::Connect {
            path: path.display().to_string(),
            source,
        },
        other => VmmError::Transport {
            operation,
            source: Box::new(other),
        },
    }
}

/// Finds `(bus, slot, function)` of the device whose `qdev_id` is `id` in a `query-pci`
/// device list, looking behind bridges.
fn find_pci(devices: &Value, id: &str) -> Option<(u64, u64, u64)> {
    devices.as_array()?.iter().find_map(|device| {
        if device.get("qdev_id").and_then(Value::as_str) == Some(id) {
            let field = |name| device.get(name).and_then(Value::as_u64);
            return Some((field("bus")?, field("slot")?, field("function")?));
        }
        find_pci(device.get("pci_bridge")?.get("devices")?, id)
    })
}

/// What a `query-status` state means for a move.
fn qemu_phase(state: &str) -> VmPhase {
    match state {
        "running" => VmPhase::Running,
        "paused" => VmPhase::Paused,
        "inmigrate" => VmPhase::Incoming,
        "postmigrate" => VmPhase::Migrated,
        _ => VmPhase::Other,
    }
}

#[async_trait]
impl Vmm for QemuVmm {
    async fn status(&self) -> Result<VmStatus, VmmError> {
        let answer = self.run("query status", "", "query-status", None).await?;
        let state = answer.get("status").and_then(Value::as_str);
        let running = answer.get("running").and_then(Value::as_bool);
        match (state, running) {
            (Some(state), Some(running)) => Ok(VmStatus {
                running,
                state: state.into(),
                phase: qemu_phase(state),
            }),
            _ => Err(VmmError::Protocol {
                operation: "query status",
                reason: format!("no status/running in {answer}"),
            }),
        }
    }

    async fn pause(&self) -> Result<(), VmmError> {
        self.run("pause", "", "stop", None).await.map(drop)
    }

    async fn resume(&self) -> Result<(), VmmError> {
        self.run("resume", "", "cont", None).await.map(drop)
    }

    async fn remove_device(&self, id: &str, deadline: Duration) -> Result<(), VmmError> {
        let start = Instant::now();
        // Subscribe first: a device that goes at once (USB) is reported before the answer.
        let mut events = self.qmp.subscribe();
        let first_request = self.unplugging().insert(id.to_string());
        if first_request {
            let sent = self
                .run("remove device", id, "device_del", Some(json!({ "id": id })))
                .await;
            if let Err(e) = sent {
                self.unplugging().remove(id);
                return Err(e);
            }
        } else if !self.device_exists(id).await? {
            // Released between the earlier call and this one.
            self.unplugging().remove(id);
            return Ok(());
        }
        let remaining = deadline.saturating_sub(start.elapsed());
        let deleted = events
            .wait_for(remaining, |event| {
                event.name == "DEVICE_DELETED"
                    && event.data.get("device").and_then(Value::as_str) == Some(id)
            })
            .await
            .map_err(|e| vmm_error("remove device", id, e))?;
        match deleted {
            Some(_) => {
                self.unplugging().remove(id);
                tracing::info!(
                    device = id,
                    elapsed_ms = millis(start.elapsed()),
                    "device released"
                );
                Ok(())
            }
            None => Err(VmmError::DeviceNotReleased {
                device: id.into(),
                deadline_ms: millis(deadline),
            }),
        }
    }

    async fn add_device(&self, device: &DeviceSpec) -> Result<AddedDevice, VmmError> {
        let arguments = Value::Object(device.properties().clone());
        self.run("add device", device.id(), "device_add", Some(arguments))
            .await?;
        Ok(AddedDevice {
            id: device.id().to_string(),
            bdf: self.pci_address(device.id()).await?,
        })
    }

    async fn prepare_incoming(&self, uri: &str, handover: VfioHandover) -> Result<(), VmmError> {
        if !handover.is_empty() {
            return Err(VmmError::Unsupported {
                operation: "prepare incoming migration",
                vmm: "QEMU",
                reason: "a QEMU destination takes its VF on its command line \
                         (-device vfio-pci,host=...), not with the receive"
                    .into(),
            });
        }
        self.watch_migration();
        self.run(
            "prepare incoming migration",
            uri,
            "migrate-incoming",
            Some(json!({ "uri": uri })),
        )
        .await
        .map(drop)
    }

    async fn send_migration(&self, uri: &str, limits: &MigrationLimits) -> Result<(), VmmError> {
        if limits.local {
            return Err(VmmError::Unsupported {
                operation: "send migration",
                vmm: "QEMU",
                reason: "local migration (memory handed over as file descriptors) is Cloud \
                         Hypervisor's; send QEMU's over a unix: or tcp: URI without it"
                    .into(),
            });
        }
        if limits.connections.is_some() {
            return Err(VmmError::Unsupported {
                operation: "send migration",
                vmm: "QEMU",
                reason: "connections is Cloud Hypervisor's; QEMU's parallel streams \
                         (multifd) are set on the VMM itself, before the migration"
                    .into(),
            });
        }
        if let Some(downtime) = limits.downtime {
            self.run(
                "send migration",
                uri,
                "migrate-set-parameters",
                Some(json!({ "downtime-limit": millis(downtime) })),
            )
            .await?;
        }
        *self
            .migration_end
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) =
            limits.timeout.map(|limit| MigrationTimeout {
                at: Instant::now() + limit,
                limit,
                strategy: limits.timeout_strategy,
            });
        self.watch_migration();
        self.run(
            "send migration",
            uri,
            "migrate",
            Some(json!({ "uri": uri })),
        )
        .await
        .map(drop)
    }

    async fn migration_blockers(&self) -> Result<Vec<String>, VmmError> {
        let answer = self
            .run("query migration blockers", "", "query-migrate", None)
            .await?;
        Ok(blocked_reasons(&answer))
    }

    async fn send_migration_held(
        &self,
        uri: &str,
        limits: &MigrationLimits,
        deadline: Duration,
    ) -> Result<Held, VmmError> {
        let parameters = self
            .run("hold the switchover", uri, "query-migrate-parameters", None)
            .await?;
        *self
            .held_bandwidth
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) =
            parameters.get("max-bandwidth").and_then(Value::as_u64);
        self.run(
            "hold the switchover",
            uri,
            "migrate-set-capabilities",
            Some(json!({ "capabilities": [{ "capability": "events", "state": true }] })),
        )
        .await?;
        self.run(
            "hold the switchover",
            uri,
            "migrate-set-parameters",
            Some(json!({
                "avail-switchover-bandwidth": HOLD_SWITCHOVER_BANDWIDTH,
                "downtime-limit": HOLD_DOWNTIME_MS,
            })),
        )
        .await?;
        let held = MigrationLimits {
            downtime: Some(Duration::from_millis(HOLD_DOWNTIME_MS)),
            ..*limits
        };
        // Subscribed before the start: the second pass's event must not be missed.
        let mut events = self.qmp.subscribe();
        self.send_migration(uri, &held).await?;
        let second_pass = events
            .wait_for(deadline, |event| {
                event.name == "MIGRATION_PASS"
                    && event.data.get("pass").and_then(Value::as_u64) >= Some(2)
                    || event.name == "MIGRATION"
                        && !matches!(
                            event.data.get("status").and_then(Value::as_str),
                            Some("setup" | "active")
                        )
            })
            .await
            .map_err(|e| vmm_error("hold the switchover", uri, e))?;
        if second_pass.is_none() {
            return Err(VmmError::TimedOut {
                operation: "the migration's first pass over memory",
                deadline_ms: millis(deadline),
            });
        }
        // The first pass is sent: from here QEMU sends only what the guest dirties, and
        // at a crawl.
        self.run(
            "hold the switchover",
            uri,
            "migrate-set-parameters",
            Some(json!({ "max-bandwidth": HOLD_BANDWIDTH })),
        )
        .await?;
        Ok(match self.query_migrate().await?.status {
            MigrationStatus::Active => Held::Ready,
            _ => Held::SwitchedOver,
        })
    }

    async fn release_switchover(&self, limits: &MigrationLimits) -> Result<(), VmmError> {
        let bandwidth = self
            .held_bandwidth
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .unwrap_or(DEFAULT_BANDWIDTH);
        self.run(
            "release the switchover",
            "",
            "migrate-set-parameters",
            Some(json!({
                "avail-switchover-bandwidth": RELEASE_SWITCHOVER_BANDWIDTH,
                "downtime-limit": millis(limits.downtime.unwrap_or(DEFAULT_DOWNTIME)),
                "max-bandwidth": bandwidth,
            })),
        )
        .await
        .map(drop)
    }

    async fn wait_migration(
        &self,
        deadline: Duration,
        progress: ProgressFn<'_>,
    ) -> Result<MigrationProgress, VmmError> {
        let end = Instant::now() + deadline;
        let mut timeout = *self
            .migration_end
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        loop {
            let mut sample = self.query_migrate().await?;
            if sample.status == MigrationStatus::Completed {
                // Stopped for the stop-and-copy before QEMU said completed.
                sample.vm_stopped_at = self.migration_event_time("STOP").await;
            } else if sample.status.is_final() {
                *self.migration_events() = None;
            }
            progress(&sample);
            if let Some(limit) = timeout.filter(|t| Instant::now() >= t.at) {
                if !sample.status.is_final() {
                    match limit.strategy {
                        // The VM stays on the source, as with Cloud Hypervisor.
                        TimeoutStrategy::Cancel => {
                            self.cancel_migration().await?;
                            return Err(VmmError::TimedOut {
                                operation: "migration (its timeout limit; cancelled)",
                                deadline_ms: millis(limit.limit),
                            });
                        }
                        // Finish whatever the stop time: no downtime limit any more.
                        TimeoutStrategy::Ignore => {
                            self.run(
                                "send migration",
                                "",
                                "migrate-set-parameters",
                                Some(json!({ "downtime-limit": UNLIMITED_DOWNTIME_MS })),
                            )
                            .await?;
                            tracing::info!(
                                limit_ms = millis(limit.limit),
                                "migration timeout reached: downtime limit lifted"
                            );
                        }
                    }
                }
                timeout = None;
            }
            match sample.status {
                MigrationStatus::Completed => return Ok(sample),
                MigrationStatus::Failed | MigrationStatus::Cancelled => {
                    return Err(VmmError::MigrationFailed {
                        reason: sample
                            .error
                            .unwrap_or_else(|| "QEMU gave no reason".to_string()),
                        status: sample.status,
                    })
                }
                MigrationStatus::None => {
                    return Err(VmmError::Protocol {
                        operation: "wait for migration",
                        reason: "no migration is running".into(),
                    })
                }
                _ => {}
            }
            if Instant::now() >= end {
                return Err(VmmError::TimedOut {
                    operation: "migration",
                    deadline_ms: millis(deadline),
                });
            }
            tokio::time::sleep(self.config.poll_interval.min(end - Instant::now())).await;
        }
    }

    async fn confirm_received(&self, deadline: Duration) -> Result<Option<SystemTime>, VmmError> {
        // The destination's own view: its incoming migration did not fail and the VM is
        // there; it leaves `inmigrate` a moment after the source saw `completed`.
        let end = Instant::now() + deadline;
        loop {
            let incoming = self.query_migrate().await?;
            if matches!(
                incoming.status,
                MigrationStatus::Failed | MigrationStatus::Cancelled
            ) {
                *self.migration_events() = None;
                return Err(VmmError::MigrationFailed {
                    reason: incoming
                        .error
                        .unwrap_or_else(|| "the destination did not receive the VM".into()),
                    status: incoming.status,
                });
            }
            let status = self.status().await?;
            // QEMU leaves `inmigrate` only once the incoming state is loaded, for the run
            // state the source had (`running`, `paused`, or `prelaunch` for a VM never
            // started); it may then forget the incoming migration (query-migrate: nothing).
            if status.phase != VmPhase::Incoming {
                // QEMU announces RESUME before the run state says running.
                if status.running {
                    return Ok(self.migration_event_time("RESUME").await);
                }
                *self.migration_events() = None;
                return Ok(None);
            }
            if Instant::now() >= end {
                return Err(VmmError::TimedOut {
                    operation: "confirm the received migration",
                    deadline_ms: millis(deadline),
                });
            }
            tokio::time::sleep(self.config.poll_interval.min(end - Instant::now())).await;
        }
    }

    async fn cancel_migration(&self) -> Result<(), VmmError> {
        self.run("cancel migration", "", "migrate_cancel", None)
            .await
            .map(drop)
    }

    async fn quit(&self) -> Result<(), VmmError> {
        match self.run("quit", "", "quit", None).await {
            // QEMU may close the socket before its answer reaches us.
            Ok(_) | Err(VmmError::Gone { .. }) => {}
            Err(e) => return Err(e),
        }
        if self.qmp.wait_closed(self.config.answer_timeout).await {
            Ok(())
        } else {
            Err(VmmError::TimedOut {
                operation: "quit",
                deadline_ms: millis(self.config.answer_timeout),
            })
        }
    }

    async fn has_device(&self, id: &str) -> Result<bool, VmmError> {
        self.device_exists(id).await
    }

    async fn open_agent_channel(&self) -> Result<Box<dyn AgentStream>, VmmError> {
        let path = self.config.agent.as_ref().ok_or(VmmError::NoAgentChannel)?;
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| VmmError::AgentChannel {
                path: path.display().to_string(),
                source,
            })?;
        Ok(Box::new(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migration_blockers_are_read_from_query_migrate() {
        // QEMU 10 lists them whether or not a migration runs; a passthrough function on
        // plain vfio-pci (no migration driver) blocks with its own words.
        let blocked = json!({"blocked-reasons": [
            "0000:3b:00.2: VFIO migration is not supported in kernel"
        ]});
        assert_eq!(
            blocked_reasons(&blocked),
            ["0000:3b:00.2: VFIO migration is not supported in kernel"]
        );
        assert!(blocked_reasons(&json!({})).is_empty());
        assert!(blocked_reasons(&json!({"status": "active", "blocked-reasons": []})).is_empty());
    }

    #[test]
    fn qemu_error_classes_map_to_kinds() {
        let command = |class: &str| QmpError::Command {
            command: "device_del".into(),
            class: class.into(),
            desc: "Device 'nope' not found".into(),
        };
        assert!(matches!(
            vmm_error("remove device", "nope", command("DeviceNotFound")),
            VmmError::NotFound { object, .. } if object == "nope"
        ));
        assert!(matches!(
            vmm_error("x", "", command("GenericError")),
            VmmError::Refused { class, .. } if class == "GenericError"
        ));
        let closed = QmpError::Closed {
            path: "/q".into(),
            reason: "EOF".into(),
        };
        assert!(matches!(
            vmm_error("quit", "", closed),
            VmmError::Gone { operation: "quit" }
        ));
        let slow = QmpError::NoAnswer {
            command: "query-status".into(),
            timeout_ms: 10,
        };
        assert!(vmm_error("query status", "", slow).is_timeout());
    }
}
