//! Why one step inside a phase failed: the error every phase body, the destination duties
//! (this host's or another migrator's) and the backends share, so that the runner can tell
//! a deadline that passed (forced paths, rollback) from a refusal.

use std::time::Duration;

use rdmamig_vmm::VmmError;
use thiserror::Error;

use crate::agent::AgentError;
use crate::journal::JournalError;
use crate::machine::Phase;
use crate::peer::tls::PeerError;
use crate::pool::PoolError;
use crate::strategy::StrategyError;
use crate::vf_mac::VfMacError;

/// Time a step may overrun its deadline before it is given up on: every call inside has
/// its own deadline, so this only catches a call that ignores it.
pub const GRACE: Duration = Duration::from_millis(250);

/// Why one step inside a phase failed.
#[derive(Debug, Error)]
pub enum StepError {
    /// A VMM call failed.
    #[error(transparent)]
    Vmm(#[from] VmmError),
    /// An agent exchange failed.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The journal could not record the step, so the step did not act.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The destination's pool could not give or take a function.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The destination migrator could not be asked, or refused.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// The strategy asked for cannot run.
    #[error(transparent)]
    Strategy(#[from] StrategyError),
    /// The VF to plug could not be given the VM's MAC.
    #[error(transparent)]
    VfMac(#[from] VfMacError),
    /// A VMM is not in the state the phase needs.
    #[error("the {side} VM is {state}, {expected}")]
    VmState {
        /// `source` or `destination`.
        side: &'static str,
        /// Its state.
        state: String,
        /// What was expected, in words.
        expected: &'static str,
    },
    /// Some connections did not come back.
    #[error("{failed} of {total} connections did not resume: {details}")]
    ConnectionsLost {
        /// How many failed.
        failed: usize,
        /// How many were listed.
        total: usize,
        /// `id: error` for each failure.
        details: String,
    },
    /// The phase as a whole ran past its deadline (a call inside ignored its own).
    #[error("a step did not return in time")]
    Stalled,
    /// The guest had not finished an unplug it was asked for, so the device could not be
    /// plugged again; the VM loses it whenever the guest does finish.
    #[error(
        "the guest has not finished removing device {device} after {waited_ms} ms (a process \
         in the guest still holds it): the VM keeps the device until the guest lets it go, \
         and then has none; plug it again once the VMM no longer lists it"
    )]
    RemovalPending {
        /// The device.
        device: String,
        /// How long the rollback waited.
        waited_ms: u64,
    },
    /// The migrator was restarted while the phase ran.
    #[error("the migrator was restarted during {phase}")]
    Interrupted {
        /// The phase.
        phase: Phase,
    },
    /// The plan does not name something this step needs (a workflow's move learns its
    /// destination only at `post-migrate`).
    #[error("the move does not name {what}")]
    NotNamed {
        /// What is missing, in words.
        what: &'static str,
    },
    /// The source VMM is on another host than this process (a workflow's `post-migrate`
    /// ran on the destination host), so this process cannot undo the move there.
    #[error(
        "the source VMM is on host {host}, not this one ({here}): run the source side by hand \
         there (the VM, paused after its migration, resumes with its NIC plugged back)"
    )]
    SourceElsewhere {
        /// Where the move began.
        host: String,
        /// This host.
        here: String,
    },
    /// A destination function cannot be handed to the receiving VMM.
    #[error("function {function} cannot be handed to the receiving VMM: {reason}")]
    NoHandOver {
        /// The pool function.
        function: String,
        /// Why.
        reason: String,
    },
    /// Opening a function's VFIO device nodes failed.
    #[error(transparent)]
    Vfio(#[from] crate::vfio::VfioError),
    /// Programs hold an RDMA device without the library, and the policy is `refuse`.
    #[error(
        "{count} program(s) in the guest hold an RDMA device without rdmamig's library, and \
         the move would break them{since}: {named}. End them first, or move with --unmanaged \
         release (ends them before the unplug) or --unmanaged ignore (moves anyway; the \
         report marks them broken)"
    )]
    UnmanagedPrograms {
        /// How many.
        count: usize,
        /// `" (started since prepare)"` when found right before the unplug.
        since: &'static str,
        /// Each, by PID, command line and device files.
        named: String,
    },
}

impl StepError {
    /// Whether it is a deadline that passed (the forced paths act on these).
    pub fn is_timeout(&self) -> bool {
        match self {
            StepError::Vmm(e) => e.is_timeout(),
            StepError::Agent(e) => e.is_timeout(),
            StepError::Stalled | StepError::RemovalPending { .. } => true,
            StepError::Peer(e) => e.is_timeout(),
            StepError::Journal(_)
            | StepError::Strategy(_)
            | StepError::VfMac(_)
            | StepError::Pool(_)
            | StepError::VmState { .. }
            | StepError::ConnectionsLost { .. }
            | StepError::Interrupted { .. }
            | StepError::NotNamed { .. }
            | StepError::SourceElsewhere { .. }
            | StepError::NoHandOver { .. }
            | StepError::Vfio(_)
            | StepError::UnmanagedPrograms { .. } => false,
        }
    }
}

/// Runs `step` under `deadline`; a step still running then is [`StepError::Stalled`].
pub async fn within<T, E: Into<StepError>>(
    deadline: Duration,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, StepError> {
    match tokio::time::timeout(deadline, step).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(StepError::Stalled),
    }
}
