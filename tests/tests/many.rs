//! Many connections: 4 traffic processes in the moving VM, 16 migratable connections each
//! (64 in all, each with traffic both ways), and the VM moves with `rdmamig migrate`, once
//! with strategy `reconnect` and once with `bridge` (every connection with a TCP bridge on
//! the permanent NICs). The agent quiesces and resumes the processes, and each process its
//! connections, with bounded concurrency; the move must report an ok outcome for every one
//! of the 64 connections at resume (at quiesce, a link that broke takes the reported forced
//! path), and nothing may be lost, duplicated or reordered on any of them, with no error on
//! either side.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use rdmamig_testbed::scenario::{self, Daemon, ScenarioConfig, ScenarioOutcome, Strategy};
use rdmamig_testbed::{error_chain, steps, Testbed};

const PROCESSES: u32 = 4;
const CONNECTIONS: u32 = 16;
/// How the library reports a connection whose link broke while it quiesced.
const LINK_BROKE: &str = "the link broke during the quiesce";

#[test]
fn sixty_four_connections_in_four_processes_move_with_nothing_lost() {
    let o = move_sixty_four(Strategy::Reconnect);
    assert_eq!(
        o.peer.bridged + o.mover.bridged,
        0,
        "no bridge was configured"
    );
}

#[test]
fn sixty_four_bridged_connections_move_with_nothing_lost() {
    let o = move_sixty_four(Strategy::Bridge);
    for (report, name) in [(&o.peer, "peer"), (&o.mover, "moving VM")] {
        assert!(
            report.bridged > 0,
            "the {name} sent nothing over the bridges: {report:?}"
        );
    }
}

/// Moves the VM with 64 connections under `strategy` and checks what every such move must
/// show; returns the outcome for the strategy's own checks.
fn move_sixty_four(strategy: Strategy) -> ScenarioOutcome {
    let bed = Testbed::new(&format!("many-{}", strategy.migrator_name()))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let config = ScenarioConfig {
        processes: PROCESSES,
        connections: CONNECTIONS,
        // 2 messages/s per connection: 128 messages/s each way in all (the guests have one
        // emulated CPU each, which 64 connections and 128 traffic threads keep busy).
        rate: 2,
        // Deadlines for 64 connections on guests with one emulated CPU each. On an idle
        // machine (2026-12-02) prepare took 1.3-2.9 s, quiesce 1.5-6.8 s, detach 7.6-13.3 s
        // and resume 6.6-8.5 s (32.4 s bridged); in CI and fresh-machine checks the guests ran
        // 5-7 times slower: prepare missed 10 s, quiesce took 11.6 s, detach 17 s, and the
        // new port was not ACTIVE within 58 s. Under a CPU limit of 0.8 core (cgroup
        // cpu.cfs_quota_us, about 9 times slower) a bridged resume had 48 of the 64 back
        // after 250 s. This test is about losing nothing, so the deadlines leave ten times
        // the idle figures or more; how fast 64 connections move is the scale issue's
        // benchmark.
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
        // At 0.8 core, the 64 connections took 72-87 s to connect (4-10 s idle), and the
        // peer once accepted nothing for 24 s, past the default 10 s.
        connect_timeout_s: 60,
        // In CI (2026-12-03) the bridged move's resume took 133 s, and at the stop 19
        // messages on the moving VM's links were still unacknowledged after the 3 s
        // default flush: links that broke late are rebuilt (with their replay) first.
        flush_timeout_s: 120,
        ..ScenarioConfig::new(strategy)
    };
    let o = scenario::run(&bed, &daemon, &config).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    eprintln!("{}\n{}", o.move_output, scenario::render(&o));
    let report = o
        .move_report
        .as_ref()
        .expect("the migrator wrote its report");
    let n = (PROCESSES * CONNECTIONS) as usize;
    for (what, outcomes) in [("quiesce", &report.quiesce), ("resume", &report.resume)] {
        assert_eq!(
            outcomes.len(),
            n,
            "{what}: one outcome per connection: {outcomes:?}"
        );
    }
    // Every connection resumes. A link may break during the quiesce: in a fresh-machine
    // check (2026-12-02), 10 of 64 bridged connections' QPs exhausted their RC retries
    // ("transport retry counter exceeded") while quiescing. The library then releases the
    // link and keeps the messages for the replay, the move reports that forced path, and
    // nothing may be lost (checked below). Anything else that fails a quiesce fails here.
    assert!(
        report.resume.iter().all(|c| c.ok),
        "resume outcomes: {:?}",
        report.resume
    );
    let broke: Vec<_> = report.quiesce.iter().filter(|c| !c.ok).collect();
    assert!(
        broke
            .iter()
            .all(|c| c.error.as_deref().is_some_and(|e| e.contains(LINK_BROKE))),
        "quiesce outcomes: {broke:?}"
    );
    if !broke.is_empty() {
        assert!(
            !report.forced.is_empty(),
            "{} links broke in the quiesce, and the report names no forced path",
            broke.len()
        );
        eprintln!(
            "many: {} of {n} links broke during the quiesce (forced path)",
            broke.len()
        );
    }
    for (receiver, sender, name) in [
        (&o.peer, &o.mover, "peer"),
        (&o.mover, &o.peer, "moving VM"),
    ] {
        assert_eq!(
            receiver.connections,
            PROCESSES * CONNECTIONS,
            "{name}: {receiver:?}"
        );
        assert_eq!(receiver.lost, 0, "{name} lost messages");
        assert_eq!(receiver.duplicated, 0, "{name} got duplicates");
        assert_eq!(receiver.reordered, 0, "{name} got messages out of order");
        assert_eq!(
            receiver.received, sender.sent,
            "{name} did not receive everything"
        );
        assert!(
            receiver.errors.is_empty(),
            "{name} saw errors: {:?}",
            receiver.errors
        );
    }
    steps::assert_no_kernel_problems(&o.kernel_problems);
    assert!(
        o.mover.connections_established >= 2 * (PROCESSES * CONNECTIONS) as u64,
        "every connection should have reconnected: {:?}",
        o.mover
    );
    o
}
