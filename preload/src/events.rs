//! Completion events on a virtual channel, across moves.
//!
//! A program that sleeps on completion events (ibv_get_cq_event) must neither sleep inside
//! the kernel on a channel a move is about to destroy (nothing would ever wake it, and the
//! unplug would wait for it), nor miss the completions a move drained for it. So the wait
//! is on the channel's descriptor, [`WAIT_STEP_MS`] at a time, outside the move's gate: only
//! once the descriptor is readable does it take the gate and read the event (looking again
//! first if a move began meanwhile). Between waits
//! it looks at the channel's CQs: an armed CQ with completions a move drained
//! ([`crate::objects::CqState::buffer`]) gets its event from here, as the real CQ would
//! have given it had nothing moved.
//!
//! Acknowledgements follow the real CQ: libibverbs' ibv_destroy_cq waits until every event
//! the kernel delivered for a CQ was acknowledged, so each virtual CQ counts the events its
//! current real CQ delivered ([`crate::objects::CqState::unacked`]). A program's ack goes to
//! the real CQ for at most that many, and a move acknowledges the rest before destroying
//! it; the program's acks of the events made here, or of an old real CQ's, stop here.

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;

use rdma_sys::{ibv_comp_channel, ibv_cq};

use crate::next;
use crate::objects::{self, find, locked, real, Channel, Cq, Drained};
use crate::relocate::{control, moves_begun};

/// How long one wait on the channel's descriptor lasts before looking again for a move's
/// completions (a move changes the file behind the descriptor, never its number).
const WAIT_STEP_MS: c_int = 50;

/// ibv_get_cq_event on a virtual channel: the next event of one of its CQs, with the
/// program's CQ and context.
///
/// # Safety
/// `channel` is a live virtual channel; `cq` and `cq_context` are writable.
pub unsafe fn next_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: the caller's live channel; its descriptor number stays the program's.
    let fd = unsafe { (*channel).fd };
    let blocking = !nonblocking(fd);
    loop {
        let moves = moves_begun();
        if let Some(drained) = drained_event(channel) {
            // SAFETY: a live virtual CQ; the out-pointers are the caller's.
            unsafe {
                *cq = drained;
                *cq_context = (*drained).cq_context;
            }
            return 0;
        }
        if blocking && !readable(fd, WAIT_STEP_MS) {
            continue;
        }
        let _device = control();
        let real_channel = real::<Channel>(channel);
        // A move since the wait may have put another file behind the descriptor: look again.
        let moved = moves_begun() != moves;
        if real_channel.is_null() || (blocking && moved && !readable(fd, 0)) {
            if blocking {
                continue;
            }
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = libc::EAGAIN };
            return -1;
        }
        let mut real_cq = null_mut();
        let mut real_context = null_mut();
        // SAFETY: the real channel behind the caller's, readable (or the caller's own
        // non-blocking descriptor); the out-pointers are ours.
        let result =
            unsafe { next::ibv_get_cq_event()(real_channel, &mut real_cq, &mut real_context) };
        if result != 0 {
            return result;
        }
        // The real CQ was created with its virtual CQ as its context.
        let virtual_cq = real_context.cast::<ibv_cq>();
        match find::<Cq>(virtual_cq) {
            // SAFETY: a live virtual CQ; the out-pointers are the caller's.
            Some(object) => unsafe {
                let mut state = locked(&(*object).state);
                state.unacked += 1;
                state.armed = false;
                *cq = virtual_cq;
                *cq_context = (*object).public.cq_context;
            },
            // SAFETY: a CQ some other path made: what libibverbs said, unchanged.
            None => unsafe {
                *cq = real_cq;
                *cq_context = real_context;
            },
        }
        return 0;
    }
}

/// ibv_ack_cq_events on a virtual CQ: to its real CQ, for at most the events that one
/// delivered and no ack took yet.
pub fn ack(cq: &Cq, events: c_uint) {
    let _device = control();
    let mut state = locked(&cq.state);
    let acked = events.min(state.unacked);
    let real = cq.real.load(Ordering::Acquire);
    if acked == 0 || real.is_null() {
        return;
    }
    state.unacked -= acked;
    // SAFETY: the live real CQ (the gate keeps a move from releasing it).
    unsafe { next::ibv_ack_cq_events()(real, acked) };
}

/// Acknowledges every event the real CQ behind `cq` delivered and no ack took, so that
/// destroying it does not wait for the program. A move calls it, with `cq`'s state held.
///
/// # Safety
/// `real` is `cq`'s live real CQ.
pub unsafe fn ack_all(real: *mut ibv_cq, unacked: &mut c_uint) {
    if *unacked > 0 {
        // SAFETY: the caller's live real CQ.
        unsafe { next::ibv_ack_cq_events()(real, *unacked) };
        *unacked = 0;
    }
}

/// The first CQ of `channel` the program armed that holds completions a move drained; it
/// is disarmed, as an event disarms a real CQ.
fn drained_event(channel: *mut ibv_comp_channel) -> Option<*mut ibv_cq> {
    if !Drained::any() {
        return None;
    }
    objects::all::<Cq>().into_iter().find_map(|cq| {
        // SAFETY: a live virtual CQ; its channel never changes.
        let object = unsafe { &*cq };
        if object.public.channel != channel {
            return None;
        }
        let mut state = locked(&object.state);
        (state.armed && !state.buffer.is_empty()).then(|| {
            state.armed = false;
            cq.cast::<ibv_cq>()
        })
    })
}

/// Whether `fd` was opened non-blocking (the program polls its channel itself).
fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL on a descriptor number; a bad one gives -1.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

/// Whether `fd` becomes readable within `timeout_ms`.
fn readable(fd: c_int, timeout_ms: c_int) -> bool {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd of ours.
    let ready = unsafe { libc::poll(&mut poll, 1, timeout_ms) };
    ready > 0 && poll.revents & libc::POLLIN != 0
}
