//! rdmamig-traffic: numbered messages both ways over a migratable (or plain) RDMA
//! connection, with a JSON report of loss, duplicates and the largest delivery gap.

use std::io::IsTerminal;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use nix::sys::signal::{SigSet, Signal};
use rdmamig_conn::plain::PlainOptions;
use rdmamig_conn::{error_chain, ConnectOptions};
use rdmamig_guest::traffic::{self, Mode, OneSidedConfig, Side, TrafficConfig};
use rdmamig_proto::app::{AgentToApp, AppReply, AppToAgent};
use rdmamig_proto::{Frame, FrameBuffer, FrameError};

/// Send numbered messages both ways over an RDMA connection and report what arrived.
///
/// Start `serve` on one machine and `connect` on the other. Both sides send `--rate`
/// messages per second (each carries a counter and a timestamp) and account for what the
/// peer sent: messages lost (gaps in the numbering), duplicated, reordered, and the largest
/// gap between two consecutive deliveries (the blackout of a move). On SIGINT/SIGTERM, or
/// after `--duration`, sending stops and each side sends an end-of-flow message; a side
/// waits until the peer acknowledged everything and its end arrived (giving up after
/// `--flush-timeout-s` without progress), keeps receiving for `--linger-ms`, then writes
/// the JSON report to `--report` and stdout.
///
/// Example:
///   rdmamig-traffic serve   --listen 10.77.0.1:7471 --rate 200 --report /tmp/a.json
///   rdmamig-traffic connect --to 10.77.0.1:7471 --rate 200 --report /tmp/b.json
///   rdmamig-traffic ctl --socket /run/rdmamig/agent.sock quiesce   (drive a process like the agent)
///
/// With --one-sided, each side also exposes a buffer of --regions x --region-size bytes and
/// fills the peer's with RDMA WRITE, one region before each message (and READs one back per
/// round); the owner verifies each region's checksum when the message naming it arrives.
#[derive(Parser, Debug)]
#[command(name = "rdmamig-traffic", version, verbatim_doc_comment)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Listen on an address and exchange traffic with whoever connects.
    Serve {
        /// Address to listen on (an address of the RDMA device).
        #[arg(long)]
        listen: SocketAddr,
        #[command(flatten)]
        common: Common,
    },
    /// Connect to a `serve` and exchange traffic.
    Connect {
        /// Address of the serving side.
        #[arg(long)]
        to: SocketAddr,
        #[command(flatten)]
        common: Common,
    },
    /// Print this machine's wall clock in milliseconds since the epoch: the time base of the
    /// reports, for lining them up with another machine's (busybox `date` has no %N).
    Now,
    /// Act as the agent for one request: listen on --socket, wait for a traffic process's
    /// library to register (it retries every second), send it the request, print its reply.
    /// Exercises exactly the code path the real agent drives.
    Ctl {
        /// The agent socket the traffic process was started with (--agent-socket).
        #[arg(long, default_value = rdmamig_proto::app::DEFAULT_AGENT_SOCKET)]
        socket: PathBuf,
        /// Time the process may take, in ms (quiesce / resume).
        #[arg(long, default_value_t = 10_000)]
        deadline_ms: u64,
        /// How long to wait for the process to register, in ms.
        #[arg(long, default_value_t = 10_000)]
        wait_ms: u64,
        /// describe | quiesce | resume
        #[arg(value_parser = ["describe", "quiesce", "resume"])]
        op: String,
    },
    /// Send bad input to the agent's application socket, each on a new connection: a frame
    /// whose payload is not a message, a frame header announcing an oversized payload, and
    /// bytes that are not a frame at all; with --impersonate, also a Hello that names
    /// another process's PID; with --vsock-port, also a request to release the RDMA device
    /// sent to the agent's host channel from inside the guest (vsock loopback, CID 1).
    /// Prints, as JSON, how the agent answered each and whether it then closed that socket.
    ProbeAgent {
        /// The agent's application socket.
        #[arg(long, default_value = rdmamig_proto::app::DEFAULT_AGENT_SOCKET)]
        socket: PathBuf,
        /// Also say Hello as this process (a library user's PID), which is not this one.
        #[arg(long, value_name = "PID")]
        impersonate: Option<u32>,
        /// Also dial the agent's host channel on this vsock port over loopback and ask it to
        /// release the device (needs the vsock_loopback module in the guest).
        #[arg(long, value_name = "PORT")]
        vsock_port: Option<u32>,
        /// Dial the host channel as this user id (and group id): an unprivileged process.
        /// The application-socket probes run first, as the caller (the socket is open
        /// only to the agent's group).
        #[arg(long, value_name = "UID", requires = "vsock_port")]
        vsock_uid: Option<u32>,
    },
    /// A slow application, for the test bed: register with the agent like the library does,
    /// answer Describe and Resume for no connections, and on a Quiesce create --marker and
    /// never answer, so the agent stays inside its quiesce until its deadline (the window in
    /// which a test kills it). Ends when the agent closes the socket, or after --max-s.
    StallQuiesce {
        /// The agent's socket.
        #[arg(long, default_value = rdmamig_proto::app::DEFAULT_AGENT_SOCKET)]
        socket: PathBuf,
        /// Created once registered.
        #[arg(long)]
        ready_file: PathBuf,
        /// Created when the quiesce arrives.
        #[arg(long)]
        marker: PathBuf,
        /// Longest life, in seconds.
        #[arg(long, default_value_t = 120)]
        max_s: u64,
    },
    /// Send a RESUME for an existing connection with a token of our own (a random one by
    /// default) and print how the listener answered, as JSON: a wrong token must be refused
    /// with BadToken and must not disturb the connection.
    ProbeResume {
        /// The listener's address.
        #[arg(long)]
        to: SocketAddr,
        /// The connection id to name (decimal, as `ctl describe` prints it).
        #[arg(long)]
        conn_id: u64,
    },
    /// Connect to a listener as a new connection but read its answer only --delay-ms after
    /// the connect (a busy VM's late handshake), and print, as JSON, whether the listener
    /// kept the connection: it must wait for the handshake rather than give up first.
    ProbeSlowHandshake {
        /// The listener's address.
        #[arg(long)]
        to: SocketAddr,
        /// How late the answer is read, in ms.
        #[arg(long, default_value_t = 6000)]
        delay_ms: u64,
    },
    /// Open a TCP stream to a listener's bridge address naming --conn-id with a random token
    /// (or, with --garbage, send bytes that are no record) and print how the listener
    /// answered, as JSON: both must be refused and the connection must carry on.
    ProbeBridge {
        /// The listener's bridge address.
        #[arg(long)]
        to: SocketAddr,
        /// The connection id to name (decimal, as `ctl describe` prints it).
        #[arg(long)]
        conn_id: u64,
        /// Send bytes that are no BRIDGE record instead.
        #[arg(long)]
        garbage: bool,
    },
}

#[derive(clap::Args, Debug)]
struct Common {
    /// migratable: rdmamig's connection (quiesce/resume/replay); plain: a naive rdma_cm
    /// connection that reconnects on its own and loses what was in flight.
    #[arg(long, value_enum, default_value_t = Mode::Migratable)]
    mode: Mode,
    /// Connections this process opens (connect) or accepts (serve), each with its own
    /// traffic (migratable mode only).
    #[arg(long, default_value_t = 1)]
    connections: u32,
    /// Messages per second this side sends on each connection.
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Bytes per message (at least 20).
    #[arg(long, default_value_t = 256)]
    size: usize,
    /// Stop after this many seconds (default: run until SIGINT/SIGTERM).
    #[arg(long)]
    duration: Option<f64>,
    /// Keep receiving this long after sending stopped, in ms.
    #[arg(long, default_value_t = 1500)]
    linger_ms: u64,
    /// Seconds the end of the run waits without progress for the peer to acknowledge
    /// everything sent and for the peer's end of the flow (a link that broke just before
    /// the stop must be rebuilt first); past it, the report names what is missing as an
    /// error.
    #[arg(long, default_value_t = 3)]
    flush_timeout_s: u64,
    /// Take no message for this long after the connection is up, in ms: a slow reader, to
    /// show that the library holds a fast sender back instead of growing this side's memory.
    #[arg(long, default_value_t = 0)]
    stall_reading_ms: u64,
    /// Write the JSON report here (it is printed on stdout too).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Create this file once the connection is established.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// The agent socket the library registers with (default $RDMAMIG_AGENT_SOCKET or
    /// /run/rdmamig/agent.sock).
    #[arg(long)]
    agent_socket: Option<PathBuf>,
    /// Seconds a migratable connection waits for a moved or lost peer before failing.
    #[arg(long, default_value_t = 60)]
    peer_wait_s: u64,
    /// QP ACK timeout exponent (4.096 us x 2^n): 16 for migratable connections unless
    /// given, librdmacm's own for plain ones.
    #[arg(long)]
    ack_timeout: Option<u8>,
    /// QP transport retries before the QP fails (0-7; Soft-RoCE retries forever at 7): 6
    /// for migratable connections unless given, 7 for plain ones. With --ack-timeout, a
    /// peer's silence longer than about (retries + 1) timeouts breaks the connection.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=7))]
    retry_count: Option<u8>,
    /// Seconds a migratable connection keeps trying to connect (a VM nested in a host
    /// needs far more than the default).
    #[arg(long, default_value_t = 10)]
    connect_timeout_s: u64,
    /// One-sided mode: RDMA WRITE a region of the peer's exposed buffer before each message.
    #[arg(long)]
    one_sided: bool,
    /// One-sided mode: regions in each side's buffer.
    #[arg(long, default_value_t = 16)]
    regions: u32,
    /// One-sided mode: bytes per region (16 to 65536).
    #[arg(long, default_value_t = 4096)]
    region_size: usize,
    /// Rewrite this file with the run's counters (JSON) every 250 ms.
    #[arg(long)]
    progress_file: Option<PathBuf>,
    /// The TCP bridge (strategy `bridge`), on an address of a NIC that moves with the VM:
    /// serve listens for bridges there, connect opens one to the peer's (migratable mode).
    #[arg(long)]
    bridge: Option<SocketAddr>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("RDMAMIG_LOG"))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Serve { listen, common } => run_traffic(Side::Serve(listen), common),
        Cmd::Connect { to, common } => run_traffic(Side::Connect(to), common),
        Cmd::Now => {
            println!("{}", traffic::unix_ms());
            0
        }
        Cmd::Ctl {
            socket,
            deadline_ms,
            wait_ms,
            op,
        } => ctl(&socket, &op, deadline_ms, wait_ms),
        Cmd::ProbeAgent {
            socket,
            impersonate,
            vsock_port,
            vsock_uid,
        } => match probe_agent(&socket, impersonate, vsock_port, vsock_uid) {
            Ok(json) => {
                println!("{json}");
                0
            }
            Err(e) => {
                eprintln!("rdmamig-traffic probe-agent: {}", error_chain(&e));
                1
            }
        },
        Cmd::StallQuiesce {
            socket,
            ready_file,
            marker,
            max_s,
        } => match stall_quiesce(&socket, &ready_file, &marker, max_s) {
            Ok(end) => {
                eprintln!("rdmamig-traffic stall-quiesce: {end}");
                0
            }
            Err(e) => {
                eprintln!("rdmamig-traffic stall-quiesce: {}", error_chain(&e));
                1
            }
        },
        Cmd::ProbeResume { to, conn_id } => {
            let answer = rdmamig_conn::probe_resume(to, conn_id, rand::random());
            println!(
                "{}",
                serde_json::json!({ "conn_id": conn_id, "answer": format!("{answer:?}") })
            );
            0
        }
        Cmd::ProbeSlowHandshake { to, delay_ms } => {
            let answer = rdmamig_conn::probe_slow_handshake(to, Duration::from_millis(delay_ms));
            println!(
                "{}",
                serde_json::json!({ "delay_ms": delay_ms, "answer": format!("{answer:?}") })
            );
            0
        }
        Cmd::ProbeBridge {
            to,
            conn_id,
            garbage,
        } => {
            let answer = rdmamig_conn::probe_bridge(to, conn_id, rand::random(), garbage);
            println!(
                "{}",
                serde_json::json!({ "conn_id": conn_id, "answer": format!("{answer:?}") })
            );
            0
        }
    };
    std::process::exit(code);
}

fn run_traffic(side: Side, c: Common) -> i32 {
    // Block the stop signals in every thread (spawned threads inherit the mask) and wait for
    // them in one thread: no signal handler, no unsafe.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    if let Err(e) = signals.thread_block() {
        eprintln!("rdmamig-traffic: blocking signals failed: {e}");
        return 1;
    }
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            if signals.wait().is_ok() {
                stop.store(true, Ordering::Relaxed);
            }
        });
    }
    if let Some(path) = &c.agent_socket {
        rdmamig_conn::registry::set_agent_socket(path);
    }
    let one_sided = c.one_sided.then(|| OneSidedConfig {
        regions: c.regions.max(1),
        region_size: c.region_size.clamp(traffic::regions::STAMP_LEN, 65536),
    });
    // Messages of one-sided mode carry a notice after the counter and timestamp; each
    // region goes out in one WRITE (and comes back in one READ).
    let size = match one_sided {
        Some(_) => c.size.max(traffic::MIN_SIZE + traffic::regions::NOTICE_LEN),
        None => c.size.max(traffic::MIN_SIZE),
    };
    let max_message = size.max(one_sided.map_or(0, |o| o.region_size));
    let defaults = ConnectOptions::default();
    let plain = PlainOptions::new(size);
    let cfg = TrafficConfig {
        side,
        mode: c.mode,
        connections: c.connections,
        rate: c.rate,
        size,
        duration: c.duration.map(Duration::from_secs_f64),
        linger: Duration::from_millis(c.linger_ms),
        flush_timeout: Duration::from_secs(c.flush_timeout_s),
        stall_reading: Duration::from_millis(c.stall_reading_ms),
        ready_file: c.ready_file,
        conn: ConnectOptions {
            peer_wait: Duration::from_secs(c.peer_wait_s),
            ack_timeout: c.ack_timeout.unwrap_or(defaults.ack_timeout),
            retry_count: c.retry_count.unwrap_or(defaults.retry_count),
            connect_timeout: Duration::from_secs(c.connect_timeout_s),
            max_message,
            bridge: c.bridge,
            ..defaults
        },
        plain: PlainOptions {
            retry_count: c.retry_count.unwrap_or(plain.retry_count),
            ack_timeout: c.ack_timeout.or(plain.ack_timeout),
            ..plain
        },
        one_sided,
        progress_file: c.progress_file,
    };
    match traffic::run(&cfg, &stop) {
        Ok(report) => {
            let json = serde_json::to_string_pretty(&report).unwrap_or_default();
            println!("{json}");
            if let Some(path) = &c.report {
                if let Err(e) = std::fs::write(path, &json) {
                    eprintln!("rdmamig-traffic: writing {}: {e}", path.display());
                    return 1;
                }
            }
            0
        }
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(": ");
                msg.push_str(&s.to_string());
                src = s.source();
            }
            eprintln!("rdmamig-traffic: {msg}");
            2
        }
    }
}

fn ctl(socket: &std::path::Path, op: &str, deadline_ms: u64, wait_ms: u64) -> i32 {
    match ctl_inner(socket, op, deadline_ms, wait_ms) {
        Ok(json) => {
            println!("{json}");
            0
        }
        Err(e) => {
            eprintln!("rdmamig-traffic ctl: {}", error_chain(&e));
            1
        }
    }
}

fn ctl_inner(
    socket: &std::path::Path,
    op: &str,
    deadline_ms: u64,
    wait_ms: u64,
) -> Result<String, ToolError> {
    let _ = std::fs::remove_file(socket);
    if let Some(dir) = socket.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let listener = UnixListener::bind(socket).map_err(|source| ToolError::Bind {
        path: socket.to_owned(),
        source,
    })?;
    let cleanup = Cleanup(socket.to_owned());
    listener.set_nonblocking(true)?;
    let wait_until = Instant::now() + Duration::from_millis(wait_ms);
    let mut stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= wait_until {
                    return Err(ToolError::NoProcess { wait_ms });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_millis(deadline_ms + 10_000)))?;
    let mut fb = FrameBuffer::new();
    let hello: AppToAgent = read_frame(&mut stream, &mut fb)?;
    let request = match op {
        "describe" => AgentToApp::Describe { request: 1 },
        "quiesce" => AgentToApp::Quiesce {
            request: 1,
            deadline_ms,
            bridge: false,
            hot: false,
        },
        _ => AgentToApp::Resume {
            request: 1,
            deadline_ms,
        },
    };
    let start = Instant::now();
    stream.write_all(&Frame::encode(&request))?;
    let reply: AppToAgent = read_frame(&mut stream, &mut fb)?;
    let elapsed = start.elapsed();
    drop(cleanup);
    Ok(serde_json::json!({
        "hello": hello,
        "reply": reply,
        "elapsed_ms": elapsed.as_secs_f64() * 1000.0,
        "at_unix_ms": traffic::unix_ms(),
    })
    .to_string())
}

/// Becomes user and group `uid`, if given, for good.
fn drop_to(uid: Option<u32>) -> Result<(), ToolError> {
    if let Some(id) = uid {
        nix::unistd::setgroups(&[]).map_err(ToolError::DropPrivileges)?;
        nix::unistd::setgid(nix::unistd::Gid::from_raw(id)).map_err(ToolError::DropPrivileges)?;
        nix::unistd::setuid(nix::unistd::Uid::from_raw(id)).map_err(ToolError::DropPrivileges)?;
    }
    Ok(())
}

/// Dials the agent's host channel from inside the guest (vsock loopback) and asks it to
/// release the device, as only the host may; returns its answer, if any, and whether it
/// closed the stream.
fn probe_vsock_loopback(port: u32) -> Result<serde_json::Value, ToolError> {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, VsockAddr};
    let fd = socket(
        AddressFamily::Vsock,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(ToolError::Vsock)?;
    connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &VsockAddr::new(libc::VMADDR_CID_LOCAL, port),
    )
    .map_err(ToolError::Vsock)?;
    let mut stream = std::fs::File::from(fd);
    let request = rdmamig_proto::agent::AgentRequest {
        id: 1,
        command: rdmamig_proto::agent::AgentCommand::ReleaseDevice {
            grace_ms: 0,
            deadline_ms: 1_000,
            scope: rdmamig_proto::agent::ReleaseScope::AllHolders,
        },
    };
    // The agent may close before the request is written: that is its answer too.
    let _ = stream.write_all(&Frame::encode(&request));
    let mut received = Vec::new();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(stream.read_to_end(&mut received).map(|_| received));
    });
    let (closed, received) = match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(Ok(received)) => (true, received),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => (true, Vec::new()),
        Ok(Err(e)) => {
            return Err(ToolError::Probe {
                name: "vsock_loopback",
                source: e,
            })
        }
        Err(_) => (false, Vec::new()),
    };
    let mut fb = FrameBuffer::new();
    fb.push(&received);
    let answer = fb.pop().ok().map(|frame| {
        frame
            .decode::<rdmamig_proto::agent::AgentResponse>()
            .map_err(|e| e.to_string())
    });
    Ok(serde_json::json!({
        "probe": "vsock_loopback",
        "answer": answer.unwrap_or_else(|| Err("no answer".into())),
        "closed": closed,
    }))
}

/// See `Cmd::ProbeAgent`.
fn probe_agent(
    socket: &std::path::Path,
    impersonate: Option<u32>,
    vsock_port: Option<u32>,
    vsock_uid: Option<u32>,
) -> Result<String, ToolError> {
    let header = |len: u32| {
        let mut b = rdmamig_proto::frame::MAGIC.to_vec();
        b.push(rdmamig_proto::PROTOCOL_VERSION);
        b.extend_from_slice(&len.to_be_bytes());
        b
    };
    let mut bad_message = header(5);
    bad_message.extend_from_slice(b"{oops");
    let mut probes: Vec<(&str, Vec<u8>)> = vec![
        ("bad_message", bad_message),
        ("oversized", header(u32::MAX)),
        ("garbage", b"GET / HTTP/1.0\r\n\r\n".to_vec()),
    ];
    if let Some(pid) = impersonate {
        let hello = AppToAgent::Hello {
            pid,
            program: "impostor".into(),
        };
        probes.push(("impostor", Frame::encode(&hello)));
    }
    let mut results = Vec::new();
    for (name, bytes) in probes {
        let mut stream = std::os::unix::net::UnixStream::connect(socket).map_err(|source| {
            ToolError::Connect {
                path: socket.to_owned(),
                source,
            }
        })?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream
            .write_all(&bytes)
            .map_err(|source| ToolError::Probe { name, source })?;
        let mut fb = FrameBuffer::new();
        let answer = read_frame::<AgentToApp>(&mut stream, &mut fb);
        // Closed: the next read ends at once; open: it times out.
        stream.set_read_timeout(Some(Duration::from_millis(500)))?;
        let closed = matches!(stream.read(&mut [0u8; 64]), Ok(0));
        results.push(serde_json::json!({
            "probe": name,
            "answer": answer.map_err(|e| format!("no answer: {}", error_chain(&e))),
            "closed": closed,
        }));
    }
    if let Some(port) = vsock_port {
        drop_to(vsock_uid)?;
        results.push(probe_vsock_loopback(port)?);
    }
    Ok(serde_json::Value::Array(results).to_string())
}

/// See [`Cmd::StallQuiesce`]; returns how it ended once registered.
fn stall_quiesce(
    socket: &std::path::Path,
    ready_file: &std::path::Path,
    marker: &std::path::Path,
    max_s: u64,
) -> Result<String, ToolError> {
    let mut stream =
        std::os::unix::net::UnixStream::connect(socket).map_err(|source| ToolError::Connect {
            path: socket.to_owned(),
            source,
        })?;
    stream.set_read_timeout(Some(Duration::from_secs(max_s)))?;
    let mut writer = stream.try_clone()?;
    let mut send = move |message: &AppToAgent| {
        writer
            .write_all(&Frame::encode(message))
            .map_err(ToolError::WriteAgent)
    };
    send(&AppToAgent::Hello {
        pid: std::process::id(),
        program: "stall-quiesce".into(),
    })?;
    std::fs::write(ready_file, b"").map_err(|source| ToolError::File {
        path: ready_file.to_owned(),
        source,
    })?;
    let mut fb = FrameBuffer::new();
    loop {
        let request = match read_frame::<AgentToApp>(&mut stream, &mut fb) {
            Ok(request) => request,
            Err(e) => return Ok(format!("the agent link ended: {}", error_chain(&e))),
        };
        let (request, body) = match request {
            AgentToApp::Describe { request } => (
                request,
                AppReply::Connections {
                    connections: Vec::new(),
                },
            ),
            AgentToApp::Resume { request, .. } => (
                request,
                AppReply::Outcomes {
                    outcomes: Vec::new(),
                },
            ),
            AgentToApp::Peer { request, .. } => (
                request,
                AppReply::Peer {
                    answer: rdmamig_proto::preload::PeerAnswer::NotMine,
                },
            ),
            AgentToApp::Refused { reason } => return Err(ToolError::Refused { reason }),
            AgentToApp::Quiesce { .. } => {
                std::fs::write(marker, b"").map_err(|source| ToolError::File {
                    path: marker.to_owned(),
                    source,
                })?;
                continue;
            }
        };
        send(&AppToAgent::Reply { request, body })?;
    }
}

/// What failed in one of the tool's agent-socket commands (`ctl`, `probe-agent`,
/// `stall-quiesce`); printed with its chain.
#[derive(Debug, thiserror::Error)]
enum ToolError {
    /// Binding the socket the library connects to failed.
    #[error("binding {}", path.display())]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Connecting to the agent's socket failed.
    #[error("connecting to {}", path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No process connected within the wait.
    #[error("no process registered within {wait_ms} ms")]
    NoProcess {
        /// The wait.
        wait_ms: u64,
    },
    /// A socket call failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Reading the socket failed.
    #[error("reading")]
    Read(#[source] std::io::Error),
    /// The other side closed the socket.
    #[error("the process closed the socket")]
    SocketClosed,
    /// A frame was malformed or did not decode.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// Sending one probe's bytes failed.
    #[error("{name}")]
    Probe {
        /// The probe.
        name: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing to the agent failed.
    #[error("writing to the agent")]
    WriteAgent(#[source] std::io::Error),
    /// Writing the ready file or the marker failed.
    #[error("{}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The agent refused one of the tool's messages.
    #[error("the agent refused a message: {reason}")]
    Refused {
        /// The agent's reason.
        reason: String,
    },
    /// Becoming the user asked for (`--vsock-uid`) failed.
    #[error("dropping privileges")]
    DropPrivileges(#[source] nix::Error),
    /// Dialing the agent over vsock loopback failed (is vsock_loopback loaded?).
    #[error("dialing the agent over vsock loopback")]
    Vsock(#[source] nix::Error),
}

struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn read_frame<T: serde::de::DeserializeOwned>(
    stream: &mut std::os::unix::net::UnixStream,
    fb: &mut FrameBuffer,
) -> Result<T, ToolError> {
    let mut buf = [0u8; 4096];
    loop {
        match fb.pop() {
            Ok(f) => return Ok(f.decode::<T>()?),
            Err(FrameError::Incomplete { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let n = stream.read(&mut buf).map_err(ToolError::Read)?;
        if n == 0 {
            return Err(ToolError::SocketClosed);
        }
        fb.push(&buf[..n]);
    }
}
