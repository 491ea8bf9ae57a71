//! A move of the program's verbs objects to a new device: the agent's quiesce and resume.
//!
//! **Quiesce** (the device is about to be unplugged):
//! 1. every QP in RTS is paused: the program's new sends are held ([`Flow::held`]);
//! 2. the sends already posted complete (the move drains the CQs itself, so that a program
//!    that is not polling does not hold it up; the program gets those completions later);
//! 3. the other end of each QP is paused the same way, through its agent
//!    ([`crate::peer`]): once it answers, nothing is in flight in either direction;
//! 4. the CQs are drained once more, and everything on the device is released, QPs first.
//!    The descriptors the program knows (completion channels, the context's) keep their
//!    numbers: a placeholder takes each one's place until the rebuild puts the new file
//!    there.
//!
//! **Resume** (a new device is there, or the old one came back after a rollback): the
//! context is opened again on the device whose GID table has the QPs' source GID; PDs, MRs
//! (same addresses: the VM's memory moved with it), channels and CQs are made again; each
//! QP is created, given its receives again, walked to RTR, then its peer is asked to walk
//! its QP to the new one ([`PeerRequest::Reconnect`]), then it goes to RTS and the held
//! sends are posted. A quiesce that failed before releasing anything is undone the same
//! way, without a rebuild: the peers are told to go on ([`PeerRequest::Unpause`]).
//!
//! While the device is away, control verbs wait ([`control`]), and the data path holds sends
//! and records receives ([`crate::ops`]).

use std::cell::Cell;
use std::collections::HashMap;
use std::net::IpAddr;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rdma_sys::{ibv_gid, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_state};
use rdmamig_proto::preload::PeerRequest;
use thiserror::Error;

use crate::exports::cqs_of;
use crate::objects::{self, locked, trace, Channel, Context, Cq, Mr, Pd, Qp};
use crate::peer::{self, PeerError};
use crate::record::{copy_attr, Receives};
use crate::wr::RecvChain;
use crate::{cm, events, keys, next, ops};

/// Why a move of the program's objects failed.
#[derive(Debug, Error)]
pub enum MoveError {
    /// The QP is in a state or use this library cannot carry.
    #[error("QP {qp:#x}: {what}")]
    Unsupported {
        /// The program's QP number.
        qp: u32,
        /// What is not supported.
        what: &'static str,
    },
    /// Sends posted before the pause did not complete in time.
    #[error("QP {qp:#x}: its sends in flight did not complete before the deadline")]
    NotDrained {
        /// The program's QP number.
        qp: u32,
    },
    /// The other end of a QP did not do what was asked.
    #[error("QP {qp:#x}: the other end did not {step}")]
    Peer {
        /// The program's QP number.
        qp: u32,
        /// What it was asked.
        step: &'static str,
        /// Why.
        #[source]
        source: PeerError,
    },
    /// A verb failed on the new device.
    #[error("{verb} failed on the new device")]
    Rebuild {
        /// The verb.
        verb: &'static str,
        /// The error it gave.
        #[source]
        source: std::io::Error,
    },
    /// An rdma_cm id listens on one address: its kernel id goes with the device.
    #[error("an rdma_cm id listens on one address here: such a listener is not carried")]
    Listening,
    /// No device has the GID the QPs used, within the deadline.
    #[error("no RDMA device has the GID {gid} (the QPs' source address)")]
    NoDevice {
        /// The GID, as an IPv6 address.
        gid: std::net::Ipv6Addr,
    },
}

/// The QP-state of a move, between the agent's quiesce and resume.
enum Phase {
    /// No move.
    Running,
    /// Paused (theirs and ours), nothing released: a failed quiesce, or one whose release
    /// failed before anything was let go.
    Paused,
    /// Everything released; each context's source GID, by the context's address.
    Released(HashMap<usize, [u8; 16]>),
}

static PHASE: Mutex<Phase> = Mutex::new(Phase::Running);

/// How often the drain looks at the CQs while it waits for sends to complete.
const DRAIN_POLL: Duration = Duration::from_millis(1);

// ----- the gate of control verbs -------------------------------------------------------

/// Closed while the device is away: control verbs (create, modify, destroy...) wait at it
/// instead of reaching a released object.
struct Gate {
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

static GATE: Gate = Gate {
    state: Mutex::new((false, 0)),
    changed: Condvar::new(),
};

thread_local! {
    /// This thread runs a move: it passes the closed gate.
    static MOVER: Cell<bool> = const { Cell::new(false) };
}

/// A control verb in progress: the gate does not close until it is done.
pub struct ControlGuard(());

impl Drop for ControlGuard {
    fn drop(&mut self) {
        locked(&GATE.state).1 -= 1;
        GATE.changed.notify_all();
    }
}

/// Waits while a move has the device away, then holds the gate open until dropped. The
/// move's own thread passes.
pub fn control() -> Option<ControlGuard> {
    if MOVER.with(Cell::get) {
        return None;
    }
    let mut state = locked(&GATE.state);
    while state.0 {
        state = GATE.changed.wait(state).unwrap_or_else(|e| e.into_inner());
    }
    state.1 += 1;
    Some(ControlGuard(()))
}

/// How many times the gate closed.
static CLOSINGS: AtomicU64 = AtomicU64::new(0);

/// How many moves have begun (closed the gate): a wait that saw the same number before and
/// after, the second time at the open gate, saw the same devices' files throughout.
pub fn moves_begun() -> u64 {
    CLOSINGS.load(Ordering::Acquire)
}

/// Closes the gate once no control verb is in progress.
fn close_gate() {
    let mut state = locked(&GATE.state);
    state.0 = true;
    CLOSINGS.fetch_add(1, Ordering::AcqRel);
    while state.1 > 0 {
        state = GATE.changed.wait(state).unwrap_or_else(|e| e.into_inner());
    }
}

fn open_gate() {
    locked(&GATE.state).0 = false;
    GATE.changed.notify_all();
}

/// Runs `f` as the move's thread.
fn as_mover<T>(f: impl FnOnce() -> T) -> T {
    MOVER.with(|m| m.set(true));
    let result = f();
    MOVER.with(|m| m.set(false));
    result
}

// ----- the QPs a move carries ----------------------------------------------------------

/// A live virtual QP, as the move sees it.
#[derive(Clone, Copy)]
struct Carried(*mut Qp);

impl Carried {
    fn qp(&self) -> &Qp {
        // SAFETY: taken from the registry under the gate: live for the whole move (a
        // destroy waits at the gate).
        unsafe { &*self.0 }
    }

    fn number(&self) -> u32 {
        self.qp().public.qp_num
    }

    /// Where its other end is, and that end's QP as its program knows it.
    fn remote(&self) -> (IpAddr, u32) {
        let record = locked(&self.qp().record);
        let attr = record.setup.attr();
        // SAFETY: reading the GID's raw bytes, plain data.
        let gid = unsafe { attr.ah_attr.grh.dgid.raw };
        (peer::ip_of(gid), attr.dest_qp_num)
    }

    fn state(&self) -> ibv_qp_state::Type {
        locked(&self.qp().record).setup.state()
    }
}

/// Every live virtual QP.
fn carried() -> Vec<Carried> {
    objects::all::<Qp>().into_iter().map(Carried).collect()
}

/// The virtual CQs `qp` completes on.
fn cqs_of_qp(qp: &Qp) -> Vec<*mut Cq> {
    locked(&qp.record).init.iter().flat_map(cqs_of).collect()
}

/// Takes what the real CQs of `qp` hold into their buffers ([`ops::drain`]).
pub fn drain_cqs(qp: &Qp) {
    for cq in cqs_of_qp(qp) {
        // SAFETY: a live virtual CQ (a QP uses it; destroying it waits at the gate).
        ops::drain(unsafe { &*cq });
    }
}

/// Drains the real CQs of `qp` until it has no signaled send outstanding; false if
/// `deadline` passed first.
pub fn drain_sends(qp: &Qp, deadline: Instant) -> bool {
    loop {
        drain_cqs(qp);
        if locked(&qp.flow).drained() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(DRAIN_POLL);
    }
}

/// Drains until no QP of `qps` has a signaled send outstanding.
fn wait_drained(qps: &[Carried], deadline: Instant) -> Result<(), MoveError> {
    match qps.iter().find(|qp| !drain_sends(qp.qp(), deadline)) {
        Some(qp) => Err(MoveError::NotDrained { qp: qp.number() }),
        None => Ok(()),
    }
}

/// Holds new sends on `qp`. When its last send was unsignaled (its completion will never
/// be seen), a fence follows it ([`ops::post_fence`]), so that the drain can tell when every
/// send before it is done: only on an rdma_cm connection, whose QPs the kernel always gives
/// remote write (a fence on a QP without it would break the connection); without one the
/// hold is refused.
pub fn hold(qp: &Qp) -> Result<(), &'static str> {
    {
        let mut flow = locked(&qp.flow);
        flow.held = true;
        flow.pause += 1;
        if !flow.unsignaled_tail || flow.broken {
            return Ok(());
        }
    }
    let refused = if !cm::connects(qp) {
        Some("its last send was unsignaled (when it completes cannot be seen), and it is not an rdma_cm connection (which a fence would tell)")
    } else if !fence(qp) {
        Some("its last send was unsignaled, and no fence could follow it (its send queue stayed full)")
    } else {
        None
    };
    match refused {
        Some(why) => {
            release_held(qp);
            Err(why)
        }
        None => Ok(()),
    }
}

/// How long a hold tries to post a fence while the send queue is full.
const FENCE_WAIT: Duration = Duration::from_secs(2);

/// Posts a fence after `qp`'s sends, draining its CQs while its send queue is full.
fn fence(qp: &Qp) -> bool {
    let deadline = Instant::now() + FENCE_WAIT;
    loop {
        {
            let mut flow = locked(&qp.flow);
            let real = qp.real.load(Ordering::Acquire);
            if real.is_null() || !flow.unsignaled_tail {
                return true;
            }
            // SAFETY: the live real QP, under its flow lock.
            match unsafe { ops::post_fence(&mut flow, real) } {
                0 => {
                    trace(format_args!(
                        "qp {:#x}: a fence follows its unsignaled sends",
                        qp.public.qp_num
                    ));
                    return true;
                }
                libc::ENOMEM if Instant::now() < deadline => {}
                _ => return false,
            }
        }
        drain_cqs(qp);
        std::thread::sleep(DRAIN_POLL);
    }
}

/// Posts the sends held on `qp` to its real QP and stops holding.
pub fn release_held(qp: &Qp) {
    let mut flow = locked(&qp.flow);
    let real = qp.real.load(Ordering::Acquire);
    if real.is_null() {
        return;
    }
    flow.held = false;
    flow.pause += 1;
    let sends = std::mem::take(&mut flow.held_sends);
    let count = sends.len();
    // SAFETY: the live real QP, under its flow lock.
    let (result, refused) = unsafe { ops::post_owned(&mut flow, real, sends) };
    if result != 0 {
        eprintln!(
            "rdmamig-preload: QP {:#x}: {} held sends of {count} could not be posted (error {result})",
            qp.public.qp_num,
            count - refused.unwrap_or(0)
        );
    }
}

// ----- quiesce -------------------------------------------------------------------------

/// The agent's quiesce: pause every QP and its peer, then release the device.
pub fn quiesce(deadline: Instant) -> Result<(), MoveError> {
    as_mover(|| {
        let mut phase = locked(&PHASE);
        if !matches!(*phase, Phase::Running) {
            // Quiesced already (a repeated request): nothing more to do.
            return Ok(());
        }
        let qps = carried();
        let live: Vec<Carried> = qps
            .iter()
            .copied()
            .filter(|qp| qp.state() == ibv_qp_state::IBV_QPS_RTS)
            .collect();
        trace(format_args!(
            "quiesce: {} QPs, {} connected",
            qps.len(),
            live.len()
        ));
        for qp in &qps {
            if qp.state() == ibv_qp_state::IBV_QPS_RTR {
                return Err(MoveError::Unsupported {
                    qp: qp.number(),
                    what: "it is between RTR and RTS",
                });
            }
        }
        if cm::listening() {
            return Err(MoveError::Listening);
        }
        for qp in &live {
            if locked(&qp.qp().record).receives.lost_track() {
                return Err(MoveError::Unsupported {
                    qp: qp.number(),
                    what: "its receives were not tracked (a failed completion)",
                });
            }
        }
        for (i, qp) in live.iter().enumerate() {
            if let Err(what) = hold(qp.qp()) {
                live[..i].iter().for_each(|q| release_held(q.qp()));
                return Err(MoveError::Unsupported {
                    qp: qp.number(),
                    what,
                });
            }
        }
        *phase = Phase::Paused;
        wait_drained(&live, deadline)?;
        for qp in &live {
            let (ip, remote) = qp.remote();
            let pause = PeerRequest::Pause {
                qp: remote,
                from_qp: qp.number(),
            };
            peer::ask(ip, &pause, deadline).map_err(|source| MoveError::Peer {
                qp: qp.number(),
                step: "pause",
                source,
            })?;
            trace(format_args!("qp {:#x}: paused with its peer", qp.number()));
        }
        wait_drained(&live, deadline)?;
        close_gate();
        let gids = release(&qps);
        *phase = Phase::Released(gids);
        trace(format_args!("released the device"));
        Ok(())
    })
}

/// The source GID of each context's QPs (the first QP's), by the context's address.
fn source_gids(qps: &[Carried]) -> HashMap<usize, [u8; 16]> {
    let mut gids = HashMap::new();
    for qp in qps {
        let context = qp.qp().public.context as usize;
        if gids.contains_key(&context) {
            continue;
        }
        let (port, index) = {
            let record = locked(&qp.qp().record);
            let attr = record.setup.attr();
            (attr.port_num, attr.ah_attr.grh.sgid_index)
        };
        let real = objects::real::<Context>(context as *mut _);
        // SAFETY: all-zero is a valid GID.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the live real context; the GID is ours.
        let rc = unsafe { next::ibv_query_gid()(real, port.max(1), index.into(), &mut gid) };
        if rc == 0 {
            // SAFETY: the raw bytes of a GID just written.
            gids.insert(context, unsafe { gid.raw });
        }
    }
    gids
}

/// Releases everything on the device, QPs first, and gives each context's source GID.
fn release(qps: &[Carried]) -> HashMap<usize, [u8; 16]> {
    let gids = source_gids(qps);
    for qp in qps {
        let _flow = locked(&qp.qp().flow);
        let real = qp.qp().real.swap(std::ptr::null_mut(), Ordering::AcqRel);
        // SAFETY: the real QP, which nothing uses any more (its flow is held).
        let rc = unsafe { next::ibv_destroy_qp()(real) };
        warn_failed("ibv_destroy_qp", rc);
    }
    for cq in objects::all::<Cq>() {
        // SAFETY: a live virtual CQ.
        let cq = unsafe { &*cq };
        ops::drain(cq);
        let mut state = locked(&cq.state);
        let real = cq.real.swap(std::ptr::null_mut(), Ordering::AcqRel);
        // SAFETY: the real CQ, drained, with no QP left on it; its events acknowledged
        // first, or its destroy would wait for the program's acks.
        unsafe {
            events::ack_all(real, &mut state.unacked);
            warn_failed("ibv_destroy_cq", next::ibv_destroy_cq()(real));
        }
    }
    for mr in objects::all::<Mr>() {
        // SAFETY: a live virtual MR.
        let real = unsafe { (*mr).real.swap(std::ptr::null_mut(), Ordering::AcqRel) };
        // SAFETY: its real MR, which no QP uses any more.
        warn_failed("ibv_dereg_mr", unsafe { next::ibv_dereg_mr()(real) });
    }
    for pd in objects::all::<Pd>() {
        // SAFETY: a live virtual PD.
        let real = unsafe { (*pd).real.swap(std::ptr::null_mut(), Ordering::AcqRel) };
        // SAFETY: its real PD, empty now.
        warn_failed("ibv_dealloc_pd", unsafe { next::ibv_dealloc_pd()(real) });
    }
    for channel in objects::all::<Channel>() {
        // SAFETY: a live virtual channel.
        let real = unsafe { (*channel).real.swap(std::ptr::null_mut(), Ordering::AcqRel) };
        // SAFETY: its real channel, with no CQ left; its descriptor is the program's.
        unsafe {
            (*real).fd = park_fd((*real).fd);
            warn_failed(
                "ibv_destroy_comp_channel",
                next::ibv_destroy_comp_channel()(real),
            );
        }
    }
    for context in objects::all::<Context>() {
        // SAFETY: a live virtual context.
        let real = unsafe { (*context).real.swap(std::ptr::null_mut(), Ordering::AcqRel) };
        // SAFETY: its real context, empty now; its descriptors are the program's.
        unsafe {
            (*real).async_fd = park_fd((*real).async_fd);
            (*real).cmd_fd = park_fd((*real).cmd_fd);
            warn_failed("ibv_close_device", next::ibv_close_device()(real));
        }
    }
    gids
}

fn warn_failed(verb: &str, rc: c_int) {
    if rc != 0 {
        eprintln!("rdmamig-preload: {verb} on the old device failed with {rc}");
    }
}

/// Puts a placeholder (an eventfd that never becomes readable) at the descriptor number
/// `fd`, and gives the number the file moved to, for the release to close.
fn park_fd(fd: c_int) -> c_int {
    // SAFETY: plain descriptor calls on numbers this library's objects own.
    unsafe {
        let moved = libc::dup(fd);
        let placeholder = libc::eventfd(0, libc::EFD_CLOEXEC);
        if moved < 0 || placeholder < 0 {
            if placeholder >= 0 {
                libc::close(placeholder);
            }
            return fd;
        }
        libc::dup2(placeholder, fd);
        libc::close(placeholder);
        moved
    }
}

/// Puts the file of the new descriptor `fresh` at the program's number `at` (closing the
/// placeholder there), and gives `at`.
fn adopt_fd(fresh: c_int, at: c_int) -> c_int {
    if fresh == at {
        return at;
    }
    // SAFETY: plain descriptor calls on numbers this library's objects own.
    unsafe {
        if libc::dup2(fresh, at) < 0 {
            return fresh;
        }
        libc::close(fresh);
    }
    at
}

// ----- resume --------------------------------------------------------------------------

/// The agent's resume: rebuild on the device there now and reconnect every QP, or, if
/// nothing was released, let the paused QPs and their peers go on.
pub fn resume(deadline: Instant) -> Result<(), MoveError> {
    as_mover(|| {
        let mut phase = locked(&PHASE);
        match std::mem::replace(&mut *phase, Phase::Running) {
            Phase::Running => Ok(()),
            Phase::Paused => {
                unpause(deadline);
                Ok(())
            }
            Phase::Released(gids) => {
                trace(format_args!("resume: rebuilding on the new device"));
                let rebuilt = rebuild(&gids, deadline);
                open_gate();
                rebuilt
            }
        }
    })
}

/// Lets every held QP and its peer go on, with nothing released.
fn unpause(deadline: Instant) {
    for qp in carried() {
        if !locked(&qp.qp().flow).held {
            continue;
        }
        let (ip, remote) = qp.remote();
        let unpause = PeerRequest::Unpause {
            qp: remote,
            from_qp: qp.number(),
        };
        if let Err(e) = peer::ask(ip, &unpause, deadline) {
            eprintln!(
                "rdmamig-preload: QP {:#x}: the other end was not told to go on: {e}",
                qp.number()
            );
        }
        release_held(qp.qp());
    }
}

fn os_error(verb: &'static str) -> MoveError {
    MoveError::Rebuild {
        verb,
        source: std::io::Error::last_os_error(),
    }
}

fn rc_error(verb: &'static str, rc: c_int) -> Result<(), MoveError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(MoveError::Rebuild {
            verb,
            source: std::io::Error::from_raw_os_error(rc.abs()),
        })
    }
}

/// Opens the device whose port 1 has `gid`; gives its context and the GID's index.
fn open_device_with(
    gid: Option<[u8; 16]>,
    deadline: Instant,
) -> Result<(*mut rdma_sys::ibv_context, u8), MoveError> {
    loop {
        let mut count = 0;
        // SAFETY: libibverbs' device list (not a verb this library defines).
        let list = unsafe { rdma_sys::ibv_get_device_list(&mut count) };
        let mut found = None;
        for i in 0..count.max(0) as usize {
            // SAFETY: `count` entries.
            let device = unsafe { *list.add(i) };
            // SAFETY: a listed device, to libibverbs' own verb.
            let context = unsafe { next::ibv_open_device()(device) };
            if context.is_null() {
                continue;
            }
            let index = match gid {
                None => Some(0),
                Some(gid) => (0..=255u8).find(|&index| {
                    // SAFETY: all-zero is a valid GID.
                    let mut have: ibv_gid = unsafe { std::mem::zeroed() };
                    // SAFETY: the context just opened; the GID is ours.
                    let rc = unsafe { next::ibv_query_gid()(context, 1, index.into(), &mut have) };
                    // SAFETY: raw bytes of a GID.
                    rc == 0 && unsafe { have.raw } == gid
                }),
            };
            match index {
                Some(index) => {
                    found = Some((context, index));
                    break;
                }
                // SAFETY: the context just opened, unused.
                None => unsafe {
                    next::ibv_close_device()(context);
                },
            }
        }
        if !list.is_null() {
            // SAFETY: the list libibverbs gave; an open context keeps its device.
            unsafe { rdma_sys::ibv_free_device_list(list) };
        }
        if let Some(found) = found {
            return Ok(found);
        }
        if Instant::now() >= deadline {
            return Err(MoveError::NoDevice {
                gid: std::net::Ipv6Addr::from(gid.unwrap_or_default()),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Makes every object again on the device there now, in the order they were made, and
/// reconnects every QP that was in RTS.
fn rebuild(gids: &HashMap<usize, [u8; 16]>, deadline: Instant) -> Result<(), MoveError> {
    let mut gid_index = HashMap::new();
    for context in objects::all::<Context>() {
        let gid = gids.get(&(context as usize)).copied();
        let (real, index) = open_device_with(gid, deadline)?;
        trace(format_args!(
            "opened the new device (source GID at index {index})"
        ));
        gid_index.insert(context as usize, index);
        // SAFETY: a live virtual context and the real one just opened; the program's
        // descriptor numbers get the new files.
        unsafe {
            let public = &mut (*context).public;
            (*real).async_fd = adopt_fd((*real).async_fd, public.async_fd);
            (*real).cmd_fd = adopt_fd((*real).cmd_fd, public.cmd_fd);
            public.device = (*real).device;
            public.num_comp_vectors = (*real).num_comp_vectors;
            (*context).real.store(real, Ordering::Release);
        }
    }
    for pd in objects::all::<Pd>() {
        // SAFETY: a live virtual PD whose context was rebuilt above.
        unsafe {
            let real = next::ibv_alloc_pd()(objects::real::<Context>((*pd).public.context));
            if real.is_null() {
                return Err(os_error("ibv_alloc_pd"));
            }
            (*pd).public.handle = (*real).handle;
            (*pd).real.store(real, Ordering::Release);
        }
    }
    for mr in objects::all::<Mr>() {
        // SAFETY: a live virtual MR whose PD was rebuilt above; its memory is the
        // program's, at the same address.
        unsafe {
            let public = &(*mr).public;
            let real = next::ibv_reg_mr_iova2()(
                objects::real::<Pd>(public.pd),
                public.addr,
                public.length,
                (*mr).iova,
                (*mr).access,
            );
            if real.is_null() {
                return Err(os_error("ibv_reg_mr"));
            }
            keys::moved((public.lkey, public.rkey), ((*real).lkey, (*real).rkey));
            (*mr).real.store(real, Ordering::Release);
        }
    }
    for channel in objects::all::<Channel>() {
        // SAFETY: a live virtual channel whose context was rebuilt above.
        unsafe {
            let real = next::ibv_create_comp_channel()(objects::real::<Context>(
                (*channel).public.context,
            ));
            if real.is_null() {
                return Err(os_error("ibv_create_comp_channel"));
            }
            (*real).fd = adopt_fd((*real).fd, (*channel).public.fd);
            (*channel).real.store(real, Ordering::Release);
        }
    }
    for cq in objects::all::<Cq>() {
        // SAFETY: a live virtual CQ whose context and channel were rebuilt above.
        unsafe {
            let public = &(*cq).public;
            let real = next::ibv_create_cq()(
                objects::real::<Context>(public.context),
                public.cqe,
                cq.cast(),
                objects::real::<Channel>(public.channel),
                (*cq).comp_vector,
            );
            if real.is_null() {
                return Err(os_error("ibv_create_cq"));
            }
            let state = locked(&(*cq).state);
            if state.armed {
                if let Some(op) = (*(*real).context).ops.req_notify_cq {
                    op(real, 0);
                }
            }
            (*cq).public.handle = (*real).handle;
            (*cq).real.store(real, Ordering::Release);
        }
    }
    trace(format_args!("PDs, MRs, channels and CQs made again"));
    for qp in carried() {
        let index = gid_index
            .get(&(qp.qp().public.context as usize))
            .copied()
            .unwrap_or(0);
        rebuild_qp(qp, index, deadline)?;
    }
    Ok(())
}

/// The fields of the transition to INIT a rebuild (or a reconnect of the other end) walks.
pub const INIT_MASK: u32 = ibv_qp_attr_mask::IBV_QP_STATE.0
    | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
    | ibv_qp_attr_mask::IBV_QP_PORT.0
    | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
/// The fields of the transition to RTR.
pub const RTR_MASK: u32 = ibv_qp_attr_mask::IBV_QP_STATE.0
    | ibv_qp_attr_mask::IBV_QP_AV.0
    | ibv_qp_attr_mask::IBV_QP_PATH_MTU.0
    | ibv_qp_attr_mask::IBV_QP_DEST_QPN.0
    | ibv_qp_attr_mask::IBV_QP_RQ_PSN.0
    | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
    | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0;
/// The fields of the transition to RTS.
pub const RTS_MASK: u32 = ibv_qp_attr_mask::IBV_QP_STATE.0
    | ibv_qp_attr_mask::IBV_QP_TIMEOUT.0
    | ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0
    | ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0
    | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0
    | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0;

/// Moves the real QP `real` to `state` with `attr`'s fields `mask` names.
///
/// # Safety
/// `real` is a live QP of libibverbs' own.
pub unsafe fn walk(
    real: *mut rdma_sys::ibv_qp,
    attr: &ibv_qp_attr,
    state: ibv_qp_state::Type,
    mask: u32,
) -> Result<(), MoveError> {
    let mut attr = copy_attr(attr);
    attr.qp_state = state;
    // SAFETY: the caller's live real QP; the attributes are ours.
    let rc = unsafe { next::ibv_modify_qp()(real, &mut attr, mask as c_int) };
    rc_error("ibv_modify_qp", rc)
}

/// Posts the receives `receives` records (the program's, outstanding) to the real QP `real`,
/// with the real lkeys.
///
/// # Safety
/// `real` is a live QP of libibverbs' own.
pub unsafe fn post_receives(
    real: *mut rdma_sys::ibv_qp,
    receives: &Receives,
) -> Result<(), MoveError> {
    let mut chain = RecvChain::new(receives.outstanding(), keys::lkey);
    let head = chain.link();
    if head.is_null() {
        return Ok(());
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: the caller's live real QP; the chain points into `chain`.
    let rc = unsafe {
        match (*(*real).context).ops.post_recv {
            Some(op) => op(real, head, &mut bad),
            None => libc::EOPNOTSUPP,
        }
    };
    rc_error("ibv_post_recv", rc)
}

/// Creates `qp` again on its rebuilt PD and CQs and walks it to the state the program had
/// it in; a QP in RTS is reconnected with its other end.
fn rebuild_qp(qp: Carried, gid_index: u8, deadline: Instant) -> Result<(), MoveError> {
    let object = qp.qp();
    let (init, mut attr, state, remote_real) = {
        let record = locked(&object.record);
        let Some(init) = record.init else {
            return Ok(());
        };
        (
            init,
            record.setup.attr_copy(),
            record.setup.state(),
            record.remote_real_qpn,
        )
    };
    let mut given = init;
    given.qp_context = qp.0.cast();
    given.send_cq = objects::real::<Cq>(init.send_cq);
    given.recv_cq = objects::real::<Cq>(init.recv_cq);
    // SAFETY: the rebuilt PD, and attributes naming the rebuilt CQs.
    let real = unsafe { next::ibv_create_qp()(objects::real::<Pd>(object.public.pd), &mut given) };
    if real.is_null() {
        return Err(os_error("ibv_create_qp"));
    }
    // SAFETY: the live real QP just made.
    let real_qpn = unsafe { (*real).qp_num };
    for cq in cqs_of_qp(object) {
        // SAFETY: a live virtual CQ.
        let mut cq_state = locked(unsafe { &(*cq).state });
        for member in cq_state
            .members
            .iter_mut()
            .filter(|m| m.qp == qp.0 as usize)
        {
            member.real_qpn = real_qpn;
        }
    }
    if state != ibv_qp_state::IBV_QPS_RESET {
        // SAFETY: the live real QP just made.
        unsafe { walk(real, &attr, ibv_qp_state::IBV_QPS_INIT, INIT_MASK)? };
    }
    trace(format_args!(
        "qp {:#x}: made again as real qp {real_qpn:#x}, in INIT",
        qp.number()
    ));
    {
        // The receives go on before the peer can send; from here the program's posts go
        // to the new QP (its sends still held).
        let _flow = locked(&object.flow);
        let record = locked(&object.record);
        // An errored QP flushed its receives: it is only walked to ERR again.
        if state != ibv_qp_state::IBV_QPS_ERR {
            if record.receives.lost_track() {
                return Err(MoveError::Unsupported {
                    qp: qp.number(),
                    what: "its receives were not tracked (a failed completion)",
                });
            }
            // SAFETY: the live real QP just made.
            unsafe { post_receives(real, &record.receives)? };
        }
        object.real.store(real, Ordering::Release);
    }
    match state {
        ibv_qp_state::IBV_QPS_RTS => {
            attr.ah_attr.grh.sgid_index = gid_index;
            let mut rtr = copy_attr(&attr);
            rtr.dest_qp_num = remote_real.unwrap_or(attr.dest_qp_num);
            let (ip, remote) = qp.remote();
            // Connected before the walk to RTR, which needs the peer's link-layer address:
            // on the new NIC the connection resolves it, where the RTR alone waited about
            // a second for it (2026-12-07, Soft-RoCE).
            let link = peer::Link::connect(ip, deadline).map_err(|source| MoveError::Peer {
                qp: qp.number(),
                step: "reconnect",
                source,
            })?;
            // SAFETY: the live real QP just made.
            unsafe { walk(real, &rtr, ibv_qp_state::IBV_QPS_RTR, RTR_MASK)? };
            // SAFETY: all-zero is a valid GID.
            let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: the rebuilt context; the GID is ours.
            unsafe {
                next::ibv_query_gid()(
                    objects::real::<Context>(object.public.context),
                    attr.port_num.max(1),
                    gid_index.into(),
                    &mut gid,
                )
            };
            let reconnect = PeerRequest::Reconnect {
                qp: remote,
                from_qp: qp.number(),
                new_qp: real_qpn,
                sq_psn: attr.sq_psn,
                rq_psn: attr.rq_psn,
                // SAFETY: raw bytes of a GID.
                gid: unsafe { gid.raw },
                rkeys: keys::rkeys(),
            };
            trace(format_args!(
                "qp {:#x}: asking its peer at {ip} to reconnect",
                qp.number()
            ));
            link.ask(&reconnect, deadline)
                .map_err(|source| MoveError::Peer {
                    qp: qp.number(),
                    step: "reconnect",
                    source,
                })?;
            // SAFETY: the live real QP just made.
            unsafe { walk(real, &attr, ibv_qp_state::IBV_QPS_RTS, RTS_MASK)? };
            locked(&object.flow).moved = true;
            let mut record = locked(&object.record);
            record
                .setup
                .apply(&attr, ibv_qp_attr_mask::IBV_QP_AV.0 as c_int);
        }
        // SAFETY: the live real QP just made.
        ibv_qp_state::IBV_QPS_ERR => unsafe {
            walk(real, &attr, state, ibv_qp_attr_mask::IBV_QP_STATE.0)?
        },
        _ => {}
    }
    trace(format_args!(
        "qp {:#x} rebuilt as real qp {real_qpn:#x}",
        qp.number()
    ));
    release_held(object);
    Ok(())
}
