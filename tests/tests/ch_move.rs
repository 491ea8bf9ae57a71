//! A whole coordinated move with Cloud Hypervisor endpoints, run as an operator runs it: the
//! one wrapper command `rdmamig-vmm --api-socket ... send-migration destination_url=...` in place
//! of `ch-remote send-migration`, through `rdmamig migrate` and the daemon's mover.
//!
//! A real Cloud Hypervisor cannot run here (no usable KVM), so both VMM APIs are the
//! spec-checked stand-ins of `rdmamig_testbed::ch_spec`: every request the move makes, on
//! both ends, is checked against Cloud Hypervisor's OpenAPI description, and a path the spec
//! lacks fails the test. The stand-ins play the two VMMs' sides of a migration the way
//! NOTES.md describes a real one: the source answers `vm.send-migration` with 204 at once,
//! writes `migration-started` / `migration-finished` to its event monitor and loses the VM
//! (404); the destination's `vm.receive-migration` stays open until then and answers 204,
//! after which its `vm.info` shows the VM. A second move's migration fails as a real one
//! does (`migration-failed`, the VM resumed on the source, the receiver answers 500 with
//! the error chain) and rolls back: Cloud Hypervisor cannot cancel, so the rollback waits
//! for the migration's end, plugs a device back on the source and has the agent resume
//! there. The guest agent is real: the test-bed guest's
//! agent, reached over real hybrid vsock (vhost-device-vsock, which speaks Cloud
//! Hypervisor's `CONNECT` protocol), from both ends' endpoints.
//!
//! Needs root, /dev/net/tun, qemu-system-x86_64, vhost-device-vsock and the workspace's
//! binaries (scripts/setup.sh); fails (never skips) without them.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rdmamig_testbed::ch_spec::{
    append_event, check_against_spec, refusal, response_schema, spec_body, successful, validate,
    vm_info, FakeCh,
};
use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::{bin_dir, error_chain, GuestBinaries, Testbed};
use rdmamig_vmm::ch_api::Endpoint;
use serde_json::{json, Value};

/// The longest the destination's receive request waits for the migration.
const RECEIVE_WAIT: Duration = Duration::from_secs(60);

/// The two VMMs' shared view of the one VM.
#[derive(Debug, Default)]
struct World {
    /// `false`: the VM is on the source; `true`: it migrated to the destination.
    migrated: bool,
    /// The source's migration failed (the VM stays on the source).
    failed: bool,
    /// A send migration fails instead of moving the VM.
    fail_migration: bool,
    source_devices: BTreeSet<String>,
    destination_devices: BTreeSet<String>,
}

type Shared = Arc<(Mutex<World>, Condvar)>;

fn info(has_vm: bool, devices: &BTreeSet<String>) -> (u16, Vec<u8>) {
    if !has_vm {
        return (404, spec_body(Endpoint::VmInfo, 404));
    }
    let ids: Vec<&str> = devices.iter().map(String::as_str).collect();
    (200, vm_info("Running", &ids))
}

fn body_id(body: Option<&Value>) -> String {
    body.and_then(|b| b["id"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The source VMM: runs the VM with `vf0`; a send migration moves it away.
fn source_api(world: Shared, events: std::path::PathBuf) -> FakeCh {
    FakeCh::start(move |path, body| {
        let (lock, arrived) = &*world;
        let mut state = lock.lock().unwrap();
        match path {
            "/vm.info" => info(!state.migrated, &state.source_devices),
            "/vm.remove-device" => {
                if state.source_devices.remove(&body_id(body)) {
                    (204, Vec::new())
                } else {
                    (404, spec_body(Endpoint::VmRemoveDevice, 404))
                }
            }
            "/vm.send-migration" => {
                // Answered at once; the outcome is in the event monitor (NOTES.md). A failed
                // migration leaves the VM resumed on the source.
                let outcome = if state.fail_migration {
                    state.failed = true;
                    ["migration-started", "migration-failed", "resumed"].as_slice()
                } else {
                    state.migrated = true;
                    ["migration-started", "migration-finished"].as_slice()
                };
                for event in outcome {
                    append_event(&events, event);
                }
                arrived.notify_all();
                (204, Vec::new())
            }
            "/vm.add-device" => {
                let id = body_id(body);
                state.source_devices.insert(id.clone());
                (200, serde_json::to_vec(&pci_device(&id)).unwrap())
            }
            _ => successful(path, body),
        }
    })
}

/// The destination VMM: no VM until the migration; plugs what it is given.
fn destination_api(world: Shared) -> FakeCh {
    FakeCh::start(move |path, body| {
        let (lock, arrived) = &*world;
        match path {
            "/vm.info" => {
                let state = lock.lock().unwrap();
                info(state.migrated, &state.destination_devices)
            }
            "/vm.receive-migration" => {
                // Open until the VM has arrived (this runs on a blocking thread).
                let state = lock.lock().unwrap();
                let (state, _) = arrived
                    .wait_timeout_while(state, RECEIVE_WAIT, |s| !s.migrated && !s.failed)
                    .unwrap();
                if state.migrated {
                    (204, Vec::new())
                } else {
                    let chain = json!([
                        "Error from API",
                        "Error receiving migration",
                        "Socket error",
                        "failed to fill whole buffer"
                    ]);
                    (500, serde_json::to_vec(&chain).unwrap())
                }
            }
            "/vm.add-device" => {
                let id = body_id(body);
                lock.lock().unwrap().destination_devices.insert(id.clone());
                (200, serde_json::to_vec(&pci_device(&id)).unwrap())
            }
            _ => successful(path, body),
        }
    })
}

/// `vm.add-device`'s answer, checked against the spec.
fn pci_device(id: &str) -> Value {
    let added = json!({"id": id, "bdf": "0000:00:05.0"});
    validate(
        response_schema(Endpoint::VmAddDevice, 200).expect("PciDeviceInfo"),
        &added,
        "PciDeviceInfo",
    )
    .expect("the stand-in answers what the spec allows");
    added
}

/// The bodies sent to `path` (under /api/v1).
fn bodies(api: &FakeCh, path: &str) -> Vec<Value> {
    api.recorded()
        .into_iter()
        .filter(|r| r.path.ends_with(path))
        .filter_map(|r| r.body)
        .collect()
}

#[test]
fn a_cloud_hypervisor_vm_moves_with_one_wrapper_command() {
    run("chmove", false);
}

#[test]
fn a_failed_cloud_hypervisor_migration_rolls_back_to_the_source() {
    run("chfail", true);
}

/// `rdmamig-vmm receive-migration` as a workflow's destination line, in ch-remote's words:
/// the option list reaches `vm.receive-migration`; a VM a failed receive left `Created` is
/// deleted first; the receiver's failure is the command's, with its chain; a key rdmamig
/// does not pass on is refused before any request.
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
        bodies(&api, "/vm.receive-migration"),
        [json!({"receiver_url": "tcp:127.0.0.1:6000", "tls_dir": "/etc/vm1/tls-server"})]
    );

    fail.store(true, Ordering::Release);
    let (code, text) = receive("receiver_url=tcp:127.0.0.1:6000");
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("failed to fill whole buffer"), "{text}");

    let before = api.recorded().len();
    let (code, text) = receive("receiver_url=tcp:127.0.0.1:6000,vfio_fds=[vfio0@5]");
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("vfio_fds is not supported yet"), "{text}");
    assert_eq!(
        api.recorded().len(),
        before,
        "a refused option list reached the VMM"
    );
}

fn run(name: &str, fail_migration: bool) {
    let bed = Testbed::builder(name)
        .guest_binaries(GuestBinaries::Required)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    if let Err(e) = scenario(&bed, fail_migration) {
        panic!("{}", error_chain(&*e));
    }
}

/// One move; with `fail_migration` the source's migration fails (event monitor:
/// `migration-failed`, the receiver answers 500) and the move must roll back.
fn scenario(bed: &Testbed, fail_migration: bool) -> Result<(), Box<dyn std::error::Error>> {
    let mut spec = bed.guest_spec("vm")?;
    spec.vsock_cid = Some(3);
    let guest = bed.start_guest(spec)?;
    // The agent listens on vsock once the guest is up; the move's prepare pings it.
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    let world: Shared = Arc::default();
    {
        let mut state = world.0.lock().unwrap();
        state.source_devices.insert("vf0".into());
        state.fail_migration = fail_migration;
    }
    let events = bed.dir().join("ch-events.json");
    std::fs::write(&events, "")?;
    let source = source_api(world.clone(), events.clone());
    let destination = destination_api(world.clone());
    let daemon = Daemon::start(bed.dir())?;
    let report = bed.dir().join("ch-move.json");
    let vsock = guest.vsock_socket();

    // The successful move is asked for in ch-remote's own words, with TLS for the stream
    // (folders the stand-ins only see named); the failing one with the wrapper's flags.
    let migration: &[&str] = if fail_migration {
        &[
            "migrate",
            "tcp:127.0.0.1:6000",
            "--downtime-ms",
            "250",
            "--migration-timeout-s",
            "30",
        ]
    } else {
        &[
            "send-migration",
            "destination_url=tcp:127.0.0.1:6000,downtime_ms=250,timeout_s=30,connections=2,\
             tls_dir=/etc/vm1/tls-client",
            "--to-tls-dir",
            "/etc/vm1/tls-server",
        ]
    };
    let output = Command::new(bin_dir().join("rdmamig-vmm"))
        .arg("--api-socket")
        .arg(source.socket())
        .arg("--vsock")
        .arg(&vsock)
        .arg("--event-monitor")
        .arg(&events)
        .args(migration)
        .arg("--to-api-socket")
        .arg(destination.socket())
        .arg("--to-vsock")
        .arg(&vsock)
        .args(["--vm", "vm", "--detach", "vf0"])
        .args(["--attach", "driver=vfio-pci,host=0000:5e:02.3,id=vf1"])
        .arg("--socket")
        .arg(daemon.socket())
        .arg("--report")
        .arg(&report)
        .output()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    eprintln!("rdmamig-vmm migrate:\n{text}");

    // Every request of the move, on both ends, is one the spec defines, with a body its
    // schema accepts.
    check_against_spec(&source.recorded());
    check_against_spec(&destination.recorded());
    let report_path = report;
    if fail_migration {
        return check_rolled_back(&output, &text, &report_path, &source, &destination, &world);
    }
    assert_eq!(output.status.code(), Some(0), "the move failed:\n{text}");
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path)?)?;
    assert_eq!(report["ok"], true, "{report:#}");
    assert_eq!(report["final_phase"], "done");
    assert_eq!(report["plan"]["source"]["vmm"], "cloud_hypervisor");
    assert_eq!(report["plan"]["destination"]["vmm"], "cloud_hypervisor");
    let phases = report["timeline"]["phases"].as_array().unwrap();
    let prepare = &phases[0]["details"];
    assert!(
        prepare["agent_version"].is_string(),
        "the real agent answered over vsock: {prepare}"
    );
    eprintln!(
        "phases: {}",
        phases
            .iter()
            .map(|p| format!(
                "{} {} ms",
                p["phase"].as_str().unwrap_or("?"),
                p["duration_ms"]
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // What each VMM was asked, in the API's own words.
    assert_eq!(bodies(&source, "/vm.remove-device"), [json!({"id": "vf0"})]);
    assert_eq!(
        bodies(&source, "/vm.send-migration"),
        [
            json!({"destination_url": "tcp:127.0.0.1:6000", "local": false,
            "downtime_ms": 250, "timeout_s": 30, "timeout_strategy": "Cancel",
            "connections": 2, "tls_dir": "/etc/vm1/tls-client"})
        ]
    );
    assert_eq!(
        bodies(&destination, "/vm.receive-migration"),
        [json!({"receiver_url": "tcp:127.0.0.1:6000", "tls_dir": "/etc/vm1/tls-server"})]
    );
    assert_eq!(
        bodies(&destination, "/vm.add-device"),
        [json!({"path": "/sys/bus/pci/devices/0000:5e:02.3", "id": "vf1"})]
    );
    let state = world.0.lock().unwrap();
    assert!(state.migrated);
    assert!(state.source_devices.is_empty());
    assert_eq!(
        state.destination_devices,
        BTreeSet::from(["vf1".to_string()])
    );
    Ok(())
}

/// The failed migration rolled the move back: exit 4, the VM on the source with a device
/// plugged back, nothing plugged on the destination, the connections resumed by the agent.
fn check_rolled_back(
    output: &std::process::Output,
    text: &str,
    report: &Path,
    source: &FakeCh,
    destination: &FakeCh,
    world: &Shared,
) -> Result<(), Box<dyn std::error::Error>> {
    assert_eq!(output.status.code(), Some(4), "not rolled back:\n{text}");
    let report: Value = serde_json::from_slice(&std::fs::read(report)?)?;
    assert_eq!(report["final_phase"], "rolled_back", "{report:#}");
    assert_eq!(report["failed_phase"], "migrate");
    assert_eq!(report["vm_location"], "source");
    let error = report["error"].as_str().unwrap_or_default();
    assert!(error.contains("migration failed"), "{error}");
    let rollback = report["timeline"]["phases"]
        .as_array()
        .and_then(|p| p.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(rollback["phase"], "rollback", "{rollback:#}");
    let steps = rollback["details"]["steps"].to_string();
    assert!(
        steps.contains("migration over without completing"),
        "{steps}"
    );
    assert!(steps.contains("re-attached on the source"), "{steps}");
    assert!(steps.contains("resumed on the source"), "{steps}");
    assert_eq!(bodies(destination, "/vm.add-device"), Vec::<Value>::new());
    assert_eq!(
        bodies(source, "/vm.add-device"),
        [json!({"path": "/sys/bus/pci/devices/0000:5e:02.3", "id": "vf1"})]
    );
    let state = world.0.lock().unwrap();
    assert!(!state.migrated && state.failed);
    assert_eq!(state.source_devices, BTreeSet::from(["vf1".to_string()]));
    assert!(state.destination_devices.is_empty());
    Ok(())
}
