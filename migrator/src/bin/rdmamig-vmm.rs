//! `rdmamig-vmm`: the commands a live-migration workflow calls, so that an existing workflow
//! gains rdmamig by changing one command.
//!
//! - `pre-migrate` (on the source, before the workflow migrates) and `post-migrate` (after
//!   it): one move, run by the migrator's own runner in two processes, with one journal and
//!   one report under `--state-dir` (`<dir>/moves/<id>.journal`, `<id>.json`).
//!   `pre-migrate` runs prepare (the agent lists the connections and the programs that hold
//!   an RDMA device without the library; `--unmanaged` decides as for `rdmamig migrate`),
//!   quiesce and detach, then hands the move over to the workflow; a failure rolls back on
//!   the source (the NIC plugged back with `--reattach`, the connections resumed) and the
//!   hook fails, so the workflow stops. `post-migrate` goes on from that journal: it
//!   confirms that the VM runs on the destination, plugs the new NIC and resumes every
//!   connection; a failure before the resume rolls back as a daemon's move does (the
//!   destination's copy is discarded, the source runs again with its NIC plugged back).
//! - `migrate`, also named `send-migration` (in place of `ch-remote send-migration
//!   destination_url=...,downtime_ms=...`, whose option list it takes, [`ch_remote`]): the
//!   whole coordinated move, through the rdmamig daemon, with the same destination
//!   arguments and the migration's limits, and the flags of `rdmamig migrate`.
//!
//! Every command names the VM's VMM and agent channel as `rdmamig migrate` names its source
//! (the flags are the same declaration, [`rdmamig_migrator::flags`]). Each hook prints what
//! happened as it happens (stderr) and one JSON line at the end (stdout).

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use rdmamig_migrator::backends::VmmBackends;
use rdmamig_migrator::ch_remote;
use rdmamig_migrator::cli::{self, write_report};
use rdmamig_migrator::flags::{GuestFlags, MoveFlags, VmmFlags, DEFAULT_SOCKET};
use rdmamig_migrator::journal::{self, Journal};
use rdmamig_migrator::machine::Phase;
use rdmamig_migrator::moving::{run_after_handover, run_to_handover, MoveContext};
use rdmamig_migrator::plan::{MigrationBy, MovePlan, Strategy};
use rdmamig_migrator::pool::{Pool, PoolConfig};
use rdmamig_migrator::report::{MoveEvent, MoveReport, VmLocation};
use rdmamig_migrator::strategy::choose_for;
use rdmamig_proto::text::error_chain;
use rdmamig_vmm::{ChConfig, ChVmm, DeviceSpec, VfioHandover, Vmm};
use serde_json::{json, Value};
use tokio::sync::mpsc;

#[derive(Parser)]
#[command(
    name = "rdmamig-vmm",
    version,
    about = "Hooks and a migrate wrapper that add rdmamig to a live-migration workflow",
    long_about = "Hooks and a migrate wrapper that add rdmamig to a live-migration workflow.\n\n\
The hooks are one move in two steps, journaled under --state-dir like a daemon's move: \
pre-migrate (prepare, quiesce, detach) hands the move over to the workflow and prints its \
id; post-migrate goes on from that journal (confirm the VM arrived, attach, resume). A \
failure rolls back as a daemon's move does, and the hook fails.\n\n\
QEMU (around `virsh migrate` or QMP migrate):\n  \
rdmamig-vmm --qmp /run/vm1/qmp.sock --agent /run/vm1/agent.sock pre-migrate --detach nic0 \\\n    \
--reattach 'driver=vfio-pci,host=0000:3b:02.1,id=nic0,bus=rp1'\n  \
... the workflow migrates the VM ...\n  \
rdmamig-vmm --qmp /run/vm1-dst/qmp.sock --agent /run/vm1-dst/agent.sock post-migrate \\\n    \
--attach 'driver=vfio-pci,host=0000:3b:02.2,id=vf1,bus=rp1'\n\n\
Cloud Hypervisor (around `ch-remote send-migration`):\n  \
rdmamig-vmm --api-socket /run/vm1/api.sock --vsock /run/vm1/vsock.sock pre-migrate --detach vf0\n  \
ch-remote --api-socket /run/vm1/api.sock send-migration destination_url=unix:/run/vm1/mig.sock\n  \
rdmamig-vmm --api-socket /run/vm1-dst/api.sock --vsock /run/vm1-dst/vsock.sock post-migrate \\\n    \
--attach 'driver=vfio-pci,host=0000:3b:02.1,id=vf1'\n\n\
Or the whole move in one command through the rdmamig daemon, in place of \
`ch-remote --api-socket /run/vm1/api.sock send-migration \
destination_url=tcp:dst-host:6000,downtime_ms=200` (the same option list):\n  \
rdmamig-vmm --api-socket /run/vm1/api.sock --vsock /run/vm1/vsock.sock \\\n    \
--event-monitor /run/vm1/events.json \\\n    \
send-migration destination_url=tcp:dst-host:6000,downtime_ms=200 \\\n    \
--to-api-socket /run/vm1-dst/api.sock --to-vsock /run/vm1-dst/vsock.sock \\\n    \
--vm vm1 --detach vf0 --attach 'driver=vfio-pci,host=0000:3b:02.1,id=vf1'\n\n\
Exit status: 0 done, 1 failed (the JSON line and stderr say why), 2 usage; migrate as \
`rdmamig migrate` (4 rolled back, 3 the daemon could not be asked)."
)]
struct Cli {
    #[command(flatten, next_help_heading = "The VM's VMM (one of)")]
    vmm: VmmFlags,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// On the source, before the migration: quiesce every connection, unplug the NIC, hand
    /// the move over to the workflow.
    PreMigrate(Box<PreMigrateArgs>),
    /// On the destination, after the migration: confirm the VM arrived, plug the new NIC,
    /// resume every connection.
    PostMigrate(PostMigrateArgs),
    /// The whole coordinated move through the rdmamig daemon, in place of
    /// `ch-remote send-migration destination_url=...,downtime_ms=...` (also named
    /// send-migration, and taking ch-remote's option list).
    #[command(visible_alias = "send-migration")]
    Migrate(Box<MigrateArgs>),
    /// Cloud Hypervisor, on the destination of a workflow's migration: ch-remote's
    /// `receive-migration receiver_url=...[,tls_dir=...]`, answered once the VM has arrived
    /// (exit 0) or the migration failed (exit 1, with the receiver's error chain). A VM a
    /// failed receive left `Created` is deleted first, so the same VMM can receive again.
    ReceiveMigration(ReceiveMigrationArgs),
}

/// Where the hooks keep their moves when no --state-dir is given.
const DEFAULT_STATE_DIR: &str = "/var/lib/rdmamig/hooks";

/// How far past the migration's own timeout the move's migrate deadline lies: the VMM's
/// timeout strategy decides, not the deadline.
const DEADLINE_PAST_TIMEOUT_S: u64 = 10;

#[derive(Args)]
struct StateFlags {
    /// Where the hooks keep each move's journal and report (`<dir>/moves/`); post-migrate
    /// goes on from pre-migrate's journal there (on another host, copy
    /// `<dir>/moves/<id>.journal` there first). Not the daemon's state directory: its
    /// recovery would take these moves for its own.
    #[arg(long, env = "RDMAMIG_HOOKS_DIR", default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Also write the move's JSON report here (post-migrate, or a failed pre-migrate).
    #[arg(long)]
    report: Option<PathBuf>,
}

impl StateFlags {
    fn moves(&self) -> PathBuf {
        self.state_dir.join("moves")
    }
}

#[derive(Args)]
struct PreMigrateArgs {
    /// The id of the NIC to unplug.
    #[arg(long)]
    detach: String,
    /// The NIC to plug back on the source if the move rolls back after the unplug, as
    /// device properties (without it such a rollback cannot give the VM its NIC back).
    #[arg(long)]
    reattach: Option<DeviceSpec>,
    /// The VM's name in messages and the report (default: its VMM's control socket).
    #[arg(long)]
    vm: Option<String>,
    /// The same as --strategy bridge: connections with a TCP bridge carry their messages
    /// over it until post-migrate has brought the RDMA path back.
    #[arg(long)]
    bridge: bool,
    #[command(flatten, next_help_heading = "The guest")]
    guest: GuestFlags,
    #[command(flatten)]
    state: StateFlags,
}

#[derive(Args)]
struct PostMigrateArgs {
    /// The NIC to plug, as device properties:
    /// 'driver=vfio-pci,host=0000:3b:02.1,id=vf1' (QEMU also takes bus=, netdev=, ...).
    #[arg(long)]
    attach: DeviceSpec,
    /// The move pre-migrate handed over (its JSON line's `move`); default: the one move
    /// handed over in --state-dir.
    #[arg(long = "move", value_name = "ID")]
    move_id: Option<String>,
    #[command(flatten)]
    state: StateFlags,
}

#[derive(Args)]
struct MigrateArgs {
    /// Where the migration stream goes: unix:PATH or tcp:HOST:PORT, or ch-remote's option
    /// list: destination_url=URL[,downtime_ms=MS][,timeout_s=S][,timeout_strategy=cancel|ignore]
    /// [,local=on|off][,connections=N][,tls_dir=DIR] (what is given there is not also
    /// given as a flag; tls_dir= needs --to-tls-dir for the destination).
    #[arg(value_name = "DESTINATION_URL|OPTIONS")]
    destination_url: String,
    /// The daemon's socket.
    #[arg(long, env = "RDMAMIG_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(flatten)]
    the_move: MoveFlags,
}

#[derive(Args)]
struct ReceiveMigrationArgs {
    /// ch-remote's option list: receiver_url=tcp:HOST:PORT|unix:PATH[,tls_dir=DIR]
    /// [,vfio_fds=[ID@FD,...],iommufd_fd=FD]. The descriptors are the caller's, open when
    /// rdmamig-vmm starts (`exec 5<>/dev/vfio/devices/vfio0 6<>/dev/iommu`), and are handed
    /// to Cloud Hypervisor with the request (SCM_RIGHTS), each under its device's id.
    #[arg(value_name = "OPTIONS")]
    options: String,
    /// The longest the migration may take to arrive, s.
    #[arg(long, default_value_t = 3600)]
    timeout_s: u64,
}

/// A hook's failure: what to print, and whether it is the caller's mistake.
enum Failure {
    /// Bad arguments: nothing was done (exit 2).
    Usage(String),
    /// The hook could not run its move, or the move failed (exit 1).
    Failed { message: String, report: Value },
}

fn failed(message: impl Into<String>) -> Failure {
    Failure::Failed {
        message: message.into(),
        report: json!({}),
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
    // Descriptors a receive hands over are adopted before this process opens any of its own
    // (the runtime's): a number the caller did not open is then found closed, never taken
    // for one of rdmamig-vmm's.
    let receive = match &cli.command {
        Command::ReceiveMigration(args) => match adopt_handover(&args.options) {
            Ok(adopted) => Some(adopted),
            Err(message) => {
                eprintln!("rdmamig-vmm receive-migration: {message}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("rdmamig-vmm: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (hook, result) = match cli.command {
        Command::Migrate(args) => return migrate(&runtime, &cli.vmm, *args),
        Command::PreMigrate(args) => (
            "pre-migrate",
            runtime.block_on(pre_migrate(&cli.vmm, *args)),
        ),
        Command::PostMigrate(args) => (
            "post-migrate",
            runtime.block_on(post_migrate(&cli.vmm, args)),
        ),
        Command::ReceiveMigration(args) => (
            "receive-migration",
            runtime.block_on(receive_migration(
                &cli.vmm,
                receive.expect("adopted above"),
                args.timeout_s,
            )),
        ),
    };
    match result {
        Ok(mut line) => {
            line["hook"] = hook.into();
            line["ok"] = true.into();
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(Failure::Usage(message)) => {
            eprintln!("rdmamig-vmm {hook}: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Failed {
            message,
            mut report,
        }) => {
            eprintln!("rdmamig-vmm {hook}: {message}");
            report["hook"] = hook.into();
            report["ok"] = false.into();
            report["error"] = message.into();
            println!("{report}");
            ExitCode::FAILURE
        }
    }
}

/// What the hooks need besides the plan: the VMMs through the migrator's backends, and no
/// pool (a workflow's move plugs what it is told).
fn context(state: &StateFlags) -> Result<MoveContext, Failure> {
    let pool = Pool::open(&PoolConfig::default(), &state.state_dir.join("pool.json"))
        .map_err(|e| failed(error_chain(&e)))?;
    Ok(MoveContext {
        backends: Arc::new(VmmBackends),
        pool: Arc::new(pool),
        peers: None,
        boundary: None,
    })
}

/// Prints the move's events as they come (stderr: stdout is the JSON line), until the move
/// drops its sender.
fn progress() -> (
    mpsc::UnboundedSender<MoveEvent>,
    tokio::task::JoinHandle<()>,
) {
    let (events, mut received) = mpsc::unbounded_channel();
    let printer = tokio::spawn(async move {
        while let Some(event) = received.recv().await {
            eprintln!("{}", cli::render_event(&event));
        }
    });
    (events, printer)
}

async fn pre_migrate(vmm: &VmmFlags, args: PreMigrateArgs) -> Result<Value, Failure> {
    let source = vmm
        .endpoint("VM")
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let strategy = if args.bridge {
        Strategy::Bridge
    } else {
        args.guest.strategy
    };
    if !matches!(strategy, Strategy::Reconnect | Strategy::Bridge) {
        return Err(Failure::Usage(format!(
            "the hooks run strategy reconnect or bridge, not {strategy} (the workflow \
             migrates; use `migrate` for the others)"
        )));
    }
    let plan = MovePlan {
        vm: args
            .vm
            .clone()
            .unwrap_or_else(|| source.control_socket().display().to_string()),
        source,
        destination: None,
        destination_migrator: None,
        detach: args.detach.clone(),
        attach: None,
        reattach: args.reattach.clone(),
        migration: MigrationBy::Workflow,
        from_pool: false,
        source_function: None,
        unmanaged: Some(args.guest.unmanaged().unwrap_or_default()),
        via: String::new(),
        limits: Default::default(),
        strategy,
        deadlines: args
            .guest
            .deadlines()
            .map_err(|e| Failure::Usage(e.to_string()))?,
    };
    plan.validate().map_err(|e| Failure::Usage(e.to_string()))?;
    let context = context(&args.state)?;
    let choice = choose_for(&plan, context.backends.as_ref(), &context.pool)
        .await
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let id = journal::move_id(&plan.vm, u64::from(std::process::id()));
    let journal =
        Journal::create(&args.state.moves(), &id, &plan).map_err(|e| failed(error_chain(&e)))?;
    let journal_path = journal.path().to_path_buf();
    let (events, printer) = progress();
    let report = run_to_handover(id, plan, choice, journal, context, events).await;
    let _ = printer.await;
    let mut line = summary(&report);
    line["journal"] = journal_path.display().to_string().into();
    if report.ok {
        // Kept for post-migrate: the final report then holds the whole move.
        let path = handover_report(&args.state, &report.id);
        write_report(&report, &path).map_err(|e| failed(error_chain(&e)))?;
        line["handed_over"] = true.into();
        return Ok(line);
    }
    store(&args.state, &report, &mut line);
    Err(failure(&report, line))
}

/// Parses a receive's options and takes ownership of the descriptors they hand over.
fn adopt_handover(options: &str) -> Result<(ch_remote::ReceiveMigration, VfioHandover), String> {
    let options = ch_remote::parse_receive_migration(options).map_err(|e| e.to_string())?;
    let adopt = |fd: RawFd| -> Result<Arc<OwnedFd>, String> {
        // SAFETY: F_GETFD only reads the descriptor's flags; it fails on a closed number.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
            return Err(format!(
                "descriptor {fd} is not open in rdmamig-vmm: open it in the calling shell \
                 (exec {fd}<>/dev/vfio/devices/vfioN, or /dev/iommu for iommufd_fd)"
            ));
        }
        // SAFETY: `fd` is open (checked above), 3 or more and named once (the parser refuses
        // the standard streams and repeats), and this process has opened nothing of its own
        // yet: it was inherited from the caller, who hands it over, so this is its one owner.
        Ok(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }))
    };
    let mut handover = VfioHandover::default();
    for (id, fd) in &options.vfio_fds {
        handover.devices.push((id.clone(), adopt(*fd)?));
    }
    handover.iommufd = options.iommufd_fd.map(adopt).transpose()?;
    Ok((options, handover))
}

/// Receives a migration into the Cloud Hypervisor at `--api-socket`, as ch-remote does.
async fn receive_migration(
    vmm: &VmmFlags,
    (options, handover): (ch_remote::ReceiveMigration, VfioHandover),
    timeout_s: u64,
) -> Result<Value, Failure> {
    let Some(api_socket) = &vmm.api_socket else {
        return Err(Failure::Usage(
            "receive-migration is Cloud Hypervisor's: give its --api-socket (QEMU receives \
             with migrate-incoming)"
                .into(),
        ));
    };
    if options.tls_dir.is_some() && vmm.tls_dir.is_some() {
        return Err(Failure::Usage(
            "tls_dir is given twice: in the option list and as --tls-dir".into(),
        ));
    }
    let mut config = ChConfig::new(api_socket);
    config.tls_dir = options.tls_dir.or_else(|| vmm.tls_dir.clone());
    config.receive_timeout = Duration::from_secs(timeout_s);
    let started = Instant::now();
    let ch = ChVmm::connect(config)
        .await
        .map_err(|e| failed(error_chain(&e)))?;
    ch.prepare_incoming(&options.receiver_url, handover)
        .await
        .map_err(|e| failed(error_chain(&e)))?;
    eprintln!(
        "rdmamig-vmm receive-migration: receiving on {} (at most {} s)",
        options.receiver_url, timeout_s
    );
    ch.wait_received(Duration::from_secs(timeout_s))
        .await
        .map_err(|e| failed(error_chain(&e)))?;
    Ok(json!({
        "receiver_url": options.receiver_url,
        "received_ms": u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    }))
}

async fn post_migrate(vmm: &VmmFlags, args: PostMigrateArgs) -> Result<Value, Failure> {
    let destination = vmm
        .endpoint("VM")
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let path = handed_over(&args.state, args.move_id.as_deref())?;
    let replay = journal::read(&path).map_err(|e| failed(error_chain(&e)))?;
    let journal = Journal::reopen(&path).map_err(|e| failed(error_chain(&e)))?;
    let earlier = std::fs::read(handover_report(&args.state, &replay.id))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<MoveReport>(&bytes).ok());
    let context = context(&args.state)?;
    let (events, printer) = progress();
    let report = run_after_handover(
        replay,
        journal,
        destination,
        args.attach,
        earlier,
        context,
        events,
    )
    .await
    .map_err(|e| failed(format!("{}. Nothing was changed", error_chain(&e))))?;
    let _ = printer.await;
    let mut line = summary(&report);
    line["journal"] = path.display().to_string().into();
    let _ = std::fs::remove_file(handover_report(&args.state, &report.id));
    store(&args.state, &report, &mut line);
    if report.ok {
        return Ok(line);
    }
    Err(failure(&report, line))
}

/// The journal of the move to go on with: `id`'s, or the one move handed over in the state
/// directory.
fn handed_over(state: &StateFlags, id: Option<&str>) -> Result<PathBuf, Failure> {
    let moves = state.moves();
    if let Some(id) = id {
        if !journal::is_move_id(id) {
            return Err(Failure::Usage(format!("{id:?} is not a move id")));
        }
        let path = moves.join(format!("{id}.journal"));
        if !path.exists() {
            return Err(failed(format!(
                "no journal of move {id} in {}: run post-migrate with the --state-dir \
                 pre-migrate used (on another host, copy the journal there first)",
                moves.display()
            )));
        }
        return Ok(path);
    }
    let scan = journal::scan(&moves).map_err(|e| failed(error_chain(&e)))?;
    let waiting: Vec<_> = scan
        .unfinished
        .into_iter()
        .filter(|(_, replay)| replay.handed_over().is_some())
        .collect();
    match waiting.as_slice() {
        [(path, _)] => Ok(path.clone()),
        [] => Err(failed(format!(
            "no move handed over in {}: run pre-migrate first, with the same --state-dir \
             (on another host, copy its journal there)",
            moves.display()
        ))),
        several => Err(Failure::Usage(format!(
            "{} moves are handed over in {}; name one with --move: {}",
            several.len(),
            moves.display(),
            several
                .iter()
                .map(|(_, replay)| format!("{} (VM {})", replay.id, replay.plan.vm))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn handover_report(state: &StateFlags, id: &str) -> PathBuf {
    state.moves().join(format!("{id}.handover.json"))
}

/// Stores the ended move's report (`<dir>/moves/<id>.json`, its timeline beside it, and
/// --report) and says where in `line` (`report`; `report_error` when it could not).
fn store(state: &StateFlags, report: &MoveReport, line: &mut Value) {
    let stored = state.moves().join(format!("{}.json", report.id));
    let mut targets = vec![stored.clone()];
    targets.extend(state.report.clone());
    for path in &targets {
        if let Err(e) = write_report(report, path) {
            line["report_error"] = error_chain(&e).into();
        }
    }
    if let Err(e) = cli::write_svg(report, &stored.with_extension("svg")) {
        tracing::warn!("{}", error_chain(&e));
    }
    line["report"] = stored.display().to_string().into();
}

/// The failure a hook whose move failed ends with.
fn failure(report: &MoveReport, line: Value) -> Failure {
    let error = report.error.as_deref().unwrap_or("the move failed");
    let message = match (&report.rollback_error, report.final_phase) {
        (Some(rollback), _) => format!("{error}; the rollback failed: {rollback}"),
        // Prepare only lists: a move refused there changed nothing.
        (None, Phase::RolledBack) if report.failed_phase == Some(Phase::Prepare) => {
            format!("{error}. Nothing was changed")
        }
        (None, Phase::RolledBack) => {
            format!("{error}; rolled back: the VM runs on the source with its NIC")
        }
        (None, _) => {
            let side = match report.vm_location {
                VmLocation::Source => "source",
                VmLocation::Destination => "destination",
            };
            format!("{error}; the VM is on the {side}")
        }
    };
    Failure::Failed {
        message,
        report: line,
    }
}

/// The hook's JSON line: the move, how far it got, and the figures a workflow checks.
fn summary(report: &MoveReport) -> Value {
    let ok = |outcomes: &[rdmamig_proto::agent::ConnectionOutcome]| {
        outcomes.iter().filter(|o| o.ok).count()
    };
    let not = |outcomes: &[rdmamig_proto::agent::ConnectionOutcome]| {
        outcomes
            .iter()
            .filter(|o| !o.ok)
            .map(|o| {
                format!(
                    "{:016x}: {}",
                    o.id,
                    o.error.as_deref().unwrap_or("no reason given")
                )
            })
            .collect::<Vec<_>>()
    };
    let mut line = json!({
        "move": report.id,
        "vm": report.plan.vm,
        "phase": report.final_phase.name(),
        "vm_location": report.vm_location,
        "connections": report.connections.len(),
        "quiesced": ok(&report.quiesce),
        "not_quiesced": not(&report.quiesce),
        "unmanaged_policy": report.plan.unmanaged.unwrap_or_default().to_string(),
        "unmanaged": report.unmanaged,
        "forced": report.forced,
    });
    if report.final_phase == Phase::Done || !report.resume.is_empty() {
        line["resumed"] = ok(&report.resume).into();
        line["not_resumed"] = not(&report.resume).into();
    }
    if let Some(error) = &report.rollback_error {
        line["rollback_error"] = error.clone().into();
    }
    if let Some(failed) = report.failed_phase {
        line["failed_phase"] = failed.name().into();
    }
    for record in &report.timeline.phases {
        line[format!("{}_ms", record.phase.name())] = record.duration_ms.into();
        if record.phase == Phase::Attach {
            // The device's id and its PCI address in the guest, as the hook's caller knows
            // them.
            for (detail, key) in [("device", "device"), ("guest_bdf", "bdf")] {
                if let Some(value) = record.details.get(detail) {
                    line[key] = value.clone();
                }
            }
        }
    }
    line
}

/// `rdmamig migrate` in-process, from the wrapper's arguments: the migration stream goes to
/// `destination_url`, and the migrate deadline lies past the migration's timeout.
fn migrate(runtime: &tokio::runtime::Runtime, vmm: &VmmFlags, mut args: MigrateArgs) -> ExitCode {
    let mut vmm = vmm.clone();
    if ch_remote::is_option_list(&args.destination_url) {
        let adopted = ch_remote::parse_send_migration(&args.destination_url)
            .map_err(|e| e.to_string())
            .and_then(|options| {
                args.the_move.limits.adopt(&options)?;
                if let Some(dir) = options.tls_dir {
                    if vmm.tls_dir.is_some() {
                        return Err(
                            "tls_dir is given twice: in the option list and as --tls-dir".into(),
                        );
                    }
                    vmm.tls_dir = Some(dir);
                }
                Ok(options.destination_url)
            });
        match adopted {
            Ok(url) => args.destination_url = url,
            Err(e) => {
                eprintln!("rdmamig-vmm migrate: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let guest = &mut args.the_move.guest;
    if let Some(timeout) = args.the_move.limits.migration_timeout_s {
        if !guest.deadlines.iter().any(|d| d.starts_with("migrate=")) {
            let ms = timeout
                .saturating_add(DEADLINE_PAST_TIMEOUT_S)
                .saturating_mul(1000);
            guest.deadlines.push(format!("migrate={ms}"));
        }
    }
    let plan = match args.the_move.plan(&vmm, args.destination_url) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("rdmamig-vmm migrate: {e}");
            return ExitCode::from(2);
        }
    };
    cli::run_migrate(
        runtime,
        "rdmamig-vmm migrate",
        &args.socket,
        plan,
        &args.the_move.output,
    )
}
