//! What a move tells: the events while it runs ([`MoveEvent`]) and the report when it ends
//! ([`MoveReport`]). The daemon streams both to clients, keeps the reports, and folds them
//! into its metrics.

use rdmamig_proto::agent::{ConnectionInfo, ConnectionOutcome};
use rdmamig_vmm::MigrationProgress;
use serde::{Deserialize, Serialize};

use crate::machine::Phase;
use crate::plan::MovePlan;
use crate::strategy::Choice;
use crate::timeline::{PhaseRecord, Timeline};
use crate::unmanaged::{Fate, ProgramReport};

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
