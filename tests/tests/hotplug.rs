//! Hot-plug on the test bed: the RDMA NIC is unplugged and a new one plugged through QMP, as
//! during a move, and the image's NIC hook gives the new NIC an ACTIVE Soft-RoCE device.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::{Duration, Instant};

use rdmamig_testbed::{error_chain, GuestBinaries, Testbed};
use serde_json::json;

const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
const UNPLUG_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn replugged_nic_gets_an_active_rxe_device() {
    let tb = Testbed::builder("hotplug")
        .guest_binaries(GuestBinaries::IfPresent)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    // Panicking while `tb` lives makes its drop print every guest's console.
    if let Err(e) = scenario(&tb) {
        panic!("{}", error_chain(&*e));
    }
}

fn scenario(tb: &Testbed) -> Result<(), Box<dyn std::error::Error>> {
    let spec = tb.guest_spec("a")?;
    let boot_started = Instant::now();
    let guest = tb.start_guest(spec.clone())?;
    eprintln!("boot to RDMAMIG-READY: {:.2?}", boot_started.elapsed());

    // Two cycles: the second unplugs a NIC that was itself hot-plugged.
    let mut current = "nic0".to_owned();
    for cycle in 1..=2 {
        let mut qmp = guest.qmp()?;
        let unplug_started = Instant::now();
        qmp.execute("device_del", json!({ "id": current }))?;
        qmp.wait_event(
            "DEVICE_DELETED",
            |data| data["device"] == current.as_str(),
            UNPLUG_TIMEOUT,
        )?;
        let unplug = unplug_started.elapsed();
        let status = guest.run_ok("rdmamig-netplug status; rdma link show", COMMAND_TIMEOUT)?;
        assert!(
            !status.contains("ACTIVE"),
            "cycle {cycle}: an rxe device survived the unplug:\n{status}"
        );

        let next = format!("nic{cycle}");
        let plug_started = Instant::now();
        qmp.execute(
            "device_add",
            json!({
                "driver": "virtio-net-pci",
                "netdev": "nd0",
                "id": next,
                "bus": "rp1",
                "mac": spec.mac,
            }),
        )?;
        drop(qmp);
        guest.run_ok("rdmamig-netplug wait-active 10", COMMAND_TIMEOUT)?;
        let plug = plug_started.elapsed();
        eprintln!(
            "cycle {cycle}: device_del -> DEVICE_DELETED {unplug:.2?}; device_add -> rxe ACTIVE {plug:.2?}"
        );

        let status = guest.run_ok("rdmamig-netplug status", COMMAND_TIMEOUT)?;
        assert!(status.contains(" ACTIVE"), "cycle {cycle}: {status}");
        let info = guest.run_ok("ibv_devinfo", COMMAND_TIMEOUT)?;
        assert!(info.contains("PORT_ACTIVE"), "cycle {cycle}: {info}");
        let addrs = guest.run_ok("/usr/sbin/ip -4 addr show", COMMAND_TIMEOUT)?;
        assert!(
            addrs.contains(&spec.ip),
            "cycle {cycle}: {} missing:\n{addrs}",
            spec.ip
        );
        current = next;
    }
    eprintln!(
        "netplug log:\n{}",
        guest.run_ok("cat /run/netplug.log", COMMAND_TIMEOUT)?
    );
    Ok(())
}
