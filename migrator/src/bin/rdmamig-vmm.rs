//! `rdmamig-vmm`: the commands a live-migration workflow calls, so that an existing workflow
//! gains rdmamig by changing one command.
//!
//! - `pre-migrate` (on the source, before the workflow migrates): the guest agent quiesces
//!   every RDMA connection and releases the NIC, then the NIC is hot-unplugged. If the
//!   unplug does not complete (a process the agent does not know holds the NIC) the hook
//!   fails, so the workflow stops; it tries to resume the connections on the source and
//!   reports whether that worked (on Linux the unplug stays pending and the port is already
//!   down, so usually not: the holder must go, and the NIC with it).
//! - `post-migrate` (on the destination, after the migration): the new NIC is hot-plugged
//!   and the agent resumes every connection on it.
//! - `migrate` (in place of `ch-remote send-migration <destination_url>`): the whole
//!   coordinated move, through the rdmamig daemon (`rdmamig migrate`), with the same
//!   destination argument.
//!
//! The hooks talk to the VMM through the plugin's `Vmm` trait (QEMU: `--qmp`; Cloud
//! Hypervisor: `--api-socket`) and to the agent through the VMM's channel (virtio-serial:
//! `--agent`; hybrid vsock: `--vsock`). Each prints one JSON line saying what it did.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use rdmamig_migrator::agent::AgentClient;
use rdmamig_migrator::mover::error_chain;
use rdmamig_vmm::cloud_hypervisor::DEFAULT_AGENT_PORT;
use rdmamig_vmm::{ChConfig, ChVmm, DeviceSpec, QemuConfig, QemuVmm, Vmm};
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
    /// `ch-remote send-migration <destination_url>` (QEMU endpoints).
    Migrate(Box<MigrateArgs>),
}

#[derive(Args)]
struct MigrateArgs {
    /// Where the migration stream goes: unix:PATH or tcp:HOST:PORT (as ch-remote takes it).
    destination_url: String,
    /// The longest the migration may take, in seconds (the migrate phase's deadline).
    #[arg(long)]
    migration_timeout_s: Option<u64>,
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
    /// The destination QEMU's QMP socket (started with -incoming defer).
    #[arg(long)]
    to_qmp: PathBuf,
    /// The destination's agent socket.
    #[arg(long)]
    to_agent: PathBuf,
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
        } => (
            "pre-migrate",
            runtime.block_on(pre_migrate(
                &cli.vmm,
                &detach,
                Duration::from_millis(quiesce_ms),
                Duration::from_millis(detach_ms),
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

async fn connect(args: &VmmArgs) -> Result<Box<dyn Vmm>, Failure> {
    match (&args.qmp, &args.api_socket) {
        (Some(qmp), None) => {
            if args.vsock.is_some() {
                return Err(usage(
                    "with --qmp the agent is reached over virtio-serial (--agent)",
                ));
            }
            let mut config = QemuConfig::new(qmp);
            config.agent.clone_from(&args.agent);
            QemuVmm::connect(config)
                .await
                .map(|vmm| Box::new(vmm) as Box<dyn Vmm>)
                .map_err(|e| failed(error_chain(&e), Value::Null))
        }
        (None, Some(api)) => {
            if args.agent.is_some() {
                return Err(usage(
                    "with --api-socket the agent is reached over hybrid vsock (--vsock)",
                ));
            }
            let mut config = ChConfig::new(api);
            config.vsock.clone_from(&args.vsock);
            config.agent_port = args.agent_port;
            ChVmm::connect(config)
                .await
                .map(|vmm| Box::new(vmm) as Box<dyn Vmm>)
                .map_err(|e| failed(error_chain(&e), Value::Null))
        }
        _ => Err(usage(
            "give the VMM: --qmp PATH (QEMU) or --api-socket PATH (Cloud Hypervisor)",
        )),
    }
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn pre_migrate(
    args: &VmmArgs,
    detach: &str,
    quiesce_deadline: Duration,
    detach_deadline: Duration,
) -> Result<Value, Failure> {
    let vmm = connect(args).await?;
    let start = Instant::now();
    let mut agent = agent(&*vmm, quiesce_deadline).await?;
    let connections = agent
        .list_connections(quiesce_deadline.saturating_sub(start.elapsed()))
        .await
        .map_err(|e| failed(error_chain(&e), Value::Null))?;
    let ids: Vec<_> = connections.iter().map(|c| c.id).collect();
    let quiesced = agent
        .quiesce(&ids, quiesce_deadline.saturating_sub(start.elapsed()))
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
    });
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
    let (Some(qmp), None) = (&vmm.qmp, &vmm.api_socket) else {
        eprintln!(
            "rdmamig-vmm migrate: the rdmamig daemon moves QEMU VMs (--qmp); for Cloud \
             Hypervisor run the pre-migrate and post-migrate hooks around \
             `ch-remote send-migration`"
        );
        return ExitCode::from(2);
    };
    let Some(agent) = &vmm.agent else {
        eprintln!("rdmamig-vmm migrate: the coordinated move needs the source agent (--agent)");
        return ExitCode::from(2);
    };
    let mut command = std::process::Command::new(&args.rdmamig);
    command
        .arg("migrate")
        .arg("--socket")
        .arg(&args.socket)
        .args(["--vm", &args.vm, "--strategy", "reconnect"])
        .arg("--qmp")
        .arg(qmp)
        .arg("--agent")
        .arg(agent)
        .args(["--detach", &args.detach])
        .arg("--to-qmp")
        .arg(&args.to_qmp)
        .arg("--to-agent")
        .arg(&args.to_agent)
        .args(["--attach", &args.attach, "--via", &args.destination_url]);
    if let Some(timeout) = args.migration_timeout_s {
        command
            .arg("--deadline")
            .arg(format!("migrate={}", timeout.saturating_mul(1000)));
    }
    if let Some(report) = &args.report {
        command.arg("--report").arg(report);
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
