//! `rdmamig`: the daemon that moves VMs with passthrough RDMA NICs, and the command that asks
//! it to.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use rdmamig_migrator::api::ClientRequest;
use rdmamig_migrator::backends::VmmBackends;
use rdmamig_migrator::cli::{self, Output};
use rdmamig_migrator::config::{Config, ConfigError, PeerConfig};
use rdmamig_migrator::daemon::DaemonConfig;
use rdmamig_migrator::flags::{MoveFlags, VmmFlags, DEFAULT_SOCKET};
use rdmamig_migrator::moving::{BoundaryHook, MoveContext};
use rdmamig_migrator::peer::{PeerError, PeerTls};
use rdmamig_migrator::pool::{Pool, PoolError};
use rdmamig_migrator::retention::Retention;
use rdmamig_migrator::sriov::{self, SriovError};
use rdmamig_migrator::vfio::Sysfs;
use rdmamig_proto::text::error_chain;

/// The daemon's state directory when none is given.
const DEFAULT_STATE_DIR: &str = "/var/lib/rdmamig";

/// Fault injection for the crash tests, only in builds with the `fault-injection` feature:
/// the daemon aborts once it has journaled this phase (a phase name, or `rollback`), as if it
/// were killed at that phase boundary.
#[cfg(feature = "fault-injection")]
const CRASH_AT_ENV: &str = "RDMAMIG_CRASH_AT";

#[derive(Parser)]
#[command(
    name = "rdmamig",
    version,
    about = "Keep RDMA connections alive while a VM with a passthrough RDMA NIC live-migrates",
    long_about = "Keep RDMA connections alive while a VM with a passthrough RDMA NIC live-migrates.\n\n\
A move: prepare (both VMMs ready, the guest agent lists the connections), quiesce (the agent \
pauses every connection and releases the NIC), detach (hot-unplug, the guest acknowledges), \
migrate (live migration to the destination VMM), attach (hot-plug a NIC on the destination), \
resume (the agent reconnects every connection). Every phase has a deadline.\n\n\
Start the daemon once per host, then ask it for moves:\n\n  \
rdmamig daemon --socket /run/rdmamig/rdmamig.sock\n  \
rdmamig migrate --socket /run/rdmamig/rdmamig.sock --vm vm1 \\\n    \
--qmp /run/vm1/qmp.sock --agent /run/vm1/agent.sock --detach nic0 \\\n    \
--to-qmp /run/vm1-dst/qmp.sock --to-agent /run/vm1-dst/agent.sock \\\n    \
--attach 'driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1,mac=52:54:00:77:00:11' \\\n    \
--via unix:/run/vm1-dst/mig.sock --report move.json"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: listen on a UNIX socket (mode 0600) and run moves for root and the
    /// daemon's own user.
    Daemon {
        /// The socket to listen on.
        #[arg(long, env = "RDMAMIG_SOCKET", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        /// Where move journals and reports are kept (`<dir>/moves/`). Unfinished moves found
        /// there at start-up are finished or rolled back.
        #[arg(long, env = "RDMAMIG_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// The config file (TOML; its [pool] table lists this host's passthrough functions).
        /// Without it the pool is empty.
        #[arg(long, env = "RDMAMIG_CONFIG")]
        config: Option<PathBuf>,
        /// Serve Prometheus metrics over HTTP on this address (e.g. 127.0.0.1:9477).
        #[arg(long)]
        metrics: Option<std::net::SocketAddr>,
        /// How many moves (of different VMs) may run at once.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
        max_moves: u16,
        /// Keep the journals and reports of at most this many finished moves (the newest);
        /// an unfinished move's journal is never pruned.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        keep_moves: u32,
        /// Also prune finished moves older than this many days.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        keep_moves_days: Option<u32>,
    },
    /// This host's passthrough functions and their states; `pool return NAME` puts a
    /// quarantined function back into use once it passes its reset.
    Pool {
        /// The daemon's socket.
        #[arg(long, env = "RDMAMIG_SOCKET", default_value = DEFAULT_SOCKET, global = true)]
        socket: PathBuf,
        /// Print JSON.
        #[arg(long, global = true)]
        json: bool,
        #[command(subcommand)]
        action: Option<PoolAction>,
    },
    /// The moves running now.
    Status {
        /// The daemon's socket.
        #[arg(long, env = "RDMAMIG_SOCKET", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The moves that ended, newest first.
    History {
        /// The daemon's socket.
        #[arg(long, env = "RDMAMIG_SOCKET", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The report of one ended move (its id is in `rdmamig history`).
    Report {
        /// The move's id.
        id: String,
        /// Also draw its timeline as SVG here.
        #[arg(long)]
        svg: Option<PathBuf>,
        /// The daemon's socket.
        #[arg(long, env = "RDMAMIG_SOCKET", default_value = DEFAULT_SOCKET)]
        socket: PathBuf,
        /// Print the JSON report.
        #[arg(long)]
        json: bool,
    },
    /// Move a VM to another VMM process, keeping its RDMA connections.
    #[command(
        long_about = "Move a VM to another VMM process, keeping its RDMA connections.\n\n\
Each end names its VMM: QEMU (--qmp, agent on virtio-serial --agent) or Cloud Hypervisor \
(--api-socket, agent on hybrid vsock --vsock, optional --event-monitor); the destination the \
same with --to-. The destination VMM must already run: QEMU with the VM's configuration minus \
the detached NIC and `-incoming defer`, Cloud Hypervisor without a VM (the move sends its \
vm.receive-migration). The move confirms on the destination that the VM arrived before it \
plugs the new NIC; a migration the destination did not receive rolls back. Progress is printed as it happens, then the timeline with every phase's \
duration. Exit status: 0 when the move is done, 4 when it failed and was rolled back (the VM \
runs on the source with its device, connections resumed), 1 when it failed and could not be \
rolled back (the message says which phase, why, and where the VM is), 2 for usage errors, 3 \
when the daemon could not be asked.\n\n\
QEMU:\n  \
rdmamig migrate --vm vm1 --qmp src/qmp.sock --agent src/agent.sock --detach nic0 \\\n    \
--to-qmp dst/qmp.sock --to-agent dst/agent.sock \\\n    \
--attach 'driver=vfio-pci,host=0000:5e:02.3,id=vf1,bus=rp1' --via unix:dst/mig.sock\n\n\
Cloud Hypervisor, with the migration's limits (as ch-remote send-migration takes them):\n  \
rdmamig migrate --vm vm1 --api-socket /run/vm1/api.sock --vsock /run/vm1/vsock.sock \\\n    \
--event-monitor /run/vm1/events.json --detach vf0 \\\n    \
--to-api-socket /run/vm1-dst/api.sock --to-vsock /run/vm1-dst/vsock.sock \\\n    \
--attach 'driver=vfio-pci,host=0000:5e:02.3,id=vf1' --via tcp:dst-host:6000 \\\n    \
--downtime-ms 300 --migration-timeout-s 50\n\n\
Baseline without the guest agent (what operators do today):\n  \
rdmamig migrate --vm vm1 --qmp src/qmp.sock --detach nic0 --to-qmp dst/qmp.sock \\\n    \
--attach driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1 --via unix:dst/mig.sock \\\n    \
--strategy naive\n\n\
Tighter deadlines for the unplug and the migration:\n  \
... --deadline detach=2000 --deadline migrate=30000\n\n\
To another host, whose migrator (listed as hostB in [[peer.known]] of this daemon's \
config, with its address) takes a function from its own pool:\n  \
rdmamig migrate --vm vm1 --qmp src/qmp.sock --agent src/agent.sock --detach nic0 \\\n    \
--destination-migrator hostB --to-qmp /run/vm1/qmp.sock --to-agent /run/vm1/agent.sock \\\n    \
--from-pool --attach driver=vfio-pci,id=nic1,bus=rp1 --via tcp:hostB:4444"
    )]
    Migrate(Box<MigrateArgs>),
}

#[derive(Subcommand)]
enum PoolAction {
    /// Put a quarantined function back into the pool after you fixed it. The daemon resets
    /// it first (a VF through VFIO: bound to vfio-pci, viable IOMMU group, reset supported)
    /// and refuses, leaving it quarantined, when that fails; any other state is refused.
    Return {
        /// The function's name (see `rdmamig pool`).
        function: String,
    },
    /// Record that a VM you started outside a move holds a free function (you gave it that
    /// VF), so that no move hands the function out and a move of the VM gives it back
    /// (`rdmamig migrate --source-function`). Anything but a free function is refused.
    Assign {
        /// The function's name (see `rdmamig pool`).
        function: String,
        /// The VM that holds it.
        #[arg(long)]
        vm: String,
    },
}

#[derive(clap::Args)]
struct MigrateArgs {
    /// The daemon's socket.
    #[arg(long, env = "RDMAMIG_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(flatten, next_help_heading = "Source VMM (one of)")]
    source: VmmFlags,
    /// The migration stream's URI: unix:/path/mig.sock or tcp:host:port.
    #[arg(long, help_heading = "The move")]
    via: String,
    #[command(flatten)]
    the_move: MoveFlags,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("rdmamig: cannot start the async runtime: {e}");
            return ExitCode::from(3);
        }
    };
    match args.command {
        Command::Daemon {
            socket,
            state_dir,
            config,
            metrics,
            max_moves,
            keep_moves,
            keep_moves_days,
        } => {
            let (pool, config) = match open_config(config.as_deref(), &state_dir) {
                Ok(opened) => opened,
                Err(e) => {
                    eprintln!("rdmamig daemon: {}", error_chain(&e));
                    return ExitCode::from(2);
                }
            };
            let peer = match peer_identity(config.peer) {
                Ok(peer) => peer,
                Err(e) => {
                    eprintln!("rdmamig daemon: [peer]: {}", error_chain(&e));
                    return ExitCode::from(2);
                }
            };
            if let Err(e) = create_state_dir(&state_dir) {
                eprintln!(
                    "rdmamig daemon: cannot create the state directory {}: {e}",
                    state_dir.display()
                );
                return ExitCode::from(2);
            }
            let boundary = match crash_hook() {
                Ok(boundary) => boundary,
                Err(e) => {
                    eprintln!("rdmamig daemon: {e}");
                    return ExitCode::from(2);
                }
            };
            let config = DaemonConfig {
                socket,
                state_dir,
                max_moves: usize::from(max_moves),
                moves: config.moves,
                metrics,
                peer_listen: peer.listen,
                peer_vmm_paths: peer.vmm_paths,
                retention: Retention {
                    keep: keep_moves as usize,
                    max_age: keep_moves_days
                        .map(|days| std::time::Duration::from_secs(u64::from(days) * 86_400)),
                },
                context: MoveContext {
                    backends: Arc::new(VmmBackends),
                    pool: Arc::new(pool),
                    peers: peer.tls,
                    boundary,
                },
            };
            match runtime.block_on(rdmamig_migrator::daemon::serve(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("rdmamig daemon: {}", error_chain(&e));
                    ExitCode::from(3)
                }
            }
        }
        Command::Migrate(args) => migrate(&runtime, *args),
        Command::Pool {
            socket,
            json,
            action,
        } => {
            let request = match action {
                None => ClientRequest::Pool,
                Some(PoolAction::Return { function }) => ClientRequest::PoolReturn { function },
                Some(PoolAction::Assign { function, vm }) => {
                    ClientRequest::PoolAssign { function, vm }
                }
            };
            query(&runtime, &socket, request, output(json), None)
        }
        Command::Status { socket, json } => {
            query(&runtime, &socket, ClientRequest::Status, output(json), None)
        }
        Command::History {
            socket,
            limit,
            json,
        } => query(
            &runtime,
            &socket,
            ClientRequest::History { limit },
            output(json),
            None,
        ),
        Command::Report {
            id,
            svg,
            socket,
            json,
        } => query(
            &runtime,
            &socket,
            ClientRequest::Report { id },
            output(json),
            svg.as_deref(),
        ),
    }
}

/// Why the daemon's config or pool cannot be opened.
#[derive(Debug, thiserror::Error)]
enum OpenError {
    /// The config file.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The pool it describes, or its states.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The VFs its `[[pool.sriov]]` entries ask for.
    #[error(transparent)]
    Sriov(#[from] SriovError),
}

/// The config file (defaults without one), and the pool it describes, with its states from
/// the state directory. The VFs of its `[[pool.sriov]]` entries are made ready first.
fn open_config(
    config: Option<&std::path::Path>,
    state_dir: &std::path::Path,
) -> Result<(Pool, Config), OpenError> {
    let config = match config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    // Checks the rest of the pool's config before the VFs change anything.
    Pool::open(&config.pool, &state_dir.join("pool.json"))?;
    let (functions, prepared) = sriov::prepare(&config.pool, &Sysfs::default())?;
    for vf in prepared {
        tracing::info!(
            "pool: VF {} is {} (vfio-pci, IOMMU group {})",
            vf.name,
            vf.pci,
            vf.group
        );
    }
    let pool = Pool::open(&functions, &state_dir.join("pool.json"))?;
    Ok((pool, config))
}

/// Creates the state directory (owner only: journals and reports name VMs, devices and
/// hosts), once the config has proven valid, so that a bad config changes nothing.
fn create_state_dir(state_dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
}

/// What the `[peer]` table gives the daemon.
#[derive(Default)]
struct PeerIdentity {
    /// Where to serve other migrators, if anywhere.
    listen: Option<String>,
    /// The VMM paths they may name.
    vmm_paths: Vec<PathBuf>,
    /// The TLS identity and the known peers.
    tls: Option<PeerTls>,
}

/// Loads the TLS files the `[peer]` table names.
fn peer_identity(config: Option<PeerConfig>) -> Result<PeerIdentity, PeerError> {
    let Some(config) = config else {
        return Ok(PeerIdentity::default());
    };
    let tls = PeerTls::load(&config.cert, &config.key, &config.ca, &config.known)?;
    Ok(PeerIdentity {
        listen: config.listen,
        vmm_paths: config.vmm_paths,
        tls: Some(tls),
    })
}

fn output(json: bool) -> Output {
    if json {
        Output::Json
    } else {
        Output::Text
    }
}

/// The hook that aborts the process when a move reaches the phase [`CRASH_AT_ENV`] names,
/// if it names one.
#[cfg(feature = "fault-injection")]
fn crash_hook() -> Result<Option<BoundaryHook>, String> {
    let Ok(name) = std::env::var(CRASH_AT_ENV) else {
        return Ok(None);
    };
    let crash_at: rdmamig_migrator::machine::Phase =
        name.parse().map_err(|e| format!("{CRASH_AT_ENV}: {e}"))?;
    eprintln!("rdmamig daemon: fault injection: aborting once a move journals {crash_at}");
    Ok(Some(Arc::new(move |phase| {
        if phase == crash_at {
            eprintln!("rdmamig daemon: {CRASH_AT_ENV}={crash_at}: aborting at this boundary");
            std::process::abort();
        }
    })))
}

/// A release build has no fault injection: nothing makes it abort on request.
#[cfg(not(feature = "fault-injection"))]
fn crash_hook() -> Result<Option<BoundaryHook>, String> {
    Ok(None)
}

fn query(
    runtime: &tokio::runtime::Runtime,
    socket: &std::path::Path,
    request: ClientRequest,
    output: Output,
    svg: Option<&std::path::Path>,
) -> ExitCode {
    match runtime.block_on(cli::query(socket, request, output, svg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmamig: {}", error_chain(&e));
            ExitCode::from(3)
        }
    }
}

fn migrate(runtime: &tokio::runtime::Runtime, args: MigrateArgs) -> ExitCode {
    let plan = match args.the_move.plan(&args.source, args.via) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("rdmamig migrate: {e}");
            return ExitCode::from(2);
        }
    };
    cli::run_migrate(
        runtime,
        "rdmamig migrate",
        &args.socket,
        plan,
        &args.the_move.output,
    )
}
