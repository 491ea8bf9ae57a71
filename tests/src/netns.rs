//! The test bed's private network: a network namespace holding a bridge and the guests' taps.
//!
//! Every test bed gets its own namespace, so guest traffic (10.77.0.0/24) never reaches the
//! host's network or another test running at the same time, and interface names inside it
//! (`br0`, `tap0`, ...) cannot collide. Deleting the namespace removes its bridge and taps with
//! it. Everything is done with iproute2's `ip`, as an operator would.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Errors of namespace management.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// `ip` could not be run.
    #[error("running `ip {args}`")]
    Spawn {
        /// The arguments given to ip.
        args: String,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// An `ip` command failed.
    #[error("`ip {args}` failed: {stderr}")]
    Command {
        /// The arguments given to ip.
        args: String,
        /// What ip printed on stderr.
        stderr: String,
    },
}

/// A network namespace with a bridge `br0`, deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    next_tap: AtomicU32,
}

/// The bridge every tap joins.
pub const BRIDGE: &str = "br0";

impl NetNs {
    /// Creates namespace `name` with loopback and bridge [`BRIDGE`] up.
    pub fn create(name: &str) -> Result<NetNs, NetnsError> {
        ip(&["netns", "add", name])?;
        let ns = NetNs {
            name: name.to_owned(),
            next_tap: AtomicU32::new(0),
        };
        // From here on, drop deletes the namespace again if a step fails.
        ns.ip(&["link", "set", "lo", "up"])?;
        ns.ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        ns.ip(&["link", "set", BRIDGE, "up"])?;
        Ok(ns)
    }

    /// The namespace's name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates the next tap (`tap0`, `tap1`, ...), attached to the bridge and up, and returns
    /// its name.
    pub fn add_tap(&self) -> Result<String, NetnsError> {
        let tap = format!("tap{}", self.next_tap.fetch_add(1, Ordering::Relaxed));
        self.ip(&["tuntap", "add", "dev", &tap, "mode", "tap"])?;
        self.ip(&["link", "set", &tap, "master", BRIDGE, "up"])?;
        Ok(tap)
    }

    /// Takes `tap` off the bridge (`joined` false: nothing it sends reaches anyone) or puts
    /// it back.
    pub fn set_tap_joined(&self, tap: &str, joined: bool) -> Result<(), NetnsError> {
        set_tap_joined(&self.name, tap, joined)
    }

    /// Gives the bridge an address (`10.78.0.254/24`): the harness's own, for reaching
    /// guests over TCP ([`connect_tcp`]).
    pub fn add_bridge_address(&self, cidr: &str) -> Result<(), NetnsError> {
        self.ip(&["addr", "add", cidr, "dev", BRIDGE]).map(drop)
    }

    /// Runs `ip -n <ns> <args>`.
    fn ip(&self, args: &[&str]) -> Result<String, NetnsError> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(err) = ip(&["netns", "delete", &self.name]) {
            eprintln!("rdmamig-testbed: deleting network namespace: {err}");
        }
    }
}

/// Takes `tap` of namespace `netns` off its bridge, or puts it back (for a thread that
/// holds no [`NetNs`]).
pub fn set_tap_joined(netns: &str, tap: &str, joined: bool) -> Result<(), NetnsError> {
    let master = if joined { "master" } else { "nomaster" };
    let mut args = vec!["-n", netns, "link", "set", tap, master];
    if joined {
        args.push(BRIDGE);
    }
    ip(&args).map(drop)
}

/// The prefix of every test-bed namespace name: `rmg<pid>n<counter>`.
pub const NAME_PREFIX: &str = "rmg";

/// The name for test bed number `counter` of this process.
pub fn namespace_name(counter: u32) -> String {
    format!("{NAME_PREFIX}{}n{counter}", std::process::id())
}

/// The harness process a test-bed namespace name belongs to, if the name is one of ours.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let (pid, counter) = rest.split_once('n')?;
    counter.parse::<u32>().ok()?;
    pid.parse().ok()
}

/// Removes the namespaces of test beds whose harness process is gone (killed before its
/// `Drop` ran, e.g. by Ctrl-C), SIGKILLing the processes still inside them (their QEMUs).
/// Returns the names removed. Namespaces of live harnesses are left alone.
pub fn sweep_stale() -> Result<Vec<String>, NetnsError> {
    let mut removed = Vec::new();
    for line in ip(&["netns", "list"])?.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = owner_pid(name) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        for process in ip(&["netns", "pids", name])?.split_whitespace() {
            if let Ok(process) = process.parse::<i32>() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(process),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        ip(&["netns", "delete", name])?;
        removed.push(name.to_owned());
    }
    Ok(removed)
}

/// Connects to `address` from inside namespace `netns` (a socket stays in the namespace it
/// was created in): a thread of its own enters the namespace, so the caller's stays put.
pub fn connect_tcp(
    netns: &str,
    address: std::net::SocketAddr,
    timeout: std::time::Duration,
) -> std::io::Result<std::net::TcpStream> {
    let path = format!("/run/netns/{netns}");
    std::thread::scope(|s| {
        s.spawn(|| {
            let namespace = std::fs::File::open(&path)?;
            nix::sched::setns(namespace, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)?;
            std::net::TcpStream::connect_timeout(&address, timeout)
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the connecting thread panicked")))
    })
}

/// Runs `ip <args>` and returns its stdout.
fn ip(args: &[&str]) -> Result<String, NetnsError> {
    let joined = args.join(" ");
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| NetnsError::Spawn {
            args: joined.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(NetnsError::Command {
            args: joined,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_names_have_owners() {
        assert_eq!(owner_pid(&namespace_name(3)), Some(std::process::id()));
        assert_eq!(owner_pid("rmg123n0"), Some(123));
        assert_eq!(owner_pid("rmg123"), None);
        assert_eq!(owner_pid("rmgxn1"), None);
        assert_eq!(owner_pid("other"), None);
    }
}
