//! Whole coordinated moves with Cloud Hypervisor endpoints, run as an operator runs them:
//! the one wrapper command `rdmamig-vmm --api-socket ... send-migration destination_url=...`
//! in place of `ch-remote send-migration`, through `rdmamig migrate` and the daemon's mover.
//!
//! A real Cloud Hypervisor cannot run here (no usable KVM), so each VMM is a
//! [`ChFacade`]: Cloud Hypervisor's API, answered as the real server does (the spec plus
//! NOTES.md; every request both ends receive is checked against the spec), over a real QEMU
//! test-bed guest that it unplugs, plugs and migrates through QMP. The VM really moves, with
//! traffic both ways to a peer VM over Soft-RoCE, and the agent is reached over real hybrid
//! vsock (vhost-device-vsock, which speaks Cloud Hypervisor's `CONNECT` protocol) at each end
//! in turn: the source's before the migration, the destination's after.
//!
//! The same move between two migrators: the destination host's own daemon, asked over
//! mutual TLS (certificates made by the test), reserves the VF from its pool (listed by PCI
//! address), sends its facade's `vm.receive-migration`, plugs the VF and resumes the
//! connections through the destination's agent; its pool then shows the VF attached.
//!
//! A third move's migration really fails (the destination's QEMU dies mid-stream) and rolls
//! back: Cloud Hypervisor cannot cancel, so the rollback waits for the migration's end, plugs
//! a device back on the source and has the agent resume there; the report carries the cause
//! from the source's log file, since `migration-failed` carries none.
//!
//! Needs root, /dev/net/tun, qemu-system-x86_64, vhost-device-vsock and the workspace's
//! binaries (scripts/setup.sh); fails (never skips) without them.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmamig_testbed::ch_facade::ChFacade;
use rdmamig_testbed::ch_spec::{check_against_spec, refusal, successful, vm_info, FakeCh};
use rdmamig_testbed::pki::{free_port, Pki};
use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{assert_served_a_move, finish_clean_flow, GuestOptions, MoveGuests};
use rdmamig_testbed::{bin_dir, error_chain, GuestBinaries, Testbed};
use serde_json::{json, Value};

/// The traffic's tag in the guests.
const TAG: &str = "chflow";
/// The VF the move attaches on the destination (the facade plugs its stand-in for it).
const VF: &str = "0000:5e:02.3";
/// Where the destination receives the migration stream (in the test bed's namespace).
const MIGRATION_URL: &str = "tcp:127.0.0.1:6000";

/// The bodies sent to `path` (under /api/v1).
fn bodies(api: &[rdmamig_testbed::ch_spec::Recorded], path: &str) -> Vec<Value> {
    api.iter()
        .filter(|r| r.path.ends_with(path))
        .filter_map(|r| r.body.clone())
        .collect()
}

/// Which move the scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    /// One daemon drives both ends.
    OneDaemon,
    /// The destination's own migrator, over mutual TLS, receives into its facade and
    /// plugs a function of its pool.
    TwoMigrators,
    /// One daemon; the destination's QEMU dies mid-stream and the move rolls back.
    FailedMigration,
}

#[test]
fn a_cloud_hypervisor_vm_moves_with_one_wrapper_command() {
    run("chmove", Case::OneDaemon);
}

#[test]
fn a_cloud_hypervisor_vm_moves_to_another_migrators_host() {
    run("chpeer", Case::TwoMigrators);
}

#[test]
fn a_failed_cloud_hypervisor_migration_rolls_back_to_the_source() {
    run("chfail", Case::FailedMigration);
}

/// `rdmamig-vmm receive-migration` as a workflow's destination line, in ch-remote's words:
/// the option list reaches `vm.receive-migration`; a VM a failed receive left `Created` is
/// deleted first; the receiver's failure is the command's, with its chain; VFIO devices the
/// caller opened are handed to the VMM with the request; a descriptor that is not open is
/// refused before any request.
#[test]
fn receive_migration_takes_ch_remotes_options() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _entered = runtime.enter();
    let fail = Arc::new(AtomicBool::new(false));
    let api = {
        let fail = fail.clone();
        FakeCh::start(move |path, body| match path {
            "/vm.info" => (200, vm_info("Created", &[])),
            "/vm.receive-migration" if fail.load(Ordering::Acquire) => refusal(&[
                "Error from API",
                "Error receiving migration",
                "Socket error",
                "failed to fill whole buffer",
            ]),
            _ => successful(path, body),
        })
    };
    let receive = |options: &str| {
        let output = Command::new(bin_dir().join("rdmamig-vmm"))
            .arg("--api-socket")
            .arg(api.socket())
            .args(["receive-migration", options, "--timeout-s", "30"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        eprintln!("rdmamig-vmm receive-migration {options}:\n{text}");
        (output.status.code(), text)
    };

    let (code, text) = receive("receiver_url=tcp:127.0.0.1:6000,tls_dir=/etc/vm1/tls-server");
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("\"received_ms\""), "{text}");
    let recorded = api.recorded();
    check_against_spec(&recorded);
    let paths: Vec<&str> = recorded.iter().map(|r| r.path.as_str()).collect();
    let delete = paths.iter().position(|p| p.ends_with("/vm.delete"));
    let receive_at = paths
        .iter()
        .position(|p| p.ends_with("/vm.receive-migration"));
    assert!(
        delete.is_some() && delete < receive_at,
        "the Created VM was not deleted before receiving: {paths:?}"
    );
    assert_eq!(
        bodies(&api.recorded(), "/vm.receive-migration"),
        [json!({"receiver_url": "tcp:127.0.0.1:6000", "tls_dir": "/etc/vm1/tls-server"})]
    );

    fail.store(true, Ordering::Release);
    let (code, text) = receive("receiver_url=tcp:127.0.0.1:6000");
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("failed to fill whole buffer"), "{text}");

    // VFIO devices handed over as ch-remote does: descriptors the calling shell opened
    // (`exec 5<>... 6<>...`), named in the body and sent beside it (SCM_RIGHTS). Files stand
    // in for the VF's cdev and /dev/iommu (the test bed's kernels have neither).
    fail.store(false, Ordering::Release);
    let dir = tempfile::tempdir().unwrap();
    let cdev = std::fs::File::create(dir.path().join("vfio0")).unwrap();
    let iommu = std::fs::File::create(dir.path().join("iommu")).unwrap();
    let identity = |file: &std::fs::File| {
        let meta = file.metadata().unwrap();
        (meta.dev(), meta.ino())
    };
    let handed = [(5, cdev.as_raw_fd()), (6, iommu.as_raw_fd())];
    let mut command = Command::new(bin_dir().join("rdmamig-vmm"));
    command.arg("--api-socket").arg(api.socket()).args([
        "receive-migration",
        "receiver_url=tcp:127.0.0.1:6000,vfio_fds=[vfio0@5],iommufd_fd=6",
    ]);
    // SAFETY: between fork and exec only dup2 runs, which is async-signal-safe; the files
    // stay open in the parent until the child has exec'd.
    unsafe {
        command.pre_exec(move || {
            for (to, from) in handed {
                if libc::dup2(from, to) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let output = command.output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let received = api.recorded();
    let request = received
        .iter()
        .rev()
        .find(|r| r.path.ends_with("/vm.receive-migration"))
        .unwrap();
    assert_eq!(
        request.body,
        Some(json!({"receiver_url": "tcp:127.0.0.1:6000",
            "vfio_fds": [{"id": "vfio0", "fd": 5}], "iommufd_fd": 6}))
    );
    assert_eq!(
        request.fds,
        [identity(&cdev), identity(&iommu)],
        "the VMM did not get the caller's descriptors, in order"
    );

    // A descriptor the caller did not open: refused before any request.
    let before = api.recorded().len();
    let (code, text) = receive("receiver_url=tcp:127.0.0.1:6000,vfio_fds=[vfio0@57],iommufd_fd=58");
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("descriptor 57 is not open in rdmamig-vmm"),
        "{text}"
    );
    assert_eq!(
        api.recorded().len(),
        before,
        "a refused option list reached the VMM"
    );
}

fn run(name: &str, case: Case) {
    let bed = Testbed::builder(name)
        .guest_binaries(GuestBinaries::Required)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    if let Err(e) = scenario(&bed, case) {
        panic!("{}", error_chain(&*e));
    }
}

/// One move with traffic both ways, as `case` says.
fn scenario(bed: &Testbed, case: Case) -> Result<(), Box<dyn std::error::Error>> {
    let fail_migration = case == Case::FailedMigration;
    let options = GuestOptions {
        vsock_cid: Some(3),
        ..Default::default()
    };
    let guests = MoveGuests::start_with(bed, "ch", options)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    let source = ChFacade::running(&guests.src);
    let destination = ChFacade::receiving(&guests.dst);
    let daemons = Daemons::start(bed, case, &guests.dst, &destination)?;
    guests.start_flow(TAG, "--rate 200")?;
    std::thread::sleep(Duration::from_secs(2));

    let report_path = bed.dir().join("ch-move.json");
    // In ch-remote's own words; the facade's QEMU cannot take Cloud Hypervisor's tls_dir, so
    // the stream is plain here (the receive test checks tls_dir reaches the API).
    let mut command = Command::new(bin_dir().join("rdmamig-vmm"));
    command
        .arg("--api-socket")
        .arg(source.socket())
        .arg("--vsock")
        .arg(guests.src.vsock_socket())
        .arg("--event-monitor")
        .arg(source.events())
        .arg("--log-file")
        .arg(source.log_file())
        .args([
            "send-migration",
            &format!("destination_url={MIGRATION_URL},downtime_ms=250,timeout_s=60"),
        ])
        .arg("--to-api-socket")
        .arg(destination.socket())
        .arg("--to-vsock")
        .arg(guests.dst.vsock_socket())
        .args(["--vm", "vm", "--detach", "nic0"])
        .args(["--attach", &format!("driver=vfio-pci,host={VF},id=vf1")])
        .arg("--socket")
        .arg(daemons.source.socket())
        .arg("--report")
        .arg(&report_path);
    if case == Case::TwoMigrators {
        command.args(["--destination-migrator", "dst", "--from-pool"]);
    }
    let output = if fail_migration {
        // Slow enough that the stream is still flowing when the destination dies.
        source.qmp(
            "migrate-set-parameters",
            json!({"max-bandwidth": 4_000_000}),
        )?;
        let mover = command
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        wait_streaming(&source)?;
        guests.dst.kill();
        mover.wait_with_output()?
    } else {
        command.output()?
    };
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    eprintln!("rdmamig-vmm send-migration:\n{text}");
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path)?)?;
    eprintln!(
        "phases: {}",
        report["timeline"]["phases"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| format!(
                "{} {} ms",
                p["phase"].as_str().unwrap_or("?"),
                p["duration_ms"]
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // Every request of the move, on both ends, is one the spec defines, with a body its
    // schema accepts.
    let (sent, received) = (source.recorded(), destination.recorded());
    check_against_spec(&sent);
    check_against_spec(&received);
    assert_eq!(bodies(&sent, "/vm.remove-device"), [json!({"id": "nic0"})]);
    assert_eq!(
        bodies(&sent, "/vm.send-migration"),
        [
            json!({"destination_url": MIGRATION_URL, "local": false, "downtime_ms": 250,
            "timeout_s": 60, "timeout_strategy": "Cancel"})
        ]
    );
    assert_eq!(
        bodies(&received, "/vm.receive-migration"),
        [json!({"receiver_url": MIGRATION_URL})]
    );
    if fail_migration {
        check_rolled_back(&output, &text, &report, &source, &destination)?;
        // The traffic goes on on the source.
        std::thread::sleep(Duration::from_secs(2));
        finish_clean_flow(&guests.src, "VM kept on the source", &guests.peer, TAG);
        return Ok(());
    }

    assert_eq!(output.status.code(), Some(0), "the move failed:\n{text}");
    assert_eq!(report["ok"], true, "{report:#}");
    assert_eq!(report["final_phase"], "done");
    assert_eq!(report["plan"]["source"]["vmm"], "cloud_hypervisor");
    assert_eq!(report["plan"]["destination"]["vmm"], "cloud_hypervisor");
    let phases = report["timeline"]["phases"].as_array().unwrap();
    let names: Vec<&str> = phases.iter().filter_map(|p| p["phase"].as_str()).collect();
    for phase in [
        "prepare", "quiesce", "detach", "migrate", "attach", "resume",
    ] {
        assert!(names.contains(&phase), "no {phase} in {names:?}");
    }
    assert!(
        phases[0]["details"]["agent_version"].is_string(),
        "the source's agent answered over vsock: {}",
        phases[0]
    );
    assert_eq!(
        bodies(&received, "/vm.add-device"),
        [json!({"path": format!("/sys/bus/pci/devices/{VF}"), "id": "vf1"})]
    );
    assert!(bodies(&sent, "/vm.add-device").is_empty());
    // The VM is on the destination's QEMU, with the device plugged there.
    assert!(!source.holds_vm() && destination.holds_vm());
    let devices = destination.devices()?;
    assert!(devices.iter().any(|d| d == "vf1"), "{devices:?}");
    if let Some(peer) = &daemons.destination {
        check_peer_duties(&report, peer, bed)?;
    }

    guests.src.kill();
    guests.dst.reattach_console()?;
    std::thread::sleep(Duration::from_secs(3));
    finish_clean_flow(&guests.dst, "moved VM", &guests.peer, TAG);
    Ok(())
}

/// The daemons of a case: the source's, and for [`Case::TwoMigrators`] the destination's.
struct Daemons {
    source: Daemon,
    destination: Option<(Daemon, u16)>,
}

impl Daemons {
    /// One daemon, or two that know each other by certificates made here: the destination
    /// lists the VF in its pool by PCI address and lets the source name only its own VMM's
    /// files (the facade's and the guest's directories).
    fn start(
        bed: &Testbed,
        case: Case,
        dst: &rdmamig_testbed::Guest,
        facade: &ChFacade,
    ) -> Result<Daemons, Box<dyn std::error::Error>> {
        if case != Case::TwoMigrators {
            return Ok(Daemons {
                source: Daemon::start(bed.dir())?,
                destination: None,
            });
        }
        let pki = Pki::new(&bed.dir().join("pki"))?;
        for host in ["source", "destination"] {
            pki.issue(host)?;
        }
        let port = free_port()?;
        let facade_dir = facade.socket().parent().expect("a directory").to_owned();
        let configs = [
            (
                "source",
                pki.peer_table("source", None, &[("dst", "destination", port)], &[]),
            ),
            (
                "destination",
                format!(
                    "[[pool.function]]\nname = \"vf0\"\npci = \"{VF}\"\n\n{}",
                    pki.peer_table(
                        "destination",
                        Some(port),
                        &[("src", "source", 0)],
                        &[
                            facade_dir.as_path(),
                            dst.dir(),
                            facade.events().parent().expect("a directory")
                        ],
                    )
                ),
            ),
        ];
        let mut started = Vec::new();
        for (name, text) in configs {
            let path = bed.dir().join(format!("{name}.toml"));
            std::fs::write(&path, text)?;
            started.push(Daemon::start_named(bed.dir(), name, Some(&path))?);
        }
        let destination = started.pop().expect("two daemons");
        let source = started.pop().expect("two daemons");
        Ok(Daemons {
            source,
            destination: Some((destination, port)),
        })
    }
}

/// The destination's migrator did its duties for the source over the channel, and its
/// pool shows the VF attached to the VM.
fn check_peer_duties(
    report: &Value,
    (daemon, port): &(Daemon, u16),
    bed: &Testbed,
) -> Result<(), Box<dyn std::error::Error>> {
    let details = |phase: &str| {
        report["timeline"]["phases"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["phase"] == phase)
            .map(|p| p["details"].clone())
            .unwrap_or_default()
    };
    assert_eq!(
        details("prepare")["destination"],
        format!("migrator dst (127.0.0.1:{port})").as_str()
    );
    assert_eq!(details("attach")["function"], "vf0", "{report:#}");
    assert_served_a_move(&bed.dir().join("destination-daemon.log"), "src");
    let state = daemon.pool_function("vf0");
    assert_eq!(state["state"], "attached", "{state}");
    assert_eq!(state["vm"], "vm", "{state}");
    Ok(())
}

/// Waits until the source's migration stream carries data (QEMU's `query-migrate`).
fn wait_streaming(source: &ChFacade) -> Result<(), Box<dyn std::error::Error>> {
    let end = Instant::now() + Duration::from_secs(120);
    loop {
        let info = source.qmp("query-migrate", Value::Null)?;
        if info["status"] == "active" && info["ram"]["transferred"].as_u64() > Some(1_000_000) {
            return Ok(());
        }
        if Instant::now() >= end {
            return Err(format!("the migration never streamed: {info}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The failed migration rolled the move back: exit 4, the VM on the source with a device
/// plugged back, nothing plugged on the destination, QEMU's cause in the report.
fn check_rolled_back(
    output: &Output,
    text: &str,
    report: &Value,
    source: &ChFacade,
    destination: &ChFacade,
) -> Result<(), Box<dyn std::error::Error>> {
    assert_eq!(output.status.code(), Some(4), "not rolled back:\n{text}");
    assert_eq!(report["final_phase"], "rolled_back", "{report:#}");
    assert_eq!(report["failed_phase"], "migrate");
    assert_eq!(report["vm_location"], "source");
    let error = report["error"].as_str().unwrap_or_default();
    let log = std::fs::read_to_string(source.log_file())?;
    let cause = log
        .lines()
        .find_map(|l| l.split("Migration failed: ").nth(1))
        .ok_or_else(|| format!("the source logged no failure: {log:?}"))?;
    assert!(
        error.contains(cause),
        "the report does not carry QEMU's cause {cause:?}: {error}"
    );
    let rollback = report["timeline"]["phases"]
        .as_array()
        .and_then(|p| p.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(rollback["phase"], "rollback", "{rollback:#}");
    let steps = rollback["details"]["steps"].to_string();
    assert!(steps.contains("re-attached on the source"), "{steps}");
    assert!(steps.contains("resumed on the source"), "{steps}");
    assert_eq!(
        bodies(&source.recorded(), "/vm.add-device"),
        [json!({"path": format!("/sys/bus/pci/devices/{VF}"), "id": "vf1"})]
    );
    assert!(bodies(&destination.recorded(), "/vm.add-device").is_empty());
    assert!(source.holds_vm() && !destination.holds_vm());
    let devices = source.devices()?;
    assert!(devices.iter().any(|d| d == "vf1"), "{devices:?}");
    Ok(())
}
