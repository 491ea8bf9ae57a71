//! Safe owning wrappers over librdmacm and libibverbs (rdma-sys).
//!
//! This is the only module of the crate with `unsafe` code. Every object that owns a verbs
//! or rdma_cm resource releases it in `Drop`, and dependencies are held by ownership so the
//! release order is always right:
//! - a [`CmId`] holds its [`EventChannel`] alive; the QP created on it
//!   ([`CmId::create_qp`]) holds its [`ProtectionDomain`] and [`CompletionQueue`] alive, and
//!   is destroyed before the id;
//! - a [`CompletionQueue`] holds its [`CompletionChannel`];
//! - a [`MemoryRegion`] owns its buffer and holds its [`ProtectionDomain`], so the PD is
//!   freed only after its last MR is deregistered.
//!
//! An explicit teardown (quiesce) drops, in this order: QP (via [`CmId::destroy_qp`]), CQ,
//! MRs, PD, cm id, channels. [`refresh_device_list`] then lets librdmacm close the device
//! context it caches for a device that is going away (see docs/architecture.md).

mod cm;
mod ib;

pub use cm::{refresh_device_list, CmEvent, CmEventKind, CmId, EventChannel, IdKey};
pub use cm::{RdmaOp, SendWr};
pub use ib::{
    CompletionChannel, CompletionQueue, ExposedMemory, ExposedRegion, MemoryRegion,
    ProtectionDomain, QpCaps, RemoteAccess, WcOpcode, WorkCompletion,
};

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use tokio::io::unix::AsyncFd;

use thiserror::Error;

/// What failed in a verbs or rdma_cm call. The source is the errno read right after the call.
#[derive(Debug, Error)]
pub enum VerbsError {
    /// rdma_create_event_channel failed.
    #[error("rdma_create_event_channel failed")]
    CreateEventChannel(#[source] io::Error),
    /// Making a channel's descriptor non-blocking failed.
    #[error("setting the {what} descriptor non-blocking failed")]
    SetNonBlocking {
        /// Which channel.
        what: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// rdma_create_id failed.
    #[error("rdma_create_id failed")]
    CreateId(#[source] io::Error),
    /// rdma_set_option failed.
    #[error("rdma_set_option({option}) failed")]
    SetOption {
        /// The option.
        option: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// rdma_bind_addr failed.
    #[error("rdma_bind_addr({addr}) failed")]
    Bind {
        /// The local address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// rdma_listen failed.
    #[error("rdma_listen failed")]
    Listen(#[source] io::Error),
    /// rdma_resolve_addr failed to start.
    #[error("rdma_resolve_addr({peer}) failed")]
    ResolveAddr {
        /// The peer address.
        peer: SocketAddr,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// rdma_resolve_route failed to start.
    #[error("rdma_resolve_route failed")]
    ResolveRoute(#[source] io::Error),
    /// rdma_connect failed.
    #[error("rdma_connect failed")]
    Connect(#[source] io::Error),
    /// rdma_accept failed.
    #[error("rdma_accept failed")]
    Accept(#[source] io::Error),
    /// rdma_reject failed.
    #[error("rdma_reject failed")]
    Reject(#[source] io::Error),
    /// rdma_disconnect failed.
    #[error("rdma_disconnect failed")]
    Disconnect(#[source] io::Error),
    /// rdma_migrate_id failed.
    #[error("rdma_migrate_id failed")]
    MigrateId(#[source] io::Error),
    /// Waiting on or reading from the CM event channel failed.
    #[error("reading a CM event failed")]
    GetCmEvent(#[source] io::Error),
    /// Private data longer than rdma_cm allows.
    #[error("private data of {len} bytes is too long (max 255)")]
    PrivateDataTooLong {
        /// Its length.
        len: usize,
    },
    /// The cm id is not bound to a device yet (no address resolved / bound).
    #[error("the cm id has no RDMA device")]
    NoDevice,
    /// ibv_alloc_pd failed.
    #[error("ibv_alloc_pd failed")]
    AllocPd(#[source] io::Error),
    /// ibv_create_comp_channel failed.
    #[error("ibv_create_comp_channel failed")]
    CreateCompChannel(#[source] io::Error),
    /// ibv_create_cq failed.
    #[error("ibv_create_cq({cqe} entries) failed")]
    CreateCq {
        /// Requested entries.
        cqe: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// ibv_req_notify_cq failed.
    #[error("ibv_req_notify_cq failed")]
    ReqNotifyCq(#[source] io::Error),
    /// ibv_poll_cq failed.
    #[error("ibv_poll_cq failed")]
    PollCq(#[source] io::Error),
    /// ibv_get_cq_event failed.
    #[error("ibv_get_cq_event failed")]
    GetCqEvent(#[source] io::Error),
    /// ibv_reg_mr failed.
    #[error("ibv_reg_mr({len} bytes) failed")]
    RegisterMr {
        /// Buffer length.
        len: usize,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// rdma_create_qp failed.
    #[error("rdma_create_qp failed")]
    CreateQp(#[source] io::Error),
    /// A QP operation on an id without a QP.
    #[error("the cm id has no QP")]
    NoQp,
    /// The objects passed belong to different devices / protection domains.
    #[error("{what} belongs to another protection domain or device")]
    Mismatch {
        /// Which object.
        what: &'static str,
    },
    /// A work request refers to bytes outside its memory region.
    #[error("range {offset}+{len} is outside the {mr_len}-byte memory region")]
    OutOfRange {
        /// Start offset.
        offset: usize,
        /// Length.
        len: usize,
        /// The MR's length.
        mr_len: usize,
    },
    /// ibv_post_send failed.
    #[error("ibv_post_send failed")]
    PostSend(#[source] io::Error),
    /// ibv_post_recv failed.
    #[error("ibv_post_recv failed")]
    PostRecv(#[source] io::Error),
    /// rdma_get_devices failed.
    #[error("rdma_get_devices failed")]
    GetDevices(#[source] io::Error),
}

/// A value that owns its descriptor: what tokio's reactor needs of what it watches.
///
/// # Safety
///
/// `as_raw_fd` must return the same open descriptor, referring to the same open file
/// description, for the value's whole lifetime.
pub unsafe trait OwnsFd: AsRawFd {}

/// Watches `inner`'s descriptor with the current runtime's reactor (called within a runtime
/// with IO enabled). The watch ends, and the descriptor is deregistered, before `inner` is
/// dropped with the returned [`AsyncFd`].
pub fn watch<T: OwnsFd>(inner: T) -> io::Result<AsyncFd<T>> {
    // SAFETY: `OwnsFd` promises what `register` requires: the descriptor stays open and the
    // same while the AsyncFd owns `inner`.
    unsafe { AsyncFd::register(inner) }.map_err(|e| e.into_parts().1)
}

/// Sets O_NONBLOCK on a descriptor owned by a verbs object.
fn set_nonblocking(fd: std::os::fd::BorrowedFd<'_>, what: &'static str) -> Result<(), VerbsError> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let map = |e: nix::Error| VerbsError::SetNonBlocking {
        what,
        source: io::Error::from_raw_os_error(e as i32),
    };
    let flags = fcntl(fd.as_raw_fd(), FcntlArg::F_GETFL).map_err(map)?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(flags)).map_err(map)?;
    Ok(())
}

/// Waits until `fd` is readable or `timeout` passes. Returns whether it is readable.
pub(crate) fn wait_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match poll(
        &mut fds,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(0) => Ok(false),
        Ok(_) => Ok(true),
        Err(nix::Error::EINTR) => Ok(false),
        Err(e) => Err(io::Error::from_raw_os_error(e as i32)),
    }
}
