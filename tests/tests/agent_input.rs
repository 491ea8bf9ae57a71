//! Bad input on the guest agent's application socket, in a running guest: a frame whose
//! payload is not a message, a header announcing an oversized frame, and bytes that are not
//! a frame at all (`rdmamig-traffic probe-agent`) must each be answered with a refusal (the
//! first keeps its socket open, the other two are closed after the answer), and the agent
//! must keep serving: the coordinated move that follows quiesces and resumes the
//! legitimate connection, which loses, duplicates and reorders nothing.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_migrator::report::MoveReport;
use rdmamig_testbed::scenario::{migrate_vm, Daemon};
use rdmamig_testbed::steps::{
    assert_clean, collect_report, dump_logs, stop_traffic, MoveGuests, STEP_TIMEOUT,
};
use rdmamig_testbed::{error_chain, Testbed};
use serde_json::Value;

const TAG: &str = "bad";

#[test]
fn bad_frames_on_the_agent_socket_are_refused_and_the_next_move_loses_nothing() {
    let bed = Testbed::new("agentinput").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let g = MoveGuests::start(&bed, TAG).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&bed, &daemon, &g)));
    if !matches!(outcome, Ok(Ok(()))) {
        for guest in [&g.peer, &g.src, &g.dst] {
            dump_logs(guest);
        }
    }
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn run(bed: &Testbed, daemon: &Daemon, g: &MoveGuests) -> Result<(), Box<dyn std::error::Error>> {
    g.start_flow(TAG, "--rate 200")?;
    std::thread::sleep(Duration::from_secs(1));

    // The flow's own process is a library user: the probe says Hello in its name.
    let user = g.src.run_ok(&format!("cat /tmp/{TAG}.pid"), STEP_TIMEOUT)?;
    let user = user.trim().to_string();
    assert!(
        user.parse::<u32>().is_ok(),
        "no library user found: {user:?}"
    );
    let out = g.src.run_ok(
        &format!("rdmamig-traffic probe-agent --impersonate {user}"),
        STEP_TIMEOUT,
    )?;
    eprintln!("probe-agent: {out}");
    let answers: Value = serde_json::from_str(out.trim())?;
    let impostor = format!("the Hello names PID {user}, but the connecting process is PID");
    for (probe, names, closed) in [
        ("bad_message", "malformed message", false),
        ("oversized", "exceeds the limit", true),
        ("garbage", "bad frame magic", true),
        ("impostor", impostor.as_str(), true),
    ] {
        let a = answers
            .as_array()
            .and_then(|list| list.iter().find(|a| a["probe"] == probe))
            .ok_or_else(|| format!("no result for {probe}: {answers}"))?;
        let answer = &a["answer"]["Ok"];
        assert_eq!(answer["msg"], "refused", "{probe} was not refused: {a}");
        let reason = answer["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(names),
            "{probe}: the refusal should say {names:?}: {reason}"
        );
        assert_eq!(
            a["closed"], closed,
            "{probe}: socket closed after the answer? {a}"
        );
    }

    let report_path = bed.dir().join("move.json");
    let (ok, output) = migrate_vm(
        bed,
        daemon,
        "reconnect",
        (&g.src, &g.dst),
        &report_path,
        "move.log",
        &[],
    )?;
    assert!(ok, "the move after the bad input failed:\n{output}");
    let report: MoveReport = serde_json::from_slice(&std::fs::read(&report_path)?)?;
    for (phase, outcomes) in [("quiesce", &report.quiesce), ("resume", &report.resume)] {
        assert!(
            !outcomes.is_empty() && outcomes.iter().all(|c| c.ok),
            "{phase} outcomes: {outcomes:?}"
        );
    }
    std::thread::sleep(Duration::from_secs(2));
    stop_traffic(&g.peer, TAG)?;
    stop_traffic(&g.dst, TAG)?;
    let rp = collect_report(&g.peer, TAG)?;
    let rv = collect_report(&g.dst, TAG)?;
    eprintln!("report peer: {rp:?}\nreport moved VM: {rv:?}");
    assert_clean("peer", &rp, &rv);
    assert_clean("moved VM", &rv, &rp);
    assert!(
        rp.connections_established >= 2,
        "the move reconnected: {rp:?}"
    );
    Ok(())
}
