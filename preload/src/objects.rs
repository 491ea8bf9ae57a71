//! The virtual verbs objects the program holds, and the registry that tells them from real
//! ones.
//!
//! Each virtual object is `#[repr(C)]` with the public struct verbs.h defines as its first
//! field, so the pointer the program holds is the object's own: the data path gets from one
//! to the other with a cast, no lookup. The public fields are the program's view (virtual
//! context, PD and CQs; the numbers and keys it was given); `real` is the provider's object
//! behind it, which a move replaces.
//!
//! The registry records every virtual object by address and kind. An exported verb asks it
//! before it takes a pointer for one of its own: an object this library did not make (a
//! real one, or a virtual one of another kind) is never cast.

use std::collections::{HashMap, VecDeque};
use std::os::raw::{c_int, c_uint};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use rdma_sys::{
    ibv_comp_channel, ibv_context, ibv_cq, ibv_mr, ibv_pd, ibv_qp, ibv_qp_init_attr, ibv_wc,
};

use crate::record::{QpSetup, Receives};
use crate::wr::HeldSend;

/// What a registered address is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A [`Context`].
    Context,
    /// A [`Channel`].
    Channel,
    /// A [`Pd`].
    Pd,
    /// An [`Mr`].
    Mr,
    /// A [`Cq`].
    Cq,
    /// A [`Qp`].
    Qp,
    /// An rdma_cm event channel ([`crate::cm::EventChannel`]).
    EventChannel,
}

/// A virtual object: its public struct and its kind.
pub trait Virtual: Sized {
    /// The struct verbs.h defines, which the program sees.
    type Public;
    /// Its kind in the registry.
    const KIND: Kind;
    /// The provider's object behind it: null while a move has released the device.
    fn real(&self) -> *mut Self::Public;
}

/// A device context.
#[repr(C)]
pub struct Context {
    /// The program's context: the real one's device and descriptors, this library's ops.
    pub public: ibv_context,
    /// The provider's context.
    pub real: AtomicPtr<ibv_context>,
}

/// A completion channel. Its descriptor is the real channel's, so that the number the
/// program waits on is the kernel's (a move puts the new channel's file at that number).
#[repr(C)]
pub struct Channel {
    /// The program's channel.
    pub public: ibv_comp_channel,
    /// The provider's channel.
    pub real: AtomicPtr<ibv_comp_channel>,
}

/// A protection domain.
#[repr(C)]
pub struct Pd {
    /// The program's PD.
    pub public: ibv_pd,
    /// The provider's PD.
    pub real: AtomicPtr<ibv_pd>,
}

/// A memory region. Its keys are the ones the program was given ([`crate::keys`] maps
/// them to the real ones once they differ).
#[repr(C)]
pub struct Mr {
    /// The program's MR (its address and length are the registration's).
    pub public: ibv_mr,
    /// The provider's MR.
    pub real: AtomicPtr<ibv_mr>,
    /// The access flags it was registered with: with the address, length and IOVA, what
    /// registering it again on a new device takes.
    pub access: c_uint,
    /// The IOVA it was registered at (its address, unless an `_iova` verb said otherwise).
    pub iova: u64,
}

/// A completion queue. The real CQ's `cq_context` points back here, so that a completion
/// event names the virtual CQ.
#[repr(C)]
pub struct Cq {
    /// The program's CQ.
    pub public: ibv_cq,
    /// The provider's CQ.
    pub real: AtomicPtr<ibv_cq>,
    /// The completion vector it was created on.
    pub comp_vector: c_int,
    /// What polling shares with a move: held throughout every poll of the real CQ.
    pub state: Mutex<CqState>,
}

/// Completions a move drained from a real CQ before releasing it, oldest first: the program
/// gets them before any newer one. All CQs' buffers together are counted
/// ([`Drained::any`]), so that the data path looks through the CQs only when one may hold
/// some: after a move, until the program has polled them.
#[derive(Default)]
pub struct Drained(VecDeque<ibv_wc>);

/// How many completions all [`Drained`] buffers hold.
static DRAINED: AtomicUsize = AtomicUsize::new(0);

impl Drained {
    /// Whether any CQ's buffer holds a completion.
    pub fn any() -> bool {
        DRAINED.load(Ordering::Acquire) > 0
    }

    /// Adds completions at the back.
    pub fn extend(&mut self, completions: impl IntoIterator<Item = ibv_wc>) {
        let before = self.0.len();
        self.0.extend(completions);
        DRAINED.fetch_add(self.0.len() - before, Ordering::AcqRel);
    }

    /// The oldest completion, taken out.
    pub fn pop_front(&mut self) -> Option<ibv_wc> {
        let completion = self.0.pop_front()?;
        DRAINED.fetch_sub(1, Ordering::AcqRel);
        Some(completion)
    }

    /// Whether this buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Drop for Drained {
    fn drop(&mut self) {
        DRAINED.fetch_sub(self.0.len(), Ordering::AcqRel);
    }
}

/// A CQ's completions taken from the real CQ but not yet by the program, and the QPs that
/// complete here.
#[derive(Default)]
pub struct CqState {
    /// What a move drained from the real CQ.
    pub buffer: Drained,
    /// The virtual QPs whose work completes here.
    pub members: Vec<Member>,
    /// The program asked for a completion event (req_notify_cq) and has not had it yet: a
    /// rebuilt CQ is armed too.
    pub armed: bool,
    /// Events the current real CQ delivered that no ack took yet ([`crate::events`]).
    pub unacked: std::os::raw::c_uint,
}

/// A QP whose work completes on a CQ: a completion's QP number is the real QP's.
#[derive(Debug, Clone, Copy)]
pub struct Member {
    /// The real QP's number (what a completion carries).
    pub real_qpn: u32,
    /// The virtual [`Qp`]'s address.
    pub qp: usize,
}

/// A queue pair. The real QP's `qp_context` points back here, so that an async event names
/// the virtual QP.
#[repr(C)]
pub struct Qp {
    /// The program's QP: its number is the one the program was given.
    pub public: ibv_qp,
    /// The provider's QP.
    pub real: AtomicPtr<ibv_qp>,
    /// What a rebuild needs: its attributes and its outstanding receives.
    pub record: Mutex<QpRecord>,
    /// What posting shares with a move: held throughout every post to the real QP.
    pub flow: Mutex<Flow>,
}

/// What rebuilding a QP on a new device takes ([`crate::record`]).
#[derive(Default)]
pub struct QpRecord {
    /// The attributes it was created with (the program's CQs).
    pub init: Option<ibv_qp_init_attr>,
    /// Its attributes, as the program set them (the remote QP number the program's).
    pub setup: QpSetup,
    /// The remote QP's real number, once a move of the remote end changed it.
    pub remote_real_qpn: Option<u32>,
    /// Its receives posted and not completed.
    pub receives: Receives,
}

// SAFETY: the init attributes' pointers name the program's own objects; the record only
// keeps them, and every use is under the record's lock.
unsafe impl Send for QpRecord {}

/// The send side of a QP, as a move sees it.
#[derive(Default)]
pub struct Flow {
    /// New sends are held here, not posted: the QP is paused for a move (of either end).
    pub held: bool,
    /// The sends held, oldest first, posted when the pause ends.
    pub held_sends: Vec<HeldSend>,
    /// Signaled sends posted to the real QP, and their completions polled: a pause waits
    /// until the two are equal.
    pub signaled_posted: u64,
    /// See [`Flow::signaled_posted`].
    pub signaled_done: u64,
    /// The last send posted was unsignaled: its completion can never be seen.
    pub unsignaled_tail: bool,
    /// Every WR is signaled (`sq_sig_all`).
    pub sig_all: bool,
    /// A send completed in error: the QP is broken, nothing is drained.
    pub broken: bool,
    /// The remote end's rkeys, its program's to its real ones, once a move of that end
    /// changed them.
    pub remote_rkeys: HashMap<u32, u32>,
    /// Counts the pauses, so that a pause's expiry does not end a later one.
    pub pause: u64,
    /// A move (of either end) walked this QP to a new one: the kernel's rdma_cm no longer
    /// connects it, so its connection events are this library's ([`crate::cm`]).
    pub moved: bool,
}

impl Flow {
    /// Whether every signaled send posted has completed.
    pub fn drained(&self) -> bool {
        self.broken || self.signaled_done >= self.signaled_posted
    }
}

/// `mutex`'s contents. A panic while holding one of these locks cannot leave a half-made
/// change that matters more than losing the program (every change is one push, pop or
/// copy): carry on with it.
pub fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

macro_rules! virtual_kind {
    ($($object:ident: $public:ty;)*) => {$(
        impl Virtual for $object {
            type Public = $public;
            const KIND: Kind = Kind::$object;
            fn real(&self) -> *mut $public {
                self.real.load(Ordering::Acquire)
            }
        }
    )*};
}

virtual_kind! {
    Context: ibv_context;
    Channel: ibv_comp_channel;
    Pd: ibv_pd;
    Mr: ibv_mr;
    Cq: ibv_cq;
    Qp: ibv_qp;
}

/// Every live virtual object, by address.
#[derive(Default)]
pub struct Registry {
    objects: HashMap<usize, Kind>,
    /// Addresses in the order they were made: a move releases in reverse and rebuilds in
    /// this order, so that every object's parents are there before it.
    order: Vec<usize>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn registry() -> MutexGuard<'static, Option<Registry>> {
    locked(&REGISTRY)
}

impl Registry {
    /// Records `address` as a live object of `kind`.
    pub fn insert(&mut self, address: usize, kind: Kind) {
        self.objects.insert(address, kind);
        self.order.push(address);
    }

    /// The live objects of `kind`, oldest first.
    pub fn all(&self, kind: Kind) -> Vec<usize> {
        self.order
            .iter()
            .copied()
            .filter(|a| self.holds(*a, kind))
            .collect()
    }

    /// Whether `address` is a live object of `kind`.
    pub fn holds(&self, address: usize, kind: Kind) -> bool {
        self.objects.get(&address) == Some(&kind)
    }

    /// Forgets `address` if it is a live object of `kind`; says whether it was.
    pub fn remove(&mut self, address: usize, kind: Kind) -> bool {
        if self.holds(address, kind) {
            self.objects.remove(&address);
            self.order.retain(|a| *a != address);
            true
        } else {
            false
        }
    }
}

/// The environment variable that has each virtual object named on stderr as it is made.
pub const TRACE_ENV: &str = "RDMAMIG_PRELOAD_TRACE";

/// Whether [`TRACE_ENV`] is set (to anything but 0).
pub fn tracing() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(TRACE_ENV).is_some_and(|v| v != "0"))
}

/// Writes `what` on stderr, naming this library and the process, with the time of day
/// (UTC, to the millisecond; two guests' clocks agree only roughly), if [`tracing`].
pub fn trace(what: std::fmt::Arguments) {
    if tracing() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let (secs, ms) = (now.as_secs() % 86_400, now.subsec_millis());
        eprintln!(
            "rdmamig-preload[{}] {:02}:{:02}:{:02}.{ms:03}: {what}",
            std::process::id(),
            secs / 3600,
            secs / 60 % 60,
            secs % 60
        );
    }
}

/// Moves `object` to the heap, registers it and returns the pointer the program gets.
pub fn publish<V: Virtual>(object: V) -> *mut V::Public {
    let object = Box::into_raw(Box::new(object));
    registry()
        .get_or_insert_with(Registry::default)
        .insert(object as usize, V::KIND);
    trace(format_args!("virtual {:?} at {object:p}", V::KIND));
    object.cast()
}

/// Every live virtual object of kind `V`, oldest first.
pub fn all<V: Virtual>() -> Vec<*mut V> {
    registry()
        .as_ref()
        .map(|r| r.all(V::KIND))
        .unwrap_or_default()
        .into_iter()
        .map(|a| a as *mut V)
        .collect()
}

/// The virtual object behind `public`, if this library made it and it is still live.
pub fn find<V: Virtual>(public: *mut V::Public) -> Option<*mut V> {
    let known = registry()
        .as_ref()
        .is_some_and(|r| r.holds(public as usize, V::KIND));
    known.then_some(public.cast())
}

/// The provider's object behind `public` if it is one of this library's objects of kind
/// `V`; `public` itself otherwise (a real object, or null, passes through).
pub fn real<V: Virtual>(public: *mut V::Public) -> *mut V::Public {
    match find::<V>(public) {
        // SAFETY: registered, hence live: made by `publish` and not yet retired.
        Some(object) => unsafe { (*object).real() },
        None => public,
    }
}

/// Unregisters the virtual object behind `public` and gives it back, to be dropped once its
/// real object is gone; `None` if it is not one of this library's.
pub fn retire<V: Virtual>(public: *mut V::Public) -> Option<Box<V>> {
    let known = registry()
        .as_mut()
        .is_some_and(|r| r.remove(public as usize, V::KIND));
    // SAFETY: the registry held this address as a live `V`, made by `publish` from a Box,
    // and no longer does: this is the only owner from here on.
    known.then(|| unsafe { Box::from_raw(public.cast::<V>()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drained_completions_are_counted_until_polled_or_dropped() {
        let count = || DRAINED.load(Ordering::Acquire);
        let before = count();
        // SAFETY: all-zero is a valid ibv_wc.
        let wc = || -> ibv_wc { unsafe { std::mem::zeroed() } };
        let mut one = Drained::default();
        one.extend([wc(), wc(), wc()]);
        assert_eq!(count(), before + 3);
        assert!(Drained::any());
        assert!(one.pop_front().is_some());
        assert_eq!(count(), before + 2);
        drop(one);
        assert_eq!(count(), before);
    }

    #[test]
    fn an_object_is_found_only_as_its_own_kind_and_only_while_live() {
        // SAFETY: all-zero is a valid ibv_pd (null context, handle 0).
        let public: ibv_pd = unsafe { std::mem::zeroed() };
        let pd = publish(Pd {
            public,
            real: Default::default(),
        });
        assert!(all::<Pd>().contains(&pd.cast::<Pd>()));
        assert_eq!(find::<Pd>(pd), Some(pd.cast::<Pd>()));
        assert_eq!(find::<Qp>(pd.cast()), None, "a PD is not a QP");
        assert!(retire::<Qp>(pd.cast()).is_none());
        assert!(retire::<Pd>(pd).is_some());
        assert_eq!(find::<Pd>(pd), None, "retired");
        assert!(retire::<Pd>(pd).is_none(), "retired once only");
    }

    #[test]
    fn an_address_this_library_never_made_is_not_found() {
        let mut outside = std::mem::MaybeUninit::<ibv_cq>::zeroed();
        assert_eq!(find::<Cq>(outside.as_mut_ptr()), None);
    }
}
