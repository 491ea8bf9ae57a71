//! Unmanaged programs, on the test bed: RDMA programs that do not use rdmamig's library run
//! in the moving VM beside a library user, and the move's `--unmanaged` policy decides.
//! - an `rping` client (rdma_cm) and an `ibv_rc_pingpong` client (raw verbs), each against
//!   a server on the peer;
//! - `refuse` (the default): the move is refused at prepare, both named; nothing changed, the
//!   programs still run and the NIC is still there;
//! - `release`: both are ended right before the unplug; the move is done and the report
//!   names them as ended;
//! - `ignore` (two new programs, moving back): the move is done, the report marks both as
//!   broken, and the CLI says so instead of a plain `done`.
//!
//! The library's connection runs through all three moves and loses, duplicates and reorders
//! nothing.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{finish_clean_flow, run_move, MoveGuests, STEP_TIMEOUT};
use rdmamig_testbed::{error_chain, Guest, Testbed};
use serde_json::Value;

const TAG: &str = "flow";

/// The two unmanaged programs of one round, by PID.
struct Programs {
    rping: u32,
    pingpong: u32,
}

#[test]
fn unmanaged_programs_are_refused_released_or_ignored_as_the_move_says() {
    let bed = Testbed::new("unmanaged").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let guests = MoveGuests::start(&bed, "um").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests.start_flow(TAG, "--rate 50").unwrap();
    let MoveGuests { peer, src, dst } = guests;

    // refuse (the default): nothing changes.
    let programs = start_programs(&peer, &src, 0);
    let (out, report) = run_move(daemon.socket(), bed.dir(), (&src, &dst), &[], "refuse");
    assert_eq!(out.status.code(), Some(4), "the move was not refused");
    assert_eq!(report["failed_phase"], "prepare", "{report:#}");
    let error = report["error"].as_str().unwrap();
    for pid in [programs.rping, programs.pingpong] {
        assert!(error.contains(&format!("PID {pid} (")), "{error}");
    }
    assert!(
        error.contains("rping -c") && error.contains("ibv_rc_pingpong"),
        "{error}"
    );
    assert_fates(&report, &programs, "untouched");
    let phases: Vec<&str> = report["timeline"]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["phase"].as_str())
        .collect();
    assert!(!phases.contains(&"quiesce"), "{phases:?}");
    for pid in [programs.rping, programs.pingpong] {
        src.run_ok(&format!("kill -0 {pid}"), STEP_TIMEOUT)
            .unwrap_or_else(|e| panic!("PID {pid} no longer runs after the refusal: {e}"));
    }
    let links = src.run_ok("rdma link show", STEP_TIMEOUT).unwrap();
    assert!(links.contains("ACTIVE"), "{links}");

    // release: ended right before the unplug, the move done.
    let (out, report) = run_move(
        daemon.socket(),
        bed.dir(),
        (&src, &dst),
        &["--unmanaged", "release"],
        "release",
    );
    assert_eq!(out.status.code(), Some(0), "the move did not complete");
    assert_fates(&report, &programs, "ended");
    let detach = &report["timeline"]["phases"][2];
    assert_eq!(detach["phase"], "detach", "{report:#}");
    let ended: Vec<u64> = detach["details"]["ended"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|h| h["pid"].as_u64())
        .collect();
    // Only they: the library's process, quiesced, lets go of its device by itself when
    // the unplug begins.
    let mut expected = vec![u64::from(programs.rping), u64::from(programs.pingpong)];
    expected.sort_unstable();
    assert_eq!(ended, expected, "{detach:#}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("but it ended or broke 2 unmanaged"),
        "{stdout}"
    );
    src.kill();
    dst.reattach_console().unwrap();
    let vm = dst;
    for pid in [programs.rping, programs.pingpong] {
        let alive = vm.run(&format!("kill -0 {pid}"), STEP_TIMEOUT).unwrap();
        assert_ne!(
            alive.status, 0,
            "PID {pid} still runs after it was released"
        );
    }

    // ignore: two new programs, the move back done, both marked broken.
    let programs = start_programs(&peer, &vm, 1);
    let back = bed
        .start_incoming(bed.incoming_spec(vm.spec(), "um-back").unwrap())
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let (out, report) = run_move(
        daemon.socket(),
        bed.dir(),
        (&vm, &back),
        &["--unmanaged", "ignore"],
        "ignore",
    );
    assert_eq!(out.status.code(), Some(0), "the move did not complete");
    assert_fates(&report, &programs, "broken");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("BROKEN by the move")
            && stdout.contains("but it ended or broke 2 unmanaged"),
        "{stdout}"
    );
    vm.kill();
    back.reattach_console().unwrap();

    std::thread::sleep(Duration::from_secs(2));
    finish_clean_flow(&back, "moved VM", &peer, TAG);
}

/// Starts an rping server and an `ibv_rc_pingpong` server on `peer` (ports of round
/// `round`), and their clients in `vm`; returns the clients once each has its RDMA device
/// open.
fn start_programs(peer: &Guest, vm: &Guest, round: u16) -> Programs {
    let address = peer.spec().address();
    let (rping_port, pingpong_port) = (7480 + round, 18520 + round);
    background(
        peer,
        &format!("rping -s -a 0.0.0.0 -p {rping_port} -S 64"),
        &format!("rping-server-{round}"),
    );
    background(
        peer,
        &format!("ibv_rc_pingpong -g 1 -e -s 64 -n 1000000000 -p {pingpong_port}"),
        &format!("pingpong-server-{round}"),
    );
    // Both servers listen (rping on its CM port, the pingpong on TCP) before the clients go.
    peer.run_ok(
        &format!(
            "i=0; until grep -qi ':{pingpong_port:04X} ' /proc/net/tcp /proc/net/tcp6 2>/dev/null; do \
               i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.05; done; sleep 0.5"
        ),
        STEP_TIMEOUT,
    )
    .unwrap();
    let rping = background(
        vm,
        &format!("rping -c -a {address} -p {rping_port} -S 64"),
        &format!("rping-client-{round}"),
    );
    let pingpong = background(
        vm,
        &format!("ibv_rc_pingpong -g 1 -e -s 64 -n 1000000000 -p {pingpong_port} {address}"),
        &format!("pingpong-client-{round}"),
    );
    for pid in [rping, pingpong] {
        vm.run_ok(
            &format!(
                "i=0; until ls -l /proc/{pid}/fd 2>/dev/null | grep -q /dev/infiniband; do \
                   kill -0 {pid} || exit 1; i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.05; done"
            ),
            STEP_TIMEOUT,
        )
        .unwrap_or_else(|e| {
            let logs = vm.run(
                "tail /tmp/rping-client-* /tmp/pingpong-client-*",
                STEP_TIMEOUT,
            );
            panic!("PID {pid} never opened its RDMA device: {e}\n{logs:?}")
        });
    }
    Programs { rping, pingpong }
}

/// Runs `command` in the background in `guest`, its output in `/tmp/<log>`; returns its PID.
fn background(guest: &Guest, command: &str, log: &str) -> u32 {
    let out = guest
        .run_ok(
            &format!("{command} >/tmp/{log} 2>&1 & echo pid $!"),
            STEP_TIMEOUT,
        )
        .unwrap();
    out.lines()
        .find_map(|l| l.trim().strip_prefix("pid "))
        .and_then(|pid| pid.trim().parse().ok())
        .unwrap_or_else(|| panic!("no PID for {command}: {out}"))
}

/// Both programs are in the report's `unmanaged`, with `fate`.
fn assert_fates(report: &Value, programs: &Programs, fate: &str) {
    let listed = report["unmanaged"].as_array().unwrap();
    for pid in [programs.rping, programs.pingpong] {
        let entry = listed
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap_or_else(|| panic!("PID {pid} is not in the report: {report:#}"));
        assert_eq!(entry["fate"], fate, "{report:#}");
    }
}
