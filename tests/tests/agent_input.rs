//! Bad input on the guest agent's application socket, in a running guest: a frame whose
//! payload is not a message, a header announcing an oversized frame, and bytes that are not
//! a frame at all (`rdmamig-traffic probe-agent`) must each be answered with a refusal (the
//! first keeps its socket open, the other two are closed after the answer), and the agent
//! must keep serving: the coordinated move that follows quiesces and resumes the
//! legitimate connection, which loses, duplicates and reorders nothing.
//!
//! The host's channel too: an unprivileged process in the guest dials the agent's vsock
//! port over loopback (CID 1) and asks it to release the RDMA device. The agent closes the
//! connection without an answer and logs the refusal; the library user it would have
//! stopped keeps running.
//!
//! The move's untrusted channels are recorded on the way ([`Tap`]): every QMP line, every
//! frame between the migrator and the agent, and the `rdmamig migrate` request and the
//! daemon's answers must decode as the types the fuzz targets feed. With
//! `RDMAMIG_RECORD_CORPUS=<dir>` they, and the move's journal, are kept there as fuzz seeds
//! ([`corpus`]).
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_images::init::AGENT_VSOCK_PORT;
use rdmamig_migrator::report::MoveReport;
use rdmamig_testbed::corpus;
use rdmamig_testbed::scenario::{migrate_vm, Daemon};
use rdmamig_testbed::steps::{
    assert_clean, collect_report, dump_logs, stop_traffic, MoveGuests, STEP_TIMEOUT,
};
use rdmamig_testbed::tap::{Split, Tap};
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
        &format!(
            "rdmamig-traffic probe-agent --impersonate {user} --vsock-port {AGENT_VSOCK_PORT} \
             --vsock-uid 65534"
        ),
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
    let vsock = answers
        .as_array()
        .and_then(|list| list.iter().find(|a| a["probe"] == "vsock_loopback"))
        .ok_or_else(|| format!("no result for vsock_loopback: {answers}"))?;
    assert_eq!(
        vsock["answer"]["Err"], "no answer",
        "the agent answered a guest process on its host channel: {vsock}"
    );
    assert_eq!(vsock["closed"], true, "not closed: {vsock}");
    let log = g.src.run_ok("cat /run/agent.log", STEP_TIMEOUT)?;
    assert!(
        log.contains("refused a vsock connection that is not the host's") && log.contains("cid=1"),
        "the agent did not log the refusal:\n{log}"
    );
    assert!(
        !log.contains("forced release"),
        "the agent acted on the guest's release request:\n{log}"
    );
    g.src
        .run_ok(&format!("kill -0 {user}"), STEP_TIMEOUT)
        .map_err(|e| format!("the library user {user} is gone after the probe: {e}"))?;

    let report_path = bed.dir().join("move.json");
    let qmp_taps = [
        Tap::insert(&g.src.qmp_socket(), Split::Lines)?,
        Tap::insert(&g.dst.qmp_socket(), Split::Lines)?,
    ];
    let agent_taps = [
        Tap::insert(&g.src.agent_socket(), Split::Frames)?,
        Tap::insert(&g.dst.agent_socket(), Split::Frames)?,
    ];
    let api = Tap::insert(daemon.socket(), Split::Frames)?;
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
    let [qmp, agent] = [&qmp_taps, &agent_taps]
        .map(|taps| taps.iter().flat_map(Tap::messages).collect::<Vec<_>>());
    check_recorded(&qmp, &agent, &api.messages());
    keep_seeds(bed, &qmp, &agent, &api.messages())?;
    drop(api);
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

/// Every recorded message decodes as the types the fuzz targets feed, and the move's
/// exchanges are there.
fn check_recorded(qmp: &[Vec<u8>], agent: &[Vec<u8>], api: &[Vec<u8>]) {
    use rdmamig_migrator::api::{ClientRequest, DaemonMessage};
    use rdmamig_proto::agent::{AgentCommand, AgentRequest, AgentResponse};
    use rdmamig_proto::FrameBuffer;
    use rdmamig_vmm::qmp::{classify, Incoming};

    let text = |m: &[u8]| String::from_utf8_lossy(m).into_owned();
    let mut answers = 0;
    for line in qmp {
        let incoming = classify(line).unwrap_or_else(|e| panic!("{e}: {}", text(line)));
        answers += usize::from(matches!(incoming, Incoming::Answer { .. }));
    }
    assert!(answers > 0, "no QMP answer recorded: {qmp:?}");

    let frame = |m: &[u8]| {
        let mut frames = FrameBuffer::new();
        frames.push(m);
        frames.pop().unwrap_or_else(|e| panic!("{e}: {}", text(m)))
    };
    let mut quiesce = false;
    for message in agent {
        let f = frame(message);
        match f.decode::<AgentRequest>() {
            Ok(request) => quiesce |= matches!(request.command, AgentCommand::Quiesce { .. }),
            Err(_) => drop(f.decode::<AgentResponse>().unwrap_or_else(|e| {
                panic!("neither a request nor an answer: {e}: {}", text(message))
            })),
        }
    }
    assert!(quiesce, "no quiesce recorded on the agent channel");

    let requests = api
        .iter()
        .filter(|m| frame(m).decode::<ClientRequest>().is_ok())
        .count();
    let answers = api
        .iter()
        .filter(|m| frame(m).decode::<DaemonMessage>().is_ok())
        .count();
    assert!(
        requests >= 1 && answers >= 1,
        "{requests} requests, {answers} answers"
    );
}

/// Keeps the recorded messages, and the move's journal, as fuzz seeds (with
/// `RDMAMIG_RECORD_CORPUS`).
fn keep_seeds(
    bed: &Testbed,
    qmp: &[Vec<u8>],
    agent: &[Vec<u8>],
    api: &[Vec<u8>],
) -> std::io::Result<()> {
    if std::env::var_os(corpus::RECORD_CORPUS).is_none() {
        return Ok(());
    }
    corpus::keep("vmm_streams", "qmp", qmp)?;
    corpus::keep("frame", "agent", agent)?;
    // migrator_api decodes a message's JSON: the frames' payloads.
    let payloads: Vec<Vec<u8>> = api
        .iter()
        .map(|m| m[rdmamig_proto::frame::HEADER_LEN.min(m.len())..].to_vec())
        .collect();
    corpus::keep("migrator_api", "api", &payloads)?;
    let mut journals = Vec::new();
    for entry in walk(&bed.dir().join("rdmamig-state"))? {
        if entry.extension().is_some_and(|e| e == "journal") {
            journals.push(std::fs::read(&entry)?);
        }
    }
    corpus::keep("journal", "journal", &journals)
}

/// Every file under `dir`.
fn walk(dir: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(walk(&path)?);
        } else {
            files.push(path);
        }
    }
    Ok(files)
}
