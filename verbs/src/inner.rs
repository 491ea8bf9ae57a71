//! The raw librdmacm handles shared by both wrapper modules: an event channel and a cm id.
//!
//! A `cm` id owns its handle, and every device object allocated through it
//! (`ib`: PD, completion channel) keeps the handle alive, so librdmacm's reference
//! on the device context outlives them. Both sides name these types; they live here, in a
//! leaf, so that neither wrapper module imports the other for them.

use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rdma_sys::*;

pub(crate) struct ChannelInner {
    pub(crate) ptr: NonNull<rdma_event_channel>,
}

// SAFETY: an rdma_event_channel is a descriptor wrapper; librdmacm's calls on it
// (rdma_get_cm_event, rdma_migrate_id, destroy) may come from any thread, and the only
// shared mutable state (the fd) is the kernel's.
unsafe impl Send for ChannelInner {}
// SAFETY: as above; no method takes `&self` and mutates Rust-visible state.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: the pointer came from rdma_create_event_channel and every id created on
        // or migrated to this channel holds an Arc to it, so no id still uses it.
        unsafe { rdma_destroy_event_channel(self.ptr.as_ptr()) };
    }
}

pub(crate) struct IdInner {
    pub(crate) ptr: NonNull<rdma_cm_id>,
    /// The channel the id's events arrive on; kept alive as long as the id.
    pub(crate) chan: Mutex<Arc<ChannelInner>>,
}

// SAFETY: librdmacm ids may be used from any thread; the `CmId` that owns the id makes every
// call through `&mut self` or from its single owner, and the other holders of `IdInner`
// (PDs, CQs, comp channels keeping the device's context referenced) only drop it.
unsafe impl Send for IdInner {}
// SAFETY: as above: shared holders never call through the pointer.
unsafe impl Sync for IdInner {}

impl IdInner {
    pub(crate) fn verbs(&self) -> *mut ibv_context {
        // SAFETY: the id is alive while `self` is; `verbs` is a plain pointer field.
        unsafe { (*self.ptr.as_ptr()).verbs }
    }
}

impl Drop for IdInner {
    fn drop(&mut self) {
        // SAFETY: the last holder is gone: the owning CmId destroyed its QP first, and every
        // PD/CQ/channel allocated on the id's device context has been released, so librdmacm
        // may drop its reference on the device. Events were acknowledged as they were read.
        let rc = unsafe { rdma_destroy_id(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "rdma_destroy_id failed");
        }
    }
}
