//! The guest's RDMA programs, seen from outside: which processes hold an RDMA device, which
//! of them are not the connection library's (the programs a move would break), and making
//! them let go when the move's policy (`release`) says so.
//!
//! A holder is a process with an open descriptor on an RDMA device file, found through
//! `/proc/<pid>/fd`: a verbs context (`/dev/infiniband/uverbs*`), which keeps the kernel from
//! finishing the unplug, or the connection manager (`/dev/infiniband/rdma_cm`), whose
//! connections break with the device. A process that uses the connection library is asked
//! to quiesce again (it drops its device context and keeps its connections); any other is
//! sent SIGTERM and, if it still holds the device after the grace, SIGKILL. Every holder is
//! reported with its PID and what was done to it: the host records them in the move's
//! report. All of it is bounded by the host's deadline.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rdmamig_proto::agent::{DeviceHolder, ReleaseScope, UnmanagedProgram, COMMAND_LEN};
use rdmamig_proto::app::AgentToApp;
use rdmamig_proto::text::printable;
use tracing::warn;

use super::apps::Apps;

/// Where the kernel lists processes.
pub const PROC: &str = "/proc";

/// Where RDMA device files live.
const DEVICE_DIR: &str = "/dev/infiniband/";

/// The prefix of the device files that are verbs contexts.
const UVERBS: &str = "uverbs";

/// How often the holders are looked at again while waiting for them to let go.
const POLL: Duration = Duration::from_millis(20);

/// A process with RDMA device files open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its PID.
    pub pid: u32,
    /// Its name (`comm`).
    pub program: String,
    /// Its command line, made safe to show ([`UnmanagedProgram::command`]).
    pub command: String,
    /// The device files, by name (`uverbs0`, `rdma_cm`), sorted, each once.
    pub devices: Vec<String>,
}

impl Holder {
    /// It has a verbs context open, which holds the unplug.
    pub fn open_context(&self) -> bool {
        self.devices.iter().any(|d| d.starts_with(UVERBS))
    }
}

/// The processes under `proc_root` with an RDMA device file open, by PID; the agent itself
/// is left out.
pub fn holders(proc_root: &Path) -> Vec<Holder> {
    let me = std::process::id();
    let Ok(entries) = fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut found: Vec<Holder> = entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let fds = fs::read_dir(entry.path().join("fd")).ok()?;
            let mut devices: Vec<String> = fds
                .flatten()
                .filter_map(|fd| {
                    let target = fs::read_link(fd.path()).ok()?;
                    let name = target.to_str()?.strip_prefix(DEVICE_DIR)?;
                    Some(name.to_string())
                })
                .collect();
            devices.sort();
            devices.dedup();
            (!devices.is_empty() && pid != me).then(|| {
                let program = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
                let command = fs::read(entry.path().join("cmdline")).unwrap_or_default();
                Holder {
                    pid,
                    program: program.trim_end().to_string(),
                    command: shown_command(&command),
                    devices,
                }
            })
        })
        .collect();
    found.sort_by_key(|h| h.pid);
    found
}

/// The holders under `proc_root` that are not processes registered in `apps` that a move
/// can carry.
pub fn unmanaged(apps: &Apps, proc_root: &Path) -> Vec<UnmanagedProgram> {
    let library = apps.carried_pids();
    holders(proc_root)
        .into_iter()
        .filter(|h| !library.contains(&h.pid))
        .map(|h| UnmanagedProgram {
            pid: h.pid,
            open_context: h.open_context(),
            command: h.command,
            devices: h.devices,
        })
        .collect()
}

/// A command line from `/proc/<pid>/cmdline` (NUL-separated) as one line an operator's
/// terminal can show: arguments joined by spaces, then [`printable`].
fn shown_command(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    printable(&text.trim_end_matches('\0').replace('\0', " "), COMMAND_LEN)
}

/// Makes the holders under `proc_root` in `scope` let go: library processes registered in
/// `apps` are asked to quiesce (they keep `rdma_cm` open for their listeners; only a verbs
/// context holds the unplug), the others get SIGTERM, then SIGKILL after `grace`; waits
/// (until `deadline`) for them to let go and reports each.
pub fn release(
    apps: &Apps,
    proc_root: &Path,
    scope: ReleaseScope,
    grace: Duration,
    deadline: Instant,
) -> Vec<DeviceHolder> {
    let library: Vec<u32> = apps.carried_pids();
    let holding = |h: &Holder| match (library.contains(&h.pid), scope) {
        (false, _) => true,
        (true, ReleaseScope::AllHolders) => h.open_context(),
        (true, ReleaseScope::Unmanaged) => false,
    };
    let mut report: Vec<DeviceHolder> = holders(proc_root)
        .into_iter()
        .filter(holding)
        .map(|holder| DeviceHolder {
            pid: holder.pid,
            program: holder.program,
            action: String::new(),
            released: false,
        })
        .collect();
    let (asked, signalled): (Vec<&mut DeviceHolder>, Vec<&mut DeviceHolder>) =
        report.iter_mut().partition(|h| library.contains(&h.pid));
    if !asked.is_empty() {
        let until = deadline.min(Instant::now() + grace);
        let remaining = until.saturating_duration_since(Instant::now()).as_millis() as u64;
        apps.drive(
            // A process already bridging keeps its bridge: this quiesce only drops the
            // device context again.
            |request| AgentToApp::Quiesce {
                request,
                deadline_ms: remaining,
                bridge: false,
                hot: false,
            },
            until,
        );
        for holder in asked {
            holder.action = "asked to quiesce (rdmamig library)".into();
        }
    }
    for holder in signalled {
        holder.action = match kill(Pid::from_raw(holder.pid as i32), Signal::SIGTERM) {
            Ok(()) => "SIGTERM".into(),
            Err(e) => format!("SIGTERM failed: {e}"),
        };
    }
    let grace_end = deadline.min(Instant::now() + grace);
    let still = |pid: u32| {
        holders(proc_root)
            .iter()
            .any(|h| h.pid == pid && holding(h))
    };
    wait_until(grace_end, || report.iter().all(|h| !still(h.pid)));
    for holder in report.iter_mut() {
        if holder.action == "SIGTERM" && still(holder.pid) {
            holder.action = match kill(Pid::from_raw(holder.pid as i32), Signal::SIGKILL) {
                Ok(()) => format!("SIGTERM, SIGKILL after {} ms", grace.as_millis()),
                Err(e) => format!("SIGTERM, SIGKILL failed: {e}"),
            };
        }
    }
    wait_until(deadline, || report.iter().all(|h| !still(h.pid)));
    for holder in report.iter_mut() {
        holder.released = !still(holder.pid);
        if !holder.released {
            warn!(pid = holder.pid, program = %holder.program, "still holds the RDMA device");
        }
    }
    report
}

fn wait_until(end: Instant, mut done: impl FnMut() -> bool) {
    while !done() && Instant::now() < end {
        std::thread::sleep(POLL.min(end.saturating_duration_since(Instant::now())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake process `pid` named `program` with descriptors pointing at `targets`.
    fn process(root: &Path, pid: u32, program: &str, targets: &[&str]) {
        let dir = root.join(pid.to_string());
        fs::create_dir_all(dir.join("fd")).unwrap();
        fs::write(dir.join("comm"), format!("{program}\n")).unwrap();
        for (fd, target) in targets.iter().enumerate() {
            symlink(target, dir.join("fd").join(fd.to_string())).unwrap();
        }
    }

    #[test]
    fn holders_are_the_processes_with_an_rdma_device_file_open() {
        let root = tempfile::tempdir().unwrap();
        process(
            root.path(),
            40,
            "ibv_rc_pingpong",
            &["/dev/null", "/dev/infiniband/uverbs0"],
        );
        process(root.path(), 41, "sshd", &["/dev/null", "socket:[123]"]);
        process(root.path(), 42, "rping", &["/dev/infiniband/rdma_cm"]);
        process(
            root.path(),
            43,
            "app2",
            &[
                "/dev/infiniband/uverbs1",
                "/dev/infiniband/rdma_cm",
                "/dev/infiniband/uverbs1",
            ],
        );
        fs::create_dir_all(root.path().join("self")).unwrap();
        let found = holders(root.path());
        let summary: Vec<(u32, &str, Vec<&str>, bool)> = found
            .iter()
            .map(|h| {
                let devices = h.devices.iter().map(String::as_str).collect();
                (h.pid, h.program.as_str(), devices, h.open_context())
            })
            .collect();
        assert_eq!(
            summary,
            [
                (40, "ibv_rc_pingpong", vec!["uverbs0"], true),
                (42, "rping", vec!["rdma_cm"], false),
                (43, "app2", vec!["rdma_cm", "uverbs1"], true),
            ]
        );
        assert!(holders(&root.path().join("missing")).is_empty());
    }

    #[test]
    fn unmanaged_programs_are_the_holders_the_library_does_not_know() {
        let root = tempfile::tempdir().unwrap();
        process(root.path(), 42, "rping", &["/dev/infiniband/rdma_cm"]);
        fs::write(
            root.path().join("42/cmdline"),
            b"rping\0-c\0-a\x1b[2J10.0.0.1\0",
        )
        .unwrap();
        let programs = unmanaged(&Apps::new(), root.path());
        assert_eq!(programs.len(), 1);
        assert_eq!(programs[0].pid, 42);
        assert_eq!(programs[0].command, "rping -c -a?[2J10.0.0.1");
        assert_eq!(programs[0].devices, ["rdma_cm"]);
        assert!(!programs[0].open_context);
    }

    #[test]
    fn a_long_command_line_is_cut_and_says_so() {
        let shown = shown_command(&vec![b'x'; COMMAND_LEN * 2]);
        assert_eq!(shown.chars().count(), COMMAND_LEN + 1);
        assert!(shown.ends_with('…'));
        assert_eq!(shown_command(b"a\0b\0"), "a b");
    }

    #[test]
    fn nothing_held_releases_at_once() {
        let root = tempfile::tempdir().unwrap();
        process(root.path(), 41, "sshd", &["/dev/null"]);
        let start = Instant::now();
        let report = release(
            &Apps::new(),
            root.path(),
            ReleaseScope::AllHolders,
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(5),
        );
        assert!(report.is_empty());
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}
