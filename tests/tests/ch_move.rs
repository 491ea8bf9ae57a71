//! A whole coordinated move with Cloud Hypervisor endpoints, run as an operator runs it: the
//! one wrapper command `rdmamig-vmm --api-socket ... migrate <destination_url> ...` in place
//! of `ch-remote send-migration`, through `rdmamig migrate` and the daemon's mover.
//!
//! A real Cloud Hypervisor cannot run here (no usable KVM), so both VMM APIs are the
//! spec-checked stand-ins of `rdmamig_testbed::ch_spec`: every request the move makes, on
//! both ends, is checked against Cloud Hypervisor's OpenAPI description, and a path the spec
//! lacks fails the test. The stand-ins play the two VMMs' sides of a migration the way
//! NOTES.md describes a real one: the source answers `vm.send-migration` with 204 at once,
//! writes `migration-started` / `migration-finished` to its event monitor and loses the VM
//! (404); the destination's `vm.receive-migration` stays open until then and answers 204,
//! after which its `vm.info` shows the VM. The guest agent is real: the test-bed guest's
//! agent, reached over real hybrid vsock (vhost-device-vsock, which speaks Cloud
//! Hypervisor's `CONNECT` protocol), from both ends' endpoints.
//!
//! Needs root, /dev/net/tun, qemu-system-x86_64, vhost-device-vsock and the workspace's
//! binaries (scripts/setup.sh); fails (never skips) without them.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rdmamig_testbed::ch_spec::{
    check_against_spec, response_schema, spec_body, successful, validate, vm_info, FakeCh,
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
                // Answered at once; the outcome is in the event monitor (NOTES.md).
                for event in ["migration-started", "migration-finished"] {
                    write_event(&events, event);
                }
                state.migrated = true;
                arrived.notify_all();
                (204, Vec::new())
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
                    .wait_timeout_while(state, RECEIVE_WAIT, |s| !s.migrated)
                    .unwrap();
                if state.migrated {
                    (204, Vec::new())
                } else {
                    (500, spec_body(Endpoint::VmReceiveMigration, 500))
                }
            }
            "/vm.add-device" => {
                let id = body_id(body);
                lock.lock().unwrap().destination_devices.insert(id.clone());
                let added = json!({"id": id, "bdf": "0000:00:05.0"});
                validate(
                    response_schema(Endpoint::VmAddDevice, 200).expect("PciDeviceInfo"),
                    &added,
                    "PciDeviceInfo",
                )
                .expect("the stand-in answers what the spec allows");
                (200, serde_json::to_vec(&added).unwrap())
            }
            _ => successful(path, body),
        }
    })
}

/// Appends one event as Cloud Hypervisor's event monitor writes it (pretty-printed JSON).
fn write_event(path: &Path, event: &str) {
    let text = serde_json::to_string_pretty(&json!({
        "timestamp": {"secs": 1, "nanos": 0}, "source": "vm", "event": event, "properties": null
    }))
    .unwrap();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    std::io::Write::write_all(&mut file, text.as_bytes()).unwrap();
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
    let bed = Testbed::builder("chmove")
        .guest_binaries(GuestBinaries::Required)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    if let Err(e) = scenario(&bed) {
        panic!("{}", error_chain(&*e));
    }
}

fn scenario(bed: &Testbed) -> Result<(), Box<dyn std::error::Error>> {
    let mut spec = bed.guest_spec("vm")?;
    spec.vsock_cid = Some(3);
    let guest = bed.start_guest(spec)?;
    // The agent listens on vsock once the guest is up; the move's prepare pings it.
    let runtime = tokio::runtime::Runtime::new()?;
    let _entered = runtime.enter();
    let world: Shared = Arc::default();
    world.0.lock().unwrap().source_devices.insert("vf0".into());
    let events = bed.dir().join("ch-events.json");
    std::fs::write(&events, "")?;
    let source = source_api(world.clone(), events.clone());
    let destination = destination_api(world.clone());
    let daemon = Daemon::start(bed.dir())?;
    let report = bed.dir().join("ch-move.json");
    let vsock = guest.vsock_socket();

    let output = Command::new(bin_dir().join("rdmamig-vmm"))
        .arg("--api-socket")
        .arg(source.socket())
        .arg("--vsock")
        .arg(&vsock)
        .arg("--event-monitor")
        .arg(&events)
        .args(["migrate", "tcp:127.0.0.1:6000"])
        .args(["--downtime-ms", "250", "--migration-timeout-s", "30"])
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
        .arg("--rdmamig")
        .arg(bin_dir().join("rdmamig"))
        .output()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    eprintln!("rdmamig-vmm migrate:\n{text}");

    // Every request of the move, on both ends, is one the spec defines, with a body its
    // schema accepts.
    check_against_spec(&source.recorded());
    check_against_spec(&destination.recorded());
    assert_eq!(output.status.code(), Some(0), "the move failed:\n{text}");

    let report: Value = serde_json::from_slice(&std::fs::read(&report)?)?;
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
            "downtime_ms": 250, "timeout_s": 30, "timeout_strategy": "Cancel"})
        ]
    );
    assert_eq!(
        bodies(&destination, "/vm.receive-migration"),
        [json!({"receiver_url": "tcp:127.0.0.1:6000"})]
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
