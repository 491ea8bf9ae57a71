//! Recovery: a restarted migrator finishes or rolls back a move from its journal.

use super::*;

impl Mover {
    /// Decides, after a restart, whether the move goes forward or back, and does it.
    pub(super) async fn recover_from(&mut self, last: Phase) -> RunResult {
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
}
