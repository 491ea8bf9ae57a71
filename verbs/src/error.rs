//! The crate's one error type: which verbs or rdma_cm call failed, with the errno read right
//! after it. A leaf module, so that the cm and ib wrappers and the device-context cache can all
//! name it without importing each other (or the crate root).

use std::io;
use std::net::SocketAddr;

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
