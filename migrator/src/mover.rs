//! Runs one move: the phases of [`crate::machine`] against two QEMU processes and the guest
//! agent, each under its deadline, recorded in a [`Timeline`], reported as it goes.
//!
//! The source and destination are two VMM processes on this host (the destination started
//! with `-incoming defer`). Each phase body does the VMM or agent calls the phase stands for;
//! the runner around it owns the state machine, the deadline, the timeline and the events, so
//! a phase body cannot forget any of them.
//!
//! A failed move is not rolled back yet: the report says where the VM is (source until the
//! migration completed, destination after) so that an operator knows what to repair.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{ConnectionInfo, ConnectionOutcome};
use rdmamig_proto::ConnectionId;
use rdmamig_vmm::{
    MigrationLimits, MigrationProgress, MigrationStatus, QemuConfig, QemuVmm, Vmm, VmmError,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;
use tokio::sync::mpsc::UnboundedSender;

use crate::agent::{AgentClient, AgentError, Outcomes};
use crate::machine::{transition, InvalidTransition, Phase};
use crate::plan::{Endpoint, MovePlan, Strategy};
use crate::timeline::{PhaseOutcome, PhaseRecord, Timeline, TimelineRecorder};

/// Time a phase may overrun its deadline before the runner gives up on it: every call inside
/// a phase has its own deadline, so this only catches a call that ignores it.
const GRACE: Duration = Duration::from_millis(250);

/// One attempt to reach a freshly connected agent; attempts repeat within the phase deadline.
const PING_ATTEMPT: Duration = Duration::from_millis(1000);

/// Migration progress is reported at most this often (and on every status change).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(200);

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

/// The outcome of a move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveReport {
    /// The plan that ran.
    pub plan: MovePlan,
    /// Whether the move reached `done`.
    pub ok: bool,
    /// `done`, or `failed`.
    pub final_phase: Phase,
    /// The phase that failed, if one did.
    pub failed_phase: Option<Phase>,
    /// The error, with its causes, if the move failed.
    pub error: Option<String>,
    /// Where the VM is now.
    pub vm_location: VmLocation,
    /// Every phase with its times.
    pub timeline: Timeline,
    /// The connections the agent listed at prepare.
    pub connections: Vec<ConnectionInfo>,
    /// Per-connection quiesce results.
    pub quiesce: Vec<ConnectionOutcome>,
    /// Per-connection resume results.
    pub resume: Vec<ConnectionOutcome>,
    /// The final migration sample (QEMU's total time, downtime, bytes).
    pub migration: Option<MigrationProgress>,
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
}

impl StepError {
    fn is_timeout(&self) -> bool {
        match self {
            StepError::Vmm(e) => e.is_timeout(),
            StepError::Agent(e) => e.is_timeout(),
            StepError::Stalled => true,
            StepError::VmState { .. } | StepError::ConnectionsLost { .. } => false,
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

/// Formats an error and its causes as `outer: cause: root`.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
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

/// Runs `plan` to the end, sending events to `events`, and returns the report.
///
/// The plan must have passed [`MovePlan::validate`].
pub async fn run_move(plan: MovePlan, events: UnboundedSender<MoveEvent>) -> MoveReport {
    let mut mover = Mover {
        plan,
        events,
        recorder: TimelineRecorder::start(),
        phase: Phase::Prepare,
        source: None,
        destination: None,
        agent: None,
        connections: Vec::new(),
        quiesce: Vec::new(),
        resume: Vec::new(),
        migration: None,
        location: VmLocation::Source,
    };
    let result = mover.run().await;
    let failed_phase = result.as_ref().err().map(|(phase, _)| *phase);
    let error = result.err().map(|(_, e)| error_chain(&e));
    let Mover {
        plan,
        recorder,
        phase,
        connections,
        quiesce,
        resume,
        migration,
        location,
        ..
    } = mover;
    MoveReport {
        plan,
        ok: phase == Phase::Done,
        final_phase: phase,
        failed_phase,
        error,
        vm_location: location,
        timeline: recorder.finish(),
        connections,
        quiesce,
        resume,
        migration,
    }
}

struct Mover {
    plan: MovePlan,
    events: UnboundedSender<MoveEvent>,
    recorder: TimelineRecorder,
    phase: Phase,
    source: Option<QemuVmm>,
    destination: Option<QemuVmm>,
    agent: Option<AgentClient>,
    connections: Vec<ConnectionInfo>,
    quiesce: Vec<ConnectionOutcome>,
    resume: Vec<ConnectionOutcome>,
    migration: Option<MigrationProgress>,
    location: VmLocation,
}

impl Mover {
    async fn run(&mut self) -> Result<(), (Phase, MoveError)> {
        for (index, phase) in Phase::WORKING.into_iter().enumerate() {
            if index > 0 {
                self.phase = transition(self.phase, phase).map_err(|e| (self.phase, e.into()))?;
            }
            let deadline = self.plan.deadlines.of(phase);
            let started = self.recorder.begin(phase, millis(deadline));
            self.emit(MoveEvent::PhaseStarted {
                phase,
                unix_ms: started,
                at_ms: self.recorder.elapsed_ms(),
                deadline_ms: millis(deadline),
            });
            let body = self.body(phase, deadline);
            let result = match tokio::time::timeout(deadline + GRACE, body).await {
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
                    self.phase = transition(self.phase, Phase::Failed)
                        .map_err(|e| (self.phase, e.into()))?;
                    self.cleanup_after_failure(phase).await;
                    return Err((phase, error));
                }
            }
        }
        self.phase = transition(self.phase, Phase::Done).map_err(|e| (self.phase, e.into()))?;
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
            Phase::Attach => Box::pin(self.attach()),
            Phase::Resume => Box::pin(self.resume_phase(deadline)),
            Phase::Done | Phase::Failed => Box::pin(async { Ok(Finished::ok(Map::new())) }),
        }
    }

    fn emit(&self, event: MoveEvent) {
        // A client that went away does not stop the move.
        let _ = self.events.send(event);
    }

    fn warn(&self, message: String) {
        tracing::warn!(vm = %self.plan.vm, "{message}");
        self.emit(MoveEvent::Warning {
            at_ms: self.recorder.elapsed_ms(),
            message,
        });
    }

    fn end_phase(&mut self, outcome: PhaseOutcome, details: Map<String, Value>) {
        if let Some(record) = self.recorder.end(outcome, details).cloned() {
            self.emit(MoveEvent::PhaseEnded {
                at_ms: self.recorder.elapsed_ms(),
                record,
            });
        }
    }

    /// Leaves nothing running that the report does not mention.
    async fn cleanup_after_failure(&mut self, phase: Phase) {
        if phase == Phase::Migrate {
            if let Some(source) = &self.source {
                if let Err(e) = source.cancel_migration().await {
                    self.warn(format!(
                        "cancelling the failed migration: {}",
                        error_chain(&e)
                    ));
                }
            }
        }
    }

    fn source(&self) -> &QemuVmm {
        self.source.as_ref().expect("prepare connected the source")
    }

    fn destination(&self) -> &QemuVmm {
        self.destination
            .as_ref()
            .expect("prepare connected the destination")
    }

    fn connection_ids(&self) -> Vec<ConnectionId> {
        self.connections.iter().map(|c| c.id).collect()
    }

    async fn prepare(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        let start = Instant::now();
        let mut details = Map::new();
        let source = connect(&self.plan.source).await?;
        let state = source.status().await?.state;
        if matches!(state.as_str(), "inmigrate" | "postmigrate" | "shutdown") {
            return Err(StepError::VmState {
                side: "source",
                state,
                expected: "not a VM that can migrate",
            });
        }
        details.insert("source_state".into(), state.into());
        let destination = connect(&self.plan.destination).await?;
        let state = destination.status().await?.state;
        if state != "inmigrate" {
            return Err(StepError::VmState {
                side: "destination",
                state,
                expected: "not waiting for a migration (start it with -incoming defer)",
            });
        }
        destination.prepare_incoming(&self.plan.via).await?;
        details.insert("via".into(), self.plan.via.clone().into());

        if self.plan.strategy == Strategy::Reconnect {
            let mut agent = AgentClient::new(source.open_agent_channel().await?);
            let version = ping(&mut agent, deadline.saturating_sub(start.elapsed())).await?;
            let connections = agent
                .list_connections(deadline.saturating_sub(start.elapsed()))
                .await?;
            details.insert("agent_version".into(), version.into());
            details.insert("connections".into(), connections.len().into());
            self.connections = connections;
            self.agent = Some(agent);
        }
        self.source = Some(source);
        self.destination = Some(destination);
        Ok(Finished::ok(details))
    }

    async fn quiesce_phase(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if self.plan.strategy == Strategy::Naive {
            return Ok(Finished::skipped(
                "strategy naive: connections are not quiesced",
            ));
        }
        let ids = self.connection_ids();
        let agent = self.agent.as_mut().expect("prepare opened the agent");
        let result = agent.quiesce(&ids, deadline).await?;
        let details = self.record_outcomes(&result, "quiesced");
        for failed in result.failed() {
            self.warn(format!(
                "connection {:016x} did not quiesce ({}); detaching anyway",
                failed.id,
                failed.error.as_deref().unwrap_or("no reason given")
            ));
        }
        self.quiesce = result.outcomes;
        Ok(Finished::ok(details))
    }

    async fn detach(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        self.source()
            .remove_device(&self.plan.detach, deadline)
            .await?;
        let mut details = Map::new();
        details.insert("device".into(), self.plan.detach.clone().into());
        Ok(Finished::ok(details))
    }

    async fn migrate(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        let start = Instant::now();
        let source = self.source.as_ref().expect("prepare connected the source");
        source
            .send_migration(&self.plan.via, &MigrationLimits::default())
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
        let done = source
            .wait_migration(deadline.saturating_sub(start.elapsed()), &mut report)
            .await?;
        self.location = VmLocation::Destination;
        let mut details = Map::new();
        for (key, value) in [
            ("qemu_total_ms", done.total_time_ms),
            ("downtime_ms", done.downtime_ms),
            ("setup_ms", done.setup_time_ms),
            ("ram_transferred", done.ram_transferred),
        ] {
            if let Some(value) = value {
                details.insert(key.into(), value.into());
            }
        }
        self.migration = Some(done);
        let state = self.destination().status().await?.state;
        details.insert("destination_state".into(), state.into());
        Ok(Finished::ok(details))
    }

    async fn attach(&mut self) -> Result<Finished, StepError> {
        let id = self.destination().add_device(&self.plan.attach).await?.id;
        let mut details = Map::new();
        details.insert("device".into(), id.into());
        details.insert("driver".into(), self.plan.attach.driver().into());
        Ok(Finished::ok(details))
    }

    async fn resume_phase(&mut self, deadline: Duration) -> Result<Finished, StepError> {
        if self.plan.strategy == Strategy::Naive {
            return Ok(Finished::skipped(
                "strategy naive: connections are not resumed",
            ));
        }
        let start = Instant::now();
        // The guest now runs under the destination VMM; the source's channel is dead.
        self.agent = None;
        let channel = self.destination().open_agent_channel().await?;
        let mut agent = AgentClient::new(channel);
        ping(&mut agent, deadline.saturating_sub(start.elapsed())).await?;
        let ids = self.connection_ids();
        let result = agent
            .resume(&ids, deadline.saturating_sub(start.elapsed()))
            .await?;
        let details = self.record_outcomes(&result, "resumed");
        let failed: Vec<_> = result.failed().collect();
        let lost = (!failed.is_empty()).then(|| StepError::ConnectionsLost {
            failed: failed.len(),
            total: ids.len(),
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
        });
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
        for id in self.connection_ids() {
            if !answered.contains_key(&id) {
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

async fn connect(endpoint: &Endpoint) -> Result<QemuVmm, VmmError> {
    let mut config = QemuConfig::new(&endpoint.qmp);
    config.agent.clone_from(&endpoint.agent);
    QemuVmm::connect(config).await
}

/// Pings a freshly connected agent until it answers or `budget` is spent: a guest may not be
/// reading its port at the very moment the host connects.
async fn ping(agent: &mut AgentClient, budget: Duration) -> Result<String, AgentError> {
    let end = Instant::now() + budget;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match agent.ping(PING_ATTEMPT.min(left)).await {
            Err(e) if e.is_timeout() && Instant::now() < end => {
                tracing::debug!("agent ping timed out; retrying");
            }
            Err(e) if e.is_timeout() => {
                return Err(AgentError::TimedOut {
                    request: "ping",
                    deadline_ms: millis(budget),
                })
            }
            other => return other,
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
