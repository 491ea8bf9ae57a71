//! A destination without a free function, on the test bed: a coordinated move that takes
//! its NIC from the destination's pool (`--from-pool`) while the pool has none free fails at
//! prepare and is rolled back before anything in the VM was touched; the RDMA traffic
//! running both ways loses, duplicates and reorders nothing, with no error on either side.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{finish_clean_flow, migrate_command, MoveGuests};
use rdmamig_testbed::{error_chain, Testbed};
use serde_json::Value;

const TAG: &str = "flow";

#[test]
fn a_destination_without_a_free_function_refuses_the_move_before_touching_the_vm() {
    let bed = Testbed::new("nofunction").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let guests = MoveGuests::start(&bed, "nf").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests
        .start_flow(TAG, "--mode migratable --rate 200")
        .unwrap();
    let MoveGuests { peer, src, dst } = guests;
    std::thread::sleep(Duration::from_secs(2));

    // The daemon runs without a config: its pool is empty.
    let report_path = bed.dir().join("move.json");
    let out = migrate_command(daemon.socket(), &src, &dst)
        .args(["--from-pool", "--report"])
        .arg(&report_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(4), "the move was not rolled back");
    assert!(stdout.contains("ROLLED BACK"), "{stdout}");

    std::thread::sleep(Duration::from_secs(3));
    let (mover, peer_report) = finish_clean_flow(&src, "source", &peer, TAG);

    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["final_phase"], "rolled_back");
    assert_eq!(report["failed_phase"], "prepare");
    assert_eq!(report["vm_location"], "source");
    assert!(
        report["error"]
            .as_str()
            .unwrap()
            .contains("no free function in the pool"),
        "{report}"
    );
    let phases: Vec<&str> = report["timeline"]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["prepare", "rollback"]);
    // Nothing was quiesced or unplugged: the flow never paused.
    assert_eq!(mover.connections_established, 1, "{mover:?}");
    assert!(peer_report.max_gap_ms < 1000.0, "{peer_report:?}");
}
