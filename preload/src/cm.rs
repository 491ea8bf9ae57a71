//! librdmacm under `rdmamig-run`: what keeps an rdma_cm program's connections through a move.
//!
//! An rdma_cm program's verbs objects are this library's already: librdmacm opens its
//! contexts and makes its PDs, CQs and QPs through the exported verbs, which this library
//! interposes (rdma_create_qp reaches ibv_create_qp; the connect and the accept walk the QP
//! with ibv_modify_qp and the kernel's attributes, which the record takes). So a move
//! carries the QP like any other ([`crate::relocate`]). What nothing can carry is the
//! kernel's rdma_cm id: the moving end's is closed when its device goes (the kernel reports
//! DEVICE_REMOVAL, and may send the other end a DREQ, hence DISCONNECTED there). So, for a
//! QP a move has touched (paused or walked to a new QP, [`touched`]):
//! - the kernel's events about its connection (DEVICE_REMOVAL, DISCONNECTED, TIMEWAIT_EXIT,
//!   ADDR_CHANGE) belong to the move: they are acknowledged here and never delivered;
//! - rdma_disconnect is this library's: the QP goes to the error state (as librdmacm's
//!   does), the other end's library is told through its agent
//!   ([`PeerRequest::Disconnect`]), and each program gets its DISCONNECTED event from here.
//!
//! To hold events back and to deliver its own, the library stands between the program and
//! each event channel the program creates ([`EventChannel`]): the descriptor the program
//! polls is an eventfd that counts the events waiting for it, and a pump thread reads
//! librdmacm's channel, acknowledges what the program must not see and queues the rest.
//! librdmacm runs its own event processing (the connect's walk to RTS, say) on that thread.
//! The channels librdmacm creates for itself (synchronous ids) stay as they are.
//!
//! Not carried: an id listening on one address in the moving VM (its kernel id goes with
//! the device; one listening on any address lives through the move). The program then
//! counts as unmanaged ([`listening`], [`crate::link`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::raw::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_state, rdma_cm_event, rdma_cm_event_type, rdma_cm_id,
    rdma_event_channel, rdma_port_space,
};
use rdmamig_proto::preload::PeerRequest;

use crate::objects::{self, find, locked, publish, retire, trace, Kind, Qp, Virtual};
use crate::peer::{self, ip_of};
use crate::relocate::control;
use crate::{exports, link, next};

/// How long a disconnect waits for the other end's agent: the program is ending the
/// connection, and the other end, if it is gone, needs no telling.
const TELL_PEER: Duration = Duration::from_secs(2);

/// The kernel's events that a move causes, which a program must not take for its own.
const MOVE_EVENTS: [rdma_cm_event_type::Type; 4] = [
    rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL,
    rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED,
    rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT,
    rdma_cm_event_type::RDMA_CM_EVENT_ADDR_CHANGE,
];

/// An event channel the program created.
#[repr(C)]
pub struct EventChannel {
    /// The program's channel: its descriptor is an eventfd (a semaphore), readable while
    /// events wait for the program.
    pub public: rdma_event_channel,
    /// librdmacm's channel, which the pump reads (non-blocking).
    pub real: AtomicPtr<rdma_event_channel>,
    /// The events for the program, oldest first, one eventfd count each; `None` where one
    /// was taken back because its id is being destroyed.
    waiting: Mutex<VecDeque<Option<usize>>>,
    /// Written to stop the pump.
    stop: c_int,
    /// The pump thread.
    pump: Mutex<Option<JoinHandle<()>>>,
}

impl Virtual for EventChannel {
    type Public = rdma_event_channel;
    const KIND: Kind = Kind::EventChannel;
    fn real(&self) -> *mut rdma_event_channel {
        self.real.load(Ordering::Acquire)
    }
}

impl EventChannel {
    /// Queues `event` for the program and counts it on the program's descriptor.
    fn deliver(&self, event: *mut rdma_cm_event) {
        let mut waiting = locked(&self.waiting);
        waiting.push_back(Some(event as usize));
        let one: u64 = 1;
        // SAFETY: an 8-byte write of our own value to the eventfd this channel owns.
        unsafe { libc::write(self.public.fd, (&one as *const u64).cast(), 8) };
    }

    /// Takes back the waiting events `which` selects, and gives them.
    fn take_back(&self, which: impl Fn(*mut rdma_cm_event) -> bool) -> Vec<*mut rdma_cm_event> {
        let mut taken = Vec::new();
        for slot in locked(&self.waiting).iter_mut() {
            if let Some(event) = slot.filter(|e| which(*e as *mut rdma_cm_event)) {
                taken.push(event as *mut rdma_cm_event);
                *slot = None;
            }
        }
        taken
    }
}

/// What this library knows of the program's rdma_cm ids, by address.
#[derive(Default)]
struct Ids {
    /// The id each virtual QP is connected by (seen on the id's events), by the QP.
    of_qp: HashMap<usize, usize>,
    /// Ids being destroyed: their events are acknowledged at once, never queued (librdmacm's
    /// destroy waits until every event the kernel reported for the id is acknowledged).
    dying: HashSet<usize>,
    /// Ids listening for connections.
    listening: HashSet<usize>,
    /// Ids whose DISCONNECTED this library delivered.
    disconnected: HashSet<usize>,
    /// The events this library made (each a Box), until acknowledged.
    made: HashSet<usize>,
    /// Ids whose other end disconnected, whose DISCONNECTED is still to be delivered.
    to_disconnect: Vec<usize>,
}

static IDS: LazyLock<Mutex<Ids>> = LazyLock::new(Mutex::default);

fn ids() -> MutexGuard<'static, Ids> {
    locked(&IDS)
}

/// Whether a move has touched `qp`: it is paused for one, or was walked to a new QP by one.
fn touched(qp: &Qp) -> bool {
    let flow = locked(&qp.flow);
    flow.held || flow.moved
}

/// Whether an rdma_cm id connects `qp` (one of its events named it).
pub fn connects(qp: &Qp) -> bool {
    ids().of_qp.contains_key(&(qp as *const Qp as usize))
}

/// Whether an id of the program listens on one address (a move cannot carry it).
pub fn listening() -> bool {
    !ids().listening.is_empty()
}

/// The program's event channel over librdmacm's `real`, if `channel` is one of ours.
fn real_channel(channel: *mut rdma_event_channel) -> *mut rdma_event_channel {
    objects::real::<EventChannel>(channel)
}

/// The program's channel whose real one is `real`.
fn channel_over(real: *mut rdma_event_channel) -> Option<&'static EventChannel> {
    objects::all::<EventChannel>()
        .into_iter()
        // SAFETY: live channels (destroying one retires it first).
        .map(|c| unsafe { &*c })
        .find(|c| c.real() == real)
}

/// Whether the nearest caller outside this library is librdmacm itself (which creates
/// channels of its own for synchronous ids, through its exported function).
fn called_by_librdmacm() -> bool {
    let mut frames = [null_mut::<c_void>(); 16];
    // SAFETY: `frames` has room for the 16 addresses asked for.
    let count = unsafe { libc::backtrace(frames.as_mut_ptr(), frames.len() as c_int) };
    let own = object_of(called_by_librdmacm as *const c_void).map(|(base, _)| base);
    frames[..count.max(0) as usize]
        .iter()
        .filter_map(|f| object_of(*f))
        .find(|(base, _)| Some(*base) != own)
        .is_some_and(|(_, name)| name.contains("librdmacm"))
}

/// The load address and file name of the object `address` is in.
fn object_of(address: *const c_void) -> Option<(usize, String)> {
    // SAFETY: all-zero is a valid Dl_info (null pointers).
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables.
    if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated name the loader keeps.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some((info.dli_fbase as usize, name.to_string_lossy().into_owned()))
}

/// rdma_create_event_channel: the program gets a channel this library stands behind.
///
/// # Safety
/// As librdmacm's rdma_create_event_channel.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    // SAFETY: librdmacm's own function.
    let real = unsafe { next::rdma_create_event_channel()() };
    if real.is_null() || called_by_librdmacm() {
        return real;
    }
    // SAFETY: the channel librdmacm just made.
    match unsafe { stand_behind(real) } {
        Ok(channel) => channel,
        Err(e) => {
            eprintln!(
                "rdmamig-preload: an rdma_cm event channel stays librdmacm's ({e}): \
                 a move will break its connections"
            );
            real
        }
    }
}

/// Makes the program's channel over `real` and starts its pump.
///
/// # Safety
/// `real` is a live channel of librdmacm's.
unsafe fn stand_behind(real: *mut rdma_event_channel) -> std::io::Result<*mut rdma_event_channel> {
    // SAFETY: plain descriptor calls; the descriptors made here are owned by the channel.
    let (public_fd, stop) = unsafe {
        let fd = (*real).fd;
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let public_fd = libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC);
        let stop = libc::eventfd(0, libc::EFD_CLOEXEC);
        if public_fd < 0 || stop < 0 {
            let error = std::io::Error::last_os_error();
            for fd in [public_fd, stop].into_iter().filter(|fd| *fd >= 0) {
                libc::close(fd);
            }
            return Err(error);
        }
        (public_fd, stop)
    };
    let channel = publish(EventChannel {
        public: rdma_event_channel { fd: public_fd },
        real: real.into(),
        waiting: Mutex::default(),
        stop,
        pump: Mutex::default(),
    });
    let address = channel as usize;
    let pump = std::thread::Builder::new()
        .name("rdmamig-cm-pump".into())
        .spawn(move || pump(address));
    match pump {
        Ok(handle) => {
            // SAFETY: the channel just published, live until the program destroys it.
            *locked(unsafe { &(*channel.cast::<EventChannel>()).pump }) = Some(handle);
            Ok(channel)
        }
        Err(e) => {
            drop(retire::<EventChannel>(channel));
            // SAFETY: the descriptors made above, used by nothing else.
            unsafe {
                libc::close(public_fd);
                libc::close(stop);
            }
            Err(e)
        }
    }
}

/// Reads librdmacm's channel until stopped, and sorts each event ([`sort`]).
fn pump(address: usize) {
    // SAFETY: the channel lives until its destroy has stopped and joined this thread.
    let channel = unsafe { &*(address as *const EventChannel) };
    let real = channel.real();
    // SAFETY: librdmacm's live channel (destroyed only after this thread ends).
    let real_fd = unsafe { (*real).fd };
    loop {
        let mut fds = [
            libc::pollfd {
                fd: real_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: channel.stop,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds, ours.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if ready < 0 || fds[1].revents != 0 {
            if ready < 0
                && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
            {
                continue;
            }
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        let mut event = null_mut();
        // SAFETY: librdmacm's live channel (non-blocking); the event pointer is ours.
        if unsafe { next::rdma_get_cm_event()(real, &mut event) } != 0 {
            // Nothing after all, or an error the program will meet on its own calls.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        // SAFETY: the event librdmacm just gave, not yet acknowledged.
        unsafe { sort(channel, event) };
    }
}

/// Delivers `event` to the program, or acknowledges it here: an event of an id being
/// destroyed, or one a move caused on a QP it touched.
///
/// # Safety
/// `event` is an event librdmacm gave and nobody acknowledged.
unsafe fn sort(channel: &EventChannel, event: *mut rdma_cm_event) {
    // SAFETY: the caller's live event and its id.
    let (id, kind, qp) = unsafe { ((*event).id, (*event).event, (*(*event).id).qp) };
    let held_back = {
        // A QP's destroy waits at the gate while its flow is looked at.
        let _gate = control();
        let qp = find::<Qp>(qp);
        let mut ids = ids();
        if let Some(qp) = qp {
            ids.of_qp.insert(qp as usize, id as usize);
        }
        // SAFETY: a live virtual QP (its destroy waits at the gate held here).
        let moved = qp.is_some_and(|qp| touched(unsafe { &*qp }));
        trace(format_args!(
            "rdma_cm event {kind} on id {id:p} (a virtual QP: {}, touched by a move: {moved})",
            qp.is_some()
        ));
        if ids.dying.contains(&(id as usize)) {
            true
        } else if moved && MOVE_EVENTS.contains(&kind) {
            trace(format_args!(
                "rdma_cm event {kind} on id {id:p} held back: a move caused it"
            ));
            true
        } else {
            // Under the ids' lock, so that a destroy of the id takes it back.
            channel.deliver(event);
            false
        }
    };
    if held_back {
        // SAFETY: the caller's event, acknowledged once, here.
        unsafe { acknowledge(event) };
    }
}

/// Acknowledges `event`: frees it if this library made it, hands it to librdmacm if not.
///
/// # Safety
/// `event` is a live event nobody acknowledged yet.
unsafe fn acknowledge(event: *mut rdma_cm_event) -> c_int {
    if ids().made.remove(&(event as usize)) {
        // SAFETY: made by `make_disconnected` as a Box, and acknowledged only now.
        drop(unsafe { Box::from_raw(event) });
        return 0;
    }
    // SAFETY: librdmacm's live event.
    unsafe { next::rdma_ack_cm_event()(event) }
}

/// rdma_get_cm_event: the next event waiting for the program on one of its channels.
///
/// # Safety
/// As librdmacm's rdma_get_cm_event.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    let Some(ours) = find::<EventChannel>(channel) else {
        // SAFETY: not ours: the caller's arguments, to librdmacm's own function.
        return unsafe { next::rdma_get_cm_event()(channel, event) };
    };
    // SAFETY: the program's live channel.
    let ours = unsafe { &*ours };
    loop {
        let mut count = 0u64;
        // SAFETY: an 8-byte read into our own value, from the channel's eventfd: blocks
        // unless the program made the descriptor non-blocking (then EAGAIN, as librdmacm's).
        let read = unsafe { libc::read(ours.public.fd, (&mut count as *mut u64).cast(), 8) };
        if read != 8 {
            return -1;
        }
        if let Some(Some(next)) = locked(&ours.waiting).pop_front() {
            // SAFETY: the caller's out-pointer.
            unsafe { *event = next as *mut rdma_cm_event };
            return 0;
        }
        // The count of an event taken back: wait for the next one.
    }
}

/// rdma_ack_cm_event: frees an event this library made, or hands librdmacm's to it.
///
/// # Safety
/// As librdmacm's rdma_ack_cm_event.
#[no_mangle]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    // SAFETY: the caller's event, acknowledged once.
    unsafe { acknowledge(event) }
}

/// rdma_destroy_event_channel: stops the pump, acknowledges what still waits, and destroys
/// librdmacm's channel.
///
/// # Safety
/// As librdmacm's rdma_destroy_event_channel.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    let Some(ours) = retire::<EventChannel>(channel) else {
        // SAFETY: not ours: the caller's channel, to librdmacm's own function.
        return unsafe { next::rdma_destroy_event_channel()(channel) };
    };
    let one: u64 = 1;
    // SAFETY: an 8-byte write of our own value to the channel's stop eventfd.
    unsafe { libc::write(ours.stop, (&one as *const u64).cast(), 8) };
    if let Some(pump) = locked(&ours.pump).take() {
        let _ = pump.join();
    }
    for event in ours.take_back(|_| true) {
        // SAFETY: a waiting event, taken back, acknowledged once.
        unsafe { acknowledge(event) };
    }
    // SAFETY: the descriptors the channel owns, and librdmacm's channel, used by nothing else
    // now.
    unsafe {
        libc::close(ours.public.fd);
        libc::close(ours.stop);
        next::rdma_destroy_event_channel()(ours.real());
    }
}

/// rdma_create_id: on librdmacm's channel behind the program's.
///
/// # Safety
/// As librdmacm's rdma_create_id.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space::Type,
) -> c_int {
    // SAFETY: the caller's arguments, the channel librdmacm's, to its own function.
    unsafe { next::rdma_create_id()(real_channel(channel), id, context, ps) }
}

/// rdma_migrate_id: to librdmacm's channel behind the program's.
///
/// # Safety
/// As librdmacm's rdma_migrate_id.
#[no_mangle]
pub unsafe extern "C" fn rdma_migrate_id(
    id: *mut rdma_cm_id,
    channel: *mut rdma_event_channel,
) -> c_int {
    // SAFETY: the caller's arguments, the channel librdmacm's, to its own function.
    unsafe { next::rdma_migrate_id()(id, real_channel(channel)) }
}

/// rdma_listen: a listener bound to one address is noted, since a move cannot carry it.
///
/// # Safety
/// As librdmacm's rdma_listen.
#[no_mangle]
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    // SAFETY: the caller's arguments, to librdmacm's own function.
    let result = unsafe { next::rdma_listen()(id, backlog) };
    // SAFETY: the caller's live id, listening.
    if result == 0 && unsafe { bound_to_one_address(id) } {
        let first = {
            let mut ids = ids();
            ids.listening.insert(id as usize) && ids.listening.len() == 1
        };
        if first {
            link::tell_carried();
        }
    }
    result
}

/// Whether `id` is bound to one address: its kernel id is then bound to that address's
/// device, and goes with it. One bound to any address is not (the kernel listens on every
/// device, a new one included), and lives through a move.
///
/// # Safety
/// `id` is a live id.
unsafe fn bound_to_one_address(id: *mut rdma_cm_id) -> bool {
    // SAFETY: the caller's live id: librdmacm's copy of the address it is bound to, read as
    // the family it names.
    unsafe {
        let bound = &(*id).route.addr.src_addr_union;
        match c_int::from(bound.src_storage.ss_family) {
            libc::AF_INET => bound.src_sin.sin_addr.s_addr != 0,
            libc::AF_INET6 => bound.src_sin6.sin6_addr.s6_addr != [0; 16],
            _ => true,
        }
    }
}

/// rdma_destroy_id: the id's waiting events are acknowledged first (librdmacm's destroy
/// waits for them), and its events from here on too.
///
/// # Safety
/// As librdmacm's rdma_destroy_id.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    let key = id as usize;
    let last_listener = {
        let mut ids = ids();
        ids.dying.insert(key);
        let last_listener = ids.listening.remove(&key) && ids.listening.is_empty();
        ids.disconnected.remove(&key);
        ids.to_disconnect.retain(|of| *of != key);
        ids.of_qp.retain(|_, of| *of != key);
        last_listener
    };
    if last_listener {
        link::tell_carried();
    }
    for channel in objects::all::<EventChannel>() {
        // SAFETY: a live channel; each waiting event's id is live (or this very one).
        let taken = unsafe { (*channel).take_back(|e| (*e).id == id) };
        for event in taken {
            // SAFETY: a waiting event, taken back, acknowledged once.
            unsafe { acknowledge(event) };
        }
    }
    // SAFETY: the caller's id, to librdmacm's own function.
    let result = unsafe { next::rdma_destroy_id()(id) };
    ids().dying.remove(&key);
    result
}

/// rdma_disconnect: librdmacm's, unless a move touched the id's QP; then this library's:
/// the QP to the error state, the other end told, and a DISCONNECTED for the program.
///
/// # Safety
/// As librdmacm's rdma_disconnect.
#[no_mangle]
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    let carried = {
        let _gate = control();
        // SAFETY: the caller's live id.
        let qp = find::<Qp>(unsafe { (*id).qp });
        // SAFETY: a live virtual QP (its destroy waits at the gate held here).
        qp.map(|qp| unsafe { &*qp })
            .filter(|qp| touched(qp))
            .map(|qp| {
                let record = locked(&qp.record);
                let attr = record.setup.attr();
                // SAFETY: raw bytes of a GID.
                let ip = ip_of(unsafe { attr.ah_attr.grh.dgid.raw });
                (ip, attr.dest_qp_num, qp.public.qp_num)
            })
    };
    let Some((ip, remote, number)) = carried else {
        // SAFETY: the caller's id, to librdmacm's own function.
        return unsafe { next::rdma_disconnect()(id) };
    };
    // As librdmacm's: the QP goes to the error state, which flushes its work.
    // SAFETY: all-zero is a valid ibv_qp_attr.
    let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
    // SAFETY: the program's virtual QP, through this library's own verb.
    let rc = unsafe {
        exports::ibv_modify_qp(
            (*id).qp,
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,
        )
    };
    if rc != 0 {
        eprintln!("rdmamig-preload: QP {number:#x}: to the error state at disconnect: error {rc}");
    }
    if !ids().disconnected.insert(id as usize) {
        return 0; // its DISCONNECTED came already (the other end disconnected first)
    }
    let disconnect = PeerRequest::Disconnect {
        qp: remote,
        from_qp: number,
    };
    match peer::ask(ip, &disconnect, Instant::now() + TELL_PEER) {
        Ok(()) => trace(format_args!(
            "qp {number:#x}: disconnected; its peer was told"
        )),
        Err(e) => trace(format_args!(
            "qp {number:#x}: disconnected; its peer was not told: {e}"
        )),
    }
    make_disconnected(id);
    0
}

/// The other end of `qp` disconnected (its library said so): the program gets DISCONNECTED
/// on the id connected by `qp`, once, at the next [`deliver_disconnects`] (after the answer
/// went back: a program that ends at once on the event would take the answer with it).
pub fn disconnected_by_peer(qp: &Qp) {
    let mut ids = ids();
    let Some(id) = ids.of_qp.get(&(qp as *const Qp as usize)).copied() else {
        return; // not an rdma_cm connection
    };
    if ids.disconnected.insert(id) {
        trace(format_args!(
            "qp {:#x}: its peer disconnected: DISCONNECTED for id {:#x}",
            qp.public.qp_num, id
        ));
        ids.to_disconnect.push(id);
    }
}

/// Delivers the DISCONNECTED events [`disconnected_by_peer`] decided.
pub fn deliver_disconnects() {
    let pending = std::mem::take(&mut ids().to_disconnect);
    for id in pending {
        make_disconnected(id as *mut rdma_cm_id);
    }
}

/// Delivers a DISCONNECTED this library made on the channel of `id`.
fn make_disconnected(id: *mut rdma_cm_id) {
    // SAFETY: the program's live id.
    let Some(channel) = channel_over(unsafe { (*id).channel }) else {
        return; // a synchronous id: it gets no events
    };
    // SAFETY: all-zero is a valid event (null pointers, no parameters).
    let mut event: rdma_cm_event = unsafe { std::mem::zeroed() };
    event.id = id;
    event.event = rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED;
    let event = Box::into_raw(Box::new(event));
    let mut ids = ids();
    ids.made.insert(event as usize);
    if ids.dying.contains(&(id as usize)) {
        ids.made.remove(&(event as usize));
        // SAFETY: the Box just made, never handed out.
        drop(unsafe { Box::from_raw(event) });
        return;
    }
    channel.deliver(event);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event naming `id` (never dereferenced here).
    fn event_for(id: usize) -> *mut rdma_cm_event {
        // SAFETY: all-zero is a valid event.
        let mut event: rdma_cm_event = unsafe { std::mem::zeroed() };
        event.id = id as *mut rdma_cm_id;
        Box::into_raw(Box::new(event))
    }

    #[test]
    fn the_program_reads_the_events_waiting_and_never_one_taken_back() {
        // SAFETY: a fresh eventfd, owned by the test.
        let fd = unsafe {
            libc::eventfd(
                0,
                libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC | libc::EFD_NONBLOCK,
            )
        };
        assert!(fd >= 0);
        let channel = publish(EventChannel {
            public: rdma_event_channel { fd },
            real: AtomicPtr::default(),
            waiting: Mutex::default(),
            stop: -1,
            pump: Mutex::default(),
        });
        // SAFETY: just published, live until retired below.
        let ours = unsafe { &*channel.cast::<EventChannel>() };
        let (dying, living) = (event_for(0x1000), event_for(0x2000));
        ours.deliver(dying);
        ours.deliver(living);
        // SAFETY: the events made above.
        let taken = ours.take_back(|e| unsafe { (*e).id } as usize == 0x1000);
        assert_eq!(taken, vec![dying]);
        let mut got = null_mut();
        // SAFETY: our channel and out-pointer.
        assert_eq!(unsafe { rdma_get_cm_event(channel, &mut got) }, 0);
        assert_eq!(got, living, "the event taken back is skipped");
        // SAFETY: as above.
        assert_eq!(unsafe { rdma_get_cm_event(channel, &mut got) }, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EAGAIN),
            "a non-blocking channel with nothing waiting says EAGAIN, as librdmacm's"
        );
        drop(retire::<EventChannel>(channel));
        // SAFETY: the test's own events and descriptor, used by nothing else now.
        unsafe {
            drop(Box::from_raw(dying));
            drop(Box::from_raw(living));
            libc::close(fd);
        }
    }
}
