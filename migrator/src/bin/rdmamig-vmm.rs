//! `rdmamig-vmm`: the commands a live-migration workflow calls, so that an existing workflow
//! gains rdmamig by changing one command.
//!
//! - `pre-migrate` (on the source, before the workflow migrates): the guest agent quiesces
//!   every RDMA connection and releases the NIC, then the NIC is hot-unplugged. Programs
//!   that hold an RDMA device without the library are found first, and `--unmanaged`
//!   decides as for `rdmamig migrate`: refuse (the hook fails before anything changes),
//!   release (they are ended before the unplug) or ignore (the report lists them as
//!   broken). If the unplug does not complete (a process still holds the NIC) the hook
//!   fails, so the workflow stops; it tries to resume the connections on the source and
//!   reports whether that worked (on Linux the unplug stays pending and the port is already
//!   down, so usually not: the holder must go, and the NIC with it).
//! - `post-migrate` (on the destination, after the migration): the new NIC is hot-plugged
//!   and the agent resumes every connection on it.
//! - `migrate` (in place of `ch-remote send-migration [--local] <destination_url>`): the
//!   whole coordinated move, through the rdmamig daemon (`rdmamig migrate`), with the same
//!   destination arguments and the migration's limits; the destination VMM is named with
//!   `--to-api-socket` (Cloud Hypervisor) or `--to-qmp` (QEMU).
//!
//! Every command names the VM's VMM and agent channel the same way as `rdmamig migrate`
//! (QEMU: `--qmp` and virtio-serial `--agent`; Cloud Hypervisor: `--api-socket` and hybrid
//! vsock `--vsock`), reached through the migrator's own backends. Each hook prints one JSON
//! line saying what it did.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use rdmamig_migrator::agent::AgentClient;
use rdmamig_migrator::backends::{Backends, VmmBackends};
use rdmamig_migrator::plan::{EndpointFlags, Strategy, UnmanagedPolicy};
use rdmamig_migrator::step::StepError;
use rdmamig_migrator::unmanaged::describe;
use rdmamig_proto::agent::ReleaseScope;
use rdmamig_proto::clock::millis;
use rdmamig_proto::text::error_chain;
use rdmamig_vmm::cloud_hypervisor::DEFAULT_AGENT_PORT;
use rdmamig_vmm::{DeviceSpec, TimeoutStrategy, Vmm};
use serde_json::{json, Value};

#[derive(Parser)]
#[command(
    name = "rdmamig-vmm",
    version,
    about = "Hooks and a migrate wrapper that add rdmamig to a live-migration workflow",
    long_about = "Hooks and a migrate wrapper that add rdmamig to a live-migration workflow.\n\n\
QEMU (libvirt hook, or around `virsh migrate` / QMP migrate):\n  \
rdmamig-vmm --qmp /run/vm1/qmp.sock --agent /run/vm1/agent.sock pre-migrate --detach nic0\n  \
... the workflow migrates the VM ...\n  \
rdmamig-vmm --qmp /run/vm1-dst/qmp.sock --agent /run/vm1-dst/agent.sock post-migrate \\\n    \
--attach 'driver=vfio-pci,host=0000:3b:02.1,id=vf1,bus=rp1'\n\n\
Cloud Hypervisor (around `ch-remote send-migration`):\n  \
rdmamig-vmm --api-socket /run/vm1/api.sock --vsock /run/vm1/vsock.sock pre-migrate --detach vf0\n  \
ch-remote --api-socket /run/vm1/api.sock send-migration unix:/run/vm1/mig.sock\n  \
rdmamig-vmm --api-socket /run/vm1-dst/api.sock --vsock /run/vm1-dst/vsock.sock post-migrate \\\n    \
--attach 'driver=vfio-pci,host=0000:3b:02.1,id=vf1'\n\n\
Or the whole move in one command through the rdmamig daemon, in place of \
`ch-remote --api-socket /run/vm1/api.sock send-migration tcp:dst-host:6000`:\n  \
rdmamig-vmm --api-socket /run/vm1/api.sock --vsock /run/vm1/vsock.sock \\\n    \
--event-monitor /run/vm1/events.json migrate tcp:dst-host:6000 \\\n    \
--to-api-socket /run/vm1-dst/api.sock --to-vsock /run/vm1-dst/vsock.sock \\\n    \
--vm vm1 --detach vf0 --attach 'driver=vfio-pci,host=0000:3b:02.1,id=vf1'\n\n\
Exit status: 0 done, 1 failed (the JSON line and stderr say why), 2 usage."
)]
struct Cli {
    #[command(flatten)]
    vmm: VmmArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct VmmArgs {
    /// QEMU's QMP socket.
    #[arg(long, global = true, conflicts_with = "api_socket")]
    qmp: Option<PathBuf>,
    /// Cloud Hypervisor's --api-socket.
    #[arg(long, global = true)]
    api_socket: Option<PathBuf>,
    /// The agent's virtio-serial chardev socket (QEMU).
    #[arg(long, global = true, conflicts_with = "vsock")]
    agent: Option<PathBuf>,
    /// The VM's hybrid vsock socket (Cloud Hypervisor --vsock socket=PATH).
    #[arg(long, global = true)]
    vsock: Option<PathBuf>,
    /// The agent's vsock port in the guest.
    #[arg(long, global = true, default_value_t = DEFAULT_AGENT_PORT)]
    agent_port: u32,
    /// Cloud Hypervisor's --event-monitor file (migrate: how the migration's outcome is
    /// known at once).
    #[arg(long, global = true)]
    event_monitor: Option<PathBuf>,
}

impl VmmArgs {
    /// The endpoint the flags name (the same rules as `rdmamig migrate`).
    fn flags(&self) -> EndpointFlags {
        EndpointFlags {
            qmp: self.qmp.clone(),
            api_socket: self.api_socket.clone(),
            agent: self.agent.clone(),
            vsock: self.vsock.clone(),
            event_monitor: self.event_monitor.clone(),
            agent_port: self.agent_port,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// On the source, before the migration: quiesce every connection, unplug the NIC.
    PreMigrate {
        /// The id of the NIC to unplug.
        #[arg(long)]
        detach: String,
        /// Deadline for the quiesce, ms.
        #[arg(long, default_value_t = 10_000)]
        quiesce_ms: u64,
        /// Deadline for the unplug, ms (the guest releases the NIC only when nothing holds it).
        #[arg(long, default_value_t = 5_000)]
        detach_ms: u64,
        /// Strategy bridge: connections with a TCP bridge carry their messages over it until
        /// post-migrate has brought the RDMA path back.
        #[arg(long)]
        bridge: bool,
        /// Programs holding an RDMA device without the rdmamig library: refuse (fail before
        /// anything changes, naming them), release (end them before the unplug) or ignore
        /// (unplug anyway; the report lists them as broken).
        #[arg(long, value_enum, default_value_t = UnmanagedPolicy::Refuse)]
        unmanaged: UnmanagedPolicy,
    },
    /// On the destination, after the migration: plug the new NIC, resume every connection.
    PostMigrate {
        /// The NIC to plug, as device properties:
        /// 'driver=vfio-pci,host=0000:3b:02.1,id=vf1' (QEMU also takes bus=, netdev=, ...).
        #[arg(long)]
        attach: DeviceSpec,
        /// Deadline for the resume, ms (includes waiting for the new RDMA port).
        #[arg(long, default_value_t = 20_000)]
        resume_ms: u64,
    },
    /// The whole coordinated move through the rdmamig daemon, in place of
    /// `ch-remote send-migration [--local] <destination_url>`.
    Migrate(Box<MigrateArgs>),
}

#[derive(Args)]
struct MigrateArgs {
    /// Where the migration stream goes: unix:PATH or tcp:HOST:PORT (as ch-remote takes it).
    destination_url: String,
    /// Same-host migration, memory handed over as file descriptors (ch-remote's --local;
    /// Cloud Hypervisor only).
    #[arg(long)]
    local: bool,
    /// The longest stop-and-copy, ms (the API's downtime_ms; VMM default 300).
    #[arg(long)]
    downtime_ms: Option<u64>,
    /// The longest the migration may take, s (the API's timeout_s); the move's migrate
    /// deadline is set 10 s past it.
    #[arg(long)]
    migration_timeout_s: Option<u64>,
    /// At the migration timeout: cancel (the VM stays on the source, the move rolls back)
    /// or ignore (finish whatever the downtime).
    #[arg(long, default_value_t = TimeoutStrategy::Cancel)]
    timeout_strategy: TimeoutStrategy,
    /// How the connections get through the move (as `rdmamig migrate --strategy`).
    #[arg(long, value_enum, default_value_t = Strategy::Reconnect)]
    strategy: Strategy,
    /// Programs holding an RDMA device without the rdmamig library (as `rdmamig migrate
    /// --unmanaged`; default: the daemon's [moves] unmanaged).
    #[arg(long, value_enum)]
    unmanaged: Option<UnmanagedPolicy>,
    /// Cloud Hypervisor destination: its --api-socket (a cloud-hypervisor without a VM).
    #[arg(long, help_heading = "Destination VMM (one of)")]
    to_api_socket: Option<PathBuf>,
    /// Cloud Hypervisor destination: the VM's hybrid vsock socket there.
    #[arg(long, help_heading = "Destination VMM (one of)")]
    to_vsock: Option<PathBuf>,
    /// QEMU destination: its QMP socket (QEMU started with -incoming defer).
    #[arg(long, help_heading = "Destination VMM (one of)")]
    to_qmp: Option<PathBuf>,
    /// QEMU destination: the agent's virtio-serial socket there.
    #[arg(long, help_heading = "Destination VMM (one of)")]
    to_agent: Option<PathBuf>,
    /// The daemon's socket.
    #[arg(
        long,
        env = "RDMAMIG_SOCKET",
        default_value = "/run/rdmamig/rdmamig.sock"
    )]
    socket: PathBuf,
    /// The VM's name.
    #[arg(long)]
    vm: String,
    /// The NIC to unplug on the source.
    #[arg(long)]
    detach: String,
    /// The NIC to plug on the destination (device properties).
    #[arg(long)]
    attach: String,
    /// Where to write the move's JSON report.
    #[arg(long)]
    report: Option<PathBuf>,
    /// The `rdmamig` program.
    #[arg(long, default_value = "rdmamig")]
    rdmamig: PathBuf,
}

/// How far past the migration's own timeout the move's migrate deadline lies: the VMM's
/// timeout strategy decides, not the deadline.
const DEADLINE_PAST_TIMEOUT_S: u64 = 10;

/// How long a released program has between SIGTERM and SIGKILL.
const RELEASE_GRACE: Duration = Duration::from_secs(1);

/// How long a failed pre-migrate tries to resume the connections on the source.
const RESUME_ON_SOURCE: Duration = Duration::from_secs(3);

/// A hook's failure: what to print, and whether it is the caller's mistake.
struct Failure {
    usage: bool,
    message: String,
    report: Value,
}

fn failed(message: impl Into<String>, report: Value) -> Failure {
    Failure {
        usage: false,
        message: message.into(),
        report,
    }
}

fn usage(message: impl Into<String>) -> Failure {
    Failure {
        usage: true,
        message: message.into(),
        report: Value::Null,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    if let Command::Migrate(args) = cli.command {
        return migrate(&cli.vmm, *args);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("rdmamig-vmm: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (hook, result) = match cli.command {
        Command::PreMigrate {
            detach,
            quiesce_ms,
            detach_ms,
            bridge,
            unmanaged,
        } => (
            "pre-migrate",
            runtime.block_on(pre_migrate(
                &cli.vmm,
                &detach,
                Duration::from_millis(quiesce_ms),
                Duration::from_millis(detach_ms),
                bridge,
                unmanaged,
            )),
        ),
        Command::PostMigrate { attach, resume_ms } => (
            "post-migrate",
            runtime.block_on(post_migrate(
                &cli.vmm,
                &attach,
                Duration::from_millis(resume_ms),
            )),
        ),
        Command::Migrate(_) => unreachable!("handled above"),
    };
    match result {
        Ok(mut report) => {
            report["hook"] = hook.into();
            report["ok"] = true.into();
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("rdmamig-vmm {hook}: {}", failure.message);
            if failure.usage {
                return ExitCode::from(2);
            }
            let mut report = failure.report;
            if !report.is_object() {
                report = json!({});
            }
            report["hook"] = hook.into();
            report["ok"] = false.into();
            report["error"] = failure.message.into();
            println!("{report}");
            ExitCode::FAILURE
        }
    }
}

async fn connect(args: &VmmArgs) -> Result<Arc<dyn Vmm>, Failure> {
    let endpoint = args
        .flags()
        .endpoint("VM")
        .map_err(|e| usage(e.to_string()))?;
    VmmBackends
        .connect(&endpoint)
        .await
        .map_err(|e| failed(error_chain(&e), Value::Null))
}

async fn agent(vmm: &dyn Vmm, budget: Duration) -> Result<AgentClient, Failure> {
    let channel = vmm
        .open_agent_channel()
        .await
        .map_err(|e| failed(error_chain(&e), Value::Null))?;
    let mut agent = AgentClient::new(channel);
    agent
        .ping(budget)
        .await
        .map_err(|e| failed(format!("the guest agent: {}", error_chain(&e)), Value::Null))?;
    Ok(agent)
}

async fn pre_migrate(
    args: &VmmArgs,
    detach: &str,
    quiesce_deadline: Duration,
    detach_deadline: Duration,
    bridge: bool,
    policy: UnmanagedPolicy,
) -> Result<Value, Failure> {
    let vmm = connect(args).await?;
    let start = Instant::now();
    let mut agent = agent(&*vmm, quiesce_deadline).await?;
    let connections = agent
        .list_connections(quiesce_deadline.saturating_sub(start.elapsed()))
        .await
        .map_err(|e| failed(error_chain(&e), Value::Null))?;
    let unmanaged = agent
        .list_unmanaged(quiesce_deadline.saturating_sub(start.elapsed()))
        .await
        .map_err(|e| failed(error_chain(&e), Value::Null))?;
    let named: Vec<String> = unmanaged.iter().map(describe).collect();
    if policy == UnmanagedPolicy::Refuse && !unmanaged.is_empty() {
        let refusal = StepError::UnmanagedPrograms {
            count: named.len(),
            since: "",
            named: named.join("; "),
        };
        return Err(failed(
            format!("{refusal}. Nothing was changed"),
            json!({ "unmanaged": unmanaged }),
        ));
    }
    let ids: Vec<_> = connections.iter().map(|c| c.id).collect();
    let quiesced = agent
        .quiesce(
            &ids,
            quiesce_deadline.saturating_sub(start.elapsed()),
            bridge,
        )
        .await
        .map_err(|e| failed(error_chain(&e), json!({"connections": ids.len()})))?;
    let not_quiesced: Vec<String> = quiesced
        .failed()
        .map(|o| {
            format!(
                "{:016x}: {}",
                o.id,
                o.error.as_deref().unwrap_or("no reason")
            )
        })
        .collect();
    let quiesce_ms = millis(start.elapsed());
    let mut report = json!({
        "connections": ids.len(),
        "quiesced": quiesced.outcomes.iter().filter(|o| o.ok).count(),
        "not_quiesced": not_quiesced,
        "quiesce_ms": quiesce_ms,
        "device": detach,
        "unmanaged_policy": policy.to_string(),
    });
    if !unmanaged.is_empty() {
        match policy {
            UnmanagedPolicy::Release => {
                let ended = agent
                    .release_device(ReleaseScope::Unmanaged, RELEASE_GRACE, detach_deadline)
                    .await
                    .map_err(|e| failed(error_chain(&e), report.clone()))?;
                report["ended"] = json!(ended);
            }
            _ => report["broken"] = json!(named),
        }
    }
    let unplug = Instant::now();
    if let Err(e) = vmm.remove_device(detach, detach_deadline).await {
        // The workflow must not migrate now. Try to give the connections back their NIC;
        // a Linux guest has usually begun tearing it down already (the unplug stays pending
        // until the holder lets go), and then the agent says the port is not ACTIVE.
        report["unplug_pending"] = e.is_timeout().into();
        let resumed = agent.resume(&ids, RESUME_ON_SOURCE).await;
        report["resumed_on_source"] = match &resumed {
            Ok(outcomes) => outcomes.outcomes.iter().filter(|o| o.ok).count().into(),
            Err(e) => error_chain(e).into(),
        };
        return Err(failed(error_chain(&e), report));
    }
    report["detach_ms"] = millis(unplug.elapsed()).into();
    Ok(report)
}

async fn post_migrate(
    args: &VmmArgs,
    attach: &DeviceSpec,
    resume_deadline: Duration,
) -> Result<Value, Failure> {
    let vmm = connect(args).await?;
    let plug = Instant::now();
    let added = vmm
        .add_device(attach)
        .await
        .map_err(|e| failed(error_chain(&e), Value::Null))?;
    let mut report = json!({
        "device": added.id,
        "bdf": added.bdf,
        "attach_ms": millis(plug.elapsed()),
    });
    let start = Instant::now();
    let mut agent = agent(&*vmm, resume_deadline).await?;
    let connections = agent
        .list_connections(resume_deadline.saturating_sub(start.elapsed()))
        .await
        .map_err(|e| failed(error_chain(&e), report.clone()))?;
    let ids: Vec<_> = connections.iter().map(|c| c.id).collect();
    let resumed = agent
        .resume(&ids, resume_deadline.saturating_sub(start.elapsed()))
        .await
        .map_err(|e| failed(error_chain(&e), report.clone()))?;
    let not_resumed: Vec<String> = resumed
        .failed()
        .map(|o| {
            format!(
                "{:016x}: {}",
                o.id,
                o.error.as_deref().unwrap_or("no reason")
            )
        })
        .collect();
    report["connections"] = ids.len().into();
    report["resumed"] = resumed.outcomes.iter().filter(|o| o.ok).count().into();
    report["resume_ms"] = millis(start.elapsed()).into();
    if !not_resumed.is_empty() {
        let message = format!(
            "{} of {} connections did not resume: {}",
            not_resumed.len(),
            ids.len(),
            not_resumed.join("; ")
        );
        report["not_resumed"] = not_resumed.into();
        return Err(failed(message, report));
    }
    Ok(report)
}

/// Runs `rdmamig migrate` with the plan the wrapper's arguments describe; its exit status
/// is the wrapper's.
fn migrate(vmm: &VmmArgs, args: MigrateArgs) -> ExitCode {
    let destination = EndpointFlags {
        qmp: args.to_qmp.clone(),
        api_socket: args.to_api_socket.clone(),
        agent: args.to_agent.clone(),
        vsock: args.to_vsock.clone(),
        event_monitor: None,
        agent_port: vmm.agent_port,
    };
    for (side, flags) in [("source", vmm.flags()), ("destination", destination)] {
        match flags.endpoint(side) {
            Ok(endpoint) if endpoint.has_agent() => {}
            Ok(_) => {
                eprintln!(
                    "rdmamig-vmm migrate: the coordinated move needs the {side} agent channel \
                     (QEMU: --agent / --to-agent; Cloud Hypervisor: --vsock / --to-vsock)"
                );
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("rdmamig-vmm migrate: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let mut command = std::process::Command::new(&args.rdmamig);
    command
        .arg("migrate")
        .arg("--socket")
        .arg(&args.socket)
        .args(["--vm", &args.vm, "--strategy", &args.strategy.to_string()])
        .args(["--detach", &args.detach, "--attach", &args.attach])
        .args(["--via", &args.destination_url])
        .arg("--agent-port")
        .arg(vmm.agent_port.to_string())
        .arg("--timeout-strategy")
        .arg(args.timeout_strategy.to_string());
    if let Some(policy) = args.unmanaged {
        command.args(["--unmanaged", &policy.to_string()]);
    }
    let paths = [
        ("--qmp", &vmm.qmp),
        ("--agent", &vmm.agent),
        ("--api-socket", &vmm.api_socket),
        ("--vsock", &vmm.vsock),
        ("--event-monitor", &vmm.event_monitor),
        ("--to-qmp", &args.to_qmp),
        ("--to-agent", &args.to_agent),
        ("--to-api-socket", &args.to_api_socket),
        ("--to-vsock", &args.to_vsock),
        ("--report", &args.report),
    ];
    for (flag, path) in paths {
        if let Some(path) = path {
            command.arg(flag).arg(path);
        }
    }
    if args.local {
        command.arg("--local");
    }
    if let Some(ms) = args.downtime_ms {
        command.arg("--downtime-ms").arg(ms.to_string());
    }
    if let Some(timeout) = args.migration_timeout_s {
        command
            .arg("--migration-timeout-s")
            .arg(timeout.to_string())
            .arg("--deadline")
            .arg(format!(
                "migrate={}",
                timeout
                    .saturating_add(DEADLINE_PAST_TIMEOUT_S)
                    .saturating_mul(1000)
            ));
    }
    match command.status() {
        Ok(status) => match status.code() {
            Some(0) => ExitCode::SUCCESS,
            Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            None => ExitCode::FAILURE,
        },
        Err(e) => {
            eprintln!(
                "rdmamig-vmm migrate: cannot run {}: {e}",
                args.rdmamig.display()
            );
            ExitCode::FAILURE
        }
    }
}
