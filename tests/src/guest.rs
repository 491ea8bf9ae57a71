//! QEMU TCG guests on the test bed: their command line, their process, their sockets.
//!
//! Each guest is one `qemu-system-x86_64` started with `ip netns exec` inside the test bed's
//! namespace, in a process group of its own so that stopping it ends everything it started.
//! The command line follows TESTBED.md: q35 with two PCIe root ports (rp1, rp2) for hot-plug,
//! the RDMA NIC (a virtio-net-pci, or an e1000e: [`NicModel`]) on rp1 backed by tap netdev
//! `nd0`, a virtio-serial port for the agent, and the serial console and QMP on UNIX sockets
//! in the guest's directory. Every guest also has a permanent NIC, `pnic0`: a virtio-net-pci
//! behind its own root port `rp3`, backed by tap netdev `nd1`, which migrates with the VM and
//! is never unplugged (the path the `bridge` strategy keeps while the RDMA NIC is away).
//! Behind a root port after `rp1` it probes after a virtio-net RDMA NIC (and the image loads
//! e1000e first), so the RDMA NIC stays `eth0` and the permanent one is `eth1`.
//! A migration destination has the same devices except the RDMA NIC (it is plugged after the
//! move) and waits with `-incoming defer` for the migrator's `migrate-incoming`.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use rdmamig_images::init::{
    AGENT_PORT_NAME, NOT_READY_MARKER, PARAM_IP, PARAM_MAC, PARAM_PERMANENT_IP,
    PARAM_PERMANENT_MAC, READY_MARKER,
};
use rdmamig_images::Image;

use crate::console::{CommandOutput, Console, ConsoleError};
use crate::qmp::{Qmp, QmpError};
use serde_json::{json, Value};

/// How long a guest may take from QEMU's start to `RDMAMIG-READY` (a boot takes ~6 s).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long QEMU may take to create its sockets.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopping QEMU gets after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How long saving or loading a snapshot may take: a nested host (a ~430 MiB file) saved
/// in 5-7 s here and restored in 0.5-12 s.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(180);
/// Console lines printed per guest in failure dumps.
const DUMP_LINES: usize = 60;

/// Errors of guest handling.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// Creating the guest's directory or log file failed.
    #[error("preparing directory {dir} of guest {guest}")]
    Prepare {
        /// The guest's name.
        guest: String,
        /// The guest's directory.
        dir: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// QEMU could not be started.
    #[error("starting QEMU for guest {guest}")]
    Spawn {
        /// The guest's name.
        guest: String,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// QEMU exited while the harness waited for it.
    #[error("QEMU of guest {guest} exited ({status}); its log ends with:\n{log_tail}")]
    Exited {
        /// The guest's name.
        guest: String,
        /// QEMU's exit status.
        status: ExitStatus,
        /// The end of QEMU's stdout/stderr.
        log_tail: String,
    },
    /// The guest reported that its RDMA NIC did not come up.
    #[error("guest {guest} is not ready: {line}; its console ends with:\n{console_tail}")]
    NotReady {
        /// The guest's name.
        guest: String,
        /// The guest's RDMAMIG-NOTREADY line.
        line: String,
        /// The end of the console log.
        console_tail: String,
    },
    /// Booting did not reach RDMAMIG-READY.
    #[error("guest {guest} did not boot; its console ends with:\n{console_tail}")]
    Boot {
        /// The guest's name.
        guest: String,
        /// The end of the console log.
        console_tail: String,
        /// What went wrong on the console.
        #[source]
        source: ConsoleError,
    },
    /// A console command could not be run.
    #[error("running {command:?} on guest {guest}")]
    Command {
        /// The guest's name.
        guest: String,
        /// The command.
        command: String,
        /// What went wrong.
        #[source]
        source: ConsoleError,
    },
    /// A console command exited with a non-zero status where success was required.
    #[error("{command:?} on guest {guest} exited with status {status}:\n{output}")]
    CommandFailed {
        /// The guest's name.
        guest: String,
        /// The command.
        command: String,
        /// Its exit status.
        status: i32,
        /// Its output.
        output: String,
    },
    /// The console could not be (re)attached.
    #[error("attaching to the console of guest {guest}")]
    Attach {
        /// The guest's name.
        guest: String,
        /// What went wrong.
        #[source]
        source: ConsoleError,
    },
    /// Saving the guest to a snapshot file, or starting it from one, did not complete.
    #[error("{operation} snapshot {file} of guest {guest}: {status}")]
    Snapshot {
        /// The guest's name.
        guest: String,
        /// "saving" or "restoring".
        operation: &'static str,
        /// The snapshot file.
        file: PathBuf,
        /// QEMU's last migration status (and its error, if it gave one).
        status: String,
    },
    /// A destination held on arrival saw no migrated VM arrive.
    #[error("no migrated VM arrived in guest {guest} within {bound:?} (its status: {status})")]
    NeverArrived {
        /// The guest's name.
        guest: String,
        /// How long it waited.
        bound: Duration,
        /// QEMU's last query-status answer.
        status: String,
    },
    /// QMP could not be reached.
    #[error("QMP of guest {guest}")]
    Qmp {
        /// The guest's name.
        guest: String,
        /// What went wrong.
        #[source]
        source: QmpError,
    },
}

/// How to start one guest. [`crate::Testbed::guest_spec`] fills in a fresh tap and an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestSpec {
    /// Short name (`a`, `b`, `a-dst`), used for the guest's directory and in messages.
    pub name: String,
    /// The RDMA NIC's address with prefix (`10.77.0.11/24`), passed as `rdmamig.ip=`.
    pub ip: String,
    /// The RDMA NIC's MAC, passed as `rdmamig.mac=` and given to the NIC device.
    pub mac: String,
    /// The tap (in the test bed's namespace) backing netdev `nd0`.
    pub tap: String,
    /// The permanent NIC's address with prefix (`10.78.0.11/24`), passed as `rdmamig.ip2=`.
    pub permanent_ip: String,
    /// The permanent NIC's MAC, passed as `rdmamig.mac2=` and given to device `pnic0`.
    pub permanent_mac: String,
    /// The tap (in the test bed's namespace) backing netdev `nd1` of the permanent NIC.
    pub permanent_tap: String,
    /// Whether the NIC device `nic0` (on `rp1`) is present at start. A migration destination
    /// has the netdev but no device.
    pub with_nic: bool,
    /// The device model of the RDMA NIC, at boot and in every hot-plug.
    pub rdma_nic: NicModel,
    /// Guest memory in MiB.
    pub memory_mib: u32,
    /// Gives the guest a vsock device with this CID, served by a vhost-device-vsock process
    /// of the guest's own: the host reaches guest ports through the hybrid vsock socket
    /// [`Guest::vsock_socket`] (`CONNECT <port>`), as with Cloud Hypervisor's `--vsock`.
    /// Guest memory is then a shared memfd, which vhost-user needs.
    pub vsock_cid: Option<u32>,
    /// With [`GuestSpec::vsock_cid`]: whether the vsock device [`VSOCK_DEVICE`] is present
    /// at start (its vhost-device-vsock and chardev always are). QEMU 10.0 cannot migrate a
    /// vhost-user-vsock device (its backend lacks VHOST_USER_PROTOCOL_F_LOG_SHMFD), so a
    /// migration destination starts without it and has it plugged after the migration
    /// ([`vsock_device_args`]).
    pub with_vsock: bool,
    /// Gives the guest an emulated IOMMU (intel-iommu, interrupt remapping, `intel_iommu=on`),
    /// created before every other device so that none bypasses it: what a guest that plays
    /// a host with VFIO needs ([`crate::nested`]).
    pub iommu: bool,
    /// vCPUs. A host needs two: its nested VM's QEMU then runs its vCPU on one and its
    /// other threads on the other (TESTBED.md: an L2 reached /init in ~110 s that way, and
    /// in ~400 s with one vCPU).
    pub cpus: u32,
    /// A migration destination keeps the arrived VM paused (QEMU `-S`) until
    /// [`Arrival::hold`] resumes it: a VM's pause as long as a test needs, as a large
    /// device state would make it. Adds a second QMP monitor for the test bed, since the
    /// migrator holds the first during a move.
    pub paused_on_arrival: bool,
}

/// The QEMU device model of a guest's RDMA NIC (Soft-RoCE runs on either).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NicModel {
    /// `virtio-net-pci`, the test bed's NIC.
    #[default]
    VirtioNet,
    /// `e1000e`. Closing it frees the skbs still in its transmit ring, and with them the
    /// references Soft-RoCE holds on the QPs that sent them; virtio-net frees them only after
    /// its netdev is unregistered, which waits for those QPs to go (docs/testbed.md).
    E1000e,
    /// `igb`: an SR-IOV PF (7 VFs), for a guest that plays a host ([`crate::nested`]).
    Igb,
}

impl NicModel {
    /// QEMU's driver name for `-device` and `device_add`.
    pub fn qemu_driver(self) -> &'static str {
        match self {
            NicModel::VirtioNet => "virtio-net-pci",
            NicModel::E1000e => "e1000e",
            NicModel::Igb => "igb",
        }
    }
}

impl GuestSpec {
    /// The NIC's address without the prefix length (`10.77.0.11`).
    pub fn address(&self) -> &str {
        self.ip.split('/').next().unwrap_or(&self.ip)
    }

    /// The permanent NIC's address without the prefix length (`10.78.0.11`).
    pub fn permanent_address(&self) -> &str {
        self.permanent_ip
            .split('/')
            .next()
            .unwrap_or(&self.permanent_ip)
    }
}

/// A QEMU process, shared between its [`Guest`] and the test bed's registry so that whichever
/// goes first stops it, and the test bed can dump its logs.
#[derive(Debug)]
pub(crate) struct VmProcess {
    pub(crate) name: String,
    pub(crate) dir: PathBuf,
    pid: u32,
    /// `None` once stopped and reaped. Keeping the child unreaped until then guarantees the
    /// process group id cannot be reused by another process while it may still be signalled.
    child: Mutex<Option<Child>>,
    /// A process serving one of QEMU's devices (vhost-device-vsock), stopped after QEMU.
    helper: Mutex<Option<Child>>,
}

impl VmProcess {
    /// Whether QEMU has exited, without waiting (its exit status if so).
    fn exit_status(&self) -> Option<ExitStatus> {
        let mut child = self.child.lock().unwrap_or_else(|p| p.into_inner());
        child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Stops QEMU and everything in its process group: SIGTERM, then SIGKILL after a grace
    /// period. Idempotent.
    pub(crate) fn stop(&self) {
        let mut slot = self.child.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mut child) = slot.take() else {
            return;
        };
        let group = Pid::from_raw(self.pid as i32);
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Also reaches helpers QEMU may have left in its group.
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait();
        if let Some(mut helper) = self.helper.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = helper.kill();
            let _ = helper.wait();
        }
    }

    /// The VM's run state as QEMU reports it, for failure reports (a guest that stopped
    /// answering its console may be paused, still migrating, or hung while running).
    fn run_state(&self) -> String {
        let status = Qmp::connect(&self.dir.join("qmp.sock"), Duration::from_secs(1))
            .and_then(|mut qmp| qmp.execute("query-status", serde_json::Value::Null));
        match status {
            Ok(status) => status.to_string(),
            Err(e) => format!("unknown ({e})"),
        }
    }

    /// The assertion QEMU itself died of, if its log has one: the emulator crashed, not
    /// the guest. QEMU 10.0's TCG with an emulated IOMMU does, now and then, while a nested
    /// VM's VFIO device goes (`iotlb_to_section: Assertion ... failed`).
    pub(crate) fn emulator_assertion(&self) -> Option<String> {
        let log = fs::read_to_string(self.dir.join("qemu.log")).ok()?;
        log.lines()
            .find(|line| line.contains("Assertion") && line.contains("failed"))
            .map(str::to_owned)
    }

    /// The VM's run state and the last lines of the console log and QEMU's own log, for
    /// failure reports.
    pub(crate) fn dump(&self) -> String {
        let console = fs::read_to_string(self.dir.join("console.log")).unwrap_or_default();
        let crashed: String = crate::kernel_log::problem_lines(&console)
            .take(3)
            .map(|line| format!("!!!!! guest {}: kernel problem: {line}\n", self.name))
            .collect();
        format!(
            "{crashed}===== guest {} ({}) console ({}) =====\n{}\n===== guest {} qemu log =====\n{}",
            self.name,
            self.run_state(),
            self.dir.join("console.log").display(),
            tail(&self.dir.join("console.log"), DUMP_LINES),
            self.name,
            tail(&self.dir.join("qemu.log"), 20),
        )
    }
}

/// One running guest.
#[derive(Debug)]
pub struct Guest {
    spec: GuestSpec,
    process: Arc<VmProcess>,
    console: Mutex<Option<Console>>,
}

/// Everything [`Guest::launch`] needs from the test bed.
pub(crate) struct Launch<'a> {
    pub(crate) netns: &'a str,
    pub(crate) image: &'a Image,
    pub(crate) dir: PathBuf,
    pub(crate) incoming: bool,
}

impl Guest {
    /// Starts QEMU for `spec`; returns once the console and QMP sockets exist. Does not wait
    /// for the boot.
    pub(crate) fn launch(spec: GuestSpec, launch: Launch<'_>) -> Result<Guest, GuestError> {
        let prepare = |source| GuestError::Prepare {
            guest: spec.name.clone(),
            dir: launch.dir.clone(),
            source,
        };
        fs::create_dir_all(&launch.dir).map_err(prepare)?;
        let log = fs::File::create(launch.dir.join("qemu.log")).map_err(prepare)?;
        let log_err = log.try_clone().map_err(prepare)?;
        let helper = match spec.vsock_cid {
            Some(cid) => Some(start_vhost_vsock(&spec.name, cid, &launch.dir)?),
            None => None,
        };
        let helper = HelperGuard(helper);
        let child = Command::new("ip")
            .args(["netns", "exec", launch.netns, "qemu-system-x86_64"])
            .args(qemu_args(&spec, launch.image, &launch.dir, launch.incoming))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .spawn()
            .map_err(|source| GuestError::Spawn {
                guest: spec.name.clone(),
                source,
            })?;
        let process = Arc::new(VmProcess {
            name: spec.name.clone(),
            dir: launch.dir,
            pid: child.id(),
            child: Mutex::new(Some(child)),
            helper: Mutex::new(helper.take()),
        });
        let guest = Guest {
            spec,
            process,
            console: Mutex::new(None),
        };
        // QMP accepting a client means QEMU has parsed its command line and created its
        // sockets; a QEMU that fails early (tap busy, bad option) is reported here.
        let qmp = Qmp::connect(&guest.qmp_socket(), SOCKET_TIMEOUT);
        if let Some(status) = guest.process.exit_status() {
            return Err(GuestError::Exited {
                guest: guest.spec.name.clone(),
                status,
                log_tail: tail(&guest.process.dir.join("qemu.log"), 20),
            });
        }
        qmp.map_err(|source| GuestError::Qmp {
            guest: guest.spec.name.clone(),
            source,
        })?;
        Ok(guest)
    }

    pub(crate) fn process(&self) -> &Arc<VmProcess> {
        &self.process
    }

    /// Attaches the console and waits at most `timeout` for `RDMAMIG-READY`.
    pub(crate) fn wait_ready(&self, timeout: Duration) -> Result<(), GuestError> {
        self.reattach_console()?;
        let console = self.console.lock().unwrap_or_else(|p| p.into_inner());
        let Some(console) = console.as_ref() else {
            unreachable!("reattach_console attached a console")
        };
        // Output from before the connection is only in the log file.
        let early = fs::read_to_string(self.console_log()).unwrap_or_default();
        if early.lines().any(|l| l.contains(READY_MARKER)) {
            return Ok(());
        }
        let boot_error = |source| {
            let status = self.process.exit_status();
            match status {
                Some(status) => GuestError::Exited {
                    guest: self.spec.name.clone(),
                    status,
                    log_tail: tail(&self.process.dir.join("qemu.log"), 20),
                },
                None => GuestError::Boot {
                    guest: self.spec.name.clone(),
                    console_tail: tail(&self.console_log(), DUMP_LINES),
                    source,
                },
            }
        };
        match console.wait_for_marker(&[READY_MARKER, NOT_READY_MARKER], timeout) {
            Ok((0, _)) => Ok(()),
            Ok((_, line)) => Err(GuestError::NotReady {
                guest: self.spec.name.clone(),
                line,
                console_tail: tail(&self.console_log(), DUMP_LINES),
            }),
            Err(source) => Err(boot_error(source)),
        }
    }

    /// The spec the guest was started from.
    pub fn spec(&self) -> &GuestSpec {
        &self.spec
    }

    /// The guest's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// QEMU's process id (also its process group id).
    pub fn pid(&self) -> u32 {
        self.process.pid
    }

    /// The guest's directory: sockets and logs.
    pub fn dir(&self) -> &Path {
        &self.process.dir
    }

    /// The assertion this guest's QEMU died of, if it did (see
    /// [`VmProcess::emulator_assertion`]).
    pub fn emulator_assertion(&self) -> Option<String> {
        self.process.emulator_assertion()
    }

    /// QEMU's QMP socket. It serves one client at a time; do not hold it longer than needed.
    pub fn qmp_socket(&self) -> PathBuf {
        self.dir().join("qmp.sock")
    }

    /// The host end of the agent's virtio-serial port (`org.rdmamig.agent.0`).
    pub fn agent_socket(&self) -> PathBuf {
        self.dir().join("agent.sock")
    }

    /// The serial console's socket (the harness holds the one connection it serves).
    pub fn console_socket(&self) -> PathBuf {
        self.dir().join("con.sock")
    }

    /// The complete console output, written by QEMU whether or not a client is connected.
    pub fn console_log(&self) -> PathBuf {
        self.dir().join("console.log")
    }

    /// The hybrid vsock socket (vhost-device-vsock's `--uds-path`) of a guest started with
    /// [`GuestSpec::vsock_cid`].
    pub fn vsock_socket(&self) -> PathBuf {
        self.dir().join("vsock.sock")
    }

    /// vhost-device-vsock's vhost-user socket, which the vsock device's chardev connects to.
    pub fn vhost_vsock_socket(&self) -> PathBuf {
        self.dir().join(VHOST_VSOCK_SOCKET)
    }

    /// A path for a migration stream socket (`unix:<path>`) with this guest as the destination.
    pub fn migration_socket_path(&self) -> PathBuf {
        self.dir().join("mig.sock")
    }

    /// On a destination [`GuestSpec::paused_on_arrival`]: what holds its arrived VM, for
    /// a thread of the test's own while the move runs.
    pub fn arrival(&self) -> Arrival {
        Arrival {
            guest: self.spec.name.clone(),
            monitor: self.dir().join(BED_QMP_SOCKET),
        }
    }

    /// Connects a new QMP session (capabilities negotiated). Drop it when done.
    pub fn qmp(&self) -> Result<Qmp, GuestError> {
        Qmp::connect(&self.qmp_socket(), SOCKET_TIMEOUT).map_err(|source| GuestError::Qmp {
            guest: self.spec.name.clone(),
            source,
        })
    }

    /// (Re)connects the harness to the console, e.g. on a migration destination, where the
    /// source's shell loop carries on. Unconsumed output of the old connection is dropped.
    pub fn reattach_console(&self) -> Result<(), GuestError> {
        let mut slot = self.console.lock().unwrap_or_else(|p| p.into_inner());
        // Free the single client slot before taking it again.
        slot.take();
        let console =
            Console::connect(&self.console_socket(), SOCKET_TIMEOUT).map_err(|source| {
                GuestError::Attach {
                    guest: self.spec.name.clone(),
                    source,
                }
            })?;
        *slot = Some(console);
        Ok(())
    }

    /// Runs a shell command on the guest's console (attaching first if needed) and returns its
    /// status and output. See [`crate::console`] for the protocol.
    pub fn run(&self, command: &str, timeout: Duration) -> Result<CommandOutput, GuestError> {
        let command_error = |source| GuestError::Command {
            guest: self.spec.name.clone(),
            command: command.to_owned(),
            source,
        };
        if self.console_missing() {
            self.reattach_console()?;
        }
        let first = {
            let console = self.console.lock().unwrap_or_else(|p| p.into_inner());
            let Some(console) = console.as_ref() else {
                unreachable!("the console was attached above")
            };
            console.run(command, timeout)
        };
        match first {
            // A command the guest never started can be sent again: once, on a fresh
            // connection (CI once saw a migrated guest's console take no command at all).
            Err(e @ ConsoleError::NotStarted { .. }) => {
                eprintln!(
                    "guest {}: {e} (QEMU says {}); sending it again on a fresh console \
                     connection",
                    self.spec.name,
                    self.process.run_state()
                );
                self.reattach_console()?;
                let console = self.console.lock().unwrap_or_else(|p| p.into_inner());
                let Some(console) = console.as_ref() else {
                    unreachable!("reattach_console attached a console")
                };
                console.run(command, timeout).map_err(command_error)
            }
            other => other.map_err(command_error),
        }
    }

    /// Like [`Guest::run`], but a non-zero status is an error; returns the output.
    pub fn run_ok(&self, command: &str, timeout: Duration) -> Result<String, GuestError> {
        Shell::run_ok(self, command, timeout)
    }

    /// Saves the whole guest, memory and devices, to `file` and stops QEMU: a snapshot that
    /// [`crate::Testbed::restore_guest`] starts again in seconds, where a nested boot takes
    /// minutes. The guest is paused first, so the snapshot is one instant. Connections to the
    /// guest's own servers (a nested VM's TCP console) should be closed before: a peer that
    /// vanishes without closing leaves them taken after the restore.
    pub fn save(&self, file: &Path) -> Result<(), GuestError> {
        let mut qmp = self.qmp()?;
        let qmp_error = |source| GuestError::Qmp {
            guest: self.spec.name.clone(),
            source,
        };
        qmp.execute("stop", Value::Null).map_err(qmp_error)?;
        qmp.execute(
            "migrate",
            json!({ "uri": format!("file:{}", file.display()) }),
        )
        .map_err(qmp_error)?;
        self.wait_migration(&mut qmp, "saving", file)?;
        drop(qmp);
        self.kill();
        Ok(())
    }

    /// Loads snapshot `file` into this guest, started with `-incoming defer`, and runs it.
    pub(crate) fn load(&self, file: &Path) -> Result<(), GuestError> {
        let mut qmp = self.qmp()?;
        let qmp_error = |source| GuestError::Qmp {
            guest: self.spec.name.clone(),
            source,
        };
        qmp.execute(
            "migrate-incoming",
            json!({ "uri": format!("file:{}", file.display()) }),
        )
        .map_err(qmp_error)?;
        self.wait_migration(&mut qmp, "restoring", file)?;
        // The guest was paused when it was saved, and stays so until told to run.
        qmp.execute("cont", Value::Null).map_err(qmp_error)?;
        Ok(())
    }

    /// Polls `query-migrate` until the save or load of `file` completes.
    fn wait_migration(
        &self,
        qmp: &mut Qmp,
        operation: &'static str,
        file: &Path,
    ) -> Result<(), GuestError> {
        let failed = |status: String| GuestError::Snapshot {
            guest: self.spec.name.clone(),
            operation,
            file: file.to_owned(),
            status,
        };
        let deadline = Instant::now() + SNAPSHOT_TIMEOUT;
        loop {
            let info = qmp
                .execute("query-migrate", Value::Null)
                .map_err(|source| GuestError::Qmp {
                    guest: self.spec.name.clone(),
                    source,
                })?;
            match info["status"].as_str().unwrap_or("none") {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    return Err(failed(format!(
                        "{} ({})",
                        info["status"],
                        info["error-desc"].as_str().unwrap_or("no reason given")
                    )))
                }
                status if Instant::now() >= deadline => {
                    return Err(failed(format!("still {status} after {SNAPSHOT_TIMEOUT:?}")))
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Stops QEMU now (SIGTERM, then SIGKILL). Dropping the guest does the same.
    pub fn kill(&self) {
        self.console
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.process.stop();
    }

    fn console_missing(&self) -> bool {
        self.console
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What the harness runs shell commands on: a test-bed guest, or a VM nested in a host
/// ([`crate::nested`]). The shared steps ([`crate::steps`]) take one.
pub trait Shell {
    /// Its name, in messages.
    fn name(&self) -> &str;
    /// Runs a command on its console; see [`Guest::run`].
    fn run(&self, command: &str, timeout: Duration) -> Result<CommandOutput, GuestError>;
    /// How many times slower than a test-bed guest it runs: the shared steps scale their
    /// waits by it.
    fn pace(&self) -> u32 {
        1
    }
    /// Like [`Shell::run`], but a non-zero status is an error; returns the output.
    fn run_ok(&self, command: &str, timeout: Duration) -> Result<String, GuestError> {
        let out = self.run(command, timeout)?;
        if out.status != 0 {
            return Err(GuestError::CommandFailed {
                guest: self.name().to_owned(),
                command: command.to_owned(),
                status: out.status,
                output: out.output,
            });
        }
        Ok(out.output)
    }
}

impl Shell for Guest {
    fn name(&self) -> &str {
        Guest::name(self)
    }

    fn run(&self, command: &str, timeout: Duration) -> Result<CommandOutput, GuestError> {
        Guest::run(self, command, timeout)
    }
}

/// QEMU's arguments for `spec` (after the program name).
fn qemu_args(spec: &GuestSpec, image: &Image, dir: &Path, incoming: bool) -> Vec<String> {
    let path = |name: &str| dir.join(name).display().to_string();
    let machine = match (spec.vsock_cid, spec.iommu) {
        (Some(_), _) => "q35,memory-backend=mem",
        // Interrupt remapping needs the IOAPIC in QEMU, not in the accelerator.
        (None, true) => "q35,kernel-irqchip=split",
        (None, false) => "q35",
    };
    let iommu = if spec.iommu { " intel_iommu=on" } else { "" };
    let mut args: Vec<String> = [
        "-name",
        &spec.name,
        "-accel",
        "tcg",
        "-machine",
        machine,
        "-m",
        &spec.memory_mib.to_string(),
        "-smp",
        &spec.cpus.to_string(),
        "-nographic",
        "-nodefaults",
        "-no-reboot",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if spec.iommu {
        args.extend([
            "-device".into(),
            "intel-iommu,intremap=on,caching-mode=on".into(),
        ]);
    }
    args.extend([
        "-kernel".into(),
        image.kernel.display().to_string(),
        "-initrd".into(),
        image.initramfs.display().to_string(),
        "-append".into(),
        // cryptomgr.notests: the kernel's self-tests of its built-in ciphers took 0.3-0.5 s
        // of a TCG boot (crypto_algapi_init, 2026-12-07), tens of seconds nested.
        format!(
            "console=ttyS0 panic=-1 quiet cryptomgr.notests{iommu} {PARAM_IP}={} {PARAM_MAC}={} \
             {PARAM_PERMANENT_IP}={} {PARAM_PERMANENT_MAC}={}",
            spec.ip, spec.mac, spec.permanent_ip, spec.permanent_mac
        ),
        "-chardev".into(),
        format!(
            "socket,id=ser0,path={},server=on,wait=off,logfile={}",
            path("con.sock"),
            path("console.log")
        ),
        "-serial".into(),
        "chardev:ser0".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", path("qmp.sock")),
        "-device".into(),
        "pcie-root-port,id=rp1,slot=1,chassis=1".into(),
        "-device".into(),
        "pcie-root-port,id=rp2,slot=2,chassis=2".into(),
        "-netdev".into(),
        format!("tap,id=nd0,ifname={},script=no,downscript=no", spec.tap),
    ]);
    if spec.with_nic {
        // romfile= skips the iPXE option ROM: no network boot, ~2 s less to boot.
        args.extend([
            "-device".into(),
            format!(
                "{},netdev=nd0,mac={},id=nic0,bus=rp1,romfile=",
                spec.rdma_nic.qemu_driver(),
                spec.mac
            ),
        ]);
    }
    args.extend([
        "-device".into(),
        "pcie-root-port,id=rp3,slot=3,chassis=3".into(),
        "-netdev".into(),
        format!(
            "tap,id=nd1,ifname={},script=no,downscript=no",
            spec.permanent_tap
        ),
        "-device".into(),
        format!(
            "virtio-net-pci,netdev=nd1,mac={},id=pnic0,bus=rp3,romfile=",
            spec.permanent_mac
        ),
        "-device".into(),
        "virtio-serial-pci,id=vser0".into(),
        "-chardev".into(),
        format!(
            "socket,path={},server=on,wait=off,id=ch0",
            path("agent.sock")
        ),
        "-device".into(),
        format!("virtserialport,chardev=ch0,name={AGENT_PORT_NAME},bus=vser0.0"),
    ]);
    if spec.vsock_cid.is_some() {
        args.extend([
            "-object".into(),
            format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                spec.memory_mib
            ),
            "-chardev".into(),
            format!(
                "socket,id={VSOCK_CHARDEV},path={}",
                path(VHOST_VSOCK_SOCKET)
            ),
            // Its own root port, so that it can be unplugged and plugged again.
            "-device".into(),
            "pcie-root-port,id=rp4,slot=4,chassis=4".into(),
        ]);
        if spec.with_vsock {
            args.extend([
                "-device".into(),
                format!("vhost-user-vsock-pci,chardev={VSOCK_CHARDEV},id={VSOCK_DEVICE},bus=rp4"),
            ]);
        }
    }
    if incoming {
        args.extend(["-incoming".into(), "defer".into()]);
    }
    if spec.paused_on_arrival {
        args.extend([
            "-S".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", path(BED_QMP_SOCKET)),
        ]);
    }
    args
}

/// The arrival of a migrated VM at a destination [`GuestSpec::paused_on_arrival`].
#[derive(Debug, Clone)]
pub struct Arrival {
    guest: String,
    monitor: PathBuf,
}

impl Arrival {
    /// Waits (at most `bound`) until the migrated VM has arrived and stays paused, keeps it
    /// paused for `hold`, then runs it. Returns when it arrived and when it was resumed.
    /// Polls the test bed's own monitor every 5 ms, so the arrival is seen within a few ms.
    pub fn hold(&self, hold: Duration, bound: Duration) -> Result<(Instant, Instant), GuestError> {
        let qmp_error = |source| GuestError::Qmp {
            guest: self.guest.clone(),
            source,
        };
        let mut qmp = Qmp::connect(&self.monitor, SOCKET_TIMEOUT).map_err(qmp_error)?;
        let end = Instant::now() + bound;
        let arrived = loop {
            let status = qmp
                .execute("query-status", Value::Null)
                .map_err(qmp_error)?;
            if status["status"] == "paused" {
                break Instant::now();
            }
            if Instant::now() >= end {
                return Err(GuestError::NeverArrived {
                    guest: self.guest.clone(),
                    bound,
                    status: status.to_string(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        std::thread::sleep(hold);
        qmp.execute("cont", Value::Null).map_err(qmp_error)?;
        Ok((arrived, Instant::now()))
    }
}

/// The second QMP monitor of a guest [`GuestSpec::paused_on_arrival`], the test bed's own.
const BED_QMP_SOCKET: &str = "bed-qmp.sock";

/// The QEMU id of a guest's vsock device ([`GuestSpec::vsock_cid`]).
pub const VSOCK_DEVICE: &str = "vsock0";

/// The chardev the vsock device speaks vhost-user over.
pub const VSOCK_CHARDEV: &str = "vs0";

/// The vsock device as QMP `device_add` arguments (as at start).
pub fn vsock_device_args() -> serde_json::Value {
    serde_json::json!({
        "driver": "vhost-user-vsock-pci",
        "chardev": VSOCK_CHARDEV,
        "id": VSOCK_DEVICE,
        "bus": "rp4",
    })
}

/// vhost-device-vsock's vhost-user socket in the guest's directory (QEMU connects to it).
const VHOST_VSOCK_SOCKET: &str = "vhost-vsock.sock";

/// Kills a helper that was started for a QEMU that then did not start.
struct HelperGuard(Option<Child>);

impl HelperGuard {
    fn take(mut self) -> Option<Child> {
        self.0.take()
    }
}

impl Drop for HelperGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts vhost-device-vsock (crates.io; scripts/setup.sh installs it) for guest CID `cid`
/// and waits until its vhost-user socket exists, so that QEMU finds it.
fn start_vhost_vsock(guest: &str, cid: u32, dir: &Path) -> Result<Child, GuestError> {
    let prepare = |source| GuestError::Prepare {
        guest: guest.to_owned(),
        dir: dir.to_owned(),
        source,
    };
    let log = fs::File::create(dir.join("vhost-vsock.log")).map_err(prepare)?;
    let log_err = log.try_clone().map_err(prepare)?;
    let socket = dir.join(VHOST_VSOCK_SOCKET);
    let mut child = Command::new("vhost-device-vsock")
        .arg("--guest-cid")
        .arg(cid.to_string())
        .arg("--socket")
        .arg(&socket)
        .arg("--uds-path")
        .arg(dir.join("vsock.sock"))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0)
        .spawn()
        .map_err(|source| GuestError::Spawn {
            guest: format!("{guest} (vhost-device-vsock: run scripts/setup.sh)"),
            source,
        })?;
    let end = Instant::now() + SOCKET_TIMEOUT;
    while !socket.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(GuestError::Exited {
                guest: format!("{guest} (vhost-device-vsock)"),
                status,
                log_tail: tail(&dir.join("vhost-vsock.log"), 20),
            });
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(GuestError::Prepare {
                guest: guest.to_owned(),
                dir: dir.to_owned(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("vhost-device-vsock created no {} in time", socket.display()),
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(child)
}

/// The last `lines` lines of a text file (lossy), or a note that it cannot be read.
fn tail(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("({} unreadable: {e})", path.display()),
    }
}
