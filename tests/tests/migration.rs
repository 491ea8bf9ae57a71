//! Live migration on the test bed, driven by hand through QMP: the harness's destination
//! guest receives the migration, its console carries on the source's shell, and a NIC plugged
//! after the move gets an ACTIVE Soft-RoCE device. This is the naive move (no quiesce, no
//! agent), checking only that the test bed supports what the migrator does.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::{Duration, Instant};

use rdmamig_testbed::{error_chain, GuestBinaries, Testbed};
use serde_json::json;

const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
const QMP_EVENT_TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn destination_carries_on_after_migration() {
    let tb = Testbed::builder("migration")
        .guest_binaries(GuestBinaries::IfPresent)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    // Panicking while `tb` lives makes its drop print every guest's console.
    if let Err(e) = scenario(&tb) {
        panic!("{}", error_chain(&*e));
    }
}

fn scenario(tb: &Testbed) -> Result<(), Box<dyn std::error::Error>> {
    let spec = tb.guest_spec("src")?;
    let src = tb.start_guest(spec.clone())?;
    let dst = tb.start_incoming(tb.incoming_spec(&spec, "dst")?)?;
    // State in guest RAM (/tmp is a tmpfs) that must arrive with the move.
    src.run_ok("echo carried-over >/tmp/state", COMMAND_TIMEOUT)?;

    let mut src_qmp = src.qmp()?;
    src_qmp.execute("device_del", json!({ "id": "nic0" }))?;
    src_qmp.wait_event(
        "DEVICE_DELETED",
        |d| d["device"] == "nic0",
        QMP_EVENT_TIMEOUT,
    )?;

    let mut dst_qmp = dst.qmp()?;
    let uri = format!("unix:{}", dst.migration_socket_path().display());
    dst_qmp.execute("migrate-incoming", json!({ "uri": uri }))?;
    src_qmp.execute(
        "migrate-set-capabilities",
        json!({ "capabilities": [{ "capability": "events", "state": true }] }),
    )?;
    let started = Instant::now();
    src_qmp.execute("migrate", json!({ "uri": uri }))?;
    let end = src_qmp.wait_event(
        "MIGRATION",
        |d| d["status"] == "completed" || d["status"] == "failed",
        QMP_EVENT_TIMEOUT,
    )?;
    assert_eq!(end["data"]["status"], "completed", "{end}");
    dst_qmp.wait_event("RESUME", |_| true, QMP_EVENT_TIMEOUT)?;
    let wall = started.elapsed();
    let stats = src_qmp.execute("query-migrate", serde_json::Value::Null)?;
    eprintln!(
        "migration: {wall:.2?} wall to RESUME on the destination; total-time {} ms, downtime {} ms",
        stats["total-time"], stats["downtime"]
    );
    drop(src_qmp);
    src.kill();

    // The destination's console is the source's shell loop, carried over.
    dst.reattach_console()?;
    let state = dst.run_ok("cat /tmp/state", COMMAND_TIMEOUT)?;
    assert_eq!(state, "carried-over\n");

    let plug_started = Instant::now();
    dst_qmp.execute(
        "device_add",
        json!({
            "driver": "virtio-net-pci",
            "netdev": "nd0",
            "id": "nic1",
            "bus": "rp1",
            "mac": spec.mac,
        }),
    )?;
    drop(dst_qmp);
    dst.run_ok("rdmamig-netplug wait-active 10", COMMAND_TIMEOUT)?;
    eprintln!(
        "destination: device_add -> rxe ACTIVE {:.2?}",
        plug_started.elapsed()
    );
    let info = dst.run_ok("ibv_devinfo", COMMAND_TIMEOUT)?;
    assert!(info.contains("PORT_ACTIVE"), "{info}");
    Ok(())
}
