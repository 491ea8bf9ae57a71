//! Rollback on the test bed: a coordinated move whose migration stalls past its deadline is
//! cancelled midway and rolled back (the NIC is plugged back on the source, the agent
//! resumes the connections there), and the RDMA traffic running both ways through it loses,
//! duplicates and reorders nothing, with no error on either side.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{finish_clean_flow, migrate_command, MoveGuests};
use rdmamig_testbed::{error_chain, Testbed};
use serde_json::Value;

const TAG: &str = "flow";

#[test]
fn a_migration_cancelled_midway_rolls_back_and_loses_nothing() {
    let bed = Testbed::new("rollback").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let guests = MoveGuests::start(&bed, "rb").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests
        .start_flow(TAG, "--mode migratable --rate 200")
        .unwrap();
    let MoveGuests { peer, src, dst } = guests;
    std::thread::sleep(Duration::from_secs(2));

    // A 512 MiB guest takes ~0.7 s to migrate here: 100 ms is a migration that stalls.
    let report_path = bed.dir().join("move.json");
    let out = migrate_command(daemon.socket(), &src, &dst)
        .args(["--deadline", "migrate=100", "--report"])
        .arg(&report_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(4), "the move was not rolled back");
    assert!(stdout.contains("ROLLED BACK"), "{stdout}");

    std::thread::sleep(Duration::from_secs(3));
    let (_, peer_report) = finish_clean_flow(&src, "source", &peer, TAG);

    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["final_phase"], "rolled_back");
    assert_eq!(report["failed_phase"], "migrate");
    assert_eq!(report["vm_location"], "source");
    assert_eq!(report["forced"][0]["phase"], "migrate");
    let phases = report["timeline"]["phases"].as_array().unwrap();
    let rollback = phases.last().unwrap();
    assert_eq!(rollback["phase"], "rollback");
    let steps = rollback["details"]["steps"].to_string();
    for step in [
        "migration cancelled",
        "re-attached on the source",
        "resumed on the source",
    ] {
        assert!(steps.contains(step), "{step}: {steps}");
    }
    // The traffic kept flowing after the rollback: more than the 2 s before the move.
    assert!(peer_report.received > 3 * 200, "{peer_report:?}");
}
