//! The Cloud Hypervisor backend of [`Vmm`]: REST over `--api-socket` for control, the event
//! monitor for a migration's outcome, hybrid vsock for the agent.
//!
//! Cloud Hypervisor's API is synchronous where QEMU's is not and the reverse:
//! - `vm.remove-device` answers 204 once the guest has been *asked*; the device is gone
//!   only when the guest ejected it, which `vm.info`'s device tree shows. So
//!   [`Vmm::remove_device`] polls the device tree until the id leaves it or the deadline
//!   passes (and, like the QEMU backend, never asks twice: a second request could be taken
//!   as a cancel).
//! - `vm.send-migration` answers 204 when its worker *starts* (NOTES.md): a 204 is never
//!   reported as a migration. [`Vmm::wait_migration`] follows the event monitor
//!   (`migration-finished` / `migration-failed`); without one it polls `vm.info` and
//!   counts the migration done only when the source VMM says the VM is gone (404). A
//!   migration that failed leaves the VM running on the source: with the event monitor that
//!   is reported as [`VmmError::MigrationFailed`] at once, without one it can only show as
//!   the deadline passing ([`VmmError::TimedOut`]), never as success.
//! - `vm.receive-migration` answers only when the migration has ended (204, or 500 with
//!   the chain). [`Vmm::prepare_incoming`] sends it from a task;
//!   [`Vmm::confirm_received`] waits for that answer (the receiver's own confirmation),
//!   then for `vm.info` to show the VM running.
//! - A VMM without a VM answers `vm.info` with 404: [`Vmm::status`] reports it as
//!   [`VmPhase::NoVm`] (a destination ready to receive, or a source whose VM left). A failed
//!   receive leaves the destination's VM `Created` (never ran): that is no VM either, and
//!   [`Vmm::prepare_incoming`] deletes it (`vm.delete`) before it receives again.
//! - A migration's `migration-failed` event carries no reason (NOTES.md): the failure names
//!   the tail of the VMM's `--log-file` when the config gives it, where the cause is.
//! - A VMM can die mid-migration, and its event file then just stops growing: while waiting
//!   for a migration the backend pings the VMM every second and fails at once, naming it,
//!   when it no longer answers.

use std::collections::{BTreeMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use rdmamig_proto::clock::millis;
use serde::Deserialize;
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::ch_api::{ApiClient, ApiError, Endpoint, PciDeviceInfo, Request, VfioFd};
use crate::ch_events::{self, EventReader};
use crate::{vsock, AddedDevice, AgentStream, DeviceSpec, MigrationLimits, MigrationProgress};
use crate::{Held, MigrationStatus, ProgressFn, VfioHandover, VmPhase, VmStatus, Vmm, VmmError};

/// [`VmStatus::state`] of a Cloud Hypervisor that holds no VM (`vm.info` answers 404).
pub const NO_VM: &str = "no VM";

/// The guest agent's vsock port when none is configured (`rdmamig-agent --vsock-port`).
pub const DEFAULT_AGENT_PORT: u32 = 7077;

/// [`VmStatus::state`] of a VM that was created and never ran (what a failed receive
/// leaves on the destination).
pub const CREATED: &str = "Created";

/// How often a migration's wait asks the VMM whether it still answers.
const LIVENESS_INTERVAL: Duration = Duration::from_secs(1);

/// How long that ask may take.
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(2);

/// How much of the end of the VMM's log a failed migration reports.
const LOG_TAIL: usize = 2048;

/// The descriptors of `handover` in the order they are sent: the devices', then the
/// iommufd.
fn handed_fds(handover: &VfioHandover) -> Vec<Arc<OwnedFd>> {
    handover
        .devices
        .iter()
        .map(|(_, fd)| fd.clone())
        .chain(handover.iommufd.clone())
        .collect()
}

/// The receive body's `vfio_fds`: each id with its descriptor's number here.
fn vfio_fds(handover: &VfioHandover) -> Vec<VfioFd> {
    handover
        .devices
        .iter()
        .map(|(id, fd)| VfioFd {
            id: id.clone(),
            fd: fd.as_raw_fd(),
        })
        .collect()
}

/// How to reach one Cloud Hypervisor process.
#[derive(Debug, Clone)]
pub struct ChConfig {
    /// `--api-socket path=PATH`.
    pub api_socket: PathBuf,
    /// `--vsock socket=PATH`: the hybrid vsock socket the agent is reached through.
    pub vsock: Option<PathBuf>,
    /// The agent's vsock port in the guest.
    pub agent_port: u32,
    /// `--event-monitor path=PATH`: how an outgoing migration's outcome is known.
    pub event_monitor: Option<PathBuf>,
    /// `--log-file PATH`: where a failed migration's cause is written (its event has none).
    pub log_file: Option<PathBuf>,
    /// Mutual TLS for the migration stream over tcp (`tls_dir`): this VMM's CA and
    /// certificate, sent with its receive (server) or its send (client).
    pub tls_dir: Option<PathBuf>,
    /// Wait for each API answer.
    pub answer_timeout: Duration,
    /// Wait for the hybrid vsock handshake (`OK <port>`).
    pub agent_timeout: Duration,
    /// Longest a received migration may take (the receive request stays open until then).
    pub receive_timeout: Duration,
    /// Interval between two polls of `vm.info` or the event monitor.
    pub poll_interval: Duration,
}

impl ChConfig {
    /// Defaults: 10 s per answer, 5 s for the vsock handshake, an hour to receive (Cloud
    /// Hypervisor's own migration timeout), 50 ms polling, the default agent port.
    pub fn new(api_socket: impl Into<PathBuf>) -> ChConfig {
        ChConfig {
            api_socket: api_socket.into(),
            vsock: None,
            agent_port: DEFAULT_AGENT_PORT,
            event_monitor: None,
            log_file: None,
            tls_dir: None,
            answer_timeout: Duration::from_secs(10),
            agent_timeout: Duration::from_secs(5),
            receive_timeout: Duration::from_secs(3600),
            poll_interval: Duration::from_millis(50),
        }
    }
}

/// An outgoing migration this session started.
#[derive(Debug)]
struct Sending {
    started: Instant,
    events: Option<EventReader>,
}

/// A Cloud Hypervisor process driven over its REST API.
#[derive(Debug)]
pub struct ChVmm {
    api: ApiClient,
    config: ChConfig,
    version: String,
    /// Devices asked to go that had not gone when last looked at.
    unplugging: Mutex<HashSet<String>>,
    sending: tokio::sync::Mutex<Option<Sending>>,
    receiving: tokio::sync::Mutex<Option<JoinHandle<Result<(), VmmError>>>>,
}

/// `VmmPingResponse`.
#[derive(Debug, Deserialize)]
struct Ping {
    version: String,
}

/// The parts of `VmInfo` the backend reads.
#[derive(Debug, Deserialize)]
struct Info {
    state: String,
    #[serde(default)]
    device_tree: BTreeMap<String, Value>,
}

impl ChVmm {
    /// The TLS folder as the API takes it.
    fn tls_dir(&self) -> Option<String> {
        self.config
            .tls_dir
            .as_ref()
            .map(|dir| dir.display().to_string())
    }

    /// Connects: pings the VMM (which also proves the socket is its API).
    pub async fn connect(config: ChConfig) -> Result<ChVmm, VmmError> {
        let api = ApiClient::new(&config.api_socket, config.answer_timeout);
        let ping: Ping = api
            .call_json(Endpoint::VmmPing, None)
            .await
            .map_err(|e| e.into_vmm("vmm"))?;
        Ok(ChVmm {
            api,
            config,
            version: ping.version,
            unplugging: Mutex::default(),
            sending: tokio::sync::Mutex::default(),
            receiving: tokio::sync::Mutex::default(),
        })
    }

    /// The VMM's version, as `vmm.ping` gave it.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The API client, for calls beyond the [`Vmm`] trait.
    pub fn api(&self) -> &ApiClient {
        &self.api
    }

    /// Hot-plugs a hybrid vsock device (for a VM started without `--vsock`).
    pub async fn add_vsock(
        &self,
        cid: u32,
        socket: &std::path::Path,
        id: Option<&str>,
    ) -> Result<AddedDevice, VmmError> {
        let request = Request::AddVsock {
            cid,
            socket: socket.display().to_string(),
            id: id.map(String::from),
        };
        let object = id.unwrap_or("vsock");
        self.added(Endpoint::VmAddVsock, &request, object).await
    }

    /// Waits for the answer to the receive request [`Vmm::prepare_incoming`] sent: `Ok`
    /// once the whole VM arrived, [`VmmError::MigrationFailed`] with the chain otherwise.
    pub async fn wait_received(&self, deadline: Duration) -> Result<(), VmmError> {
        let mut receiving = self.receiving.lock().await;
        let task = receiving.as_mut().ok_or_else(|| VmmError::Protocol {
            operation: "receive migration",
            reason: "no migration is being received (call prepare_incoming first)".into(),
        })?;
        match tokio::time::timeout(deadline, task).await {
            Err(_) => Err(VmmError::TimedOut {
                operation: "receive migration",
                deadline_ms: millis(deadline),
            }),
            Ok(joined) => {
                *receiving = None;
                joined.map_err(|e| VmmError::Transport {
                    operation: "receive migration",
                    source: Box::new(e),
                })?
            }
        }
    }

    async fn info(&self, operation: &'static str) -> Result<Info, VmmError> {
        self.api
            .call_json(Endpoint::VmInfo, None)
            .await
            .map_err(|e| match e.into_vmm("vm") {
                VmmError::Protocol { reason, .. } => VmmError::Protocol { operation, reason },
                other => other,
            })
    }

    async fn added(
        &self,
        endpoint: Endpoint,
        request: &Request,
        object: &str,
    ) -> Result<AddedDevice, VmmError> {
        let body = self
            .api
            .call(endpoint, Some(request))
            .await
            .map_err(|e| e.into_vmm(object))?;
        if body.is_empty() {
            // 204: cold-added to a VM that is not booted; no address yet.
            return Ok(AddedDevice {
                id: object.into(),
                bdf: None,
            });
        }
        let info: PciDeviceInfo =
            serde_json::from_slice(&body).map_err(|e| VmmError::Protocol {
                operation: endpoint.operation(),
                reason: format!("the answer is not a PciDeviceInfo: {e}"),
            })?;
        Ok(AddedDevice {
            id: info.id,
            bdf: Some(info.bdf),
        })
    }

    /// Fails, naming the VMM, when it no longer answers `vmm.ping` (it died: its socket is
    /// gone, or it does not answer within [`LIVENESS_TIMEOUT`]).
    async fn still_answers(&self, operation: &'static str) -> Result<(), VmmError> {
        match self
            .api
            .call_within(Endpoint::VmmPing, None, LIVENESS_TIMEOUT)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => Err(VmmError::Died {
                operation,
                socket: self.config.api_socket.display().to_string(),
                cause: Box::new(e.into_vmm("vmm")),
            }),
        }
    }

    /// The end of the VMM's log (the lines of its last [`LOG_TAIL`] bytes), made printable,
    /// when the config names it and it can be read.
    fn log_tail(&self) -> Option<String> {
        let path = self.config.log_file.as_ref()?;
        let bytes = std::fs::read(path).ok()?;
        let start = bytes.len().saturating_sub(LOG_TAIL);
        let tail = String::from_utf8_lossy(&bytes[start..]);
        // From the first whole line on; lines joined as one message.
        let whole = match tail.find('\n') {
            Some(at) if start > 0 => &tail[at + 1..],
            _ => &tail[..],
        };
        let lines: Vec<&str> = whole
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        if lines.is_empty() {
            return None;
        }
        Some(rdmamig_proto::text::printable(&lines.join(" | "), LOG_TAIL))
    }

    fn unplugging(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.unplugging
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The sysfs path Cloud Hypervisor takes for a passthrough device described as
/// `driver=vfio-pci,host=<BDF>` (or `sysfsdev=<path>`).
pub fn vfio_path(device: &DeviceSpec) -> Result<String, VmmError> {
    let unsupported = |reason: String| VmmError::Unsupported {
        operation: "add device",
        vmm: "the Cloud Hypervisor backend",
        reason,
    };
    if device.driver() != "vfio-pci" {
        return Err(unsupported(format!(
            "only VFIO passthrough devices (driver=vfio-pci) are plugged through vm.add-device, \
             not {}",
            device.driver()
        )));
    }
    let properties = device.properties();
    if let Some(path) = properties.get("sysfsdev").and_then(Value::as_str) {
        return Ok(path.into());
    }
    match properties.get("host").and_then(Value::as_str) {
        Some(bdf) if is_bdf(bdf) => Ok(format!("/sys/bus/pci/devices/{bdf}")),
        Some(bdf) => Err(unsupported(format!(
            "host={bdf} is not a full PCI address (0000:00:02.0)"
        ))),
        None => Err(unsupported(
            "a vfio-pci device needs host=<BDF> or sysfsdev=<path>".into(),
        )),
    }
}

/// `dddd:bb:dd.f` in hex.
fn is_bdf(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.len() == 12
        && bytes.iter().enumerate().all(|(i, b)| match i {
            4 | 7 => *b == b':',
            10 => *b == b'.',
            11 => (b'0'..=b'7').contains(b),
            _ => b.is_ascii_hexdigit(),
        })
}

#[async_trait]
impl Vmm for ChVmm {
    async fn status(&self) -> Result<VmStatus, VmmError> {
        let info = match self.info("query the VM").await {
            Ok(info) => info,
            // The VMM runs without a VM: none created or received yet, or it left.
            Err(VmmError::NotFound { .. }) => {
                return Ok(VmStatus {
                    running: false,
                    state: NO_VM.into(),
                    phase: VmPhase::NoVm,
                })
            }
            Err(e) => return Err(e),
        };
        let phase = match info.state.as_str() {
            "Running" => VmPhase::Running,
            "Paused" => VmPhase::Paused,
            // Never ran (a failed receive left it): nothing runs, as with no VM.
            CREATED => VmPhase::NoVm,
            _ => VmPhase::Other,
        };
        Ok(VmStatus {
            running: phase == VmPhase::Running,
            state: info.state,
            phase,
        })
    }

    async fn pause(&self) -> Result<(), VmmError> {
        self.api
            .call(Endpoint::VmPause, None)
            .await
            .map(drop)
            .map_err(|e| e.into_vmm("vm"))
    }

    async fn resume(&self) -> Result<(), VmmError> {
        self.api
            .call(Endpoint::VmResume, None)
            .await
            .map(drop)
            .map_err(|e| e.into_vmm("vm"))
    }

    async fn remove_device(&self, id: &str, deadline: Duration) -> Result<(), VmmError> {
        let start = Instant::now();
        let first_request = self.unplugging().insert(id.to_string());
        if first_request {
            let request = Request::RemoveDevice { id: id.into() };
            if let Err(e) = self
                .api
                .call(Endpoint::VmRemoveDevice, Some(&request))
                .await
            {
                self.unplugging().remove(id);
                return Err(e.into_vmm(id));
            }
        }
        loop {
            let info = self.info("remove device").await?;
            if !info.device_tree.contains_key(id) {
                self.unplugging().remove(id);
                tracing::info!(
                    device = id,
                    elapsed_ms = millis(start.elapsed()),
                    "device released"
                );
                return Ok(());
            }
            if start.elapsed() >= deadline {
                return Err(VmmError::DeviceNotReleased {
                    device: id.into(),
                    deadline_ms: millis(deadline),
                });
            }
            let left = deadline.saturating_sub(start.elapsed());
            tokio::time::sleep(self.config.poll_interval.min(left)).await;
        }
    }

    async fn add_device(&self, device: &DeviceSpec) -> Result<AddedDevice, VmmError> {
        let request = Request::AddDevice {
            path: vfio_path(device)?,
            id: device.id().into(),
        };
        self.added(Endpoint::VmAddDevice, &request, device.id())
            .await
    }

    async fn prepare_incoming(&self, uri: &str, handover: VfioHandover) -> Result<(), VmmError> {
        let mut receiving = self.receiving.lock().await;
        if receiving.as_ref().is_some_and(|task| !task.is_finished()) {
            return Err(VmmError::Conflict {
                operation: "receive migration",
                object: uri.into(),
                message: "this VMM is already receiving a migration".into(),
            });
        }
        // A failed receive left a VM that never ran: Cloud Hypervisor receives only into a
        // VMM without one.
        if self.status().await?.state == CREATED {
            self.api
                .call(Endpoint::VmDelete, None)
                .await
                .map_err(|e| e.into_vmm("vm"))?;
            tracing::info!(
                socket = %self.config.api_socket.display(),
                "deleted the VM a failed receive left before receiving again"
            );
        }
        let request = Request::ReceiveMigration {
            receiver_url: uri.into(),
            tls_dir: self.tls_dir(),
            vfio_fds: vfio_fds(&handover),
            iommufd_fd: handover.iommufd.as_ref().map(|fd| fd.as_raw_fd()),
        };
        let fds = handed_fds(&handover);
        let api = self.api.clone();
        let timeout = self.config.receive_timeout;
        let object = uri.to_string();
        let task = tokio::spawn(async move {
            api.call_handing(Endpoint::VmReceiveMigration, &request, timeout, fds)
                .await
                .map(drop)
                .map_err(|e| received_error(e, &object))
        });
        // A unix: receiver is ready once Cloud Hypervisor has bound its socket; a sender
        // that came earlier would find nobody.
        if let Some(path) = uri.strip_prefix("unix:") {
            let end = Instant::now() + self.config.answer_timeout;
            while !std::path::Path::new(path).exists() {
                if task.is_finished() {
                    return task.await.map_err(|e| VmmError::Transport {
                        operation: "receive migration",
                        source: Box::new(e),
                    })?;
                }
                if Instant::now() >= end {
                    task.abort();
                    return Err(VmmError::TimedOut {
                        operation: "receive migration (listening)",
                        deadline_ms: millis(self.config.answer_timeout),
                    });
                }
                tokio::time::sleep(self.config.poll_interval).await;
            }
        }
        *receiving = Some(task);
        Ok(())
    }

    async fn migration_blockers(&self) -> Result<Vec<String>, VmmError> {
        Err(VmmError::Unsupported {
            operation: "list migration blockers",
            vmm: "Cloud Hypervisor",
            reason: "its API does not say whether a VM can migrate before it tries".into(),
        })
    }

    async fn send_migration_held(
        &self,
        _uri: &str,
        _limits: &MigrationLimits,
        _deadline: Duration,
    ) -> Result<Held, VmmError> {
        Err(VmmError::Unsupported {
            operation: "hold a migration before its switchover",
            vmm: "Cloud Hypervisor",
            reason: "vm.send-migration decides its switchover alone; its event monitor's \
                     `pausing` event comes as the VM stops, too late to pause the guest's \
                     senders"
                .into(),
        })
    }

    async fn release_switchover(&self, _limits: &MigrationLimits) -> Result<(), VmmError> {
        Err(VmmError::Unsupported {
            operation: "release a held switchover",
            vmm: "Cloud Hypervisor",
            reason: "it holds no switchover".into(),
        })
    }

    async fn send_migration(&self, uri: &str, limits: &MigrationLimits) -> Result<(), VmmError> {
        let events = match &self.config.event_monitor {
            Some(path) => {
                Some(
                    EventReader::from_end(path)
                        .await
                        .map_err(|e| VmmError::Transport {
                            operation: "send migration",
                            source: Box::new(e),
                        })?,
                )
            }
            None => None,
        };
        let request = Request::SendMigration {
            destination_url: uri.into(),
            local: limits.local,
            downtime_ms: limits.downtime.map(|d| millis(d).max(1)),
            timeout_s: limits.timeout.map(|t| t.as_secs().max(1)),
            timeout_strategy: limits.timeout_strategy,
            connections: limits.connections,
            tls_dir: self.tls_dir(),
        };
        let started = Instant::now();
        self.api
            .call(Endpoint::VmSendMigration, Some(&request))
            .await
            .map_err(|e| e.into_vmm(uri))?;
        *self.sending.lock().await = Some(Sending { started, events });
        Ok(())
    }

    async fn wait_migration(
        &self,
        deadline: Duration,
        progress: ProgressFn<'_>,
    ) -> Result<MigrationProgress, VmmError> {
        let start = Instant::now();
        let mut sending = self.sending.lock().await;
        let sent = sending.as_mut().ok_or_else(|| VmmError::Protocol {
            operation: "wait for migration",
            reason: "no migration was sent by this session".into(),
        })?;
        let mut asked_alive = Instant::now();
        loop {
            if asked_alive.elapsed() >= LIVENESS_INTERVAL {
                self.still_answers("wait for migration").await?;
                asked_alive = Instant::now();
            }
            let elapsed = millis(sent.started.elapsed());
            let sample = match sent.events.as_mut() {
                Some(reader) => {
                    let events = reader.poll().await.map_err(|e| VmmError::Transport {
                        operation: "wait for migration",
                        source: Box::new(e),
                    })?;
                    let mut last = None;
                    for event in &events {
                        if let Some(sample) = ch_events::progress(event, elapsed) {
                            progress(&sample);
                            let done = sample.status.is_final();
                            last = Some(sample);
                            if done {
                                break;
                            }
                        }
                    }
                    last
                }
                None => {
                    let sample = match self.info("wait for migration").await {
                        // The source VMM no longer has the VM: it went to the destination.
                        Err(VmmError::NotFound { .. }) => MigrationStatus::Completed,
                        Err(e) => return Err(e),
                        Ok(_) => MigrationStatus::Active,
                    };
                    let sample = MigrationProgress {
                        status: sample,
                        total_time_ms: Some(elapsed),
                        setup_time_ms: None,
                        downtime_ms: None,
                        ram_transferred: None,
                        ram_remaining: None,
                        ram_total: None,
                        mbps: None,
                        ram_syncs: None,
                        error: None,
                        vm_stopped_at: None,
                    };
                    progress(&sample);
                    Some(sample)
                }
            };
            match sample {
                Some(done) if done.status == MigrationStatus::Completed => {
                    *sending = None;
                    return Ok(done);
                }
                Some(failed) if failed.status == MigrationStatus::Failed => {
                    *sending = None;
                    let mut reason = failed.error.unwrap_or_default();
                    if let Some(tail) = self.log_tail() {
                        reason = format!("{reason}; its log ends: {tail}");
                    }
                    return Err(VmmError::MigrationFailed {
                        status: failed.status,
                        reason,
                    });
                }
                _ => {}
            }
            if start.elapsed() >= deadline {
                return Err(VmmError::TimedOut {
                    operation: "migration",
                    deadline_ms: millis(deadline),
                });
            }
            let left = deadline.saturating_sub(start.elapsed());
            tokio::time::sleep(self.config.poll_interval.min(left)).await;
        }
    }

    async fn confirm_received(&self, deadline: Duration) -> Result<Option<SystemTime>, VmmError> {
        let start = Instant::now();
        let in_flight = self.receiving.lock().await.is_some();
        if in_flight {
            // This session sent the receive request: its answer is the receiver's word.
            self.wait_received(deadline).await?;
        }
        // Without one (another session or migrator sent it), and to see the VM is there
        // after the answer: running, or paused if it was paused at the source.
        loop {
            let status = self.status().await?;
            if matches!(status.phase, VmPhase::Running | VmPhase::Paused) {
                // Its event monitor stamps events from the VMM's own start, not the clock.
                return Ok(None);
            }
            if start.elapsed() >= deadline {
                return Err(if status.phase == VmPhase::NoVm {
                    VmmError::MigrationFailed {
                        status: MigrationStatus::Failed,
                        reason: "the destination has no VM: it did not receive the migration"
                            .into(),
                    }
                } else {
                    VmmError::TimedOut {
                        operation: "confirm the received migration",
                        deadline_ms: millis(deadline),
                    }
                });
            }
            let left = deadline.saturating_sub(start.elapsed());
            tokio::time::sleep(self.config.poll_interval.min(left)).await;
        }
    }

    async fn cancel_migration(&self) -> Result<(), VmmError> {
        Err(VmmError::Unsupported {
            operation: "cancel migration",
            vmm: "Cloud Hypervisor",
            reason: "its API has no cancel; send with a timeout (timeout_strategy Cancel) \
                     to bound a migration"
                .into(),
        })
    }

    async fn quit(&self) -> Result<(), VmmError> {
        match self.api.call(Endpoint::VmmShutdown, None).await {
            Ok(_) => Ok(()),
            Err(e) => match e.into_vmm("vmm") {
                // The VMM may exit before its answer is out.
                VmmError::Gone { .. } => Ok(()),
                other => Err(other),
            },
        }
    }

    async fn has_device(&self, id: &str) -> Result<bool, VmmError> {
        Ok(self.info("has device").await?.device_tree.contains_key(id))
    }

    async fn open_agent_channel(&self) -> Result<Box<dyn AgentStream>, VmmError> {
        let socket = self.config.vsock.as_ref().ok_or(VmmError::NoAgentChannel)?;
        let (stream, _) = vsock::connect(socket, self.config.agent_port, self.config.agent_timeout)
            .await
            .map_err(VmmError::AgentVsock)?;
        Ok(Box::new(stream))
    }
}

/// A receive that ended badly: a 500 is the migration failing, not a refusal.
fn received_error(error: ApiError, object: &str) -> VmmError {
    match error {
        ApiError::Status {
            status: 500,
            message,
            ..
        } => VmmError::MigrationFailed {
            status: MigrationStatus::Failed,
            reason: message,
        },
        other => other.into_vmm(object),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vfio_devices_become_sysfs_paths() {
        let spec = |text: &str| DeviceSpec::parse(text).unwrap();
        assert_eq!(
            vfio_path(&spec("driver=vfio-pci,host=0000:3b:02.1,id=vf0")).unwrap(),
            "/sys/bus/pci/devices/0000:3b:02.1"
        );
        assert_eq!(
            vfio_path(&spec(
                "driver=vfio-pci,sysfsdev=/sys/bus/pci/devices/x,id=vf0"
            ))
            .unwrap(),
            "/sys/bus/pci/devices/x"
        );
        for bad in [
            "driver=virtio-net-pci,id=n",
            "driver=vfio-pci,host=3b:02.1,id=vf0",
            "driver=vfio-pci,host=0000:3b:02.8,id=vf0",
            "driver=vfio-pci,id=vf0",
        ] {
            assert!(
                matches!(vfio_path(&spec(bad)), Err(VmmError::Unsupported { .. })),
                "{bad}"
            );
        }
    }
}
