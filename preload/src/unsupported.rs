//! Verbs this library does not support yet. A program that calls one on a virtual object
//! gets EOPNOTSUPP at the call (errno too, for verbs that return a pointer), and its stderr
//! says which verb, once per verb: an error the program handles, never an object this
//! library cannot rebuild after a move. docs/preload.md lists what is supported.

use std::collections::HashSet;
use std::os::raw::{c_int, c_void};
use std::sync::Mutex;

use rdma_sys::{ibv_ah, ibv_ah_attr, ibv_cq, ibv_gid, ibv_mr, ibv_pd, ibv_qp, ibv_srq};
use rdma_sys::{ibv_mw, ibv_mw_bind, ibv_recv_wr, ibv_srq_init_attr};

use crate::next;
use crate::objects::{find, Cq, Mr, Pd, Qp, Virtual};

/// Refuses `verb`: says so on stderr the first time, sets errno, returns EOPNOTSUPP.
pub fn refuse(verb: &'static str) -> c_int {
    static SAID: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let first = SAID
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashSet::new)
        .insert(verb);
    if first {
        eprintln!(
            "rdmamig-preload: {verb} is not supported under rdmamig-run (EOPNOTSUPP); \
             see docs/preload.md"
        );
    }
    // SAFETY: errno is this thread's; writing it is what a failing verb does.
    unsafe { *libc::__errno_location() = libc::EOPNOTSUPP };
    libc::EOPNOTSUPP
}

/// Whether `object` is one of this library's virtual objects of kind `V`.
fn ours<V: Virtual>(object: *mut V::Public) -> bool {
    find::<V>(object).is_some()
}

/// ibv_create_srq: shared receive queues are not rebuilt yet.
///
/// # Safety
/// As libibverbs' ibv_create_srq.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    if ours::<Pd>(pd) {
        refuse("ibv_create_srq");
        return std::ptr::null_mut();
    }
    // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
    unsafe { next::ibv_create_srq()(pd, attr) }
}

/// ibv_create_ah: address handles (UD) are not rebuilt yet.
///
/// # Safety
/// As libibverbs' ibv_create_ah.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    if ours::<Pd>(pd) {
        refuse("ibv_create_ah");
        return std::ptr::null_mut();
    }
    // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
    unsafe { next::ibv_create_ah()(pd, attr) }
}

/// ibv_rereg_mr: a region's change is not tracked yet.
///
/// # Safety
/// As libibverbs' ibv_rereg_mr.
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    if ours::<Mr>(mr) {
        return refuse("ibv_rereg_mr");
    }
    // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
    unsafe { next::ibv_rereg_mr()(mr, flags, pd, addr, length, access) }
}

/// ibv_resize_cq: a CQ keeps the size it was created with.
///
/// # Safety
/// As libibverbs' ibv_resize_cq.
#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    if ours::<Cq>(cq) {
        return refuse("ibv_resize_cq");
    }
    // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
    unsafe { next::ibv_resize_cq()(cq, cqe) }
}

/// ibv_qp_to_qp_ex: the extended QP's ops (ibv_wr_*) would bypass the virtual QP.
///
/// # Safety
/// As libibverbs' ibv_qp_to_qp_ex.
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut c_void {
    if ours::<Qp>(qp) {
        refuse("ibv_qp_to_qp_ex");
        return std::ptr::null_mut();
    }
    // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
    unsafe { next::ibv_qp_to_qp_ex()(qp) }
}

/// ibv_attach_mcast: multicast (UD) is not supported.
///
/// # Safety
/// As libibverbs' ibv_attach_mcast.
#[no_mangle]
pub unsafe extern "C" fn ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int {
    if ours::<Qp>(qp) {
        return refuse("ibv_attach_mcast");
    }
    // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
    unsafe { next::ibv_attach_mcast()(qp, gid, lid) }
}

/// The ops a virtual context's table refuses: memory windows and SRQ receives.
pub mod ops {
    use super::*;

    /// ibv_alloc_mw.
    pub extern "C" fn alloc_mw(_pd: *mut ibv_pd, _type: u32) -> *mut ibv_mw {
        refuse("ibv_alloc_mw");
        std::ptr::null_mut()
    }

    /// ibv_bind_mw.
    pub extern "C" fn bind_mw(
        _qp: *mut ibv_qp,
        _mw: *mut ibv_mw,
        _bind: *mut ibv_mw_bind,
    ) -> c_int {
        refuse("ibv_bind_mw")
    }

    /// ibv_dealloc_mw.
    pub extern "C" fn dealloc_mw(_mw: *mut ibv_mw) -> c_int {
        refuse("ibv_dealloc_mw")
    }

    /// ibv_post_srq_recv.
    pub extern "C" fn post_srq_recv(
        _srq: *mut ibv_srq,
        _wr: *mut ibv_recv_wr,
        _bad: *mut *mut ibv_recv_wr,
    ) -> c_int {
        refuse("ibv_post_srq_recv")
    }
}
