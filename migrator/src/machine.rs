//! The move as one state machine.
//!
//! Every move walks the same phases in the same order; a strategy that has nothing to do in a
//! phase (the `naive` baseline has no quiesce and no resume) still passes through it and
//! records it as skipped, so timelines of different strategies line up phase by phase and the
//! transition function does not depend on the strategy.
//!
//! A failure before the destination resumes the guest's connections leads to `Rollback`
//! (the VM goes back to the source with its device and its connections resumed there), which
//! ends in `RolledBack`, or in `Failed` when the rollback itself fails. Once the destination
//! has started resuming connections, the peers may have exchanged messages with the moved
//! guest, so going back would lose them: a failure in `Resume` ends in `Failed`. `Done`,
//! `RolledBack` and `Failed` are final.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Where a move stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Connect to both VMMs, ready the destination, list the guest's connections.
    Prepare,
    /// The guest agent quiesces every connection and releases the RDMA device.
    Quiesce,
    /// The source VMM unplugs the device and the guest acknowledges.
    Detach,
    /// The VM migrates to the destination VMM.
    Migrate,
    /// The destination VMM plugs the new device.
    Attach,
    /// The guest agent reconnects every connection on the new device.
    Resume,
    /// The move failed before the point of no return: put the VM back as it was.
    Rollback,
    /// The move completed.
    Done,
    /// The move failed and the VM runs on the source as before, with its device.
    RolledBack,
    /// The move stopped with an error and could not be undone.
    Failed,
}

impl Phase {
    /// The working phases, in order.
    pub const WORKING: [Phase; 6] = [
        Phase::Prepare,
        Phase::Quiesce,
        Phase::Detach,
        Phase::Migrate,
        Phase::Attach,
        Phase::Resume,
    ];

    /// Every phase.
    pub const ALL: [Phase; 10] = [
        Phase::Prepare,
        Phase::Quiesce,
        Phase::Detach,
        Phase::Migrate,
        Phase::Attach,
        Phase::Resume,
        Phase::Rollback,
        Phase::Done,
        Phase::RolledBack,
        Phase::Failed,
    ];

    /// The phase's name as operators write it (`--deadline detach=5000`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prepare => "prepare",
            Phase::Quiesce => "quiesce",
            Phase::Detach => "detach",
            Phase::Migrate => "migrate",
            Phase::Attach => "attach",
            Phase::Resume => "resume",
            Phase::Rollback => "rollback",
            Phase::Done => "done",
            Phase::RolledBack => "rolled_back",
            Phase::Failed => "failed",
        }
    }

    /// Whether no step leads out of this phase.
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Done | Phase::RolledBack | Phase::Failed)
    }

    /// Whether a failure in this phase is undone by a rollback (the destination has not
    /// started resuming the guest's connections yet).
    pub fn can_roll_back(self) -> bool {
        matches!(
            self,
            Phase::Prepare | Phase::Quiesce | Phase::Detach | Phase::Migrate | Phase::Attach
        )
    }

    fn next(self) -> Option<Phase> {
        match self {
            Phase::Prepare => Some(Phase::Quiesce),
            Phase::Quiesce => Some(Phase::Detach),
            Phase::Detach => Some(Phase::Migrate),
            Phase::Migrate => Some(Phase::Attach),
            Phase::Attach => Some(Phase::Resume),
            Phase::Resume => Some(Phase::Done),
            Phase::Rollback => Some(Phase::RolledBack),
            Phase::Done | Phase::RolledBack | Phase::Failed => None,
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

impl std::str::FromStr for Phase {
    type Err = UnknownPhase;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Phase::ALL
            .into_iter()
            .find(|p| p.name() == text)
            .ok_or_else(|| UnknownPhase { name: text.into() })
    }
}

/// A phase name that is not one.
#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "unknown phase {name:?} (phases: prepare, quiesce, detach, migrate, attach, resume, rollback)"
)]
pub struct UnknownPhase {
    /// The name given.
    pub name: String,
}

/// A step the machine does not allow.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid move step from {from} to {to}")]
pub struct InvalidTransition {
    /// The phase the move is in.
    pub from: Phase,
    /// The phase asked for.
    pub to: Phase,
}

/// The one transition function: the next phase; `Rollback` from a phase that can roll back;
/// `Failed` from any phase that is not final.
pub fn transition(from: Phase, to: Phase) -> Result<Phase, InvalidTransition> {
    let allowed = from.next() == Some(to)
        || (to == Phase::Rollback && from.can_roll_back())
        || (to == Phase::Failed && !from.is_final());
    if allowed {
        Ok(to)
    } else {
        Err(InvalidTransition { from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_is_checked() {
        let allowed = [
            (Phase::Prepare, Phase::Quiesce),
            (Phase::Quiesce, Phase::Detach),
            (Phase::Detach, Phase::Migrate),
            (Phase::Migrate, Phase::Attach),
            (Phase::Attach, Phase::Resume),
            (Phase::Resume, Phase::Done),
            (Phase::Prepare, Phase::Failed),
            (Phase::Quiesce, Phase::Failed),
            (Phase::Detach, Phase::Failed),
            (Phase::Migrate, Phase::Failed),
            (Phase::Attach, Phase::Failed),
            (Phase::Resume, Phase::Failed),
            (Phase::Prepare, Phase::Rollback),
            (Phase::Quiesce, Phase::Rollback),
            (Phase::Detach, Phase::Rollback),
            (Phase::Migrate, Phase::Rollback),
            (Phase::Attach, Phase::Rollback),
            (Phase::Rollback, Phase::RolledBack),
            (Phase::Rollback, Phase::Failed),
        ];
        let mut checked = 0;
        for from in Phase::ALL {
            for to in Phase::ALL {
                checked += 1;
                let result = transition(from, to);
                if allowed.contains(&(from, to)) {
                    assert_eq!(result, Ok(to), "{from} -> {to}");
                } else {
                    assert_eq!(
                        result,
                        Err(InvalidTransition { from, to }),
                        "{from} -> {to}"
                    );
                }
            }
        }
        assert_eq!(checked, 100);
    }

    #[test]
    fn the_error_names_both_phases() {
        let err = transition(Phase::Detach, Phase::Prepare).unwrap_err();
        assert_eq!(err.to_string(), "invalid move step from detach to prepare");
        assert!(transition(Phase::Done, Phase::Failed).is_err());
        assert!(transition(Phase::Failed, Phase::Failed).is_err());
        assert_eq!(
            transition(Phase::Resume, Phase::Rollback)
                .unwrap_err()
                .to_string(),
            "invalid move step from resume to rollback"
        );
    }

    #[test]
    fn names_parse_back() {
        for phase in Phase::ALL {
            assert_eq!(phase.name().parse::<Phase>(), Ok(phase));
            assert_eq!(
                serde_json::to_value(phase).unwrap(),
                serde_json::json!(phase.name())
            );
        }
        assert_eq!(
            "unplug".parse::<Phase>(),
            Err(UnknownPhase {
                name: "unplug".into()
            })
        );
        assert_eq!(Phase::WORKING.len() + 4, Phase::ALL.len());
    }
}
