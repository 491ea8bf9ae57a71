//! The QEMU backend's hot-unplug and hot-plug with a booted guest on the test bed (TCG,
//! Soft-RoCE): the guest acknowledges the unplug (DEVICE_DELETED) unless a process holds a
//! verbs context on the NIC, in which case the deadline error says so; once the process is
//! gone, asking again completes the pending unplug without a second request.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64, like every test-bed test.

use std::time::{Duration, Instant};

use rdmamig_testbed::{error_chain, GuestBinaries, Testbed};
use rdmamig_vmm::{DeviceSpec, QemuConfig, QemuVmm, Vmm, VmmError};

const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn unplug_waits_for_the_guest_and_names_a_held_device() {
    let tb = Testbed::builder("vmmplug")
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
    let guest = tb.start_guest(spec.clone())?;
    let runtime = tokio::runtime::Runtime::new()?;
    let vmm = runtime.block_on(QemuVmm::connect(QemuConfig::new(guest.qmp_socket())))?;
    assert!(runtime.block_on(vmm.status())?.running);

    // A raw verbs user keeps the device (started once its device set-up succeeded).
    rdmamig_testbed::steps::start_holder(&guest)?;
    let started = Instant::now();
    let removed = runtime.block_on(vmm.remove_device("nic0", Duration::from_secs(3)));
    let Err(err) = removed else {
        let holder = guest.run("cat /run/holder.log /run/netplug.log", COMMAND_TIMEOUT)?;
        panic!(
            "the guest released a NIC a process holds; the holder:\n{}",
            holder.output
        );
    };
    eprintln!("held device: {err} (after {:?})", started.elapsed());
    assert!(
        matches!(&err, VmmError::DeviceNotReleased { device, .. } if device == "nic0"),
        "{err}"
    );

    // Once the holder is gone, the pending unplug completes; asking again just waits.
    guest.run_ok("kill $(cat /run/holder.pid)", COMMAND_TIMEOUT)?;
    let started = Instant::now();
    runtime.block_on(vmm.remove_device("nic0", Duration::from_secs(20)))?;
    eprintln!(
        "released {:?} after the holder was killed",
        started.elapsed()
    );

    // A free NIC: plug, then unplug with the guest acknowledging at once.
    let nic = DeviceSpec::parse(&format!(
        "driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1,mac={}",
        spec.mac
    ))?;
    let added = runtime.block_on(vmm.add_device(&nic))?;
    // The firmware numbered the root port's bus: the NIC is slot 0 behind it.
    assert_eq!(added.bdf.as_deref(), Some("0000:01:00.0"), "{added:?}");
    guest.run_ok(
        "i=0; until [ \"$(cat /sys/class/net/eth0/carrier 2>/dev/null)\" = 1 ]; do \
           i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.05; done",
        COMMAND_TIMEOUT,
    )?;
    let started = Instant::now();
    runtime.block_on(vmm.remove_device("nic1", Duration::from_secs(5)))?;
    eprintln!("free NIC unplugged in {:?}", started.elapsed());
    Ok(())
}
