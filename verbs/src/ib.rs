//! libibverbs objects on a cm id's device: PD, completion channel, CQ, MR.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::*;

use crate::context::{context_in_use, remember_context};
use crate::devices::ensure_watching;
use crate::error::VerbsError;
use crate::fd::{set_nonblocking, wait_readable, OwnsFd};
use crate::inner::IdInner;

/// Queue sizes for an RC QP.
#[derive(Debug, Clone, Copy)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Inline data size requested (0 for none).
    pub max_inline_data: u32,
}

pub(crate) struct PdInner {
    ptr: NonNull<ibv_pd>,
    /// The context's command descriptor: the key of its in-use count (see
    /// `context::context_in_use`).
    cmd_fd: i32,
    // Keeps the id, and with it librdmacm's reference on the device context, alive.
    _id: Arc<IdInner>,
}

// SAFETY: ibv_pd may be used from any thread (libibverbs objects are thread-safe); Rust code
// only passes the pointer to libibverbs.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: the last holder is gone: every MR (each holds this Arc) was deregistered and
        // every QP on this PD (each holds this Arc) destroyed.
        let rc = unsafe { ibv_dealloc_pd(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::from_raw_os_error(rc), "ibv_dealloc_pd failed");
        }
        // Everything of this endpoint on the context (QP, CQ, completion channel, MRs) was
        // released before its PD.
        context_in_use(self.cmd_fd, false);
    }
}

/// A protection domain. Cloning shares it; it is freed after its last clone, MR and QP.
#[derive(Clone)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

impl ProtectionDomain {
    pub(crate) fn alloc(id: Arc<IdInner>) -> Result<Self, VerbsError> {
        let ctx = id.verbs();
        if ctx.is_null() {
            return Err(VerbsError::NoDevice);
        }
        let cmd_fd = remember_context(ctx);
        ensure_watching();
        // SAFETY: `ctx` is the id's open device context (non-NULL, kept open by the id).
        let ptr = unsafe { ibv_alloc_pd(ctx) };
        let ptr =
            NonNull::new(ptr).ok_or_else(|| VerbsError::AllocPd(io::Error::last_os_error()))?;
        context_in_use(cmd_fd, true);
        Ok(Self {
            inner: Arc::new(PdInner {
                ptr,
                cmd_fd,
                _id: id,
            }),
        })
    }

    pub(crate) fn raw(&self) -> *mut ibv_pd {
        self.inner.ptr.as_ptr()
    }

    pub(crate) fn inner(&self) -> Arc<PdInner> {
        self.inner.clone()
    }

    pub(crate) fn context(&self) -> *mut ibv_context {
        // SAFETY: the PD is alive; `context` is a plain pointer field.
        unsafe { (*self.raw()).context }
    }

    /// Registers a zeroed, owned buffer of `len` bytes for local write (receives).
    pub fn register(&self, len: usize) -> Result<MemoryRegion, VerbsError> {
        let mut buf = vec![0u8; len.max(1)].into_boxed_slice();
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        // SAFETY: valid PD; the buffer is owned by the returned MR and outlives the
        // registration (deregistered in Drop before the buffer is freed).
        let ptr = unsafe { ibv_reg_mr(self.raw(), buf.as_mut_ptr().cast(), buf.len(), access) };
        let ptr = NonNull::new(ptr).ok_or_else(|| VerbsError::RegisterMr {
            len,
            source: io::Error::last_os_error(),
        })?;
        Ok(MemoryRegion {
            ptr,
            buf,
            _pd: self.inner.clone(),
        })
    }
}

impl ProtectionDomain {
    /// Registers `mem` for the peer's RDMA WRITE and/or READ (and local write).
    pub fn register_exposed(
        &self,
        mem: &Arc<ExposedMemory>,
        access: RemoteAccess,
    ) -> Result<ExposedRegion, VerbsError> {
        let mut flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if access.write {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if access.read {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        // SAFETY: valid PD; the memory is held by the returned region, so it outlives the
        // registration (deregistered in Drop before the Arc is released).
        let ptr =
            unsafe { ibv_reg_mr(self.raw(), mem.ptr.as_ptr().cast(), mem.len(), flags as i32) };
        let ptr = NonNull::new(ptr).ok_or_else(|| VerbsError::RegisterMr {
            len: mem.len(),
            source: io::Error::last_os_error(),
        })?;
        Ok(ExposedRegion {
            ptr,
            mem: mem.clone(),
            _pd: self.inner.clone(),
        })
    }
}

/// A registered memory region owning its buffer; holds its PD alive.
pub struct MemoryRegion {
    ptr: NonNull<ibv_mr>,
    buf: Box<[u8]>,
    _pd: Arc<PdInner>,
}

// SAFETY: the MR handle is usable from any thread; the buffer is an owned allocation.
unsafe impl Send for MemoryRegion {}

impl MemoryRegion {
    /// The buffer's length.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer is empty (never, in practice).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Reads `len` bytes at `offset` (e.g. a received message, after its completion).
    pub fn read(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.buf.get(offset..offset.checked_add(len)?)
    }

    /// Writable view of `len` bytes at `offset` (a send slot with no send in flight).
    pub fn write(&mut self, offset: usize, len: usize) -> Option<&mut [u8]> {
        self.buf.get_mut(offset..offset.checked_add(len)?)
    }

    pub(crate) fn pd_raw(&self) -> *mut ibv_pd {
        // SAFETY: the MR is alive; `pd` is a plain pointer field.
        unsafe { (*self.ptr.as_ptr()).pd }
    }

    pub(crate) fn sge(&self, offset: usize, len: usize) -> Result<ibv_sge, VerbsError> {
        let out = || VerbsError::OutOfRange {
            offset,
            len,
            mr_len: self.buf.len(),
        };
        let end = offset.checked_add(len).ok_or_else(out)?;
        if end > self.buf.len() || len > u32::MAX as usize {
            return Err(out());
        }
        // SAFETY: the MR is alive; `lkey` is a plain field.
        let lkey = unsafe { (*self.ptr.as_ptr()).lkey };
        Ok(ibv_sge {
            addr: self.buf.as_ptr() as u64 + offset as u64,
            length: len as u32,
            lkey,
        })
    }
}

/// What the peer may do to an exposed buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteAccess {
    /// RDMA WRITE into it.
    pub write: bool,
    /// RDMA READ from it.
    pub read: bool,
}

/// Memory an application exposes to its peer's RDMA WRITE and READ.
///
/// It outlives every registration of it (each [`ExposedRegion`] holds it), so that it can be
/// registered again on a new device after a move while its contents (guest memory, which
/// migrates with the VM) stay where they are. The NIC writes into it behind the compiler's
/// back, so it is only ever accessed by copying through raw pointers, never through a
/// reference.
pub struct ExposedMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the allocation is owned; every access copies through raw pointers and never forms a
// reference, so concurrent copies (and the NIC's DMA) cannot violate aliasing rules.
unsafe impl Send for ExposedMemory {}
// SAFETY: as above.
unsafe impl Sync for ExposedMemory {}

impl ExposedMemory {
    /// A zeroed buffer of `len` bytes (at least 1).
    pub fn new(len: usize) -> Self {
        let buf = vec![0u8; len.max(1)].into_boxed_slice();
        let len = buf.len();
        let ptr = NonNull::new(Box::into_raw(buf).cast::<u8>()).expect("Box is never null");
        Self { ptr, len }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `out.len()` bytes at `offset` into `out`; `None` if the range is outside.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Option<()> {
        if offset.checked_add(out.len())? > self.len {
            return None;
        }
        // SAFETY: the range lies inside the allocation (checked); `out` is a distinct Rust
        // buffer; the copy forms no reference to the shared memory.
        unsafe {
            ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Some(())
    }

    /// Copies `data` to `offset`; `None` if the range is outside.
    pub fn write(&self, offset: usize, data: &[u8]) -> Option<()> {
        if offset.checked_add(data.len())? > self.len {
            return None;
        }
        // SAFETY: as for `read`, in the other direction.
        unsafe {
            ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        Some(())
    }

    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for ExposedMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from Box::into_raw of a boxed slice of exactly `len` bytes;
        // every registration holds an Arc to this memory, so none is left.
        drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len)) });
    }
}

/// A registration of [`ExposedMemory`] on one PD, for the peer's RDMA WRITE/READ.
pub struct ExposedRegion {
    ptr: NonNull<ibv_mr>,
    mem: Arc<ExposedMemory>,
    _pd: Arc<PdInner>,
}

// SAFETY: the MR handle is usable from any thread; the memory is Send + Sync.
unsafe impl Send for ExposedRegion {}

impl ExposedRegion {
    /// The key the peer names this registration by.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is alive; `rkey` is a plain field.
        unsafe { (*self.ptr.as_ptr()).rkey }
    }

    /// The address the peer's work requests use (the buffer's virtual address).
    pub fn addr(&self) -> u64 {
        self.mem.addr()
    }

    /// The buffer's length.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Whether the buffer is empty (never).
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }
}

impl Drop for ExposedRegion {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr, deregistered once, before the memory and the PD
        // (both held by this struct) can go.
        let rc = unsafe { ibv_dereg_mr(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::from_raw_os_error(rc), "ibv_dereg_mr failed");
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr, deregistered once, before `buf` is freed (fields
        // drop after this body) and before the PD (we hold it).
        let rc = unsafe { ibv_dereg_mr(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::from_raw_os_error(rc), "ibv_dereg_mr failed");
        }
    }
}

pub(crate) struct CompChanInner {
    ptr: NonNull<ibv_comp_channel>,
    _id: Arc<IdInner>,
}

// SAFETY: a completion channel is a descriptor wrapper usable from any thread.
unsafe impl Send for CompChanInner {}
// SAFETY: as above.
unsafe impl Sync for CompChanInner {}

impl Drop for CompChanInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds this Arc, so none remains.
        let rc = unsafe { ibv_destroy_comp_channel(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "ibv_destroy_comp_channel failed");
        }
    }
}

/// A completion channel: a descriptor readable when a CQ armed with `req_notify` has a
/// new completion.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<CompChanInner>,
}

impl CompletionChannel {
    pub(crate) fn create(id: Arc<IdInner>) -> Result<Self, VerbsError> {
        let ctx = id.verbs();
        if ctx.is_null() {
            return Err(VerbsError::NoDevice);
        }
        // SAFETY: `ctx` is the id's open device context.
        let ptr = unsafe { ibv_create_comp_channel(ctx) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| VerbsError::CreateCompChannel(io::Error::last_os_error()))?;
        let chan = Self {
            inner: Arc::new(CompChanInner { ptr, _id: id }),
        };
        set_nonblocking(chan.fd(), "completion channel")?;
        Ok(chan)
    }

    /// The channel's descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel is alive for the borrow; `fd` is a plain field.
        unsafe { BorrowedFd::borrow_raw((*self.inner.ptr.as_ptr()).fd) }
    }

    /// Waits at most `timeout` for the descriptor to become readable.
    pub fn wait(&self, timeout: Duration) -> Result<bool, VerbsError> {
        wait_readable(self.fd(), timeout).map_err(VerbsError::GetCqEvent)
    }

    /// Creates a CQ with `cqe` entries reporting to this channel.
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue, VerbsError> {
        // SAFETY: the channel is alive; `context` is a plain pointer field.
        let ctx = unsafe { (*self.inner.ptr.as_ptr()).context };
        // SAFETY: `ctx` is the channel's open device context; the channel outlives the CQ
        // (the CQ holds it).
        let ptr =
            unsafe { ibv_create_cq(ctx, cqe as i32, ptr::null_mut(), self.inner.ptr.as_ptr(), 0) };
        let ptr = NonNull::new(ptr).ok_or_else(|| VerbsError::CreateCq {
            cqe,
            source: io::Error::last_os_error(),
        })?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ptr,
                chan: self.inner.clone(),
            }),
        })
    }
}

/// The descriptor, for a reactor to watch (tokio's `AsyncFd`).
impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd().as_raw_fd()
    }
}

// SAFETY: the descriptor is the channel's own, set at creation and closed only when the last
// holder of `inner` (this value, a clone or a CQ on the channel) drops it: a clone being
// watched keeps it open until the watch ends.
unsafe impl OwnsFd for CompletionChannel {}

pub(crate) struct CqInner {
    ptr: NonNull<ibv_cq>,
    chan: Arc<CompChanInner>,
}

// SAFETY: CQ calls are thread-safe in libibverbs; the pointer is only passed to it.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds this Arc, so none remains; every CQ event read
        // was acknowledged at once (ack_events), so ibv_destroy_cq does not block.
        let rc = unsafe { ibv_destroy_cq(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::from_raw_os_error(rc), "ibv_destroy_cq failed");
        }
    }
}

/// What a work completion was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND completed.
    Send,
    /// A receive completed.
    Recv,
    /// Anything else (or unknown, for flushed work requests).
    Other(u32),
}

/// One work completion, copied out.
#[derive(Debug, Clone)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// ibv_wc_status (0 = success).
    pub status: u32,
    /// Opcode (valid only when successful).
    pub opcode: WcOpcode,
    /// Bytes received (receives).
    pub byte_len: u32,
}

impl WorkCompletion {
    /// Whether it succeeded.
    pub fn ok(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    /// Whether it was flushed by a QP in error (after a disconnect).
    pub fn flushed(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }

    /// The status as libibverbs describes it.
    pub fn status_str(&self) -> String {
        // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
        let s = unsafe { ibv_wc_status_str(self.status) };
        if s.is_null() {
            return format!("status {}", self.status);
        }
        // SAFETY: non-NULL static C string.
        unsafe { std::ffi::CStr::from_ptr(s) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A completion queue, with its completion channel.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

impl CompletionQueue {
    pub(crate) fn raw(&self) -> *mut ibv_cq {
        self.inner.ptr.as_ptr()
    }

    pub(crate) fn context(&self) -> *mut ibv_context {
        // SAFETY: the CQ is alive; `context` is a plain pointer field.
        unsafe { (*self.raw()).context }
    }

    /// Arms the CQ: the channel becomes readable at the next completion.
    pub fn req_notify(&self) -> Result<(), VerbsError> {
        // SAFETY: valid CQ.
        let rc = unsafe { ibv_req_notify_cq(self.raw(), 0) };
        if rc != 0 {
            return Err(VerbsError::ReqNotifyCq(io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// Reads and acknowledges every pending event on the CQ's channel; returns how many.
    pub fn ack_events(&self) -> Result<u32, VerbsError> {
        let mut n = 0u32;
        loop {
            let mut cq: *mut ibv_cq = ptr::null_mut();
            let mut ctx: *mut libc::c_void = ptr::null_mut();
            // SAFETY: valid, non-blocking channel; out-pointers for the CQ and its context.
            let rc = unsafe { ibv_get_cq_event(self.inner.chan.ptr.as_ptr(), &mut cq, &mut ctx) };
            if rc != 0 {
                let err = io::Error::last_os_error();
                if n > 0 {
                    // SAFETY: valid CQ; acknowledges exactly the events read above.
                    unsafe { ibv_ack_cq_events(self.raw(), n) };
                }
                return match err.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(n),
                    _ => Err(VerbsError::GetCqEvent(err)),
                };
            }
            if cq != self.raw() {
                // Only our CQ reports to this channel; acknowledge a foreign event anyway.
                // SAFETY: `cq` was returned by ibv_get_cq_event and is alive.
                unsafe { ibv_ack_cq_events(cq, 1) };
            } else {
                n += 1;
            }
        }
    }

    /// Polls up to `max` completions into `out`; returns how many were added.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize, VerbsError> {
        const BATCH: usize = 16;
        // SAFETY: ibv_wc is plain data; all-zero is a valid value.
        let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        let mut total = 0;
        while total < max {
            let want = (max - total).min(BATCH) as i32;
            // SAFETY: valid CQ; `wcs` has room for `want` entries.
            let n = unsafe { ibv_poll_cq(self.raw(), want, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::PollCq(io::Error::from_raw_os_error(-n)));
            }
            for wc in &wcs[..n as usize] {
                let opcode = match wc.opcode {
                    ibv_wc_opcode::IBV_WC_SEND => WcOpcode::Send,
                    ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
                    other => WcOpcode::Other(other),
                };
                out.push(WorkCompletion {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    opcode,
                    byte_len: wc.byte_len,
                });
            }
            total += n as usize;
            if (n as usize) < want as usize {
                break;
            }
        }
        Ok(total)
    }
}
