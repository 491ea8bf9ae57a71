//! `rdmamig-agent`: the rdmamig guest agent daemon.

use rdmamig_proto::text::error_chain;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use rdmamig_guest::agent::apps::{Apps, SocketAccess};
use rdmamig_guest::agent::{device, host, peers, vsock, Agent};
use rdmamig_proto::app::DEFAULT_AGENT_SOCKET;
use tracing::{error, info, warn};

/// The rdmamig guest agent.
///
/// Runs inside the VM. The host migrator talks to it over a virtio-serial port (QEMU) or
/// AF_VSOCK (Cloud Hypervisor's hybrid vsock) to list, quiesce and resume the VM's
/// migratable RDMA connections; applications that use the rdmamig connection library
/// register with it through a UNIX socket. Both host channels speak the same protocol; with
/// --vsock-port the agent serves both, and a VM without the virtio-serial port is served
/// over vsock alone.
///
/// Example (what the test-bed image runs at boot):
///
///     rdmamig-agent --port-name org.rdmamig.agent.0 --vsock-port 7077
///
/// Cloud Hypervisor side of the vsock (the host then writes `CONNECT 7077`):
///
///     --vsock cid=3,socket=/run/vm1/vsock.sock
///
/// QEMU side of the port:
///
///     -device virtio-serial-pci,id=vser0
///     -chardev socket,path=/run/vm1/agent.sock,server=on,wait=off,id=ch0
///     -device virtserialport,chardev=ch0,name=org.rdmamig.agent.0,bus=vser0.0
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// Name of the virtio-serial port the host uses (as given to QEMU's virtserialport).
    #[arg(long, default_value = "org.rdmamig.agent.0")]
    port_name: String,
    /// UNIX socket where applications register.
    #[arg(long, default_value = DEFAULT_AGENT_SOCKET)]
    app_socket: PathBuf,
    /// The application socket's mode, in octal: who may register with the agent (a
    /// registered process is asked to quiesce instead of being ended at a forced release).
    #[arg(long, default_value = "660", value_parser = octal_mode)]
    app_socket_mode: u32,
    /// The group (numeric GID) that owns the application socket, so that its members may
    /// register (default: the agent's group).
    #[arg(long, value_name = "GID")]
    app_socket_group: Option<u32>,
    /// How long to wait at start for the virtio-serial port to appear.
    #[arg(long, default_value = "30", value_name = "SECONDS")]
    port_wait: u64,
    /// Also serve the host on this AF_VSOCK port (the host only: CID 2).
    #[arg(long, value_name = "PORT")]
    vsock_port: Option<u32>,
    /// TCP port where preloaded programs (`rdmamig-run`) in other VMs reach the ones here
    /// when one end of their QP moves (0: not served; their moves then fail).
    #[arg(long, default_value_t = rdmamig_proto::preload::PEER_PORT, value_name = "PORT")]
    peer_port: u16,
    /// The agent's niceness (-20 to 19). It answers the host's move commands within their
    /// deadlines, so it runs ahead of the applications: on a loaded guest (64 connections,
    /// 0.8 CPU) a listing of unmanaged programs at niceness 0 took over 20 s.
    #[arg(long, default_value_t = -10, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    nice: i32,
}

/// Sets the niceness of the calling thread, which the threads it starts inherit (Linux
/// keeps it per thread), so this runs before any is started.
fn set_niceness(nice: i32) -> std::io::Result<()> {
    // SAFETY: setpriority takes no pointers; with PRIO_PROCESS and 0 it changes only the
    // calling thread's niceness.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    if let Err(e) = set_niceness(args.nice) {
        // Not fatal: the agent works, only later under load.
        warn!(nice = args.nice, "could not set the agent's niceness: {e}");
    }

    let apps = Apps::new();
    let access = SocketAccess {
        mode: args.app_socket_mode,
        group: args.app_socket_group,
    };
    if let Err(e) = apps.listen(&args.app_socket, access) {
        error!("{}", error_chain(&e));
        return ExitCode::FAILURE;
    }
    if args.peer_port != 0 {
        // Without it, only preloaded programs' moves fail: the agent goes on.
        if let Err(e) = peers::listen(apps.clone(), args.peer_port) {
            error!("{}", error_chain(&e));
        }
    }
    // A vsock that cannot listen leaves the virtio-serial port, which is reported below
    // if it is missing too.
    let listener = match args.vsock_port.map(vsock::listen_on).transpose() {
        Ok(listener) => listener,
        Err(e) => {
            error!("{}", error_chain(&e));
            None
        }
    };
    let agent = Agent::new(apps, PathBuf::from(device::SYSFS_INFINIBAND));
    std::thread::scope(|scope| {
        if let Some(listener) = &listener {
            info!(vsock_port = listener.port(), "agent serving over vsock");
            scope.spawn(|| listener.serve(&agent));
        }
        match host::open_port(&args.port_name, Duration::from_secs(args.port_wait)) {
            Ok(mut port) => {
                info!(port = %args.port_name, apps = %args.app_socket.display(), "agent serving");
                let host = host::HostWait::for_port(&port);
                host::serve(&mut port, &agent, host::OnEof::WaitForHost(&host));
                ExitCode::SUCCESS
            }
            // A VM with only a vsock (Cloud Hypervisor) is served there.
            Err(e) if listener.is_some() => {
                info!("{}; serving over vsock only", error_chain(&e));
                ExitCode::SUCCESS
            }
            Err(e) => {
                error!("{}", error_chain(&e));
                ExitCode::FAILURE
            }
        }
    })
}

/// A `--app-socket-mode` that is not one.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a file mode in octal (such as 660)")]
struct NotAMode(String);

/// A file mode in octal (`660`, `0660`), at most 0777.
fn octal_mode(text: &str) -> Result<u32, NotAMode> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(NotAMode(text.into())),
    }
}
