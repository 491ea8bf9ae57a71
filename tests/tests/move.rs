//! End-to-end: a VM with live RDMA traffic both ways moves to another QEMU process through
//! the rdmamig daemon and CLI, on the test bed.
//!
//! - The coordinated moves (`reconnect`, and `bridge` with a TCP bridge on the guests'
//!   permanent NICs) must lose, duplicate and reorder nothing, the peer must see no error,
//!   traffic must go on after the move, and every phase must be in the timeline. With
//!   `bridge`, both sides must have carried messages over the bridge.
//! - The naive move (unplug, migrate, plug; traffic over a plain rdma_cm connection that
//!   reconnects on its own) is recorded beside it: what it lost and its largest gap.
//! - What the guests sent each other is captured in the namespace ([`Capture`]): every RDMA
//!   SEND and every library record in rdma_cm's messages must decode as the library's wire
//!   protocol, and with `bridge` every TCP bridge as its greeting and frames. With
//!   `RDMAMIG_RECORD_CORPUS=<dir>` they are kept there as fuzz seeds (`fuzz/seeds/`).
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use rdmamig_conn::wire::{Header, PrivateData, HEADER_LEN, MAX_CONNECT_PRIVATE_DATA};
use rdmamig_migrator::machine::Phase;
use rdmamig_migrator::timeline::PhaseOutcome;
use rdmamig_testbed::capture::{Capture, Packets};
use rdmamig_testbed::corpus;
use rdmamig_testbed::scenario::{self, Daemon, ScenarioConfig, ScenarioOutcome, Strategy};
use rdmamig_testbed::{error_chain, steps, Testbed};

fn run(strategy: Strategy) -> (ScenarioOutcome, Packets) {
    let bed =
        Testbed::new(strategy.migrator_name()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let capture = Capture::start(bed.netns()).expect("capturing in the namespace");
    // A panic while `bed` lives prints every guest's console.
    let outcome = scenario::run(&bed, &daemon, &ScenarioConfig::new(strategy))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    eprintln!("{}\n{}", outcome.move_output, scenario::render(&outcome));
    let packets = capture.finish().expect("the capture");
    (outcome, packets)
}

#[test]
fn coordinated_move_loses_nothing_and_the_peer_sees_no_error() {
    let (o, packets) = run(Strategy::Reconnect);
    assert_coordinated(&o);
    assert_eq!(
        o.peer.bridged + o.mover.bridged,
        0,
        "no bridge was configured"
    );
    let (sends, records) = rdma_on_the_wire(&packets);
    keep_seeds("rdma_wire", "send", &one_per_shape(sends));
    keep_seeds("rdma_wire", "cm", &records);
}

#[test]
fn bridged_move_loses_nothing_and_carries_traffic_over_tcp() {
    let (o, packets) = run(Strategy::Bridge);
    assert_coordinated(&o);
    for (report, name) in [(&o.peer, "peer"), (&o.mover, "moving VM")] {
        assert!(
            report.bridged > 0,
            "the {name} sent nothing over the bridge: {report:?}"
        );
    }
    rdma_on_the_wire(&packets);
    let bridges = bridges_on_the_wire(&packets);
    let openings: Vec<Vec<u8>> = bridges
        .iter()
        .map(|s| s[..s.len().min(SEED_BYTES)].to_vec())
        .collect();
    keep_seeds("bridge", "stream", &openings);
}

/// Every RDMA SEND the guests exchanged is one of the library's messages, and every library
/// record in rdma_cm's messages decodes; returns both.
fn rdma_on_the_wire(packets: &Packets) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let sends = packets.rdma_sends();
    assert!(
        !sends.is_empty(),
        "no RDMA SEND in {} packets",
        packets.len()
    );
    for send in &sends {
        if let Err(e) = Header::decode(send) {
            panic!("an RDMA SEND that is not a message ({e}): {send:02x?}");
        }
    }
    let records = packets.cm_private_data(PrivateData::MAGIC);
    assert!(
        !records.is_empty(),
        "no library record in rdma_cm's messages"
    );
    for record in &records {
        if let Err(e) = PrivateData::decode(record) {
            panic!("a connection record that does not decode ({e}): {record:02x?}");
        }
    }
    (sends, records)
}

/// The TCP bridges (streams that open with a BRIDGE or ACCEPT record) each decode as that
/// record and then whole frames; returns them. Both directions must be there.
fn bridges_on_the_wire(packets: &Packets) -> Vec<Vec<u8>> {
    let bridges: Vec<Vec<u8>> = packets
        .tcp_streams()
        .into_iter()
        .filter(|s| {
            matches!(
                PrivateData::decode(s),
                Ok(PrivateData::Bridge(_) | PrivateData::Accept(_))
            )
        })
        .collect();
    let greetings = bridges
        .iter()
        .filter(|s| matches!(PrivateData::decode(s), Ok(PrivateData::Bridge(_))))
        .count();
    assert!(
        greetings > 0 && greetings < bridges.len(),
        "{greetings} bridge greetings among {} bridge streams",
        bridges.len()
    );
    for stream in &bridges {
        let mut rest = stream.get(MAX_CONNECT_PRIVATE_DATA..).unwrap_or_default();
        while let Some(len) = Header::announced_len(rest) {
            let Some(frame) = rest.get(..HEADER_LEN + len) else {
                break; // the capture ended inside this frame
            };
            if let Err(e) = Header::decode(frame) {
                panic!("a bridge frame that does not decode ({e}): {frame:02x?}");
            }
            rest = &rest[frame.len()..];
        }
    }
    bridges
}

/// The largest seed kept: libFuzzer's default input size. A bridge stream is cut to its
/// greeting and first frames.
const SEED_BYTES: usize = 4096;

/// One message for each header shape (kind, flags and length): thousands of SENDs differ
/// only in their sequence numbers and data, which the fuzzer varies anyway.
fn one_per_shape(messages: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut seen = std::collections::HashSet::new();
    messages
        .into_iter()
        .filter(|m| seen.insert(m.get(..8).map(<[u8]>::to_vec)))
        .collect()
}

/// Keeps `messages` as seeds of fuzz target `target` (with `RDMAMIG_RECORD_CORPUS`).
fn keep_seeds(target: &str, prefix: &str, messages: &[Vec<u8>]) {
    corpus::keep(target, prefix, messages)
        .unwrap_or_else(|e| panic!("keeping the {target} seeds: {e}"));
}

/// What every coordinated move must show: each phase ok, every connection quiesced and
/// resumed, nothing lost, duplicated or reordered either way, no error, traffic after.
fn assert_coordinated(o: &ScenarioOutcome) {
    let report = o
        .move_report
        .as_ref()
        .expect("the migrator wrote its report");
    for phase in [
        Phase::Prepare,
        Phase::Quiesce,
        Phase::Detach,
        Phase::Migrate,
        Phase::Attach,
        Phase::Resume,
    ] {
        let record = report
            .timeline
            .phase(phase)
            .unwrap_or_else(|| panic!("phase {phase:?} missing from the timeline"));
        assert_eq!(record.outcome, PhaseOutcome::Ok, "phase {phase:?}");
        if phase == Phase::Migrate {
            // The guest's pause (source STOP to destination RESUME, QEMU's stamps) lies
            // within this migration; QEMU's downtime_ms is printed beside it.
            let paused = &record.details["vm_paused_ms"];
            assert!(
                matches!(paused.as_u64(), Some(p) if p > 0 && p <= record.duration_ms),
                "vm_paused_ms {paused} outside the migrate phase: {:?}",
                record.details
            );
        }
    }
    assert!(
        !report.quiesce.is_empty() && report.quiesce.iter().all(|c| c.ok),
        "quiesce outcomes: {:?}",
        report.quiesce
    );
    assert!(
        !report.resume.is_empty() && report.resume.iter().all(|c| c.ok),
        "resume outcomes: {:?}",
        report.resume
    );

    for (receiver, sender, name) in [
        (&o.peer, &o.mover, "peer"),
        (&o.mover, &o.peer, "moving VM"),
    ] {
        assert_eq!(receiver.lost, 0, "{name} lost messages");
        assert_eq!(receiver.duplicated, 0, "{name} got duplicates");
        assert_eq!(receiver.reordered, 0, "{name} got messages out of order");
        assert_eq!(
            receiver.received, sender.sent,
            "{name} received {} of the {} messages sent to it",
            receiver.received, sender.sent
        );
        assert!(
            receiver.errors.is_empty(),
            "{name} saw errors: {:?}",
            receiver.errors
        );
    }
    steps::assert_no_kernel_problems(&o.kernel_problems);
    // Traffic went on after the move: the peer's last delivery (on the host's clock) is
    // well after the move ended.
    let last_delivery = o.peer.last_delivery_unix_ms as i64 - o.peer_clock_offset_ms;
    assert!(
        last_delivery > o.move_window_unix_ms.1 as i64 + 1000,
        "the peer's last delivery ({last_delivery}) is not after the move's end ({})",
        o.move_window_unix_ms.1
    );
}

#[test]
fn naive_move_baseline_is_recorded() {
    let (o, _) = run(Strategy::Naive);
    // The baseline's own steps must work for the comparison to mean anything: the unplug
    // completes and the VM migrates (`run` fails otherwise), and the application
    // reconnects by itself afterwards.
    assert!(
        o.peer.connections_established >= 2,
        "the plain client did not reconnect after the move"
    );
    let last_delivery = o.peer.last_delivery_unix_ms as i64 - o.peer_clock_offset_ms;
    assert!(
        last_delivery > o.move_window_unix_ms.1 as i64,
        "traffic did not resume after the naive move"
    );
    eprintln!(
        "naive baseline: lost {} + {}, largest gap at the peer {:.1} ms, peer errors {:?}",
        o.peer.lost, o.mover.lost, o.peer.max_gap_ms, o.peer.errors
    );
}
