//! The guest agent killed mid-quiesce, on the test bed: a slow application
//! (`rdmamig-traffic stall-quiesce`) keeps the agent inside its quiesce; the moment it has
//! the quiesce request (its marker file appears) the test kills the agent with SIGKILL. The
//! migrator takes its forced path (the quiesce is not answered: detach without a
//! coordinated quiesce), the move goes on and completes; at the resume the agent is still
//! gone (forced again), and the RDMA connection recovers through the library's own path:
//! its hold expires, it reconnects to the peer and replays. Nothing is lost, duplicated or
//! reordered, and the report says what was forced and why.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::{Duration, Instant};

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{
    dump_logs, finish_clean_flow, migrate_command, MoveGuests, STEP_TIMEOUT,
};
use rdmamig_testbed::{error_chain, Testbed};
use serde_json::Value;

const TAG: &str = "flow";

/// How long the moving side's connection waits for a resume before it recovers on its own
/// (the library's forced path), s. The peer waits the default 60 s for it.
const HOLD_S: u64 = 8;

#[test]
fn an_agent_killed_mid_quiesce_is_forced_past_and_the_connection_recovers_on_its_own() {
    let bed = Testbed::new("agentkill").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let guests = MoveGuests::start(&bed, "ak").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests
        .start_flow_sides(
            TAG,
            "--rate 100",
            &format!("--rate 100 --peer-wait-s {HOLD_S}"),
        )
        .unwrap();
    let MoveGuests { peer, src, dst } = guests;
    src.run_ok(
        "rdmamig-traffic stall-quiesce --ready-file /tmp/stall.ready --marker /tmp/stall.quiescing \
         >/tmp/stall.out 2>&1 & \
         i=0; while [ ! -e /tmp/stall.ready ]; do i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.05; done",
        STEP_TIMEOUT,
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(2));

    let report_path = bed.dir().join("move.json");
    let started = Instant::now();
    let mover = migrate_command(daemon.socket(), &src, &dst)
        .args(["--deadline", "quiesce=4000", "--deadline", "resume=3000"])
        .arg("--report")
        .arg(&report_path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The agent has forwarded the quiesce and waits for the slow application: kill it now.
    let killed = src.run_ok(
        "i=0; while [ ! -e /tmp/stall.quiescing ]; do i=$((i+1)); [ $i -gt 300 ] && exit 1; \
         sleep 0.05; done; kill -KILL $(pidof rdmamig-agent) && echo agent killed",
        STEP_TIMEOUT,
    );
    let killed_after = started.elapsed();
    let out = mover.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        killed.as_ref().is_ok_and(|o| o.contains("agent killed")),
        "the quiesce never reached the slow application: {killed:?}"
    );
    eprintln!("agent killed {} ms into the move", killed_after.as_millis());
    assert_eq!(out.status.code(), Some(0), "the move did not complete");

    src.kill();
    dst.reattach_console().unwrap();
    // The connection recovers by itself: a second "link established" in its log.
    let recovered = dst.run_ok(
        &format!(
            "i=0; while [ $(grep -c 'link established' /tmp/{TAG}.err) -lt 2 ]; do \
               i=$((i+1)); [ $i -gt 600 ] && exit 1; sleep 0.05; done; echo recovered"
        ),
        STEP_TIMEOUT,
    );
    if recovered.is_err() {
        dump_logs(&dst);
        dump_logs(&peer);
        panic!("the connection did not recover on its own: {recovered:?}");
    }
    std::thread::sleep(Duration::from_secs(2));
    let (_, peer_report) = finish_clean_flow(&dst, "moved VM", &peer, TAG);

    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    assert_eq!(report["final_phase"], "done", "{report:#}");
    assert_eq!(report["vm_location"], "destination");
    let forced: Vec<&str> = report["forced"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["phase"].as_str().unwrap())
        .collect();
    assert_eq!(forced, ["quiesce", "resume"], "{report:#}");
    let quiesce = report["forced"][0]["reason"].as_str().unwrap();
    assert!(quiesce.contains("the agent did not quiesce"), "{quiesce}");
    let phases = report["timeline"]["phases"].as_array().unwrap();
    assert_eq!(phases[1]["phase"], "quiesce");
    assert_eq!(phases[1]["outcome"]["result"], "forced", "{:#}", phases[1]);
    assert!(stdout.contains("forced"), "{stdout}");
    // The traffic kept flowing after the move: more than the 2 s before it.
    assert!(peer_report.received > 3 * 100, "{peer_report:?}");
}
