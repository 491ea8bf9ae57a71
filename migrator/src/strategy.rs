//! Which strategy a move runs: `auto` decides from what VFIO says about the passthrough
//! function, and `vfio-migrate` is refused, before anything changes, for a function that
//! cannot move its device state.
//!
//! The function involved is the source's (`--source-function`, this host's pool): its device
//! state is what `vfio-migrate` hands to the VMM. VFIO answers through
//! query_migration_support; a device must support STOP_COPY
//! ([`crate::vfio_migrate::auto_picks_vfio_migrate`]). An emulated NIC (the test bed's
//! functions) has no VFIO device to ask, so `auto` picks `reconnect` and says why.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::plan::{MovePlan, Strategy};
use crate::pool::{Attachment, Pool};
use crate::vfio::{Sysfs, VfioFunction};
use crate::vfio_migrate::auto_picks_vfio_migrate;
use rdmamig_proto::text::error_chain;

/// The strategy a move runs, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice {
    /// `reconnect`, `naive` or `vfio-migrate` (never `auto`).
    pub strategy: Strategy,
    /// Why, in words.
    pub reason: String,
}

impl Choice {
    /// The strategy the plan asked for, which needs no question to VFIO.
    pub fn asked(strategy: Strategy) -> Choice {
        Choice {
            strategy,
            reason: "asked for".into(),
        }
    }
}

/// What the source's function can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FunctionSupport {
    /// Not in this host's pool.
    Unknown,
    /// An emulated NIC: no VFIO device to ask.
    Emulated,
    /// VFIO's answer: the migration flags, `None` when the device cannot migrate.
    Vfio {
        /// The PCI address.
        pci: String,
        /// query_migration_support's flags.
        flags: Option<u64>,
    },
    /// VFIO could not be asked (no VFIO on the host, device not bound to vfio-pci, ...).
    VfioFailed {
        /// The PCI address.
        pci: String,
        /// Why.
        error: String,
    },
}

impl FunctionSupport {
    /// Asks VFIO about function `name` of `pool`.
    pub fn query(pool: &Pool, name: &str) -> FunctionSupport {
        match pool.attachment(name) {
            None => FunctionSupport::Unknown,
            Some(Attachment::Emulated { .. }) => FunctionSupport::Emulated,
            Some(Attachment::Vfio { pci }) => {
                match VfioFunction::open(&Sysfs::default(), &pci)
                    .and_then(|f| f.migration_support())
                {
                    Ok(flags) => FunctionSupport::Vfio { pci, flags },
                    Err(e) => FunctionSupport::VfioFailed {
                        pci,
                        error: error_chain(&e),
                    },
                }
            }
        }
    }

    /// Why this function cannot move its state through VFIO; `None` when it can.
    fn why_not(&self) -> Option<String> {
        match self {
            FunctionSupport::Unknown => Some("is not in this host's pool".into()),
            FunctionSupport::Emulated => Some("is an emulated NIC, not a VFIO device".into()),
            FunctionSupport::Vfio { flags, .. } if auto_picks_vfio_migrate(*flags) => None,
            FunctionSupport::Vfio { pci, flags: None } => Some(format!(
                "({pci}) does not support VFIO migration (query_migration_support: not supported)"
            )),
            FunctionSupport::Vfio {
                pci,
                flags: Some(flags),
            } => Some(format!(
                "({pci}) does not support VFIO migration's STOP_COPY (flags {flags:#x})"
            )),
            FunctionSupport::VfioFailed { pci, error } => {
                Some(format!("({pci}) could not be asked through VFIO: {error}"))
            }
        }
    }
}

/// Why a move cannot run the strategy it asked for.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum StrategyError {
    /// `vfio-migrate` without the function whose state would move.
    #[error(
        "strategy vfio-migrate needs --source-function: the passthrough function whose device \
         state the VMM moves"
    )]
    NoFunction,
    /// The function cannot move its state.
    #[error("strategy vfio-migrate refused: function {function} {why}")]
    Unsupported {
        /// The function.
        function: String,
        /// Why.
        why: String,
    },
}

/// Decides the strategy for `asked`, given the source's function and what it can do.
pub fn choose(
    asked: Strategy,
    function: Option<(&str, &FunctionSupport)>,
) -> Result<Choice, StrategyError> {
    let verdict = function.map(|(name, support)| (name, support.why_not()));
    match (asked, verdict) {
        (Strategy::Reconnect | Strategy::Bridge | Strategy::Naive, _) => Ok(Choice::asked(asked)),
        (Strategy::VfioMigrate, None) => Err(StrategyError::NoFunction),
        (Strategy::VfioMigrate, Some((function, Some(why)))) => Err(StrategyError::Unsupported {
            function: function.into(),
            why,
        }),
        (Strategy::VfioMigrate | Strategy::Auto, Some((function, None))) => Ok(Choice {
            strategy: Strategy::VfioMigrate,
            reason: format!("function {function} supports VFIO migration (STOP_COPY)"),
        }),
        (Strategy::Auto, Some((function, Some(why)))) => Ok(Choice {
            strategy: Strategy::Reconnect,
            reason: format!("auto picked reconnect: function {function} {why}"),
        }),
        (Strategy::Auto, None) => Ok(Choice {
            strategy: Strategy::Reconnect,
            reason: "auto picked reconnect: no --source-function names the passthrough \
                     function, so VFIO cannot be asked whether it migrates its state"
                .into(),
        }),
    }
}

/// Decides the strategy of `plan`, asking VFIO about its source function in `pool`.
pub fn choose_for(plan: &MovePlan, pool: &Pool) -> Result<Choice, StrategyError> {
    let support = plan
        .source_function
        .as_deref()
        .map(|name| (name, FunctionSupport::query(pool, name)));
    choose(
        plan.strategy,
        support.as_ref().map(|(name, support)| (*name, support)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_migrate::{MIGRATION_P2P, MIGRATION_STOP_COPY};

    fn vfio(flags: Option<u64>) -> FunctionSupport {
        FunctionSupport::Vfio {
            pci: "0000:3b:00.2".into(),
            flags,
        }
    }

    #[test]
    fn auto_picks_vfio_migrate_only_for_a_function_with_stop_copy() {
        let supported = vfio(Some(MIGRATION_STOP_COPY | MIGRATION_P2P));
        let choice = choose(Strategy::Auto, Some(("vf0", &supported))).unwrap();
        assert_eq!(choice.strategy, Strategy::VfioMigrate);
        for (support, why) in [
            (vfio(None), "does not support VFIO migration"),
            (vfio(Some(MIGRATION_P2P)), "STOP_COPY (flags 0x2)"),
            (
                FunctionSupport::Emulated,
                "is an emulated NIC, not a VFIO device",
            ),
            (FunctionSupport::Unknown, "is not in this host's pool"),
            (
                FunctionSupport::VfioFailed {
                    pci: "0000:3b:00.2".into(),
                    error: "this host has no VFIO".into(),
                },
                "could not be asked through VFIO: this host has no VFIO",
            ),
        ] {
            let choice = choose(Strategy::Auto, Some(("vf0", &support))).unwrap();
            assert_eq!(choice.strategy, Strategy::Reconnect, "{support:?}");
            assert!(
                choice
                    .reason
                    .starts_with("auto picked reconnect: function vf0 "),
                "{choice:?}"
            );
            assert!(choice.reason.contains(why), "{choice:?}");
            let refused = choose(Strategy::VfioMigrate, Some(("vf0", &support))).unwrap_err();
            assert!(refused.to_string().contains(why), "{refused}");
        }
        let none = choose(Strategy::Auto, None).unwrap();
        assert_eq!(none.strategy, Strategy::Reconnect);
        assert!(none.reason.contains("no --source-function"), "{none:?}");
    }

    #[test]
    fn vfio_migrate_is_refused_without_a_function_that_supports_it() {
        assert_eq!(
            choose(Strategy::VfioMigrate, None),
            Err(StrategyError::NoFunction)
        );
        assert_eq!(
            choose(
                Strategy::VfioMigrate,
                Some(("tap0", &FunctionSupport::Emulated))
            )
            .unwrap_err()
            .to_string(),
            "strategy vfio-migrate refused: function tap0 is an emulated NIC, not a VFIO device"
        );
        let supported = vfio(Some(MIGRATION_STOP_COPY));
        assert_eq!(
            choose(Strategy::VfioMigrate, Some(("vf0", &supported)))
                .unwrap()
                .strategy,
            Strategy::VfioMigrate
        );
        // What was asked for explicitly runs as asked.
        for asked in [Strategy::Reconnect, Strategy::Bridge, Strategy::Naive] {
            assert_eq!(choose(asked, None).unwrap().strategy, asked);
        }
    }
}
