//! The move scenario: a peer VM and a VM with an RDMA NIC exchange numbered messages both
//! ways while the VM moves to another QEMU process with `rdmamig migrate`.
//!
//! The same scenario runs coordinated (strategy `reconnect`, traffic over rdmamig's
//! migratable connection) and naively (strategy `naive`, traffic over a plain rdma_cm
//! connection that reconnects on its own, as applications do today), on the same VMs, the
//! same traffic and the same migration steps. The demo prints both; the end-to-end tests
//! assert on them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmamig_guest::traffic::Report as TrafficReport;
use rdmamig_migrator::report::MoveReport;
use thiserror::Error;

use crate::steps;
use crate::{Guest, GuestError, Testbed, TestbedError};

/// Where the traffic tool listens on the peer.
const TRAFFIC_PORT: u16 = 7471;
/// Bound on every console command of the scenario.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on the whole `rdmamig migrate` run with the migrator's default deadlines; the
/// deadlines a scenario sets are added to it.
const MOVE_TIMEOUT: Duration = Duration::from_secs(120);

/// The daemon built with the `fault-injection` feature, for the crash scenarios only.
const FAULT_INJECTION_BINARY: &str = "rdmamig-fault-injection";

/// How the VM is moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// rdmamig's coordinated move: quiesce, detach, migrate, attach, resume.
    Reconnect,
    /// As reconnect, with every connection's messages carried over a TCP bridge on the
    /// guests' permanent NICs from the quiesce until the RDMA path is back.
    Bridge,
    /// What operators do today: unplug, migrate, plug; applications reconnect on their own.
    Naive,
    /// The NIC migrates with the VM (an emulated NIC with Soft-RoCE: the test bed's stand-in
    /// for a migration-capable VF); the connections pause right before the switchover and
    /// keep their QPs.
    Hot,
    /// The baseline beside `hot`: the same migration with the NIC attached, but the traffic
    /// over plain rdma_cm connections, which nothing pauses (the migrator's `hot` finds no
    /// library connection to pause).
    Attached,
}

impl Strategy {
    /// The migrator's name for the strategy.
    pub fn migrator_name(self) -> &'static str {
        match self {
            Strategy::Reconnect => "reconnect",
            Strategy::Bridge => "bridge",
            Strategy::Naive => "naive",
            Strategy::Hot | Strategy::Attached => "hot",
        }
    }

    /// The scenario's own name (guests, files, columns).
    pub fn label(self) -> &'static str {
        match self {
            Strategy::Attached => "attached",
            other => other.migrator_name(),
        }
    }

    /// Whether the destination is started with the RDMA NIC, which then migrates.
    fn nic_migrates(self) -> bool {
        matches!(self, Strategy::Hot | Strategy::Attached)
    }

    /// The traffic tool's connection mode for the strategy.
    fn traffic_mode(self) -> &'static str {
        match self {
            Strategy::Reconnect | Strategy::Bridge | Strategy::Hot => "migratable",
            Strategy::Naive | Strategy::Attached => "plain",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ScenarioConfig {
    /// How the VM is moved.
    pub strategy: Strategy,
    /// Messages per second each side sends on each connection.
    pub rate: u32,
    /// Traffic processes on each side (process `i` serves on port 7471 + i).
    pub processes: u32,
    /// Connections of each process.
    pub connections: u32,
    /// After the VM's move, move the peer VM too (the passive side of every connection),
    /// with the same strategy, while traffic runs.
    pub move_peer: bool,
    /// With `move_peer`: start the peer's move half a second after the first one, so that
    /// the two moves overlap.
    pub overlap: bool,
    /// Traffic time before the move.
    pub before: Duration,
    /// Traffic time after the move.
    pub after: Duration,
    /// `phase=ms` deadlines given to `rdmamig migrate` (`--deadline`), beside its defaults.
    pub deadlines: Vec<String>,
    /// How long each migratable connection waits for a moved peer (`--peer-wait-s`): a
    /// move that outlasts it fails the connections, so it must exceed the move's deadlines.
    pub peer_wait_s: u32,
    /// How long each migratable connection keeps trying to connect (`--connect-timeout-s`):
    /// a failed connect ends the traffic process, and on a loaded guest (0.8 core) the peer
    /// once accepted nothing for 24 s.
    pub connect_timeout_s: u32,
    /// How long each traffic process's final flush waits for its peer's acknowledgements
    /// (`--flush-timeout-s`): a link that broke just before the stop is rebuilt first.
    pub flush_timeout_s: u32,
    /// The destination's RDMA NIC is off the bridge from the move's start until this long
    /// after it: across the switchover the path is gone, so a QP that `hot` kept cannot
    /// carry its probe, and the connection must fall back to a reconnect.
    pub dst_path_back_after: Option<Duration>,
    /// The destination keeps the arrived VM paused this long before it runs it: a VM's
    /// pause longer than any peer's retry budget, as a large device state would make it.
    pub hold_arrival: Option<Duration>,
    /// Every traffic connection's QP retry budget: ACK timeout exponent and transport
    /// retries (`--ack-timeout`, `--retry-count`). Without it each kind keeps its defaults
    /// (a plain QP retries forever on Soft-RoCE).
    pub retry_budget: Option<(u8, u8)>,
}

impl ScenarioConfig {
    /// The defaults used by the demo and the tests.
    pub fn new(strategy: Strategy) -> Self {
        Self {
            strategy,
            rate: 200,
            processes: 1,
            connections: 1,
            move_peer: false,
            overlap: false,
            before: Duration::from_secs(3),
            after: Duration::from_secs(4),
            // A naive unplug under traffic that catches a Soft-RoCE packet in virtio-net's
            // TX ring takes ~51 s to complete (docs/testbed.md); the naive move waits for
            // it, as an operator's script would, instead of failing at 5 s.
            deadlines: match strategy {
                Strategy::Naive => vec!["detach=60000".into()],
                _ => Vec::new(),
            },
            peer_wait_s: 60,
            connect_timeout_s: 10,
            flush_timeout_s: 3,
            dst_path_back_after: None,
            hold_arrival: None,
            retry_budget: None,
        }
    }

    /// Many connections: `processes` traffic processes of `connections` each, 2 messages/s
    /// per connection each way, with bounds for guests that many connections keep busy.
    pub fn many(strategy: Strategy, processes: u32, connections: u32) -> Self {
        Self {
            processes,
            connections,
            // 2 messages/s per connection: 128 messages/s each way for 64 (the guests have
            // one emulated CPU each, which 64 connections and 128 traffic threads keep busy).
            rate: 2,
            // Deadlines for 64 connections on guests with one emulated CPU each. On an idle
            // machine (2026-12-02) prepare took 1.3-2.9 s, quiesce 1.5-6.8 s, detach
            // 7.6-13.3 s and resume 6.6-8.5 s (32.4 s bridged); in CI and fresh-machine checks
            // the guests ran 5-7 times slower: prepare missed 10 s, quiesce took 11.6 s,
            // detach 17 s, and the new port was not ACTIVE within 58 s. Under a CPU limit of
            // 0.8 core (cgroup cpu.cfs_quota_us, about 9 times slower) a bridged resume had
            // 48 of the 64 back after 250 s. The deadlines leave ten times the idle figures
            // or more: how fast many connections move is the benchmark's `scale` part.
            deadlines: [
                "prepare=30000",
                "quiesce=60000",
                "detach=90000",
                "resume=600000",
                "rollback=600000",
            ]
            .map(String::from)
            .to_vec(),
            // Longer than quiesce, detach, migrate and resume together at those deadlines.
            peer_wait_s: 900,
            // At 0.8 core, 64 connections took 72-87 s to connect (4-10 s idle), and the peer
            // once accepted nothing for 24 s, past the default 10 s.
            connect_timeout_s: 60,
            // In CI (2026-12-03) a bridged move's resume took 133 s, and at the stop 19
            // messages on the moving VM's links were still unacknowledged after the 3 s
            // default flush: links that broke late are rebuilt (with their replay) first.
            flush_timeout_s: 120,
            ..Self::new(strategy)
        }
    }
}

/// What a scenario produced.
#[derive(Debug)]
pub struct ScenarioOutcome {
    /// The strategy used.
    pub strategy: Strategy,
    /// What `rdmamig migrate` printed (progress and the timeline).
    pub move_output: String,
    /// The migrator's report, when it wrote one.
    pub move_report: Option<MoveReport>,
    /// Wall-clock time (ms since the epoch) the move command started and ended.
    pub move_window_unix_ms: (u64, u64),
    /// The traffic report of the peer VM (it receives what the moving VM sends).
    pub peer: TrafficReport,
    /// The traffic report of the moving VM.
    pub mover: TrafficReport,
    /// With [`ScenarioConfig::hold_arrival`]: how long the arrived VM was kept paused,
    /// from the destination's first look that saw it arrived to its resume.
    pub held: Option<Duration>,
    /// The peer's retransmission counters across the move, from before it to the end of
    /// the traffic after it (the peer's device stays: a moved peer has none to compare).
    pub peer_retransmissions: Option<steps::Retransmissions>,
    /// What `rdmamig migrate` printed for the peer VM's own move, when `move_peer` was set.
    pub peer_move: Option<String>,
    /// The peer's clock minus the host's, in ms (guests set their clock from the RTC at
    /// boot, to the second): subtract it from the peer's times to line them up with the
    /// host's timeline.
    pub peer_clock_offset_ms: i64,
    /// What the kernels of the guests that ran the traffic to the end logged as a problem
    /// (WARN, BUG, memory corruption, hung tasks; [`steps::kernel_problems`]).
    pub kernel_problems: Vec<String>,
}

impl ScenarioOutcome {
    /// QEMU's reported downtime of the migration (the source's stop-and-copy).
    pub fn vmm_downtime_ms(&self) -> Option<u64> {
        self.move_report
            .as_ref()
            .and_then(|r| r.migration.as_ref())
            .and_then(|m| m.downtime_ms)
    }

    /// How long the guest did not run (source STOP to destination RESUME), from the
    /// migrate phase's details.
    pub fn vm_paused_ms(&self) -> Option<u64> {
        let report = self.move_report.as_ref()?;
        let migrate = report
            .timeline
            .phase(rdmamig_migrator::machine::Phase::Migrate)?;
        migrate.details.get("vm_paused_ms")?.as_u64()
    }
}

/// Why a scenario could not be run to the end.
#[derive(Debug, Error)]
pub enum ScenarioError {
    /// The test bed could not start a guest or a tap.
    #[error("setting up the test bed")]
    Testbed(#[from] Box<TestbedError>),
    /// A console command in a guest failed.
    #[error("in guest {guest}: {what}")]
    Guest {
        /// The guest.
        guest: String,
        /// What the scenario was doing.
        what: &'static str,
        /// The cause.
        #[source]
        source: Box<GuestError>,
    },
    /// A traffic step in a guest failed.
    #[error("in guest {guest}: {what}: {reason}")]
    Step {
        /// The guest.
        guest: String,
        /// What the scenario was doing.
        what: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// The migrator could not be started or run.
    #[error("running {program}")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The migrator daemon did not come up.
    #[error("the rdmamig daemon did not create {socket} within {timeout:?}")]
    DaemonStart {
        /// The socket it should create.
        socket: PathBuf,
        /// How long we waited.
        timeout: Duration,
    },
    /// `rdmamig migrate` ran longer than its bound.
    #[error("rdmamig migrate did not finish within {0:?}")]
    MoveTimeout(Duration),
    /// `rdmamig migrate` failed: the scenario stops there (where the VM runs afterwards
    /// depends on how far the move got), with what the migrator printed.
    #[error("the move of {vm} failed; rdmamig migrate printed:\n{output}")]
    MoveFailed {
        /// The VM that was to move.
        vm: String,
        /// What `rdmamig migrate` printed (progress and the timeline).
        output: String,
    },
    /// A traffic report could not be read.
    #[error("traffic report of guest {guest} is not valid: {reason}")]
    Report {
        /// The guest.
        guest: String,
        /// Why.
        reason: String,
    },
}

/// A running `rdmamig daemon`, stopped on drop.
pub struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    /// Starts `rdmamig daemon` with its socket in `dir`, and waits for the socket.
    pub fn start(dir: &Path) -> Result<Daemon, ScenarioError> {
        Daemon::start_named(dir, "rdmamig", None)
    }

    /// Starts `rdmamig daemon` `name` (socket `<dir>/<name>.sock`, state `<dir>/<name>-state`,
    /// log `<dir>/<name>-daemon.log`) with the config file `config`, if any (several daemons
    /// play several hosts), and waits for the socket.
    pub fn start_named(
        dir: &Path,
        name: &str,
        config: Option<&Path>,
    ) -> Result<Daemon, ScenarioError> {
        Daemon::spawn(dir, name, config, None)
    }

    /// Starts `rdmamig daemon` like [`Daemon::start`], told to abort once it has journaled
    /// the phase `crash_at` (`RDMAMIG_CRASH_AT`: a migrator killed at that boundary). It
    /// runs the build with fault injection, `rdmamig-fault-injection` (scripts/test.sh
    /// makes it); the release `rdmamig` has none. A daemon started again in `dir` finds the
    /// journal and the same state.
    pub fn start_crashing(dir: &Path, crash_at: &str) -> Result<Daemon, ScenarioError> {
        Daemon::spawn(dir, "rdmamig", None, Some(crash_at))
    }

    fn spawn(
        dir: &Path,
        name: &str,
        config: Option<&Path>,
        crash_at: Option<&str>,
    ) -> Result<Daemon, ScenarioError> {
        let socket = dir.join(format!("{name}.sock"));
        // A killed daemon leaves its socket file behind: wait for the new one.
        let _ = std::fs::remove_file(&socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{name}-daemon.log")))
            .map_err(|source| ScenarioError::Spawn {
                program: "rdmamig daemon".into(),
                source,
            })?;
        let binary = match crash_at {
            Some(_) => FAULT_INJECTION_BINARY,
            None => "rdmamig",
        };
        let mut command = Command::new(crate::bin_dir().join(binary));
        command
            .args(["daemon", "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join(format!("{name}-state")))
            .env_remove("RDMAMIG_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("cloning a file handle"))
            .stderr(log);
        if let Some(config) = config {
            command.arg("--config").arg(config);
        }
        if let Some(phase) = crash_at {
            command.env("RDMAMIG_CRASH_AT", phase);
        }
        let child = command.spawn().map_err(|source| ScenarioError::Spawn {
            program: match crash_at {
                Some(_) => format!(
                    "{FAULT_INJECTION_BINARY} daemon (scripts/test.sh builds it: \
                     `cargo build --release -p rdmamig-migrator --features fault-injection`, \
                     then target/release/rdmamig copied to {FAULT_INJECTION_BINARY})"
                ),
                None => "rdmamig daemon".into(),
            },
            source,
        })?;
        let daemon = Daemon { child, socket };
        let timeout = Duration::from_secs(10);
        let end = Instant::now() + timeout;
        while !daemon.socket.exists() {
            if Instant::now() >= end {
                return Err(ScenarioError::DaemonStart {
                    socket: daemon.socket.clone(),
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }

    /// The daemon's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The state of function `name` in `rdmamig pool --json` (`{"state": "attached", "vm":
    /// ...}`; `Null` if the pool lacks it).
    pub fn pool_function(&self, name: &str) -> serde_json::Value {
        let out = Command::new(crate::bin_dir().join("rdmamig"))
            .args(["pool", "--json", "--socket"])
            .arg(&self.socket)
            .output();
        let functions: serde_json::Value = out
            .ok()
            .and_then(|o| serde_json::from_slice(&o.stdout).ok())
            .unwrap_or_default();
        functions
            .as_array()
            .into_iter()
            .flatten()
            .find(|f| f["name"] == name)
            .map(|f| f["state"].clone())
            .unwrap_or_default()
    }

    /// Kills the daemon started by [`Daemon::start_named`] as `rdmamig` in `dir` with
    /// `config` (SIGKILL, as a crash would) and starts it again on the same state, which
    /// finishes or rolls back what it was running.
    pub fn restart_after_kill(
        &mut self,
        dir: &Path,
        config: Option<&Path>,
    ) -> Result<(), ScenarioError> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        *self = Daemon::start_named(dir, "rdmamig", config)?;
        Ok(())
    }

    /// Waits (at most `timeout`) for the daemon to exit by itself; returns whether it did,
    /// and whether it exited successfully.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<bool> {
        let end = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status.success()),
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(20)),
                _ => return None,
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the scenario on `bed` with a fresh peer, source and destination.
pub fn run(
    bed: &Testbed,
    daemon: &Daemon,
    config: &ScenarioConfig,
) -> Result<ScenarioOutcome, ScenarioError> {
    let tag = config.strategy.label();
    let strategy = config.strategy.migrator_name();
    let steps::MoveGuests { peer, src, dst } = steps::MoveGuests::start_with(
        bed,
        tag,
        steps::GuestOptions {
            dst_nic: config.strategy.nic_migrates(),
            dst_paused_on_arrival: config.hold_arrival.is_some(),
            ..Default::default()
        },
    )
    .map_err(Box::new)?;
    let peer_spec = peer.spec().clone();

    let peer_clock_offset_ms = clock_offset_ms(&peer)?;
    let processes = config.processes.max(1);
    for i in 0..processes {
        let port = TRAFFIC_PORT + i as u16;
        let server = format!("{}:{port}", peer_spec.address());
        let mut common = format!(
            "--mode {} --rate {} --connections {} --peer-wait-s {} --connect-timeout-s {} \
             --flush-timeout-s {}",
            config.strategy.traffic_mode(),
            config.rate,
            config.connections,
            config.peer_wait_s,
            config.connect_timeout_s,
            config.flush_timeout_s
        );
        if let Some((ack_timeout, retry_count)) = config.retry_budget {
            common.push_str(&format!(
                " --ack-timeout {ack_timeout} --retry-count {retry_count}"
            ));
        }
        if config.strategy == Strategy::Bridge {
            // Both ends name the peer's bridge: the server listens there, the client
            // connects to it.
            common.push_str(&format!(
                " --bridge {}:{port}",
                peer_spec.permanent_address()
            ));
        }
        for (guest, args) in [
            (&peer, format!("serve --listen {server} {common}")),
            (&src, format!("connect --to {server} {common}")),
        ] {
            let started = steps::start_traffic(guest, &traffic_tag(i), &args);
            step(guest, "starting the traffic tool", started)?;
        }
    }
    let connecting = Instant::now();
    for i in 0..processes {
        for (guest, other) in [(&peer, &src), (&src, &peer)] {
            let ready = steps::wait_ready(guest, &traffic_tag(i), config.connections);
            if ready.is_err() {
                // The error holds this side's log; why a connect never completes may be in
                // the other side's.
                let tail = format!("tail -n 60 /tmp/{}.err", traffic_tag(i));
                match other.run(&tail, steps::STEP_TIMEOUT) {
                    Ok(out) => eprintln!("{}'s {}:\n{}", other.name(), traffic_tag(i), out.output),
                    Err(e) => eprintln!("{}'s log: {}", other.name(), crate::error_chain(&e)),
                }
            }
            step(guest, "waiting for the traffic tool to connect", ready)?;
        }
    }
    eprintln!(
        "rdmamig-testbed {tag}: {} connections in {processes} processes connected in {:.1} s",
        processes * config.connections,
        connecting.elapsed().as_secs_f64()
    );
    std::thread::sleep(config.before);
    // The peer's counters, unless the peer moves too (its device is then replaced).
    let read_retransmissions = || {
        step(
            &peer,
            "reading the retransmission counters",
            steps::retransmissions(&peer),
        )
    };
    let retransmissions_before = if config.move_peer {
        None
    } else {
        Some(read_retransmissions()?)
    };

    let report_path = bed.dir().join(format!("move-{tag}.json"));
    let peer_report_path = bed.dir().join(format!("move-{tag}-peer.json"));
    let peer_dst = if config.move_peer {
        let spec = bed
            .incoming_spec(&peer_spec, &format!("{tag}-peer-dst"))
            .map_err(Box::new)?;
        Some(bed.start_incoming(spec).map_err(Box::new)?)
    } else {
        None
    };
    let move_first = || {
        migrate_vm(
            bed,
            daemon,
            strategy,
            (&src, &dst),
            &report_path,
            &format!("move-{tag}.log"),
            &config.deadlines,
        )
    };
    let move_peer = |peer_dst: &Guest| {
        migrate_vm(
            bed,
            daemon,
            strategy,
            (&peer, peer_dst),
            &peer_report_path,
            &format!("move-{tag}-peer.log"),
            &config.deadlines,
        )
    };
    let started = crate::unix_ms();
    let path_back = match config.dst_path_back_after {
        Some(after) => {
            bed.set_tap_joined(&dst.spec().tap, false)
                .map_err(Box::new)?;
            let (netns, tap) = (bed.netns().to_owned(), dst.spec().tap.clone());
            Some(std::thread::spawn(move || {
                std::thread::sleep(after);
                crate::netns::set_tap_joined(&netns, &tap, true)
            }))
        }
        None => None,
    };
    let hold = config.hold_arrival.map(|hold| {
        let arrival = dst.arrival();
        std::thread::spawn(move || arrival.hold(hold, MOVE_TIMEOUT))
    });
    let (first, ended, peer_move) = match &peer_dst {
        Some(peer_dst) if config.overlap => {
            let (first, ended, second) = std::thread::scope(|s| {
                let first = s.spawn(|| {
                    let r = move_first();
                    (r, crate::unix_ms())
                });
                std::thread::sleep(Duration::from_millis(500));
                let second = move_peer(peer_dst);
                let (first, ended) = first.join().expect("move thread");
                (first, ended, second)
            });
            (first, ended, Some(second?))
        }
        Some(peer_dst) => {
            let first = move_first();
            let ended = crate::unix_ms();
            std::thread::sleep(config.after);
            (first, ended, Some(move_peer(peer_dst)?))
        }
        None => (move_first(), crate::unix_ms(), None),
    };
    let succeeded = |vm: &Guest, (ok, output): (bool, String)| {
        if ok {
            Ok(output)
        } else {
            Err(ScenarioError::MoveFailed {
                vm: vm.name().to_string(),
                output,
            })
        }
    };
    if let Some(back) = path_back {
        if let Err(e) = back.join().expect("the path's thread") {
            eprintln!("rdmamig-testbed {tag}: putting the destination's NIC back: {e}");
        }
    }
    let held = match hold.map(|h| h.join().expect("the hold's thread")) {
        Some(Ok((arrived, resumed))) => Some(resumed - arrived),
        Some(Err(source)) => {
            return Err(ScenarioError::Guest {
                guest: dst.name().into(),
                what: "holding the arrived VM",
                source: Box::new(source),
            })
        }
        None => None,
    };
    let move_output = succeeded(&src, first?)?;
    let peer_move = peer_move.map(|out| succeeded(&peer, out)).transpose()?;
    std::thread::sleep(config.after);
    let peer_retransmissions = retransmissions_before
        .map(|before| read_retransmissions().map(|now| now.since(before)))
        .transpose()?;
    let peer = peer_dst.as_ref().unwrap_or(&peer);
    // Both sides stop sending before either closes, so neither sees the other's close as
    // an error: signal both, then collect both reports.
    for i in 0..processes {
        for guest in [&dst, peer] {
            let stopped = steps::stop_traffic(guest, &traffic_tag(i));
            step(guest, "stopping the traffic tool", stopped)?;
        }
    }
    let flush = Duration::from_secs(config.flush_timeout_s.into());
    let mover = collect_reports(&dst, processes, flush)?;
    let peer_report = collect_reports(peer, processes, flush)?;
    if let Some(dir) = std::env::var_os(KEEP_LOGS) {
        for (guest, side) in [(&dst, "mover"), (peer, "peer")] {
            for i in 0..processes {
                steps::keep_traffic_log(
                    guest,
                    &traffic_tag(i),
                    &Path::new(&dir).join(format!("{tag}-{side}-{}.log", traffic_tag(i))),
                );
            }
        }
    }
    let mut kernel_problems = Vec::new();
    for guest in [&dst, peer] {
        let read = steps::kernel_problems(guest);
        kernel_problems.extend(step(guest, "reading the kernel log", read)?);
    }
    let move_report = std::fs::read(&report_path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    Ok(ScenarioOutcome {
        strategy: config.strategy,
        move_output,
        move_report,
        move_window_unix_ms: (started, ended),
        held,
        peer_retransmissions,
        peer_move,
        peer: peer_report,
        mover,
        peer_clock_offset_ms,
        kernel_problems,
    })
}

/// Moves `vm` to the `-incoming` guest `dst` with `rdmamig migrate --strategy strategy`,
/// writing the migrator's report to `report_path` and its output to `log` in the bed's
/// directory; stops the source and attaches to the destination's console afterwards.
/// `deadlines`: `phase=ms` items for `--deadline`. Returns whether the move succeeded and
/// what the command printed.
pub fn migrate_vm(
    bed: &Testbed,
    daemon: &Daemon,
    strategy: &str,
    (vm, dst): (&Guest, &Guest),
    report_path: &Path,
    log: &str,
    deadlines: &[String],
) -> Result<(bool, String), ScenarioError> {
    let mut migrate = crate::steps::migrate_command(daemon.socket(), vm, dst);
    migrate
        .args(["--strategy", strategy, "--report"])
        .arg(report_path);
    for deadline in deadlines {
        migrate.args(["--deadline", deadline]);
    }
    let set: u64 = deadlines
        .iter()
        .filter_map(|d| d.split_once('=')?.1.parse::<u64>().ok())
        .sum();
    let bound = MOVE_TIMEOUT + Duration::from_millis(set);
    let outcome = run_bounded(migrate, &bed.dir().join(log), bound)?;
    vm.kill();
    dst.reattach_console()
        .map_err(|source| ScenarioError::Guest {
            guest: dst.name().into(),
            what: "attaching to the console after the move",
            source: Box::new(source),
        })?;
    Ok(outcome)
}

/// Estimates `guest`'s wall clock minus the host's from one console round trip (the
/// error is at most half the round trip, tens of milliseconds).
fn clock_offset_ms(guest: &Guest) -> Result<i64, ScenarioError> {
    let before = crate::unix_ms();
    let out = guest
        .run_ok("rdmamig-traffic now", COMMAND_TIMEOUT)
        .map_err(|source| ScenarioError::Guest {
            guest: guest.name().into(),
            what: "reading the guest clock",
            source: Box::new(source),
        })?;
    let after = crate::unix_ms();
    let guest_ms: u64 = out.trim().parse().map_err(|_| ScenarioError::Report {
        guest: guest.name().into(),
        reason: format!("`rdmamig-traffic now` printed {out:?}"),
    })?;
    Ok(guest_ms as i64 - ((before + after) / 2) as i64)
}

/// Names a host directory where each scenario that moved its VM keeps the traffic
/// processes' logs (the library's link and bridge events), which end with the guests.
const KEEP_LOGS: &str = "RDMAMIG_KEEP_LOGS";

/// The traffic tool's tag (its files in the guest) for process `i` of the scenario.
fn traffic_tag(i: u32) -> String {
    format!("traffic{i}")
}

/// Runs one of the shared traffic steps on `guest`, naming what the scenario was doing.
fn step<T>(
    guest: &Guest,
    what: &'static str,
    result: crate::steps::StepResult<T>,
) -> Result<T, ScenarioError> {
    result.map_err(|source| ScenarioError::Step {
        guest: guest.name().into(),
        what,
        reason: crate::error_chain(source.as_ref()),
    })
}

/// Collects the reports of the `processes` traffic processes of `guest`, summed.
fn collect_reports(
    guest: &Guest,
    processes: u32,
    flush: Duration,
) -> Result<TrafficReport, ScenarioError> {
    let reports = (0..processes)
        .map(|i| {
            step(
                guest,
                "collecting the traffic report",
                steps::collect_report_after_flush(guest, &traffic_tag(i), flush),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    TrafficReport::merge(reports).ok_or_else(|| ScenarioError::Report {
        guest: guest.name().into(),
        reason: "no traffic process".into(),
    })
}

/// Runs `command` to completion within `timeout`, its output going to `log`; returns
/// whether it succeeded and what it printed.
fn run_bounded(
    mut command: Command,
    log: &Path,
    timeout: Duration,
) -> Result<(bool, String), ScenarioError> {
    let spawn_error = |source| ScenarioError::Spawn {
        program: "rdmamig migrate".into(),
        source,
    };
    let file = std::fs::File::create(log).map_err(spawn_error)?;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(file.try_clone().map_err(spawn_error)?)
        .stderr(file)
        .spawn()
        .map_err(spawn_error)?;
    let end = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(spawn_error)? {
            break status;
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ScenarioError::MoveTimeout(timeout));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = std::fs::read_to_string(log).unwrap_or_default();
    Ok((status.success(), output))
}

/// The application's view of one scenario, as printed by the demo and the tests.
pub fn render(outcome: &ScenarioOutcome) -> String {
    let mut text = String::new();
    let side = |text: &mut String, what: &str, r: &TrafficReport, sender: &TrafficReport| {
        text.push_str(&format!(
            "  {what}\n    largest delivery gap (switching time)  {:.1} ms, ended {} UTC\n    \
             sent by the other side / received     {} / {}\n    \
             lost / duplicated / reordered          {} / {} / {}\n    \
             connections established               {}\n    \
             sent over the TCP bridge              {}\n    \
             errors seen                           {}\n",
            r.max_gap_ms,
            r.max_gap_end_time,
            sender.sent,
            r.received,
            r.lost,
            r.duplicated,
            r.reordered,
            r.connections_established,
            sender.bridged,
            if r.errors.is_empty() {
                "none".to_string()
            } else {
                r.errors.join("; ")
            },
        ));
    };
    side(
        &mut text,
        "peer VM, receiving from the moving VM:",
        &outcome.peer,
        &outcome.mover,
    );
    if outcome.peer.max_gap_ms > 0.0 {
        // The peer's clock, set from the RTC at boot, lines up with the host's through the
        // measured offset (within half a console round trip).
        let on_timeline = |guest_ms: u64| {
            guest_ms as i64 - outcome.peer_clock_offset_ms - outcome.move_window_unix_ms.0 as i64
        };
        text.push_str(&format!(
            "    that gap on the move's timeline       +{} ms to +{} ms\n",
            on_timeline(outcome.peer.max_gap_start_unix_ms),
            on_timeline(outcome.peer.max_gap_end_unix_ms),
        ));
    }
    side(
        &mut text,
        "moving VM, receiving from the peer:",
        &outcome.mover,
        &outcome.peer,
    );
    if let Some(r) = outcome.peer_retransmissions {
        text.push_str(&format!(
            "  peer's RC retransmissions during the move: {} timeouts, {} QPs out of retries, \
             {} duplicate requests received\n",
            r.timeouts, r.exhausted, r.duplicates
        ));
    }
    for problem in &outcome.kernel_problems {
        text.push_str(&format!("  guest kernel problem: {problem}\n"));
    }
    text
}

/// Outcomes side by side, one column per move, headed by its strategy.
pub fn compare(outcomes: &[ScenarioOutcome]) -> String {
    let shown = |ms: Option<u64>| ms.map_or("?".to_owned(), |ms| ms.to_string());
    let row = |what: &str, f: &dyn Fn(&ScenarioOutcome) -> String| {
        let cells: String = outcomes
            .iter()
            .map(|o| format!(" {:>10} |", f(o)))
            .collect();
        format!("| {what:<44} |{cells}\n")
    };
    let mut text = row("", &|o| o.strategy.label().to_string());
    text += &format!(
        "|{}|{}\n",
        "-".repeat(46),
        "------------|".repeat(outcomes.len())
    );
    text += &row("switching time at the peer (largest gap, ms)", &|o| {
        format!("{:.1}", o.peer.max_gap_ms)
    });
    text += &row("largest gap at the moving VM (ms, its clock)", &|o| {
        format!("{:.1}", o.mover.max_gap_ms)
    });
    text += &row("VMM downtime (ms)", &|o| shown(o.vmm_downtime_ms()));
    text += &row("VM paused, STOP to RESUME (ms)", &|o| {
        shown(o.vm_paused_ms())
    });
    text += &row("messages lost (peer + moving VM)", &|o| {
        (o.peer.lost + o.mover.lost).to_string()
    });
    text += &row("messages duplicated", &|o| {
        (o.peer.duplicated + o.mover.duplicated).to_string()
    });
    text += &row("errors seen by the peer", &|o| {
        o.peer.errors.len().to_string()
    });
    text += &row("move command wall time (ms)", &|o| {
        (o.move_window_unix_ms.1 - o.move_window_unix_ms.0).to_string()
    });
    text
}
