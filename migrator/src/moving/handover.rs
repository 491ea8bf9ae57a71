//! A workflow's move: `rdmamig-vmm pre-migrate`, then the workflow's own migration, then
//! `rdmamig-vmm post-migrate`. It is one move with one journal and one report, run by the
//! same runner as a daemon's move, in two processes:
//!
//! - [`run_to_handover`] runs prepare, quiesce and detach, and journals the hand-over;
//!   a failure there rolls back on the source;
//! - the workflow migrates the VM;
//! - [`run_after_handover`] reads the journal, journals the destination it is given, and
//!   runs migrate (the arrival is confirmed, nothing is sent), attach and resume. A failure
//!   before the resume rolls back as a daemon's move does: the destination's copy is
//!   discarded, the source runs again with its device plugged back, the connections resume
//!   there. Only on the source's host: elsewhere the move fails and says where the VM is.

use rdmamig_vmm::DeviceSpec;

use super::*;
use crate::report::MoveReport;

/// The working phases before the workflow migrates.
const BEFORE: [Phase; 3] = [Phase::Prepare, Phase::Quiesce, Phase::Detach];

/// The working phases after it.
const AFTER: [Phase; 3] = [Phase::Migrate, Phase::Attach, Phase::Resume];

/// Why a handed-over move cannot go on; nothing was changed.
#[derive(Debug, Error)]
pub enum HandoverError {
    /// The journal is not a workflow's move.
    #[error("move {id} is not a workflow's move (it was started by `rdmamig migrate`)")]
    NotAWorkflowMove {
        /// The move.
        id: String,
    },
    /// The move ended already.
    #[error("move {id} has ended already ({phase})")]
    Ended {
        /// The move.
        id: String,
        /// How it ended.
        phase: Phase,
    },
    /// The move did not reach its hand-over (its pre-migrate is running, or was killed).
    #[error("move {id} was not handed over to the workflow (it stands in {phase})")]
    NotHandedOver {
        /// The move.
        id: String,
        /// Its last phase.
        phase: Phase,
    },
    /// The destination could not be journaled, so nothing acted.
    #[error(transparent)]
    Journal(#[from] JournalError),
}

/// This host's name, which a workflow's journal records for its source.
pub fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .unwrap_or_default()
}

/// Runs a workflow's move (the plan says [`MigrationBy::Workflow`]) to its hand-over.
///
/// The report's `ok` says the move was handed over: its `final_phase` is `detach` and the
/// journal stays open for [`run_after_handover`]. A failure rolls back and ends the move.
pub async fn run_to_handover(
    id: String,
    plan: MovePlan,
    choice: Choice,
    journal: Journal,
    context: MoveContext,
    events: UnboundedSender<MoveEvent>,
) -> MoveReport {
    let mut mover = Mover::new(id, plan, journal, context, events);
    mover.choose(choice);
    let result = match mover.run(&BEFORE).await {
        Ok(()) => {
            let handover = Record::HandedOver { host: this_host() };
            match mover.journal.append(&handover) {
                Ok(()) => return mover.report_so_far(Ok(()), true),
                // Without the record, post-migrate could not go on: undo the move now.
                Err(e) => {
                    let error = MoveError::PhaseFailed {
                        phase: Phase::Detach,
                        cause: e.into(),
                    };
                    mover.fail_and_roll_back(Phase::Detach, error).await
                }
            }
        }
        Err(e) => Err(e),
    };
    mover.report(result)
}

/// Goes on with a move [`run_to_handover`] handed over, once the workflow migrated the VM
/// to `destination`: confirms it arrived, plugs `attach`, resumes the connections.
///
/// `earlier` is the hand-over's report, when this host has it: the final report then holds
/// the whole move's timeline and the quiesce's outcomes.
pub async fn run_after_handover(
    replay: Replay,
    mut journal: Journal,
    destination: Endpoint,
    attach: DeviceSpec,
    earlier: Option<MoveReport>,
    context: MoveContext,
    events: UnboundedSender<MoveEvent>,
) -> Result<MoveReport, HandoverError> {
    let id = replay.id.clone();
    if replay.plan.migration != MigrationBy::Workflow {
        return Err(HandoverError::NotAWorkflowMove { id });
    }
    if let Some(phase) = replay.ended() {
        return Err(HandoverError::Ended { id, phase });
    }
    let Some(host) = replay.handed_over() else {
        let phase = replay.last_phase().unwrap_or(Phase::Prepare);
        return Err(HandoverError::NotHandedOver { id, phase });
    };
    let source_host = host.to_string();
    journal.append(&Record::Arrived {
        destination: destination.clone(),
        attach: attach.clone(),
    })?;
    let mut plan = replay.plan.clone();
    plan.destination = Some(destination);
    plan.attach = Some(attach);
    let mut mover = Mover::new(id, plan, journal, context, events);
    mover.source_host = Some(source_host);
    mover.ids = replay.connections();
    mover.function = replay.reserved();
    if let Some(choice) = replay.chosen() {
        mover.choose(choice);
    }
    mover.unplugging = replay.unplugging();
    mover.reached = Phase::Detach;
    mover.phase = Phase::Detach;
    if let Some(earlier) = earlier.filter(|r| r.id == mover.id) {
        mover.recorder = TimelineRecorder::continuing(earlier.timeline);
        mover.connections = earlier.connections;
        mover.quiesce = earlier.quiesce;
        mover.unmanaged.add_reports(earlier.unmanaged);
    }
    let result = mover.run(&AFTER).await;
    Ok(mover.report(result))
}
