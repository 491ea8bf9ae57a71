//! Strategy `hot` on the test bed: the RDMA NIC (virtio-net with Soft-RoCE, the test bed's
//! stand-in for a migration-capable VF) stays plugged and migrates with the VM; the
//! destination QEMU was started with the same NIC. The connections pause right before the
//! switchover (the migration held short of it), keep their QPs, and are confirmed on them
//! after the move.
//!
//! Traffic runs both ways. Nothing may be lost, duplicated or reordered, the peer must see
//! no error, no connection may reconnect (one QP each, the same number before and after,
//! as the library reports), and the report must show the pause inside the migrate phase,
//! no detach, no attach.
//!
//! The traffic runs at 1000 messages/s each way ([`RATE`]): QEMU 10.0 switches over by
//! itself after any pass that finds no memory dirty, whatever the hold, and at 200/s the
//! passes a millisecond apart that follow the first one found such a quiet moment in about
//! one run of eight (the move then says so as a forced path, and nothing is lost; but
//! these tests are about what comes after the pause).
//!
//! The last test gives every QP a bounded retry budget and keeps the arrived VM paused
//! longer than it: the same migration uncoordinated (plain rdma_cm connections, which
//! nothing pauses) breaks its connection, and `hot`'s loses nothing.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_migrator::machine::Phase;
use rdmamig_migrator::timeline::PhaseOutcome;
use rdmamig_testbed::scenario::{self, Daemon, ScenarioConfig, ScenarioOutcome, Strategy};
use rdmamig_testbed::{error_chain, Testbed};

/// Messages per second each way: a guest busy enough that no pass finds it idle.
const RATE: u32 = 1000;

fn config() -> ScenarioConfig {
    ScenarioConfig {
        rate: RATE,
        ..ScenarioConfig::new(Strategy::Hot)
    }
}

/// Runs the hot scenario `config` on a test bed of its own, and checks that neither side
/// lost, duplicated or reordered anything or saw an error; returns both sides' reports.
fn run_clean(name: &str, config: &ScenarioConfig) -> ScenarioOutcome {
    let bed = Testbed::new(name).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let o = scenario::run(&bed, &daemon, config).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    eprintln!("{}\n{}", o.move_output, scenario::render(&o));
    for (report, side) in [(&o.peer, "peer"), (&o.mover, "moving VM")] {
        assert_eq!(report.lost, 0, "the {side} lost messages: {report:?}");
        assert_eq!(report.duplicated, 0, "{side}: {report:?}");
        assert_eq!(report.reordered, 0, "{side}: {report:?}");
        assert!(report.errors.is_empty(), "{side} saw errors: {report:?}");
    }
    o
}

#[test]
fn hot_move_keeps_every_qp_and_loses_nothing() {
    let o = run_clean("hot", &config());
    for (report, name) in [(&o.peer, "peer"), (&o.mover, "moving VM")] {
        assert!(report.received > 0, "{name} received nothing: {report:?}");
        // One QP for the whole run: the move kept it, nothing reconnected.
        assert_eq!(
            report.connections_established, 1,
            "the {name}'s connection reconnected: {report:?}"
        );
        assert_eq!(report.qps.len(), 1, "{name}: {report:?}");
        assert_eq!(report.replayed, 0, "{name}: {report:?}");
    }
    assert!(o.kernel_problems.is_empty(), "{:?}", o.kernel_problems);
    let report = o.move_report.as_ref().expect("the move's report");
    assert!(report.ok, "{report:#?}");
    let phase = |p: Phase| {
        report
            .timeline
            .phase(p)
            .unwrap_or_else(|| panic!("no {p} in {report:#?}"))
    };
    for p in [Phase::Quiesce, Phase::Detach, Phase::Attach] {
        assert!(
            matches!(phase(p).outcome, PhaseOutcome::Skipped { .. }),
            "{p}: {:?}",
            phase(p).outcome
        );
    }
    let migrate = &phase(Phase::Migrate).details;
    assert_eq!(
        phase(Phase::Migrate).outcome,
        PhaseOutcome::Ok,
        "{migrate:#?}"
    );
    assert_eq!(migrate["paused"], 1, "{migrate:#?}");
    assert_eq!(
        migrate["switchover"], "held until the pause",
        "{migrate:#?}"
    );
    let resume = &phase(Phase::Resume).details;
    assert_eq!(resume["resumed"], 1, "{resume:#?}");
    assert_eq!(resume["fell_back"], 0, "{resume:#?}");
    eprintln!(
        "hot: peer's largest gap {:.1} ms, VM paused {:?} ms, pause {} ms",
        o.peer.max_gap_ms,
        o.vm_paused_ms(),
        migrate["pause_ms"]
    );
}

/// The QP the move kept does not survive: the destination's NIC is off the bridge from the
/// move's start until 8 s later, so the probe on the kept QP gets no answer. The connection
/// must give the QP up, reconnect once the path is back, replay, and lose nothing; the
/// report says it fell back, and why.
#[test]
fn a_qp_that_does_not_survive_falls_back_to_a_reconnect_and_loses_nothing() {
    let config = ScenarioConfig {
        dst_path_back_after: Some(Duration::from_secs(8)),
        ..config()
    };
    let o = run_clean("hotfb", &config);
    for (report, name) in [(&o.peer, "peer"), (&o.mover, "moving VM")] {
        // The kept QP was given up: a second one carries the connection.
        assert_eq!(report.connections_established, 2, "{name}: {report:?}");
        assert_eq!(report.qps.len(), 2, "{name}: {report:?}");
    }
    let report = o.move_report.as_ref().expect("the move's report");
    assert!(report.ok, "{report:#?}");
    let resume = &report
        .timeline
        .phase(Phase::Resume)
        .expect("a resume")
        .details;
    assert_eq!(resume["fell_back"], 1, "{resume:#?}");
    // What gave the QP up: its retry budget on the probe (the library's retry_cnt), or the
    // confirmation's 3 s, whichever comes first.
    let why = resume["fell_back_connections"][0]
        .as_str()
        .unwrap_or_default();
    assert!(
        why.contains("transport retry counter exceeded")
            || why.contains("the probe on the kept QP"),
        "{resume:#?}"
    );
}

/// The retry budget of the last test: ACK timeout 2^18 x 4.096 us (~1.07 s) and 2 retries,
/// so a QP whose peer stays silent for about 3.2 s goes to error; Soft-RoCE also spends a
/// retry on each sequence-error NAK, which the go-back-N resend after a silence draws.
/// Measured with it (one run each): the uncoordinated QP survived the migration with no
/// hold (peer's gap 0.7 s) and broke with a 1 s hold. Ordinary stalls leave it alone.
const BUDGET: (u8, u8) = (18, 2);
/// How long the arrived VM stays paused: beyond what the budget's timeouts alone allow.
const HOLD: Duration = Duration::from_secs(4);

/// With a bounded retry budget and a VM pause longer than it, the uncoordinated migration
/// with the NIC attached breaks the peer's QP (transport retries exhausted: the peer kept
/// sending into the stopped VM), and `hot`, whose connections stopped sending at the
/// switchover, keeps its QP and loses nothing.
#[test]
fn a_pause_longer_than_the_retry_budget_breaks_an_uncoordinated_qp_but_not_hot() {
    let held = |strategy| ScenarioConfig {
        hold_arrival: Some(HOLD),
        retry_budget: Some(BUDGET),
        ..ScenarioConfig {
            rate: RATE,
            ..ScenarioConfig::new(strategy)
        }
    };

    let bed = Testbed::new("hotbud").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let attached = scenario::run(&bed, &daemon, &held(Strategy::Attached))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    eprintln!("{}\n{}", attached.move_output, scenario::render(&attached));
    let held_for = attached.held.expect("the arrival was held");
    assert_paused_for_the_hold(&attached);
    let retries_exhausted = |errors: &[String]| {
        errors
            .iter()
            .any(|e| e.contains("transport retry counter exceeded"))
    };
    let counters = attached
        .peer_retransmissions
        .expect("the peer's retransmission counters");
    assert!(
        counters.exhausted > 0,
        "the peer's rxe counted no QP out of retries: {counters:?}"
    );
    assert!(
        retries_exhausted(&attached.peer.errors),
        "the uncoordinated peer's QP survived a {held_for:?} pause with budget {BUDGET:?}: \
         peer {:?}, moving VM {:?}",
        attached.peer,
        attached.mover
    );
    drop(daemon);
    drop(bed);

    let o = run_clean("hotbud2", &held(Strategy::Hot));
    let held_for = o.held.expect("the arrival was held");
    assert_paused_for_the_hold(&o);
    for (report, name) in [(&o.peer, "peer"), (&o.mover, "moving VM")] {
        assert!(report.received > 0, "{name} received nothing: {report:?}");
        assert_eq!(
            report.connections_established, 1,
            "the {name}'s connection reconnected: {report:?}"
        );
        assert_eq!(report.replayed, 0, "{name}: {report:?}");
    }
    let report = o.move_report.as_ref().expect("the move's report");
    assert!(report.ok, "{report:#?}");
    eprintln!(
        "hot with budget {BUDGET:?}, VM held {held_for:?}: uncoordinated peer lost {} and \
         the moving VM {} (peer's largest gap {:.0} ms, retransmissions {:?}); hot lost \
         nothing (peer's largest gap {:.0} ms, retransmissions {:?})",
        attached.peer.lost,
        attached.mover.lost,
        attached.peer.max_gap_ms,
        attached.peer_retransmissions,
        o.peer.max_gap_ms,
        o.peer_retransmissions
    );
}

/// The hold reached the traffic: the peer received nothing from the moving VM for at least
/// [`HOLD`] (the hold's own clock says only that it slept).
fn assert_paused_for_the_hold(o: &ScenarioOutcome) {
    assert!(
        o.peer.max_gap_ms >= HOLD.as_millis() as f64,
        "the peer's largest gap ({:.0} ms) is shorter than the hold: {:?}",
        o.peer.max_gap_ms,
        o.peer
    );
}
