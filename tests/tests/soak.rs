//! The soak and fault test, on the test bed: one VM moves back and forth
//! `RDMAMIG_SOAK_MOVES` times (12 by default; set it higher for a long run by hand) with
//! traffic both ways, while faults hit its moves at random points. The faults are dealt
//! from a deck shuffled by a seed that holds every fault equally often (twice in the
//! default 12 moves), so that each fault is tried in every run:
//! - the guest agent killed (and started again once the move has ended);
//! - the daemon killed and restarted (it finishes or rolls back the move from its journal);
//! - a flood of idle connections on the daemon's API socket and on its `[peer]` port;
//! - a client that stops reading for the whole move (SIGSTOP);
//! - the peer's traffic process killed during the move and started again: the moving VM's
//!   program must be told (its connection fails, it is not left waiting), and what it got
//!   before has no gap, duplicate or reordering; a new flow then starts.
//!
//! Every move plugs a function from the daemon's pool (`--from-pool`) and gives back the one
//! it unplugs (`--source-function`). The seed is printed (`RDMAMIG_SOAK_SEED=<seed>` repeats
//! a run), and so is each move's fault and outcome. At the end every move has a report in
//! the daemon's history, every flow lost, duplicated and reordered nothing, the daemon still
//! answers on its API socket and on its `[peer]` port, and its pool is consistent: the
//! function the VM has is attached to it, the other is free.
//!
//! `RDMAMIG_SOAK_FAULT=<fault>` (say `PeerTrafficRestarted`) injects that fault into every
//! move, to chase one by hand.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmamig_migrator::config::KnownPeer;
use rdmamig_migrator::destination::MoveRef;
use rdmamig_migrator::peer::{self, PeerCall, PeerRequest, PeerTls, PEER_PROTOCOL_VERSION};
use rdmamig_testbed::pki::{free_port, Pki};
use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{
    collect_report, finish_clean_flow, migrate_command_as, start_traffic, stop_traffic, wait_ready,
    MoveGuests, STEP_TIMEOUT,
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
    PeerTrafficRestarted,
}

const FAULTS: [Fault; 6] = [
    Fault::None,
    Fault::AgentKilled,
    Fault::DaemonRestarted,
    Fault::ConnectionFlood,
    Fault::StoppedClient,
    Fault::PeerTrafficRestarted,
];

/// The soak's fixed parts: the bed, the daemon's config and its `[peer]` port, the peer VM.
struct Scene<'a> {
    bed: &'a Testbed,
    config: PathBuf,
    peer_port: u16,
    peer: &'a Guest,
    /// The options of the peer's traffic server.
    peer_traffic: &'a str,
    /// The connection floods started, joined before the end's checks.
    floods: std::cell::RefCell<Vec<std::thread::JoinHandle<()>>>,
}

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

/// `moves` faults, each of [`FAULTS`] as often as the others (a remainder repeats the first
/// ones), in an order the seed decides (Fisher-Yates).
fn shuffled_deck(rng: &mut Rng, moves: usize) -> Vec<Fault> {
    let mut deck: Vec<Fault> = FAULTS.iter().copied().cycle().take(moves).collect();
    for i in (1..deck.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        deck.swap(i, j);
    }
    deck
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
        .unwrap_or(2 * FAULTS.len());
    say(&format!(
        "soak: seed {seed} (RDMAMIG_SOAK_SEED={seed} repeats this run), {moves} moves"
    ));
    let forced = std::env::var("RDMAMIG_SOAK_FAULT").ok().map(|name| {
        *FAULTS
            .iter()
            .find(|f| format!("{f:?}") == name)
            .unwrap_or_else(|| panic!("RDMAMIG_SOAK_FAULT={name}: not one of {FAULTS:?}"))
    });
    let mut rng = Rng(seed);
    let deck = shuffled_deck(&mut rng, moves);

    let bed = Testbed::new("soak").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let pki = Pki::new(&bed.dir().join("pki")).unwrap();
    pki.issue("soak").unwrap();
    let peer_port = free_port().unwrap();
    let config = bed.dir().join("rdmamig.toml");
    let text = format!(
        "{POOL}\n{}",
        pki.peer_table("soak", Some(peer_port), &[("self", "soak", peer_port)], &[])
    );
    std::fs::write(&config, text).unwrap();
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
    let scene = Scene {
        bed: &bed,
        config,
        peer_port,
        peer: &peer,
        peer_traffic: &peer_traffic,
        floods: Default::default(),
    };
    let (mut vm, mut next) = (src, Some(dst));

    for n in 1..=moves {
        let fault = forced.unwrap_or(deck[n - 1]);
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
        let injected = inject(fault, at, &client, &mut daemon, &scene, &vm, flow);
        let out = wait_client(client, fault, daemon.socket());
        let report = newest_report(daemon.socket(), n);
        let outcome = report["final_phase"].as_str().unwrap_or("?").to_string();
        let moved = report["vm_location"] == "destination";
        say(&format!(
            "soak: move {n}: {fault:?} {injected}: {outcome} in {} ms, VM on the {}",
            started.elapsed().as_millis(),
            if moved { "destination" } else { "source" }
        ));
        // A move ends done or rolled back. Two faults may end it failed past the point of no
        // return, the VM running on the destination: an agent that died after the quiesce
        // (the connections, which no resume reached, reconnect on their own), and a peer
        // program that died (its connection cannot resume, and the report says so).
        let expected = outcome == "done"
            || outcome == "rolled_back"
            || (outcome == "failed"
                && moved
                && matches!(fault, Fault::AgentKilled | Fault::PeerTrafficRestarted));
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
        if fault == Fault::PeerTrafficRestarted {
            check_broken_flow(&vm, &tag(flow));
            // The peer's new server (started by `inject`) takes the VM's new program.
            flow += 1;
            let server = format!("{}:7471", peer.spec().address());
            start_traffic(
                &vm,
                &tag(flow),
                &format!("connect --to {server} {vm_traffic}"),
            )
            .and_then(|()| wait_ready(&peer, &tag(flow), 1))
            .and_then(|()| wait_ready(&vm, &tag(flow), 1))
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
    // Once every flood has let go, the port must serve again (a flood still connecting
    // would hold its places and backlog: once, 169 of its connects timed out at 500 ms each).
    for flood in scene.floods.take() {
        flood.join().expect("the flood thread");
    }
    let answer = peer_call(&pki, peer_port);
    say(&format!("soak: the [peer] port answers: {answer}"));
}

/// The VM's program of a flow whose peer program was killed: it must have been told (its
/// connection fails once the peer refuses the resume or `peer_wait` passes), and what it
/// received before has no gap, duplicate or reordering.
fn check_broken_flow(vm: &Guest, tag: &str) {
    std::thread::sleep(Duration::from_secs(PEER_WAIT_S + 2));
    let report = stop_traffic(vm, tag)
        .and_then(|()| collect_report(vm, tag))
        .unwrap_or_else(|e| panic!("{tag}: the VM's traffic report: {e}"));
    say(&format!(
        "soak: {tag} (its peer killed): received {}, errors {:?}",
        report.received, report.errors
    ));
    assert_eq!(report.lost, 0, "{report:?}");
    assert_eq!(report.duplicated, 0, "{report:?}");
    assert_eq!(report.reordered, 0, "{report:?}");
    assert!(
        !report.errors.is_empty(),
        "the VM's program was not told that its peer died: {report:?}"
    );
}

/// Asks the daemon, over its `[peer]` port and mutual TLS, to release a function it does not
/// have: any answer shows that the port still serves. Returns the answer, in words.
fn peer_call(pki: &Pki, port: u16) -> String {
    let known = KnownPeer {
        name: "self".into(),
        cert: pki.file("soak", "pem"),
        address: Some(format!("127.0.0.1:{port}")),
    };
    let tls = PeerTls::load(
        &pki.file("soak", "pem"),
        &pki.file("soak", "key"),
        &pki.file("ca", "pem"),
        &[known],
    )
    .unwrap();
    let target = tls.resolve("self").unwrap();
    let request = PeerRequest {
        version: PEER_PROTOCOL_VERSION,
        deadline_ms: 5000,
        call: PeerCall::Release {
            function: "no-such-function".into(),
            of: MoveRef {
                move_id: "soak-probe".into(),
                vm: VM.into(),
            },
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let answer = runtime
        .block_on(peer::call(&tls, &target, &request))
        .unwrap_or_else(|e| panic!("the [peer] port does not serve: {}", error_chain(&e)));
    format!("{answer:?}")
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
    scene: &Scene,
    vm: &Guest,
    flow: usize,
) -> String {
    match fault {
        Fault::None => String::new(),
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
                .restart_after_kill(scene.bed.dir(), Some(&scene.config))
                .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
            format!("at {} ms", at.as_millis())
        }
        Fault::ConnectionFlood => {
            std::thread::sleep(at);
            // From a thread of its own, so that the move goes on meanwhile: past the peer
            // listener's places and backlog, connects wait for SYN-ACKs that do not come.
            let socket = daemon.socket().to_path_buf();
            let address = SocketAddr::from(([127, 0, 0, 1], scene.peer_port));
            let flood = std::thread::spawn(move || {
                let local: Vec<UnixStream> = (0..300)
                    .filter_map(|_| UnixStream::connect(&socket).ok())
                    .collect();
                // Connects stop after 5 s: each one past the backlog waits its 500 ms.
                let end = Instant::now() + Duration::from_secs(5);
                let remote: Vec<TcpStream> = (0..300)
                    .take_while(|_| Instant::now() < end)
                    .filter_map(|_| {
                        TcpStream::connect_timeout(&address, Duration::from_millis(500)).ok()
                    })
                    .collect();
                say(&format!(
                    "soak: flood: {} of 300 API and {} of 300 [peer] connections held for 3 s",
                    local.len(),
                    remote.len()
                ));
                std::thread::sleep(Duration::from_secs(3));
            });
            scene.floods.borrow_mut().push(flood);
            format!("at {} ms", at.as_millis())
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
        Fault::PeerTrafficRestarted => {
            std::thread::sleep(at);
            let peer = scene.peer;
            peer.run_ok(
                &format!("kill -KILL $(cat /tmp/{}.pid)", tag(flow)),
                STEP_TIMEOUT,
            )
            .unwrap();
            let server = format!("{}:7471", peer.spec().address());
            start_traffic(
                peer,
                &tag(flow + 1),
                &format!("serve --listen {server} {}", scene.peer_traffic),
            )
            .unwrap();
            format!("at {} ms (killed, a new server started)", at.as_millis())
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
