//! The device watcher: one thread per process that refreshes the device list when the
//! kernel announces an RDMA or network device coming or going, instead of every connection
//! refreshing it on a timer while it holds no device.
//!
//! The refresh is what releases the cached context of a vanished device, which the device's
//! hot-unplug waits for ([`refresh_device_list`]), and what tells librdmacm of a new device
//! before an old one with the same GUID can be picked for it. Both must happen promptly,
//! but on a TCG guest a timer costs CPU all the time: 10 refreshes a second per connection
//! were most of an idle library process's CPU. The kernel's uevents (a netlink socket,
//! which needs no privilege to read) say exactly when; where they may not come, a look
//! every [`LOOK_ANYWAY`] for a vanished device (a stat) bounds the wait. Where no uevent
//! socket can be opened, the watcher refreshes every [`RETRY`].

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::OnceLock;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    bind, recv, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

use crate::context::{eviction_pending, refresh_device_list};

/// How often the watcher refreshes while a vanished device's context still has objects on
/// it (their owner refreshes once it released them; this is the backstop), and always
/// when uevents cannot be read.
const RETRY: Duration = Duration::from_millis(100);

/// How often the watcher looks for a vanished device even when no uevent came (a stat per
/// cached context, no refresh unless one is gone): the kernel sends the uevents of RDMA
/// devices only to network namespaces of the initial user namespace, so a process in a
/// container with a user namespace of its own never gets them.
const LOOK_ANYWAY: Duration = Duration::from_secs(1);

/// The netlink multicast group of the kernel's own uevents (udev's rebroadcasts are 2).
const KERNEL_UEVENTS: u32 = 1;

/// Starts the process's device watcher, once; later calls do nothing.
pub(crate) fn ensure_watching() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let socket = match uevent_socket() {
            Ok(s) => Some(s),
            Err(error) => {
                tracing::warn!(%error, "no uevent socket: the RDMA device list is refreshed every 100 ms instead");
                None
            }
        };
        if let Err(error) = std::thread::Builder::new()
            .name("rdmamig-devices".into())
            .spawn(move || watch(socket))
        {
            tracing::warn!(%error, "no device watcher thread: a vanished device's context is released only when a connection refreshes");
        }
    });
}

fn uevent_socket() -> nix::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkKObjectUEvent,
    )?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, KERNEL_UEVENTS))?;
    Ok(fd)
}

fn watch(socket: Option<OwnedFd>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let changed = match &socket {
            Some(s) => {
                let wait = if eviction_pending() {
                    RETRY
                } else {
                    LOOK_ANYWAY
                };
                let timeout = PollTimeout::from(wait.as_millis() as u16);
                let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
                match poll(&mut fds, timeout) {
                    Ok(0) => false,
                    Ok(_) => drain(s, &mut buf),
                    Err(nix::errno::Errno::EINTR) => false,
                    Err(error) => {
                        tracing::warn!(%error, "polling the uevent socket failed");
                        std::thread::sleep(RETRY);
                        true
                    }
                }
            }
            None => {
                std::thread::sleep(RETRY);
                true
            }
        };
        // Looked at after the wait: a device that vanished without a uevent is released
        // now, not one wait later.
        if changed || eviction_pending() {
            let _ = refresh_device_list();
        }
    }
}

/// Reads every queued uevent; says whether one was about a device the list depends on.
/// A lost uevent (the socket's buffer overflowed) counts as one.
fn drain(socket: &OwnedFd, buf: &mut [u8]) -> bool {
    let mut relevant = false;
    loop {
        match recv(socket.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
            Ok(n) => relevant |= is_device_event(&buf[..n]),
            Err(nix::errno::Errno::EAGAIN) => return relevant,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return true,
        }
    }
}

/// A kernel uevent (`ACTION@DEVPATH`, then `KEY=VALUE` fields, each NUL-terminated) about
/// an RDMA device, its verbs node, or a network device (Soft-RoCE follows its netdev).
fn is_device_event(msg: &[u8]) -> bool {
    msg.split(|b| *b == 0).any(|field| {
        matches!(
            field,
            b"SUBSYSTEM=infiniband" | b"SUBSYSTEM=infiniband_verbs" | b"SUBSYSTEM=net"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uevent(fields: &[&str]) -> Vec<u8> {
        fields.iter().flat_map(|f| f.bytes().chain([0])).collect()
    }

    #[test]
    fn rdma_and_network_devices_count_and_others_do_not() {
        for subsystem in ["infiniband", "infiniband_verbs", "net"] {
            let msg = uevent(&[
                "remove@/devices/virtual/infiniband_verbs/uverbs0",
                "ACTION=remove",
                &format!("SUBSYSTEM={subsystem}"),
                "SEQNUM=1234",
            ]);
            assert!(is_device_event(&msg), "{subsystem}");
        }
        for subsystem in ["block", "pci", "infiniband_mad", "netfoo"] {
            let msg = uevent(&[
                "add@/devices/x",
                "ACTION=add",
                &format!("SUBSYSTEM={subsystem}"),
            ]);
            assert!(!is_device_event(&msg), "{subsystem}");
        }
        // A value that only mentions the subsystem elsewhere is not one.
        assert!(!is_device_event(&uevent(&["DEVPATH=/SUBSYSTEM=net"])));
        assert!(!is_device_event(b""));
    }
}
