//! Runs one move: the phases of [`crate::machine`] against the two VMMs and the guest agent,
//! each under its deadline, journaled before it acts, recorded in a [`Timeline`], reported
//! as it goes; and undoes a move that fails before the point of no return.
//!
//! The runner owns the state machine, the journal, the deadlines, the timeline and the
//! events, so that a phase body cannot forget any of them. The VMMs and the agent are reached
//! through [`Backends`] and [`GuestAgent`], so that every failure path is unit-tested against
//! fakes and the same runner drives QEMU or Cloud Hypervisor in production.
//!
//! Failure paths:
//! - **forced paths.** A quiesce the agent does not answer, or that some connections fail
//!   (the peer did not acknowledge the PAUSE), is recorded as forced and the move goes on:
//!   the guest library recovers a connection whose device vanished without a quiesce
//!   (it waits for its peer and replays); when the agent failed at the quiesce, its silence
//!   at the resume is forced the same way (each connection reconnects by itself once its
//!   hold expires). A detach the guest does not complete (a process
//!   holds its device context) and a migration that stalls pass their deadlines and roll the
//!   move back (the migration is cancelled first). Every forced path is in the timeline and
//!   in the report's `forced` list.
//! - **rollback.** Any failure before the destination resumes connections rolls back: a
//!   migration in flight is cancelled (one that completed is undone by stopping the
//!   destination and letting the source run again: the guest had not talked to any peer
//!   from the destination yet), the device is plugged back on the source, the agent resumes
//!   the connections there, and the reservation on the destination is released.
//! - **recovery.** A migrator that restarts reads the journal of a move that did not end and
//!   [`recover`]s it: forward when the migration had completed, back otherwise.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdmamig_proto::agent::{ConnectionInfo, ConnectionOutcome, DeviceHolder, ReleaseScope};
use rdmamig_proto::clock::millis;
use rdmamig_proto::text::error_chain;
use rdmamig_proto::ConnectionId;
use rdmamig_vmm::{
    vm_paused, ChConfig, ChVmm, MigrationProgress, MigrationStatus, QemuConfig, QemuVmm, VmPhase,
    Vmm, VmmError,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;
use tokio::sync::mpsc::UnboundedSender;

use crate::agent::{AgentClient, AgentError, GuestAgent, Outcomes};
use crate::destination::{DestinationHost, LocalDestination, MoveRef};
use crate::journal::{Journal, JournalError, Record, Replay};
use crate::machine::{transition, InvalidTransition, Phase};
use crate::peer::{PeerError, PeerTls, RemoteDestination};
use crate::plan::{Endpoint, MovePlan, Strategy, UnmanagedPolicy};
use crate::pool::{Attachment, Pool, PoolError};
use crate::strategy::{choose_for, Choice, StrategyError};
use crate::timeline::{PhaseOutcome, PhaseRecord, Timeline, TimelineRecorder};
use crate::unmanaged::{Fate, Found, ProgramReport};

/// Time a phase may overrun its deadline before the runner gives up on it: every call inside
/// a phase has its own deadline, so this only catches a call that ignores it.
const GRACE: Duration = Duration::from_millis(250);

/// One attempt to reach a freshly connected agent; attempts repeat within the phase deadline.
const PING_ATTEMPT: Duration = Duration::from_millis(1000);

/// Migration progress is reported at most this often (and on every status change).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(200);

/// Time a process signalled by the forced release has between SIGTERM and SIGKILL.
const RELEASE_GRACE: Duration = Duration::from_millis(1000);

/// How often a rollback polls the source while a cancelled migration winds down.
const CANCEL_POLL: Duration = Duration::from_millis(50);

/// The part of a rollback's deadline kept, after the resume, to give the destination's
/// function back.
const RELEASE_RESERVE: Duration = Duration::from_secs(2);

/// How often a rollback polls the source while the guest finishes a pending unplug.
const REMOVAL_POLL: Duration = Duration::from_millis(100);

/// How the mover reaches VMMs and guest agents.
#[async_trait]
pub trait Backends: Send + Sync {
    /// Connects to the VMM of one end of the move.
    async fn connect(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError>;

    /// Opens a session with the guest agent through `vmm`'s agent channel.
    async fn agent(&self, vmm: &dyn Vmm) -> Result<Box<dyn GuestAgent>, VmmError>;
}

/// The VMM each endpoint names (QEMU over QMP, Cloud Hypervisor over its REST API), the
/// agent through that VMM's channel (virtio-serial, hybrid vsock).
#[derive(Debug, Default)]
pub struct VmmBackends;

#[async_trait]
impl Backends for VmmBackends {
    async fn connect(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError> {
        Ok(match endpoint {
            Endpoint::Qemu { qmp, agent } => {
                let mut config = QemuConfig::new(qmp);
                config.agent.clone_from(agent);
                Arc::new(QemuVmm::connect(config).await?)
            }
            Endpoint::CloudHypervisor {
                api_socket,
                event_monitor,
                vsock,
                agent_port,
            } => {
                let mut config = ChConfig::new(api_socket);
                config.event_monitor.clone_from(event_monitor);
                config.vsock.clone_from(vsock);
                config.agent_port = *agent_port;
                Arc::new(ChVmm::connect(config).await?)
            }
        })
    }

    async fn agent(&self, vmm: &dyn Vmm) -> Result<Box<dyn GuestAgent>, VmmError> {
        Ok(Box::new(AgentClient::new(vmm.open_agent_channel().await?)))
    }
}

/// Called with each phase once it is journaled and before it acts (fault injection: the
/// daemon aborts there when told to, which is how tests kill it at every phase boundary).
pub type BoundaryHook = Arc<dyn Fn(Phase) + Send + Sync>;

/// What a move needs besides its plan.
#[derive(Clone)]
pub struct MoveContext {
    /// The VMMs and agents.
    pub backends: Arc<dyn Backends>,
    /// This host's pool of passthrough functions (the destination's, when the destination
    /// VMM runs on this host).
    pub pool: Arc<Pool>,
    /// This host's identity towards other migrators (`[peer]` in the config), needed for a
    /// move whose destination is another migrator.
    pub peers: Option<PeerTls>,
    /// Called at every phase boundary.
    pub boundary: Option<BoundaryHook>,
}

impl MoveContext {
    /// The destination end of `plan`: this host, or the migrator it names.
    pub fn destination(&self, plan: &MovePlan) -> Result<Arc<dyn DestinationHost>, PeerError> {
        match &plan.destination_migrator {
            None => Ok(Arc::new(LocalDestination::new(
                self.backends.clone(),
                self.pool.clone(),
            ))),
            Some(target) => {
                let tls = self.peers.clone().ok_or(PeerError::NotConfigured)?;
                let target = tls.resolve(target)?;
                Ok(Arc::new(RemoteDestination::new(tls, target)))
            }
        }
    }
}

/// What a move reports while it runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum MoveEvent {
    /// A phase started.
    PhaseStarted {
        /// The phase.
        phase: Phase,
        /// When, ms since the epoch.
        unix_ms: u64,
        /// Ms since the move started.
        at_ms: u64,
        /// Its deadline, ms.
        deadline_ms: u64,
    },
    /// A phase ended.
    PhaseEnded {
        /// Ms since the move started.
        at_ms: u64,
        /// Its record in the timeline.
        record: PhaseRecord,
    },
    /// A migration progress sample.
    Migration {
        /// Ms since the move started.
        at_ms: u64,
        /// The sample.
        progress: MigrationProgress,
    },
    /// Something the operator should know that is not a failure.
    Warning {
        /// Ms since the move started.
        at_ms: u64,
        /// What.
        message: String,
    },
}

/// Where the VM is after the move (or its failure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmLocation {
    /// The source VMM still runs the VM.
    Source,
    /// The destination VMM runs the VM.
    Destination,
}

/// A forced path the move took.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForcedPath {
    /// The phase.
    pub phase: Phase,
    /// What was forced and why.
    pub reason: String,
}

/// The outcome of a move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveReport {
    /// The move's id (its journal and report files are named after it).
    pub id: String,
    /// The plan that ran.
    pub plan: MovePlan,
    /// Whether the move reached `done`.
    pub ok: bool,
    /// `done`, `rolled_back` or `failed`.
    pub final_phase: Phase,
    /// The phase that failed, if one did.
    pub failed_phase: Option<Phase>,
    /// The error, with its causes, if the move failed.
    pub error: Option<String>,
    /// Why the rollback could not finish, if it did not.
    pub rollback_error: Option<String>,
    /// Where the VM is now.
    pub vm_location: VmLocation,
    /// The forced paths taken.
    pub forced: Vec<ForcedPath>,
    /// Set when a restarted migrator finished this move from its journal: the last phase
    /// the killed migrator had entered.
    pub recovered_from: Option<Phase>,
    /// The pool function plugged on the destination (or released by the rollback).
    pub function: Option<String>,
    /// The strategy the move ran and why (`auto` decided at prepare).
    #[serde(default)]
    pub chosen: Option<Choice>,
    /// Every phase with its times (after a restart: the phases the restarted migrator ran).
    pub timeline: Timeline,
    /// The connections the agent listed at prepare.
    pub connections: Vec<ConnectionInfo>,
    /// Per-connection quiesce results.
    pub quiesce: Vec<ConnectionOutcome>,
    /// Per-connection resume results.
    pub resume: Vec<ConnectionOutcome>,
    /// The final migration sample (QEMU's total time, downtime, bytes).
    pub migration: Option<MigrationProgress>,
    /// The programs that held an RDMA device without the library, and what the move did
    /// to them.
    #[serde(default)]
    pub unmanaged: Vec<ProgramReport>,
}

impl MoveReport {
    /// The unmanaged programs the move ended or broke (a `done` with these is no plain
    /// success).
    pub fn casualties(&self) -> impl Iterator<Item = &ProgramReport> {
        self.unmanaged.iter().filter(|p| p.fate != Fate::Untouched)
    }
}

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
    fn is_timeout(&self) -> bool {
        match self {
            StepError::Vmm(e) => e.is_timeout(),
            StepError::Agent(e) => e.is_timeout(),
            StepError::Stalled | StepError::RemovalPending { .. } => true,
            StepError::Peer(e) => e.is_timeout(),
            StepError::Journal(_)
            | StepError::Strategy(_)
            | StepError::Pool(_)
            | StepError::VmState { .. }
            | StepError::ConnectionsLost { .. }
            | StepError::Interrupted { .. }
            | StepError::UnmanagedPrograms { .. } => false,
        }
    }
}

/// Why a move stopped.
#[derive(Debug, Error)]
pub enum MoveError {
    /// A phase ran out of time.
    #[error("phase {phase} missed its deadline of {deadline_ms} ms")]
    DeadlineMissed {
        /// The phase.
        phase: Phase,
        /// Its deadline.
        deadline_ms: u64,
        /// What was still pending.
        #[source]
        cause: StepError,
    },
    /// A phase failed.
    #[error("phase {phase} failed")]
    PhaseFailed {
        /// The phase.
        phase: Phase,
        /// Why.
        #[source]
        cause: StepError,
    },
    /// The runner asked the state machine for a step it does not allow (a bug).
    #[error("internal error")]
    Transition(#[from] InvalidTransition),
}

/// What a phase body hands back to the runner.
struct Finished {
    outcome: PhaseOutcome,
    details: Map<String, Value>,
}

impl Finished {
    fn ok(details: Map<String, Value>) -> Finished {
        Finished {
            outcome: PhaseOutcome::Ok,
            details,
        }
    }

    fn skipped(reason: &str) -> Finished {
        Finished {
            outcome: PhaseOutcome::Skipped {
                reason: reason.into(),
            },
            details: Map::new(),
        }
    }
}

/// Runs `plan` to the end under the journal `journal` (already holding its `begin` record),
/// sending events to `events`, and returns the report.
///
/// The plan must have passed [`MovePlan::validate`].
pub async fn run_move(
    id: String,
    plan: MovePlan,
    journal: Journal,
    context: MoveContext,
    events: UnboundedSender<MoveEvent>,
) -> MoveReport {
    let mut mover = Mover::new(id, plan, journal, context, events);
    let result = mover.run(&Phase::WORKING).await;
    mover.report(result)
}

/// Finishes or rolls back a move a killed migrator left unfinished, from its journal.
///
/// The move goes forward when its migration had completed (journaled, or the source VMM
/// says so: the kill may have come between the two) and back otherwise. A rollback that had
/// started goes on.
pub async fn recover(
    replay: Replay,
    journal: Journal,
    context: MoveContext,
    events: UnboundedSender<MoveEvent>,
) -> MoveReport {
    let mut mover = Mover::new(
        replay.id.clone(),
        replay.plan.clone(),
        journal,
        context,
        events,
    );
    mover.ids = replay.connections();
    mover.function = replay.reserved();
    if let Some(choice) = replay.chosen() {
        mover.strategy = choice.strategy;
        mover.chosen = Some(choice);
    }
    let last = replay.last_phase();
    mover.recovered_from = Some(last.unwrap_or(Phase::Prepare));
    mover.reached = last.unwrap_or(Phase::Prepare);
    mover.migrated = replay.migrated();
    mover.unplugging = replay.unplugging();
    mover.phase = mover.reached;
    let result = match (replay.rolling_back(), last) {
        (Some(reason), _) => {
            mover.warn(format!(
                "the migrator restarted during the rollback ({reason}); going on with it"
            ));
            mover.phase = Phase::Rollback;
            let failed = mover.reached;
            match mover.finish_rollback(failed).await {
                Ok(()) => Err((
                    failed,
                    MoveError::PhaseFailed {
                        phase: failed,
                        cause: StepError::Interrupted { phase: failed },
                    },
                )),
                Err(e) => Err(e),
            }
        }
        (None, None) => {
            let cause = StepError::Interrupted {
                phase: Phase::Prepare,
            };
            mover
                .fail_and_roll_back(
                    Phase::Prepare,
                    MoveError::PhaseFailed {
                        phase: Phase::Prepare,
                        cause,
                    },
                )
                .await
        }
        (None, Some(last)) => mover.recover_from(last).await,
    };
    mover.report(result)
}

/// How a move ended, as the runner sees it: `Ok` for done, or the failed phase and error.
type RunResult = Result<(), (Phase, MoveError)>;

struct Mover {
    id: String,
    plan: MovePlan,
    events: UnboundedSender<MoveEvent>,
    recorder: TimelineRecorder,
    journal: Journal,
    context: MoveContext,
    phase: Phase,
    /// The last working phase entered (and journaled).
    reached: Phase,
    /// Whether the migration completed.
    migrated: bool,
    /// Whether the source VMM was asked to unplug the device (journaled first): an unplug
    /// the guest may still finish.
    unplugging: bool,
    source: Option<Arc<dyn Vmm>>,
    /// The destination end, resolved on first use (a recovering migrator resolves afresh).
    destination: Option<Arc<dyn DestinationHost>>,
    agent: Option<Box<dyn GuestAgent>>,
    connections: Vec<ConnectionInfo>,
    ids: Vec<ConnectionId>,
    quiesce: Vec<ConnectionOutcome>,
    resume: Vec<ConnectionOutcome>,
    migration: Option<MigrationProgress>,
    location: VmLocation,
    forced: Vec<ForcedPath>,
    rollback_error: Option<String>,
    recovered_from: Option<Phase>,
    /// The strategy the move runs: the plan's until prepare decided (`auto`).
    strategy: Strategy,
    chosen: Option<Choice>,
    /// The function reserved in the destination's pool.
    function: Option<(String, Attachment)>,
    /// How the reset of the source's function after the detach went (`None`: not done in
    /// this process, e.g. after a restart).
    source_reset: Option<Result<String, String>>,
    /// Why the agent failed at the quiesce, when the move went on without it: its silence
    /// at the resume is then expected, not a failure.
    agent_lost: Option<String>,
    /// The unmanaged programs found so far.
    unmanaged: Found,
}

impl Mover {
    fn new(
        id: String,
        plan: MovePlan,
        journal: Journal,
        context: MoveContext,
        events: UnboundedSender<MoveEvent>,
    ) -> Mover {
        Mover {
            id,
            strategy: plan.strategy,
            plan,
            events,
            recorder: TimelineRecorder::start(),
            journal,
            context,
            phase: Phase::Prepare,
            reached: Phase::Prepare,
            migrated: false,
            unplugging: false,
            source: None,
            destination: None,
            agent: None,
            connections: Vec::new(),
            ids: Vec::new(),
            quiesce: Vec::new(),
            resume: Vec::new(),
            migration: None,
            location: VmLocation::Source,
            forced: Vec::new(),
            rollback_error: None,
            recovered_from: None,
            chosen: None,
            function: None,
            source_reset: None,
            agent_lost: None,
            unmanaged: Found::default(),
        }
    }

    fn report(mut self, result: RunResult) -> MoveReport {
        let failed_phase = result.as_ref().err().map(|(phase, _)| *phase);
        let error = result.err().map(|(_, e)| error_chain(&e));
        let final_phase = self.phase;
        if let Err(e) = self.journal.append(&Record::End { phase: final_phase }) {
            tracing::error!(move_id = %self.id, "{}", error_chain(&e));
        }
        MoveReport {
            id: self.id,
            plan: self.plan,
            ok: final_phase == Phase::Done,
            final_phase,
            failed_phase,
            error,
            rollback_error: self.rollback_error,
            vm_location: self.location,
            forced: self.forced,
            recovered_from: self.recovered_from,
            function: self.function.map(|(name, _)| name),
            chosen: self.chosen,
            timeline: self.recorder.finish(),
            connections: self.connections,
            quiesce: self.quiesce,
            resume: self.resume,
            migration: self.migration,
            unmanaged: self.unmanaged.finish(self.unplugging),
        }
    }

    /// The plan's policy for unmanaged programs (the daemon fills it in; a plan run
    /// without a daemon gets the default).
    fn unmanaged_policy(&self) -> UnmanagedPolicy {
        self.plan.unmanaged.unwrap_or_default()
    }

    /// Decides, after a restart, whether the move goes forward or back, and does it.
    async fn recover_from(&mut self, last: Phase) -> RunResult {
        let mut migrated = self.migrated;
        if !migrated && last >= Phase::Migrate {
            // The kill may have come after the migration completed and before the journal
            // said so: the source VMM knows.
            match self.source_vmm().await {
                Ok(source) => match source.status().await {
                    Ok(status) => {
                        migrated = matches!(status.phase, VmPhase::Migrated | VmPhase::NoVm)
                    }
                    Err(e) => self.warn(format!(
                        "cannot ask the source whether the migration completed: {}",
                        error_chain(&e)
                    )),
                },
                Err(e) => self.warn(format!(
                    "cannot reach the source after the restart: {}",
                    error_chain(&e)
                )),
            }
        }
        if migrated {
            self.migrated = true;
            self.location = VmLocation::Destination;
            self.warn(format!(
                "the migrator restarted during {last}; the migration had completed: finishing the move"
            ));
            let rest: Vec<Phase> = Phase::WORKING
                .into_iter()
                .filter(|p| *p >= last.max(Phase::Attach))
                .collect();
            // Re-enter the last phase (its step may not have happened).
            self.phase = rest[0];
            self.run(&rest).await
        } else {
            self.warn(format!(
                "the migrator restarted during {last}; the migration had not completed: rolling back"
            ));
            let cause = StepError::Interrupted { phase: last };
            self.fail_and_roll_back(last, MoveError::PhaseFailed { phase: last, cause })
                .await
        }
    }

    /// Runs `phases` in order; the first is entered without a transition when it is the
    /// phase the move already stands in (a fresh move, or a recovery re-entering a phase).
    async fn run(&mut self, phases: &[Phase]) -> RunResult {
        for &phase in phases {
            if phase != self.phase {
                self.phase = transition(self.phase, phase).map_err(|e| (self.phase, e.into()))?;
            }
            let deadline = self.plan.deadlines.of(phase);
            if let Err(e) = self.enter(phase) {
                let error = MoveError::PhaseFailed {
                    phase,
                    cause: e.into(),
                };
                return self.fail_and_roll_back(phase, error).await;
            }
            let started = self.recorder.begin(phase, millis(deadline));
            self.emit(MoveEvent::PhaseStarted {
                phase,
                unix_ms: started,
                at_ms: self.recorder.elapsed_ms(),
                deadline_ms: millis(deadline),
            });
            // A forced release waits for the unplug, the release, then the unplug again.
            let budget =
                if phase == Phase::Detach && self.unmanaged_policy() == UnmanagedPolicy::Release {
                    deadline * 3
                } else {
                    deadline
                };
            let body = self.body(phase, deadline);
            let result = match tokio::time::timeout(budget + GRACE, body).await {
                Ok(result) => result,
                Err(_) => Err(StepError::Stalled),
            };
            match result {
                Ok(finished) => self.end_phase(finished.outcome, finished.details),
                Err(cause) => {
                    let error = if cause.is_timeout() {
                        MoveError::DeadlineMissed {
                            phase,
                            deadline_ms: millis(deadline),
                            cause,
                        }
                    } else {
                        MoveError::PhaseFailed { phase, cause }
                    };
                    let outcome = PhaseOutcome::Failed {
                        error: error_chain(&error),
                    };
                    self.end_phase(outcome, Map::new());
                    return self.fail_and_roll_back(phase, error).await;
                }
            }
        }
        self.return_source_function();
        self.phase = transition(self.phase, Phase::Done).map_err(|e| (self.phase, e.into()))?;
        Ok(())
    }

    /// Journals `phase` durably, then lets the boundary hook see it.
    fn enter(&mut self, phase: Phase) -> Result<(), JournalError> {
        self.journal.append(&Record::Enter { phase })?;
        if phase <= Phase::Resume {
            self.reached = phase;
        }
        if let Some(hook) = &self.context.boundary {
            hook(phase);
        }
        Ok(())
    }

    /// Ends a move that failed in `failed`: rolls back when the phase allows it.
    async fn fail_and_roll_back(&mut self, failed: Phase, error: MoveError) -> RunResult {
        if !failed.can_roll_back() {
            // Past the point of no return the VM runs on the destination: the function it
            // left at the detach is free, whatever went wrong after.
            self.return_source_function();
            self.phase =
                transition(self.phase, Phase::Failed).map_err(|e| (self.phase, e.into()))?;
            return Err((failed, error));
        }
        self.phase = transition(self.phase, Phase::Rollback).map_err(|e| (self.phase, e.into()))?;
        let reason = error_chain(&error);
        if let Err(e) = self.journal.append(&Record::RollingBack { reason }) {
            self.warn(format!(
                "the rollback could not be journaled ({}); rolling back anyway",
                error_chain(&e)
            ));
        }
        match self.finish_rollback(failed).await {
            Ok(()) | Err(_) => Err((failed, error)),
        }
    }

    /// Runs the rollback phase; the move ends `rolled_back`, or `failed` if the rollback
    /// itself fails. `Ok` only in the sense that the state machine accepted the steps.
    async fn finish_rollback(&mut self, failed: Phase) -> RunResult {
        let deadline = self.plan.deadlines.of(Phase::Rollback);
        if let Some(hook) = &self.context.boundary {
            hook(Phase::Rollback);
        }
        let started = self.recorder.begin(Phase::Rollback, millis(deadline));
        self.emit(MoveEvent::PhaseStarted {
            phase: Phase::Rollback,
            unix_ms: started,
            at_ms: self.recorder.elapsed_ms(),
            deadline_ms: millis(deadline),
        });
        let mut steps = Vec::new();
        let result = self.undo(&mut steps, deadline).await;
        let mut details = Map::new();
        details.insert("failed_phase".into(), failed.name().into());
        details.insert(
            "steps".into(),
            Value::Array(steps.into_iter().map(Value::from).collect()),
        );
        match result {
            Ok(()) => {
                self.end_phase(PhaseOutcome::Ok, details);
                self.phase = transition(self.phase, Phase::RolledBack)
                    .map_err(|e| (self.phase, e.into()))?;
                Ok(())
            }
            Err(cause) => {
                let text = error_chain(&cause);
                self.end_phase(
                    PhaseOutcome::Failed {
                        error: text.clone(),
                    },
                    details,
                );
                self.rollback_error = Some(text);
                self.phase =
                    transition(self.phase, Phase::Failed).map_err(|e| (self.phase, e.into()))?;
                Ok(())
            }
        }
    }

    /// Puts the VM back on the source as it was before the move, step by step from how far
    /// the move got; every step first checks whether it is still needed (a restarted
    /// migrator may repeat it).
    ///
    /// Undoing the migration, and plugging and resuming on the source, each have `deadline`.
    /// Between them, waiting for an unplug the guest has not finished has a bound of its own
    /// (`deadline` again): a slow removal must not eat the time the resume needs.
    async fn undo(&mut self, steps: &mut Vec<String>, deadline: Duration) -> Result<(), StepError> {
        within(deadline, self.undo_migration(steps)).await?;
        if self.unplugging {
            self.await_pending_removal(steps, deadline).await?;
        }
        within(deadline, self.undo_on_source(steps, deadline)).await
    }

    /// Brings the VM back to the source VMM if the migration started: cancels it or, if it
    /// completed, discards the destination's copy and runs the source again.
    async fn undo_migration(&mut self, steps: &mut Vec<String>) -> Result<(), StepError> {
        if self.reached >= Phase::Migrate {
            let source = self.source_vmm().await?;
            if !self.migrated {
                let cancelled = match source.cancel_migration().await {
                    Ok(()) => true,
                    // Cloud Hypervisor cannot cancel: the migration ends by itself (failed, or
                    // its own timeout limit with the Cancel strategy), which the wait sees.
                    Err(e @ VmmError::Unsupported { .. }) => {
                        self.warn(format!("{e}: waiting for the migration to end"));
                        false
                    }
                    Err(e) => return Err(e.into()),
                };
                // Wait until the migration is over, not just asked to stop: a VMM refuses
                // hot-plug while a cancelled migration is still winding down. It may also
                // have completed before the cancel took.
                let mut ignore = |_: &MigrationProgress| {};
                match source
                    .wait_migration(self.plan.deadlines.of(Phase::Rollback), &mut ignore)
                    .await
                {
                    Ok(_) => self.migrated = true,
                    // Cancelled or failed: over. Protocol: none was running (a migrator
                    // killed before it started one).
                    Err(VmmError::MigrationFailed { .. } | VmmError::Protocol { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                let end = Instant::now() + self.plan.deadlines.of(Phase::Rollback);
                loop {
                    let status = source.status().await?;
                    match status.phase {
                        VmPhase::Migrated | VmPhase::NoVm => {
                            self.migrated = true;
                            break;
                        }
                        VmPhase::Running | VmPhase::Paused => break,
                        _ if Instant::now() >= end => {
                            return Err(StepError::VmState {
                                side: "source",
                                state: status.state,
                                expected: "still migrating after the cancel",
                            })
                        }
                        _ => tokio::time::sleep(CANCEL_POLL).await,
                    }
                }
                if !self.migrated {
                    steps.push(if cancelled {
                        "migration cancelled".into()
                    } else {
                        "migration over without completing (the VMM cannot cancel)".into()
                    });
                }
            }
            if self.migrated {
                let deadline = self.plan.deadlines.of(Phase::Rollback);
                self.destination()?
                    .discard(&self.plan.destination, deadline)
                    .await?;
                steps.push("destination VMM stopped (the migrated copy is discarded)".into());
                if !source.status().await?.running {
                    source.resume().await?;
                }
                steps.push("source VM running again".into());
                self.migrated = false;
            }
            self.location = VmLocation::Source;
        }
        Ok(())
    }

    /// Waits, up to `bound`, until the source no longer lists the detached device.
    ///
    /// A device_del cannot be taken back: a guest whose process held the device finishes
    /// the removal it was asked for once the process lets go, however late. Plugging
    /// nothing because the device is "still there" would leave the VM without its NIC then;
    /// so the rollback waits for the removal to end, and only then plugs the function again.
    async fn await_pending_removal(
        &mut self,
        steps: &mut Vec<String>,
        bound: Duration,
    ) -> Result<(), StepError> {
        let source = self.source_vmm().await?;
        let device = self.plan.detach.clone();
        let start = Instant::now();
        if !within(bound, source.has_device(&device)).await? {
            return Ok(());
        }
        self.warn(format!(
            "device {device} is still on the source, its unplug pending in the guest: waiting \
             up to {} ms for the guest to finish removing it before plugging it again",
            millis(bound)
        ));
        loop {
            tokio::time::sleep(REMOVAL_POLL).await;
            let left = bound.saturating_sub(start.elapsed());
            let gone = !left.is_zero() && !within(left, source.has_device(&device)).await?;
            if gone {
                steps.push(format!(
                    "waited {} ms for the guest to finish removing device {device}",
                    millis(start.elapsed())
                ));
                return Ok(());
            }
            if left.is_zero() {
                return Err(StepError::RemovalPending {
                    device,
                    waited_ms: millis(start.elapsed()),
                });
            }
        }
    }

    /// Plugs the device back on the source, resumes the connections there, and gives back
    /// the destination's function.
    async fn undo_on_source(
        &mut self,
        steps: &mut Vec<String>,
        deadline: Duration,
    ) -> Result<(), StepError> {
        let stage = Instant::now();
        let reached = self.reached;
        if reached >= Phase::Detach && self.strategy != Strategy::VfioMigrate {
            let source = self.source_vmm().await?;
            let spec = self.plan.reattach_spec().clone();
            if source.has_device(spec.id()).await? {
                steps.push(format!("device {} already back on the source", spec.id()));
            } else {
                source.add_device(&spec).await?;
                steps.push(format!("device {} re-attached on the source", spec.id()));
            }
        }
        if reached >= Phase::Quiesce && self.strategy != Strategy::Naive {
            // A fresh session: the old one may hold requests the agent never answered.
            self.agent = None;
            let source = self.source_vmm().await?;
            // A NIC plugged again must come up before anything reconnects: the resume gets
            // what is left of the rollback's deadline (but the time to give back a function).
            let reserve = if self.function.is_some() {
                RELEASE_RESERVE
            } else {
                Duration::ZERO
            };
            let budget = deadline
                .saturating_sub(stage.elapsed())
                .saturating_sub(reserve);
            let start = Instant::now();
            let (mut agent, _) =
                open_agent(self.context.backends.as_ref(), source.as_ref(), budget).await?;
            let result = agent
                .resume(&self.ids, budget.saturating_sub(start.elapsed()))
                .await?;
            self.resume = result.outcomes.clone();
            let failed: Vec<_> = result.failed().collect();
            if !failed.is_empty() {
                return Err(connections_lost(&failed, self.ids.len()));
            }
            steps.push(format!(
                "{} connections resumed on the source",
                result.outcomes.len()
            ));
        }
        if let Some((function, _)) = self.function.clone() {
            let destination = self.destination()?;
            let deadline = self.plan.deadlines.of(Phase::Rollback);
            destination
                .release(&function, &self.move_ref(), deadline)
                .await?;
            steps.push(format!(
                "function {function} released to the destination's pool ({})",
                destination.describe()
            ));
        }
        Ok(())
    }

    fn body(
        &mut self,
        phase: Phase,
        deadline: Duration,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Finished, StepError>> + Send + '_>> {
        match phase {
            Phase::Prepare => Box::pin(self.prepare(deadline)),
            Phase::Quiesce => Box::pin(self.quiesce_phase(deadline)),
            Phase::Detach => Box::pin(self.detach(deadline)),
            Phase::Migrate => Box::pin(self.migrate(deadline)),
            Phase::Attach => Box::pin(self.attach(deadline)),
            Phase::Resume => Box::pin(self.resume_phase(deadline)),
            Phase::Rollback | Phase::Done | Phase::RolledBack | Phase::Failed => {
                Box::pin(async { Ok(Finished::ok(Map::new())) })
            }
        }
    }

    fn emit(&self, event: MoveEvent) {
        // A client that went away does not stop the move.
        let _ = self.events.send(event);
    }

    fn warn(&self, message: String) {
        tracing::warn!(vm = %self.plan.vm, move_id = %self.id, "{message}");
        self.emit(MoveEvent::Warning {
            at_ms: self.recorder.elapsed_ms(),
            message,
        });
    }

    fn force(&mut self, phase: Phase, reason: String) {
        self.warn(format!("{phase}: forced: {reason}"));
        self.forced.push(ForcedPath { phase, reason });
    }

    fn end_phase(&mut self, outcome: PhaseOutcome, details: Map<String, Value>) {
        if let Some(record) = self.recorder.end(outcome, details).cloned() {
            self.emit(MoveEvent::PhaseEnded {
                at_ms: self.recorder.elapsed_ms(),
                record,
            });
        }
    }

    /// The source VMM, connected on first use (a recovering migrator connects afresh).
    async fn source_vmm(&mut self) -> Result<Arc<dyn Vmm>, VmmError> {
        if let Some(vmm) = &self.source {
            return Ok(vmm.clone());
        }
        let vmm = self.context.backends.connect(&self.plan.source).await?;
        self.source = Some(vmm.clone());
        Ok(vmm)
    }

    /// The destination end, resolved on first use.
    fn destination(&mut self) -> Result<Arc<dyn DestinationHost>, PeerError> {
        if let Some(destination) = &self.destination {
            return Ok(destination.clone());
        }
        let destination = self.context.destination(&self.plan)?;
        self.destination = Some(destination.clone());
        Ok(destination)
    }

    fn move_ref(&self) -> MoveRef {
        MoveRef {
            move_id: self.id.clone(),
            vm: self.plan.vm.clone(),
        }
    }

    async fn prepare(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        let start = Instant::now();
        let mut details = Map::new();
        // Decided before anything acts: a refused strategy changes nothing.
        let choice = choose_for(&self.plan, &self.context.pool)?;
        self.journal.append(&Record::Chose {
            choice: choice.clone(),
        })?;
        details.insert("strategy".into(), choice.strategy.to_string().into());
        if self.plan.strategy != choice.strategy {
            details.insert("strategy_reason".into(), choice.reason.clone().into());
        }
        self.strategy = choice.strategy;
        self.chosen = Some(choice);
        let source = self.source_vmm().await?;
        let status = source.status().await?;
        if !matches!(status.phase, VmPhase::Running | VmPhase::Paused) {
            return Err(StepError::VmState {
                side: "source",
                state: status.state,
                expected: "not a VM that can migrate (neither running nor paused)",
            });
        }
        details.insert("source_state".into(), status.state.into());
        let destination = self.destination()?;
        details.insert("destination".into(), destination.describe().into());
        // vfio-migrate plugs nothing: the destination VMM was started with its function.
        if self.plan.from_pool && self.strategy != Strategy::VfioMigrate {
            let (function, attachment) = destination
                .reserve(&self.move_ref(), deadline.saturating_sub(start.elapsed()))
                .await?;
            self.journal.append(&Record::Reserved {
                function: function.clone(),
                attachment: attachment.clone(),
            })?;
            details.insert("function".into(), function.clone().into());
            self.function = Some((function, attachment));
        }
        // The guest before the destination VMM is readied, which cannot be taken back: a
        // refusal (unmanaged programs) leaves it as it was (a reservation is released).
        if self.strategy != Strategy::Naive {
            let (mut agent, version) = open_agent(
                self.context.backends.as_ref(),
                source.as_ref(),
                deadline.saturating_sub(start.elapsed()),
            )
            .await?;
            let connections = agent
                .list_connections(deadline.saturating_sub(start.elapsed()))
                .await?;
            details.insert("agent_version".into(), version.into());
            details.insert("connections".into(), connections.len().into());
            self.ids = connections.iter().map(|c| c.id).collect();
            self.journal.append(&Record::Listed {
                connections: self.ids.clone(),
            })?;
            self.connections = connections;
            let programs = agent
                .list_unmanaged(deadline.saturating_sub(start.elapsed()))
                .await;
            self.agent = Some(agent);
            let programs = programs?;
            details.insert("unmanaged".into(), programs.len().into());
            self.unmanaged.add(programs);
            if !self.unmanaged.is_empty() {
                self.warn(format!(
                    "unmanaged programs (policy {}): {}",
                    self.unmanaged_policy(),
                    self.unmanaged.named()
                ));
                if self.unmanaged_policy() == UnmanagedPolicy::Refuse {
                    return Err(self.refusal(""));
                }
            }
        }
        destination
            .prepare_receive(
                &self.plan.destination,
                &self.plan.via,
                deadline.saturating_sub(start.elapsed()),
            )
            .await?;
        details.insert("via".into(), self.plan.via.clone().into());
        Ok(Finished::ok(details))
    }

    async fn quiesce_phase(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if self.strategy == Strategy::Naive {
            return Ok(Finished::skipped(
                "strategy naive: connections are not quiesced",
            ));
        }
        let ids = self.ids.clone();
        let bridge = self.strategy == Strategy::Bridge;
        let result = match self.agent.as_mut() {
            Some(agent) => agent.quiesce(&ids, deadline, bridge).await,
            None => {
                let source = self.source_vmm().await?;
                let mut agent = self.context.backends.agent(source.as_ref()).await?;
                let result = agent.quiesce(&ids, deadline, bridge).await;
                self.agent = Some(agent);
                result
            }
        };
        let result = match result {
            Ok(result) => result,
            Err(e) => {
                // The agent is silent or broken: the move goes on, and every connection
                // recovers through the library's own path (device gone, wait for the peer,
                // replay).
                let reason = format!(
                    "the agent did not quiesce ({}); detaching without a coordinated quiesce",
                    error_chain(&e)
                );
                self.agent = None;
                self.agent_lost = Some(error_chain(&e));
                self.force(Phase::Quiesce, reason.clone());
                return Ok(Finished {
                    outcome: PhaseOutcome::Forced { reason },
                    details: Map::new(),
                });
            }
        };
        let details = self.record_outcomes(&result, "quiesced");
        let failed: Vec<String> = result
            .failed()
            .map(|f| {
                format!(
                    "{:016x}: {}",
                    f.id,
                    f.error.as_deref().unwrap_or("no reason given")
                )
            })
            .collect();
        self.quiesce = result.outcomes;
        if failed.is_empty() {
            return Ok(Finished::ok(details));
        }
        let reason = format!(
            "{} connections did not quiesce ({}); detaching anyway",
            failed.len(),
            failed.join("; ")
        );
        self.force(Phase::Quiesce, reason.clone());
        Ok(Finished {
            outcome: PhaseOutcome::Forced { reason },
            details,
        })
    }

    async fn detach(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if self.strategy == Strategy::VfioMigrate {
            return Ok(Finished::skipped(
                "strategy vfio-migrate: the function stays plugged; the VMM moves its state",
            ));
        }
        let source = self.source_vmm().await?;
        let mut details = Map::new();
        let mut outcome = PhaseOutcome::Ok;
        self.settle_unmanaged(deadline, &mut details).await?;
        self.journal.append(&Record::Unplugging)?;
        self.unplugging = true;
        match source.remove_device(&self.plan.detach, deadline).await {
            Ok(()) => {}
            Err(e) if e.is_timeout() && self.unmanaged_policy() == UnmanagedPolicy::Release => {
                let (holders, reason) = self.force_release(deadline).await?;
                outcome = PhaseOutcome::Forced { reason };
                details.insert(
                    "forced_release".into(),
                    serde_json::to_value(&holders).unwrap_or_default(),
                );
                // The unplug is still pending in the VMM: wait for it again.
                source.remove_device(&self.plan.detach, deadline).await?;
            }
            Err(e) if e.is_timeout() => {
                self.force(
                    Phase::Detach,
                    format!(
                        "the guest did not release {} within {} ms (an application holds its \
                         device context): rolling back",
                        self.plan.detach,
                        millis(deadline)
                    ),
                );
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        }
        details.insert("device".into(), self.plan.detach.clone().into());
        if let Some(name) = self.plan.source_function.clone() {
            let result = self.reset_source_function(&name);
            let text = match &result {
                Ok(done) => done.clone(),
                Err(e) => format!("FAILED: {e}"),
            };
            details.insert("reset".into(), text.into());
            self.source_reset = Some(result);
        }
        Ok(Finished { outcome, details })
    }

    /// Right before the unplug, the unmanaged programs again (the quiesce may have taken a
    /// while): under `release` they are ended now; under `refuse` one that started since
    /// prepare fails the phase, which rolls back with the device still plugged. Without an
    /// agent (a forced quiesce) there is no one to ask, and the unplug goes on.
    async fn settle_unmanaged(
        &mut self,
        deadline: Duration,
        details: &mut Map<String, Value>,
    ) -> Result<(), StepError> {
        let policy = self.unmanaged_policy();
        if self.strategy == Strategy::Naive {
            return Ok(());
        }
        let Some(agent) = self.agent.as_mut() else {
            return Ok(());
        };
        let programs = match agent.list_unmanaged(deadline).await {
            Ok(programs) => programs,
            Err(e) => {
                self.warn(format!(
                    "the agent could not list unmanaged programs before the unplug ({}); \
                     unplugging",
                    error_chain(&e)
                ));
                return Ok(());
            }
        };
        if programs.is_empty() {
            return Ok(());
        }
        let new = self.unmanaged.add(programs);
        match policy {
            // Prepare refused any found then: these all started since.
            UnmanagedPolicy::Refuse => Err(self.refusal(" (started since prepare)")),
            UnmanagedPolicy::Release => {
                let holders = agent
                    .release_device(ReleaseScope::Unmanaged, RELEASE_GRACE, deadline)
                    .await?;
                self.unmanaged.released(&holders);
                details.insert(
                    "ended".into(),
                    serde_json::to_value(&holders).unwrap_or_default(),
                );
                Ok(())
            }
            UnmanagedPolicy::Ignore => {
                if new > 0 {
                    self.warn(format!(
                        "unmanaged programs started since prepare (policy ignore): {}",
                        self.unmanaged.named()
                    ));
                }
                Ok(())
            }
        }
    }

    fn refusal(&self, since: &'static str) -> StepError {
        StepError::UnmanagedPrograms {
            count: self.unmanaged.len(),
            since,
            named: self.unmanaged.named(),
        }
    }

    /// The forced release (`--unmanaged release`), after the unplug missed its deadline: the
    /// agent makes every process that holds the RDMA device let go, and the forced path is
    /// recorded with each holder's PID, name and what was done to it.
    async fn force_release(
        &mut self,
        deadline: Duration,
    ) -> Result<(Vec<DeviceHolder>, String), StepError> {
        let mut agent = match self.agent.take() {
            Some(agent) => agent,
            None => {
                let source = self.source_vmm().await?;
                self.context.backends.agent(source.as_ref()).await?
            }
        };
        let holders = agent
            .release_device(ReleaseScope::AllHolders, RELEASE_GRACE, deadline)
            .await;
        self.agent = Some(agent);
        let holders = holders?;
        let named = if holders.is_empty() {
            "the agent found no process holding an RDMA device".to_string()
        } else {
            holders
                .iter()
                .map(|h| {
                    format!(
                        "PID {} ({}): {}{}",
                        h.pid,
                        h.program,
                        h.action,
                        if h.released { "" } else { ", still holding it" }
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        let reason = format!(
            "the guest did not release {} within {} ms (a process holds its device context): \
             forced release (--unmanaged release): {named}",
            self.plan.detach,
            millis(deadline)
        );
        self.force(Phase::Detach, reason.clone());
        Ok((holders, reason))
    }

    /// Resets the source's detached function, so that it stops processing whatever was
    /// still posted to it, before it may go back to the pool.
    fn reset_source_function(&self, name: &str) -> Result<String, String> {
        match self.context.pool.attachment(name) {
            Some(attachment) => crate::pool::reset(&attachment),
            None => Err(format!("no function {name} in this host's pool")),
        }
    }

    /// Once the move is done, gives the source's function back to the pool, or quarantines
    /// it when its reset failed. Neither undoes the move: problems are warnings.
    fn return_source_function(&mut self) {
        let Some(name) = self.plan.source_function.clone() else {
            return;
        };
        if self.strategy == Strategy::VfioMigrate {
            // Never detached: it stays with the source VMM until that exits.
            return;
        }
        let result = match self.source_reset.take() {
            Some(result) => result,
            None => self.reset_source_function(&name),
        };
        let pool = self.context.pool.clone();
        let outcome = match &result {
            Ok(_) => pool.release(&name, &self.id, &self.plan.vm),
            Err(reason) => {
                self.warn(format!(
                    "function {name} is quarantined: its reset failed: {reason}"
                ));
                pool.quarantine(&name, reason)
            }
        };
        if let Err(e) = outcome {
            self.warn(format!(
                "function {name} could not be returned to the pool: {}",
                error_chain(&e)
            ));
        }
    }

    async fn migrate(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        let start = Instant::now();
        let source = self.source_vmm().await?;
        source
            .send_migration(&self.plan.via, &self.plan.limits)
            .await?;
        let events = self.events.clone();
        let recorder_start = self.recorder.started_at();
        let mut last: Option<(Instant, MigrationStatus)> = None;
        let mut report = |progress: &MigrationProgress| {
            let due = match &last {
                None => true,
                Some((at, status)) => {
                    *status != progress.status || at.elapsed() >= PROGRESS_INTERVAL
                }
            };
            if due || progress.status.is_final() {
                last = Some((Instant::now(), progress.status.clone()));
                let _ = events.send(MoveEvent::Migration {
                    at_ms: millis(recorder_start.elapsed()),
                    progress: progress.clone(),
                });
            }
        };
        let done = match source
            .wait_migration(deadline.saturating_sub(start.elapsed()), &mut report)
            .await
        {
            Ok(done) => done,
            Err(e) => {
                if e.is_timeout() {
                    self.force(
                        Phase::Migrate,
                        format!(
                            "the migration did not complete within {} ms: cancelling it and \
                             rolling back",
                            millis(deadline)
                        ),
                    );
                }
                return Err(e.into());
            }
        };
        // The source let go of the VM: from here a rollback stops the destination and
        // resumes the source, whether or not the destination confirms.
        self.migrated = true;
        self.location = VmLocation::Destination;
        let confirm = Instant::now();
        let started = self
            .destination()?
            .confirm_received(
                &self.plan.destination,
                deadline.saturating_sub(start.elapsed()),
            )
            .await?;
        self.journal.append(&Record::Migrated)?;
        let mut details = Map::new();
        details.insert("confirm_ms".into(), millis(confirm.elapsed()).into());
        // From the source's stop to the destination's start: the VMM's downtime ends with
        // the send, before the destination runs the guest.
        if let Some(paused) = vm_paused(done.vm_stopped_at, started) {
            details.insert("vm_paused_ms".into(), millis(paused).into());
        }
        for (key, value) in [
            ("vmm_total_ms", done.total_time_ms),
            ("downtime_ms", done.downtime_ms),
            ("setup_ms", done.setup_time_ms),
            ("ram_transferred", done.ram_transferred),
        ] {
            if let Some(value) = value {
                details.insert(key.into(), value.into());
            }
        }
        self.migration = Some(done);
        Ok(Finished::ok(details))
    }

    async fn attach(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if self.strategy == Strategy::VfioMigrate {
            return Ok(Finished::skipped(
                "strategy vfio-migrate: the function arrived with the VM's device state",
            ));
        }
        let destination = self.destination()?;
        let function = self.function.as_ref().map(|(name, _)| name.as_str());
        let plugged = destination
            .attach(
                &self.plan.destination,
                &self.move_ref(),
                function,
                &self.plan.attach,
                self.recovered_from.is_some(),
                deadline,
            )
            .await?;
        let mut details = Map::new();
        if plugged.already {
            details.insert("already_attached".into(), true.into());
        }
        if let Some(function) = function {
            details.insert("function".into(), function.into());
        }
        details.insert("device".into(), plugged.id.into());
        details.insert("driver".into(), plugged.driver.into());
        Ok(Finished::ok(details))
    }

    async fn resume_phase(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if self.strategy == Strategy::Naive {
            return Ok(Finished::skipped(
                "strategy naive: connections are not resumed",
            ));
        }
        // The guest now runs under the destination VMM; the source's channel is dead.
        self.agent = None;
        let ids = self.ids.clone();
        let resumed = self
            .destination()?
            .resume(&self.plan.destination, &ids, deadline)
            .await;
        let result = match resumed {
            Ok(result) => result,
            Err(e) => match (&e, &self.agent_lost) {
                // The move already went on without the agent: every connection is
                // recovering on its own, as the quiesce's forced path said.
                (StepError::Agent(_), Some(lost)) => {
                    let reason = format!(
                        "the agent did not resume either ({}; at the quiesce: {lost}): the \
                         connections recover through the library's own path (each reconnects \
                         by itself once its hold expires)",
                        error_chain(&e)
                    );
                    self.force(Phase::Resume, reason.clone());
                    return Ok(Finished {
                        outcome: PhaseOutcome::Forced { reason },
                        details: Map::new(),
                    });
                }
                _ => return Err(e),
            },
        };
        let details = self.record_outcomes(&result, "resumed");
        let failed: Vec<_> = result.failed().collect();
        let lost = (!failed.is_empty()).then(|| connections_lost(&failed, ids.len()));
        self.resume = result.outcomes;
        match lost {
            Some(error) => Err(error),
            None => Ok(Finished::ok(details)),
        }
    }

    /// Details of a quiesce or resume, warning about listed connections the agent skipped.
    fn record_outcomes(&self, result: &Outcomes, verb: &str) -> Map<String, Value> {
        let answered: HashMap<ConnectionId, bool> =
            result.outcomes.iter().map(|o| (o.id, o.ok)).collect();
        for id in &self.ids {
            if !answered.contains_key(id) {
                self.warn(format!("the agent did not report connection {id:016x}"));
            }
        }
        let mut details = Map::new();
        details.insert(
            verb.into(),
            answered.values().filter(|ok| **ok).count().into(),
        );
        details.insert(
            "failed".into(),
            answered.values().filter(|ok| !**ok).count().into(),
        );
        details.insert("agent_ms".into(), result.elapsed_ms.into());
        details
    }
}

fn connections_lost(failed: &[&ConnectionOutcome], total: usize) -> StepError {
    StepError::ConnectionsLost {
        failed: failed.len(),
        total,
        details: failed
            .iter()
            .map(|o| {
                format!(
                    "{:016x}: {}",
                    o.id,
                    o.error.as_deref().unwrap_or("no reason given")
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// How long to wait before opening the agent's channel again after the guest closed it.
const REOPEN_PAUSE: Duration = Duration::from_millis(100);

/// Opens a session with `vmm`'s agent and pings it until it answers or `budget` is spent;
/// returns the session and the agent's version. A guest may not be reading its port at the
/// very moment the host connects (the ping times out: asked again), and right after a
/// migration it may drop the host's first connection (the channel closes: opened again).
pub(crate) async fn open_agent(
    backends: &dyn Backends,
    vmm: &dyn Vmm,
    budget: Duration,
) -> Result<(Box<dyn GuestAgent>, String), StepError> {
    let end = Instant::now() + budget;
    loop {
        let mut agent = backends.agent(vmm).await?;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match agent.ping(PING_ATTEMPT.min(left)).await {
                Ok(version) => return Ok((agent, version)),
                Err(e) if e.is_timeout() && Instant::now() < end => {
                    tracing::debug!("agent ping timed out; retrying");
                }
                Err(e) if e.is_timeout() => {
                    return Err(AgentError::TimedOut {
                        request: "ping",
                        deadline_ms: millis(budget),
                    }
                    .into())
                }
                Err(AgentError::Closed { .. }) if Instant::now() + REOPEN_PAUSE < end => {
                    tracing::debug!("the guest closed the agent channel; opening it again");
                    tokio::time::sleep(REOPEN_PAUSE).await;
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Runs `step` under `deadline`; a step still running then is [`StepError::Stalled`].
async fn within<T, E: Into<StepError>>(
    deadline: Duration,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, StepError> {
    match tokio::time::timeout(deadline, step).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(StepError::Stalled),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fakes::{FakeBackends, FakeHost, Fault, Where, FAKE_PAUSE};
    use crate::journal;
    use crate::plan::tests::plan;
    use crate::pool::FunctionState;
    use rdmamig_proto::agent::UnmanagedProgram;

    struct Bed {
        host: FakeHost,
        dir: tempfile::TempDir,
        pool: Arc<Pool>,
    }

    impl Bed {
        /// A fake host whose pool has `functions` emulated functions `tap0`...
        fn with_pool(functions: usize) -> Bed {
            let dir = tempfile::tempdir().unwrap();
            let mut text = String::new();
            for i in 0..functions {
                text.push_str(&format!(
                    "[[pool.function]]\nname = \"tap{i}\"\ndevice = \"driver=e1000e,netdev=nd{i}\"\n"
                ));
            }
            let config: crate::config::Config = toml::from_str(&text).unwrap();
            let pool = Pool::open(&config.pool, &dir.path().join("pool.json")).unwrap();
            Bed {
                host: FakeHost::new(),
                dir,
                pool: Arc::new(pool),
            }
        }

        fn new() -> Bed {
            Bed::with_pool(0)
        }

        fn pooled() -> MovePlan {
            let mut plan = plan();
            plan.from_pool = true;
            plan
        }

        fn context(&self, boundary: Option<BoundaryHook>) -> MoveContext {
            MoveContext {
                backends: Arc::new(FakeBackends(self.host.clone())),
                pool: self.pool.clone(),
                peers: None,
                boundary,
            }
        }

        async fn run(&self, plan: MovePlan) -> MoveReport {
            let journal = Journal::create(self.dir.path(), "m", &plan).unwrap();
            let (events, _received) = tokio::sync::mpsc::unbounded_channel();
            run_move("m".into(), plan, journal, self.context(None), events).await
        }

        fn journal_path(&self) -> std::path::PathBuf {
            self.dir.path().join("m.journal")
        }

        fn calls(&self) -> Vec<String> {
            self.host.state().calls.clone()
        }
    }

    /// The VM is back on the source with a device, running, connections resumed there.
    fn assert_back_on_source(bed: &Bed, report: &MoveReport, resumed: bool) {
        assert_eq!(report.final_phase, Phase::RolledBack, "{report:#?}");
        assert!(!report.ok);
        assert_eq!(report.vm_location, VmLocation::Source);
        assert!(report.error.is_some());
        let state = bed.host.state();
        assert_eq!(state.guest, Where::Source);
        assert_eq!(state.source_state, "running");
        assert!(!state.migrating);
        assert!(
            !state.source_devices.is_empty(),
            "{:?}",
            state.source_devices
        );
        assert_eq!(state.resumed_on.last() == Some(&Where::Source), resumed);
        assert!(!state.quiesced);
        let rollback = report.timeline.phases.last().unwrap();
        assert_eq!(rollback.phase, Phase::Rollback);
        assert_eq!(rollback.outcome, PhaseOutcome::Ok);
        let replay = journal::read(&bed.journal_path()).unwrap();
        assert_eq!(replay.ended(), Some(Phase::RolledBack));
        assert!(replay.rolling_back().is_some());
    }

    #[tokio::test]
    async fn a_move_runs_every_phase_and_journals_each_before_it_acts() {
        let bed = Bed::new();
        let report = bed.run(plan()).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.final_phase, Phase::Done);
        assert_eq!(report.vm_location, VmLocation::Destination);
        assert!(report.forced.is_empty());
        let phases: Vec<Phase> = report.timeline.phases.iter().map(|p| p.phase).collect();
        assert_eq!(phases, Phase::WORKING);
        let migrate = &report.timeline.phases[3].details;
        assert_eq!(migrate["vm_paused_ms"], millis(FAKE_PAUSE));
        assert_eq!(migrate["downtime_ms"], 20);
        let state = bed.host.state();
        assert_eq!(state.destination_devices, ["nic1".to_string()].into());
        assert_eq!(state.resumed_on, vec![Where::Destination]);
        let replay = journal::read(&bed.journal_path()).unwrap();
        let entered: Vec<Phase> = replay
            .records
            .iter()
            .filter_map(|r| match r {
                Record::Enter { phase } => Some(*phase),
                _ => None,
            })
            .collect();
        assert_eq!(entered, Phase::WORKING);
        assert_eq!(replay.connections(), vec![11, 12]);
        assert!(replay.migrated());
        assert_eq!(replay.ended(), Some(Phase::Done));
    }

    #[tokio::test]
    async fn prepare_failure_rolls_back_with_nothing_to_undo() {
        let bed = Bed::new();
        bed.host.state().destination_state = "running".into();
        let report = bed.run(plan()).await;
        assert_back_on_source(&bed, &report, false);
        assert_eq!(report.failed_phase, Some(Phase::Prepare));
        assert!(report.error.as_deref().unwrap().contains("-incoming defer"));
        assert!(!bed.calls().iter().any(|c| c.starts_with("agent.quiesce")));
        assert!(bed.host.state().source_devices.contains("nic0"));
    }

    #[tokio::test]
    async fn a_silent_agent_at_prepare_rolls_back() {
        let bed = Bed::new();
        bed.host.fail("agent.ping", Fault::Timeout);
        let mut plan = plan();
        plan.deadlines.set("prepare=300").unwrap();
        let report = bed.run(plan).await;
        assert_back_on_source(&bed, &report, false);
        assert_eq!(report.failed_phase, Some(Phase::Prepare));
    }

    #[tokio::test]
    async fn a_silent_agent_at_quiesce_takes_the_forced_path_and_the_move_goes_on() {
        let bed = Bed::new();
        bed.host.fail("agent.quiesce", Fault::Timeout);
        let report = bed.run(plan()).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.forced.len(), 1);
        assert_eq!(report.forced[0].phase, Phase::Quiesce);
        assert!(report.forced[0].reason.contains("did not answer quiesce"));
        assert!(matches!(
            report.timeline.phases[1].outcome,
            PhaseOutcome::Forced { .. }
        ));
    }

    #[tokio::test]
    async fn an_agent_lost_at_quiesce_and_silent_at_resume_forces_both_and_the_move_is_done() {
        let bed = Bed::new();
        bed.host.fail("agent.quiesce", Fault::Timeout);
        bed.host.fail("agent.resume", Fault::Timeout);
        let report = bed.run(plan()).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.vm_location, VmLocation::Destination);
        let forced: Vec<Phase> = report.forced.iter().map(|f| f.phase).collect();
        assert_eq!(forced, [Phase::Quiesce, Phase::Resume]);
        assert!(report.forced[1].reason.contains("library's own path"));
        assert!(matches!(
            report.timeline.phases[5].outcome,
            PhaseOutcome::Forced { .. }
        ));
    }

    #[tokio::test]
    async fn a_peer_that_does_not_ack_the_pause_is_forced_and_recorded() {
        let bed = Bed::new();
        bed.host.fail("agent.quiesce", Fault::PeerNoAck);
        let report = bed.run(plan()).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.forced.len(), 1);
        assert!(report.forced[0]
            .reason
            .contains("did not acknowledge the PAUSE"));
        assert_eq!(report.quiesce.iter().filter(|o| !o.ok).count(), 1);
    }

    #[tokio::test]
    async fn a_held_device_context_rolls_back_after_the_pending_unplug_completes() {
        let bed = Bed::new();
        bed.host.fail("src.remove_device", Fault::Timeout);
        // The holder lets go a few checks into the rollback: the guest then finishes the
        // unplug it was asked for, and the VM would have no NIC if nothing were plugged.
        bed.host.state().holder_lets_go_after = Some(3);
        let report = bed.run(plan()).await;
        assert_back_on_source(&bed, &report, true);
        assert_eq!(report.failed_phase, Some(Phase::Detach));
        assert_eq!(report.forced[0].phase, Phase::Detach);
        let state = bed.host.state();
        assert_eq!(state.unplug_pending, None);
        assert!(state.source_devices.contains(plan().reattach_spec().id()));
        let calls = &state.calls;
        let added = calls.iter().position(|c| c == "src.add_device").unwrap();
        let resumed = calls.iter().rposition(|c| c == "agent.resume").unwrap();
        assert!(added < resumed, "{calls:?}");
        let steps = &report.timeline.phases.last().unwrap().details["steps"];
        let steps: Vec<&str> = steps
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s.as_str())
            .collect();
        assert!(
            steps[0].starts_with("waited ") && steps[0].contains("removing device nic0"),
            "{steps:?}"
        );
        assert!(steps[1].contains("re-attached on the source"), "{steps:?}");
    }

    #[tokio::test]
    async fn a_device_the_guest_never_lets_go_fails_the_rollback_and_says_so() {
        let bed = Bed::new();
        bed.host.fail("src.remove_device", Fault::Timeout);
        let mut plan = plan();
        plan.deadlines.set("rollback=300").unwrap();
        let report = bed.run(plan).await;
        assert_eq!(report.final_phase, Phase::Failed, "{report:#?}");
        let error = report.rollback_error.as_deref().unwrap();
        assert!(
            error.contains("has not finished removing device nic0 after")
                && error.contains("then has none"),
            "{error}"
        );
        // Nothing was plugged beside the device whose removal is pending.
        assert!(!bed.calls().contains(&"src.add_device".to_string()));
    }

    #[tokio::test]
    async fn a_held_device_context_is_released_by_force_when_the_move_allows_it() {
        let bed = Bed::new();
        bed.host.fail("src.remove_device", Fault::Timeout);
        let mut plan = plan();
        plan.unmanaged = Some(UnmanagedPolicy::Release);
        let report = bed.run(plan).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.forced.len(), 1);
        assert_eq!(report.forced[0].phase, Phase::Detach);
        let reason = &report.forced[0].reason;
        assert!(
            reason.contains(
                "forced release (--unmanaged release): PID 4242 (ibv_rc_pingpong): SIGTERM"
            ),
            "{reason}"
        );
        let detach = &report.timeline.phases[2];
        assert!(matches!(detach.outcome, PhaseOutcome::Forced { .. }));
        assert_eq!(detach.details["forced_release"][0]["pid"], 4242);
        let calls = bed.calls();
        let unplugs = calls.iter().filter(|c| *c == "src.remove_device").count();
        assert_eq!(unplugs, 2, "{calls:?}");
        assert!(calls.contains(&"agent.release_device".to_string()));
    }

    #[tokio::test]
    async fn a_failed_forced_release_rolls_back() {
        let bed = Bed::new();
        bed.host.fail("src.remove_device", Fault::Timeout);
        bed.host.fail("agent.release_device", Fault::Timeout);
        let mut plan = plan();
        plan.unmanaged = Some(UnmanagedPolicy::Release);
        // The holder ends on its own a little later; the rollback waits for the removal.
        bed.host.state().holder_lets_go_after = Some(2);
        let report = bed.run(plan).await;
        assert_back_on_source(&bed, &report, true);
        assert_eq!(report.failed_phase, Some(Phase::Detach));
    }

    fn rping(pid: u32) -> UnmanagedProgram {
        UnmanagedProgram {
            pid,
            command: "rping -c -a 10.77.0.3".into(),
            devices: vec!["rdma_cm".into()],
            open_context: false,
        }
    }

    #[tokio::test]
    async fn unmanaged_programs_refuse_the_move_at_prepare_by_default() {
        let bed = Bed::new();
        bed.host.state().unmanaged = vec![rping(31)];
        let report = bed.run(plan()).await;
        assert_eq!(report.final_phase, Phase::RolledBack, "{report:#?}");
        assert_eq!(report.failed_phase, Some(Phase::Prepare));
        let error = report.error.as_deref().unwrap();
        assert!(
            error.contains("PID 31 (rping -c -a 10.77.0.3) on rdma_cm")
                && error.contains("--unmanaged release"),
            "{error}"
        );
        assert_eq!(report.unmanaged.len(), 1);
        assert_eq!(report.unmanaged[0].fate, Fate::Untouched);
        assert_eq!(report.casualties().count(), 0);
        let calls = bed.calls();
        // Nothing changed: no quiesce, no unplug, and the destination was not readied.
        for call in [
            "agent.quiesce",
            "src.remove_device",
            "agent.release_device",
            "dst.prepare_incoming",
        ] {
            assert!(!calls.contains(&call.to_string()), "{call}: {calls:?}");
        }
    }

    #[tokio::test]
    async fn release_ends_unmanaged_programs_before_the_unplug() {
        let bed = Bed::new();
        bed.host.state().unmanaged = vec![rping(31)];
        let mut plan = plan();
        plan.unmanaged = Some(UnmanagedPolicy::Release);
        let report = bed.run(plan).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.unmanaged[0].fate, Fate::Ended);
        assert_eq!(report.unmanaged[0].action.as_deref(), Some("SIGTERM"));
        assert!(report.forced.is_empty(), "{:?}", report.forced);
        let calls = bed.calls();
        let release = calls.iter().position(|c| c == "agent.release_device");
        let unplug = calls.iter().position(|c| c == "src.remove_device");
        assert!(release.unwrap() < unplug.unwrap(), "{calls:?}");
        let detach = &report.timeline.phases[2];
        assert_eq!(detach.details["ended"][0]["pid"], 31);
    }

    #[tokio::test]
    async fn ignore_moves_and_marks_unmanaged_programs_broken() {
        let bed = Bed::new();
        bed.host.state().unmanaged = vec![rping(31)];
        let mut plan = plan();
        plan.unmanaged = Some(UnmanagedPolicy::Ignore);
        let report = bed.run(plan).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.unmanaged[0].fate, Fate::Broken);
        assert_eq!(report.casualties().count(), 1);
        assert!(!bed.calls().contains(&"agent.release_device".to_string()));
    }

    #[tokio::test]
    async fn a_program_started_after_prepare_rolls_back_before_the_unplug() {
        let bed = Bed::new();
        let host = bed.host.clone();
        let boundary: BoundaryHook = Arc::new(move |phase| {
            if phase == Phase::Quiesce {
                host.state().unmanaged = vec![rping(32)];
            }
        });
        let plan = plan();
        let journal = Journal::create(bed.dir.path(), "m", &plan).unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let report = run_move(
            "m".into(),
            plan,
            journal,
            bed.context(Some(boundary)),
            events,
        )
        .await;
        assert_back_on_source(&bed, &report, true);
        assert_eq!(report.failed_phase, Some(Phase::Detach));
        let error = report.error.as_deref().unwrap();
        assert!(
            error.contains("started since prepare") && error.contains("PID 32"),
            "{error}"
        );
        assert!(!bed.calls().contains(&"src.remove_device".to_string()));
        assert_eq!(report.unmanaged[0].fate, Fate::Untouched);
    }

    #[tokio::test]
    async fn a_stalled_migration_is_cancelled_and_rolled_back() {
        let bed = Bed::new();
        bed.host.fail("src.wait_migration", Fault::Timeout);
        let report = bed.run(plan()).await;
        assert_back_on_source(&bed, &report, true);
        assert_eq!(report.failed_phase, Some(Phase::Migrate));
        assert_eq!(report.forced[0].phase, Phase::Migrate);
        let calls = bed.calls();
        assert!(calls.contains(&"src.cancel_migration".to_string()));
        assert!(calls.contains(&"src.add_device".to_string()));
        assert_eq!(bed.host.state().source_devices, ["nic1".to_string()].into());
    }

    #[tokio::test]
    async fn a_failed_migration_rolls_back() {
        let bed = Bed::new();
        bed.host.fail("src.wait_migration", Fault::Refuse);
        let report = bed.run(plan()).await;
        assert_back_on_source(&bed, &report, true);
        assert!(report.forced.is_empty());
        assert!(report.error.as_deref().unwrap().contains("failed on cue"));
    }

    #[tokio::test]
    async fn an_attach_failure_after_the_migration_fails_back_to_the_source() {
        let bed = Bed::new();
        bed.host.fail("dst.add_device", Fault::Refuse);
        let report = bed.run(plan()).await;
        assert_back_on_source(&bed, &report, true);
        assert_eq!(report.failed_phase, Some(Phase::Attach));
        let state = bed.host.state();
        assert!(state.destination_gone);
        assert!(state.calls.contains(&"src.resume".to_string()));
        let steps = &report.timeline.phases.last().unwrap().details["steps"];
        assert!(
            steps.to_string().contains("destination VMM stopped"),
            "{steps}"
        );
    }

    #[tokio::test]
    async fn a_migration_the_destination_did_not_receive_fails_back_to_the_source() {
        let bed = Bed::new();
        bed.host.fail("dst.confirm_received", Fault::Refuse);
        let report = bed.run(plan()).await;
        assert_back_on_source(&bed, &report, true);
        assert_eq!(report.failed_phase, Some(Phase::Migrate));
        let state = bed.host.state();
        assert!(state.destination_gone);
        assert_eq!(state.source_state, "running");
        assert!(
            !state.calls.contains(&"dst.add_device".to_string()),
            "nothing is plugged into a VM that did not arrive"
        );
        assert!(
            report
                .error
                .as_deref()
                .unwrap_or("")
                .contains("not received"),
            "{report:?}"
        );
    }

    #[tokio::test]
    async fn a_resume_failure_is_past_the_point_of_no_return() {
        let bed = Bed::new();
        bed.host.fail("agent.resume", Fault::Timeout);
        let report = bed.run(plan()).await;
        assert_eq!(report.final_phase, Phase::Failed);
        assert_eq!(report.failed_phase, Some(Phase::Resume));
        assert_eq!(report.vm_location, VmLocation::Destination);
        assert!(report.rollback_error.is_none());
        assert!(!report
            .timeline
            .phases
            .iter()
            .any(|p| p.phase == Phase::Rollback));
        let replay = journal::read(&bed.journal_path()).unwrap();
        assert_eq!(replay.ended(), Some(Phase::Failed));
    }

    #[tokio::test]
    async fn a_failed_rollback_ends_failed_and_says_why() {
        let bed = Bed::new();
        bed.host.fail("src.wait_migration", Fault::Refuse);
        bed.host.fail("src.add_device", Fault::Refuse);
        let report = bed.run(plan()).await;
        assert_eq!(report.final_phase, Phase::Failed);
        assert_eq!(report.failed_phase, Some(Phase::Migrate));
        assert!(report
            .rollback_error
            .as_deref()
            .unwrap()
            .contains("refused on cue"));
        assert_eq!(report.vm_location, VmLocation::Source);
    }

    /// Kills the move (a panic in the boundary hook, the way the daemon aborts) right after
    /// `phase` was journaled, then recovers it from the journal.
    async fn crash_and_recover(bed: &Bed, plan: MovePlan, crash_at: Phase) -> MoveReport {
        let journal = Journal::create(bed.dir.path(), "m", &plan).unwrap();
        let hook: BoundaryHook = Arc::new(move |phase| {
            assert!(phase != crash_at, "killed at {phase}");
        });
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let context = bed.context(Some(hook));
        let killed = tokio::spawn(run_move("m".into(), plan, journal, context, events)).await;
        assert!(killed.is_err(), "the move was not killed at {crash_at}");
        let open = journal::scan(bed.dir.path()).unwrap().unfinished;
        assert_eq!(open.len(), 1);
        let (path, replay) = open.into_iter().next().unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let report = recover(
            replay,
            Journal::reopen(&path).unwrap(),
            bed.context(None),
            events,
        )
        .await;
        assert!(journal::scan(bed.dir.path()).unwrap().unfinished.is_empty());
        report
    }

    #[tokio::test]
    async fn a_migrator_killed_at_every_phase_boundary_finishes_or_rolls_back() {
        for crash_at in Phase::WORKING {
            let bed = Bed::new();
            let report = crash_and_recover(&bed, plan(), crash_at).await;
            assert_eq!(report.recovered_from, Some(crash_at), "{crash_at}");
            if crash_at <= Phase::Migrate {
                // Killed before the migration: back to the source.
                assert_back_on_source(&bed, &report, crash_at >= Phase::Quiesce);
                assert!(report.error.as_deref().unwrap().contains("restarted"));
            } else {
                assert!(report.ok, "{crash_at}: {report:#?}");
                let state = bed.host.state();
                assert_eq!(state.guest, Where::Destination);
                assert_eq!(state.destination_devices, ["nic1".to_string()].into());
                assert_eq!(state.resumed_on.last(), Some(&Where::Destination));
            }
        }
    }

    #[tokio::test]
    async fn a_migrator_killed_during_a_rollback_finishes_it() {
        let bed = Bed::new();
        bed.host.fail("dst.add_device", Fault::Refuse);
        let report = crash_and_recover(&bed, plan(), Phase::Rollback).await;
        assert_back_on_source(&bed, &report, true);
        assert!(bed.host.state().destination_gone);
    }

    #[tokio::test]
    async fn a_migration_that_completed_before_the_journal_said_so_is_finished() {
        let bed = Bed::new();
        let plan = plan();
        let mut journal = Journal::create(bed.dir.path(), "m", &plan).unwrap();
        for phase in [
            Phase::Prepare,
            Phase::Quiesce,
            Phase::Detach,
            Phase::Migrate,
        ] {
            journal.append(&Record::Enter { phase }).unwrap();
        }
        {
            let mut state = bed.host.state();
            state.source_devices.clear();
            state.source_state = "postmigrate".into();
            state.destination_state = "running".into();
            state.guest = Where::Destination;
            state.quiesced = true;
        }
        let replay = journal::read(&bed.journal_path()).unwrap();
        let (events, _received) = tokio::sync::mpsc::unbounded_channel();
        let report = recover(replay, journal, bed.context(None), events).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.vm_location, VmLocation::Destination);
        assert_eq!(bed.host.state().resumed_on, vec![Where::Destination]);
    }

    #[tokio::test]
    async fn a_pooled_function_is_reserved_then_attached() {
        let bed = Bed::with_pool(1);
        let report = bed.run(Bed::pooled()).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(report.function.as_deref(), Some("tap0"));
        assert_eq!(
            bed.pool.state("tap0"),
            Some(FunctionState::Attached { vm: "vm1".into() })
        );
        let attach = &report.timeline.phases[4];
        assert_eq!(attach.details["driver"], "e1000e");
    }

    #[tokio::test]
    async fn no_free_function_rolls_back_at_prepare_before_touching_the_vm() {
        let bed = Bed::with_pool(0);
        let report = bed.run(Bed::pooled()).await;
        assert_back_on_source(&bed, &report, false);
        assert_eq!(report.failed_phase, Some(Phase::Prepare));
        assert!(report
            .error
            .as_deref()
            .unwrap()
            .contains("no free function in the pool"));
        assert!(bed.calls().is_empty(), "{:?}", bed.calls());
    }

    #[tokio::test]
    async fn a_rollback_releases_the_reservation() {
        for fault in ["src.wait_migration", "dst.add_device"] {
            let bed = Bed::with_pool(1);
            bed.host.fail(fault, Fault::Refuse);
            let report = bed.run(Bed::pooled()).await;
            assert_back_on_source(&bed, &report, true);
            assert_eq!(bed.pool.state("tap0"), Some(FunctionState::Free), "{fault}");
            let steps = &report.timeline.phases.last().unwrap().details["steps"];
            assert!(steps.to_string().contains("tap0 released"), "{steps}");
        }
    }

    #[tokio::test]
    async fn a_reservation_survives_a_killed_migrator_and_the_recovery_uses_it() {
        let bed = Bed::with_pool(1);
        let report = crash_and_recover(&bed, Bed::pooled(), Phase::Attach).await;
        assert!(report.ok, "{report:#?}");
        assert_eq!(
            bed.pool.state("tap0"),
            Some(FunctionState::Attached { vm: "vm1".into() })
        );
        let bed = Bed::with_pool(1);
        let report = crash_and_recover(&bed, Bed::pooled(), Phase::Detach).await;
        assert_eq!(report.final_phase, Phase::RolledBack);
        assert_eq!(bed.pool.state("tap0"), Some(FunctionState::Free));
    }

    #[tokio::test]
    async fn the_detached_function_is_reset_then_returned_or_quarantined() {
        let dir = tempfile::tempdir().unwrap();
        let config: crate::config::Config = toml::from_str(
            "[[pool.function]]\nname = \"tap0\"\ndevice = \"driver=e1000e,netdev=nd0\"\n\
             [[pool.function]]\nname = \"vf9\"\npci = \"0000:3b:00.7\"\n",
        )
        .unwrap();
        for (function, freed) in [("tap0", true), ("vf9", false)] {
            let mut bed = Bed::new();
            bed.pool = Arc::new(
                Pool::open(&config.pool, &dir.path().join(format!("{function}.json"))).unwrap(),
            );
            // The source VM runs with the function, as an earlier move left it.
            bed.pool.reserve("earlier").unwrap();
            bed.pool.reserve("earlier").unwrap();
            bed.pool.attach(function, "earlier", "vm1").unwrap();
            let mut plan = plan();
            plan.source_function = Some(function.into());
            let report = bed.run(plan).await;
            assert!(report.ok, "{report:#?}");
            let reset = report.timeline.phases[2].details["reset"].as_str().unwrap();
            let state = bed.pool.state(function).unwrap();
            if freed {
                assert_eq!(reset, "emulated: nothing to reset");
                assert_eq!(state, FunctionState::Free);
            } else {
                // This host has no such VF (and maybe no VFIO): the reset fails, and the
                // function must not be handed out again.
                assert!(reset.starts_with("FAILED: "), "{reset}");
                assert!(
                    matches!(&state, FunctionState::Quarantined { reason } if !reason.is_empty()),
                    "{state:?}"
                );
            }
        }
    }

    #[tokio::test]
    async fn a_move_that_fails_past_the_point_of_no_return_still_frees_the_source_function() {
        let dir = tempfile::tempdir().unwrap();
        let config: crate::config::Config = toml::from_str(
            "[[pool.function]]\nname = \"tap0\"\ndevice = \"driver=e1000e,netdev=nd0\"\n",
        )
        .unwrap();
        let mut bed = Bed::new();
        bed.pool = Arc::new(Pool::open(&config.pool, &dir.path().join("pool.json")).unwrap());
        bed.pool.reserve("earlier").unwrap();
        bed.pool.attach("tap0", "earlier", "vm1").unwrap();
        bed.host.fail("agent.resume", Fault::Timeout);
        let mut plan = plan();
        plan.source_function = Some("tap0".into());
        let report = bed.run(plan).await;
        assert_eq!(report.final_phase, Phase::Failed);
        assert_eq!(report.vm_location, VmLocation::Destination);
        assert_eq!(bed.pool.state("tap0"), Some(FunctionState::Free));
    }

    #[tokio::test]
    async fn the_naive_strategy_rolls_back_without_the_agent() {
        let bed = Bed::new();
        bed.host.fail("src.wait_migration", Fault::Refuse);
        let mut plan = plan();
        plan.strategy = Strategy::Naive;
        let report = bed.run(plan).await;
        assert_back_on_source(&bed, &report, false);
        assert!(!bed.calls().iter().any(|c| c.starts_with("agent.")));
    }
}

/// The guest is untrusted: an agent that misbehaves at the quiesce, through the real
/// protocol client, only ever affects its own VM's move.
#[cfg(test)]
mod trust_tests {
    use super::*;
    use crate::fakes::{FakeBackends, FakeHost, Where};
    use crate::plan::tests::plan;
    use rdmamig_proto::agent::{AgentCommand, AgentRequest, AgentResponse, AgentResult};
    use rdmamig_proto::{Frame, FrameBuffer, MAX_FRAME_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    #[derive(Clone, Copy, Debug)]
    enum Misbehaviour {
        Garbage,
        Oversized,
        ForeignConnection,
    }

    /// The fake host's VMMs, and a scripted agent speaking the real framing.
    struct ScriptedBackends {
        vmms: FakeBackends,
        misbehaviour: Misbehaviour,
    }

    #[async_trait]
    impl Backends for ScriptedBackends {
        async fn connect(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError> {
            self.vmms.connect(endpoint).await
        }

        async fn agent(&self, _vmm: &dyn Vmm) -> Result<Box<dyn GuestAgent>, VmmError> {
            let (host, guest) = tokio::io::duplex(1 << 20);
            tokio::spawn(serve(guest, self.misbehaviour));
            Ok(Box::new(AgentClient::new(Box::new(host))))
        }
    }

    async fn serve(mut stream: DuplexStream, misbehaviour: Misbehaviour) {
        let mut buffer = FrameBuffer::new();
        let mut chunk = [0u8; 4096];
        loop {
            let frame = loop {
                match buffer.pop() {
                    Ok(frame) => break frame,
                    Err(_) => match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buffer.push(&chunk[..n]),
                    },
                }
            };
            let Ok(request) = frame.decode::<AgentRequest>() else {
                return;
            };
            let result = match request.command {
                AgentCommand::Ping => AgentResult::Pong {
                    version: "scripted".into(),
                },
                AgentCommand::ListConnections => AgentResult::Connections {
                    connections: vec![],
                },
                AgentCommand::ListUnmanaged => AgentResult::Unmanaged { programs: vec![] },
                AgentCommand::Quiesce { .. } => {
                    let bytes = match misbehaviour {
                        Misbehaviour::Garbage => b"\x00\x01garbage that is no frame".to_vec(),
                        Misbehaviour::Oversized => {
                            let mut b = b"RMG\x01".to_vec();
                            let len = u32::try_from(MAX_FRAME_LEN * 4).unwrap();
                            b.extend_from_slice(&len.to_be_bytes());
                            b
                        }
                        Misbehaviour::ForeignConnection => Frame::encode(&AgentResponse {
                            id: request.id,
                            result: AgentResult::Outcomes {
                                outcomes: vec![ConnectionOutcome {
                                    id: 0xdead,
                                    ok: true,
                                    elapsed_ms: 1,
                                    error: None,
                                }],
                                elapsed_ms: 1,
                            },
                        }),
                    };
                    let _ = stream.write_all(&bytes).await;
                    return;
                }
                AgentCommand::Resume { .. } => AgentResult::Outcomes {
                    outcomes: vec![],
                    elapsed_ms: 1,
                },
                AgentCommand::ReleaseDevice { .. } => AgentResult::Released { holders: vec![] },
            };
            let answer = Frame::encode(&AgentResponse {
                id: request.id,
                result,
            });
            if stream.write_all(&answer).await.is_err() {
                return;
            }
        }
    }

    #[tokio::test]
    async fn a_misbehaving_agent_only_forces_its_own_quiesce() {
        for misbehaviour in [
            Misbehaviour::Garbage,
            Misbehaviour::Oversized,
            Misbehaviour::ForeignConnection,
        ] {
            let host = FakeHost::new();
            let dir = tempfile::tempdir().unwrap();
            let plan = plan();
            let journal = Journal::create(dir.path(), "m", &plan).unwrap();
            let pool =
                Arc::new(Pool::open(&Default::default(), &dir.path().join("pool.json")).unwrap());
            let context = MoveContext {
                backends: Arc::new(ScriptedBackends {
                    vmms: FakeBackends(host.clone()),
                    misbehaviour,
                }),
                pool,
                peers: None,
                boundary: None,
            };
            let (events, _received) = tokio::sync::mpsc::unbounded_channel();
            let report = run_move("m".into(), plan, journal, context, events).await;
            // The move went on through its forced path; the host acted on nothing the agent
            // named, and only on this VM's two VMMs.
            assert!(report.ok, "{misbehaviour:?}: {report:#?}");
            assert_eq!(report.forced.len(), 1, "{misbehaviour:?}");
            assert_eq!(report.forced[0].phase, Phase::Quiesce);
            let reason = &report.forced[0].reason;
            let expected = match misbehaviour {
                Misbehaviour::Garbage | Misbehaviour::Oversized => "malformed",
                Misbehaviour::ForeignConnection => "which was not listed",
            };
            assert!(reason.contains(expected), "{misbehaviour:?}: {reason}");
            assert!(report.quiesce.is_empty(), "{misbehaviour:?}");
            let state = host.state();
            assert_eq!(state.guest, Where::Destination);
            assert!(state
                .calls
                .iter()
                .all(|c| c.starts_with("src.") || c.starts_with("dst.")));
        }
    }
}
