//! The permanent NIC on the test bed: every guest has a second, paravirtual NIC (10.78.0.0/24)
//! that migrates with the VM and is never unplugged, the path the `bridge` strategy will keep
//! while the RDMA NIC is away.
//!
//! A TCP connection from the moving VM to the peer over the permanent NIC is opened before a
//! coordinated move (`reconnect`, with RDMA traffic running) and carries data after it; the
//! permanent NIC's carrier never changes through the RDMA NIC's unplug, the migration and the
//! new RDMA NIC's plug; it keeps its address and gets no Soft-RoCE device; and the moved VM
//! opens a new connection over it.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::scenario::{migrate_vm, Daemon};
use rdmamig_testbed::steps::{
    assert_clean, collect_report, dump_logs, stop_traffic, MoveGuests, STEP_TIMEOUT,
};
use rdmamig_testbed::{error_chain, Guest, Testbed};

const TAG: &str = "flow";
/// The peer's TCP port for the connection kept across the move.
const KEPT_PORT: u16 = 7600;
/// The peer's TCP port for the connection opened after the move.
const FRESH_PORT: u16 = 7601;

#[test]
fn the_permanent_nic_stays_up_through_a_coordinated_move() {
    let bed = Testbed::new("permanent").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let g = MoveGuests::start(&bed, "pn").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    if let Err(e) = run(&bed, &daemon, &g) {
        for guest in [&g.peer, &g.src, &g.dst] {
            dump_logs(guest);
        }
        panic!("{}", error_chain(&*e));
    }
}

fn run(bed: &Testbed, daemon: &Daemon, g: &MoveGuests) -> Result<(), Box<dyn std::error::Error>> {
    let peer = g.peer.spec().permanent_address().to_owned();
    let dev = permanent_dev(&g.src)?;
    let rdma_dev = g.src.run_ok("rdmamig-netplug status", STEP_TIMEOUT)?;
    assert!(
        !rdma_dev.contains(&dev),
        "the NIC hook manages the permanent NIC {dev}: {rdma_dev}"
    );

    // Connectivity before the move, on a connection that stays open through it. The
    // listener's stdin never ends (nc half-closes on EOF, which would end the connection).
    g.peer.run_ok(
        &format!("(sleep 600 | nc -l -p {KEPT_PORT} >/tmp/kept.rx) >/dev/null 2>&1 &"),
        STEP_TIMEOUT,
    )?;
    // The client connects once: it must find the listener there (CI, 2026-12-02: "before"
    // never arrived, the client having run first on a loaded machine).
    wait_listening(&g.peer, KEPT_PORT)?;
    g.src.run_ok(
        &format!(
            "((echo before; i=0; until [ -e /tmp/kept.go ]; do i=$((i+1)); [ $i -gt 1200 ] && \
             break; sleep 0.1; done; echo after) | nc {peer} {KEPT_PORT}; echo $? >/tmp/kept.rc) \
             >/dev/null 2>&1 &"
        ),
        STEP_TIMEOUT,
    )?;
    wait_for_text(&g.peer, "/tmp/kept.rx", "before")?;
    let changes_before = carrier_changes(&g.src, &dev)?;

    g.start_flow(TAG, "--mode migratable --rate 100")?;
    std::thread::sleep(Duration::from_secs(1));
    let (ok, output) = migrate_vm(
        bed,
        daemon,
        "reconnect",
        (&g.src, &g.dst),
        &bed.dir().join("permanent-move.json"),
        "permanent-move.log",
        &[],
    )?;
    assert!(ok, "the move failed:\n{output}");

    // The moved VM: the same netdev, address and link, never down, no Soft-RoCE on it.
    assert_eq!(permanent_dev(&g.dst)?, dev);
    let changes_after = carrier_changes(&g.dst, &dev)?;
    assert_eq!(
        changes_after, changes_before,
        "the permanent NIC {dev} lost its carrier during the move"
    );
    let addrs = g.dst.run_ok(
        &format!("/usr/sbin/ip -4 -o addr show dev {dev}"),
        STEP_TIMEOUT,
    )?;
    assert!(addrs.contains(&g.dst.spec().permanent_ip), "{addrs}");
    let rdma = g.dst.run_ok("rdma link show", STEP_TIMEOUT)?;
    let words: Vec<&str> = rdma.split_whitespace().collect();
    assert!(
        !words.windows(2).any(|w| w == ["netdev", dev.as_str()]),
        "Soft-RoCE on the permanent NIC: {rdma}"
    );
    assert!(rdma.contains("ACTIVE"), "no new RDMA NIC: {rdma}");

    // The connection opened before the move carries data after it, and ends cleanly.
    g.dst.run_ok("touch /tmp/kept.go", STEP_TIMEOUT)?;
    g.dst.run_ok(
        "i=0; until [ -e /tmp/kept.rc ]; do i=$((i+1)); [ $i -gt 400 ] && exit 1; \
         sleep 0.05; done; [ \"$(cat /tmp/kept.rc)\" = 0 ]",
        STEP_TIMEOUT,
    )?;
    let kept = g.peer.run_ok("cat /tmp/kept.rx", STEP_TIMEOUT)?;
    assert_eq!(kept, "before\nafter\n");

    // A new connection from the moved VM.
    g.peer.run_ok(
        &format!("(sleep 600 | nc -l -p {FRESH_PORT} >/tmp/fresh.rx) >/dev/null 2>&1 &"),
        STEP_TIMEOUT,
    )?;
    wait_listening(&g.peer, FRESH_PORT)?;
    g.dst.run_ok(
        &format!("echo fresh | nc -w 5 {peer} {FRESH_PORT}"),
        STEP_TIMEOUT,
    )?;
    wait_for_text(&g.peer, "/tmp/fresh.rx", "fresh")?;

    // The RDMA traffic beside it went through the move as usual.
    stop_traffic(&g.dst, TAG)?;
    stop_traffic(&g.peer, TAG)?;
    let mover = collect_report(&g.dst, TAG)?;
    let peer_report = collect_report(&g.peer, TAG)?;
    assert_clean("peer", &peer_report, &mover);
    assert_clean("moved VM", &mover, &peer_report);
    eprintln!(
        "permanent NIC {dev}: carrier changes {changes_before} before and after the move; \
         RDMA traffic {} / {} messages",
        mover.received, peer_report.received
    );
    Ok(())
}

/// Waits (up to 10 s) until `file` in `guest` contains `text`.
fn wait_for_text(guest: &Guest, file: &str, text: &str) -> Result<(), Box<dyn std::error::Error>> {
    guest.run_ok(
        &format!(
            "end=$(($(date +%s) + 20)); until grep -q {text} {file} 2>/dev/null; do \
             [ $(date +%s) -ge $end ] && {{ echo 'no {text} in {file} after 20 s'; exit 1; }}; \
             sleep 0.05; done"
        ),
        STEP_TIMEOUT,
    )?;
    Ok(())
}

/// Waits until a TCP socket listens on `port` in `guest` (its /proc/net/tcp or tcp6 line:
/// local port in hex, no remote, state 0A).
fn wait_listening(guest: &Guest, port: u16) -> Result<(), Box<dyn std::error::Error>> {
    guest.run_ok(
        &format!(
            "end=$(($(date +%s) + 20)); until grep -Eq ':{port:04X} 0+:0000 0A' /proc/net/tcp /proc/net/tcp6 2>/dev/null; do \
             [ $(date +%s) -ge $end ] && {{ echo 'nothing listens on port {port}'; exit 1; }}; \
             sleep 0.05; done"
        ),
        STEP_TIMEOUT,
    )?;
    Ok(())
}

/// The guest's netdev carrying its permanent NIC's MAC.
fn permanent_dev(guest: &Guest) -> Result<String, Box<dyn std::error::Error>> {
    let path = guest.run_ok(
        &format!(
            "grep -l {} /sys/class/net/*/address",
            guest.spec().permanent_mac
        ),
        STEP_TIMEOUT,
    )?;
    let path = path.trim();
    let dev = path.trim_end_matches("/address");
    let dev = dev.rsplit('/').next().unwrap_or_default();
    if dev.is_empty() || path.lines().count() != 1 {
        return Err(format!("{}: permanent NIC netdev from {path:?}", guest.name()).into());
    }
    Ok(dev.to_owned())
}

/// How often the kernel saw `dev`'s carrier change since boot.
fn carrier_changes(guest: &Guest, dev: &str) -> Result<u64, Box<dyn std::error::Error>> {
    let out = guest.run_ok(
        &format!("cat /sys/class/net/{dev}/carrier_changes"),
        STEP_TIMEOUT,
    )?;
    Ok(out.trim().parse()?)
}
