//! The soak and fault test, on the test bed: one VM moves back and forth
//! `RDMAMIG_SOAK_MOVES` times (20 by default; set it higher for a long run by hand) with
//! traffic both ways, while faults chosen from a seed hit its moves at random points:
//! - the guest agent killed (and started again once the move has ended);
//! - the daemon killed and restarted (it finishes or rolls back the move from its journal);
//! - a flood of idle connections on the daemon's API socket;
//! - a client that stops reading for the whole move (SIGSTOP);
//! - the traffic processes restarted after the move (the flow that ends is checked).
//!
//! Every move plugs a function from the daemon's pool (`--from-pool`) and gives back the one
//! it unplugs (`--source-function`). The seed is printed (`RDMAMIG_SOAK_SEED=<seed>` repeats
//! a run), and so is each move's fault and outcome. At the end every move has a report in
//! the daemon's history, every flow lost, duplicated and reordered nothing, the daemon still
//! answers, and its pool is consistent: the function the VM has is attached to it, the other
//! is free.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{
    finish_clean_flow, migrate_command_as, start_traffic, wait_ready, MoveGuests, STEP_TIMEOUT,
};
use rdmamig_testbed::{bin_dir, error_chain, Guest, Testbed};
use serde_json::Value;

/// How long a flow's connections wait for a coordinated resume before they reconnect on
/// their own (after a move whose agent was killed).
const PEER_WAIT_S: u64 = 8;
/// How long one move may take, faults included.
const MOVE_TIMEOUT: Duration = Duration::from_secs(180);
/// The VM's name in every move (its QEMU processes have names of their own).
const VM: &str = "soak-vm";
/// The daemon's pool: two emulated NICs on whichever VMM's `nd0` a move plugs them into.
const POOL: &str = "[[pool.function]]\nname = \"nic-a\"\ndevice = \"driver=virtio-net-pci,netdev=nd0\"\n\
                    [[pool.function]]\nname = \"nic-b\"\ndevice = \"driver=virtio-net-pci,netdev=nd0\"\n";

/// A fault injected into one move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    AgentKilled,
    DaemonRestarted,
    ConnectionFlood,
    StoppedClient,
    TrafficRestarted,
}

const FAULTS: [Fault; 6] = [
    Fault::None,
    Fault::AgentKilled,
    Fault::DaemonRestarted,
    Fault::ConnectionFlood,
    Fault::StoppedClient,
    Fault::TrafficRestarted,
];

/// xorshift64*: the same seed, the same faults at the same points.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

#[test]
fn moves_back_and_forth_under_random_faults_lose_nothing() {
    let seed: u64 = std::env::var("RDMAMIG_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
        | 1;
    let moves: usize = std::env::var("RDMAMIG_SOAK_MOVES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    say(&format!(
        "soak: seed {seed} (RDMAMIG_SOAK_SEED={seed} repeats this run), {moves} moves"
    ));
    let mut rng = Rng(seed);

    let bed = Testbed::new("soak").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let config = bed.dir().join("rdmamig.toml");
    std::fs::write(&config, POOL).unwrap();
    let mut daemon = Daemon::start_named(bed.dir(), "rdmamig", Some(&config))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    // The pool function the VM has (none before its first move).
    let mut function: Option<String> = None;
    let guests = MoveGuests::start(&bed, "sk").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let mut flow = 0;
    // The moving VM's connections reconnect on their own PEER_WAIT_S after a move whose
    // resume never reached them; the peer's wait for them is the library's default (60 s).
    let (peer_traffic, vm_traffic) = (
        "--rate 50".to_string(),
        format!("--rate 50 --peer-wait-s {PEER_WAIT_S}"),
    );
    guests
        .start_flow_sides(&tag(flow), &peer_traffic, &vm_traffic)
        .unwrap();
    let MoveGuests { peer, src, dst } = guests;
    let (mut vm, mut next) = (src, Some(dst));

    for n in 1..=moves {
        let fault = FAULTS[rng.below(FAULTS.len() as u64) as usize];
        let at = Duration::from_millis(rng.below(3000));
        let dst = match next.take() {
            Some(dst) => dst,
            None => {
                let spec = bed
                    .incoming_spec(vm.spec(), &format!("sk-{n}"))
                    .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
                bed.start_incoming(spec)
                    .unwrap_or_else(|e| panic!("{}", error_chain(&e)))
            }
        };
        let started = Instant::now();
        let mut command = migrate_command_as(daemon.socket(), VM, &vm, &dst);
        command.arg("--from-pool");
        if let Some(function) = &function {
            command.args(["--source-function", function]);
        }
        let client = command
            .arg("--report")
            .arg(bed.dir().join(format!("move-{n}.json")))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let injected = inject(fault, at, &client, &mut daemon, &bed, &config, &vm);
        let out = wait_client(client, fault, daemon.socket());
        let report = newest_report(daemon.socket(), n);
        let outcome = report["final_phase"].as_str().unwrap_or("?").to_string();
        let moved = report["vm_location"] == "destination";
        say(&format!(
            "soak: move {n}: {fault:?} {injected}: {outcome} in {} ms, VM on the {}",
            started.elapsed().as_millis(),
            if moved { "destination" } else { "source" }
        ));
        // A move ends done or rolled back. One whose agent died after the quiesce ends
        // failed past the point of no return: the VM runs on the destination, and its
        // connections, which no resume reached, reconnect on their own.
        let expected = outcome == "done"
            || outcome == "rolled_back"
            || (fault == Fault::AgentKilled && outcome == "failed" && moved);
        assert!(
            expected,
            "move {n} ({fault:?}) ended {outcome}:\n{out}\n{report:#}"
        );
        if moved {
            vm.kill();
            dst.reattach_console().unwrap();
            vm = dst;
            function = report["function"].as_str().map(str::to_string);
        } else {
            dst.kill();
        }
        if fault == Fault::AgentKilled {
            // The agent died with the VM's memory wherever it went: start it again, and let
            // the connections, which got no coordinated resume, reconnect on their own.
            vm.run_ok(
                &format!(
                    "pidof rdmamig-agent >/dev/null || {{ {} --port-name {} --vsock-port {} \
                     </dev/null >>/run/agent.log 2>&1 & }}",
                    rdmamig_images::init::AGENT_PATH,
                    rdmamig_images::init::AGENT_PORT_NAME,
                    rdmamig_images::init::AGENT_VSOCK_PORT
                ),
                STEP_TIMEOUT,
            )
            .unwrap();
            std::thread::sleep(Duration::from_secs(PEER_WAIT_S + 4));
        }
        if fault == Fault::TrafficRestarted {
            finish_clean_flow(&vm, "moving VM", &peer, &tag(flow));
            flow += 1;
            let server = format!("{}:7471", peer.spec().address());
            start_traffic(
                &peer,
                &tag(flow),
                &format!("serve --listen {server} {peer_traffic}"),
            )
            .and_then(|()| {
                start_traffic(
                    &vm,
                    &tag(flow),
                    &format!("connect --to {server} {vm_traffic}"),
                )
            })
            .and_then(|()| wait_ready(&peer, &tag(flow)))
            .and_then(|()| wait_ready(&vm, &tag(flow)))
            .unwrap();
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    finish_clean_flow(&vm, "moving VM", &peer, &tag(flow));
    let history = rdmamig(daemon.socket(), &["history", "--limit", "10000"]);
    assert_eq!(
        history.as_array().map(Vec::len),
        Some(moves),
        "every move has a report: {history:#}"
    );
    let status = rdmamig(daemon.socket(), &["status"]);
    assert_eq!(status["moves"], serde_json::json!([]), "{status:#}");
    let pool = rdmamig(daemon.socket(), &["pool"]);
    say(&format!("soak: pool at the end: {pool}"));
    for entry in pool.as_array().unwrap() {
        let name = entry["name"].as_str().unwrap();
        let state = &entry["state"];
        if Some(name) == function.as_deref() {
            assert_eq!(state["state"], "attached", "{pool:#}");
            assert_eq!(state["vm"], VM, "{pool:#}");
        } else {
            assert_eq!(state["state"], "free", "{pool:#}");
        }
    }
}

/// Prints to the test's stderr even when the test passes (the test harness captures only
/// what its print macros write): CI's log shows the seed and every move's outcome.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn tag(flow: usize) -> String {
    format!("soak{flow}")
}

/// Injects `fault` into the move `client` asked for, `at` into it; says what it did.
fn inject(
    fault: Fault,
    at: Duration,
    client: &Child,
    daemon: &mut Daemon,
    bed: &Testbed,
    config: &Path,
    vm: &Guest,
) -> String {
    match fault {
        Fault::None | Fault::TrafficRestarted => String::new(),
        Fault::AgentKilled => {
            std::thread::sleep(at);
            // Once the VM has stopped on the source its console no longer answers, and the
            // kill may or may not have run before it did.
            match vm.run("kill -KILL $(pidof rdmamig-agent)", Duration::from_secs(3)) {
                Ok(_) => format!("at {} ms", at.as_millis()),
                Err(_) => format!(
                    "at {} ms (no answer from the console within 3 s: the VM may have stopped)",
                    at.as_millis()
                ),
            }
        }
        Fault::DaemonRestarted => {
            std::thread::sleep(at);
            daemon
                .restart_after_kill(bed.dir(), Some(config))
                .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
            format!("at {} ms", at.as_millis())
        }
        Fault::ConnectionFlood => {
            std::thread::sleep(at);
            let socket = daemon.socket().to_path_buf();
            let flood: Vec<UnixStream> = (0..300)
                .filter_map(|_| UnixStream::connect(&socket).ok())
                .collect();
            let held = flood.len();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(3));
                drop(flood);
            });
            format!("at {} ms ({held} idle connections for 3 s)", at.as_millis())
        }
        Fault::StoppedClient => {
            // Once the daemon runs the move the client asked for.
            let end = Instant::now() + Duration::from_secs(10);
            while moves_running(daemon.socket()).unwrap_or(0) == 0 {
                assert!(Instant::now() < end, "the move never started");
                std::thread::sleep(Duration::from_millis(20));
            }
            signal(client, libc::SIGSTOP);
            "once the move ran, for the rest of it".into()
        }
    }
}

fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) with a PID of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

/// Waits for the move's client to end (a stopped one is let go once the daemon says the
/// move ended, whatever the client did); returns what it printed.
fn wait_client(mut client: Child, fault: Fault, socket: &Path) -> String {
    if fault == Fault::StoppedClient {
        wait_idle(socket);
        signal(&client, libc::SIGCONT);
    }
    let end = Instant::now() + MOVE_TIMEOUT;
    while client.try_wait().unwrap().is_none() {
        assert!(Instant::now() < end, "the move's client did not end");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut out = String::new();
    for pipe in [
        client.stdout.take().map(|p| Box::new(p) as Box<dyn Read>),
        client.stderr.take().map(|p| Box::new(p) as Box<dyn Read>),
    ]
    .into_iter()
    .flatten()
    {
        let mut pipe = pipe;
        let _ = pipe.read_to_string(&mut out);
    }
    wait_idle(socket);
    out
}

/// Waits until the daemon runs no move (a restarted one may still be recovering).
fn wait_idle(socket: &Path) {
    let end = Instant::now() + MOVE_TIMEOUT;
    loop {
        let running = moves_running(socket);
        if running == Some(0) {
            return;
        }
        assert!(
            Instant::now() < end,
            "the daemon still runs moves: {running:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// How many moves the daemon runs; `None` when it does not answer.
fn moves_running(socket: &Path) -> Option<usize> {
    rdmamig_try(socket, &["status"])?["moves"]
        .as_array()
        .map(Vec::len)
}

/// The report of the newest move, once the daemon's history has `count` moves.
fn newest_report(socket: &Path, count: usize) -> Value {
    let history = rdmamig(socket, &["history", "--limit", "10000"]);
    let moves = history.as_array().unwrap();
    assert_eq!(moves.len(), count, "a move has no report: {history:#}");
    let id = moves[0]["id"].as_str().unwrap();
    rdmamig(socket, &["report", id])
}

fn rdmamig(socket: &Path, args: &[&str]) -> Value {
    rdmamig_try(socket, args).unwrap_or_else(|| panic!("rdmamig {args:?} failed"))
}

fn rdmamig_try(socket: &Path, args: &[&str]) -> Option<Value> {
    let out = Command::new(bin_dir().join("rdmamig"))
        .args(args)
        .arg("--socket")
        .arg(socket)
        .arg("--json")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}
