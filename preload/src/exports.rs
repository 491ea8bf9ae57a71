//! The exported verbs this library supports, interposed by symbol: each one takes the
//! program's virtual objects, calls libibverbs' own verb ([`next`]) on the real objects
//! behind them, and gives the program virtual objects back.
//!
//! An argument that is not one of this library's objects ([`objects::find`]) passes through
//! unchanged: the program, or a library below it, may hold real objects it made before the
//! preload, and those stay what they are.
//!
//! A destroy calls the real verb first and forgets the virtual object only once that
//! succeeded: a PD with MRs still on it stays usable, as libibverbs' EBUSY says.

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;

use rdma_sys::{
    _compat_ibv_port_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_device_attr,
    ibv_ece, ibv_gid, ibv_mr, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_init_attr,
    ibv_qp_state, ibv_qp_type,
};

use crate::objects::{
    self, find, locked, publish, real, retire, trace, Channel, Context, Cq, Flow, Member, Mr, Pd,
    Qp,
};
use crate::relocate::control;
use crate::unsupported::refuse;
use crate::{events, keys, link, next, ops};

/// A zeroed public struct: every verbs.h struct here is plain data (pointers, integers, and
/// pthread objects whose all-zero value is their static initializer on glibc).
fn zeroed<T>() -> T {
    // SAFETY: see above; only instantiated with verbs.h's plain-data structs.
    unsafe { std::mem::zeroed() }
}

/// ibv_open_device: a virtual context over the provider's, with this library's ops table.
///
/// # Safety
/// As libibverbs' ibv_open_device.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    let _device = control();
    // SAFETY: the caller's device, to libibverbs' own verb.
    let real = unsafe { next::ibv_open_device()(device) };
    if real.is_null() {
        return real;
    }
    link::start();
    let mut public: ibv_context = zeroed();
    // SAFETY: `real` is the live context libibverbs just opened.
    unsafe {
        public.device = (*real).device;
        public.cmd_fd = (*real).cmd_fd;
        public.async_fd = (*real).async_fd;
        public.num_comp_vectors = (*real).num_comp_vectors;
    }
    public.ops = ops::table();
    // Not an extended context (`abi_compat` is not verbs.h's marker), so the inline
    // extended verbs find no ops and fail with EOPNOTSUPP.
    public.abi_compat = null_mut();
    publish(Context {
        public,
        real: real.into(),
    })
}

/// ibv_close_device.
///
/// # Safety
/// As libibverbs' ibv_close_device.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    let _device = control();
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_close_device()(real::<Context>(context)) };
    if result == 0 {
        drop(retire::<Context>(context));
    }
    result
}

/// ibv_query_device.
///
/// # Safety
/// As libibverbs' ibv_query_device.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(
    context: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    let _device = control();
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    unsafe { next::ibv_query_device()(real::<Context>(context), attr) }
}

/// ibv_query_port (verbs.h's inline falls back to it on a context that is not extended).
///
/// # Safety
/// As libibverbs' ibv_query_port.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(
    context: *mut ibv_context,
    port: u8,
    attr: *mut _compat_ibv_port_attr,
) -> c_int {
    let _device = control();
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    unsafe { next::ibv_query_port()(real::<Context>(context), port, attr) }
}

/// ibv_query_gid.
///
/// # Safety
/// As libibverbs' ibv_query_gid.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    let _device = control();
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    unsafe { next::ibv_query_gid()(real::<Context>(context), port, index, gid) }
}

/// ibv_query_pkey.
///
/// # Safety
/// As libibverbs' ibv_query_pkey.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    let _device = control();
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    unsafe { next::ibv_query_pkey()(real::<Context>(context), port, index, pkey) }
}

/// ibv_create_comp_channel: the virtual channel has the real one's descriptor.
///
/// # Safety
/// As libibverbs' ibv_create_comp_channel.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(
    context: *mut ibv_context,
) -> *mut ibv_comp_channel {
    let _device = control();
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    let real = unsafe { next::ibv_create_comp_channel()(objects::real::<Context>(context)) };
    if real.is_null() || find::<Context>(context).is_none() {
        return real;
    }
    let mut public: ibv_comp_channel = zeroed();
    public.context = context;
    // SAFETY: `real` is the live channel libibverbs just made.
    public.fd = unsafe { (*real).fd };
    publish(Channel {
        public,
        real: real.into(),
    })
}

/// ibv_destroy_comp_channel.
///
/// # Safety
/// As libibverbs' ibv_destroy_comp_channel.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    let _device = control();
    // SAFETY: the real channel behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_destroy_comp_channel()(real::<Channel>(channel)) };
    if result == 0 {
        drop(retire::<Channel>(channel));
    }
    result
}

/// ibv_get_cq_event: the event names the real CQ, whose `cq_context` is the virtual one.
///
/// # Safety
/// As libibverbs' ibv_get_cq_event.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    if find::<Channel>(channel).is_none() {
        // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
        return unsafe { next::ibv_get_cq_event()(channel, cq, cq_context) };
    }
    // SAFETY: a live virtual channel; the out-pointers are the caller's.
    unsafe { events::next_event(channel, cq, cq_context) }
}

/// ibv_ack_cq_events.
///
/// # Safety
/// As libibverbs' ibv_ack_cq_events.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, events: c_uint) {
    match find::<Cq>(cq) {
        // SAFETY: a live virtual CQ.
        Some(object) => events::ack(unsafe { &*object }, events),
        // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
        None => unsafe { next::ibv_ack_cq_events()(cq, events) },
    }
}

/// ibv_alloc_pd.
///
/// # Safety
/// As libibverbs' ibv_alloc_pd.
#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    let _device = control();
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    let real = unsafe { next::ibv_alloc_pd()(objects::real::<Context>(context)) };
    if real.is_null() || find::<Context>(context).is_none() {
        return real;
    }
    let mut public: ibv_pd = zeroed();
    public.context = context;
    // SAFETY: `real` is the live PD libibverbs just allocated.
    public.handle = unsafe { (*real).handle };
    publish(Pd {
        public,
        real: real.into(),
    })
}

/// ibv_dealloc_pd.
///
/// # Safety
/// As libibverbs' ibv_dealloc_pd.
#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    let _device = control();
    // SAFETY: the real PD behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_dealloc_pd()(real::<Pd>(pd)) };
    if result == 0 {
        drop(retire::<Pd>(pd));
    }
    result
}

/// The virtual MR over `real`, just registered on virtual PD `pd` with `access` at `iova`;
/// `real` as it is when `pd` is not one of ours or the registration failed.
///
/// # Safety
/// `real` is null or a live MR; `pd` is the caller's PD.
unsafe fn publish_mr(pd: *mut ibv_pd, real: *mut ibv_mr, access: c_uint, iova: u64) -> *mut ibv_mr {
    let Some(virtual_pd) = find::<Pd>(pd) else {
        return real;
    };
    if real.is_null() {
        return real;
    }
    let mut public: ibv_mr = zeroed();
    // SAFETY: a live virtual PD and the live MR just registered.
    unsafe {
        public.context = (*virtual_pd).public.context;
        public.pd = pd;
        public.addr = (*real).addr;
        public.length = (*real).length;
        public.handle = (*real).handle;
        (public.lkey, public.rkey) = keys::assign(((*real).lkey, (*real).rkey));
    }
    publish(Mr {
        public,
        real: real.into(),
        access,
        iova,
    })
}

/// ibv_reg_mr.
///
/// # Safety
/// As libibverbs' ibv_reg_mr.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    let _device = control();
    // SAFETY: the real PD behind the caller's, to libibverbs' own verb; then as publish_mr.
    unsafe {
        let real = next::ibv_reg_mr()(real::<Pd>(pd), addr, length, access);
        publish_mr(pd, real, access as c_uint, addr as u64)
    }
}

/// ibv_reg_mr_iova.
///
/// # Safety
/// As libibverbs' ibv_reg_mr_iova.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    let _device = control();
    // SAFETY: as in ibv_reg_mr.
    unsafe {
        let real = next::ibv_reg_mr_iova()(real::<Pd>(pd), addr, length, iova, access);
        publish_mr(pd, real, access as c_uint, iova)
    }
}

/// ibv_reg_mr_iova2 (what verbs.h's ibv_reg_mr becomes for some access flags).
///
/// # Safety
/// As libibverbs' ibv_reg_mr_iova2.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    let _device = control();
    // SAFETY: as in ibv_reg_mr.
    unsafe {
        let real = next::ibv_reg_mr_iova2()(real::<Pd>(pd), addr, length, iova, access);
        publish_mr(pd, real, access, iova)
    }
}

/// ibv_dereg_mr.
///
/// # Safety
/// As libibverbs' ibv_dereg_mr.
#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    let _device = control();
    // SAFETY: the real MR behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_dereg_mr()(real::<Mr>(mr)) };
    if result == 0 {
        if let Some(object) = retire::<Mr>(mr) {
            keys::forget((object.public.lkey, object.public.rkey));
        }
    }
    result
}

/// ibv_create_cq: the real CQ's context is the virtual CQ, so that completion events name it.
///
/// # Safety
/// As libibverbs' ibv_create_cq.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    let _device = control();
    if find::<Context>(context).is_none() {
        // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
        return unsafe { next::ibv_create_cq()(context, cqe, cq_context, channel, comp_vector) };
    }
    let mut public: ibv_cq = zeroed();
    public.context = context;
    public.channel = channel;
    public.cq_context = cq_context;
    let virtual_cq = publish(Cq {
        public,
        real: Default::default(),
        comp_vector,
        state: Default::default(),
    });
    // SAFETY: the real context and channel behind the caller's, to libibverbs' own verb.
    let real = unsafe {
        next::ibv_create_cq()(
            real::<Context>(context),
            cqe,
            virtual_cq.cast(),
            real::<Channel>(channel),
            comp_vector,
        )
    };
    if real.is_null() {
        drop(retire::<Cq>(virtual_cq));
        return real;
    }
    // SAFETY: the virtual CQ just published, not yet handed out; the live real CQ.
    unsafe {
        let object = virtual_cq.cast::<Cq>();
        (*object).real.store(real, Ordering::Release);
        (*object).public.handle = (*real).handle;
        (*object).public.cqe = (*real).cqe;
    }
    virtual_cq
}

/// ibv_destroy_cq.
///
/// # Safety
/// As libibverbs' ibv_destroy_cq.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    let _device = control();
    // SAFETY: the real CQ behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_destroy_cq()(real::<Cq>(cq)) };
    if result == 0 {
        drop(retire::<Cq>(cq));
    }
    result
}

/// ibv_create_qp: RC QPs without an SRQ; the real QP's context is the virtual QP, so that
/// async events name it.
///
/// # Safety
/// As libibverbs' ibv_create_qp.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    let _device = control();
    let Some(virtual_pd) = find::<Pd>(pd) else {
        // SAFETY: not one of ours: libibverbs' own, with the caller's arguments.
        return unsafe { next::ibv_create_qp()(pd, attr) };
    };
    // SAFETY: the caller's init attributes, read as the verb reads them.
    let asked = unsafe { *attr };
    if asked.qp_type != ibv_qp_type::IBV_QPT_RC {
        refuse("ibv_create_qp of a QP type other than RC");
        return null_mut();
    }
    if !asked.srq.is_null() {
        refuse("ibv_create_qp with a shared receive queue");
        return null_mut();
    }
    let mut public: ibv_qp = zeroed();
    // SAFETY: a live virtual PD.
    public.context = unsafe { (*virtual_pd).public.context };
    public.qp_context = asked.qp_context;
    public.pd = pd;
    public.send_cq = asked.send_cq;
    public.recv_cq = asked.recv_cq;
    public.qp_type = asked.qp_type;
    let virtual_qp = publish(Qp {
        public,
        real: Default::default(),
        record: Default::default(),
        flow: std::sync::Mutex::new(Flow {
            sig_all: asked.sq_sig_all != 0,
            ..Flow::default()
        }),
    });
    let mut given = asked;
    given.qp_context = virtual_qp.cast();
    given.send_cq = real::<Cq>(asked.send_cq);
    given.recv_cq = real::<Cq>(asked.recv_cq);
    // SAFETY: the real PD behind the caller's, and attributes naming the real CQs.
    let real_qp = unsafe { next::ibv_create_qp()(real::<Pd>(pd), &mut given) };
    if real_qp.is_null() {
        drop(retire::<Qp>(virtual_qp));
        return real_qp;
    }
    // SAFETY: the caller's attributes get the capabilities the provider granted, as the
    // verb writes them; the virtual QP is not yet handed out; the real QP is live.
    unsafe {
        (*attr).cap = given.cap;
        let object = virtual_qp.cast::<Qp>();
        (*object).real.store(real_qp, Ordering::Release);
        (*object).public.handle = (*real_qp).handle;
        (*object).public.qp_num = (*real_qp).qp_num;
        (*object).public.state = (*real_qp).state;
        let mut init = asked;
        init.cap = given.cap;
        locked(&(*object).record).init = Some(init);
        let member = Member {
            real_qpn: (*real_qp).qp_num,
            qp: virtual_qp as usize,
        };
        for cq in cqs_of(&init) {
            locked(&(*cq).state).members.push(member);
        }
    }
    virtual_qp
}

/// ibv_modify_qp: the state the program sees follows the real QP's, and the QP's record
/// takes what the program set.
///
/// # Safety
/// As libibverbs' ibv_modify_qp.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    let _device = control();
    // SAFETY: the real QP behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_modify_qp()(real::<Qp>(qp), attr, mask) };
    if result != 0 {
        return result;
    }
    let Some(object) = find::<Qp>(qp) else {
        return result;
    };
    // SAFETY: a live virtual QP and its live real QP, which libibverbs just updated; the
    // caller's attributes, which the verb just read.
    unsafe {
        (*object).public.state = (*objects::real::<Qp>(qp)).state;
        let mut record = locked(&(*object).record);
        record.setup.apply(&*attr, mask);
        match record.setup.state() {
            // RESET empties the queues; the error state flushes them.
            ibv_qp_state::IBV_QPS_RESET => record.receives = Default::default(),
            ibv_qp_state::IBV_QPS_ERR => record.receives.lose_track(),
            ibv_qp_state::IBV_QPS_RTS if mask & IBV_QP_STATE != 0 => {
                let set = record.setup.attr();
                trace(format_args!(
                    "qp {:#x} recorded at RTS: dest_qp {:#x} rq_psn {:#x} sq_psn {:#x} \
                     path_mtu {} dgid {} receives {}",
                    (*qp).qp_num,
                    set.dest_qp_num,
                    set.rq_psn,
                    set.sq_psn,
                    set.path_mtu,
                    Gid(set.ah_attr.grh.dgid.raw),
                    record.receives.outstanding().len(),
                ))
            }
            _ => {}
        }
    }
    result
}

/// The virtual CQs a QP's work completes on (one when its send and receive CQs are one).
pub fn cqs_of(init: &rdma_sys::ibv_qp_init_attr) -> Vec<*mut Cq> {
    let send = find::<Cq>(init.send_cq);
    let recv = find::<Cq>(init.recv_cq).filter(|r| Some(*r) != send);
    send.into_iter().chain(recv).collect()
}

/// The mask bit of ibv_modify_qp that moves a QP to another state.
const IBV_QP_STATE: c_int = ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int;

/// A GID as `ip` writes an IPv6 address, for the trace.
struct Gid([u8; 16]);

impl std::fmt::Display for Gid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::net::Ipv6Addr::from(self.0).fmt(f)
    }
}

/// ibv_query_qp: the init attributes name the program's CQs and context.
///
/// # Safety
/// As libibverbs' ibv_query_qp.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    let _device = control();
    // SAFETY: the real QP behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_query_qp()(real::<Qp>(qp), attr, mask, init_attr) };
    if result != 0 {
        return result;
    }
    if let Some(object) = find::<Qp>(qp) {
        // SAFETY: a live virtual QP; the caller's init attributes, as the verb writes them.
        unsafe {
            let public = &mut (*object).public;
            public.state = (*objects::real::<Qp>(qp)).state;
            (*init_attr).qp_context = public.qp_context;
            (*init_attr).send_cq = public.send_cq;
            (*init_attr).recv_cq = public.recv_cq;
        }
    }
    0
}

/// ibv_query_ece, on the real QP (librdmacm asks it of every QP it connects).
///
/// # Safety
/// As libibverbs' ibv_query_ece.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    let _device = control();
    // SAFETY: the real QP behind the caller's, to libibverbs' own verb.
    unsafe { next::ibv_query_ece()(real::<Qp>(qp), ece) }
}

/// ibv_set_ece, on the real QP (librdmacm sets what the other end agreed to).
///
/// # Safety
/// As libibverbs' ibv_set_ece.
#[no_mangle]
pub unsafe extern "C" fn ibv_set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    let _device = control();
    // SAFETY: the real QP behind the caller's, to libibverbs' own verb.
    unsafe { next::ibv_set_ece()(real::<Qp>(qp), ece) }
}

/// ibv_destroy_qp.
///
/// # Safety
/// As libibverbs' ibv_destroy_qp.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    let _device = control();
    // SAFETY: the real QP behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_destroy_qp()(real::<Qp>(qp)) };
    if result != 0 {
        return result;
    }
    if let Some(object) = retire::<Qp>(qp) {
        let record = locked(&object.record);
        for cq in record.init.iter().flat_map(cqs_of) {
            // SAFETY: a live virtual CQ: libibverbs refuses to destroy a CQ a QP still uses.
            let mut state = locked(unsafe { &(*cq).state });
            state.members.retain(|m| m.qp != qp as usize);
        }
        trace(format_args!(
            "qp {:#x} destroyed with {} receives outstanding{}",
            object.public.qp_num,
            record.receives.outstanding().len(),
            if record.receives.lost_track() {
                " (lost track)"
            } else {
                ""
            },
        ));
    }
    result
}

/// `struct ibv_async_event` read as plain data: its type as an integer (a kernel newer than
/// these bindings may report a type they do not name).
#[repr(C)]
pub struct AsyncEvent {
    element: *mut c_void,
    event_type: u32,
}

/// Whether an event of `event_type` names a CQ (and not a QP): IBV_EVENT_CQ_ERR.
fn names_cq(event_type: u32) -> bool {
    event_type == 0
}

/// Whether an event of `event_type` names a QP: IBV_EVENT_QP_FATAL to _PATH_MIG_ERR, and
/// IBV_EVENT_QP_LAST_WQE_REACHED.
fn names_qp(event_type: u32) -> bool {
    (1..=7).contains(&event_type) || event_type == 16
}

/// ibv_get_async_event: an event about a QP or CQ names the virtual one.
///
/// # Safety
/// As libibverbs' ibv_get_async_event.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    context: *mut ibv_context,
    event: *mut AsyncEvent,
) -> c_int {
    // Not under `control`: it blocks until an event comes.
    // SAFETY: the real context behind the caller's, to libibverbs' own verb.
    let result = unsafe { next::ibv_get_async_event()(real::<Context>(context), event.cast()) };
    if result != 0 {
        return result;
    }
    // SAFETY: the event libibverbs just filled in; the real objects it names are live until
    // the event is acknowledged, and their user context is the virtual object when they are
    // ours.
    unsafe {
        let kind = (*event).event_type;
        if names_qp(kind) {
            let back = (*(*event).element.cast::<ibv_qp>())
                .qp_context
                .cast::<ibv_qp>();
            if find::<Qp>(back).is_some() {
                (*event).element = back.cast();
            }
        } else if names_cq(kind) {
            let back = (*(*event).element.cast::<ibv_cq>())
                .cq_context
                .cast::<ibv_cq>();
            if find::<Cq>(back).is_some() {
                (*event).element = back.cast();
            }
        }
    }
    0
}

/// ibv_ack_async_event: acknowledged on the real object, whose destroy waits for it.
///
/// # Safety
/// As libibverbs' ibv_ack_async_event.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut AsyncEvent) {
    // SAFETY: the caller's event, as ibv_get_async_event gave it.
    let (kind, element) = unsafe { ((*event).event_type, (*event).element) };
    let element = if names_qp(kind) {
        real::<Qp>(element.cast()).cast()
    } else if names_cq(kind) {
        real::<Cq>(element.cast()).cast()
    } else {
        element
    };
    let mut acked = AsyncEvent {
        element,
        event_type: kind,
    };
    // SAFETY: the same event, naming the real object.
    unsafe { next::ibv_ack_async_event()((&mut acked as *mut AsyncEvent).cast()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn async_events_that_name_a_queue_pair_or_a_completion_queue() {
        // verbs.h's enum ibv_event_type, by value.
        let qp_events = [1, 2, 3, 4, 5, 6, 7, 16];
        for kind in 0..=19 {
            assert_eq!(names_qp(kind), qp_events.contains(&kind), "{kind}");
            assert_eq!(names_cq(kind), kind == 0, "{kind}");
        }
        assert!(
            !names_qp(99) && !names_cq(99),
            "a type these bindings do not name"
        );
    }

    #[test]
    fn the_event_layout_is_verbs_h() {
        assert_eq!(
            std::mem::size_of::<AsyncEvent>(),
            std::mem::size_of::<rdma_sys::ibv_async_event>()
        );
    }
}
