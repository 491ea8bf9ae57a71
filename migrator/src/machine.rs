//! The move as one state machine.
//!
//! Every move walks the same phases in the same order; a strategy that has nothing to do in a
//! phase (the `naive` baseline has no quiesce and no resume) still passes through it and
//! records it as skipped, so timelines of different strategies line up phase by phase and the
//! transition function does not depend on the strategy. Any working phase may fail; `Done`
//! and `Failed` are final.

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
    /// The move completed.
    Done,
    /// The move stopped with an error.
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
    pub const ALL: [Phase; 8] = [
        Phase::Prepare,
        Phase::Quiesce,
        Phase::Detach,
        Phase::Migrate,
        Phase::Attach,
        Phase::Resume,
        Phase::Done,
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
            Phase::Done => "done",
            Phase::Failed => "failed",
        }
    }

    /// Whether no step leads out of this phase.
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Done | Phase::Failed)
    }

    fn next(self) -> Option<Phase> {
        match self {
            Phase::Prepare => Some(Phase::Quiesce),
            Phase::Quiesce => Some(Phase::Detach),
            Phase::Detach => Some(Phase::Migrate),
            Phase::Migrate => Some(Phase::Attach),
            Phase::Attach => Some(Phase::Resume),
            Phase::Resume => Some(Phase::Done),
            Phase::Done | Phase::Failed => None,
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
#[error("unknown phase {name:?} (phases: prepare, quiesce, detach, migrate, attach, resume)")]
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

/// The one transition function: the next working phase, or `Failed` from any working phase.
pub fn transition(from: Phase, to: Phase) -> Result<Phase, InvalidTransition> {
    let allowed = from.next() == Some(to) || (to == Phase::Failed && !from.is_final());
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
        assert_eq!(checked, 64);
    }

    #[test]
    fn the_error_names_both_phases() {
        let err = transition(Phase::Detach, Phase::Prepare).unwrap_err();
        assert_eq!(err.to_string(), "invalid move step from detach to prepare");
        assert!(transition(Phase::Done, Phase::Failed).is_err());
        assert!(transition(Phase::Failed, Phase::Failed).is_err());
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
        assert_eq!(Phase::WORKING.len() + 2, Phase::ALL.len());
    }
}
