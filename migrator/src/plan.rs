//! What a move is asked to do: the plan a client hands the daemon.
//!
//! The plan is complete in itself (both VMMs, the device to detach, the device to attach, the
//! migration URI, the strategy, the deadlines), so the daemon needs no other configuration to
//! run a move, and the report can repeat the plan it ran.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use rdmamig_vmm::DeviceSpec;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::machine::{Phase, UnknownPhase};

/// How the move treats the guest's RDMA connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Quiesce every connection through the guest agent, move, and resume them.
    Reconnect,
    /// The baseline operators use today: unplug, migrate, plug; no agent, no quiesce.
    Naive,
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Strategy::Reconnect => "reconnect",
            Strategy::Naive => "naive",
        })
    }
}

/// One end of the move: a VMM and (for strategies that use it) its agent channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The QEMU QMP socket.
    pub qmp: PathBuf,
    /// The agent's virtio-serial chardev socket.
    pub agent: Option<PathBuf>,
}

/// Per-phase deadlines, in ms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deadlines(BTreeMap<Phase, u64>);

impl Default for Deadlines {
    /// Generous for the test bed's TCG guests: a migration of an idle 512 MiB guest takes
    /// under a second, a quiesce a few hundred ms, a hot-unplug 0.1-0.2 s (TESTBED.md).
    fn default() -> Self {
        Deadlines(BTreeMap::from([
            (Phase::Prepare, 10_000),
            (Phase::Quiesce, 10_000),
            (Phase::Detach, 5_000),
            (Phase::Migrate, 60_000),
            (Phase::Attach, 5_000),
            (Phase::Resume, 20_000),
            (Phase::Rollback, 30_000),
        ]))
    }
}

impl Deadlines {
    /// The deadline of `phase`.
    pub fn of(&self, phase: Phase) -> Duration {
        let ms = self
            .0
            .get(&phase)
            .copied()
            .or_else(|| Deadlines::default().0.get(&phase).copied())
            .unwrap_or(0);
        Duration::from_millis(ms)
    }

    /// Applies one `phase=ms` override.
    pub fn set(&mut self, item: &str) -> Result<(), PlanError> {
        let bad = |reason: String| PlanError::Deadline {
            item: item.into(),
            reason,
        };
        let (phase, ms) = item
            .split_once('=')
            .ok_or_else(|| bad("expected phase=ms".into()))?;
        let phase: Phase = phase
            .trim()
            .parse()
            .map_err(|e: UnknownPhase| bad(e.to_string()))?;
        if phase.is_final() {
            return Err(bad(format!("{phase} has no deadline")));
        }
        let ms: u64 = ms
            .trim()
            .parse()
            .map_err(|e| bad(format!("{ms:?} is not a number of ms: {e}")))?;
        if ms == 0 {
            return Err(bad("a deadline of 0 ms can never be met".into()));
        }
        self.0.insert(phase, ms);
        Ok(())
    }
}

/// A move, as a client asks for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MovePlan {
    /// The VM's name (for messages and the report).
    pub vm: String,
    /// Where the VM runs now.
    pub source: Endpoint,
    /// The VMM process that receives it (started with `-incoming defer`), on the host of
    /// `destination_migrator` when that is given.
    pub destination: Endpoint,
    /// The migrator that does the destination's duties (a `[[peer.known]]` name or
    /// `host:port`), over mutual TLS; `None`: this host's daemon does them itself.
    #[serde(default)]
    pub destination_migrator: Option<String>,
    /// The device to unplug on the source (the RDMA NIC).
    pub detach: String,
    /// The device to plug on the destination.
    pub attach: DeviceSpec,
    /// The device to plug back on the source if the move rolls back after the detach;
    /// `attach` when not given (the destination runs the VM's own configuration).
    #[serde(default)]
    pub reattach: Option<DeviceSpec>,
    /// Plug a function from the destination's pool (reserved at prepare) instead of
    /// `attach` as it is; `attach` then gives the properties the function does not (id,
    /// bus, MAC).
    #[serde(default)]
    pub from_pool: bool,
    /// The source's pool function the detached device is: after the detach it is reset
    /// (VFIO), and once the move is done it returns to the pool, or is quarantined if the
    /// reset failed.
    #[serde(default)]
    pub source_function: Option<String>,
    /// Where the migration stream goes (`unix:/path` or `tcp:host:port`).
    pub via: String,
    /// How connections are treated.
    pub strategy: Strategy,
    /// Per-phase deadlines.
    pub deadlines: Deadlines,
}

/// A plan that cannot run.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PlanError {
    /// A `--deadline` item is not `phase=ms` with a working phase and a positive number.
    #[error("bad deadline {item:?}: {reason}")]
    Deadline {
        /// The item.
        item: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The strategy needs an agent channel the plan does not give.
    #[error("strategy {strategy} needs the {side} agent socket")]
    MissingAgent {
        /// The strategy.
        strategy: Strategy,
        /// `source` or `destination`.
        side: &'static str,
    },
    /// The migration URI is not one QEMU takes.
    #[error("migration URI {uri:?} is not unix:PATH or tcp:HOST:PORT")]
    Via {
        /// The URI.
        uri: String,
    },
    /// A required field is empty.
    #[error("the plan has an empty {field}")]
    Empty {
        /// The field.
        field: &'static str,
    },
}

impl MovePlan {
    /// The device a rollback plugs back on the source.
    pub fn reattach_spec(&self) -> &DeviceSpec {
        self.reattach.as_ref().unwrap_or(&self.attach)
    }

    /// Checks what can be checked before touching any VMM.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.vm.is_empty() {
            return Err(PlanError::Empty { field: "vm name" });
        }
        if self.detach.is_empty() {
            return Err(PlanError::Empty {
                field: "device to detach",
            });
        }
        let via_ok = self
            .via
            .strip_prefix("unix:")
            .or_else(|| self.via.strip_prefix("tcp:"))
            .is_some_and(|rest| !rest.is_empty());
        if !via_ok {
            return Err(PlanError::Via {
                uri: self.via.clone(),
            });
        }
        if self.strategy == Strategy::Reconnect {
            for (side, endpoint) in [("source", &self.source), ("destination", &self.destination)] {
                if endpoint.agent.is_none() {
                    return Err(PlanError::MissingAgent {
                        strategy: self.strategy,
                        side,
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn plan() -> MovePlan {
        MovePlan {
            vm: "vm1".into(),
            source: Endpoint {
                qmp: "/s/qmp".into(),
                agent: Some("/s/agent".into()),
            },
            destination: Endpoint {
                qmp: "/d/qmp".into(),
                agent: Some("/d/agent".into()),
            },
            destination_migrator: None,
            detach: "nic0".into(),
            attach: DeviceSpec::parse("driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1").unwrap(),
            reattach: None,
            from_pool: false,
            source_function: None,
            via: "unix:/d/mig.sock".into(),
            strategy: Strategy::Reconnect,
            deadlines: Deadlines::default(),
        }
    }

    #[test]
    fn deadlines_parse_and_reject() {
        let mut d = Deadlines::default();
        d.set("detach=1500").unwrap();
        assert_eq!(d.of(Phase::Detach), Duration::from_millis(1500));
        assert_eq!(d.of(Phase::Migrate), Duration::from_secs(60));
        for bad in ["detach", "unplug=5", "detach=soon", "detach=0", "done=5"] {
            assert!(
                matches!(d.set(bad), Err(PlanError::Deadline { .. })),
                "{bad}"
            );
        }
        assert!(Phase::WORKING
            .iter()
            .all(|p| Deadlines::default().of(*p) > Duration::ZERO));
    }

    #[test]
    fn validation() {
        assert_eq!(plan().validate(), Ok(()));
        let mut p = plan();
        p.destination.agent = None;
        assert_eq!(
            p.validate(),
            Err(PlanError::MissingAgent {
                strategy: Strategy::Reconnect,
                side: "destination"
            })
        );
        p.strategy = Strategy::Naive;
        assert_eq!(p.validate(), Ok(()));
        p.via = "/d/mig.sock".into();
        assert!(matches!(p.validate(), Err(PlanError::Via { .. })));
        p.via = "tcp:127.0.0.1:4444".into();
        p.detach.clear();
        assert!(matches!(p.validate(), Err(PlanError::Empty { .. })));
    }

    #[test]
    fn plan_round_trips_through_json() {
        let p = plan();
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<MovePlan>(&json).unwrap(), p);
    }
}
