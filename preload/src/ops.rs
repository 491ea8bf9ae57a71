//! The data path: the ops table of every virtual context.
//!
//! verbs.h inlines ibv_post_send, ibv_post_recv, ibv_poll_cq and ibv_req_notify_cq as a
//! call through `object->context->ops`. A virtual QP or CQ points at a virtual context,
//! whose table is [`table`]: each op here gets the real object behind the virtual one with a
//! cast and calls the provider's op on it. Real objects point at the provider's context and
//! never come here.
//!
//! Until a move changes them, the real numbers and keys are the program's: nothing in a work
//! request or a completion needs translating. What the data path adds is the record of the
//! receives ([`crate::record::Receives`]): each accepted receive is noted on its QP, and
//! each receive completion polled takes it off again.

use std::os::raw::c_int;

use rdma_sys::{
    ibv_context_ops, ibv_cq, ibv_qp, ibv_recv_wr, ibv_send_wr, ibv_wc, ibv_wc_opcode, ibv_wc_status,
};

use crate::objects::{locked, Cq, Qp};
use crate::record::PostedReceive;
use crate::unsupported;

/// The ops table of a virtual context: the four data-path ops, and a refusal for each other
/// op verbs.h still calls through the table (memory windows, SRQ receives). The `_compat_`
/// entries are left empty: only binaries built against libibverbs 1.0's headers call them.
pub fn table() -> ibv_context_ops {
    // SAFETY: every field is an `Option` of a function pointer; all-zero is all `None`.
    let mut ops: ibv_context_ops = unsafe { std::mem::zeroed() };
    ops.post_send = Some(post_send);
    ops.post_recv = Some(post_recv);
    ops.poll_cq = Some(poll_cq);
    ops.req_notify_cq = Some(req_notify_cq);
    ops.alloc_mw = Some(unsupported::ops::alloc_mw);
    ops.bind_mw = Some(unsupported::ops::bind_mw);
    ops.dealloc_mw = Some(unsupported::ops::dealloc_mw);
    ops.post_srq_recv = Some(unsupported::ops::post_srq_recv);
    ops
}

/// The provider's QP behind `qp`.
///
/// # Safety
/// `qp` came through a virtual context's table, so it is a live virtual [`Qp`].
unsafe fn real_qp(qp: *mut ibv_qp) -> *mut ibv_qp {
    // SAFETY: see the function's contract: the public struct is the `Qp`'s first field.
    unsafe { (*qp.cast::<Qp>()).real }
}

/// The provider's CQ behind `cq`.
///
/// # Safety
/// `cq` came through a virtual context's table, so it is a live virtual [`Cq`].
unsafe fn real_cq(cq: *mut ibv_cq) -> *mut ibv_cq {
    // SAFETY: see the function's contract: the public struct is the `Cq`'s first field.
    unsafe { (*cq.cast::<Cq>()).real }
}

unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: reached through a virtual context's table: `qp` is a virtual QP, its real QP
    // live, and the provider's context of a real QP has its ops table.
    unsafe {
        let real = real_qp(qp);
        match (*(*real).context).ops.post_send {
            Some(op) => op(real, wr, bad_wr),
            None => libc::EOPNOTSUPP,
        }
    }
}

unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: as in `post_send`; then the caller's chain, which the provider only read, up to
    // the first request it refused (all of it when it accepted all).
    unsafe {
        let real = real_qp(qp);
        let Some(op) = (*(*real).context).ops.post_recv else {
            return libc::EOPNOTSUPP;
        };
        let result = op(real, wr, bad_wr);
        let refused = if result == 0 {
            std::ptr::null_mut()
        } else {
            *bad_wr
        };
        let mut record = locked(&(*qp.cast::<Qp>()).record);
        let mut next = wr;
        while !next.is_null() && next != refused {
            let sges = match (*next).num_sge {
                n if n > 0 => std::slice::from_raw_parts((*next).sg_list, n as usize).to_vec(),
                _ => Vec::new(),
            };
            record.receives.posted(PostedReceive {
                wr_id: (*next).wr_id,
                sges,
            });
            next = (*next).next;
        }
        result
    }
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: reached through a virtual context's table: `cq` is a virtual CQ, its real CQ
    // live, and the provider's context of a real CQ has its ops table. The provider wrote
    // `polled` completions at `wc`.
    unsafe {
        let real = real_cq(cq);
        let Some(op) = (*(*real).context).ops.poll_cq else {
            return -libc::EOPNOTSUPP;
        };
        let polled = op(real, entries, wc);
        if polled > 0 {
            let completions = std::slice::from_raw_parts(wc, polled as usize);
            record_completions(&*cq.cast::<Cq>(), completions);
        }
        polled
    }
}

/// Takes each receive completion off its QP's record; a failed completion (it carries no
/// opcode, and the QP is in error) ends the tracking of its QP's receives.
fn record_completions(cq: &Cq, completions: &[ibv_wc]) {
    // Held throughout: a QP leaves this list before it is freed (`ibv_destroy_qp`).
    let receivers = locked(&cq.receivers);
    if receivers.is_empty() {
        return;
    }
    for wc in completions {
        let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
        if ok && wc.opcode & ibv_wc_opcode::IBV_WC_RECV == 0 {
            continue;
        }
        let Some(&(_, qp)) = receivers.iter().find(|(num, _)| *num == wc.qp_num) else {
            continue;
        };
        // SAFETY: a live virtual QP: see above.
        let mut record = locked(unsafe { &(*(qp as *const Qp)).record });
        if ok {
            record.receives.completed(wc.wr_id);
        } else {
            record.receives.lose_track();
        }
    }
}

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: as in `poll_cq`.
    unsafe {
        let real = real_cq(cq);
        match (*(*real).context).ops.req_notify_cq {
            Some(op) => op(real, solicited_only),
            None => libc::EOPNOTSUPP,
        }
    }
}
