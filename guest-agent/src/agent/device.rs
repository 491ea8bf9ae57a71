//! Waiting for a usable RDMA device.
//!
//! After a move the new NIC appears in the guest and the image's own network
//! configuration (udev, NetworkManager, or the test-bed image's netplug hook) brings it up.
//! The agent only waits, bounded, until some RDMA port is ACTIVE before it tells the
//! applications to reconnect, so that their first connect attempt has a device to use.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where the kernel lists RDMA devices.
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// An RDMA port the kernel reports as ACTIVE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivePort {
    /// The RDMA device, e.g. `rxe_eth0` or `mlx5_1`.
    pub device: String,
    /// The port number.
    pub port: u32,
}

/// Lists the ACTIVE ports under `root` (normally [`SYSFS_INFINIBAND`]).
pub fn active_ports(root: &Path) -> Vec<ActivePort> {
    let mut found = Vec::new();
    let Ok(devices) = fs::read_dir(root) else {
        return found;
    };
    for device in devices.flatten() {
        let ports_dir: PathBuf = device.path().join("ports");
        let Ok(ports) = fs::read_dir(&ports_dir) else {
            continue;
        };
        for port in ports.flatten() {
            let state = fs::read_to_string(port.path().join("state")).unwrap_or_default();
            // The kernel writes e.g. "4: ACTIVE".
            if state.trim_end().ends_with("ACTIVE") {
                if let Ok(number) = port.file_name().to_string_lossy().parse() {
                    found.push(ActivePort {
                        device: device.file_name().to_string_lossy().into_owned(),
                        port: number,
                    });
                }
            }
        }
    }
    found.sort_by(|a, b| (&a.device, a.port).cmp(&(&b.device, b.port)));
    found
}

/// The first pause between two looks at the ports: a port that comes up at once (a
/// function that kept its link) is seen within it.
const FIRST_POLL: Duration = Duration::from_millis(10);

/// Waits until some port under `root` is ACTIVE, for at most `timeout`. Returns the active
/// ports, or `None` when the time ran out.
///
/// The pause between looks starts at [`FIRST_POLL`] and doubles up to `longest`: a new
/// function's link takes seconds on hardware and minutes in a nested test-bed VM, where a
/// look every 10 ms for all that time was work the VM's own bring-up had to share the CPU
/// with.
pub fn wait_for_active_port(
    root: &Path,
    timeout: Duration,
    longest: Duration,
) -> Option<Vec<ActivePort>> {
    let end = Instant::now() + timeout;
    let mut pause = FIRST_POLL.min(longest);
    loop {
        let ports = active_ports(root);
        if !ports.is_empty() {
            return Some(ports);
        }
        let now = Instant::now();
        if now >= end {
            return None;
        }
        std::thread::sleep(pause.min(end - now));
        pause = (pause * 2).min(longest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(root: &Path, device: &str, port: u32, state: &str) {
        let dir = root.join(device).join("ports").join(port.to_string());
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("state"), state).unwrap();
    }

    #[test]
    fn only_active_ports_count() {
        let root = tempfile::tempdir().unwrap();
        port(root.path(), "rxe_eth0", 1, "1: DOWN\n");
        assert!(active_ports(root.path()).is_empty());
        port(root.path(), "rxe_eth1", 1, "4: ACTIVE\n");
        assert_eq!(
            active_ports(root.path()),
            vec![ActivePort {
                device: "rxe_eth1".into(),
                port: 1
            }]
        );
    }

    #[test]
    fn waiting_is_bounded() {
        let root = tempfile::tempdir().unwrap();
        let start = Instant::now();
        let got = wait_for_active_port(
            root.path(),
            Duration::from_millis(60),
            Duration::from_millis(10),
        );
        assert!(got.is_none());
        assert!(start.elapsed() < Duration::from_secs(2));
    }
}
