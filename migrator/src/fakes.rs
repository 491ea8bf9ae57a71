//! A fake host for the mover's unit tests: two VMMs and a guest agent over one shared,
//! inspectable state, each operation able to fail on cue.
//!
//! The fakes model what the mover relies on, as QEMU and the agent behave on the test bed: a
//! device the guest holds stays after a failed unplug, its removal pending until the holder
//! lets go (never, unless a test says when); a completed migration leaves the
//! source `postmigrate` and the destination running the guest; a cancelled one leaves the
//! source running; the guest's agent answers wherever the guest runs.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rdmamig_proto::agent::{
    ConnectionInfo, ConnectionOutcome, ConnectionState, DeviceHolder, QuiesceMode, ReleaseScope,
    Role, UnmanagedProgram,
};
use rdmamig_proto::ConnectionId;
use rdmamig_vmm::{
    AddedDevice, AgentStream, DeviceSpec, Held, MigrationLimits, MigrationProgress,
    MigrationStatus, ProgressFn, VfioHandover, VmPhase, VmStatus, Vmm, VmmError,
};

use crate::agent::{AgentError, GuestAgent, Outcomes};
use crate::backends::Backends;
use crate::plan::Endpoint;

/// When the fake source stops the guest for the stop-and-copy.
pub const FAKE_STOP: SystemTime = UNIX_EPOCH;

/// How long after [`FAKE_STOP`] the fake destination starts the guest.
pub const FAKE_PAUSE: Duration = Duration::from_millis(35);

/// How an operation fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// It passes its deadline.
    Timeout,
    /// It is refused (or fails outright).
    Refuse,
    /// (quiesce only) one connection reports a failure: its peer did not acknowledge.
    PeerNoAck,
    /// (quiesce only) the answer leaves the last listed connection out.
    LeavesOut,
}

/// Which side the guest runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    Source,
    Destination,
}

/// The whole fake host.
#[derive(Debug)]
pub struct HostState {
    pub source_state: String,
    pub destination_state: String,
    pub destination_gone: bool,
    pub source_devices: BTreeSet<String>,
    pub destination_devices: BTreeSet<String>,
    /// Every device plugged, in order: which side, and its properties.
    pub plugged: Vec<(Where, DeviceSpec)>,
    pub migrating: bool,
    pub guest: Where,
    pub quiesced: bool,
    pub resumed_on: Vec<Where>,
    pub calls: Vec<String>,
    pub faults: HashMap<&'static str, Fault>,
    /// The source device whose unplug timed out and is still pending in the guest.
    pub unplug_pending: Option<String>,
    /// After how many more checks of the source's devices the process holding the device
    /// lets go, so that its pending unplug completes; `None`: it never does.
    pub holder_lets_go_after: Option<usize>,
    /// The guest's programs that hold the RDMA device without the library; a release
    /// ends them.
    pub unmanaged: Vec<UnmanagedProgram>,
    /// The ids of the VFIO devices the destination's receive was handed.
    pub handed: Vec<String>,
}

/// A handle on the fake host; clones share it.
#[derive(Debug, Clone)]
pub struct FakeHost(pub Arc<Mutex<HostState>>);

impl FakeHost {
    /// A source running the guest with `nic0`, a destination waiting with -incoming.
    pub fn new() -> FakeHost {
        FakeHost(Arc::new(Mutex::new(HostState {
            source_state: "running".into(),
            destination_state: "inmigrate".into(),
            destination_gone: false,
            source_devices: BTreeSet::from(["nic0".to_string()]),
            destination_devices: BTreeSet::new(),
            plugged: Vec::new(),
            migrating: false,
            guest: Where::Source,
            quiesced: false,
            resumed_on: Vec::new(),
            calls: Vec::new(),
            faults: HashMap::new(),
            unplug_pending: None,
            holder_lets_go_after: None,
            unmanaged: Vec::new(),
            handed: Vec::new(),
        })))
    }

    pub fn state(&self) -> std::sync::MutexGuard<'_, HostState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn fail(&self, operation: &'static str, fault: Fault) {
        self.state().faults.insert(operation, fault);
    }

    /// Records the call and returns its fault, if one is set.
    fn call(&self, name: &'static str) -> Option<Fault> {
        let mut state = self.state();
        state.calls.push(name.into());
        state.faults.get(name).copied()
    }
}

struct FakeVmm {
    host: FakeHost,
    side: Where,
}

fn refused(operation: &'static str) -> VmmError {
    VmmError::Refused {
        operation,
        class: "GenericError".into(),
        message: "refused on cue".into(),
    }
}

impl FakeVmm {
    fn op(&self, source: &'static str, destination: &'static str) -> &'static str {
        match self.side {
            Where::Source => source,
            Where::Destination => destination,
        }
    }

    fn check_alive(&self, operation: &'static str) -> Result<(), VmmError> {
        if self.side == Where::Destination && self.host.state().destination_gone {
            return Err(VmmError::Gone { operation });
        }
        Ok(())
    }
}

#[async_trait]
impl Vmm for FakeVmm {
    async fn status(&self) -> Result<VmStatus, VmmError> {
        self.check_alive("query status")?;
        let state = self.host.state();
        let name = match self.side {
            Where::Source => state.source_state.clone(),
            Where::Destination => state.destination_state.clone(),
        };
        let phase = match name.as_str() {
            "running" => VmPhase::Running,
            "paused" => VmPhase::Paused,
            "inmigrate" => VmPhase::Incoming,
            "postmigrate" => VmPhase::Migrated,
            _ => VmPhase::Other,
        };
        Ok(VmStatus {
            running: phase == VmPhase::Running,
            state: name,
            phase,
        })
    }

    async fn remove_device(&self, id: &str, deadline: Duration) -> Result<(), VmmError> {
        let fault = self
            .host
            .call(self.op("src.remove_device", "dst.remove_device"));
        match fault {
            Some(Fault::Timeout) => {
                if self.side == Where::Source {
                    self.host.state().unplug_pending = Some(id.into());
                }
                Err(VmmError::DeviceNotReleased {
                    device: id.into(),
                    deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
                })
            }
            Some(_) => Err(refused("remove device")),
            None => {
                let mut state = self.host.state();
                state.source_devices.remove(id);
                state.unplug_pending = None;
                Ok(())
            }
        }
    }

    async fn pause(&self) -> Result<(), VmmError> {
        self.host.call(self.op("src.pause", "dst.pause"));
        Err(refused("pause"))
    }

    async fn add_device(&self, device: &DeviceSpec) -> Result<AddedDevice, VmmError> {
        self.check_alive("add device")?;
        if self
            .host
            .call(self.op("src.add_device", "dst.add_device"))
            .is_some()
        {
            return Err(refused("add device"));
        }
        let mut state = self.host.state();
        let devices = match self.side {
            Where::Source => &mut state.source_devices,
            Where::Destination => &mut state.destination_devices,
        };
        if !devices.insert(device.id().into()) {
            return Err(refused("add device"));
        }
        state.plugged.push((self.side, device.clone()));
        Ok(AddedDevice {
            id: device.id().into(),
            bdf: None,
        })
    }

    async fn prepare_incoming(&self, _uri: &str, handover: VfioHandover) -> Result<(), VmmError> {
        self.check_alive("prepare incoming migration")?;
        self.host.call("dst.prepare_incoming");
        self.host.state().handed = handover.devices.iter().map(|(id, _)| id.clone()).collect();
        Ok(())
    }

    async fn send_migration(&self, _uri: &str, _limits: &MigrationLimits) -> Result<(), VmmError> {
        self.host.call("src.send_migration");
        self.host.state().migrating = true;
        Ok(())
    }

    async fn migration_blockers(&self) -> Result<Vec<String>, VmmError> {
        self.host.call("src.migration_blockers");
        Ok(Vec::new())
    }

    async fn send_migration_held(
        &self,
        uri: &str,
        limits: &MigrationLimits,
        _deadline: Duration,
    ) -> Result<Held, VmmError> {
        self.send_migration(uri, limits).await?;
        self.host.call("src.hold_switchover");
        Ok(Held::Ready)
    }

    async fn release_switchover(&self, _limits: &MigrationLimits) -> Result<(), VmmError> {
        self.host.call("src.release_switchover");
        Ok(())
    }

    async fn wait_migration(
        &self,
        deadline: Duration,
        progress: ProgressFn<'_>,
    ) -> Result<MigrationProgress, VmmError> {
        let fault = self.host.call("src.wait_migration");
        {
            let state = self.host.state();
            if !state.migrating && state.source_state != "postmigrate" {
                // Cancelled (or never started): QEMU reports it as over.
                return Err(VmmError::MigrationFailed {
                    status: MigrationStatus::Cancelled,
                    reason: "cancelled".into(),
                });
            }
        }
        let sample = |status: MigrationStatus| MigrationProgress {
            vm_stopped_at: (status == MigrationStatus::Completed).then_some(FAKE_STOP),
            status,
            total_time_ms: Some(700),
            setup_time_ms: Some(5),
            downtime_ms: Some(20),
            ram_transferred: Some(1 << 20),
            ram_remaining: Some(0),
            ram_total: None,
            mbps: None,
            ram_syncs: None,
            error: None,
        };
        match fault {
            Some(Fault::Timeout) => Err(VmmError::TimedOut {
                operation: "migration",
                deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
            }),
            Some(_) => {
                self.host.state().migrating = false;
                Err(VmmError::MigrationFailed {
                    status: MigrationStatus::Failed,
                    reason: "failed on cue".into(),
                })
            }
            None => {
                {
                    let mut state = self.host.state();
                    state.migrating = false;
                    state.source_state = "postmigrate".into();
                    state.destination_state = "running".into();
                    state.guest = Where::Destination;
                    // What is still plugged moves with the VM (hot: the device).
                    let moved = std::mem::take(&mut state.source_devices);
                    state.destination_devices.extend(moved);
                }
                let done = sample(MigrationStatus::Completed);
                progress(&done);
                Ok(done)
            }
        }
    }

    async fn confirm_received(&self, _deadline: Duration) -> Result<Option<SystemTime>, VmmError> {
        self.check_alive("confirm the received migration")?;
        if self.host.call("dst.confirm_received").is_some() {
            return Err(VmmError::MigrationFailed {
                status: MigrationStatus::Failed,
                reason: "not received, on cue".into(),
            });
        }
        Ok(Some(FAKE_STOP + FAKE_PAUSE))
    }

    async fn cancel_migration(&self) -> Result<(), VmmError> {
        self.host.call("src.cancel_migration");
        self.host.state().migrating = false;
        Ok(())
    }

    async fn quit(&self) -> Result<(), VmmError> {
        self.check_alive("quit")?;
        self.host.call(self.op("src.quit", "dst.quit"));
        let mut state = self.host.state();
        if self.side == Where::Destination {
            state.destination_gone = true;
            if state.guest == Where::Destination {
                state.guest = Where::Source;
            }
        }
        Ok(())
    }

    async fn open_agent_channel(&self) -> Result<Box<dyn AgentStream>, VmmError> {
        Err(VmmError::NoAgentChannel)
    }

    async fn has_device(&self, id: &str) -> Result<bool, VmmError> {
        self.check_alive("has device")?;
        let mut state = self.host.state();
        if self.side == Where::Source && state.unplug_pending.as_deref() == Some(id) {
            match state.holder_lets_go_after {
                Some(0) => {
                    state.source_devices.remove(id);
                    state.unplug_pending = None;
                }
                Some(checks) => state.holder_lets_go_after = Some(checks - 1),
                None => {}
            }
        }
        Ok(match self.side {
            Where::Source => state.source_devices.contains(id),
            Where::Destination => state.destination_devices.contains(id),
        })
    }

    async fn resume(&self) -> Result<(), VmmError> {
        self.host.call(self.op("src.resume", "dst.resume"));
        let mut state = self.host.state();
        if self.side == Where::Source && state.source_state == "postmigrate" {
            state.source_state = "running".into();
            state.guest = Where::Source;
        }
        Ok(())
    }
}

/// The guest's agent, answering wherever the guest runs.
struct FakeAgent {
    host: FakeHost,
}

const CONNECTIONS: [ConnectionId; 2] = [11, 12];

fn timed_out(request: &'static str) -> AgentError {
    AgentError::TimedOut {
        request,
        deadline_ms: 1,
    }
}

#[async_trait]
impl GuestAgent for FakeAgent {
    async fn ping(&mut self, deadline: Duration) -> Result<String, AgentError> {
        match self.host.call("agent.ping") {
            Some(_) => {
                tokio::time::sleep(deadline).await;
                Err(timed_out("ping"))
            }
            None => Ok("fake".into()),
        }
    }

    async fn list_connections(
        &mut self,
        _deadline: Duration,
    ) -> Result<Vec<ConnectionInfo>, AgentError> {
        self.host.call("agent.list");
        Ok(CONNECTIONS
            .iter()
            .map(|id| ConnectionInfo {
                id: *id,
                pid: 100,
                role: Role::Active,
                local: "10.77.0.2:1".into(),
                peer: "10.77.0.3:7471".into(),
                state: ConnectionState::Established,
                last_sent: 0,
                last_received: 0,
                unacked: 0,
                bridge: false,
                qp: None,
            })
            .collect())
    }

    async fn list_unmanaged(
        &mut self,
        _deadline: Duration,
    ) -> Result<Vec<UnmanagedProgram>, AgentError> {
        if self.host.call("agent.list_unmanaged") == Some(Fault::Timeout) {
            return Err(timed_out("list unmanaged programs"));
        }
        Ok(self.host.state().unmanaged.clone())
    }

    async fn quiesce(
        &mut self,
        known: &[ConnectionId],
        _deadline: Duration,
        _mode: QuiesceMode,
    ) -> Result<Outcomes, AgentError> {
        let fault = self.host.call("agent.quiesce");
        if fault == Some(Fault::Timeout) {
            return Err(timed_out("quiesce"));
        }
        self.host.state().quiesced = true;
        let answered = if fault == Some(Fault::LeavesOut) {
            &known[..known.len().saturating_sub(1)]
        } else {
            known
        };
        let outcomes = answered
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let failed = i == 0 && fault == Some(Fault::PeerNoAck);
                ConnectionOutcome {
                    id: *id,
                    ok: !failed,
                    elapsed_ms: 3,
                    error: failed.then(|| "the peer did not acknowledge the PAUSE".into()),
                    fell_back: None,
                }
            })
            .collect();
        Ok(Outcomes {
            outcomes,
            elapsed_ms: 5,
        })
    }

    async fn release_device(
        &mut self,
        _scope: ReleaseScope,
        _grace: Duration,
        _deadline: Duration,
    ) -> Result<Vec<DeviceHolder>, AgentError> {
        if self.host.call("agent.release_device").is_some() {
            return Err(timed_out("release the device"));
        }
        let mut state = self.host.state();
        let mut holders: Vec<DeviceHolder> = std::mem::take(&mut state.unmanaged)
            .into_iter()
            .map(|program| DeviceHolder {
                pid: program.pid,
                program: program.command,
                action: "SIGTERM".into(),
                released: true,
            })
            .collect();
        // The process that held a pending unplug (a library user that did not let go: it is
        // no unmanaged program) is made to: the unplug can complete.
        if state.unplug_pending.is_some() && state.faults.remove("src.remove_device").is_some() {
            holders.push(DeviceHolder {
                pid: 4242,
                program: "ibv_rc_pingpong".into(),
                action: "SIGTERM".into(),
                released: true,
            });
        }
        Ok(holders)
    }

    async fn resume(
        &mut self,
        known: &[ConnectionId],
        _deadline: Duration,
    ) -> Result<Outcomes, AgentError> {
        let fault = self.host.call("agent.resume");
        if fault.is_some() {
            return Err(timed_out("resume"));
        }
        let mut state = self.host.state();
        state.quiesced = false;
        let guest = state.guest;
        state.resumed_on.push(guest);
        Ok(Outcomes {
            outcomes: known
                .iter()
                .map(|id| ConnectionOutcome {
                    id: *id,
                    ok: true,
                    elapsed_ms: 4,
                    error: None,
                    fell_back: None,
                })
                .collect(),
            elapsed_ms: 6,
        })
    }
}

/// [`Backends`] over the fake host; endpoints whose control socket starts with `/s` are the
/// source.
#[derive(Debug, Clone)]
pub struct FakeBackends(pub FakeHost);

#[async_trait]
impl Backends for FakeBackends {
    async fn connect(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError> {
        let side = if endpoint.control_socket().starts_with("/s") {
            Where::Source
        } else {
            Where::Destination
        };
        if side == Where::Destination && self.0.state().destination_gone {
            return Err(VmmError::Connect {
                path: endpoint.control_socket().display().to_string(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        Ok(Arc::new(FakeVmm {
            host: self.0.clone(),
            side,
        }))
    }

    async fn agent(&self, _vmm: &dyn Vmm) -> Result<Box<dyn GuestAgent>, VmmError> {
        Ok(Box::new(FakeAgent {
            host: self.0.clone(),
        }))
    }
}
