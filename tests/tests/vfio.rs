//! Real VFIO on the test bed: a QEMU guest with an emulated IOMMU plays the host, and the
//! migrator's VFIO layer (rdmamig_migrator::vfio, driven by `rdmamig-vfio-check` inside the
//! guest) opens, resets, DMA-maps and queries real vfio-pci devices there.
//!
//! The guest has (see ../shared/TESTBED.md, "Real VFIO inside a guest"):
//! - `edu` on the root bus: advertises no reset, which the migrator must report;
//! - `edu` behind a pcie-root-port: resets through its bus;
//! - an e1000e on the root bus: resets through PM;
//! - `edu` and a virtio-net NIC behind one PCIe-to-PCI bridge: one IOMMU group, the NIC stays
//!   on virtio-pci, so the group is not viable for the edu.
//!
//! No network: the guest has no tap, and its only NICs sit on an internal QEMU hub.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdmamig_images::{ImageSpec, DEFAULT_MODULES};
use rdmamig_testbed::bin_dir;
use rdmamig_testbed::console::Console;
use serde_json::Value;

const CHECK_BINARY: &str = "rdmamig-vfio-check";

/// QEMU's `edu` device and the e1000e, as sysfs names their vendor:device.
const EDU: &str = "1234:11e8";
const E1000E: &str = "8086:10d3";

/// A QEMU process killed (by PID) on drop, its console dumped if the test panicked.
struct Vm {
    child: Child,
    dir: PathBuf,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("console.log")).unwrap_or_default();
            eprintln!("--- guest console ---\n{log}\n--- end of guest console ---");
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

#[test]
fn the_vfio_layer_works_on_real_vfio_devices_in_a_guest_with_an_iommu() {
    let check = bin_dir().join(CHECK_BINARY);
    assert!(
        check.is_file(),
        "{} is missing: build it with `cargo build --release -p rdmamig-migrator`",
        check.display()
    );
    assert!(DEFAULT_MODULES.contains(&"e1000e"));
    let image = rdmamig_images::build(&ImageSpec {
        out_dir: workspace_root().join("target/testbed-vfio"),
        guest_binaries: vec![check],
        extra_modules: ["vfio", "vfio_iommu_type1", "vfio-pci"]
            .map(String::from)
            .to_vec(),
        ..ImageSpec::default()
    })
    .expect("the VFIO guest image builds");

    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("con.sock");
    let child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg", "-machine", "q35", "-m", "512", "-smp", "1"])
        .args(["-nographic", "-nodefaults", "-no-reboot"])
        // The vIOMMU comes first: devices created before it would bypass it.
        .args(["-device", "intel-iommu,intremap=on"])
        .arg("-kernel")
        .arg(&image.kernel)
        .arg("-initrd")
        .arg(&image.initramfs)
        .args(["-append", "console=ttyS0 panic=-1 quiet intel_iommu=on"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=ser0,path={},server=on,wait=off,logfile={}",
            console.display(),
            dir.path().join("console.log").display()
        ))
        .args(["-serial", "chardev:ser0"])
        .args(["-device", "edu,addr=05.0"])
        .args(["-device", "pcie-root-port,id=rp1,slot=1,chassis=1"])
        .args(["-device", "edu,bus=rp1"])
        .args([
            "-netdev",
            "hubport,id=h0,hubid=0",
            "-netdev",
            "hubport,id=h1,hubid=0",
        ])
        .args(["-device", "e1000e,netdev=h0,addr=06.0,romfile="])
        .args(["-device", "pcie-root-port,id=rp2,slot=2,chassis=2"])
        .args(["-device", "pcie-pci-bridge,id=br1,bus=rp2"])
        .args(["-device", "edu,bus=br1,addr=01.0"])
        .args([
            "-device",
            "virtio-net-pci,netdev=h1,bus=br1,addr=02.0,romfile=",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("qemu.log")).unwrap())
        .spawn()
        .expect("qemu-system-x86_64 runs");
    let _vm = Vm {
        child,
        dir: dir.path().to_path_buf(),
    };
    let console = Console::connect(&console, Duration::from_secs(10)).unwrap();
    console
        .wait_for_marker(&["RDMAMIG-READY"], Duration::from_secs(90))
        .unwrap();
    let out = console
        .run(
            &format!("{CHECK_BINARY} {EDU} {E1000E}"),
            Duration::from_secs(60),
        )
        .unwrap();
    assert_eq!(out.status, 0, "{}", out.output);
    eprintln!("{}", out.output);
    let reports: Vec<Value> = out
        .output
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reports.len(), 4, "{}", out.output);
    let by_driver_and_reset = |ids: &str, f: &dyn Fn(&Value) -> bool| -> Vec<Value> {
        reports
            .iter()
            .filter(|r| r["ids"] == ids && f(r))
            .cloned()
            .collect()
    };

    // Every device is refused while it is not on vfio-pci, with an error that says so.
    for r in &reports {
        let before = r["open_before_bind"]["error"].as_str().unwrap_or_default();
        assert!(
            before.contains("is not bound to vfio-pci"),
            "{}: {before}",
            r["address"]
        );
        assert_eq!(r["bind"], "ok", "{r}");
    }
    let e1000e = by_driver_and_reset(E1000E, &|_| true);
    assert_eq!(e1000e.len(), 1);
    assert_eq!(e1000e[0]["driver_before"], "e1000e");
    assert!(e1000e[0]["open_before_bind"]["error"]
        .as_str()
        .unwrap()
        .contains("(its driver: e1000e)"));

    // The edu beside the virtio-net NIC behind the bridge: the group is not viable.
    let spoiled = by_driver_and_reset(EDU, &|r| r["open"].get("error").is_some());
    assert_eq!(spoiled.len(), 1, "{reports:?}");
    let error = spoiled[0]["open"]["error"].as_str().unwrap();
    assert!(
        error.contains("is not viable") && error.contains("bound to virtio-pci"),
        "{error}"
    );

    // The others open; DMA maps and unmaps; none supports VFIO migration.
    let opened: Vec<&Value> = reports.iter().filter(|r| r["open"] == "ok").collect();
    assert_eq!(opened.len(), 3, "{reports:?}");
    for r in &opened {
        assert_eq!(r["dma"], "ok", "{r}");
        assert_eq!(r["migration"], "not supported", "{r}");
    }
    // edu on the root bus advertises no reset, and the migrator says so; the edu behind the
    // root port and the e1000e reset for real.
    let root_edu: Vec<&&Value> = opened
        .iter()
        .filter(|r| r["address"] == "0000:00:05.0")
        .collect();
    assert_eq!(root_edu.len(), 1, "{reports:?}");
    assert_eq!(root_edu[0]["reset_advertised"], false);
    assert!(root_edu[0]["reset"]["error"]
        .as_str()
        .unwrap()
        .contains("advertises no reset"));
    let reset_ok = opened.iter().filter(|r| r["reset"] == "ok").count();
    assert_eq!(reset_ok, 2, "{reports:?}");
    assert!(e1000e[0]["reset_advertised"] == true);
}
