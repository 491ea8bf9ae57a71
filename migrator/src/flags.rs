//! The flags of a move, declared once. `rdmamig migrate` and `rdmamig-vmm` (its hooks and
//! its migrate wrapper) flatten the same groups, so that a flag means the same in every
//! command and its help is written in one place.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use rdmamig_vmm::cloud_hypervisor::DEFAULT_AGENT_PORT;
use rdmamig_vmm::{DeviceSpec, MigrationLimits, TimeoutStrategy, MAX_MIGRATION_CONNECTIONS};

use crate::ch_remote::SendMigration;

use crate::plan::{
    Deadlines, Endpoint, EndpointFlags, MigrationBy, MovePlan, PlanError, Strategy, UnmanagedPolicy,
};

/// The daemon's socket when none is given.
pub const DEFAULT_SOCKET: &str = "/run/rdmamig/rdmamig.sock";

/// The VMM the VM runs under now (the source of a move), and how its agent is reached.
#[derive(Args, Debug, Clone)]
pub struct VmmFlags {
    /// QEMU: its QMP socket.
    #[arg(long, global = true, conflicts_with = "api_socket")]
    pub qmp: Option<PathBuf>,
    /// Cloud Hypervisor: its --api-socket.
    #[arg(long, global = true)]
    pub api_socket: Option<PathBuf>,
    /// QEMU: the agent's virtio-serial chardev socket; needed by every strategy but naive.
    #[arg(long, global = true, conflicts_with = "vsock")]
    pub agent: Option<PathBuf>,
    /// Cloud Hypervisor: the VM's hybrid vsock socket (--vsock socket=PATH); needed by
    /// every strategy but naive.
    #[arg(long, global = true)]
    pub vsock: Option<PathBuf>,
    /// Cloud Hypervisor: its --event-monitor file, which tells a migration's outcome at once
    /// (without it the move knows only once the source has lost the VM, and a failed
    /// migration shows as the migrate deadline passing).
    #[arg(long, global = true)]
    pub event_monitor: Option<PathBuf>,
    /// Cloud Hypervisor: its --log-file, where a failed migration's cause is (its
    /// migration-failed event carries none): the failure quotes the log's end.
    #[arg(long, global = true)]
    pub log_file: Option<PathBuf>,
    /// Cloud Hypervisor: mutual TLS for the migration stream (tcp: only), the folder with
    /// ca-cert.pem, client-cert.pem and client-key.pem (ch-remote's tls_dir=); the
    /// destination then needs --to-tls-dir.
    #[arg(long, global = true)]
    pub tls_dir: Option<PathBuf>,
    /// Cloud Hypervisor: the guest agent's vsock port (both ends).
    #[arg(long, global = true, default_value_t = DEFAULT_AGENT_PORT)]
    pub agent_port: u32,
}

impl VmmFlags {
    /// The endpoint the flags name; `side` is for the message.
    pub fn endpoint(&self, side: &'static str) -> Result<Endpoint, PlanError> {
        EndpointFlags {
            qmp: self.qmp.clone(),
            api_socket: self.api_socket.clone(),
            agent: self.agent.clone(),
            vsock: self.vsock.clone(),
            event_monitor: self.event_monitor.clone(),
            agent_port: self.agent_port,
            log_file: self.log_file.clone(),
            tls_dir: self.tls_dir.clone(),
        }
        .endpoint(side)
    }
}

/// The VMM that receives the VM.
#[derive(Args, Debug, Clone)]
pub struct DestinationFlags {
    /// QEMU destination: its QMP socket (QEMU started with -incoming defer); a path on the
    /// destination migrator's host when --destination-migrator is given (so are the other
    /// destination sockets).
    #[arg(long)]
    pub to_qmp: Option<PathBuf>,
    /// Cloud Hypervisor destination: its --api-socket (a cloud-hypervisor without a VM).
    #[arg(long)]
    pub to_api_socket: Option<PathBuf>,
    /// QEMU destination: the agent's virtio-serial chardev socket; needed by every strategy
    /// but naive.
    #[arg(long)]
    pub to_agent: Option<PathBuf>,
    /// Cloud Hypervisor destination: the VM's hybrid vsock socket; needed by every
    /// strategy but naive.
    #[arg(long)]
    pub to_vsock: Option<PathBuf>,
    /// Cloud Hypervisor destination: its TLS folder for receiving the migration stream
    /// (ca-cert.pem, server-cert.pem, server-key.pem); needed when the source has --tls-dir.
    #[arg(long)]
    pub to_tls_dir: Option<PathBuf>,
}

impl DestinationFlags {
    /// The endpoint the flags name (the agent's vsock port is the source's).
    pub fn endpoint(&self, agent_port: u32) -> Result<Endpoint, PlanError> {
        EndpointFlags {
            qmp: self.to_qmp.clone(),
            api_socket: self.to_api_socket.clone(),
            agent: self.to_agent.clone(),
            vsock: self.to_vsock.clone(),
            event_monitor: None,
            agent_port,
            log_file: None,
            tls_dir: self.to_tls_dir.clone(),
        }
        .endpoint("destination")
    }
}

/// The migration's own bounds, handed to the source VMM (as `ch-remote send-migration`
/// and `vm.send-migration` take them).
#[derive(Args, Debug, Clone)]
pub struct LimitFlags {
    /// The longest stop-and-copy the VMM may choose, ms (VMM default: QEMU 300, Cloud
    /// Hypervisor 300).
    #[arg(long)]
    pub downtime_ms: Option<u64>,
    /// The longest the migration may take, s; must be below the migrate phase's deadline
    /// (--deadline migrate=MS).
    #[arg(long)]
    pub migration_timeout_s: Option<u64>,
    /// At the migration timeout: cancel (the VM stays on the source, the move rolls back;
    /// the default) or ignore (finish whatever the downtime).
    #[arg(long)]
    pub timeout_strategy: Option<TimeoutStrategy>,
    /// Cloud Hypervisor: same-host migration, memory handed over as file descriptors
    /// (unix: URI, guest memory shared=on; ch-remote's local=on). QEMU refuses it.
    #[arg(long)]
    pub local: bool,
    /// Cloud Hypervisor (after v53): parallel TCP connections for the migration stream,
    /// 1 to 128 (ch-remote's connections=). QEMU refuses it.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=MAX_MIGRATION_CONNECTIONS as i64))]
    pub connections: Option<u8>,
}

impl LimitFlags {
    /// The limits the flags give.
    pub fn limits(&self) -> MigrationLimits {
        MigrationLimits {
            downtime: self.downtime_ms.map(Duration::from_millis),
            timeout: self.migration_timeout_s.map(Duration::from_secs),
            timeout_strategy: self.timeout_strategy.unwrap_or_default(),
            local: self.local,
            connections: self.connections,
        }
    }

    /// Takes the bounds of ch-remote's option list (`rdmamig-vmm send-migration
    /// destination_url=...,downtime_ms=...`); a bound also given as a flag is refused,
    /// naming both.
    pub fn adopt(&mut self, options: &SendMigration) -> Result<(), String> {
        let given = |key| options.given.contains(&key);
        let twice = |key: &str, flag: &str| {
            Err(format!(
                "{key} is given twice: in the option list and as --{flag}"
            ))
        };
        let limits = &options.limits;
        if given("downtime_ms") {
            if self.downtime_ms.is_some() {
                return twice("downtime_ms", "downtime-ms");
            }
            self.downtime_ms = limits.downtime.map(|d| d.as_millis() as u64);
        }
        if given("timeout_s") {
            if self.migration_timeout_s.is_some() {
                return twice("timeout_s", "migration-timeout-s");
            }
            self.migration_timeout_s = limits.timeout.map(|t| t.as_secs());
        }
        if given("timeout_strategy") {
            if self.timeout_strategy.is_some() {
                return twice("timeout_strategy", "timeout-strategy");
            }
            self.timeout_strategy = Some(limits.timeout_strategy);
        }
        if given("local") {
            if self.local {
                return twice("local", "local");
            }
            self.local = limits.local;
        }
        if given("connections") {
            if self.connections.is_some() {
                return twice("connections", "connections");
            }
            self.connections = limits.connections;
        }
        Ok(())
    }
}

/// How the move treats the guest: its connections, its unmanaged programs, the deadlines.
#[derive(Args, Debug, Clone)]
pub struct GuestFlags {
    /// How the connections get through the move. reconnect: quiesce and resume every
    /// connection through the guest agent; bridge: as reconnect, but connections opened
    /// with a TCP bridge carry their messages over it (over a NIC that moves with the VM)
    /// while the RDMA path is away; naive: unplug, migrate, plug, nothing else;
    /// hot: the device stays plugged and the VMM moves its state with the VM (an emulated
    /// NIC, or a VF on a VFIO variant driver that migrates, such as mlx5_vfio_pci; the
    /// destination VMM must have been started with the same device); every connection
    /// pauses right before the switchover, keeps its QP and is confirmed on it after the
    /// move (refused before anything changes when the source VMM blocks the migration or
    /// --source-function names a VF on plain vfio-pci; `vfio-migrate` is its former name);
    /// auto: hot when nothing blocks it and the destination VMM has the device, reconnect
    /// otherwise (the report says why).
    #[arg(long, value_enum, default_value_t = Strategy::Reconnect)]
    pub strategy: Strategy,
    /// What to do with programs in the guest that hold an RDMA device without the rdmamig
    /// library (an rping, a raw-verbs tool): the move would break them. refuse: the move is
    /// refused at prepare, naming them (and rolls back before the unplug if one appeared
    /// since); release: they are ended (SIGTERM, SIGKILL after 1 s) right before the unplug,
    /// and if the unplug still misses its deadline whatever holds the device is made to let
    /// go (the detach may then take up to three times its deadline); ignore: the move goes
    /// on and the report marks each as broken. Default: the daemon's [moves] unmanaged,
    /// itself refuse by default (refuse for the hooks, which run without a daemon).
    #[arg(long, value_enum)]
    pub unmanaged: Option<UnmanagedPolicy>,
    /// The same as --unmanaged release (its name before that option existed).
    #[arg(long, conflicts_with = "unmanaged")]
    pub force_release: bool,
    /// A phase deadline, phase=ms (repeatable). Defaults: prepare=10000 quiesce=10000
    /// detach=5000 migrate=60000 attach=5000 resume=20000 rollback=30000, each phase after
    /// prepare given more per connection listed at prepare (quiesce 100 ms, detach 200,
    /// resume and rollback 250). A deadline set here does not grow.
    #[arg(long = "deadline", value_name = "PHASE=MS")]
    pub deadlines: Vec<String>,
}

impl GuestFlags {
    /// The policy for unmanaged programs the flags ask for, if any.
    pub fn unmanaged(&self) -> Option<UnmanagedPolicy> {
        if self.force_release {
            Some(UnmanagedPolicy::Release)
        } else {
            self.unmanaged
        }
    }

    /// The deadlines, the defaults changed by each `--deadline`.
    pub fn deadlines(&self) -> Result<Deadlines, PlanError> {
        let mut deadlines = Deadlines::default();
        for item in &self.deadlines {
            deadlines.set(item)?;
        }
        Ok(deadlines)
    }
}

/// What a move shows and keeps.
#[derive(Args, Debug, Clone)]
pub struct OutputFlags {
    /// Write the JSON report (timeline, migration figures, per-connection outcomes) here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Draw the timeline as SVG here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Print events and the report as JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A whole move but its source VMM and the migration stream's address, which the commands
/// name each in their own way (`rdmamig migrate --via`, `rdmamig-vmm migrate URL`).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "The move")]
pub struct MoveFlags {
    /// The VM's name (used in messages and the report).
    #[arg(long)]
    pub vm: String,
    /// The id of the device to unplug on the source (the RDMA NIC).
    #[arg(long)]
    pub detach: String,
    /// The device to plug on the destination, as device properties:
    /// QEMU 'driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1,mac=52:54:00:77:00:11';
    /// both VMMs 'driver=vfio-pci,host=0000:3b:02.1,id=vf1'. With --from-pool and a VF,
    /// 'mac=' is the VM's MAC, which the destination sets on the VF through its PF before
    /// the plug (`ip link set <PF> vf <N> mac`), so the guest finds it there.
    #[arg(long)]
    pub attach: DeviceSpec,
    /// The device to plug back on the source if the move rolls back after the detach
    /// (default: the --attach device).
    #[arg(long)]
    pub reattach: Option<DeviceSpec>,
    /// The migrator on the destination host that does the destination's duties: a
    /// [[peer.known]] name from the daemon's config, or host:port.
    ///
    /// Without it, this daemon drives both VMMs itself (both on this host). With it, this
    /// daemon asks that migrator, over mutual TLS with the certificates of the daemon's
    /// [peer] table, to reserve a function from its pool (--from-pool), ready its VMM
    /// (--to-qmp, a path on that host) to receive, plug the function after the migration,
    /// and resume the connections through its agent (--to-agent); a rollback releases its
    /// reservation the same way. The destination must list this host in its
    /// [[peer.known]] and present a certificate that is a listed peer's (the named one's)
    /// for the host part of its address. The migration stream's address is then where that
    /// host receives it (tcp:HOST:PORT between hosts).
    #[arg(long, value_name = "NAME|HOST:PORT", verbatim_doc_comment)]
    pub destination_migrator: Option<String>,
    /// Plug a function from the destination's pool (reserved at prepare; the move fails
    /// and rolls back at once when none is free); --attach then gives the id, bus and MAC.
    #[arg(long)]
    pub from_pool: bool,
    /// The pool function the detached device is (this host's pool): reset after the
    /// detach, back to the pool when the move is done, quarantined if the reset failed.
    #[arg(long)]
    pub source_function: Option<String>,
    /// The VMM that receives the VM.
    #[command(flatten, next_help_heading = "Destination VMM (one of)")]
    pub destination: DestinationFlags,
    /// The migration's own bounds.
    #[command(
        flatten,
        next_help_heading = "Migration limits (handed to the source VMM)"
    )]
    pub limits: LimitFlags,
    /// How the guest is treated.
    #[command(flatten, next_help_heading = "The guest")]
    pub guest: GuestFlags,
    /// What is shown and kept.
    #[command(flatten, next_help_heading = "Output")]
    pub output: OutputFlags,
}

impl MoveFlags {
    /// The plan of a move of the VM under `source`, its migration stream going to `via`;
    /// checked with [`MovePlan::validate`].
    pub fn plan(&self, source: &VmmFlags, via: String) -> Result<MovePlan, PlanError> {
        let plan = MovePlan {
            vm: self.vm.clone(),
            source: source.endpoint("source")?,
            destination: Some(self.destination.endpoint(source.agent_port)?),
            destination_migrator: self.destination_migrator.clone(),
            detach: self.detach.clone(),
            attach: Some(self.attach.clone()),
            reattach: self.reattach.clone(),
            migration: MigrationBy::Migrator,
            from_pool: self.from_pool,
            source_function: self.source_function.clone(),
            unmanaged: self.guest.unmanaged(),
            via,
            limits: self.limits.limits(),
            strategy: self.guest.strategy,
            deadlines: self.guest.deadlines()?,
        };
        plan.validate()?;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ch_remote::parse_send_migration;

    fn no_flags() -> LimitFlags {
        LimitFlags {
            downtime_ms: None,
            migration_timeout_s: None,
            timeout_strategy: None,
            local: false,
            connections: None,
        }
    }

    #[test]
    fn ch_remote_options_become_the_limits_and_flags_add_to_them() {
        let options =
            parse_send_migration("destination_url=tcp:dst-host:6000,downtime_ms=200,connections=8")
                .unwrap();
        let mut flags = LimitFlags {
            migration_timeout_s: Some(60),
            ..no_flags()
        };
        flags.adopt(&options).unwrap();
        let limits = flags.limits();
        assert_eq!(limits.downtime, Some(Duration::from_millis(200)));
        assert_eq!(limits.timeout, Some(Duration::from_secs(60)));
        assert_eq!(limits.connections, Some(8));
        assert_eq!(limits.timeout_strategy, TimeoutStrategy::Cancel);
    }

    #[test]
    fn a_bound_given_as_an_option_and_as_a_flag_is_refused() {
        let options =
            parse_send_migration("destination_url=tcp:dst-host:6000,timeout_strategy=ignore")
                .unwrap();
        let mut flags = LimitFlags {
            timeout_strategy: Some(TimeoutStrategy::Cancel),
            ..no_flags()
        };
        assert_eq!(
            flags.adopt(&options).unwrap_err(),
            "timeout_strategy is given twice: in the option list and as --timeout-strategy"
        );
    }
}
