//! A migrator killed mid-move on the test bed: the daemon aborts right after it journaled
//! the attach (the migration has completed, the VM runs on the destination without its NIC,
//! its connections quiesced); a restarted daemon reads the journal, finishes the move
//! (attach, resume on the destination), and the RDMA traffic running both ways through it
//! loses, duplicates and reorders nothing, with no error on either side.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmamig_testbed::steps::{
    assert_clean, collect_report, dump_logs, migrate_command, stop_traffic, MoveGuests,
};
use rdmamig_testbed::{bin_dir, error_chain, Testbed};
use serde_json::Value;

const TAG: &str = "flow";

/// `rdmamig daemon` with its socket and state in `dir`, killed (by PID) on drop.
struct Daemon(Child);

impl Daemon {
    fn start(dir: &Path, crash_at: Option<&str>) -> Daemon {
        let socket = dir.join("rdmamig.sock");
        let _ = std::fs::remove_file(&socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("rdmamig-daemon.log"))
            .unwrap();
        let mut command = Command::new(bin_dir().join("rdmamig"));
        command
            .args(["daemon", "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("rdmamig-state"))
            .env_remove("RDMAMIG_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if let Some(phase) = crash_at {
            command.env("RDMAMIG_CRASH_AT", phase);
        }
        let daemon = Daemon(command.spawn().unwrap());
        let end = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(Instant::now() < end, "the daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_migrator_killed_after_the_migration_is_finished_by_its_successor_and_loses_nothing() {
    let bed = Testbed::new("restart").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let mut daemon = Daemon::start(bed.dir(), Some("attach"));
    let socket = bed.dir().join("rdmamig.sock");
    let guests = MoveGuests::start(&bed, "rs").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    guests
        .start_flow(TAG, "--mode migratable --rate 200")
        .unwrap();
    let MoveGuests { peer, src, dst } = guests;
    std::thread::sleep(Duration::from_secs(2));

    let out = migrate_command(&socket, &src, &dst).output().unwrap();
    eprintln!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "the daemon was not killed mid-move"
    );
    assert!(!daemon.0.wait().unwrap().success());

    // The successor finishes the move from the journal.
    daemon = Daemon::start(bed.dir(), None);
    let end = Instant::now() + Duration::from_secs(60);
    let report = loop {
        let out = Command::new(bin_dir().join("rdmamig"))
            .args(["history", "--json", "--socket"])
            .arg(&socket)
            .output()
            .unwrap();
        let history: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if let Some(id) = history[0]["id"].as_str() {
            let out = Command::new(bin_dir().join("rdmamig"))
                .args(["report", id, "--json", "--socket"])
                .arg(&socket)
                .output()
                .unwrap();
            break serde_json::from_slice::<Value>(&out.stdout).unwrap();
        }
        assert!(
            Instant::now() < end,
            "the restarted daemon did not finish the move"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("{report:#}");
    drop(daemon);
    src.kill();
    dst.reattach_console().unwrap();

    std::thread::sleep(Duration::from_secs(3));
    stop_traffic(&dst, TAG).unwrap();
    stop_traffic(&peer, TAG).unwrap();
    let (mover, peer_report) = match (collect_report(&dst, TAG), collect_report(&peer, TAG)) {
        (Ok(m), Ok(p)) => (m, p),
        (m, p) => {
            dump_logs(&dst);
            dump_logs(&peer);
            panic!("traffic reports: {:?} / {:?}", m.err(), p.err());
        }
    };
    eprintln!("moved VM: {mover:?}\npeer: {peer_report:?}");
    assert_clean("peer", &peer_report, &mover);
    assert_clean("moved VM", &mover, &peer_report);

    assert_eq!(report["final_phase"], "done", "{report}");
    assert_eq!(report["recovered_from"], "attach");
    assert_eq!(report["vm_location"], "destination");
    let phases: Vec<&str> = report["timeline"]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["attach", "resume"]);
    // The traffic kept flowing after the move: more than the 2 s before it.
    assert!(peer_report.received > 3 * 200, "{peer_report:?}");
}
