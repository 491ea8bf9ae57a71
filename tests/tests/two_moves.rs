//! Two VMs moved at once on the test bed, each with live RDMA traffic to a shared peer VM:
//! the daemon runs both moves concurrently (their timelines overlap), both complete, and
//! neither flow loses, duplicates or reorders anything, with no error on either side.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them. Five
//! TCG guests at once on two cores: the slowest test-bed test (~60 s).

use std::process::Output;
use std::time::Duration;

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{finish_clean_flow, migrate_command, start_traffic, wait_ready};
use rdmamig_testbed::{error_chain, Guest, Testbed};
use serde_json::Value;

fn migrate(daemon: &Daemon, src: &Guest, dst: &Guest) -> Output {
    migrate_command(daemon.socket(), src, dst)
        .arg("--json")
        .output()
        .unwrap()
}

#[test]
fn two_vms_move_concurrently_and_lose_nothing() {
    let bed = Testbed::new("two").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let peer_spec = bed.guest_spec("two-peer").unwrap();
    let specs = [
        bed.guest_spec("two-a").unwrap(),
        bed.guest_spec("two-b").unwrap(),
    ];
    let (peer, a, b) = std::thread::scope(|s| {
        let peer = s.spawn(|| bed.start_guest(peer_spec.clone()));
        let a = s.spawn(|| bed.start_guest(specs[0].clone()));
        let b = s.spawn(|| bed.start_guest(specs[1].clone()));
        (
            peer.join().unwrap().unwrap(),
            a.join().unwrap().unwrap(),
            b.join().unwrap().unwrap(),
        )
    });
    let sources = [a, b];
    let destinations: Vec<Guest> = specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let dst = bed.incoming_spec(spec, &format!("two-{i}-dst")).unwrap();
            bed.start_incoming(dst).unwrap()
        })
        .collect();
    for (i, src) in sources.iter().enumerate() {
        let tag = format!("flow{i}");
        let server = format!("{}:{}", peer_spec.address(), 7471 + i);
        let common = "--mode migratable --rate 100";
        start_traffic(&peer, &tag, &format!("serve --listen {server} {common}")).unwrap();
        start_traffic(src, &tag, &format!("connect --to {server} {common}")).unwrap();
        wait_ready(&peer, &tag, 1).unwrap();
        wait_ready(src, &tag, 1).unwrap();
    }
    std::thread::sleep(Duration::from_secs(2));

    let outputs: Vec<Output> = std::thread::scope(|s| {
        let moves: Vec<_> = (0..2)
            .map(|i| {
                let (daemon, src, dst) = (&daemon, &sources[i], &destinations[i]);
                s.spawn(move || migrate(daemon, src, dst))
            })
            .collect();
        moves.into_iter().map(|m| m.join().unwrap()).collect()
    });
    let mut windows = Vec::new();
    for out in &outputs {
        let stdout = String::from_utf8_lossy(&out.stdout);
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{stdout}");
        let report: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(report["final_phase"], "done");
        let t = &report["timeline"];
        windows.push((
            t["started_unix_ms"].as_u64().unwrap(),
            t["ended_unix_ms"].as_u64().unwrap(),
        ));
        eprintln!("move of {}: {} ms", report["plan"]["vm"], t["total_ms"]);
    }
    // The moves overlapped: each started before the other ended.
    assert!(
        windows[0].0 < windows[1].1 && windows[1].0 < windows[0].1,
        "{windows:?}"
    );
    for (src, dst) in sources.iter().zip(&destinations) {
        src.kill();
        dst.reattach_console().unwrap();
    }
    std::thread::sleep(Duration::from_secs(3));
    for (i, dst) in destinations.iter().enumerate() {
        let tag = format!("flow{i}");
        let (_, peer_report) = finish_clean_flow(dst, "moved VM", &peer, &tag);
        assert!(peer_report.received > 3 * 100, "{peer_report:?}");
    }
}
