//! A Cloud Hypervisor API over a real QEMU test-bed guest: the stand-in for a Cloud
//! Hypervisor that cannot run here (no usable KVM), with a VM that really moves.
//!
//! One [`ChFacade`] plays one Cloud Hypervisor process: an API socket (the spec-checked,
//! recording server of [`crate::ch_spec`]), an event monitor file and a log file. It answers
//! as a real Cloud Hypervisor does (the spec's schemas, and where the spec is wrong or silent,
//! ../shared/cloud-hypervisor/NOTES.md) and performs each request on its QEMU guest through
//! QMP:
//! - `vm.info`: the guest's run state and its devices (QOM's peripherals); 404 while the
//!   facade holds no VM (a destination before its receive, a source after its send);
//! - `vm.pause` / `vm.resume`: `stop` / `cont`; a refused transition is a 500 with the chain;
//! - `vm.remove-device`: `device_del`, answered once the guest was asked (it ejects later);
//! - `vm.add-device` of a VFIO path: the test bed's stand-in for a VF, the guest's emulated
//!   RDMA NIC on its own root port (netdev `nd0`, the guest's MAC);
//! - `vm.send-migration`: answered at once; `migrate` runs behind it and the outcome is in
//!   the event monitor (`migration-finished`, or `migration-failed` with the cause in the
//!   log file only);
//! - `vm.receive-migration`: `migrate-incoming`, answered when the VM has arrived (204) or
//!   the receive failed (500 with the chain; the VM then shows `Created`).
//!
//! The agent's hybrid vsock is the guest's vhost-device-vsock. QEMU 10.0 cannot migrate a
//! vhost-user-vsock device, so the sending facade unplugs it before `migrate` (and plugs it
//! back if the migration fails) and the receiving one plugs its own before answering: what a
//! real Cloud Hypervisor does inside its migration, where the vsock device moves and its host
//! socket is then the destination's.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use rdmamig_vmm::ch_api::Endpoint;
use rdmamig_vmm::cloud_hypervisor::DEFAULT_AGENT_PORT;
use serde_json::{json, Value};

use crate::ch_spec::{append_event, refusal, response_schema, spec_body, successful, validate};
use crate::ch_spec::{vm_info, FakeCh, Recorded};
use crate::guest::{vsock_device_args, VSOCK_CHARDEV, VSOCK_DEVICE};
use crate::{Guest, Qmp, QmpError};

/// How long a QMP connection may take.
const QMP_CONNECT: Duration = Duration::from_secs(10);
/// How often a migration's state is asked.
const POLL: Duration = Duration::from_millis(20);
/// The longest a receive waits for the VM (Cloud Hypervisor's own is an hour).
const RECEIVE_WAIT: Duration = Duration::from_secs(180);
/// The longest the guest may take to eject the vsock device, or its agent to answer on a
/// plugged one.
const VSOCK_WAIT: Duration = Duration::from_secs(20);

/// What the facade drives: one QEMU guest, by its sockets.
#[derive(Debug, Clone)]
struct Target {
    name: String,
    qmp_socket: PathBuf,
    /// vhost-device-vsock's vhost-user socket (the chardev's other end).
    vhost_socket: PathBuf,
    /// The hybrid vsock socket the host reaches the agent through.
    vsock_socket: PathBuf,
    /// `device_add` arguments of the VF stand-in, without its id.
    nic: Value,
}

/// Whether the facade holds the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holding {
    /// No VM: a destination before its receive, a source after its send (404).
    Nothing,
    /// A failed receive left a VM that never ran (NOTES.md: `Created`).
    Created,
    /// The VM runs here (or is paused).
    Vm,
}

/// The facade's mutable side, behind one lock: every QMP exchange goes through it, one at a
/// time (QEMU serves one QMP client per socket).
struct State {
    target: Target,
    holding: Holding,
    qmp: Option<Qmp>,
    /// The facade is gone: a receive still waiting ends (the test's runtime waits for it).
    closed: bool,
}

impl State {
    /// The QMP session, opened on first use.
    fn qmp(&mut self) -> Result<&mut Qmp, QmpError> {
        if self.qmp.is_none() {
            self.qmp = Some(Qmp::connect(&self.target.qmp_socket, QMP_CONNECT)?);
        }
        Ok(self.qmp.as_mut().expect("just opened"))
    }

    /// Runs one QMP command; a broken session is dropped (the next command reconnects).
    fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let result = self.qmp().and_then(|q| q.execute(command, arguments));
        if matches!(
            result,
            Err(QmpError::Io { .. } | QmpError::Closed { .. } | QmpError::Timeout { .. })
        ) {
            self.qmp = None;
        }
        result
    }

    /// The ids of the guest's devices (QOM's peripherals, root ports left out).
    fn devices(&mut self) -> Result<Vec<String>, QmpError> {
        let listed = self.execute("qom-list", json!({"path": "/machine/peripheral"}))?;
        Ok(listed
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| {
                let kind = p["type"].as_str().unwrap_or_default();
                kind.starts_with("child<") && !kind.contains("root-port")
            })
            .filter_map(|p| p["name"].as_str().map(str::to_owned))
            .collect())
    }

    /// `running` or `paused` (every state that is not running shows as paused).
    fn running(&mut self) -> Result<bool, QmpError> {
        Ok(self.execute("query-status", Value::Null)?["status"] == "running")
    }
}

/// One Cloud Hypervisor process played over one QEMU guest.
pub struct ChFacade {
    api: FakeCh,
    state: Arc<Mutex<State>>,
    files: Files,
    _dir: tempfile::TempDir,
}

impl ChFacade {
    /// A facade over a guest that runs the VM (a source).
    pub fn running(guest: &Guest) -> ChFacade {
        ChFacade::start(guest, Holding::Vm)
    }

    /// A facade over an `-incoming defer` guest, holding no VM until a receive.
    pub fn receiving(guest: &Guest) -> ChFacade {
        ChFacade::start(guest, Holding::Nothing)
    }

    fn start(guest: &Guest, holding: Holding) -> ChFacade {
        let spec = guest.spec();
        let target = Target {
            name: spec.name.clone(),
            qmp_socket: guest.qmp_socket(),
            vhost_socket: guest.vhost_vsock_socket(),
            vsock_socket: guest.vsock_socket(),
            nic: json!({
                "driver": spec.rdma_nic.qemu_driver(),
                "netdev": "nd0",
                "mac": spec.mac,
                "bus": "rp1",
                "romfile": "",
            }),
        };
        let state = Arc::new(Mutex::new(State {
            target,
            holding,
            qmp: None,
            closed: false,
        }));
        let dir = tempfile::tempdir().expect("a directory for the facade's files");
        let files = Files {
            events: dir.path().join("events.json"),
            log: dir.path().join("cloud-hypervisor.log"),
        };
        std::fs::write(&files.events, "").expect("the event file is created");
        std::fs::write(&files.log, "").expect("the log is created");
        let api = {
            let state = state.clone();
            let files = files.clone();
            FakeCh::start(move |path, body| answer(&state, &files, path, body))
        };
        ChFacade {
            api,
            state,
            files,
            _dir: dir,
        }
    }

    /// The API socket (`--api-socket`).
    pub fn socket(&self) -> PathBuf {
        self.api.socket()
    }

    /// The event monitor file (`--event-monitor path=`).
    pub fn events(&self) -> &Path {
        &self.files.events
    }

    /// The log file (`--log-file`).
    pub fn log_file(&self) -> &Path {
        &self.files.log
    }

    /// Every request so far.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.api.recorded()
    }

    /// Whether the facade holds the VM now.
    pub fn holds_vm(&self) -> bool {
        self.lock().holding == Holding::Vm
    }

    /// The guest's device ids now.
    pub fn devices(&self) -> Result<Vec<String>, QmpError> {
        self.lock().devices()
    }

    /// Runs a QMP command on the guest through the facade's session (QEMU serves one
    /// client per QMP socket): a test's own knob, e.g. a bandwidth limit.
    pub fn qmp(&self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        self.lock().execute(command, arguments)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for ChFacade {
    fn drop(&mut self) {
        self.lock().closed = true;
    }
}

/// The files a Cloud Hypervisor process writes besides its API socket.
#[derive(Debug, Clone)]
struct Files {
    events: PathBuf,
    log: PathBuf,
}

type Answer = (u16, Vec<u8>);

/// Answers one request (the path under /api/v1), as Cloud Hypervisor does.
fn answer(state: &Arc<Mutex<State>>, files: &Files, path: &str, body: Option<&Value>) -> Answer {
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    let result = match path {
        "/vm.info" => info(&mut lock()),
        "/vm.pause" => transition(&mut lock(), false),
        "/vm.resume" => transition(&mut lock(), true),
        "/vm.remove-device" => remove_device(&mut lock(), body),
        "/vm.add-device" => add_device(&mut lock(), body),
        "/vm.send-migration" => send_migration(state, files, body),
        "/vm.receive-migration" => receive_migration(state, files, body),
        "/vm.delete" => {
            let mut state = lock();
            if state.holding == Holding::Created {
                state.holding = Holding::Nothing;
            }
            Ok(successful(path, body))
        }
        _ => Ok(successful(path, body)),
    };
    result.unwrap_or_else(|e| {
        refusal(&[
            "Error from API",
            "The facade's QEMU failed",
            &crate::error_chain(&e),
        ])
    })
}

/// Refused because no VM is here, as Cloud Hypervisor words it.
fn no_vm() -> Answer {
    refusal(&["Error from API", "VM is not running"])
}

fn info(state: &mut State) -> Result<Answer, QmpError> {
    match state.holding {
        Holding::Nothing => Ok((404, spec_body(Endpoint::VmInfo, 404))),
        Holding::Created => Ok((200, vm_info("Created", &[]))),
        Holding::Vm => {
            let phase = if state.running()? {
                "Running"
            } else {
                "Paused"
            };
            let devices = state.devices()?;
            let ids: Vec<&str> = devices.iter().map(String::as_str).collect();
            Ok((200, vm_info(phase, &ids)))
        }
    }
}

/// `vm.pause` (`resume == false`) or `vm.resume`.
fn transition(state: &mut State, resume: bool) -> Result<Answer, QmpError> {
    if state.holding != Holding::Vm {
        return Ok(no_vm());
    }
    let running = state.running()?;
    if running == resume {
        let now = if running { "Running" } else { "Paused" };
        return Ok(refusal(&[
            "Error from API",
            if resume {
                "The VM could not be resumed"
            } else {
                "The VM could not be paused"
            },
            &format!("InvalidStateTransition({now}, {now})"),
        ]));
    }
    state.execute(if resume { "cont" } else { "stop" }, Value::Null)?;
    Ok((204, Vec::new()))
}

fn body_str<'a>(body: Option<&'a Value>, key: &str) -> Option<&'a str> {
    body.and_then(|b| b[key].as_str())
}

fn remove_device(state: &mut State, body: Option<&Value>) -> Result<Answer, QmpError> {
    if state.holding != Holding::Vm {
        return Ok(no_vm());
    }
    let id = body_str(body, "id").unwrap_or_default();
    if !state.devices()?.iter().any(|d| d == id) {
        return Ok(refusal_404(&[
            "Error from API",
            "The device could not be removed from the VM",
            "Error from device manager",
            &format!("Failed to find device corresponding to the given identifier: {id}"),
        ]));
    }
    state.execute("device_del", json!({"id": id}))?;
    Ok((204, Vec::new()))
}

/// A 404 with the chain (`vm.remove-device` of an unknown id, NOTES.md).
fn refusal_404(chain: &[&str]) -> Answer {
    (404, serde_json::to_vec(chain).expect("strings serialise"))
}

fn add_device(state: &mut State, body: Option<&Value>) -> Result<Answer, QmpError> {
    if state.holding != Holding::Vm {
        return Ok(no_vm());
    }
    let (Some(path), Some(id)) = (body_str(body, "path"), body_str(body, "id")) else {
        return Ok(refusal(&[
            "Error from API",
            "The facade plugs VFIO paths with an id only",
        ]));
    };
    if !path.starts_with("/sys/bus/pci/devices/") {
        return Ok(refusal(&[
            "Error from API",
            "The new device could not be added to the VM",
            "Cannot create a VFIO device",
            &format!("{path} is not a PCI device"),
        ]));
    }
    let mut arguments = state.target.nic.clone();
    arguments["id"] = json!(id);
    state.execute("device_add", arguments)?;
    let bdf = bdf_of(&state.execute("query-pci", Value::Null)?, id)
        .unwrap_or_else(|| "0000:00:00.0".into());
    let added = json!({"id": id, "bdf": bdf});
    validate(
        response_schema(Endpoint::VmAddDevice, 200).expect("PciDeviceInfo"),
        &added,
        "PciDeviceInfo",
    )
    .expect("the facade answers what the spec allows");
    Ok((200, serde_json::to_vec(&added).expect("json")))
}

/// The PCI address of the device with QEMU id `id` in `query-pci`'s answer.
fn bdf_of(buses: &Value, id: &str) -> Option<String> {
    fn walk(devices: &Value, id: &str) -> Option<String> {
        for device in devices.as_array()? {
            if device["qdev_id"] == id {
                return Some(format!(
                    "0000:{:02x}:{:02x}.{}",
                    device["bus"].as_u64()?,
                    device["slot"].as_u64()?,
                    device["function"].as_u64()?
                ));
            }
            if let Some(found) = walk(&device["pci_bridge"]["devices"], id) {
                return Some(found);
            }
        }
        None
    }
    buses
        .as_array()?
        .iter()
        .find_map(|bus| walk(&bus["devices"], id))
}

/// A migration URL Cloud Hypervisor takes (`unix:PATH`, `tcp:HOST:PORT`), which is also
/// QEMU's syntax.
fn migration_url(url: &str) -> bool {
    url.starts_with("unix:") || url.starts_with("tcp:")
}

fn send_migration(
    state: &Arc<Mutex<State>>,
    files: &Files,
    body: Option<&Value>,
) -> Result<Answer, QmpError> {
    let mut locked = state.lock().unwrap_or_else(|e| e.into_inner());
    if locked.holding != Holding::Vm {
        return Ok(refusal(&["Error from API", "VM is not running"]));
    }
    let url = body_str(body, "destination_url")
        .unwrap_or_default()
        .to_owned();
    if !migration_url(&url) || body.is_some_and(|b| b["local"] == true) {
        return Ok(refusal(&[
            "Error from API",
            "Error sending migration",
            &format!("the facade migrates to unix: or tcp: URLs, not local ones ({url:?})"),
        ]));
    }
    let downtime_ms = body.and_then(|b| b["downtime_ms"].as_u64()).unwrap_or(300);
    locked.execute(
        "migrate-set-parameters",
        json!({"downtime-limit": downtime_ms}),
    )?;
    drop(locked);
    // Answered at once; the migration runs behind it (NOTES.md).
    let state = state.clone();
    let files = files.clone();
    thread::spawn(move || {
        append_event(&files.events, "migration-started");
        match migrate(&state, &url) {
            Ok(()) => {
                state.lock().unwrap_or_else(|e| e.into_inner()).holding = Holding::Nothing;
                append_event(&files.events, "migration-finished");
            }
            Err(cause) => {
                log(&files.log, &format!("Migration failed: {cause}"));
                let mut locked = state.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = plug_vsock(&mut locked) {
                    log(&files.log, &format!("vsock not plugged back: {e}"));
                }
                drop(locked);
                for event in ["migration-failed", "resuming", "resumed"] {
                    append_event(&files.events, event);
                }
            }
        }
    });
    Ok((204, Vec::new()))
}

/// Unplugs the vsock device and migrates the guest to `url`; the error is QEMU's cause.
fn migrate(state: &Mutex<State>, url: &str) -> Result<(), String> {
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    unplug_vsock(state)?;
    lock()
        .execute("migrate", json!({"uri": url}))
        .map_err(|e| crate::error_chain(&e))?;
    loop {
        let info = lock()
            .execute("query-migrate", Value::Null)
            .map_err(|e| crate::error_chain(&e))?;
        match info["status"].as_str().unwrap_or_default() {
            "completed" => return Ok(()),
            "failed" | "cancelled" => {
                return Err(info["error-desc"]
                    .as_str()
                    .unwrap_or("migration failed")
                    .to_owned())
            }
            _ => thread::sleep(POLL),
        }
    }
}

/// Asks the guest to eject the vsock device and waits until it has.
fn unplug_vsock(state: &Mutex<State>) -> Result<(), String> {
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    lock()
        .execute("device_del", json!({"id": VSOCK_DEVICE}))
        .map_err(|e| crate::error_chain(&e))?;
    let end = Instant::now() + VSOCK_WAIT;
    loop {
        let devices = lock().devices().map_err(|e| crate::error_chain(&e))?;
        if !devices.iter().any(|d| d == VSOCK_DEVICE) {
            return Ok(());
        }
        if Instant::now() >= end {
            return Err(format!(
                "the guest did not eject {VSOCK_DEVICE} within {VSOCK_WAIT:?}"
            ));
        }
        thread::sleep(POLL);
    }
}

/// Plugs the vsock device (its chardev connected anew: the old connection's vhost-user
/// session ended with the old device) and waits until the agent answers through it.
fn plug_vsock(state: &mut State) -> Result<(), String> {
    let qmp_error = |e: QmpError| crate::error_chain(&e);
    state
        .execute("chardev-remove", json!({"id": VSOCK_CHARDEV}))
        .map_err(qmp_error)?;
    // vhost-device-vsock serves the next frontend from a new socket once the last one
    // left: until it is there, the chardev cannot connect.
    let path = state.target.vhost_socket.display().to_string();
    let end = Instant::now() + VSOCK_WAIT;
    loop {
        let added = state.execute(
            "chardev-add",
            json!({"id": VSOCK_CHARDEV, "backend": {"type": "socket", "data": {
                "addr": {"type": "unix", "data": {"path": path}}, "server": false}}}),
        );
        match added {
            Ok(_) => break,
            Err(QmpError::Command { .. }) if Instant::now() < end => {
                thread::sleep(POLL);
            }
            Err(e) => return Err(qmp_error(e)),
        }
    }
    state
        .execute("device_add", vsock_device_args())
        .map_err(qmp_error)?;
    let end = Instant::now() + VSOCK_WAIT;
    loop {
        match agent_answers(&state.target.vsock_socket) {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= end => {
                return Err(format!(
                    "the agent of {} did not answer on vsock within {VSOCK_WAIT:?}: {e}",
                    state.target.name
                ))
            }
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// One hybrid vsock handshake with the agent's port (`CONNECT` / `OK`), then closed.
fn agent_answers(socket: &Path) -> std::io::Result<()> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(format!("CONNECT {DEFAULT_AGENT_PORT}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    if line.starts_with("OK ") {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("answered {line:?}")))
    }
}

fn receive_migration(
    state: &Arc<Mutex<State>>,
    files: &Files,
    body: Option<&Value>,
) -> Result<Answer, QmpError> {
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    if lock().holding == Holding::Vm {
        return Ok(refusal(&[
            "Error from API",
            "Error receiving migration",
            "a VM is already running",
        ]));
    }
    let url = body_str(body, "receiver_url").unwrap_or_default();
    if !migration_url(url) {
        return Ok(refusal(&[
            "Error from API",
            "Error receiving migration",
            &format!("the facade receives on unix: or tcp: URLs ({url:?})"),
        ]));
    }
    append_event(&files.events, "migration-receive-ready");
    lock().execute("migrate-incoming", json!({"uri": url}))?;
    let failed = |cause: String| {
        log(&files.log, &format!("Migration receive failed: {cause}"));
        append_event(&files.events, "migration-receive-failed");
        lock().holding = Holding::Created;
        refusal(&["Error from API", "Error receiving migration", &cause])
    };
    // QEMU runs the guest once it has arrived, and exits if the load fails.
    let end = Instant::now() + RECEIVE_WAIT;
    loop {
        // Bound first: the guard must be gone before `failed` takes the lock again.
        let running = lock().running();
        if lock().closed {
            return Ok(failed("the VMM is shutting down".into()));
        }
        match running {
            Ok(true) => break,
            Ok(false) if Instant::now() < end => thread::sleep(POLL),
            Ok(false) => return Ok(failed(format!("no VM within {RECEIVE_WAIT:?}"))),
            Err(e) => return Ok(failed(crate::error_chain(&e))),
        }
    }
    let mut locked = lock();
    if let Err(cause) = plug_vsock(&mut locked) {
        drop(locked);
        return Ok(failed(cause));
    }
    locked.holding = Holding::Vm;
    drop(locked);
    append_event(&files.events, "migration-receive-finished");
    Ok((204, Vec::new()))
}

/// Appends a line to the facade's log, as Cloud Hypervisor's `--log-file`.
fn log(path: &Path, line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .expect("the log opens");
    writeln!(file, "cloud-hypervisor: <vmm> ERROR:vmm/src/lib.rs: {line}").expect("logged");
}
