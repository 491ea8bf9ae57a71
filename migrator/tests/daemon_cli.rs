//! `rdmamig daemon` and `rdmamig migrate` end to end against real QEMU processes (TCG, no
//! guest kernel: SeaBIOS runs and finds nothing to boot).
//!
//! Without a guest, the `naive` strategy runs all the way when the detached device is one
//! QEMU unplugs on its own (a USB keyboard); a PCIe NIC is never released without a guest,
//! which is how a guest that keeps the device busy looks from the host. The `reconnect`
//! strategy needs the guest agent; here it can only show that a silent agent fails the move
//! at prepare, before anything was unplugged. The full `reconnect` move with a booted guest
//! runs on the test bed (tests/).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

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
    "-device",
    "virtio-serial-pci,id=vser0",
];

/// A child process killed on drop.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_file(path: &Path) {
    let end = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(Instant::now() < end, "{} did not appear", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the UNIX socket `path` takes a connection: its file exists from bind(),
/// before its owner listens.
fn wait_for_listener(path: &Path) {
    let end = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        assert!(
            Instant::now() < end,
            "{} took no connection",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One VM's QEMU process with its sockets in `dir/name/`.
struct Vm {
    dir: PathBuf,
    _process: Process,
}

impl Vm {
    fn start(root: &Path, name: &str, extra: &[&str]) -> Vm {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new("qemu-system-x86_64")
            .args(BASE)
            .arg("-qmp")
            .arg(format!(
                "unix:{},server=on,wait=off",
                dir.join("qmp.sock").display()
            ))
            .arg("-chardev")
            .arg(format!(
                "socket,id=ch0,path={},server=on,wait=off",
                dir.join("agent.sock").display()
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
            .expect("qemu-system-x86_64 runs");
        let vm = Vm {
            dir,
            _process: Process(child),
        };
        wait_for_listener(&vm.qmp());
        vm
    }

    fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }

    fn agent(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }
}

/// A daemon, a source VM and a destination VM in one temporary directory.
struct Bed {
    dir: tempfile::TempDir,
    socket: PathBuf,
    daemon: Process,
    source: Vm,
    destination: Vm,
}

/// A metrics port for the daemon in `dir`, distinct between the tests of one run, and below
/// Linux's ephemeral ports (32768 on): the flood test's hundreds of client connections take
/// ports there, and a daemon must not find its own taken.
fn metrics_port(dir: &Path) -> u16 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    dir.hash(&mut hasher);
    std::process::id().hash(&mut hasher);
    20_000 + u16::try_from(hasher.finish() % 12_000).unwrap()
}

/// GET /metrics from the daemon in `dir`.
fn scrape(dir: &Path) -> String {
    http(dir, "GET /metrics")
}

/// The whole answer of the daemon's metrics port in `dir` to `request` (`METHOD /path`).
fn http(dir: &Path, request: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", metrics_port(dir))).unwrap();
    write!(stream, "{request} HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// Starts `rdmamig daemon` with its socket and state in `dir`, appending to `dir/daemon.log`;
/// `crash_at` makes it abort once it has journaled that phase.
fn start_daemon(dir: &Path, crash_at: Option<&str>) -> Process {
    let mut command = daemon_command(dir, crash_at);
    let daemon = Process(command.spawn().unwrap());
    wait_for_file(&dir.join("rdmamig.sock"));
    daemon
}

/// The `rdmamig daemon` command [`start_daemon`] runs.
fn daemon_command(dir: &Path, crash_at: Option<&str>) -> Command {
    let socket = dir.join("rdmamig.sock");
    // A killed daemon leaves its socket file; wait for the new one.
    let _ = std::fs::remove_file(&socket);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("daemon.log"))
        .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_rdmamig"));
    command
        .args(["daemon", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env_remove("RDMAMIG_CRASH_AT")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    if let Some(phase) = crash_at {
        command.env("RDMAMIG_CRASH_AT", phase);
    }
    command
        .arg("--metrics")
        .arg(format!("127.0.0.1:{}", metrics_port(dir)));
    let config = dir.join("rdmamig.toml");
    if config.exists() {
        command.arg("--config").arg(config);
    }
    command
}

impl Bed {
    fn start(source_extra: &[&str]) -> Bed {
        Bed::start_crashing(source_extra, None)
    }

    fn start_crashing(source_extra: &[&str], crash_at: Option<&str>) -> Bed {
        Bed::start_full(source_extra, crash_at, None)
    }

    /// `config`: the daemon's config file's text.
    fn start_full(source_extra: &[&str], crash_at: Option<&str>, config: Option<&str>) -> Bed {
        let dir = tempfile::tempdir().unwrap();
        if let Some(config) = config {
            std::fs::write(dir.path().join("rdmamig.toml"), config).unwrap();
        }
        let socket = dir.path().join("rdmamig.sock");
        let source = Vm::start(dir.path(), "src", source_extra);
        let destination = Vm::start(dir.path(), "dst", &["-incoming", "defer"]);
        let daemon = start_daemon(dir.path(), crash_at);
        Bed {
            dir,
            socket,
            daemon,
            source,
            destination,
        }
    }

    /// `rdmamig <args> --socket <bed's> --json`, parsed.
    fn query(&self, args: &[&str]) -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_rdmamig"))
            .args(args)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--json")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "rdmamig {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn report_path(&self) -> PathBuf {
        self.dir.path().join("report.json")
    }

    /// `rdmamig migrate` with the bed's sockets plus `args`.
    fn migrate(&self, detach: &str, args: &[&str]) -> Output {
        let output = Command::new(env!("CARGO_BIN_EXE_rdmamig"))
            .arg("migrate")
            .arg("--socket")
            .arg(&self.socket)
            .args(["--vm", "vm1", "--qmp"])
            .arg(self.source.qmp())
            .arg("--agent")
            .arg(self.source.agent())
            .args(["--detach", detach, "--to-qmp"])
            .arg(self.destination.qmp())
            .arg("--to-agent")
            .arg(self.destination.agent())
            .args([
                "--attach",
                "driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1,mac=52:54:00:77:00:21",
            ])
            .arg("--via")
            .arg(format!(
                "unix:{}",
                self.dir.path().join("mig.sock").display()
            ))
            .arg("--report")
            .arg(self.report_path())
            .args(args)
            .output()
            .unwrap();
        eprintln!(
            "stdout:\n{}\nstderr:\n{}\ndaemon log:\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
        );
        output
    }

    fn report(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.report_path()).unwrap()).unwrap()
    }
}

/// The ids of the devices a VM has (`qom-list /machine/peripheral`).
fn peripherals(qmp_socket: &Path) -> Vec<String> {
    let devices = qmp(
        qmp_socket,
        "qom-list",
        serde_json::json!({"path": "/machine/peripheral"}),
    );
    devices["return"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["name"].as_str().map(str::to_string))
        .collect()
}

/// One QMP command on a fresh connection (the daemon has let go of the monitor by then).
fn qmp(socket: &Path, command: &str, arguments: Value) -> Value {
    use std::io::{BufRead, BufReader, Write};
    let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let mut request = serde_json::json!({ "execute": command });
    if !arguments.is_null() {
        request["arguments"] = arguments;
    }
    for message in [serde_json::json!({"execute": "qmp_capabilities"}), request] {
        writeln!(writer, "{message}").unwrap();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            let answer: Value = serde_json::from_str(&line).unwrap();
            if answer.get("return").is_some() || answer.get("error").is_some() {
                if message["execute"] == command {
                    return answer;
                }
                break;
            }
        }
    }
    unreachable!("the loop returns the command's answer")
}

#[test]
fn naive_move_runs_every_phase_and_reports_the_timeline() {
    let bed = Bed::start(&["-device", "usb-kbd,id=kbd0,bus=xhci.0"]);
    let mode = std::fs::metadata(&bed.socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "daemon socket mode {mode:o}");

    let out = bed.migrate("kbd0", &["--strategy", "naive"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", out.status);
    for phase in [
        "prepare", "quiesce", "detach", "migrate", "attach", "resume",
    ] {
        assert!(stdout.contains(&format!("] {phase:<8} started")), "{phase}");
    }
    assert!(stdout.contains("quiesce  skipped: strategy naive"));
    assert!(stdout.contains("migrate  completed"));
    assert!(stdout.contains("  total "));
    assert!(stdout.contains(" done in "));
    assert!(stdout.contains("the VM is on the destination"));

    let report = bed.report();
    assert_eq!(report["ok"], true);
    assert_eq!(report["final_phase"], "done");
    assert_eq!(report["vm_location"], "destination");
    let phases = report["timeline"]["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 6);
    let migrate = &phases[3];
    assert_eq!(migrate["phase"], "migrate");
    assert!(migrate["details"]["downtime_ms"].is_u64());
    assert!(migrate["details"]["ram_transferred"].as_u64().unwrap() > 0);
    for pair in phases.windows(2) {
        assert!(pair[0]["ended_unix_ms"].as_u64() <= pair[1]["started_unix_ms"].as_u64());
    }
    eprintln!(
        "naive move: total {} ms; phases (ms): {:?}; QEMU migration total {} ms, downtime {} ms",
        report["timeline"]["total_ms"],
        phases
            .iter()
            .map(|p| (
                p["phase"].as_str().unwrap(),
                p["duration_ms"].as_u64().unwrap()
            ))
            .collect::<Vec<_>>(),
        report["migration"]["total_time_ms"],
        report["migration"]["downtime_ms"]
    );

    // The destination runs the VM with the new NIC.
    let status = qmp(&bed.destination.qmp(), "query-status", Value::Null);
    assert_eq!(status["return"]["status"], "running", "{status}");
    let kind = qmp(
        &bed.destination.qmp(),
        "qom-get",
        serde_json::json!({"path": "/machine/peripheral/nic1", "property": "type"}),
    );
    assert_eq!(kind["return"], "virtio-net-pci", "{kind}");
    let source = qmp(&bed.source.qmp(), "query-status", Value::Null);
    assert_eq!(source["return"]["status"], "postmigrate", "{source}");

    // The state it keeps names VMs, devices and hosts: the owner's only, whatever the umask.
    let moves = bed.dir.path().join("state/moves");
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&bed.dir.path().join("state")), 0o700);
    assert_eq!(mode(&moves), 0o700);
    for entry in std::fs::read_dir(&moves).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
    }
}

#[test]
fn a_device_the_guest_keeps_fails_detach_at_its_deadline() {
    let bed = Bed::start(&[
        "-device",
        "virtio-net-pci,id=nic0,netdev=nd0,bus=rp1,romfile=",
    ]);
    let svg = bed.dir.path().join("move.svg");
    let out = bed.migrate(
        "nic0",
        &[
            "--strategy",
            "naive",
            "--deadline",
            "detach=500",
            "--deadline",
            "rollback=1500",
            "--svg",
            svg.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "phase detach missed its deadline of 500 ms: the guest did not release device nic0"
        ),
        "{stderr}"
    );
    // This QEMU runs no guest, so the unplug it was asked for stays pending for good. A
    // device_del cannot be taken back: the rollback waits for the removal (its own bound),
    // plugs nothing beside the pending device, and ends failed, saying what will happen.
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let report = bed.report();
    assert_eq!(report["ok"], false);
    assert_eq!(report["final_phase"], "failed");
    assert_eq!(report["failed_phase"], "detach");
    assert_eq!(report["vm_location"], "source");
    assert_eq!(report["forced"][0]["phase"], "detach");
    let rollback_error = report["rollback_error"].as_str().unwrap();
    assert!(
        rollback_error.contains("has not finished removing device nic0 after"),
        "{rollback_error}"
    );
    let detach = &report["timeline"]["phases"][2];
    assert_eq!(detach["outcome"]["result"], "failed");
    let took = detach["duration_ms"].as_u64().unwrap();
    assert!((500..1500).contains(&took), "detach took {took} ms");
    let phases = report["timeline"]["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 4);
    assert_eq!(phases[3]["phase"], "rollback");
    assert_eq!(phases[3]["outcome"]["result"], "failed");
    let waited = phases[3]["duration_ms"].as_u64().unwrap();
    assert!((1500..4000).contains(&waited), "rollback took {waited} ms");
    let source = qmp(&bed.source.qmp(), "query-status", Value::Null);
    assert_eq!(source["return"]["status"], "running", "{source}");
    let names = peripherals(&bed.source.qmp());
    assert!(names.iter().any(|n| n == "nic0"), "{names:?}");
    // The daemon keeps the report: history lists it, report returns it.
    let history = bed.query(&["history"]);
    assert_eq!(history[0]["outcome"], "failed");
    let id = history[0]["id"].as_str().unwrap();
    assert_eq!(bed.query(&["report", id])["final_phase"], "failed");
    assert_eq!(bed.query(&["status"])["moves"], serde_json::json!([]));
    // The SVG timeline, from the CLI and kept by the daemon.
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(
        picture.starts_with("<svg") && picture.contains("rollback"),
        "{picture}"
    );
    let kept = bed.dir.path().join(format!("state/moves/{id}.svg"));
    assert_eq!(std::fs::read_to_string(kept).unwrap(), picture);
    let metrics = scrape(bed.dir.path());
    for line in [
        "rdmamig_moves_total{outcome=\"failed\"} 1",
        "rdmamig_forced_paths_total{phase=\"detach\"} 1",
        "rdmamig_moves_running 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line}\n{metrics}");
    }
    assert!(metrics.starts_with("HTTP/1.0 200"), "{metrics}");
    let elsewhere = http(bed.dir.path(), "GET /");
    assert!(elsewhere.starts_with("HTTP/1.0 404"), "{elsewhere}");
    let posted = http(bed.dir.path(), "POST /metrics");
    assert!(posted.starts_with("HTTP/1.0 405"), "{posted}");
}

/// Kills the daemon (it aborts on cue) right after it journaled each phase of a naive move,
/// restarts it on the same state directory, and checks that the restarted daemon finished
/// the move (killed after the migration) or rolled it back (killed before), with a report.
#[test]
fn a_daemon_killed_at_every_phase_boundary_finishes_or_rolls_back_after_restart() {
    for crash_at in [
        "prepare", "quiesce", "detach", "migrate", "attach", "resume",
    ] {
        let mut bed =
            Bed::start_crashing(&["-device", "usb-kbd,id=kbd0,bus=xhci.0"], Some(crash_at));
        let out = bed.migrate("kbd0", &["--strategy", "naive"]);
        assert_eq!(
            out.status.code(),
            Some(3),
            "{crash_at}: the daemon did not die"
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("before the final report"),
            "{crash_at}"
        );
        let status = bed.daemon.0.wait().unwrap();
        assert!(!status.success(), "{crash_at}: {status}");
        bed.daemon = start_daemon(bed.dir.path(), None);
        let end = Instant::now() + Duration::from_secs(30);
        let history = loop {
            let history = bed.query(&["history"]);
            if history.as_array().is_some_and(|h| !h.is_empty()) {
                break history;
            }
            assert!(Instant::now() < end, "{crash_at}: no recovered move");
            std::thread::sleep(Duration::from_millis(100));
        };
        let id = history[0]["id"].as_str().unwrap();
        let report = bed.query(&["report", id]);
        assert_eq!(report["recovered_from"], crash_at, "{report}");
        let source = qmp(&bed.source.qmp(), "query-status", Value::Null);
        if ["attach", "resume"].contains(&crash_at) {
            assert_eq!(report["final_phase"], "done", "{crash_at}: {report}");
            assert_eq!(report["vm_location"], "destination");
            let nic = qmp(
                &bed.destination.qmp(),
                "qom-get",
                serde_json::json!({"path": "/machine/peripheral/nic1", "property": "type"}),
            );
            assert_eq!(nic["return"], "virtio-net-pci", "{crash_at}: {nic}");
            assert_eq!(source["return"]["status"], "postmigrate", "{source}");
        } else {
            assert_eq!(report["final_phase"], "rolled_back", "{crash_at}: {report}");
            assert_eq!(report["vm_location"], "source");
            assert_eq!(
                source["return"]["status"], "running",
                "{crash_at}: {source}"
            );
            // The keyboard is back, or (killed before the detach acted) never left; when it
            // left, the rollback plugged the reattach device.
            let names = peripherals(&bed.source.qmp());
            let expected = if crash_at == "migrate" {
                "nic1"
            } else {
                "kbd0"
            };
            assert!(names.iter().any(|n| n == expected), "{crash_at}: {names:?}");
        }
        assert_eq!(bed.query(&["status"])["moves"], serde_json::json!([]));
    }
}

#[test]
fn a_silent_agent_fails_the_reconnect_move_at_prepare() {
    let bed = Bed::start(&["-device", "usb-kbd,id=kbd0,bus=xhci.0"]);
    let out = bed.migrate("kbd0", &["--deadline", "prepare=1500", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4));
    assert!(
        stderr.contains(
            "phase prepare missed its deadline of 1500 ms: the guest agent did not answer ping"
        ),
        "{stderr}"
    );
    // --json: every line of stdout is one JSON object; the last is the report.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["event"], "phase_started");
    let report = lines.last().unwrap();
    assert_eq!(report["failed_phase"], "prepare");
    assert_eq!(report["vm_location"], "source");
    // The device was not touched.
    let kbd = qmp(
        &bed.source.qmp(),
        "qom-get",
        serde_json::json!({"path": "/machine/peripheral/kbd0", "property": "type"}),
    );
    assert_eq!(kbd["return"], "usb-kbd", "{kbd}");
}

/// One emulated function in the pool: the first move gets it, the second finds none free and
/// rolls back before touching the VM; `rdmamig pool` shows the states.
#[test]
fn moves_take_functions_from_the_pool_and_none_free_rolls_back_at_prepare() {
    let config = "[pool]\nreservation_s = 60\n\n[[pool.function]]\nname = \"tap0\"\n\
                  device = \"driver=virtio-net-pci,netdev=nd0\"\n";
    let bed = Bed::start_full(
        &["-device", "usb-kbd,id=kbd0,bus=xhci.0"],
        None,
        Some(config),
    );
    let pool = bed.query(&["pool"]);
    assert_eq!(pool[0]["name"], "tap0");
    assert_eq!(pool[0]["state"]["state"], "free");

    let out = bed.migrate("kbd0", &["--strategy", "naive", "--from-pool"]);
    assert!(out.status.success(), "{}", out.status);
    let report = bed.report();
    assert_eq!(report["function"], "tap0");
    assert_eq!(
        report["timeline"]["phases"][4]["details"]["function"],
        "tap0"
    );
    let pool = bed.query(&["pool"]);
    assert_eq!(pool[0]["state"]["state"], "attached");
    assert_eq!(pool[0]["state"]["vm"], "vm1");

    // A second VM finds the pool empty: the move fails at prepare and nothing was touched.
    let other = Vm::start(
        bed.dir.path(),
        "src2",
        &["-device", "usb-kbd,id=kbd0,bus=xhci.0"],
    );
    let out = Command::new(env!("CARGO_BIN_EXE_rdmamig"))
        .arg("migrate")
        .arg("--socket")
        .arg(&bed.socket)
        .args(["--vm", "vm2", "--qmp"])
        .arg(other.qmp())
        .args(["--detach", "kbd0", "--to-qmp"])
        .arg(bed.destination.qmp())
        .args([
            "--attach",
            "driver=virtio-net-pci,id=nic2,bus=rp1",
            "--via",
            "unix:/nonexistent/m",
        ])
        .args(["--strategy", "naive", "--from-pool", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("phase prepare failed: no free function in the pool (1 attached)"),
        "{stderr}"
    );
    let kbd = qmp(
        &other.qmp(),
        "qom-get",
        serde_json::json!({"path": "/machine/peripheral/kbd0", "property": "type"}),
    );
    assert_eq!(kbd["return"], "usb-kbd", "{kbd}");
}

/// Two VMs move at once; a second move of a VM that is moving is refused.
#[test]
fn moves_of_different_vms_run_concurrently_and_the_same_vm_is_refused() {
    // vm1 holds its NIC (no guest to release it): its move spends 3 s in detach, then rolls
    // back. vm2 moves its keyboard meanwhile.
    let bed = Bed::start(&[
        "-device",
        "virtio-net-pci,id=nic0,netdev=nd0,bus=rp1,romfile=",
    ]);
    let vm2 = Vm::start(
        bed.dir.path(),
        "src2",
        &["-device", "usb-kbd,id=kbd0,bus=xhci.0"],
    );
    let dst2 = Vm::start(bed.dir.path(), "dst2", &["-incoming", "defer"]);
    let move_of = |vm: &str, source: &Vm, destination: &Vm, detach: &str, extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_rdmamig"))
            .arg("migrate")
            .arg("--socket")
            .arg(&bed.socket)
            .args(["--vm", vm, "--qmp"])
            .arg(source.qmp())
            .args(["--detach", detach, "--to-qmp"])
            .arg(destination.qmp())
            .args([
                "--attach",
                "driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1",
            ])
            .arg("--via")
            .arg(format!(
                "unix:{}",
                destination.dir.join("mig.sock").display()
            ))
            .args(["--strategy", "naive", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    std::thread::scope(|s| {
        let first = s.spawn(|| {
            move_of(
                "vm1",
                &bed.source,
                &bed.destination,
                "nic0",
                &["--deadline", "detach=3000", "--deadline", "rollback=1000"],
            )
        });
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let status = bed.query(&["status"]);
            if status["moves"].as_array().is_some_and(|m| !m.is_empty()) {
                assert_eq!(status["moves"][0]["vm"], "vm1");
                break;
            }
            assert!(Instant::now() < end, "vm1's move never showed in status");
            std::thread::sleep(Duration::from_millis(20));
        }
        let again = move_of("vm1", &bed.source, &bed.destination, "nic0", &[]);
        assert_eq!(again.status.code(), Some(3));
        let stderr = String::from_utf8_lossy(&again.stderr);
        assert!(stderr.contains("VM vm1 is already moving"), "{stderr}");

        let second = move_of("vm2", &vm2, &dst2, "kbd0", &[]);
        assert!(
            second.status.success(),
            "{}",
            String::from_utf8_lossy(&second.stderr)
        );
        // vm1's NIC never leaves (no guest to release it): its unplug stays pending, and
        // the rollback, which waits for it, fails.
        let first = first.join().unwrap();
        assert_eq!(
            first.status.code(),
            Some(1),
            "{}",
            String::from_utf8_lossy(&first.stderr)
        );
        let report = |out: &Output| -> Value {
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap())
                .unwrap()
        };
        let (one, two) = (report(&first), report(&second));
        // vm2's whole move lies inside vm1's.
        let window = |r: &Value| {
            (
                r["timeline"]["started_unix_ms"].as_u64().unwrap(),
                r["timeline"]["ended_unix_ms"].as_u64().unwrap(),
            )
        };
        let (a, b) = (window(&one), window(&two));
        assert!(a.0 < b.0 && b.1 < a.1, "not concurrent: {a:?} {b:?}");
        assert_eq!(two["final_phase"], "done");
    });
}

#[test]
fn usage_errors_and_an_absent_daemon_have_their_own_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let base = |via: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_rdmamig"));
        command
            .arg("migrate")
            .arg("--socket")
            .arg(dir.path().join("nobody.sock"))
            .args([
                "--vm",
                "vm1",
                "--qmp",
                "/x/qmp",
                "--detach",
                "nic0",
                "--to-qmp",
                "/y/qmp",
                "--attach",
                "driver=e1000e,id=nic1",
                "--via",
                via,
                "--strategy",
                "naive",
            ]);
        command
    };
    let out = base("/no/scheme").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not unix:PATH or tcp:HOST:PORT"));
    let out = base("unix:/m")
        .args(["--deadline", "unplug=5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown phase"));
    let out = base("unix:/m").output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the rdmamig daemon"));
}

/// `rdmamig pool return`: a quarantined function passes its reset and is free again; one
/// whose reset fails (a VF that is not there), one that is not quarantined and an unknown
/// name are refused with the reason, exit status 3, and stay as they were.
#[test]
fn a_quarantined_function_returns_to_the_pool_only_after_its_reset() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rdmamig.toml"),
        "[[pool.function]]\nname = \"tap0\"\ndevice = \"driver=e1000e,netdev=nd0\"\n\n\
         [[pool.function]]\nname = \"vf0\"\npci = \"0000:7f:1f.7\"\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    let quarantined = r#"{"state":"quarantined","reason":"reset failed"}"#;
    std::fs::write(
        dir.path().join("state/pool.json"),
        format!(r#"{{"tap0":{quarantined},"vf0":{quarantined}}}"#),
    )
    .unwrap();
    let _daemon = start_daemon(dir.path(), None);
    let pool = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_rdmamig"))
            .arg("pool")
            .args(args)
            .arg("--socket")
            .arg(dir.path().join("rdmamig.sock"))
            .output()
            .unwrap()
    };

    let out = pool(&["return", "tap0"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "tap0: emulated: nothing to reset; back in the pool (free)\n"
    );
    for (args, reason) in [
        (
            ["return", "tap0"],
            "pool function tap0 is free, only a quarantined function is returned to the pool",
        ),
        (
            ["return", "vf0"],
            "pool function vf0 stays quarantined: its check failed: ",
        ),
        (["return", "vf9"], "no function \"vf9\" in the pool"),
    ] {
        let out = pool(&args);
        assert_eq!(out.status.code(), Some(3), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
    }
    let out = pool(&["--json"]);
    let states: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(states[0]["name"], "tap0");
    assert_eq!(states[0]["state"]["state"], "free");
    assert_eq!(states[1]["name"], "vf0");
    assert_eq!(states[1]["state"]["reason"], "reset failed");
}

/// Hundreds of idle connections on the API socket and the metrics port, past the daemon's
/// descriptors (it runs with 96): accepts fail with EMFILE. The daemon keeps its socket and
/// keeps running, and serves again once the flood ends.
#[test]
fn floods_of_idle_connections_never_take_the_daemon_down() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("rdmamig.sock");
    let mut command = daemon_command(dir.path(), None);
    // SAFETY: the closure runs in the forked child before exec and only calls setrlimit,
    // which is async-signal-safe, on a valid rlimit.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 96,
                rlim_max: 96,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut daemon = Process(command.spawn().unwrap());
    wait_for_file(&socket);
    let metrics = ("127.0.0.1", metrics_port(dir.path()));
    let api: Vec<_> = (0..180)
        .filter_map(|_| std::os::unix::net::UnixStream::connect(&socket).ok())
        .collect();
    let scrapes: Vec<_> = (0..100)
        .filter_map(|_| std::net::TcpStream::connect(metrics).ok())
        .collect();
    assert!(
        api.len() > 96,
        "only {} API connections were made",
        api.len()
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        daemon.0.try_wait().unwrap().is_none(),
        "the daemon exited under the flood:\n{}",
        std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
    );
    assert!(socket.exists(), "the flood removed the daemon's socket");
    drop(api);
    drop(scrapes);
    // The flood's connections end; the daemon answers again.
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let out = Command::new(env!("CARGO_BIN_EXE_rdmamig"))
            .args(["status", "--json", "--socket"])
            .arg(&socket)
            .output()
            .unwrap();
        if out.status.success() {
            break serde_json::from_slice::<Value>(&out.stdout).unwrap();
        }
        assert!(
            Instant::now() < end,
            "the daemon does not answer after the flood: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status["moves"], serde_json::json!([]));
    assert!(scrape(dir.path()).contains("rdmamig_moves_running 0"));
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert!(log.contains("cannot accept a connection"), "{log}");
}

/// A daemon that cannot start changes nothing: a `--socket` path holding a regular file keeps
/// it, and a config that parses but is not valid creates no state directory.
#[test]
fn a_daemon_that_cannot_start_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, "precious").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rdmamig"))
        .args(["daemon", "--socket"])
        .arg(&file)
        .arg("--state-dir")
        .arg(dir.path().join("state1"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("is not a socket"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "precious");

    let config = dir.path().join("rdmamig.toml");
    std::fs::write(&config, "[pool]\nreservation_s = 0\n").unwrap();
    let state = dir.path().join("state2");
    let out = Command::new(env!("CARGO_BIN_EXE_rdmamig"))
        .args(["daemon", "--socket"])
        .arg(dir.path().join("d.sock"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("reservation_s = 0"), "{stderr}");
    assert!(
        !state.exists(),
        "a rejected config created {}",
        state.display()
    );

    // A daemon that stops after its socket is in place (its metrics port is taken) takes
    // the socket with it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let socket = dir.path().join("d3.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_rdmamig"))
        .args(["daemon", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.path().join("state3"))
        .arg("--metrics")
        .arg(taken.local_addr().unwrap().to_string())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("cannot serve metrics"), "{stderr}");
    assert!(!socket.exists(), "the stopped daemon left its socket");
}

/// Answers that grow with the host (a long history, a large pool, a report with a long
/// error) are streamed in pieces, never refused for their size.
#[test]
fn answers_that_grow_with_the_host_are_never_cut() {
    let mut config = String::new();
    for i in 0..600 {
        config.push_str(&format!(
            "[[pool.function]]\nname = \"vf{i}\"\ndevice = \"driver=e1000e,netdev=pool{i}\"\n"
        ));
    }
    let bed = Bed::start_full(
        &["-device", "usb-kbd,id=kbd0,bus=xhci.0"],
        None,
        Some(&config),
    );
    let out = bed.migrate("kbd0", &["--strategy", "naive"]);
    assert!(out.status.success(), "{}", out.status);
    let report = bed.report();
    let moves = bed.dir.path().join("state/moves");
    let started = report["timeline"]["started_unix_ms"].as_u64().unwrap();
    for i in 0..449u64 {
        let mut copy = report.clone();
        copy["id"] = format!("copy-{i}").into();
        copy["timeline"]["started_unix_ms"] = (started - 1 - i).into();
        std::fs::write(moves.join(format!("copy-{i}.json")), copy.to_string()).unwrap();
    }
    let mut big = report.clone();
    big["id"] = "big".into();
    big["error"] = "x".repeat(60_000).into();
    std::fs::write(moves.join("big.json"), big.to_string()).unwrap();

    let history = bed.query(&["history", "--limit", "450"]);
    assert_eq!(history.as_array().unwrap().len(), 450);
    let shown = bed.query(&["report", "big"]);
    assert_eq!(shown["error"].as_str().unwrap().len(), 60_000);
    let pool = bed.query(&["pool"]);
    assert_eq!(pool.as_array().unwrap().len(), 600);
}
