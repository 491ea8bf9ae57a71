//! The forced release: when the host's unplug missed its deadline because some process
//! still holds the RDMA device, and the operator allowed it for this move, the agent makes
//! the holders let go so that the unplug completes.
//!
//! A holder is a process with an open descriptor on an RDMA device's uverbs node
//! (`/dev/infiniband/uverbs*`, found through `/proc/<pid>/fd`): that descriptor is what
//! keeps the kernel from finishing the unplug. A process that uses the connection library
//! is asked to quiesce again (it drops its device context and keeps its connections); any
//! other is sent SIGTERM and, if it still holds the device after the grace, SIGKILL. Every
//! holder is reported with its PID and what was done to it: the host records them in the
//! move's timeline. All of it is bounded by the host's deadline.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rdmamig_proto::agent::DeviceHolder;
use rdmamig_proto::app::AgentToApp;
use tracing::warn;

use super::apps::Apps;

/// Where the kernel lists processes.
pub const PROC: &str = "/proc";

/// The prefix of the device nodes that hold an RDMA device.
const UVERBS: &str = "/dev/infiniband/uverbs";

/// How often the holders are looked at again while waiting for them to let go.
const POLL: Duration = Duration::from_millis(20);

/// The processes under `proc_root` with a descriptor open on an RDMA device, with their
/// names, by PID; the agent itself is left out.
pub fn holders(proc_root: &Path) -> Vec<(u32, String)> {
    let me = std::process::id();
    let Ok(entries) = fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut found: Vec<(u32, String)> = entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let fds = fs::read_dir(entry.path().join("fd")).ok()?;
            let holds = fds.flatten().any(|fd| {
                fs::read_link(fd.path())
                    .is_ok_and(|target| target.to_string_lossy().starts_with(UVERBS))
            });
            (holds && pid != me).then(|| {
                let program = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
                (pid, program.trim_end().to_string())
            })
        })
        .collect();
    found.sort();
    found
}

/// Makes every holder under `proc_root` let go: library processes registered in `apps` are
/// asked to quiesce, the others get SIGTERM, then SIGKILL after `grace`; waits (until
/// `deadline`) for them to let go and reports each.
pub fn release(
    apps: &Apps,
    proc_root: &Path,
    grace: Duration,
    deadline: Instant,
) -> Vec<DeviceHolder> {
    let held = holders(proc_root);
    let library: Vec<u32> = apps.pids();
    let mut report: Vec<DeviceHolder> = held
        .iter()
        .map(|(pid, program)| DeviceHolder {
            pid: *pid,
            program: program.clone(),
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
    let still = |pid: u32| holders(proc_root).iter().any(|(p, _)| *p == pid);
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
    fn holders_are_the_processes_with_a_uverbs_node_open() {
        let root = tempfile::tempdir().unwrap();
        process(
            root.path(),
            40,
            "ibv_rc_pingpong",
            &["/dev/null", "/dev/infiniband/uverbs0"],
        );
        process(root.path(), 41, "sshd", &["/dev/null", "socket:[123]"]);
        process(root.path(), 42, "app", &["/dev/infiniband/rdma_cm"]);
        process(root.path(), 43, "app2", &["/dev/infiniband/uverbs1"]);
        fs::create_dir_all(root.path().join("self")).unwrap();
        assert_eq!(
            holders(root.path()),
            [
                (40, "ibv_rc_pingpong".to_string()),
                (43, "app2".to_string())
            ]
        );
        assert!(holders(&root.path().join("missing")).is_empty());
    }

    #[test]
    fn nothing_held_releases_at_once() {
        let root = tempfile::tempdir().unwrap();
        process(root.path(), 41, "sshd", &["/dev/null"]);
        let start = Instant::now();
        let report = release(
            &Apps::new(),
            root.path(),
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(5),
        );
        assert!(report.is_empty());
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}
