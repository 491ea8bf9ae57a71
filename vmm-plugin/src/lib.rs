//! The VMM adapter: what a move needs from the hypervisor, behind one narrow trait.
//!
//! The migrator drives a move through [`Vmm`] only, so that a QEMU guest and a Cloud
//! Hypervisor guest move the same way. The trait is as small as the move: status, pause and
//! resume, remove a device and wait until the guest released it, add a device (its id and
//! PCI address back), the two ends of a live migration with limits and progress, cancel,
//! quit, and the host end of the guest-agent channel.
//!
//! Layout:
//! - [`qmp`]: a QMP client (UNIX socket, commands with ids, events delivered to waiters);
//! - [`qemu`]: the QEMU backend of [`Vmm`] built on it;
//! - [`ch_api`]: Cloud Hypervisor's REST API over its `--api-socket` (hyper), one typed
//!   request per endpoint and every status its OpenAPI spec lists mapped to a kind;
//! - [`ch_events`]: Cloud Hypervisor's `--event-monitor` stream, which is how a migration's
//!   outcome is known (its `vm.send-migration` answers 204 before anything happened);
//! - [`cloud_hypervisor`]: the Cloud Hypervisor backend of [`Vmm`] built on both;
//! - [`vsock`]: the host end of a hybrid vsock (`CONNECT <port>` / `OK <port>`);
//! - [`device`]: device descriptions (`driver=...,id=...` as an operator writes them);
//! - [`migration`]: migration progress as the VMM reports it.
//!
//! Errors that callers act on are typed ([`VmmError`]): a device that is not there, a
//! conflict with what exists, a request the VMM refused (with its own words), a deadline
//! that passed (naming the operation), and a VMM that went away.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};

pub mod ch_api;
pub mod ch_events;
pub mod cloud_hypervisor;
pub mod device;
mod fd_passing;
pub mod migration;
pub mod qemu;
pub mod qmp;
pub mod vsock;

pub use cloud_hypervisor::{ChConfig, ChVmm};
pub use device::{DeviceSpec, DeviceSpecError};
pub use migration::{
    vm_paused, MigrationLimits, MigrationProgress, MigrationStatus, TimeoutStrategy,
    MAX_MIGRATION_CONNECTIONS,
};
pub use qemu::{QemuConfig, QemuVmm};

/// A byte stream to the guest agent, whatever carries it (virtio-serial, hybrid vsock).
pub trait AgentStream: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> AgentStream for T {}

/// The run state of a VM as its VMM reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmStatus {
    /// Whether the guest's vCPUs run.
    pub running: bool,
    /// The VMM's own name for the state (QEMU: `running`, `paused`, `prelaunch`,
    /// `inmigrate`, `postmigrate`, ...; Cloud Hypervisor: `Running`, `Paused`, `Created`,
    /// `Shutdown`, or `no VM`).
    pub state: String,
    /// What the state means for a move, whatever the VMM calls it.
    pub phase: VmPhase,
}

/// Where a VM stands as far as a live migration is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmPhase {
    /// The guest runs here.
    Running,
    /// The VM is here with its vCPUs stopped.
    Paused,
    /// The VMM waits for the VM to arrive (QEMU `inmigrate`).
    Incoming,
    /// The VM left with a completed migration (QEMU `postmigrate`).
    Migrated,
    /// The VMM holds no VM (Cloud Hypervisor before a VM is created or received, and after
    /// it left): at a destination it can receive one, at a source the VM has gone.
    NoVm,
    /// Anything else: shut down, crashed, created but not booted, a migration in progress.
    Other,
}

/// A device the VMM plugged.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AddedDevice {
    /// Its id in the VMM.
    pub id: String,
    /// Its PCI address in the guest (`0000:00:02.0`), when the VMM reports one.
    pub bdf: Option<String>,
}

/// Called with every progress sample while a migration runs.
pub type ProgressFn<'a> = &'a mut (dyn FnMut(&MigrationProgress) + Send);

/// VFIO devices handed to a receiving VMM as open descriptors, so that the destination's VF
/// may sit at another address than the source's (Cloud Hypervisor's main branch after v53
/// takes them with its receive: `vfio_fds`, `iommufd_fd`; NOTES.md).
#[derive(Debug, Clone, Default)]
pub struct VfioHandover {
    /// (the device's id in the VM's config, its VFIO cdev `/dev/vfio/devices/vfioN`).
    pub devices: Vec<(String, Arc<OwnedFd>)>,
    /// A fresh `/dev/iommu` for them.
    pub iommufd: Option<Arc<OwnedFd>>,
}

impl VfioHandover {
    /// Whether nothing is handed over.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.iommufd.is_none()
    }
}

/// What a move needs from a VMM.
///
/// Every call that waits takes a deadline; none waits unbounded.
#[async_trait]
pub trait Vmm: Send + Sync {
    /// The VM's run state.
    async fn status(&self) -> Result<VmStatus, VmmError>;

    /// Stops the guest's vCPUs.
    async fn pause(&self) -> Result<(), VmmError>;

    /// Lets a paused guest run again (a move that rolls back after its migration completed
    /// restarts the source VM, which the VMM paused at the end of the migration).
    async fn resume(&self) -> Result<(), VmmError>;

    /// Asks the guest to release device `id` and waits until the VMM reports it gone.
    ///
    /// Fails with [`VmmError::DeviceNotReleased`] when the guest still holds the device at
    /// the deadline (for example a process keeps an RDMA context on it open). The request
    /// stays pending in the guest: calling again for the same device does not ask again, it
    /// waits again (asking twice would cancel the unplug in a Linux guest).
    async fn remove_device(&self, id: &str, deadline: Duration) -> Result<(), VmmError>;

    /// Plugs a new device; returns its id and, where the VMM tells, its PCI address.
    ///
    /// A passthrough function is `driver=vfio-pci,host=<BDF>,id=<id>` for every backend
    /// (Cloud Hypervisor gets it as `/sys/bus/pci/devices/<BDF>`).
    async fn add_device(&self, device: &DeviceSpec) -> Result<AddedDevice, VmmError>;

    /// Readies this (destination) VMM to receive a migration at `uri`, handing it the VFIO
    /// devices of `handover` (none: the VMM has its devices already).
    async fn prepare_incoming(&self, uri: &str, handover: VfioHandover) -> Result<(), VmmError>;

    /// Starts sending this VM to `uri` within `limits`; returns once the migration has
    /// started. Starting is not succeeding: only [`Vmm::wait_migration`] says how it ended.
    async fn send_migration(&self, uri: &str, limits: &MigrationLimits) -> Result<(), VmmError>;

    /// Why this VM cannot migrate as it is, in the VMM's words (QEMU's migration blockers:
    /// a device without migration support names itself); empty when nothing blocks it.
    /// [`VmmError::Unsupported`] from a VMM that cannot tell.
    async fn migration_blockers(&self) -> Result<Vec<String>, VmmError>;

    /// Starts sending this VM to `uri` like [`Vmm::send_migration`], but holds the migration
    /// short of its switchover: memory is copied while the guest runs, and the VMM does not
    /// stop the VM until [`Vmm::release_switchover`]. Returns once the copy is as far as it
    /// gets without the stop (the last moment to pause the guest's senders), within
    /// `deadline`. [`Held::SwitchedOver`] when the VMM stopped the VM before the hold took.
    /// [`VmmError::Unsupported`] from a VMM that cannot hold a switchover (nothing started).
    async fn send_migration_held(
        &self,
        uri: &str,
        limits: &MigrationLimits,
        deadline: Duration,
    ) -> Result<Held, VmmError>;

    /// Lets a migration held by [`Vmm::send_migration_held`] switch over within `limits`.
    async fn release_switchover(&self, limits: &MigrationLimits) -> Result<(), VmmError>;

    /// Waits until the outgoing migration completes, calling `progress` with every sample.
    /// The completed sample carries the guest's stop time where the VMM tells
    /// ([`MigrationProgress::vm_stopped_at`]).
    ///
    /// A migration that fails or is cancelled is an error carrying the VMM's reason.
    async fn wait_migration(
        &self,
        deadline: Duration,
        progress: ProgressFn<'_>,
    ) -> Result<MigrationProgress, VmmError>;

    /// Confirms that this (destination) VMM received the whole VM and holds it (in the run
    /// state it had at the source); waits up to
    /// `deadline` for it to get there. A migration the destination did not receive is
    /// [`VmmError::MigrationFailed`], however the source saw it end.
    ///
    /// Returns when the guest started running here, by this host's clock, if the VMM tells
    /// (QEMU's `RESUME` event, seen when this connection readied the incoming side): with
    /// [`MigrationProgress::vm_stopped_at`] it gives [`vm_paused`]. `None` for a guest that
    /// arrived paused, or a VMM that does not tell.
    async fn confirm_received(&self, deadline: Duration) -> Result<Option<SystemTime>, VmmError>;

    /// Cancels the outgoing migration.
    async fn cancel_migration(&self) -> Result<(), VmmError>;

    /// Ends the VMM process.
    async fn quit(&self) -> Result<(), VmmError>;

    /// Opens the host end of the channel to the guest agent.
    async fn open_agent_channel(&self) -> Result<Box<dyn AgentStream>, VmmError>;

    /// Whether the VM has a device with this id (a migrator that restarted mid-move asks
    /// before it re-attaches or detaches anything).
    async fn has_device(&self, id: &str) -> Result<bool, VmmError>;
}

/// Where a migration started by [`Vmm::send_migration_held`] stands when the call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Held short of the switchover: the guest runs until [`Vmm::release_switchover`].
    Ready,
    /// The VMM stopped the VM for its switchover before the hold took (or the migration
    /// ended): the guest can no longer be asked for anything on this side.
    SwitchedOver,
}

/// Why a VMM operation failed.
#[derive(Debug, Error)]
pub enum VmmError {
    /// Could not reach the VMM's control socket.
    #[error("cannot connect to the VMM at {path}")]
    Connect {
        /// The control socket.
        path: String,
        /// What the connect said.
        #[source]
        source: std::io::Error,
    },
    /// The object named in a request does not exist in the VM.
    #[error("{operation}: {object} not found ({message})")]
    NotFound {
        /// The operation.
        operation: &'static str,
        /// What was not found (a device id, ...).
        object: String,
        /// The VMM's words.
        message: String,
    },
    /// The request conflicts with what the VM has (a device with that id or path exists).
    #[error("{operation}: {object} conflicts with an existing one ({message})")]
    Conflict {
        /// The operation.
        operation: &'static str,
        /// What conflicts (a device id, a path).
        object: String,
        /// The VMM's words.
        message: String,
    },
    /// The VMM has no way to do this.
    #[error("{operation} is not supported by {vmm}: {reason}")]
    Unsupported {
        /// The operation.
        operation: &'static str,
        /// The VMM.
        vmm: &'static str,
        /// Why, and what to do instead.
        reason: String,
    },
    /// The VMM refused a request.
    #[error("{operation}: the VMM refused: {message} ({class})")]
    Refused {
        /// The operation.
        operation: &'static str,
        /// The VMM's error class (QEMU: `GenericError`, `CommandNotFound`, ...; Cloud
        /// Hypervisor: the HTTP status, `HTTP 500`).
        class: String,
        /// The VMM's words.
        message: String,
    },
    /// The guest did not release a device before the deadline.
    #[error(
        "the guest did not release device {device} within {deadline_ms} ms \
         (a process in the guest may still hold it open)"
    )]
    DeviceNotReleased {
        /// The device id.
        device: String,
        /// The deadline that passed.
        deadline_ms: u64,
    },
    /// An operation did not finish before its deadline.
    #[error("{operation} did not finish within {deadline_ms} ms")]
    TimedOut {
        /// The operation.
        operation: &'static str,
        /// The deadline that passed.
        deadline_ms: u64,
    },
    /// The migration ended without completing.
    #[error("migration {status}: {reason}")]
    MigrationFailed {
        /// `failed` or `cancelled`.
        status: MigrationStatus,
        /// The VMM's reason (QEMU's `error-desc`), or a note that it gave none.
        reason: String,
    },
    /// The VMM closed its control socket (it exited or crashed).
    #[error("{operation}: the VMM is gone (its control socket closed)")]
    Gone {
        /// The operation that found it gone.
        operation: &'static str,
    },
    /// The VMM stopped answering while an operation waited on it.
    #[error("{operation}: the VMM at {socket} no longer answers (it died, or hangs)")]
    Died {
        /// What was waiting on it.
        operation: &'static str,
        /// Its control socket.
        socket: String,
        /// What the liveness check got.
        #[source]
        cause: Box<VmmError>,
    },
    /// The VMM said something this adapter cannot make sense of.
    #[error("{operation}: unexpected answer from the VMM: {reason}")]
    Protocol {
        /// The operation.
        operation: &'static str,
        /// What was wrong with it.
        reason: String,
    },
    /// The exchange with the VMM broke in a way none of the kinds above describes.
    #[error("{operation}: talking to the VMM failed")]
    Transport {
        /// The operation.
        operation: &'static str,
        /// The backend's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The VM was described without an agent channel.
    #[error("no agent channel is configured for this VM")]
    NoAgentChannel,
    /// Could not open the channel to the guest agent.
    #[error("cannot open the agent channel at {path}")]
    AgentChannel {
        /// The channel's socket.
        path: String,
        /// What the connect said.
        #[source]
        source: std::io::Error,
    },
    /// Could not open the hybrid vsock channel to the guest agent.
    #[error("cannot open the agent channel over vsock")]
    AgentVsock(#[source] vsock::VsockError),
}

impl VmmError {
    /// Whether the error is a deadline that passed (the device or migration may still finish).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            VmmError::DeviceNotReleased { .. }
                | VmmError::TimedOut { .. }
                | VmmError::AgentVsock(vsock::VsockError::TimedOut { .. })
        )
    }
}
