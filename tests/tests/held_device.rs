//! An application holding its device context, on the test bed: a raw verbs user the agent
//! does not know (`ibv_rc_pingpong`, see `steps::start_holder`) keeps the moving VM's RDMA
//! device while rdmamig connections carry traffic. The move was asked with `--force-release`
//! (the old name of `--unmanaged release`), so the agent ends the holder right before the
//! unplug (SIGTERM, SIGKILL after 1 s if needed), the report names it as ended, the unplug
//! completes and the move goes on to the destination. The rdmamig connections lose,
//! duplicate and reorder nothing.
//!
//! With `--unmanaged ignore` the holder stays, and the unplug misses its deadline: the move
//! rolls back. The unplug the guest was asked for cannot be taken back: it completes whenever
//! the holder lets go. The rollback waits for
//! that, plugs the NIC back, and resumes the connections on the source
//! (`a_held_device_rolls_back_and_the_vm_keeps_its_nic_once_the_holder_lets_go`). A holder
//! that never lets go ends the rollback `failed`, saying so (`daemon_cli`'s
//! `a_device_the_guest_keeps_fails_detach_at_its_deadline`).
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{
    finish_clean_flow, migrate_command, start_holder, MoveGuests, STEP_TIMEOUT,
};
use rdmamig_testbed::{error_chain, Testbed};
use serde_json::Value;

const TAG: &str = "flow";

#[test]
fn a_held_device_is_released_before_the_unplug_and_the_move_completes_losing_nothing() {
    let bed = Testbed::new("helddev").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let guests = MoveGuests::start(&bed, "hd").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests.start_flow(TAG, "--rate 100").unwrap();
    let MoveGuests { peer, src, dst } = guests;
    let holder = start_holder(&src).unwrap();
    std::thread::sleep(Duration::from_secs(2));

    let report_path = bed.dir().join("move.json");
    let out = migrate_command(daemon.socket(), &src, &dst)
        .args(["--force-release", "--deadline", "detach=2000", "--report"])
        .arg(&report_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "the move did not complete");

    src.kill();
    dst.reattach_console().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let (_, peer_report) = finish_clean_flow(&dst, "moved VM", &peer, TAG);

    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["final_phase"], "done", "{report:#}");
    assert_eq!(report["vm_location"], "destination");
    assert_eq!(report["plan"]["unmanaged"], "release", "{report:#}");
    let program = &report["unmanaged"][0];
    assert_eq!(program["pid"], holder, "{report:#}");
    assert_eq!(program["fate"], "ended", "{report:#}");
    assert_eq!(program["open_context"], true, "{report:#}");
    let detach = &report["timeline"]["phases"][2];
    assert_eq!(detach["phase"], "detach");
    // Ended before the unplug, which then completed in time: no forced path.
    assert_eq!(detach["outcome"]["result"], "ok", "{detach:#}");
    let ended = &detach["details"]["ended"];
    assert_eq!(ended[0]["pid"], holder, "{detach:#}");
    assert_eq!(ended[0]["released"], true, "{detach:#}");
    assert!(stdout.contains("ENDED by the move"), "{stdout}");
    assert!(
        stdout.contains("but it ended or broke 1 unmanaged"),
        "{stdout}"
    );
    // The traffic kept flowing after the move: more than the 2 s before it.
    assert!(peer_report.received > 3 * 100, "{peer_report:?}");
}

#[test]
fn a_held_device_rolls_back_and_the_vm_keeps_its_nic_once_the_holder_lets_go() {
    let bed = Testbed::new("heldroll").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let guests = MoveGuests::start(&bed, "hr").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests.start_flow(TAG, "--rate 100").unwrap();
    let MoveGuests { peer, src, dst } = guests;
    let holder = start_holder(&src).unwrap();
    std::thread::sleep(Duration::from_secs(2));

    let report_path = bed.dir().join("move.json");
    let mut child = migrate_command(daemon.socket(), &src, &dst)
        .args([
            "--unmanaged",
            "ignore",
            "--deadline",
            "detach=2000",
            "--report",
        ])
        .arg(&report_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The detach misses its deadline and the rollback starts, with the unplug still
    // pending in the guest. Only then does the holder let go (its program ends), and the
    // guest finishes the removal it was asked for.
    let mut progress = Vec::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        eprintln!("{line}");
        let rollback_started = line.contains("rollback") && line.contains("started");
        progress.push(line);
        if rollback_started {
            break;
        }
    }
    assert!(
        progress.iter().any(|l| l.contains("rollback")),
        "the move never rolled back: {progress:?}"
    );
    std::thread::sleep(Duration::from_secs(1));
    src.run_ok(&format!("kill {holder}"), STEP_TIMEOUT).unwrap();
    for line in lines {
        let line = line.unwrap();
        eprintln!("{line}");
        progress.push(line);
    }
    let out = child.wait_with_output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(4), "the move did not roll back");

    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["final_phase"], "rolled_back", "{report:#}");
    assert_eq!(report["failed_phase"], "detach", "{report:#}");
    assert_eq!(report["vm_location"], "source");
    let rollback = report["timeline"]["phases"]
        .as_array()
        .unwrap()
        .last()
        .unwrap();
    assert_eq!(rollback["phase"], "rollback");
    assert_eq!(rollback["outcome"]["result"], "ok", "{rollback:#}");
    let steps: Vec<&str> = rollback["details"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        steps[0].starts_with("waited ") && steps[0].contains("removing device nic0"),
        "{steps:?}"
    );
    assert!(steps[1].contains("re-attached on the source"), "{steps:?}");
    assert!(
        steps[2].contains("connections resumed on the source"),
        "{steps:?}"
    );

    // The VM has its NIC again, with Soft-RoCE on it, and the library's connections went
    // on over it: nothing lost, duplicated or reordered.
    let links = src.run_ok("rdma link show", STEP_TIMEOUT).unwrap();
    assert!(links.contains("ACTIVE"), "{links}");
    std::thread::sleep(Duration::from_secs(3));
    let (vm_report, _) = finish_clean_flow(&src, "source VM", &peer, TAG);
    assert!(vm_report.received > 3 * 100, "{vm_report:?}");
    drop(dst);
}
