//! One-sided RDMA WRITE and READ into buffers the peer exposed, named by stable handles.
//!
//! An application exposes a buffer under a handle ([`Connection::expose`]); the library
//! registers it on every QP the connection gets (a new device after a move means new MRs and
//! new rkeys) and tells the peer, in a REGIONS message sent first thing on each QP, which
//! address and rkey each handle has now. The peer's application takes a [`RemoteBuffer`] once
//! ([`Connection::remote`]) and keeps it across any number of moves: each WRITE or READ is
//! queued by handle and offset, and posted with the key of the QP it goes out on.
//!
//! Queued operations stay queued until their completion arrives. Those without one when the
//! link goes (a quiesce, a lost link) are posted again, in order, on the next QP: a WRITE
//! puts the same bytes at the same place again and a READ reads again, so a replay changes
//! nothing the first attempt had done (see docs/architecture.md for why, and for the order
//! of WRITEs and SENDs).
//!
//! This file holds the pure bookkeeping (range checks, the peer's map, the operation queue),
//! unit tested below; the application-facing calls are in `connection/onesided.rs`, and the
//! worker posts and completes.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{mpsc, Arc};

use thiserror::Error;

use crate::error::ConnError;
use crate::wire::{RegionEntry, ACCESS_READ, ACCESS_WRITE};
use rdmamig_verbs::{ExposedMemory, RemoteAccess};

/// What the peer's REGIONS records or the completions of one-sided operations got wrong
/// (each ends the link: a protocol or a local error).
#[derive(Debug, Error, PartialEq, Eq)]
pub(crate) enum OneSidedError {
    /// The peer announced a new buffer beyond [`MAX_BUFFERS`].
    #[error("the peer announced more than {MAX_BUFFERS} buffers (handle {handle})")]
    TooManyBuffers {
        /// The new buffer's handle.
        handle: u64,
    },
    /// The peer announced a buffer again with another size or access.
    #[error("the peer changed buffer {handle} from {old_len} to {new_len} bytes (access {old_access} to {new_access})")]
    BufferChanged {
        /// The buffer's handle.
        handle: u64,
        /// Its size before.
        old_len: u64,
        /// Its size now.
        new_len: u64,
        /// Its access bits before.
        old_access: u8,
        /// Its access bits now.
        new_access: u8,
    },
    /// A completion for an operation that is not the oldest queued (RC completes in order).
    #[error("one-sided completion for operation {id} while {oldest} is the oldest")]
    OutOfOrder {
        /// The completed operation.
        id: u64,
        /// The oldest queued one.
        oldest: u64,
    },
    /// A completion with no operation queued.
    #[error("one-sided completion for operation {id} with none queued")]
    NoneQueued {
        /// The completed operation.
        id: u64,
    },
}

/// What the peer may do to an exposed buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// RDMA WRITE only.
    Write,
    /// RDMA READ only.
    Read,
    /// Both.
    ReadWrite,
}

impl Access {
    pub(crate) fn bits(self) -> u8 {
        match self {
            Access::Write => ACCESS_WRITE,
            Access::Read => ACCESS_READ,
            Access::ReadWrite => ACCESS_WRITE | ACCESS_READ,
        }
    }
}

/// The verbs access flags of an exposure's access bits.
pub(crate) fn remote_access(bits: u8) -> RemoteAccess {
    RemoteAccess {
        write: bits & ACCESS_WRITE != 0,
        read: bits & ACCESS_READ != 0,
    }
}

/// A buffer this side exposed to the peer. The memory stays allocated (and registered on
/// the connection's current QP) as long as the connection lives, even if this handle is
/// dropped. The peer writes into it at any time: read it once the peer said (by a message,
/// sent after its writes) that the data is there.
#[derive(Clone)]
pub struct Exposed {
    pub(crate) handle: u64,
    pub(crate) mem: Arc<ExposedMemory>,
}

impl std::fmt::Debug for Exposed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Exposed({}, {} bytes)", self.handle, self.mem.len())
    }
}

impl Exposed {
    /// The handle the peer names this buffer by.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Whether it is empty (never: at least one byte).
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// Copies `out.len()` bytes at `offset` out of the buffer.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), ConnError> {
        check_range(self.handle, self.mem.len() as u64, offset as u64, out.len())?;
        self.mem.read(offset, out).ok_or(ConnError::OutOfBounds {
            handle: self.handle,
            offset: offset as u64,
            len: out.len(),
            size: self.mem.len() as u64,
        })
    }

    /// Copies `data` into the buffer at `offset` (e.g. what the peer will READ).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), ConnError> {
        check_range(
            self.handle,
            self.mem.len() as u64,
            offset as u64,
            data.len(),
        )?;
        self.mem.write(offset, data).ok_or(ConnError::OutOfBounds {
            handle: self.handle,
            offset: offset as u64,
            len: data.len(),
            size: self.mem.len() as u64,
        })
    }
}

/// A buffer the peer exposed, by its stable handle: valid across any number of moves of
/// either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBuffer {
    pub(crate) handle: u64,
    pub(crate) len: u64,
    pub(crate) access: u8,
}

impl RemoteBuffer {
    /// The peer's handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the peer allows RDMA WRITE into it.
    pub fn writable(&self) -> bool {
        self.access & ACCESS_WRITE != 0
    }

    /// Whether the peer allows RDMA READ from it.
    pub fn readable(&self) -> bool {
        self.access & ACCESS_READ != 0
    }
}

/// Checks that `len` bytes at `offset` lie inside a buffer of `size` bytes.
pub(crate) fn check_range(
    handle: u64,
    size: u64,
    offset: u64,
    len: usize,
) -> Result<(), ConnError> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(ConnError::OutOfBounds {
            handle,
            offset,
            len,
            size,
        }),
    }
}

/// The peer's exposed buffers as the application sees them (handle, length, access), built
/// from the REGIONS records of every QP. Stable across moves: a handle keeps its length
/// and access; a record that changes them is a protocol error.
#[derive(Debug, Default)]
pub(crate) struct PeerMap {
    buffers: BTreeMap<u64, RemoteBuffer>,
}

/// The most buffers one side of a connection may expose: what the peer announces beyond it
/// is a protocol error, so a peer cannot grow this side's map without bound.
pub(crate) const MAX_BUFFERS: usize = 1024;

impl PeerMap {
    /// Takes the records of one REGIONS message.
    pub(crate) fn update(&mut self, entries: &[RegionEntry]) -> Result<(), OneSidedError> {
        for e in entries {
            if !self.buffers.contains_key(&e.handle) && self.buffers.len() >= MAX_BUFFERS {
                return Err(OneSidedError::TooManyBuffers { handle: e.handle });
            }
            let b = RemoteBuffer {
                handle: e.handle,
                len: e.len,
                access: e.access,
            };
            match self.buffers.get(&e.handle) {
                Some(old) if *old != b => {
                    return Err(OneSidedError::BufferChanged {
                        handle: e.handle,
                        old_len: old.len,
                        new_len: b.len,
                        old_access: old.access,
                        new_access: b.access,
                    })
                }
                _ => {
                    self.buffers.insert(e.handle, b);
                }
            }
        }
        Ok(())
    }

    pub(crate) fn get(&self, handle: u64) -> Option<RemoteBuffer> {
        self.buffers.get(&handle).copied()
    }
}

/// The handle to give a buffer exposed without one: one past the largest in use.
pub(crate) fn next_handle(exposed: &BTreeMap<u64, (Arc<ExposedMemory>, u8)>) -> u64 {
    exposed.keys().next_back().map_or(1, |h| h + 1)
}

/// What a queued one-sided operation does.
pub(crate) enum OpKind {
    /// RDMA WRITE these bytes.
    Write(Vec<u8>),
    /// RDMA READ this many bytes; the result goes to the waiting caller (gone if it gave up).
    Read(usize, mpsc::Sender<Vec<u8>>),
}

/// One queued WRITE or READ (at most one send slot of data).
pub(crate) struct Op {
    pub(crate) id: u64,
    pub(crate) handle: u64,
    pub(crate) offset: u64,
    pub(crate) kind: OpKind,
}

impl Op {
    pub(crate) fn len(&self) -> usize {
        match &self.kind {
            OpKind::Write(d) => d.len(),
            OpKind::Read(n, _) => *n,
        }
    }
}

/// The queue of one-sided operations: kept, in order, until each completes, so that what a
/// lost link took is posted again on the next. Ids are contiguous from the front.
pub(crate) struct Ops {
    queue: VecDeque<Op>,
    next_id: u64,
    /// Highest id ever posted on any QP (posting up to it again is a replay).
    max_posted: u64,
}

impl Default for Ops {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
            next_id: 1,
            max_posted: 0,
        }
    }
}

impl Ops {
    pub(crate) fn push(&mut self, handle: u64, offset: u64, kind: OpKind) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back(Op {
            id,
            handle,
            offset,
            kind,
        });
        id
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Where a new QP starts posting: everything still queued goes out (again).
    pub(crate) fn restart_point(&self) -> u64 {
        self.queue.front().map_or(self.next_id, |op| op.id) - 1
    }

    /// The operation to post after `posted_upto` on the current QP.
    pub(crate) fn next_to_post(&self, posted_upto: u64) -> Option<&Op> {
        let front = self.queue.front()?.id;
        let next = (posted_upto + 1).max(front);
        self.queue.get((next - front) as usize)
    }

    /// Records that `id` was posted; returns whether that was a replay.
    pub(crate) fn on_posted(&mut self, id: u64) -> bool {
        let replay = id <= self.max_posted;
        self.max_posted = self.max_posted.max(id);
        replay
    }

    /// Completion of `id`: RC completes in posting order, so it must be the oldest.
    pub(crate) fn complete(&mut self, id: u64) -> Result<Op, OneSidedError> {
        match self.queue.front() {
            Some(op) if op.id == id => Ok(self.queue.pop_front().expect("checked")),
            Some(op) => Err(OneSidedError::OutOfOrder { id, oldest: op.id }),
            None => Err(OneSidedError::NoneQueued { id }),
        }
    }

    /// Drops everything (the connection failed or closed): waiting readers are woken.
    pub(crate) fn clear(&mut self) {
        self.queue.clear();
    }
}

/// One-sided state shared by the application and the worker (inside the shared `State`).
#[derive(Default)]
pub(crate) struct OneSided {
    /// This side's exposures: handle -> (memory, access bits).
    pub(crate) exposed: BTreeMap<u64, (Arc<ExposedMemory>, u8)>,
    /// The peer's buffers.
    pub(crate) peer: PeerMap,
    pub(crate) ops: Ops,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(handle: u64, len: u64, access: u8) -> RegionEntry {
        RegionEntry {
            handle,
            addr: 0x1000 * handle,
            len,
            rkey: handle as u32,
            access,
        }
    }

    #[test]
    fn ranges_inside_pass_and_outside_fail() {
        assert!(check_range(1, 100, 0, 100).is_ok());
        assert!(check_range(1, 100, 100, 0).is_ok());
        assert!(check_range(1, 100, 99, 1).is_ok());
        for (offset, len) in [(99, 2), (101, 0), (u64::MAX, 1), (0, 101)] {
            assert!(
                matches!(
                    check_range(7, 100, offset, len),
                    Err(ConnError::OutOfBounds {
                        handle: 7,
                        size: 100,
                        ..
                    })
                ),
                "{offset}+{len}"
            );
        }
    }

    #[test]
    fn the_peer_map_keeps_handles_stable_and_refuses_changes() {
        let mut m = PeerMap::default();
        m.update(&[entry(1, 64, ACCESS_WRITE), entry(2, 8, ACCESS_READ)])
            .unwrap();
        let before = m.get(1).unwrap();
        // A new QP: new addresses and keys, same buffers.
        let mut moved = entry(1, 64, ACCESS_WRITE);
        moved.addr = 0xdead_0000;
        moved.rkey = 0x77;
        m.update(&[moved]).unwrap();
        assert_eq!(m.get(1), Some(before));
        assert!(before.writable() && !before.readable());
        assert!(m.get(2).unwrap().readable());
        assert_eq!(m.get(3), None);
        assert!(m.update(&[entry(1, 65, ACCESS_WRITE)]).is_err());
        assert!(m.update(&[entry(2, 8, ACCESS_WRITE)]).is_err());
        assert_eq!(m.get(1).unwrap().len(), 64);
    }

    #[test]
    fn handles_are_given_past_the_largest() {
        let mut exposed = BTreeMap::new();
        assert_eq!(next_handle(&exposed), 1);
        exposed.insert(41, (Arc::new(ExposedMemory::new(1)), ACCESS_WRITE));
        assert_eq!(next_handle(&exposed), 42);
    }

    #[test]
    fn a_peer_announcing_more_buffers_than_the_limit_is_refused() {
        let mut map = PeerMap::default();
        let entry = |handle| RegionEntry {
            handle,
            addr: 0,
            rkey: 1,
            len: 16,
            access: 1,
        };
        let full: Vec<RegionEntry> = (0..MAX_BUFFERS as u64).map(entry).collect();
        map.update(&full).unwrap();
        // Announcing a known buffer again is fine; a new one is not.
        map.update(&[entry(0)]).unwrap();
        let err = map
            .update(&[entry(MAX_BUFFERS as u64)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("more than 1024 buffers"), "{err}");
        assert_eq!(map.buffers.len(), MAX_BUFFERS);
    }

    #[test]
    fn exposed_memory_is_bounds_checked() {
        let e = Exposed {
            handle: 3,
            mem: Arc::new(ExposedMemory::new(16)),
        };
        e.write(12, b"abcd").unwrap();
        let mut out = [0u8; 4];
        e.read(12, &mut out).unwrap();
        assert_eq!(&out, b"abcd");
        assert!(matches!(
            e.write(13, b"abcd"),
            Err(ConnError::OutOfBounds { handle: 3, .. })
        ));
        assert!(e.read(usize::MAX, &mut out).is_err());
    }

    fn write(ops: &mut Ops, handle: u64) -> u64 {
        ops.push(handle, 0, OpKind::Write(vec![1]))
    }

    #[test]
    fn operations_post_in_order_and_complete_in_order() {
        let mut ops = Ops::default();
        let a = write(&mut ops, 1);
        let b = write(&mut ops, 1);
        let mut upto = ops.restart_point();
        assert_eq!(upto, 0);
        let next = ops.next_to_post(upto).unwrap().id;
        assert_eq!(next, a);
        assert!(!ops.on_posted(a));
        upto = a;
        assert_eq!(ops.next_to_post(upto).unwrap().id, b);
        assert!(ops.complete(b).is_err(), "b completed before a");
        assert_eq!(ops.complete(a).unwrap().id, a);
        assert_eq!(ops.len(), 1);
        assert!(ops.complete(a).is_err());
    }

    #[test]
    fn a_new_link_replays_what_did_not_complete() {
        let mut ops = Ops::default();
        let ids: Vec<u64> = (0..4).map(|_| write(&mut ops, 2)).collect();
        for id in &ids {
            ops.on_posted(*id);
        }
        ops.complete(ids[0]).unwrap();
        // The link went with 1..3 posted but not completed: the next QP starts before them.
        let upto = ops.restart_point();
        assert_eq!(ops.next_to_post(upto).unwrap().id, ids[1]);
        assert!(ops.on_posted(ids[1]), "posting again is a replay");
        let fresh = write(&mut ops, 2);
        assert!(!ops.on_posted(fresh));
        // A stale posted_upto from before the front never skips the front.
        assert_eq!(ops.next_to_post(0).unwrap().id, ids[1]);
        ops.clear();
        assert!(ops.is_empty());
        assert_eq!(ops.restart_point(), fresh);
    }
}
