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
//!
//! Layout: this module holds the runner (the [`Mover`], [`run_move`], [`recover`], the loop
//! over phases, journaling, failing and rolling back); each phase's body has a module of its
//! own ([`prepare`], [`quiesce`], [`detach`], [`migrate`], [`attach`], [`resume`]), as do
//! the [`rollback`] and the [`recovery`] from a journal.

mod attach;
mod detach;
mod handover;
mod migrate;
mod prepare;
mod quiesce;
mod recovery;
mod resume;
mod rollback;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trust_tests;

pub use handover::{run_after_handover, run_to_handover, this_host, HandoverError};

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{
    ConnectionInfo, ConnectionOutcome, DeviceHolder, QuiesceMode, ReleaseScope,
};
use rdmamig_proto::clock::millis;
use rdmamig_proto::text::error_chain;
use rdmamig_proto::ConnectionId;
use rdmamig_vmm::{
    vm_paused, DeviceSpec, MigrationProgress, MigrationStatus, VmPhase, Vmm, VmmError,
};
use serde_json::{Map, Value};
use thiserror::Error;
use tokio::sync::mpsc::UnboundedSender;

use crate::agent::{GuestAgent, Outcomes};
use crate::backends::{open_agent, Backends};
use crate::destination::{DestinationHost, HandOver, LocalDestination, MoveRef};
use crate::journal::{Journal, JournalError, Record, Replay};
use crate::machine::{transition, InvalidTransition, Phase};
use crate::peer::tls::{PeerError, PeerTls};
use crate::peer::RemoteDestination;
use crate::plan::{Endpoint, MigrationBy, MovePlan, Strategy, UnmanagedPolicy};
use crate::pool::{Attachment, Pool};
use crate::report::{ForcedPath, MoveEvent, MoveReport, VmLocation};
use crate::step::{within, StepError, GRACE};
use crate::strategy::Choice;
use crate::timeline::{PhaseOutcome, TimelineRecorder};
use crate::unmanaged::Found;

/// Migration progress is reported at most this often (and on every status change).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(200);

/// Time a process signalled by the forced release has between SIGTERM and SIGKILL.
const RELEASE_GRACE: Duration = Duration::from_millis(1000);

/// How long a failed migration waits for the receiver's word on why.
const RECEIVERS_WORD: Duration = Duration::from_secs(2);

/// How often a rollback polls the source while a cancelled migration winds down.
const CANCEL_POLL: Duration = Duration::from_millis(50);

/// The part of a rollback's deadline kept, after the resume, to give the destination's
/// function back.
const RELEASE_RESERVE: Duration = Duration::from_secs(2);

/// How often a rollback polls the source while the guest finishes a pending unplug.
const REMOVAL_POLL: Duration = Duration::from_millis(100);

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
/// The plan must have passed [`MovePlan::validate`], and `choice` is what
/// [`crate::strategy::choose_for`] said of it when the move was admitted: prepare journals
/// it rather than asking VFIO again.
pub async fn run_move(
    id: String,
    plan: MovePlan,
    choice: Choice,
    journal: Journal,
    context: MoveContext,
    events: UnboundedSender<MoveEvent>,
) -> MoveReport {
    let mut mover = Mover::new(id, plan, journal, context, events);
    mover.choose(choice);
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
        mover.choose(choice);
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
    /// The host of the source VMM, when the move was handed over to a workflow (only
    /// that host can reach the source).
    source_host: Option<String>,
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
            source_host: None,
        }
    }

    /// The strategy the move runs, decided before it starts (or read back from its journal).
    fn choose(&mut self, choice: Choice) {
        self.strategy = choice.strategy;
        self.chosen = Some(choice);
    }

    /// The report of a move that ended (journaled so).
    fn report(mut self, result: RunResult) -> MoveReport {
        if let Err(e) = self.journal.append(&Record::End { phase: self.phase }) {
            tracing::error!(move_id = %self.id, "{}", error_chain(&e));
        }
        let ok = self.phase == Phase::Done;
        self.report_so_far(result, ok)
    }

    /// The report as the move stands; `ok` says whether that is success.
    fn report_so_far(self, result: RunResult, ok: bool) -> MoveReport {
        let failed_phase = result.as_ref().err().map(|(phase, _)| *phase);
        let error = result.err().map(|(_, e)| error_chain(&e));
        let final_phase = self.phase;
        MoveReport {
            id: self.id,
            plan: self.plan,
            ok,
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

    /// The deadline of `phase` in this move: the plan's, grown with the connections listed
    /// at prepare unless the client set it.
    fn deadline(&self, phase: Phase) -> Duration {
        self.plan.deadlines.for_move(phase, self.ids.len())
    }

    /// The plan's policy for unmanaged programs (the daemon fills it in; a plan run
    /// without a daemon gets the default).
    fn unmanaged_policy(&self) -> UnmanagedPolicy {
        self.plan.unmanaged.unwrap_or_default()
    }

    /// Runs `phases` in order; the first is entered without a transition when it is the
    /// phase the move already stands in (a fresh move, or a recovery re-entering a phase).
    /// A run that ends with the resume ends the move (`done`); a workflow's move stops
    /// after its detach, for the workflow to migrate.
    async fn run(&mut self, phases: &[Phase]) -> RunResult {
        for &phase in phases {
            if phase != self.phase {
                self.phase = transition(self.phase, phase).map_err(|e| (self.phase, e.into()))?;
            }
            let deadline = self.deadline(phase);
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
        if phases.last() != Some(&Phase::Resume) {
            return Ok(());
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

    /// The source VMM, connected on first use (a recovering migrator connects afresh);
    /// never one on another host, whose socket path may name a VMM of this host.
    async fn source_vmm(&mut self) -> Result<Arc<dyn Vmm>, StepError> {
        if let Some(vmm) = &self.source {
            return Ok(vmm.clone());
        }
        if let Some(host) = &self.source_host {
            let here = this_host();
            if *host != here {
                return Err(StepError::SourceElsewhere {
                    host: host.clone(),
                    here,
                });
            }
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

    /// The destination VMM: every plan names it, but a workflow's only from `post-migrate`.
    fn destination_endpoint(&self) -> Result<Endpoint, StepError> {
        self.plan.destination.clone().ok_or(StepError::NotNamed {
            what: "the destination VMM",
        })
    }

    /// Whether the destination VMM is handed the reserved function with its receive
    /// ([`MovePlan::hands_pool_vf_to_receiver`], for a strategy whose device moves).
    fn hands_over_at_receive(&self) -> bool {
        self.strategy.steps().device_moves.is_some() && self.plan.hands_pool_vf_to_receiver()
    }

    fn move_ref(&self) -> MoveRef {
        MoveRef {
            move_id: self.id.clone(),
            vm: self.plan.vm.clone(),
        }
    }

    /// Once the move is done, gives the source's function back to the pool, or quarantines
    /// it when its reset failed. Neither undoes the move: problems are warnings.
    fn return_source_function(&mut self) {
        let Some(name) = self.plan.source_function.clone() else {
            return;
        };
        if self.strategy.steps().device_moves.is_some() {
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

/// The error of a resume (or a rollback's) in which some connections did not come back.
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
