//! The data path: the ops table of every virtual context.
//!
//! verbs.h inlines ibv_post_send, ibv_post_recv, ibv_poll_cq and ibv_req_notify_cq as a
//! call through `object->context->ops`. A virtual QP or CQ points at a virtual context,
//! whose table is [`table`]: each op here gets the real object behind the virtual one with a
//! cast and calls the provider's op on it. Real objects point at the provider's context and
//! never come here.
//!
//! Beside the call, each op keeps what a move needs ([`crate::relocate`]):
//! - a post holds the QP's [`Flow`] lock: while a move pauses the QP (or has released the
//!   device) the sends are held, copied, and the receives only recorded; after a move the
//!   requests go to the provider with the real keys ([`crate::keys`]);
//! - a poll holds the CQ's [`CqState`] lock: it gives the completions a move drained
//!   first, counts the send completions a pause waits for, takes each receive completion
//!   off its QP's record ([`crate::record::Receives`]), and gives each completion the
//!   program's QP number.
//!
//! Before any move and outside a pause, that is two uncontended locks and a copy of each
//! receive's scatter list per post; nothing in a request or a completion is rewritten.

use std::os::raw::c_int;
use std::sync::atomic::Ordering;

use rdma_sys::{
    ibv_context_ops, ibv_cq, ibv_qp, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_wc,
    ibv_wc_opcode, ibv_wc_status,
};

use crate::keys;
use crate::objects::{locked, Cq, CqState, Flow, Qp};
use crate::record::PostedReceive;
use crate::unsupported;
use crate::wr::{self, RecvChain};

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

unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: reached through a virtual context's table: `qp` is a live virtual QP; the
    // caller's chain is live for the call.
    unsafe {
        let object = &*qp.cast::<Qp>();
        let mut flow = locked(&object.flow);
        let real = object.real.load(Ordering::Acquire);
        if flow.held || real.is_null() {
            let held = wr::copy_chain(wr);
            flow.held_sends.extend(held);
            return 0;
        }
        let Some(op) = (*(*real).context).ops.post_send else {
            return libc::EOPNOTSUPP;
        };
        if !keys::translating() && flow.remote_rkeys.is_empty() {
            let result = op(real, wr, bad_wr);
            let refused = if result == 0 {
                std::ptr::null_mut()
            } else {
                *bad_wr
            };
            let mut next = wr;
            while !next.is_null() && next != refused {
                count_posted(&mut flow, (*next).send_flags);
                next = (*next).next;
            }
            return result;
        }
        let sends = wr::copy_chain(wr);
        let (result, refused) = post_owned(&mut flow, real, sends);
        if let Some(index) = refused {
            let mut bad = wr;
            for _ in 0..index {
                bad = (*bad).next;
            }
            *bad_wr = bad;
        }
        result
    }
}

/// Counts one send accepted by the provider with `flags`.
fn count_posted(flow: &mut Flow, flags: u32) {
    if flow.sig_all || flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0 {
        flow.signaled_posted += 1;
        flow.unsignaled_tail = false;
    } else {
        flow.unsignaled_tail = true;
    }
}

/// The `wr_id` of a fence ([`post_fence`]): its completion is this library's, never the
/// program's.
pub const FENCE_WR_ID: u64 = u64::from_be_bytes(*b"rdmamig!");

/// Posts a fence on `real`: a signaled RDMA WRITE of no bytes, which touches no memory at
/// the other end (no address or rkey is checked, C9-88) and completes only after every send
/// before it (an RC send queue completes in order). Its completion is counted like any
/// signaled send's and never given to the program.
///
/// # Safety
/// `real` is the live real QP of the virtual QP whose `flow` is held.
pub unsafe fn post_fence(flow: &mut Flow, real: *mut ibv_qp) -> c_int {
    // SAFETY: all-zero is a valid send request (no SGEs, null pointers).
    let mut fence: ibv_send_wr = unsafe { std::mem::zeroed() };
    fence.wr_id = FENCE_WR_ID;
    fence.opcode = rdma_sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    fence.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    let mut bad = std::ptr::null_mut();
    // SAFETY: the caller's live real QP; the request is ours, alive for the call.
    let result = unsafe {
        match (*(*real).context).ops.post_send {
            Some(op) => op(real, &mut fence, &mut bad),
            None => libc::EOPNOTSUPP,
        }
    };
    if result == 0 {
        count_posted(flow, ibv_send_flags::IBV_SEND_SIGNALED.0);
    }
    result
}

/// Posts owned sends to `real` with the real keys; gives the provider's result and the
/// index of the first send it refused.
///
/// # Safety
/// `real` is the live real QP of the virtual QP whose `flow` is held.
pub unsafe fn post_owned(
    flow: &mut Flow,
    real: *mut ibv_qp,
    mut sends: Vec<wr::HeldSend>,
) -> (c_int, Option<usize>) {
    if sends.is_empty() {
        return (0, None);
    }
    for send in &mut sends {
        send.translate(keys::lkey, |rkey| {
            flow.remote_rkeys.get(&rkey).copied().unwrap_or(rkey)
        });
    }
    let sig_all = flow.sig_all;
    let signaled: Vec<bool> = sends.iter().map(|s| s.signaled(sig_all)).collect();
    let head = wr::link_sends(&mut sends);
    let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
    // SAFETY: the caller's live real QP; `head` points into `sends`, alive for the call.
    let result = unsafe {
        match (*(*real).context).ops.post_send {
            Some(op) => op(real, head, &mut bad),
            None => libc::EOPNOTSUPP,
        }
    };
    let refused = (result != 0).then(|| wr::index_of(&sends, bad).unwrap_or(0));
    for signaled in &signaled[..refused.unwrap_or(sends.len())] {
        let flags = if *signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        count_posted(flow, flags);
    }
    (result, refused)
}

unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: as in `post_send`; the provider only reads the caller's chain.
    unsafe {
        let object = &*qp.cast::<Qp>();
        let _flow = locked(&object.flow);
        let mut posted = Vec::new();
        let mut next = wr;
        while !next.is_null() {
            let sges = match (*next).num_sge {
                n if n > 0 => std::slice::from_raw_parts((*next).sg_list, n as usize).to_vec(),
                _ => Vec::new(),
            };
            posted.push(PostedReceive {
                wr_id: (*next).wr_id,
                sges,
            });
            next = (*next).next;
        }
        let real = object.real.load(Ordering::Acquire);
        let (result, accepted) = if real.is_null() {
            // The device is away: the rebuild posts every recorded receive.
            (0, posted.len())
        } else {
            let Some(op) = (*(*real).context).ops.post_recv else {
                return libc::EOPNOTSUPP;
            };
            if keys::translating() {
                let mut chain = RecvChain::new(posted.iter(), keys::lkey);
                let mut bad = std::ptr::null_mut();
                let result = op(real, chain.link(), &mut bad);
                let accepted = if result == 0 {
                    posted.len()
                } else {
                    chain.accepted_before(bad)
                };
                if result != 0 {
                    let mut at = wr;
                    for _ in 0..accepted {
                        at = (*at).next;
                    }
                    *bad_wr = at;
                }
                (result, accepted)
            } else {
                let result = op(real, wr, bad_wr);
                let mut accepted = posted.len();
                if result != 0 {
                    accepted = 0;
                    let mut at = wr;
                    while !at.is_null() && at != *bad_wr {
                        accepted += 1;
                        at = (*at).next;
                    }
                }
                (result, accepted)
            }
        };
        let mut record = locked(&object.record);
        for receive in posted.into_iter().take(accepted) {
            record.receives.posted(receive);
        }
        result
    }
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: reached through a virtual context's table: `cq` is a live virtual CQ; `wc`
    // has room for `entries` completions (the caller's).
    unsafe {
        let object = &*cq.cast::<Cq>();
        let mut state = locked(&object.state);
        let wanted = entries.max(0) as usize;
        let mut got = 0;
        while got < wanted {
            let Some(completion) = state.buffer.pop_front() else {
                break;
            };
            *wc.add(got) = completion;
            got += 1;
        }
        let real = object.real.load(Ordering::Acquire);
        if got < wanted && !real.is_null() {
            let Some(op) = (*(*real).context).ops.poll_cq else {
                return -libc::EOPNOTSUPP;
            };
            let polled = op(real, (wanted - got) as c_int, wc.add(got));
            if polled < 0 {
                return if got > 0 { got as c_int } else { polled };
            }
            let fresh = std::slice::from_raw_parts_mut(wc.add(got), polled as usize);
            got += account(&state, fresh);
        }
        got as c_int
    }
}

/// Takes everything the real CQ holds into its buffer, for the program to poll later: a
/// move does this before it releases or resets what completes there.
pub fn drain(cq: &Cq) {
    let mut state = locked(&cq.state);
    let real = cq.real.load(Ordering::Acquire);
    if real.is_null() {
        return;
    }
    // SAFETY: all-zero is a valid ibv_wc.
    let mut batch: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: the live real CQ (the move holds the device); room for 16.
        let polled = unsafe {
            match (*(*real).context).ops.poll_cq {
                Some(op) => op(real, batch.len() as c_int, batch.as_mut_ptr()),
                None => 0,
            }
        };
        if polled <= 0 {
            break;
        }
        let kept = account(&state, &mut batch[..polled as usize]);
        // SAFETY: ibv_wc is plain data: a bitwise copy is a copy.
        state
            .buffer
            .extend(batch[..kept].iter().map(|wc| unsafe { std::ptr::read(wc) }));
    }
}

/// What each completion polled from the real CQ tells: a receive done (off its QP's
/// record), a signaled send done (counted for a pause), or a failure (the QP broken, its
/// receives flushed). Each completion then names the program's QP number; a fence's is
/// dropped. Gives how many are kept, moved to the front.
fn account(state: &CqState, completions: &mut [ibv_wc]) -> usize {
    let mut kept = 0;
    for at in 0..completions.len() {
        let wc = &mut completions[at];
        let Some(member) = state.members.iter().find(|m| m.real_qpn == wc.qp_num) else {
            completions.swap(kept, at);
            kept += 1;
            continue;
        };
        // SAFETY: a member is a live virtual QP: it leaves the list before it is freed.
        let qp = unsafe { &*(member.qp as *const Qp) };
        let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
        let receive = wc.opcode & ibv_wc_opcode::IBV_WC_RECV != 0;
        if !ok {
            locked(&qp.record).receives.lose_track();
            locked(&qp.flow).broken = true;
        } else if receive {
            locked(&qp.record).receives.completed(wc.wr_id);
        } else {
            locked(&qp.flow).signaled_done += 1;
        }
        if !receive && wc.wr_id == FENCE_WR_ID {
            continue;
        }
        wc.qp_num = qp.public.qp_num;
        completions.swap(kept, at);
        kept += 1;
    }
    kept
}

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: as in `poll_cq`.
    unsafe {
        let object = &*cq.cast::<Cq>();
        let mut state = locked(&object.state);
        state.armed = true;
        let real = object.real.load(Ordering::Acquire);
        if real.is_null() {
            // Armed again on the new CQ by the rebuild.
            return 0;
        }
        match (*(*real).context).ops.req_notify_cq {
            Some(op) => op(real, solicited_only),
            None => libc::EOPNOTSUPP,
        }
    }
}
