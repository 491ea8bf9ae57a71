//! The host's channel into the agent: a virtio-serial port.
//!
//! The port is found by name, since there is no udev in minimal images to create
//! `/dev/virtio-ports/<name>`. It stays open for the agent's whole life: a read returns EOF
//! while no host is connected (for example between the source and the destination of a
//! migration), and closing the port would make the guest drop what the next host sends.
//! Bytes left over from a host that disconnected mid-frame are discarded on EOF.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rdmamig_proto::agent::{AgentRequest, AgentResponse, AgentResult};
use rdmamig_proto::{Frame, FrameBuffer, FrameError};
use thiserror::Error;
use tracing::{debug, warn};

use super::Agent;

/// Where the kernel lists virtio-serial ports and their names.
pub const SYSFS_VIRTIO_PORTS: &str = "/sys/class/virtio-ports";

/// How long to wait before reading again while no host is connected.
const IDLE_POLL: Duration = Duration::from_millis(20);

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

/// What an end of stream means on this channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnEof {
    /// A virtio-serial port: no host right now; wait and read again.
    WaitForHost,
    /// An ordinary stream: the peer is gone; stop serving.
    Stop,
}

/// Serves host requests from `channel` until it ends (never, for a port).
pub fn serve<C: Read + Write>(channel: &mut C, agent: &Agent, on_eof: OnEof) {
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
                    OnEof::WaitForHost => {
                        std::thread::sleep(IDLE_POLL);
                        continue;
                    }
                }
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!("reading the host channel failed: {e}");
                agent.host_left();
                if on_eof == OnEof::Stop {
                    return;
                }
                std::thread::sleep(IDLE_POLL);
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
            if let Err(e) = channel.write_all(&Frame::encode(&response)) {
                warn!("answering the host failed: {e}");
            }
        }
    }
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
