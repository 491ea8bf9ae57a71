//! What a move is asked to do: the plan a client hands the daemon.
//!
//! The plan is complete in itself (both VMMs, the device to detach, the device to attach, the
//! migration URI, the strategy, the deadlines), so the daemon needs no other configuration to
//! run a move, and the report can repeat the plan it ran.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rdmamig_proto::agent::QuiesceMode;
use rdmamig_vmm::{DeviceSpec, MigrationLimits};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::machine::{Phase, UnknownPhase};

/// How the move treats the guest's RDMA connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Quiesce every connection through the guest agent, move, and resume them.
    Reconnect,
    /// As reconnect, but connections with a TCP bridge (over a NIC that moves with the VM)
    /// carry their messages over it from the quiesce until the RDMA path is back.
    Bridge,
    /// The baseline operators use today: unplug, migrate, plug; no agent, no quiesce.
    Naive,
    /// The device stays plugged and the VMM moves its state with the VM (an emulated NIC,
    /// or a VF on a migration-capable variant driver): every connection pauses at a
    /// sequence boundary right before the switchover, keeps its QP, and is confirmed on it
    /// after the move. `vfio-migrate` is its former name.
    #[serde(alias = "vfio_migrate")]
    #[value(alias = "vfio-migrate")]
    Hot,
    /// hot when the source VMM, the source's function and the destination VMM say the
    /// device can move with the VM, reconnect otherwise; the report says why.
    Auto,
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Strategy::Reconnect => "reconnect",
            Strategy::Bridge => "bridge",
            Strategy::Naive => "naive",
            Strategy::Hot => "hot",
            Strategy::Auto => "auto",
        })
    }
}

/// What a strategy does in a move: the one table every phase reads, instead of checks on
/// the strategy's name scattered through the phases. `auto` is decided at prepare, before
/// any phase reads this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Steps {
    /// Why the guest's connections are left alone, when they are (prepare lists nothing,
    /// quiesce and resume are skipped, a rollback resumes nothing).
    pub uncoordinated: Option<&'static str>,
    /// What the quiesce does to each connection (a `hot` one pauses inside the migrate
    /// phase, right before the switchover).
    pub quiesce: QuiesceMode,
    /// Why the device stays plugged and moves with the VM, when it does (nothing is
    /// reserved, detached, reset, given back or re-attached).
    pub device_moves: Option<&'static str>,
}

impl Strategy {
    /// The table of what this strategy does.
    pub fn steps(self) -> Steps {
        let swap = Steps {
            uncoordinated: None,
            quiesce: QuiesceMode::Release,
            device_moves: None,
        };
        match self {
            Strategy::Reconnect | Strategy::Auto => swap,
            Strategy::Bridge => Steps {
                quiesce: QuiesceMode::Bridge,
                ..swap
            },
            Strategy::Naive => Steps {
                uncoordinated: Some("strategy naive: connections are not coordinated"),
                ..swap
            },
            Strategy::Hot => Steps {
                quiesce: QuiesceMode::Hot,
                device_moves: Some(
                    "strategy hot: the device stays plugged; the VMM moves its state with the VM",
                ),
                ..swap
            },
        }
    }
}

/// What a move does with programs in the guest that hold an RDMA device without rdmamig's
/// library (unmanaged programs): the move would break them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum UnmanagedPolicy {
    /// Refuse the move at prepare, before anything changes, naming the programs (and roll
    /// back, before the unplug, if one appeared since).
    #[default]
    Refuse,
    /// End them (SIGTERM, then SIGKILL after 1 s) right before the unplug; if the unplug
    /// still misses its deadline, make whatever holds the device let go and wait again.
    Release,
    /// Move anyway; the report marks each of them as broken by the move.
    Ignore,
}

impl std::fmt::Display for UnmanagedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UnmanagedPolicy::Refuse => "refuse",
            UnmanagedPolicy::Release => "release",
            UnmanagedPolicy::Ignore => "ignore",
        })
    }
}

/// Who migrates the VM between the detach and the attach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationBy {
    /// The migrator tells the source VMM to migrate and follows it (`rdmamig migrate`).
    #[default]
    Migrator,
    /// A live-migration workflow (libvirt, a script around `ch-remote`): `pre-migrate` runs
    /// the move to its detach and hands it over; the workflow migrates; `post-migrate`
    /// confirms the arrival and runs the rest, from the same journal.
    Workflow,
}

/// One end of the move: which VMM runs the VM, how to reach it, and (for strategies that
/// use it) how to reach the guest agent through it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "vmm", rename_all = "snake_case")]
pub enum Endpoint {
    /// QEMU, driven over QMP; the agent over a virtio-serial port.
    Qemu {
        /// The QMP socket.
        qmp: PathBuf,
        /// The agent's virtio-serial chardev socket.
        agent: Option<PathBuf>,
    },
    /// Cloud Hypervisor, driven over its REST API; the agent over hybrid vsock.
    CloudHypervisor {
        /// `--api-socket path=PATH`.
        api_socket: PathBuf,
        /// `--event-monitor path=PATH`: how a migration's outcome is known at once (without
        /// it, only once the source has lost the VM).
        event_monitor: Option<PathBuf>,
        /// `--vsock socket=PATH`: the hybrid vsock socket the agent is reached through.
        vsock: Option<PathBuf>,
        /// The agent's vsock port in the guest.
        agent_port: u32,
        /// `--log-file PATH`: where the VMM writes a failed migration's cause (its event
        /// carries none), quoted in the failure.
        #[serde(default)]
        log_file: Option<PathBuf>,
        /// Mutual TLS for the migration stream (`tcp:` only): the folder with this end's
        /// CA and certificate, a source's client one or a destination's server one
        /// (`tls_dir` of `vm.send-migration` and `vm.receive-migration`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tls_dir: Option<PathBuf>,
    },
}

impl Endpoint {
    /// The VMM's control socket (for messages).
    pub fn control_socket(&self) -> &Path {
        match self {
            Endpoint::Qemu { qmp, .. } => qmp,
            Endpoint::CloudHypervisor { api_socket, .. } => api_socket,
        }
    }

    /// Whether the guest agent can be reached through this end.
    pub fn has_agent(&self) -> bool {
        match self {
            Endpoint::Qemu { agent, .. } => agent.is_some(),
            Endpoint::CloudHypervisor { vsock, .. } => vsock.is_some(),
        }
    }
}

/// One end of a move as command-line flags give it: exactly one VMM control socket and the
/// agent channel that goes with that VMM.
#[derive(Debug, Clone, Default)]
pub struct EndpointFlags {
    /// QEMU's QMP socket.
    pub qmp: Option<PathBuf>,
    /// Cloud Hypervisor's API socket.
    pub api_socket: Option<PathBuf>,
    /// QEMU: the agent's virtio-serial socket.
    pub agent: Option<PathBuf>,
    /// Cloud Hypervisor: the hybrid vsock socket.
    pub vsock: Option<PathBuf>,
    /// Cloud Hypervisor: the event monitor file.
    pub event_monitor: Option<PathBuf>,
    /// Cloud Hypervisor: the agent's vsock port.
    pub agent_port: u32,
    /// Cloud Hypervisor: its log file.
    pub log_file: Option<PathBuf>,
    /// Cloud Hypervisor: its TLS folder for the migration stream.
    pub tls_dir: Option<PathBuf>,
}

impl EndpointFlags {
    /// The endpoint the flags name; `side` (`source`, `destination`) is for the message.
    pub fn endpoint(self, side: &'static str) -> Result<Endpoint, PlanError> {
        let mismatch = |flag: &'static str, vmm: &'static str| PlanError::Flags {
            side,
            reason: format!("{flag} is for {vmm} endpoints"),
        };
        match (self.qmp, self.api_socket) {
            (Some(qmp), None) => {
                if self.vsock.is_some() {
                    return Err(mismatch(
                        "a hybrid vsock socket",
                        "Cloud Hypervisor (QEMU's agent is on virtio-serial)",
                    ));
                }
                if self.event_monitor.is_some() {
                    return Err(mismatch("an event monitor", "Cloud Hypervisor"));
                }
                if self.log_file.is_some() {
                    return Err(mismatch("a log file", "Cloud Hypervisor"));
                }
                if self.tls_dir.is_some() {
                    return Err(mismatch(
                        "a TLS folder",
                        "Cloud Hypervisor (QEMU's migration TLS is a tls-creds object)",
                    ));
                }
                Ok(Endpoint::Qemu {
                    qmp,
                    agent: self.agent,
                })
            }
            (None, Some(api_socket)) => {
                if self.agent.is_some() {
                    return Err(mismatch(
                        "a virtio-serial agent socket",
                        "QEMU (Cloud Hypervisor's agent is on hybrid vsock)",
                    ));
                }
                Ok(Endpoint::CloudHypervisor {
                    api_socket,
                    event_monitor: self.event_monitor,
                    vsock: self.vsock,
                    agent_port: self.agent_port,
                    log_file: self.log_file,
                    tls_dir: self.tls_dir,
                })
            }
            (Some(_), Some(_)) => Err(PlanError::Flags {
                side,
                reason: "give one VMM: a QMP socket (QEMU) or an API socket (Cloud Hypervisor), \
                         not both"
                    .into(),
            }),
            (None, None) => Err(PlanError::Flags {
                side,
                reason: "give the VMM: a QMP socket (QEMU) or an API socket (Cloud Hypervisor)"
                    .into(),
            }),
        }
    }
}

/// Per-phase deadlines, in ms: the ones a client set (`--deadline`), over defaults that grow
/// with the connections the move carries ([`Deadlines::for_move`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deadlines(BTreeMap<Phase, u64>);

/// The longest deadline a phase may have: a day.
pub const MAX_DEADLINE_MS: u64 = 24 * 3600 * 1000;

/// A phase's default deadline, in ms, and what each connection listed at prepare adds to
/// it. The bases are generous for one connection on the test bed's TCG guests (a migration
/// of an idle 512 MiB guest takes under a second, a quiesce a few hundred ms, a hot-unplug
/// 0.1-0.2 s: TESTBED.md). Releasing and re-creating every connection's QP, CQ and memory
/// takes time per connection: 64 connections on idle test-bed guests (2026-12-02) took
/// 2.0 s to quiesce, 7.6 s to detach and 8.5 s to resume, where one takes about 0.04 s,
/// 0.2 s and 0.7 s, so a fixed 5 s detach failed every 64-connection move.
const DEFAULTS: [(Phase, u64, u64); 7] = [
    (Phase::Prepare, 10_000, 0),
    (Phase::Quiesce, 10_000, 100),
    (Phase::Detach, 5_000, 200),
    (Phase::Migrate, 60_000, 0),
    (Phase::Attach, 5_000, 0),
    (Phase::Resume, 20_000, 250),
    (Phase::Rollback, 30_000, 250),
];

impl Deadlines {
    /// The deadline of `phase` before any connection is known: the one set, or the base.
    /// (Prepare lists the connections, so its own deadline never grows.)
    pub fn of(&self, phase: Phase) -> Duration {
        self.for_move(phase, 0)
    }

    /// The deadline of `phase` in a move of `connections` connections: the one set, or the
    /// base plus each connection's share, at most [`MAX_DEADLINE_MS`].
    pub fn for_move(&self, phase: Phase, connections: usize) -> Duration {
        let ms = self.0.get(&phase).copied().unwrap_or_else(|| {
            DEFAULTS
                .iter()
                .find(|(p, _, _)| *p == phase)
                .map_or(0, |&(_, base, each)| {
                    base.saturating_add(each.saturating_mul(connections as u64))
                        .min(MAX_DEADLINE_MS)
                })
        });
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
        if ms > MAX_DEADLINE_MS {
            return Err(bad(format!(
                "longer than a day ({MAX_DEADLINE_MS} ms): no phase should take that long"
            )));
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
    /// The VMM process that receives it (QEMU started with `-incoming defer`; a Cloud
    /// Hypervisor without a VM), on the host of `destination_migrator` when that is given.
    /// `None` only in a workflow's move until `post-migrate` names it.
    pub destination: Option<Endpoint>,
    /// The migrator that does the destination's duties (a `[[peer.known]]` name or
    /// `host:port`), over mutual TLS; `None`: this host's daemon does them itself.
    #[serde(default)]
    pub destination_migrator: Option<String>,
    /// The device to unplug on the source (the RDMA NIC).
    pub detach: String,
    /// The device to plug on the destination; `None` only in a workflow's move until
    /// `post-migrate` names it.
    pub attach: Option<DeviceSpec>,
    /// The device to plug back on the source if the move rolls back after the detach;
    /// `attach` when not given (the destination runs the VM's own configuration).
    #[serde(default)]
    pub reattach: Option<DeviceSpec>,
    /// Who migrates the VM: the migrator (the source VMM is told to), or the workflow
    /// around `rdmamig-vmm pre-migrate` and `post-migrate`.
    #[serde(default)]
    pub migration: MigrationBy,
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
    /// What to do with unmanaged programs; `None`: the daemon's `[moves] unmanaged`. The
    /// daemon fills it in when it admits the move, so the journal holds the policy that ran.
    #[serde(default)]
    pub unmanaged: Option<UnmanagedPolicy>,
    /// Where the migration stream goes (`unix:/path` or `tcp:host:port`); empty when the
    /// workflow migrates.
    #[serde(default)]
    pub via: String,
    /// The migration's own bounds, handed to the source VMM.
    #[serde(default)]
    pub limits: MigrationLimits,
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
    /// An end's command-line flags do not name one VMM with its own agent channel.
    #[error("the {side}: {reason}")]
    Flags {
        /// `source` or `destination`.
        side: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The migration's timeout limit is not inside the migrate phase's deadline, which
    /// would end the migration first.
    #[error(
        "the migration timeout ({timeout_s} s) must be shorter than the migrate phase's \
         deadline ({deadline_ms} ms): raise it with --deadline migrate=MS"
    )]
    TimeoutPastDeadline {
        /// The migration's timeout limit.
        timeout_s: u64,
        /// The migrate phase's deadline.
        deadline_ms: u64,
    },
    /// The strategy needs an agent channel the plan does not give.
    #[error("strategy {strategy} needs the {side} agent channel")]
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
    /// Whether a move whose device migrates with the VM (`hot`) hands the destination VMM a
    /// function of the destination's pool with its receive: a Cloud Hypervisor destination
    /// takes a VF as descriptors; a QEMU destination was started with its device.
    pub fn hands_pool_vf_to_receiver(&self) -> bool {
        self.from_pool && matches!(self.destination, Some(Endpoint::CloudHypervisor { .. }))
    }

    /// The device a rollback plugs back on the source, if the plan names one.
    pub fn reattach_spec(&self) -> Option<&DeviceSpec> {
        self.reattach.as_ref().or(self.attach.as_ref())
    }

    /// A migration stream is encrypted at both ends or at neither, and only over `tcp:`:
    /// Cloud Hypervisor's sender and receiver must both have a TLS folder, or the migration
    /// fails after the VM has been quiesced and unplugged.
    fn validate_tls(&self) -> Result<(), PlanError> {
        let tls = |end: Option<&Endpoint>| match end {
            Some(Endpoint::CloudHypervisor { tls_dir, .. }) => tls_dir.is_some(),
            _ => false,
        };
        let (sends, receives) = (tls(Some(&self.source)), tls(self.destination.as_ref()));
        if !sends && !receives {
            return Ok(());
        }
        let flags = |side, reason: &str| {
            Err(PlanError::Flags {
                side,
                reason: reason.into(),
            })
        };
        if !self.via.starts_with("tcp:") {
            return flags("source", "a TLS folder is for tcp: migrations only");
        }
        if self.migration == MigrationBy::Migrator && sends != receives {
            let (side, missing) = if sends {
                (
                    "destination",
                    "the source sends over TLS: give the destination's TLS folder",
                )
            } else {
                (
                    "source",
                    "the destination receives over TLS: give the source's TLS folder",
                )
            };
            return flags(side, missing);
        }
        Ok(())
    }

    /// Checks what can be checked before touching any VMM.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.vm.is_empty() {
            return Err(PlanError::Empty { field: "vm name" });
        }
        // `set` checks what the CLI gives; a plan sent over the API skips it.
        for (phase, ms) in &self.deadlines.0 {
            if phase.is_final() || *ms == 0 || *ms > MAX_DEADLINE_MS {
                return Err(PlanError::Deadline {
                    item: format!("{phase}={ms}"),
                    reason: format!("a working phase's deadline must be 1 to {MAX_DEADLINE_MS} ms"),
                });
            }
        }
        if self.detach.is_empty() {
            return Err(PlanError::Empty {
                field: "device to detach",
            });
        }
        if self.migration == MigrationBy::Migrator {
            if self.destination.is_none() {
                return Err(PlanError::Empty {
                    field: "destination VMM",
                });
            }
            if self.attach.is_none() {
                return Err(PlanError::Empty {
                    field: "device to attach",
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
        }
        self.validate_tls()?;
        if let Some(timeout) = self.limits.timeout {
            let deadline = self.deadlines.of(Phase::Migrate);
            if timeout >= deadline {
                return Err(PlanError::TimeoutPastDeadline {
                    timeout_s: timeout.as_secs(),
                    deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
                });
            }
        }
        if self.strategy != Strategy::Naive {
            let ends = [
                ("source", Some(&self.source)),
                ("destination", self.destination.as_ref()),
            ];
            for (side, endpoint) in ends {
                if endpoint.is_some_and(|e| !e.has_agent()) {
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
            source: Endpoint::Qemu {
                qmp: "/s/qmp".into(),
                agent: Some("/s/agent".into()),
            },
            destination: Some(Endpoint::Qemu {
                qmp: "/d/qmp".into(),
                agent: Some("/d/agent".into()),
            }),
            destination_migrator: None,
            detach: "nic0".into(),
            attach: Some(
                DeviceSpec::parse("driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1").unwrap(),
            ),
            reattach: None,
            migration: MigrationBy::Migrator,
            from_pool: false,
            source_function: None,
            unmanaged: None,
            via: "unix:/d/mig.sock".into(),
            limits: MigrationLimits::default(),
            strategy: Strategy::Reconnect,
            deadlines: Deadlines::default(),
        }
    }

    #[test]
    fn the_strategy_table_says_what_each_strategy_does() {
        let of = |s: Strategy| {
            let steps = s.steps();
            (
                steps.uncoordinated.is_none(),
                steps.quiesce,
                steps.device_moves.is_none(),
            )
        };
        // (coordinates the connections, what their quiesce does, swaps the device)
        assert_eq!(of(Strategy::Reconnect), (true, QuiesceMode::Release, true));
        assert_eq!(of(Strategy::Bridge), (true, QuiesceMode::Bridge, true));
        assert_eq!(of(Strategy::Naive), (false, QuiesceMode::Release, true));
        assert_eq!(of(Strategy::Hot), (true, QuiesceMode::Hot, false));
    }

    #[test]
    fn plans_and_journals_that_say_vfio_migrate_run_hot() {
        let old: Strategy = serde_json::from_str("\"vfio_migrate\"").unwrap();
        assert_eq!(old, Strategy::Hot);
        assert_eq!(
            <Strategy as clap::ValueEnum>::from_str("vfio-migrate", false),
            Ok(Strategy::Hot)
        );
        assert_eq!(serde_json::to_string(&Strategy::Hot).unwrap(), "\"hot\"");
    }

    #[test]
    fn a_plan_from_the_api_with_a_deadline_out_of_range_is_refused() {
        for ms in [0, MAX_DEADLINE_MS + 1] {
            let mut text = serde_json::to_value(plan()).unwrap();
            text["deadlines"]["detach"] = ms.into();
            let bad: MovePlan = serde_json::from_value(text).unwrap();
            let err = bad.validate().unwrap_err();
            assert!(err.to_string().contains("detach="), "{err}");
        }
        assert!(plan().validate().is_ok());
    }

    #[test]
    fn default_deadlines_grow_per_connection_up_to_a_day() {
        let mut d = Deadlines::default();
        assert_eq!(d.for_move(Phase::Detach, 0), Duration::from_secs(5));
        assert_eq!(
            d.for_move(Phase::Detach, 64),
            Duration::from_millis(5_000 + 64 * 200)
        );
        assert_eq!(d.for_move(Phase::Prepare, 64), Duration::from_secs(10));
        assert_eq!(
            d.for_move(Phase::Resume, usize::MAX),
            Duration::from_millis(MAX_DEADLINE_MS)
        );
        d.set("detach=1500").unwrap();
        assert_eq!(d.for_move(Phase::Detach, 1024), Duration::from_millis(1500));
        assert_eq!(d.of(Phase::Detach), Duration::from_millis(1500));
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
        p.limits.timeout = Some(Duration::from_secs(60));
        assert!(matches!(
            p.validate(),
            Err(PlanError::TimeoutPastDeadline { .. })
        ));
        p.limits.timeout = Some(Duration::from_secs(59));
        assert_eq!(p.validate(), Ok(()));
        p.destination = Some(Endpoint::CloudHypervisor {
            api_socket: "/d/api".into(),
            event_monitor: None,
            vsock: None,
            agent_port: 7077,
            log_file: None,
            tls_dir: None,
        });
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
    fn a_migration_is_encrypted_at_both_ends_or_at_neither_and_over_tcp() {
        let ch = |tls: Option<&str>| Endpoint::CloudHypervisor {
            api_socket: "/a".into(),
            event_monitor: None,
            vsock: Some("/v".into()),
            agent_port: 7077,
            log_file: None,
            tls_dir: tls.map(PathBuf::from),
        };
        let mut p = plan();
        p.via = "tcp:127.0.0.1:4444".into();
        p.source = ch(Some("/s/tls"));
        p.destination = Some(ch(None));
        assert!(
            matches!(p.validate(), Err(PlanError::Flags { side: "destination", ref reason }) if reason.contains("TLS")),
            "{:?}",
            p.validate()
        );
        p.destination = Some(ch(Some("/d/tls")));
        assert_eq!(p.validate(), Ok(()));
        p.source = ch(None);
        assert!(matches!(
            p.validate(),
            Err(PlanError::Flags { side: "source", .. })
        ));
        p.source = ch(Some("/s/tls"));
        p.via = "unix:/d/mig.sock".into();
        assert!(
            matches!(p.validate(), Err(PlanError::Flags { ref reason, .. }) if reason.contains("tcp:")),
            "{:?}",
            p.validate()
        );
        // QEMU has no TLS folder: the flag is refused for it.
        let qemu_tls = EndpointFlags {
            qmp: Some("/q".into()),
            tls_dir: Some("/t".into()),
            ..EndpointFlags::default()
        };
        assert!(qemu_tls.endpoint("source").is_err());
    }

    #[test]
    fn flags_name_one_vmm_with_its_own_agent_channel() {
        let flags = |qmp: bool, api: bool, agent: bool, vsock: bool| EndpointFlags {
            qmp: qmp.then(|| "/q".into()),
            api_socket: api.then(|| "/a".into()),
            agent: agent.then(|| "/ag".into()),
            vsock: vsock.then(|| "/v".into()),
            event_monitor: None,
            agent_port: 7077,
            log_file: None,
            tls_dir: None,
        };
        assert_eq!(
            flags(true, false, true, false).endpoint("source"),
            Ok(Endpoint::Qemu {
                qmp: "/q".into(),
                agent: Some("/ag".into())
            })
        );
        assert_eq!(
            flags(false, true, false, true).endpoint("source"),
            Ok(Endpoint::CloudHypervisor {
                api_socket: "/a".into(),
                event_monitor: None,
                vsock: Some("/v".into()),
                agent_port: 7077,
                log_file: None,
                tls_dir: None,
            })
        );
        for (bad, what) in [
            (flags(true, true, false, false), "not both"),
            (flags(false, false, false, false), "give the VMM"),
            (flags(true, false, false, true), "hybrid vsock"),
            (flags(false, true, true, false), "virtio-serial"),
        ] {
            let err = bad.endpoint("destination").unwrap_err();
            assert!(
                matches!(&err, PlanError::Flags { side: "destination", reason } if reason.contains(what)),
                "{err}"
            );
        }
        let mut monitor = flags(true, false, false, false);
        monitor.event_monitor = Some("/e".into());
        assert!(monitor.endpoint("source").is_err());
    }

    #[test]
    fn plan_round_trips_through_json() {
        let mut p = plan();
        p.destination = Some(Endpoint::CloudHypervisor {
            api_socket: "/d/api".into(),
            event_monitor: Some("/d/events".into()),
            vsock: Some("/d/vsock".into()),
            agent_port: 7077,
            log_file: None,
            tls_dir: None,
        });
        p.limits.downtime = Some(Duration::from_millis(200));
        p.limits.local = true;
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<MovePlan>(&json).unwrap(), p);
    }
}
