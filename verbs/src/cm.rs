//! librdmacm: event channels, cm ids and CM events (the device-list refresh is in `context`).

use std::io;
use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_sys::*;

use crate::error::VerbsError;
use crate::fd::{set_nonblocking, wait_readable, OwnsFd};
use crate::ib::{
    CompletionChannel, CompletionQueue, MemoryRegion, PdInner, ProtectionDomain, QpCaps,
};
use crate::inner::{ChannelInner, IdInner};

/// rdma_set_option level for cm id options (missing from rdma-sys).
const RDMA_OPTION_ID: i32 = 0;
/// rdma_set_option name: the QP's local ACK timeout, 4.096 us x 2^value.
const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;
/// Largest private data rdma_cm accepts in any call (a `u8` length).
const MAX_PRIVATE_DATA: usize = 255;

/// A one-sided operation on the peer's registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaOp {
    /// RDMA WRITE: local bytes to the peer's memory.
    Write,
    /// RDMA READ: the peer's memory to local bytes.
    Read,
}

/// One SEND of a chain posted by [`CmId::post_sends`]: `len` bytes at `offset` of the MR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Start of the message in the MR.
    pub offset: usize,
    /// Its length.
    pub len: usize,
    /// The work request's id (reported by its completion, if signaled).
    pub wr_id: u64,
    /// Whether it produces a completion.
    pub signaled: bool,
}

/// An rdma_cm event channel: the descriptor CM events for its ids arrive on.
pub struct EventChannel {
    inner: Arc<ChannelInner>,
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventChannel(fd {})", self.raw_fd())
    }
}

impl EventChannel {
    /// Creates a channel with a non-blocking descriptor.
    pub fn new() -> Result<Self, VerbsError> {
        // SAFETY: no arguments; the result is checked for NULL below.
        let ptr = unsafe { rdma_create_event_channel() };
        let Some(ptr) = NonNull::new(ptr) else {
            return Err(VerbsError::CreateEventChannel(io::Error::last_os_error()));
        };
        let chan = Self {
            inner: Arc::new(ChannelInner { ptr }),
        };
        set_nonblocking(chan.fd(), "CM event channel")?;
        Ok(chan)
    }

    fn raw_fd(&self) -> i32 {
        // SAFETY: the channel is alive (we hold the Arc) and `fd` is a plain int field.
        unsafe { (*self.inner.ptr.as_ptr()).fd }
    }

    /// The channel's descriptor, readable when an event is pending.
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor stays open as long as the channel, which outlives the
        // returned borrow.
        unsafe { BorrowedFd::borrow_raw(self.raw_fd()) }
    }

    /// Returns the next event, waiting at most `timeout`; `None` if none arrived. The event is
    /// copied out and acknowledged at once.
    pub fn get_event(&self, timeout: Duration) -> Result<Option<CmEvent>, VerbsError> {
        if !timeout.is_zero()
            && !wait_readable(self.fd(), timeout).map_err(VerbsError::GetCmEvent)?
        {
            return Ok(None);
        }
        let mut ev: *mut rdma_cm_event = ptr::null_mut();
        // SAFETY: valid channel; `ev` is an out-pointer for one event.
        let rc = unsafe { rdma_get_cm_event(self.inner.ptr.as_ptr(), &mut ev) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                _ => Err(VerbsError::GetCmEvent(err)),
            };
        }
        // SAFETY: rdma_get_cm_event succeeded, so `ev` points to a valid event that stays
        // valid until rdma_ack_cm_event below; for RDMA_PS_TCP ids `param.conn` is the
        // active union member, and its private data pointer is valid for its length.
        let event = unsafe {
            let e = &*ev;
            let kind = CmEventKind::from_raw(e.event);
            let conn = &e.param.conn;
            let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data as *const u8,
                    conn.private_data_len as usize,
                )
                .to_vec()
            };
            let new_id = match (kind, NonNull::new(e.id)) {
                (CmEventKind::ConnectRequest, Some(id)) => Some(CmId {
                    inner: Arc::new(IdInner {
                        ptr: id,
                        chan: Mutex::new(self.inner.clone()),
                    }),
                    qp: None,
                }),
                _ => None,
            };
            CmEvent {
                kind,
                status: e.status,
                id: IdKey(e.id as usize),
                listen_id: NonNull::new(e.listen_id).map(|p| IdKey(p.as_ptr() as usize)),
                private_data,
                new_id,
            }
        };
        // SAFETY: `ev` came from rdma_get_cm_event and is acknowledged exactly once; nothing
        // above kept a pointer into it.
        let rc = unsafe { rdma_ack_cm_event(ev) };
        if rc != 0 {
            return Err(VerbsError::GetCmEvent(io::Error::last_os_error()));
        }
        Ok(Some(event))
    }
}

/// The descriptor, for a reactor to watch (tokio's `AsyncFd`).
impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.raw_fd()
    }
}

// SAFETY: the descriptor is the channel's own, set at creation and closed only when the last
// holder of `inner` (this value or an id on the channel) drops it.
unsafe impl OwnsFd for EventChannel {}

/// Identity of a cm id, to match events with ids. Only compared, never dereferenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdKey(usize);

/// The kind of a CM event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum CmEventKind {
    AddrResolved,
    AddrError,
    RouteResolved,
    RouteError,
    ConnectRequest,
    ConnectResponse,
    ConnectError,
    Unreachable,
    Rejected,
    Established,
    Disconnected,
    DeviceRemoval,
    AddrChange,
    TimewaitExit,
    /// Any other (multicast) event.
    Other(u32),
}

impl CmEventKind {
    fn from_raw(t: rdma_cm_event_type::Type) -> Self {
        use rdma_cm_event_type::*;
        match t {
            RDMA_CM_EVENT_ADDR_RESOLVED => Self::AddrResolved,
            RDMA_CM_EVENT_ADDR_ERROR => Self::AddrError,
            RDMA_CM_EVENT_ROUTE_RESOLVED => Self::RouteResolved,
            RDMA_CM_EVENT_ROUTE_ERROR => Self::RouteError,
            RDMA_CM_EVENT_CONNECT_REQUEST => Self::ConnectRequest,
            RDMA_CM_EVENT_CONNECT_RESPONSE => Self::ConnectResponse,
            RDMA_CM_EVENT_CONNECT_ERROR => Self::ConnectError,
            RDMA_CM_EVENT_UNREACHABLE => Self::Unreachable,
            RDMA_CM_EVENT_REJECTED => Self::Rejected,
            RDMA_CM_EVENT_ESTABLISHED => Self::Established,
            RDMA_CM_EVENT_DISCONNECTED => Self::Disconnected,
            RDMA_CM_EVENT_DEVICE_REMOVAL => Self::DeviceRemoval,
            RDMA_CM_EVENT_ADDR_CHANGE => Self::AddrChange,
            RDMA_CM_EVENT_TIMEWAIT_EXIT => Self::TimewaitExit,
            other => Self::Other(other),
        }
    }
}

/// One CM event, copied out of librdmacm (already acknowledged).
#[derive(Debug)]
pub struct CmEvent {
    /// What happened.
    pub kind: CmEventKind,
    /// The event's status (0, a negative errno, or a reject reason for `Rejected`).
    pub status: i32,
    /// The id the event is for (for `ConnectRequest`: the new id).
    pub id: IdKey,
    /// The listening id, for `ConnectRequest`.
    pub listen_id: Option<IdKey>,
    /// The private data the peer sent, as delivered (it may be zero-padded).
    pub private_data: Vec<u8>,
    /// For `ConnectRequest`: the new id, owned; dropping it rejects the request.
    pub new_id: Option<CmId>,
}

struct QpParts {
    // Held so the PD and CQ are released only after the QP.
    _pd: Arc<PdInner>,
    _cq: CompletionQueue,
    pd_ptr: *mut ibv_pd,
}

/// An rdma_cm identifier (RDMA_PS_TCP, RC), optionally with the RC QP created on it.
///
/// `Drop` destroys the QP, then releases the CQ/PD references the QP held, then the id
/// (once no PD/CQ allocated on its device remains).
pub struct CmId {
    inner: Arc<IdInner>,
    qp: Option<QpParts>,
}

// SAFETY: see IdInner; QpParts holds only Send types and a PD pointer used for comparison.
unsafe impl Send for CmId {}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CmId({:p}, qp: {})", self.inner.ptr, self.qp.is_some())
    }
}

fn sockaddr_of(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
        }
    }
    storage
}

/// Reads a socket address librdmacm filled in.
///
/// # Safety
/// `sa` must point to a valid sockaddr whose family says how long it is.
unsafe fn socketaddr_from(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: the caller guarantees `sa` is valid; the family field decides the layout.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let sin = &*(sa as *const libc::sockaddr_in);
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let sin6 = &*(sa as *const libc::sockaddr_in6);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                    u16::from_be(sin6.sin6_port),
                    u32::from_be(sin6.sin6_flowinfo),
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

fn check(rc: i32, wrap: impl FnOnce(io::Error) -> VerbsError) -> Result<(), VerbsError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(wrap(io::Error::last_os_error()))
    }
}

fn conn_param(
    private_data: &[u8],
    retry: u8,
    rnr_retry: u8,
) -> Result<rdma_conn_param, VerbsError> {
    if private_data.len() > MAX_PRIVATE_DATA {
        return Err(VerbsError::PrivateDataTooLong {
            len: private_data.len(),
        });
    }
    Ok(rdma_conn_param {
        private_data: if private_data.is_empty() {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        },
        private_data_len: private_data.len() as u8,
        responder_resources: 1,
        initiator_depth: 1,
        flow_control: 1,
        retry_count: retry.min(7),
        rnr_retry_count: rnr_retry.min(7),
        srq: 0,
        qp_num: 0,
    })
}

impl CmId {
    /// Creates an RDMA_PS_TCP id whose events arrive on `chan`.
    pub fn create(chan: &EventChannel) -> Result<Self, VerbsError> {
        let mut id: *mut rdma_cm_id = ptr::null_mut();
        // SAFETY: valid channel; `id` is an out-pointer; the context pointer is unused.
        let rc = unsafe {
            rdma_create_id(
                chan.inner.ptr.as_ptr(),
                &mut id,
                ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(VerbsError::CreateId(io::Error::last_os_error()));
        }
        let ptr =
            NonNull::new(id).ok_or_else(|| VerbsError::CreateId(io::Error::other("NULL id")))?;
        Ok(Self {
            inner: Arc::new(IdInner {
                ptr,
                chan: Mutex::new(chan.inner.clone()),
            }),
            qp: None,
        })
    }

    fn raw(&self) -> *mut rdma_cm_id {
        self.inner.ptr.as_ptr()
    }

    /// This id's identity, to match CM events.
    pub fn key(&self) -> IdKey {
        IdKey(self.raw() as usize)
    }

    /// Sets the QP's local ACK timeout (4.096 us x 2^`timeout`); call before resolving the
    /// route (active side) or accepting (passive side).
    pub fn set_ack_timeout(&self, timeout: u8) -> Result<(), VerbsError> {
        let mut value = timeout;
        // SAFETY: valid id; the option value is a u8 of the given length, read during the call.
        let rc = unsafe {
            rdma_set_option(
                self.raw(),
                RDMA_OPTION_ID,
                RDMA_OPTION_ID_ACK_TIMEOUT,
                (&mut value as *mut u8).cast(),
                mem::size_of::<u8>(),
            )
        };
        check(rc, |source| VerbsError::SetOption {
            option: "RDMA_OPTION_ID_ACK_TIMEOUT",
            source,
        })
    }

    /// Binds the id to a local address (the listener's address).
    pub fn bind(&self, addr: SocketAddr) -> Result<(), VerbsError> {
        let mut sa = sockaddr_of(addr);
        // SAFETY: valid id; `sa` is a valid sockaddr for the duration of the call.
        let rc =
            unsafe { rdma_bind_addr(self.raw(), (&mut sa as *mut libc::sockaddr_storage).cast()) };
        check(rc, |source| VerbsError::Bind { addr, source })
    }

    /// Starts listening for connect requests.
    pub fn listen(&self, backlog: i32) -> Result<(), VerbsError> {
        // SAFETY: valid, bound id.
        let rc = unsafe { rdma_listen(self.raw(), backlog) };
        check(rc, VerbsError::Listen)
    }

    /// Starts resolving `peer` (event AddrResolved / AddrError).
    pub fn resolve_addr(&self, peer: SocketAddr, timeout: Duration) -> Result<(), VerbsError> {
        let mut dst = sockaddr_of(peer);
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: valid id; `dst` is valid during the call (librdmacm copies it); no source.
        let rc = unsafe {
            rdma_resolve_addr(
                self.raw(),
                ptr::null_mut(),
                (&mut dst as *mut libc::sockaddr_storage).cast(),
                ms,
            )
        };
        check(rc, |source| VerbsError::ResolveAddr { peer, source })
    }

    /// Starts resolving the route (event RouteResolved / RouteError).
    pub fn resolve_route(&self, timeout: Duration) -> Result<(), VerbsError> {
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: valid id with a resolved address.
        let rc = unsafe { rdma_resolve_route(self.raw(), ms) };
        check(rc, VerbsError::ResolveRoute)
    }

    /// Sends a connect request carrying `private_data` (at most 56 bytes arrive on IB/RoCE).
    pub fn connect(&self, private_data: &[u8], retry: u8, rnr_retry: u8) -> Result<(), VerbsError> {
        let mut param = conn_param(private_data, retry, rnr_retry)?;
        // SAFETY: valid id with a QP; `param` and the private data it points to live across
        // the call, which copies them.
        let rc = unsafe { rdma_connect(self.raw(), &mut param) };
        check(rc, VerbsError::Connect)
    }

    /// Accepts a connect request, replying with `private_data`.
    pub fn accept(&self, private_data: &[u8], retry: u8, rnr_retry: u8) -> Result<(), VerbsError> {
        let mut param = conn_param(private_data, retry, rnr_retry)?;
        // SAFETY: valid id from a connect request, with a QP; `param` lives across the call.
        let rc = unsafe { rdma_accept(self.raw(), &mut param) };
        check(rc, VerbsError::Accept)
    }

    /// Rejects a connect request, with `private_data` for the peer.
    pub fn reject(&self, private_data: &[u8]) -> Result<(), VerbsError> {
        if private_data.len() > MAX_PRIVATE_DATA {
            return Err(VerbsError::PrivateDataTooLong {
                len: private_data.len(),
            });
        }
        // SAFETY: valid id from a connect request; the data is copied during the call.
        let rc = unsafe {
            rdma_reject(
                self.raw(),
                private_data.as_ptr().cast(),
                private_data.len() as u8,
            )
        };
        check(rc, VerbsError::Reject)
    }

    /// Disconnects (moves the QP to ERR, flushing posted work requests, and sends a DREQ).
    pub fn disconnect(&self) -> Result<(), VerbsError> {
        // SAFETY: valid id.
        let rc = unsafe { rdma_disconnect(self.raw()) };
        check(rc, VerbsError::Disconnect)
    }

    /// Moves the id to another event channel (its future events arrive there).
    pub fn migrate(&mut self, chan: &EventChannel) -> Result<(), VerbsError> {
        // SAFETY: valid id and channel; every event reported for this id was acknowledged
        // when it was read, so rdma_migrate_id does not wait forever.
        let rc = unsafe { rdma_migrate_id(self.raw(), chan.inner.ptr.as_ptr()) };
        check(rc, VerbsError::MigrateId)?;
        let mut guard = self.inner.chan.lock().unwrap_or_else(|p| p.into_inner());
        *guard = chan.inner.clone();
        Ok(())
    }

    /// The local address, once bound or resolved.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: valid id; `route.addr.src_addr_union` is a sockaddr storage librdmacm keeps
        // (zeroed, so family 0 -> None, before binding).
        unsafe { socketaddr_from(&(*self.raw()).route.addr.src_addr_union.src_addr) }
    }

    /// The peer address, once resolved or connected.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as for local_addr, for the destination address.
        unsafe { socketaddr_from(&(*self.raw()).route.addr.dst_addr_union.dst_addr) }
    }

    /// Allocates a protection domain on the id's device.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain, VerbsError> {
        ProtectionDomain::alloc(self.inner.clone())
    }

    /// Creates a completion channel on the id's device.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel, VerbsError> {
        CompletionChannel::create(self.inner.clone())
    }

    /// Creates the RC QP on this id, with `cq` for both send and receive completions.
    pub fn create_qp(
        &mut self,
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<(), VerbsError> {
        if self.qp.is_some() {
            return Err(VerbsError::CreateQp(io::Error::from_raw_os_error(
                libc::EEXIST,
            )));
        }
        if pd.context() != self.inner.verbs() || cq.context() != self.inner.verbs() {
            return Err(VerbsError::Mismatch {
                what: "the PD or CQ",
            });
        }
        // SAFETY: all-zero is a valid ibv_qp_init_attr (NULL pointers, zero caps).
        let mut attr: ibv_qp_init_attr = unsafe { mem::zeroed() };
        attr.send_cq = cq.raw();
        attr.recv_cq = cq.raw();
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap = ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: caps.max_inline_data,
        };
        // SAFETY: valid id bound to the device of `pd` and `cq` (checked above); `attr` lives
        // across the call.
        let rc = unsafe { rdma_create_qp(self.raw(), pd.raw(), &mut attr) };
        check(rc, VerbsError::CreateQp)?;
        self.qp = Some(QpParts {
            _pd: pd.inner(),
            _cq: cq.clone(),
            pd_ptr: pd.raw(),
        });
        Ok(())
    }

    /// Whether a QP exists on this id.
    pub fn has_qp(&self) -> bool {
        self.qp.is_some()
    }

    /// The number of this id's QP, if it has one (a QP that moves with its VM keeps it).
    pub fn qp_num(&self) -> Option<u32> {
        self.qp.as_ref()?;
        // SAFETY: valid id; rdma_create_qp set `qp` to a live QP, which lives until
        // `destroy_qp` clears `self.qp` (checked above).
        Some(unsafe { (*(*self.raw()).qp).qp_num })
    }

    /// Destroys the QP (if any); posted work requests are gone with it.
    ///
    /// The QP is first moved to the error state, which flushes its work requests: Soft-RoCE
    /// (kernel 6.1) otherwise waits in `rxe_destroy_qp` for references its send path still
    /// holds, which after a device vanished under a busy QP was seen to block the thread
    /// (and with it the device's unplug) for longer than 10 s.
    pub fn destroy_qp(&mut self) {
        if let Some(parts) = self.qp.take() {
            // SAFETY: the id is valid and has a QP (`parts` is Some); a zeroed ibv_qp_attr
            // with only qp_state set is a valid argument for the IBV_QP_STATE mask. A failure
            // (the device is gone) is harmless: the destroy below runs either way.
            let rc = unsafe {
                let mut attr: ibv_qp_attr = std::mem::zeroed();
                attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
                ibv_modify_qp(
                    (*self.raw()).qp,
                    &mut attr,
                    ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                )
            };
            if rc != 0 {
                tracing::debug!(error = %io::Error::from_raw_os_error(rc), "moving the QP to ERR before destroying it failed");
            }
            // SAFETY: the id has a QP created by rdma_create_qp, destroyed exactly once here,
            // while `parts` still holds its PD and CQ.
            unsafe { rdma_destroy_qp(self.raw()) };
            // Only now may the PD and CQ go.
            drop(parts);
        }
    }

    fn qp_ptr(&self, mr: &MemoryRegion) -> Result<*mut ibv_qp, VerbsError> {
        let parts = self.qp.as_ref().ok_or(VerbsError::NoQp)?;
        if mr.pd_raw() != parts.pd_ptr {
            return Err(VerbsError::Mismatch {
                what: "the memory region",
            });
        }
        // SAFETY: the id is valid and has a QP.
        Ok(unsafe { (*self.raw()).qp })
    }

    /// Posts a signaled SEND of `mr[offset..offset+len]` with `wr_id`.
    ///
    /// The bytes must not be changed until the send's completion is polled.
    pub fn post_send(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<(), VerbsError> {
        let wr = SendWr {
            offset,
            len,
            wr_id,
            signaled: true,
        };
        self.post_sends(mr, &[wr]).map_err(|(_, e)| e)
    }

    /// Posts `wrs` as SENDs of ranges of `mr`, in order, as one chain: one `ibv_post_send`,
    /// so Soft-RoCE takes one doorbell (one system call) for all of them. On failure, returns
    /// how many of them were posted (the first ones) with the error.
    ///
    /// The bytes must not be changed until a completion at or after each send is polled (an
    /// unsignaled send is complete once a later signaled one on the same QP is).
    pub fn post_sends(&self, mr: &MemoryRegion, wrs: &[SendWr]) -> Result<(), (usize, VerbsError)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let qp = self.qp_ptr(mr).map_err(|e| (0, e))?;
        let mut sges = Vec::with_capacity(wrs.len());
        for (i, w) in wrs.iter().enumerate() {
            sges.push(mr.sge(w.offset, w.len).map_err(|e| (i, e))?);
        }
        // SAFETY: all-zero is a valid ibv_send_wr (no next, no unions in use).
        let mut chain: Vec<ibv_send_wr> = wrs.iter().map(|_| unsafe { mem::zeroed() }).collect();
        let base = chain.as_mut_ptr();
        for (i, (wr, w)) in chain.iter_mut().zip(wrs).enumerate() {
            wr.wr_id = w.wr_id;
            wr.sg_list = &mut sges[i];
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
            if w.signaled {
                wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if i + 1 < wrs.len() {
                // SAFETY: i + 1 is within `chain`, which is neither moved nor resized below.
                wr.next = unsafe { base.add(i + 1) };
            }
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: valid QP; the chain and its SGEs live across the call and each WR's `next`
        // points into the same vector; every SGE lies inside an MR of the QP's PD (checked),
        // whose buffer the MR owns.
        let rc = unsafe { ibv_post_send(qp, base, &mut bad) };
        if rc != 0 {
            let posted = if bad.is_null() {
                0
            } else {
                // SAFETY: on failure `bad` points at the first WR not posted, inside the chain
                // that starts at `base`.
                let index = unsafe { bad.offset_from(base) };
                index.clamp(0, wrs.len() as isize) as usize
            };
            return Err((
                posted,
                VerbsError::PostSend(io::Error::from_raw_os_error(rc)),
            ));
        }
        Ok(())
    }

    /// Posts a signaled RDMA WRITE of `mr[offset..offset+len]` to, or RDMA READ of `len`
    /// bytes from, the peer's `remote_addr` (registered under `rkey`) into the same local
    /// range, with `wr_id`.
    ///
    /// The local bytes must not be touched until the completion is polled.
    #[allow(clippy::too_many_arguments)]
    pub fn post_rdma(
        &self,
        op: RdmaOp,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: u32,
        wr_id: u64,
    ) -> Result<(), VerbsError> {
        let qp = self.qp_ptr(mr)?;
        let mut sge = mr.sge(offset, len)?;
        // SAFETY: all-zero is a valid ibv_send_wr; only the `rdma` member of the `wr` union
        // is set below, as the RDMA opcodes require.
        let mut wr: ibv_send_wr = unsafe { mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = match op {
            RdmaOp::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            RdmaOp::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
        };
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: as for post_send; the remote range is checked by the peer's NIC against the
        // rkey's registration (a bad one fails the work request, never local memory).
        let rc = unsafe { ibv_post_send(qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostSend(io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// Posts a receive into `mr[offset..offset+len]` with `wr_id`.
    pub fn post_recv(
        &self,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<(), VerbsError> {
        let qp = self.qp_ptr(mr)?;
        let mut sge = mr.sge(offset, len)?;
        let mut wr = ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: as for post_send.
        let rc = unsafe { ibv_post_recv(qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostRecv(io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.destroy_qp();
        // `inner` drops after this: the id is destroyed once the last PD/CQ on it is gone.
    }
}
