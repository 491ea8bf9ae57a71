//! A migrator killed at every phase boundary on the test bed, with a real guest and live
//! RDMA traffic both ways: for each of the six phases the daemon aborts right after it
//! journaled the phase (`RDMAMIG_CRASH_AT`), before the phase acts; a restarted daemon reads
//! the journal and rolls the move back (killed at prepare, quiesce, detach or migrate: the
//! migration had not completed) or finishes it (killed at attach or resume: the VM already
//! runs on the destination). Each time the flow loses, duplicates and reorders nothing, with
//! no error on either side, and `history`/`report` give the outcome and where it recovered
//! from.
//!
//! Each boundary gets fresh guests: a boundary leaves the destination QEMU in a state the
//! next move cannot use (still waiting with its incoming channel set up, or running the
//! migrated VM), and a rolled-back source may still be releasing its NIC; only the image is
//! shared. Six rounds of ~35 s.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::process::Command;
use std::time::{Duration, Instant};

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{finish_clean_flow, migrate_command, MoveGuests};
use rdmamig_testbed::{bin_dir, error_chain, Testbed};
use serde_json::Value;

const TAG: &str = "flow";

/// Each boundary, how the restarted daemon must end the move, and where the VM then runs.
const BOUNDARIES: [(&str, &str, &str); 6] = [
    ("prepare", "rolled_back", "source"),
    ("quiesce", "rolled_back", "source"),
    ("detach", "rolled_back", "source"),
    ("migrate", "rolled_back", "source"),
    ("attach", "done", "destination"),
    ("resume", "done", "destination"),
];

#[test]
fn a_migrator_killed_at_every_phase_boundary_finishes_or_rolls_back_and_loses_nothing() {
    let mut summary = Vec::new();
    for (index, (phase, outcome, location)) in BOUNDARIES.into_iter().enumerate() {
        summary.push(kill_at(index, phase, outcome, location));
    }
    eprintln!("{}", summary.join("\n"));
}

/// One round: the daemon killed at `phase`; returns a line for the summary.
fn kill_at(index: usize, phase: &str, outcome: &str, location: &str) -> String {
    let bed =
        Testbed::new(&format!("restart{index}")).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let mut daemon =
        Daemon::start_crashing(bed.dir(), phase).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let guests = MoveGuests::start(&bed, &format!("k{index}"))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests
        .start_flow(TAG, "--mode migratable --rate 200")
        .unwrap();
    let MoveGuests { peer, src, dst } = guests;
    std::thread::sleep(Duration::from_secs(2));

    let out = migrate_command(daemon.socket(), &src, &dst)
        .output()
        .unwrap();
    eprintln!(
        "---- killed at {phase}:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "{phase}: the daemon was not killed mid-move"
    );
    assert_eq!(
        daemon.wait_exit(Duration::from_secs(10)),
        Some(false),
        "{phase}: the daemon did not abort"
    );
    drop(daemon);

    // The successor finishes or rolls back the move from the journal.
    let restarted = Instant::now();
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let report = wait_for_report(daemon.socket(), phase);
    let recovery_ms = restarted.elapsed().as_millis();
    eprintln!("{report:#}");
    drop(daemon);
    let mover = if location == "destination" {
        src.kill();
        dst.reattach_console().unwrap();
        &dst
    } else {
        &src
    };

    std::thread::sleep(Duration::from_secs(3));
    let (moved, peer_report) = finish_clean_flow(
        mover,
        &format!("moving VM, daemon killed at {phase}"),
        &peer,
        TAG,
    );

    assert_eq!(report["final_phase"], outcome, "{phase}: {report}");
    assert_eq!(report["recovered_from"], phase, "{phase}: {report}");
    assert_eq!(report["vm_location"], location, "{phase}: {report}");
    // The traffic kept flowing after the move: more than the 2 s before it.
    assert!(peer_report.received > 3 * 200, "{phase}: {peer_report:?}");
    format!(
        "killed at {phase:<8} -> {outcome:<12} on the {location:<12} recovered in {recovery_ms} ms; \
         peer got {} of {} messages, 0 lost; largest gap {:.0} ms",
        peer_report.received, moved.sent, peer_report.max_gap_ms
    )
}

/// Waits (at most 60 s) until the daemon on `socket` has a report, and returns it.
fn wait_for_report(socket: &std::path::Path, phase: &str) -> Value {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let out = Command::new(bin_dir().join("rdmamig"))
            .args(["history", "--json", "--socket"])
            .arg(socket)
            .output()
            .unwrap();
        let history: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if let Some(id) = history[0]["id"].as_str() {
            let out = Command::new(bin_dir().join("rdmamig"))
                .args(["report", id, "--json", "--socket"])
                .arg(socket)
                .output()
                .unwrap();
            return serde_json::from_slice(&out.stdout).unwrap();
        }
        assert!(
            Instant::now() < end,
            "{phase}: the restarted daemon did not end the move"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
