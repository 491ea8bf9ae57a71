//! The host's channel into the agent: a virtio-serial port.
//!
//! The port is found by name, since there is no udev in minimal images to create
//! `/dev/virtio-ports/<name>`. It stays open for the agent's whole life: a read returns EOF
//! while no host is connected (for example between the source and the destination of a
//! migration), and closing the port would make the guest drop what the next host sends.
//! Bytes left over from a host that disconnected mid-frame are discarded on EOF.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::signal::{SigSet, Signal};

use rdmamig_proto::agent::{AgentRequest, AgentResponse, AgentResult};
use rdmamig_proto::message;
use rdmamig_proto::{Frame, FrameBuffer, FrameError};
use thiserror::Error;
use tracing::{debug, warn};

use super::Agent;

/// Where the kernel lists virtio-serial ports and their names.
pub const SYSFS_VIRTIO_PORTS: &str = "/sys/class/virtio-ports";

/// The longest a port without a host waits before reading again, should the kernel's
/// signal not come: a host that connects is then served this late at worst.
const HOST_WAIT_BOUND: Duration = Duration::from_secs(1);

/// Why the host channel could not be opened.
#[derive(Debug, Error)]
pub enum HostPortError {
    /// No virtio-serial port has that name.
    #[error("no virtio-serial port is named {name:?} (looked in {SYSFS_VIRTIO_PORTS})")]
    NotFound {
        /// The port name looked for.
        name: String,
    },
    /// The port's device node could not be opened.
    #[error("cannot open the virtio-serial port {path}")]
    Open {
        /// The device node.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Finds the device node (`/dev/vportNpM`) of the virtio-serial port called `name`.
pub fn find_port(sysfs: &Path, name: &str) -> Option<PathBuf> {
    fs::read_dir(sysfs).ok()?.flatten().find_map(|entry| {
        let port_name = fs::read_to_string(entry.path().join("name")).ok()?;
        (port_name.trim_end() == name).then(|| Path::new("/dev").join(entry.file_name()))
    })
}

/// Opens the port called `name`, waiting up to `timeout` for it to appear (the driver may
/// still be probing when the agent starts).
pub fn open_port(name: &str, timeout: Duration) -> Result<File, HostPortError> {
    let end = std::time::Instant::now() + timeout;
    let path = loop {
        if let Some(path) = find_port(Path::new(SYSFS_VIRTIO_PORTS), name) {
            break path;
        }
        if std::time::Instant::now() >= end {
            return Err(HostPortError::NotFound { name: name.into() });
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|source| HostPortError::Open {
            path: path.display().to_string(),
            source,
        })
}

/// Waits for a host to open its end of the port, without polling.
///
/// A read returns EOF at once while no host is connected, so reading again every 20 ms
/// kept the agent awake all the time: in a nested TCG VM that loop alone took a large share
/// of the VM's CPU, and the VM's own work (a new VF's probe) went that much slower.
/// virtio_console signals SIGIO to a port in async mode when the host opens its end
/// (VIRTIO_CONSOLE_PORT_OPEN). The signal goes to the serving thread only, where it is
/// blocked and taken with sigtimedwait: it interrupts nothing, and a host that connects
/// between the EOF and the wait leaves it pending, so the wait returns at once.
pub struct HostWait {
    signals: SigSet,
}

impl HostWait {
    /// Puts `port` in async mode with the calling thread as the signal's target: call it on
    /// the thread that serves the port. If the port refuses, the agent still serves it,
    /// reading again every [`HOST_WAIT_BOUND`] (logged).
    pub fn for_port(port: &File) -> HostWait {
        let mut signals = SigSet::empty();
        signals.add(Signal::SIGIO);
        if let Err(e) = signals.thread_block() {
            warn!("cannot block SIGIO in the host port's thread: {e}");
        }
        if let Err(e) = signal_this_thread(port) {
            warn!(
                "the host port does not signal a host's arrival ({e}): a host waits up to \
                 {} ms for its first answer",
                HOST_WAIT_BOUND.as_millis()
            );
        }
        HostWait { signals }
    }

    /// Returns once a host may have connected: on the port's signal, or after `bound`.
    fn wait(&self, bound: Duration) {
        let timeout = libc::timespec {
            tv_sec: bound.as_secs() as libc::time_t,
            tv_nsec: bound.subsec_nanos() as libc::c_long,
        };
        // SAFETY: the set and the timeout are live values of the types sigtimedwait reads,
        // and a null info pointer is allowed. Only SIGIO, blocked in this thread, is taken.
        unsafe { libc::sigtimedwait(self.signals.as_ref(), std::ptr::null_mut(), &timeout) };
    }
}

/// fcntl(2)'s `struct f_owner_ex`, and the two constants that go with it (Linux's
/// asm-generic/fcntl.h), which the libc crate does not have.
#[repr(C)]
struct OwnerEx {
    kind: libc::c_int,
    pid: libc::pid_t,
}
const F_SETOWN_EX: libc::c_int = 15;
const F_OWNER_TID: libc::c_int = 0;

/// Makes the kernel send SIGIO to the calling thread (not any thread of the process, as
/// plain F_SETOWN would) when `port`'s state changes.
fn signal_this_thread(port: &File) -> nix::Result<()> {
    let fd = port.as_raw_fd();
    let owner = OwnerEx {
        kind: F_OWNER_TID,
        pid: nix::unistd::gettid().as_raw(),
    };
    // SAFETY: F_SETOWN_EX reads one f_owner_ex (laid out as OwnerEx) through the pointer,
    // which is live for the call.
    if unsafe { libc::fcntl(fd, F_SETOWN_EX, &owner) } != 0 {
        return Err(nix::Error::last());
    }
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_ASYNC))?;
    Ok(())
}

/// What an end of stream means on this channel.
#[derive(Clone, Copy)]
pub enum OnEof<'a> {
    /// A virtio-serial port: no host right now; wait for one and read again.
    WaitForHost(&'a HostWait),
    /// An ordinary stream: the peer is gone; stop serving.
    Stop,
}

/// Serves host requests from `channel` until it ends (never, for a port).
pub fn serve<C: Read + Write>(channel: &mut C, agent: &Agent, on_eof: OnEof<'_>) {
    let mut frames = FrameBuffer::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = match channel.read(&mut chunk) {
            Ok(0) => {
                if !frames.is_empty() {
                    debug!(bytes = frames.len(), "host left mid-frame; discarding");
                    frames = FrameBuffer::new();
                }
                agent.host_left();
                match on_eof {
                    OnEof::Stop => return,
                    OnEof::WaitForHost(host) => {
                        host.wait(HOST_WAIT_BOUND);
                        continue;
                    }
                }
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!("reading the host channel failed: {e}");
                agent.host_left();
                match on_eof {
                    OnEof::Stop => return,
                    // Not a host's arrival, so no signal comes: the bound paces the retries.
                    OnEof::WaitForHost(host) => host.wait(HOST_WAIT_BOUND),
                }
                continue;
            }
        };
        frames.push(&chunk[..n]);
        loop {
            let response = match frames.pop() {
                Ok(frame) => match frame.decode::<AgentRequest>() {
                    Ok(request) => AgentResponse {
                        id: request.id,
                        result: agent.handle(request.command),
                    },
                    Err(e) => refusal(&e),
                },
                Err(FrameError::Incomplete { .. }) => break,
                Err(e) => {
                    frames.resync();
                    refusal(&e)
                }
            };
            if let Err(e) = channel.write_all(&encode(&response)) {
                warn!("answering the host failed: {e}");
            }
        }
    }
}

/// The answer's bytes: in pieces when it lists more connections than a frame holds
/// ([`message`]); an answer too large even for that says so instead.
fn encode(response: &AgentResponse) -> Vec<u8> {
    message::encode(response).unwrap_or_else(|e| {
        warn!("cannot send an answer to the host: {e}");
        Frame::encode(&AgentResponse {
            id: response.id,
            result: AgentResult::Error {
                message: format!("the answer cannot be sent: {e}"),
            },
        })
    })
}

/// The answer to bytes that are not a valid request: id 0, since none could be read.
fn refusal(error: &FrameError) -> AgentResponse {
    warn!("refused a request from the host: {error}");
    AgentResponse {
        id: 0,
        result: AgentResult::Error {
            message: format!("request refused: {error}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_port_by_name() {
        let sysfs = tempfile::tempdir().unwrap();
        for (dev, name) in [("vport1p1", "other"), ("vport2p1", "org.rdmamig.agent.0")] {
            fs::create_dir_all(sysfs.path().join(dev)).unwrap();
            fs::write(sysfs.path().join(dev).join("name"), format!("{name}\n")).unwrap();
        }
        assert_eq!(
            find_port(sysfs.path(), "org.rdmamig.agent.0"),
            Some(PathBuf::from("/dev/vport2p1"))
        );
        assert_eq!(find_port(sysfs.path(), "missing"), None);
    }
}
