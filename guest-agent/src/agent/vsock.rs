//! The host's channel into the agent over AF_VSOCK, for VMMs without virtio-serial.
//!
//! Cloud Hypervisor (and vhost-device-vsock under QEMU) give the host a hybrid vsock: the
//! host writes `CONNECT <port>` to a UNIX socket and the VMM connects it to the guest's
//! AF_VSOCK listener on that port. The protocol on the stream is the one the virtio-serial
//! port carries ([`super::host::serve`]), so the same image serves both VMMs. Unlike the
//! port, a vsock connection has a real end: EOF means that host is gone, and the next host
//! (the destination's, after a migration) connects anew. Each connection is served on its
//! own thread so that a host that keeps a dead connection open blocks no other.
//!
//! Only the host may connect: the channel can ask the agent to release the device, which
//! ends processes. The listener binds any CID (the host reaches the guest at the guest's
//! own CID), so every connection's peer is checked: the host is `VMADDR_CID_HOST` (2); a
//! process in the guest dialing the port over vsock loopback (CID 1) or another VM is
//! refused and closed at once, and the refusal logged.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::sys::socket::{
    accept, bind, getpeername, listen, socket, AddressFamily, Backlog, SockFlag, SockType,
    VsockAddr,
};
use thiserror::Error;
use tracing::{info, warn};

use super::host::{self, OnEof};
use super::Agent;

/// Why the vsock listener could not be set up.
#[derive(Debug, Error)]
pub enum VsockListenError {
    /// socket(AF_VSOCK) failed: the kernel has no vsock support (load
    /// vmw_vsock_virtio_transport).
    #[error("cannot create an AF_VSOCK socket (is vmw_vsock_virtio_transport loaded?)")]
    Socket(#[source] nix::Error),
    /// bind or listen failed.
    #[error("cannot listen on vsock port {port}")]
    Listen {
        /// The port.
        port: u32,
        /// What the kernel said.
        #[source]
        source: nix::Error,
    },
}

/// A listening AF_VSOCK socket.
#[derive(Debug)]
pub struct VsockListener {
    fd: OwnedFd,
    port: u32,
}

/// Listens on vsock `port` for any CID (the host reaches the guest as its own CID).
pub fn listen_on(port: u32) -> Result<VsockListener, VsockListenError> {
    let fd = socket(
        AddressFamily::Vsock,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(VsockListenError::Socket)?;
    let addr = VsockAddr::new(libc::VMADDR_CID_ANY, port);
    bind(fd.as_raw_fd(), &addr).map_err(|source| VsockListenError::Listen { port, source })?;
    listen(&fd, Backlog::new(4).unwrap_or(Backlog::MAXCONN))
        .map_err(|source| VsockListenError::Listen { port, source })?;
    Ok(VsockListener { fd, port })
}

impl VsockListener {
    /// The port listened on.
    pub fn port(&self) -> u32 {
        self.port
    }

    /// Serves every host that connects, each on its own thread, for as long as the process
    /// lives.
    pub fn serve(&self, agent: &Agent) {
        std::thread::scope(|scope| loop {
            let raw = match accept(self.fd.as_raw_fd()) {
                Ok(raw) => raw,
                Err(nix::Error::EINTR) => continue,
                Err(e) => {
                    warn!(port = self.port, "vsock accept failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    continue;
                }
            };
            // SAFETY: accept() just returned `raw` as a new descriptor that nothing else
            // owns; the File takes sole ownership and closes it once.
            let mut stream = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
            let peer = getpeername::<VsockAddr>(stream.as_raw_fd()).map(|addr| addr.cid());
            match peer {
                Ok(cid) if is_host(cid) => {}
                Ok(cid) => {
                    warn!(
                        port = self.port,
                        cid, "refused a vsock connection that is not the host's (CID 2)"
                    );
                    continue;
                }
                Err(e) => {
                    warn!(
                        port = self.port,
                        "refused a vsock connection of unknown peer: {e}"
                    );
                    continue;
                }
            }
            info!(port = self.port, "host connected over vsock");
            scope.spawn(move || {
                host::serve(&mut stream, agent, OnEof::Stop);
                info!("vsock host disconnected");
            });
        })
    }
}

/// Whether a vsock peer is the host: only `VMADDR_CID_HOST` is (not the guest itself over
/// loopback, `VMADDR_CID_LOCAL`, and not another VM).
pub fn is_host(cid: u32) -> bool {
    cid == libc::VMADDR_CID_HOST
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_host_may_connect() {
        assert!(is_host(2));
        for cid in [0, 1, 3, 42, u32::MAX] {
            assert!(!is_host(cid), "CID {cid}");
        }
    }
}
