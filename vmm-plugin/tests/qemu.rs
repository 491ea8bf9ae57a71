//! The QEMU backend against real QEMU processes (TCG, no guest kernel).
//!
//! With no guest, QEMU still answers QMP, hot-plugs devices and migrates RAM and device
//! state between two processes. What needs a guest is a PCIe hot-unplug: QEMU only reports
//! DEVICE_DELETED once the guest powered the slot down. That makes a guest-less VM a faithful
//! "guest that does not release the device"; a USB device, which QEMU unplugs at once,
//! shows the DEVICE_DELETED path. The unplug acknowledged by a real guest kernel is tested on
//! the test bed (tests/tests/qmp_hotplug.rs).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmamig_vmm::qmp::QmpError;
use rdmamig_vmm::{
    vm_paused, DeviceSpec, MigrationLimits, MigrationStatus, QemuConfig, QemuVmm, TimeoutStrategy,
    VfioHandover, Vmm, VmmError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A QEMU process in its own temporary directory, killed on drop.
struct Qemu {
    child: Child,
    dir: tempfile::TempDir,
}

const BASE: &[&str] = &[
    "-accel",
    "tcg",
    "-machine",
    "q35",
    "-m",
    "128",
    "-nodefaults",
    "-no-user-config",
    "-display",
    "none",
    "-device",
    "pcie-root-port,id=rp1,slot=1,chassis=1",
    "-device",
    "qemu-xhci,id=xhci",
    "-netdev",
    "hubport,id=nd0,hubid=0",
];

impl Qemu {
    /// Starts QEMU with the common machine plus `extra` arguments.
    fn start(extra: &[&str]) -> Qemu {
        let dir = tempfile::tempdir().expect("temporary directory");
        let qmp = dir.path().join("qmp.sock");
        let agent = dir.path().join("agent.sock");
        let child = Command::new("qemu-system-x86_64")
            .args(BASE)
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()))
            .args(["-device", "virtio-serial-pci,id=vser0", "-chardev"])
            .arg(format!(
                "socket,id=ch0,path={},server=on,wait=off",
                agent.display()
            ))
            .args([
                "-device",
                "virtserialport,chardev=ch0,name=org.rdmamig.agent.0,bus=vser0.0",
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("qemu-system-x86_64 runs (Debian package qemu-system-x86)");
        let qemu = Qemu { child, dir };
        // The socket file exists from bind(), before QEMU listens on it: wait until a
        // connection is taken (on a loaded machine the gap is long enough to hit).
        let end = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&qmp).is_err() {
            assert!(
                Instant::now() < end,
                "QEMU's QMP socket took no connection in 10 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        qemu
    }

    fn qmp(&self) -> PathBuf {
        self.dir.path().join("qmp.sock")
    }

    fn agent(&self) -> PathBuf {
        self.dir.path().join("agent.sock")
    }

    fn config(&self) -> QemuConfig {
        QemuConfig::new(self.qmp()).with_agent(self.agent())
    }

    async fn connect(&self) -> QemuVmm {
        QemuVmm::connect(self.config()).await.expect("QMP connects")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn uri(path: &Path) -> String {
    format!("unix:{}", path.display())
}

#[tokio::test]
async fn greets_negotiates_and_reports_status() {
    let qemu = Qemu::start(&["-S"]);
    let vmm = qemu.connect().await;
    assert!(vmm.qmp().version()["qemu"]["major"].as_u64().unwrap() >= 7);
    let status = vmm.status().await.unwrap();
    assert_eq!(status.state, "prelaunch");
    assert!(!status.running);
    vmm.qmp().execute("cont", None).await.unwrap();
    assert!(vmm.status().await.unwrap().running);
}

#[tokio::test]
async fn adds_a_device_and_types_the_errors() {
    let qemu = Qemu::start(&["-S"]);
    let vmm = qemu.connect().await;
    let nic =
        DeviceSpec::parse("driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1,romfile=").unwrap();
    let added = vmm.add_device(&nic).await.unwrap();
    assert_eq!(added.id, "nic1");
    // Before the firmware ran (-S) the root port has no bus number, so there is no address
    // yet; a booted guest's is checked on the test bed (guest_hotplug.rs).
    assert_eq!(added.bdf, None);
    let kind = vmm
        .qmp()
        .execute(
            "qom-get",
            Some(serde_json::json!({"path": "/machine/peripheral/nic1", "property": "type"})),
        )
        .await
        .unwrap();
    assert_eq!(kind, "virtio-net-pci");

    // The same id again: QEMU refuses, with its reason.
    let err = vmm.add_device(&nic).await.unwrap_err();
    assert!(
        matches!(&err, VmmError::Refused { message, .. } if message.contains("nic1")),
        "{err}"
    );
    let bogus = DeviceSpec::parse("driver=no-such-device,id=x").unwrap();
    assert!(matches!(
        vmm.add_device(&bogus).await.unwrap_err(),
        VmmError::Refused { .. }
    ));
    let err = vmm
        .remove_device("nope", Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::NotFound { object, .. } if object == "nope"),
        "{err}"
    );
    let err = vmm.qmp().execute("bogus", None).await.unwrap_err();
    assert!(
        matches!(&err, QmpError::Command { class, .. } if class == "CommandNotFound"),
        "{err}"
    );
}

#[tokio::test]
async fn a_device_the_guest_does_not_release_misses_the_deadline() {
    // No guest: nobody powers the PCIe slot down, exactly as when a guest process keeps
    // the device open.
    let qemu = Qemu::start(&[
        "-S",
        "-device",
        "virtio-net-pci,id=nic0,netdev=nd0,bus=rp1,romfile=",
    ]);
    let vmm = qemu.connect().await;
    let start = Instant::now();
    let err = vmm
        .remove_device("nic0", Duration::from_millis(400))
        .await
        .unwrap_err();
    let waited = start.elapsed();
    assert!(
        matches!(&err, VmmError::DeviceNotReleased { device, deadline_ms: 400 } if device == "nic0"),
        "{err}"
    );
    assert!(err.to_string().contains("did not release device nic0"));
    assert!(err.is_timeout());
    assert!(waited >= Duration::from_millis(400) && waited < Duration::from_secs(2));
    // Asking again waits again (without a second device_del, which a guest could take as
    // a cancel).
    let again = vmm
        .remove_device("nic0", Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(again, VmmError::DeviceNotReleased { .. }),
        "{again}"
    );
}

#[tokio::test]
async fn a_released_device_is_reported_by_device_deleted() {
    // QEMU unplugs a USB device at once: DEVICE_DELETED comes before device_del's answer,
    // which is what subscribing before sending is for.
    let qemu = Qemu::start(&["-S", "-device", "usb-kbd,id=kbd0,bus=xhci.0"]);
    let vmm = qemu.connect().await;
    let start = Instant::now();
    vmm.remove_device("kbd0", Duration::from_secs(2))
        .await
        .unwrap();
    eprintln!("usb-kbd removed in {:?}", start.elapsed());
    assert!(matches!(
        vmm.remove_device("kbd0", Duration::from_secs(1))
            .await
            .unwrap_err(),
        VmmError::NotFound { .. }
    ));
}

#[tokio::test]
async fn migrates_between_two_processes_with_progress() {
    let source = Qemu::start(&["-S"]);
    let destination = Qemu::start(&["-S", "-incoming", "defer"]);
    let src = source.connect().await;
    let dst = destination.connect().await;
    assert_eq!(dst.status().await.unwrap().state, "inmigrate");
    let via = uri(&destination.path("mig.sock"));
    dst.prepare_incoming(&via, VfioHandover::default())
        .await
        .unwrap();

    let start = Instant::now();
    src.send_migration(&via, &MigrationLimits::default())
        .await
        .unwrap();
    let mut samples = Vec::new();
    let done = src
        .wait_migration(Duration::from_secs(30), &mut |p| samples.push(p.clone()))
        .await
        .unwrap();
    let wall = start.elapsed();
    eprintln!(
        "migration of a paused 128 MiB VM: wall {wall:?}, QEMU total {:?} ms, downtime {:?} ms, \
         {:?} bytes, {} samples",
        done.total_time_ms,
        done.downtime_ms,
        done.ram_transferred,
        samples.len()
    );
    assert_eq!(done.status, MigrationStatus::Completed);
    assert_eq!(samples.last(), Some(&done));
    assert!(done.ram_transferred.unwrap() > 0);
    assert!(done.ram_total.unwrap() >= 128 << 20);
    assert!(done.total_time_ms.is_some() && done.downtime_ms.is_some());
    assert_eq!(src.status().await.unwrap().state, "postmigrate");
    // Never started, so never stopped or started by the migration: no pause to measure.
    assert_eq!(done.vm_stopped_at, None);
    // The destination's own word: it received the VM (not started, as at the source).
    let started = dst.confirm_received(Duration::from_secs(10)).await.unwrap();
    assert_eq!(started, None);
    let arrived = dst.status().await.unwrap();
    assert_eq!(arrived.state, "prelaunch", "{arrived:?}");
    assert!(!arrived.running);

    // The destination owns the VM now and takes a new device.
    let nic = DeviceSpec::parse("driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1").unwrap();
    dst.add_device(&nic).await.unwrap();
}

#[tokio::test]
async fn a_running_vm_is_paused_from_the_sources_stop_to_the_destinations_start() {
    // Running at the source (its firmware finds nothing to boot and waits); the destination
    // starts it once the state is in, as a VM that was running.
    let source = Qemu::start(&[]);
    let destination = Qemu::start(&["-incoming", "defer"]);
    let src = source.connect().await;
    let dst = destination.connect().await;
    assert!(src.status().await.unwrap().running);
    let via = uri(&destination.path("mig.sock"));
    dst.prepare_incoming(&via, VfioHandover::default())
        .await
        .unwrap();
    src.send_migration(&via, &MigrationLimits::default())
        .await
        .unwrap();
    let done = src
        .wait_migration(Duration::from_secs(30), &mut |_| {})
        .await
        .unwrap();
    let started = dst.confirm_received(Duration::from_secs(10)).await.unwrap();
    assert!(dst.status().await.unwrap().running);
    let stopped = done.vm_stopped_at.expect("the source's STOP time");
    let started = started.expect("the destination's RESUME time");
    let paused = vm_paused(Some(stopped), Some(started)).expect("the start after the stop");
    eprintln!(
        "QEMU downtime {:?} ms, VM paused {paused:?} (STOP to RESUME)",
        done.downtime_ms
    );
    assert!(paused < Duration::from_secs(30), "{paused:?}");
}

#[tokio::test]
async fn a_cancelled_migration_is_an_error_and_the_source_keeps_the_vm() {
    let source = Qemu::start(&["-S"]);
    let destination = Qemu::start(&["-S", "-incoming", "defer"]);
    let src = source.connect().await;
    let dst = destination.connect().await;
    // Slow enough (about 5 s for the ~0.5 MB an idle VM sends) to be caught while active.
    src.qmp()
        .execute(
            "migrate-set-parameters",
            Some(serde_json::json!({"max-bandwidth": 100_000})),
        )
        .await
        .unwrap();
    let via = uri(&destination.path("mig.sock"));
    dst.prepare_incoming(&via, VfioHandover::default())
        .await
        .unwrap();
    src.send_migration(&via, &MigrationLimits::default())
        .await
        .unwrap();
    src.cancel_migration().await.unwrap();
    let mut last = None;
    let err = src
        .wait_migration(Duration::from_secs(30), &mut |p| {
            last = Some(p.status.clone())
        })
        .await
        .unwrap_err();
    assert_eq!(last, Some(MigrationStatus::Cancelled));
    assert!(
        matches!(
            &err,
            VmmError::MigrationFailed {
                status: MigrationStatus::Cancelled,
                ..
            }
        ),
        "{err}"
    );
    assert!(!matches!(
        src.status().await.unwrap().state.as_str(),
        "postmigrate"
    ));
    // The destination never got the VM: it does not confirm (its incoming migration failed
    // and QEMU exits, or it still waits).
    let refused = dst
        .confirm_received(Duration::from_secs(2))
        .await
        .expect_err("a cancelled migration is not received");
    eprintln!("destination after the cancel: {refused}");
}

#[tokio::test]
async fn limits_set_the_downtime_and_a_migration_past_its_timeout_is_cancelled() {
    let source = Qemu::start(&["-S"]);
    let destination = Qemu::start(&["-S", "-incoming", "defer"]);
    let src = source.connect().await;
    let dst = destination.connect().await;
    // About 5 s for an idle VM's RAM at this bandwidth: the 1 s limit passes first.
    src.qmp()
        .execute(
            "migrate-set-parameters",
            Some(serde_json::json!({"max-bandwidth": 100_000})),
        )
        .await
        .unwrap();
    let via = uri(&destination.path("mig.sock"));
    dst.prepare_incoming(&via, VfioHandover::default())
        .await
        .unwrap();
    let limits = MigrationLimits {
        downtime: Some(Duration::from_millis(123)),
        timeout: Some(Duration::from_secs(1)),
        ..MigrationLimits::default()
    };
    src.send_migration(&via, &limits).await.unwrap();
    let parameters = src
        .qmp()
        .execute("query-migrate-parameters", None)
        .await
        .unwrap();
    assert_eq!(parameters["downtime-limit"], 123);
    let start = Instant::now();
    let err = src
        .wait_migration(Duration::from_secs(30), &mut |_| {})
        .await
        .unwrap_err();
    let waited = start.elapsed();
    assert!(
        matches!(
            &err,
            VmmError::TimedOut {
                deadline_ms: 1000,
                ..
            }
        ),
        "{err}"
    );
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    // Cancelled, and the VM stays on the source.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let state = src.qmp().execute("query-migrate", None).await.unwrap();
        if state["status"] == "cancelled" {
            break;
        }
        assert!(Instant::now() < end, "still {state}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_ne!(src.status().await.unwrap().state, "postmigrate");
}

#[tokio::test]
async fn past_its_timeout_with_the_ignore_strategy_a_migration_completes_and_local_is_refused() {
    let source = Qemu::start(&["-S"]);
    let destination = Qemu::start(&["-S", "-incoming", "defer"]);
    let src = source.connect().await;
    let dst = destination.connect().await;
    let via = uri(&destination.path("mig.sock"));
    let local = MigrationLimits {
        local: true,
        ..MigrationLimits::default()
    };
    let err = src.send_migration(&via, &local).await.unwrap_err();
    assert!(matches!(&err, VmmError::Unsupported { .. }), "{err}");
    let parallel = MigrationLimits {
        connections: Some(4),
        ..MigrationLimits::default()
    };
    let err = src.send_migration(&via, &parallel).await.unwrap_err();
    assert!(matches!(&err, VmmError::Unsupported { .. }), "{err}");
    assert_eq!(
        src.qmp().execute("query-migrate", None).await.unwrap(),
        serde_json::json!({}),
        "a refused migration started nothing"
    );
    // The throttled link keeps the migration's first pass (about 0.5 MB) going past the
    // timeout; then the downtime limit is lifted and the migration completes.
    src.qmp()
        .execute(
            "migrate-set-parameters",
            Some(serde_json::json!({"max-bandwidth": 100_000})),
        )
        .await
        .unwrap();
    dst.prepare_incoming(&via, VfioHandover::default())
        .await
        .unwrap();
    let limits = MigrationLimits {
        downtime: Some(Duration::from_millis(1)),
        timeout: Some(Duration::from_secs(1)),
        timeout_strategy: TimeoutStrategy::Ignore,
        local: false,
        connections: None,
    };
    src.send_migration(&via, &limits).await.unwrap();
    let done = src
        .wait_migration(Duration::from_secs(60), &mut |_| {})
        .await
        .unwrap();
    assert_eq!(done.status, MigrationStatus::Completed);
    let parameters = src
        .qmp()
        .execute("query-migrate-parameters", None)
        .await
        .unwrap();
    assert_eq!(parameters["downtime-limit"], 2_000_000, "{parameters}");
    eprintln!(
        "completed after the timeout: total {:?} ms, downtime {:?} ms",
        done.total_time_ms, done.downtime_ms
    );
}

#[tokio::test]
async fn adds_a_netdev_for_a_new_nic() {
    let qemu = Qemu::start(&["-S"]);
    let vmm = qemu.connect().await;
    let netdev = serde_json::json!({"type": "hubport", "id": "nd9", "hubid": 1});
    vmm.add_netdev(netdev.as_object().unwrap().clone())
        .await
        .unwrap();
    let nic =
        DeviceSpec::parse("driver=virtio-net-pci,id=nic9,netdev=nd9,bus=rp1,romfile=").unwrap();
    vmm.add_device(&nic).await.unwrap();
    let err = vmm
        .add_netdev(netdev.as_object().unwrap().clone())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::Refused { message, .. } if message.contains("nd9")),
        "{err}"
    );
}

#[tokio::test]
async fn a_migration_to_nowhere_fails_with_qemus_reason() {
    let source = Qemu::start(&["-S"]);
    let src = source.connect().await;
    let via = uri(&source.path("nobody-listens.sock"));
    // QEMU accepts the command and fails the migration itself.
    src.send_migration(&via, &MigrationLimits::default())
        .await
        .unwrap();
    let err = src
        .wait_migration(Duration::from_secs(10), &mut |_| {})
        .await
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::MigrationFailed { status: MigrationStatus::Failed, reason }
            if reason.contains("nobody-listens.sock") && reason.contains("No such file")),
        "{err}"
    );
}

#[tokio::test]
async fn quit_ends_the_process_and_later_calls_say_gone() {
    let mut qemu = Qemu::start(&["-S"]);
    let vmm = qemu.connect().await;
    vmm.quit().await.unwrap();
    let status = qemu.child.wait().unwrap();
    assert!(status.success(), "{status}");
    let err = vmm.status().await.unwrap_err();
    assert!(matches!(err, VmmError::Gone { .. }), "{err}");
}

#[tokio::test]
async fn opens_the_agent_channel() {
    let qemu = Qemu::start(&["-S"]);
    let vmm = qemu.connect().await;
    let mut channel = vmm.open_agent_channel().await.unwrap();
    // No guest reads it, but QEMU accepts the bytes on the chardev.
    channel.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_millis(100), channel.read(&mut buf)).await;
    assert!(read.is_err(), "no guest, so nothing to read");

    // QEMU serves one QMP client at a time: a second one gets no greeting.
    let mut second = QemuConfig::new(qemu.qmp());
    second.connect_timeout = Duration::from_millis(300);
    let err = QemuVmm::connect(second.clone()).await.unwrap_err();
    let cause = std::error::Error::source(&err).map(ToString::to_string);
    assert!(
        cause
            .as_deref()
            .unwrap_or("")
            .contains("another client may hold the monitor"),
        "{err}: {cause:?}"
    );

    drop(vmm);
    let without = QemuVmm::connect(second).await.unwrap();
    assert!(matches!(
        without.open_agent_channel().await.err(),
        Some(VmmError::NoAgentChannel)
    ));
}
