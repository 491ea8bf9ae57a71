//! Which strategy a move runs: `auto` decides from what the source VMM, the source's
//! function and the destination VMM say about the device moving with the VM, and `hot` is
//! refused, before anything changes, for a device that cannot.
//!
//! The evidence, gathered when the move is admitted ([`gather`]):
//! - the source VMM's migration blockers (QEMU lists a device without migration support,
//!   such as a VF on plain vfio-pci, with its own words);
//! - the source's function (`--source-function`), from sysfs: an emulated NIC migrates as
//!   the VMM's device model; a VF migrates only on a VFIO variant driver that implements
//!   migration (mlx5_vfio_pci, ...), never on plain vfio-pci;
//! - whether the destination VMM has the device (a `hot` move plugs nothing: a QEMU
//!   destination must have been started with it), or is handed a VF from the destination's
//!   pool with its receive (Cloud Hypervisor with `--from-pool`).
//!
//! Never by opening the function's VFIO group: the source VMM holds it, and the kernel
//! refuses a second opener.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::backends::Backends;
use crate::plan::{MigrationBy, MovePlan, Strategy};
use crate::pool::{Attachment, Pool};
use crate::vfio::Sysfs;
use rdmamig_proto::text::error_chain;

/// VFIO variant drivers that implement the migration uAPI (Linux 6.x): a VF bound to one
/// can move its device state with the VM.
pub const MIGRATION_DRIVERS: [&str; 5] = [
    "mlx5_vfio_pci",
    "hisi_acc_vfio_pci",
    "pds_vfio_pci",
    "virtio_vfio_pci",
    "qat_vfio_pci",
];

/// The strategy a move runs, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice {
    /// `reconnect`, `bridge`, `naive` or `hot` (never `auto`).
    pub strategy: Strategy,
    /// Why, in words.
    pub reason: String,
}

impl Choice {
    /// The strategy the plan asked for, which needs no evidence.
    pub fn asked(strategy: Strategy) -> Choice {
        Choice {
            strategy,
            reason: "asked for".into(),
        }
    }
}

/// What the source's function is, as this host's pool and sysfs say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FunctionSupport {
    /// Not in this host's pool.
    Unknown,
    /// An emulated NIC: the VMM migrates its device model.
    Emulated,
    /// A passthrough function and the driver it is bound to (`None`: none).
    Vfio {
        /// The PCI address.
        pci: String,
        /// The bound driver's name.
        driver: Option<String>,
    },
}

impl FunctionSupport {
    /// Reads function `name` of `pool` (sysfs only).
    pub fn query(pool: &Pool, name: &str, sysfs: &Sysfs) -> FunctionSupport {
        match pool.attachment(name) {
            None => FunctionSupport::Unknown,
            Some(Attachment::Emulated { .. }) => FunctionSupport::Emulated,
            Some(Attachment::Vfio { pci }) => {
                let driver = sysfs.driver(&pci).ok().flatten();
                FunctionSupport::Vfio { pci, driver }
            }
        }
    }

    /// Why this function cannot move with the VM; `None` when it can.
    fn why_not(&self) -> Option<String> {
        match self {
            FunctionSupport::Unknown => Some("is not in this host's pool".into()),
            FunctionSupport::Emulated => None,
            FunctionSupport::Vfio {
                driver: Some(driver),
                ..
            } if MIGRATION_DRIVERS.contains(&driver.as_str()) => None,
            FunctionSupport::Vfio {
                pci,
                driver: Some(driver),
            } if driver == "vfio-pci" => Some(format!(
                "({pci}) is bound to plain vfio-pci, which cannot migrate a device's state: \
                 bind it to its VFIO variant driver ({})",
                MIGRATION_DRIVERS.join(", ")
            )),
            FunctionSupport::Vfio {
                pci,
                driver: Some(driver),
            } => Some(format!(
                "({pci}) is bound to {driver}, not to a VFIO driver that migrates ({})",
                MIGRATION_DRIVERS.join(", ")
            )),
            FunctionSupport::Vfio { pci, driver: None } => {
                Some(format!("({pci}) is bound to no driver"))
            }
        }
    }
}

/// What is known, when a move is admitted, of its device moving with the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// The source VMM's migration blockers, or why it could not tell.
    pub blockers: Result<Vec<String>, String>,
    /// The source's function (`--source-function`) and what it is.
    pub function: Option<(String, FunctionSupport)>,
    /// Where the destination's device comes from.
    pub destination: DestinationDevice,
}

/// Where the device of a `hot` move's destination comes from: a `hot` move plugs nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestinationDevice {
    /// The destination VMM was started with the device (`--detach`'s id).
    Has,
    /// The destination VMM has no such device.
    Lacks,
    /// The destination's pool hands the receiving VMM a VF with its receive (Cloud
    /// Hypervisor's `vfio_fds`, with `--from-pool`).
    HandedOver,
    /// Nobody asked (another migrator's destination, or a workflow's).
    NotAsked,
}

impl Evidence {
    /// Why the device cannot move with the VM, when something says so.
    fn refusal(&self, device: &str) -> Option<String> {
        if let Ok(blockers) = &self.blockers {
            if !blockers.is_empty() {
                return Some(format!(
                    "the source VMM blocks the migration: {}",
                    blockers.join("; ")
                ));
            }
        }
        if let Some((name, support)) = &self.function {
            if let Some(why) = support.why_not() {
                return Some(format!("function {name} {why}"));
            }
        }
        if self.destination == DestinationDevice::Lacks {
            return Some(format!(
                "the destination VMM has no device {device}: start it with the same device, \
                 which a hot move migrates instead of plugging"
            ));
        }
        None
    }

    /// Why `auto` cannot be sure the device moves, when nothing refuses it.
    fn doubt(&self) -> Option<String> {
        let vmm_says = matches!(&self.blockers, Ok(b) if b.is_empty());
        let function_says = self.function.as_ref().is_some_and(|(_, s)| {
            matches!(s, FunctionSupport::Vfio { .. }) && s.why_not().is_none()
        });
        if !vmm_says && !function_says {
            let why = match &self.blockers {
                Err(e) => e.clone(),
                Ok(_) => "it said nothing".into(),
            };
            return Some(format!(
                "neither the source VMM ({why}) nor a --source-function on a migration \
                 driver says the device can move with the VM"
            ));
        }
        if self.destination == DestinationDevice::NotAsked {
            return Some(
                "the destination VMM was not asked whether it has the device (another \
                 migrator's, or a workflow's): ask for --strategy hot to move it anyway"
                    .into(),
            );
        }
        None
    }
}

/// Why a move cannot run the strategy it asked for.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum StrategyError {
    /// The device cannot move with the VM.
    #[error("strategy hot refused: {why}")]
    Unsupported {
        /// Why.
        why: String,
    },
}

/// Decides the strategy for `asked`, given what is known of `device` (the plan's
/// `--detach`) moving with the VM.
pub fn choose(asked: Strategy, device: &str, evidence: &Evidence) -> Result<Choice, StrategyError> {
    match asked {
        Strategy::Reconnect | Strategy::Bridge | Strategy::Naive => Ok(Choice::asked(asked)),
        Strategy::Hot => match evidence.refusal(device) {
            Some(why) => Err(StrategyError::Unsupported { why }),
            None => Ok(Choice::asked(asked)),
        },
        Strategy::Auto => Ok(
            match evidence.refusal(device).or_else(|| evidence.doubt()) {
                Some(why) => Choice {
                    strategy: Strategy::Reconnect,
                    reason: format!("auto picked reconnect: {why}"),
                },
                None => Choice {
                    strategy: Strategy::Hot,
                    reason: format!(
                        "auto picked hot: nothing blocks the migration of {device}, and {}",
                        match evidence.destination {
                            DestinationDevice::HandedOver =>
                                "the destination's pool hands the receiving VMM a VF for it",
                            _ => "the destination VMM has it",
                        }
                    ),
                },
            },
        ),
    }
}

/// Gathers the evidence for `plan` from its VMMs (asked for the blockers and the device,
/// nothing changed) and this host's `pool`. Only `hot` and `auto` need it.
pub async fn gather(plan: &MovePlan, backends: &dyn Backends, pool: &Pool) -> Evidence {
    let blockers = match backends.connect(&plan.source).await {
        Ok(vmm) => vmm.migration_blockers().await.map_err(|e| error_chain(&e)),
        Err(e) => Err(error_chain(&e)),
    };
    let function = plan.source_function.as_deref().map(|name| {
        (
            name.to_string(),
            FunctionSupport::query(pool, name, &Sysfs::default()),
        )
    });
    let local_destination = plan
        .destination
        .as_ref()
        .filter(|_| plan.destination_migrator.is_none() && plan.migration == MigrationBy::Migrator);
    let destination = match local_destination {
        _ if plan.hands_pool_vf_to_receiver() => DestinationDevice::HandedOver,
        Some(endpoint) => match backends.connect(endpoint).await {
            Ok(vmm) => match vmm.has_device(&plan.detach).await {
                Ok(true) => DestinationDevice::Has,
                Ok(false) => DestinationDevice::Lacks,
                Err(_) => DestinationDevice::NotAsked,
            },
            Err(_) => DestinationDevice::NotAsked,
        },
        None => DestinationDevice::NotAsked,
    };
    Evidence {
        blockers,
        function,
        destination,
    }
}

/// Decides the strategy of `plan`, gathering the evidence when it needs any.
pub async fn choose_for(
    plan: &MovePlan,
    backends: &dyn Backends,
    pool: &Pool,
) -> Result<Choice, StrategyError> {
    match plan.strategy {
        Strategy::Hot | Strategy::Auto => {
            let evidence = gather(plan, backends, pool).await;
            choose(plan.strategy, &plan.detach, &evidence)
        }
        asked => Ok(Choice::asked(asked)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vf(driver: Option<&str>) -> FunctionSupport {
        FunctionSupport::Vfio {
            pci: "0000:3b:00.2".into(),
            driver: driver.map(String::from),
        }
    }

    fn evidence(blockers: &[&str], function: Option<FunctionSupport>) -> Evidence {
        Evidence {
            blockers: Ok(blockers.iter().map(|b| b.to_string()).collect()),
            function: function.map(|f| ("vf0".to_string(), f)),
            destination: DestinationDevice::Has,
        }
    }

    #[test]
    fn a_qemu_blocker_refuses_hot_and_auto_says_so() {
        let blocked = evidence(
            &["0000:3b:00.2: VFIO migration is not supported in kernel"],
            None,
        );
        let refused = choose(Strategy::Hot, "rdma0", &blocked).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "strategy hot refused: the source VMM blocks the migration: 0000:3b:00.2: VFIO \
             migration is not supported in kernel"
        );
        let auto = choose(Strategy::Auto, "rdma0", &blocked).unwrap();
        assert_eq!(auto.strategy, Strategy::Reconnect);
        assert!(
            auto.reason.contains("VFIO migration is not supported"),
            "{auto:?}"
        );
    }

    #[test]
    fn a_vf_moves_only_on_a_variant_driver_that_migrates() {
        for driver in MIGRATION_DRIVERS {
            let ok = evidence(&[], Some(vf(Some(driver))));
            assert_eq!(
                choose(Strategy::Auto, "rdma0", &ok).unwrap().strategy,
                Strategy::Hot
            );
            assert_eq!(
                choose(Strategy::Hot, "rdma0", &ok).unwrap().strategy,
                Strategy::Hot
            );
        }
        for (support, why) in [
            (vf(Some("vfio-pci")), "plain vfio-pci"),
            (
                vf(Some("mlx5_core")),
                "bound to mlx5_core, not to a VFIO driver",
            ),
            (vf(None), "bound to no driver"),
            (FunctionSupport::Unknown, "is not in this host's pool"),
        ] {
            let e = evidence(&[], Some(support));
            let refused = choose(Strategy::Hot, "rdma0", &e).unwrap_err().to_string();
            assert!(refused.contains(why), "{refused}");
            assert!(refused.contains("function vf0"), "{refused}");
            let auto = choose(Strategy::Auto, "rdma0", &e).unwrap();
            assert_eq!(auto.strategy, Strategy::Reconnect);
            assert!(auto.reason.contains(why), "{auto:?}");
        }
        // An emulated NIC is the VMM's own device model: it moves.
        let emulated = evidence(&[], Some(FunctionSupport::Emulated));
        assert_eq!(
            choose(Strategy::Auto, "rdma0", &emulated).unwrap().strategy,
            Strategy::Hot
        );
    }

    #[test]
    fn auto_needs_a_word_from_the_vmm_or_the_driver_and_the_destinations_device() {
        // Cloud Hypervisor cannot list blockers; without a function on a migration driver
        // nothing says the device moves.
        let silent = Evidence {
            blockers: Err("Cloud Hypervisor cannot tell".into()),
            function: None,
            destination: DestinationDevice::Has,
        };
        let auto = choose(Strategy::Auto, "rdma0", &silent).unwrap();
        assert_eq!(auto.strategy, Strategy::Reconnect);
        assert!(
            auto.reason.contains("Cloud Hypervisor cannot tell"),
            "{auto:?}"
        );
        // Asked for explicitly, nothing refuses it.
        assert_eq!(
            choose(Strategy::Hot, "rdma0", &silent).unwrap().strategy,
            Strategy::Hot
        );
        let with_driver = Evidence {
            function: Some(("vf0".into(), vf(Some("mlx5_vfio_pci")))),
            ..silent
        };
        assert_eq!(
            choose(Strategy::Auto, "rdma0", &with_driver)
                .unwrap()
                .strategy,
            Strategy::Hot
        );
        // The destination not asked (another migrator's): auto stays with reconnect.
        let remote = Evidence {
            destination: DestinationDevice::NotAsked,
            ..evidence(&[], None)
        };
        let auto = choose(Strategy::Auto, "rdma0", &remote).unwrap();
        assert_eq!(auto.strategy, Strategy::Reconnect);
        assert!(auto.reason.contains("not asked"), "{auto:?}");
        // The destination without the device: refused.
        let missing = Evidence {
            destination: DestinationDevice::Lacks,
            ..evidence(&[], None)
        };
        let refused = choose(Strategy::Hot, "rdma0", &missing)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("has no device rdma0"), "{refused}");
    }

    #[test]
    fn auto_counts_a_vf_handed_to_the_receiving_vmm_as_the_destinations_device() {
        // Cloud Hypervisor: no blockers to ask, the source's VF on a migration driver, and
        // the destination's pool handing the receiver a VF.
        let handed = Evidence {
            blockers: Err("Cloud Hypervisor cannot tell".into()),
            function: Some(("vf0".into(), vf(Some("mlx5_vfio_pci")))),
            destination: DestinationDevice::HandedOver,
        };
        let auto = choose(Strategy::Auto, "rdma0", &handed).unwrap();
        assert_eq!(auto.strategy, Strategy::Hot, "{auto:?}");
        assert!(
            auto.reason.contains("hands the receiving VMM a VF"),
            "{auto:?}"
        );
        // The hand-over says nothing of the source: a plain vfio-pci VF still refuses.
        let plain = Evidence {
            function: Some(("vf0".into(), vf(Some("vfio-pci")))),
            ..handed
        };
        let auto = choose(Strategy::Auto, "rdma0", &plain).unwrap();
        assert_eq!(auto.strategy, Strategy::Reconnect, "{auto:?}");
    }

    #[test]
    fn what_was_asked_for_explicitly_needs_no_evidence() {
        let blocked = evidence(&["anything"], Some(vf(Some("vfio-pci"))));
        for asked in [Strategy::Reconnect, Strategy::Bridge, Strategy::Naive] {
            assert_eq!(choose(asked, "rdma0", &blocked).unwrap().strategy, asked);
        }
    }
}
