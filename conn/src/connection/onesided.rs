//! The one-sided calls of a [`Connection`]: expose a buffer, take the peer's, queue WRITEs
//! and READs on it, wait for them (see [`crate::onesided`] for the bookkeeping they use and
//! the promises they keep across moves).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::error::ConnError;
use crate::onesided::*;
use crate::shared::State;
use rdmamig_verbs::ExposedMemory;

use super::Connection;

/// A READ between its checks and its data. Its reply's sender goes into the queued
/// operation and nowhere else, so the queue dropping the operation (the connection failed or
/// closed) ends the wait for the data.
pub(crate) struct PendingRead {
    handle: u64,
    offset: u64,
    len: usize,
    /// Until queued.
    reply: Option<mpsc::Sender<Vec<u8>>>,
    data: mpsc::Receiver<Vec<u8>>,
}

impl Connection {
    /// Exposes a new zeroed buffer of `len` bytes to the peer under `handle` (or, with
    /// `None`, a handle chosen here: see [`Exposed::handle`]). The peer finds it with
    /// [`Connection::remote`] once this side's next REGIONS message arrived (at once on a
    /// live link, else after the next reconnect). Does not wait.
    pub fn expose(
        &self,
        handle: Option<u64>,
        len: usize,
        access: Access,
    ) -> Result<Exposed, ConnError> {
        let mut st = self.shared.lock();
        self.check_usable(&st, "expose")?;
        let handle = handle.unwrap_or_else(|| next_handle(&st.onesided.exposed));
        if st.onesided.exposed.contains_key(&handle) {
            return Err(ConnError::HandleInUse { handle });
        }
        if st.onesided.exposed.len() >= MAX_BUFFERS {
            return Err(ConnError::TooManyExposed { limit: MAX_BUFFERS });
        }
        let mem = Arc::new(ExposedMemory::new(len));
        st.onesided
            .exposed
            .insert(handle, (mem.clone(), access.bits()));
        drop(st);
        self.shared.notify_worker();
        Ok(Exposed { handle, mem })
    }

    /// The peer's buffer `handle`, waiting up to `timeout` for the peer to expose it
    /// ([`ConnError::UnknownHandle`] after that). The value stays valid across moves of
    /// either side.
    pub fn remote(&self, handle: u64, timeout: Duration) -> Result<RemoteBuffer, ConnError> {
        let found = self.wait_until(Instant::now() + timeout, |st| self.remote_step(st, handle));
        found.unwrap_or_else(|| Err(self.unknown_handle(handle, timeout)))
    }

    /// Queues an RDMA WRITE of `data` into the peer's buffer at `offset` and returns; waits
    /// up to `send_timeout` while `max_outbox` operations are queued
    /// ([`ConnError::OneSidedTimedOut`] naming `write` after that). Larger writes are
    /// split into `max_message`-sized WRITEs. [`Connection::flush_writes`] waits until they
    /// are done; a message sent after that is delivered after the data is in place.
    pub fn write(&self, to: &RemoteBuffer, offset: u64, data: &[u8]) -> Result<(), ConnError> {
        let deadline = Instant::now() + self.shared.opts.send_timeout;
        for (at, part) in self.write_parts(to, offset, data)? {
            let queued = self.wait_until(deadline, |st| self.queue_write(st, to, at, part));
            self.queued("write", self.shared.opts.send_timeout, queued)?;
        }
        Ok(())
    }

    /// RDMA READs `len` bytes (at most `max_message`) of the peer's buffer at `offset`,
    /// waiting up to `timeout` for them (across a move, if one happens meanwhile);
    /// [`ConnError::OneSidedTimedOut`] naming `read` after that.
    pub fn read(
        &self,
        from: &RemoteBuffer,
        offset: u64,
        len: usize,
        timeout: Duration,
    ) -> Result<Vec<u8>, ConnError> {
        let mut read = self.start_read(from, offset, len)?;
        let deadline = Instant::now() + timeout;
        let queued = self.wait_until(deadline, |st| self.queue_read(st, &mut read));
        self.queued("read", timeout, queued)?;
        let answer = self.wait_until(deadline, |st| self.read_step(st, &mut read));
        answer.unwrap_or_else(|| Err(self.onesided_timeout("read", timeout)))
    }

    /// Waits up to `timeout` until every queued WRITE (and READ) has completed: its data is
    /// in the peer's buffer; [`ConnError::OneSidedTimedOut`] naming `flush_writes` after that.
    pub fn flush_writes(&self, timeout: Duration) -> Result<(), ConnError> {
        let done = self.wait_until(Instant::now() + timeout, |st| self.flushed_step(st));
        done.unwrap_or_else(|| Err(self.onesided_timeout("flush_writes", timeout)))
    }

    // What follows is shared by the blocking calls above and their async forms
    // (asynchronous.rs): the checks, the queueing, and each wait's `decide` step, a look at
    // the locked state that answers or says to wait for the worker's next change.

    /// `remote`'s step: the buffer once the peer's map names it.
    pub(crate) fn remote_step(
        &self,
        st: &State,
        handle: u64,
    ) -> Option<Result<RemoteBuffer, ConnError>> {
        if let Some(b) = st.onesided.peer.get(handle) {
            return Some(Ok(b));
        }
        self.check_usable(st, "remote").err().map(Err)
    }

    /// `remote`'s error when the peer exposed nothing under `handle` within `after`.
    pub(crate) fn unknown_handle(&self, handle: u64, after: Duration) -> ConnError {
        ConnError::UnknownHandle {
            id: self.shared.id,
            handle,
            after,
        }
    }

    /// Checks a WRITE and splits it into `max_message`-sized parts, each with its offset.
    pub(crate) fn write_parts<'a>(
        &self,
        to: &RemoteBuffer,
        offset: u64,
        data: &'a [u8],
    ) -> Result<impl Iterator<Item = (u64, &'a [u8])> + 'a, ConnError> {
        self.check_op(to, offset, data.len(), to.writable(), "write")?;
        let chunk = self.shared.opts.max_message.max(1);
        Ok(data
            .chunks(chunk)
            .enumerate()
            .map(move |(i, part)| (offset + (i * chunk) as u64, part)))
    }

    /// The step of queueing one part of a WRITE (see [`Connection::queue_op`]).
    pub(crate) fn queue_write(
        &self,
        st: &mut State,
        to: &RemoteBuffer,
        at: u64,
        part: &[u8],
    ) -> Option<Result<(), ConnError>> {
        self.queue_op(st, "write", to.handle, at, || OpKind::Write(part.to_vec()))
    }

    /// Checks a READ; what its waits need.
    pub(crate) fn start_read(
        &self,
        from: &RemoteBuffer,
        offset: u64,
        len: usize,
    ) -> Result<PendingRead, ConnError> {
        self.check_op(from, offset, len, from.readable(), "read")?;
        let max = self.shared.opts.max_message;
        if len > max {
            return Err(ConnError::MessageTooLarge { len, max });
        }
        let (reply, data) = mpsc::channel();
        Ok(PendingRead {
            handle: from.handle,
            offset,
            len,
            reply: Some(reply),
            data,
        })
    }

    /// The step of queueing a READ (see [`Connection::queue_op`]); its reply's sender goes
    /// into the queue.
    pub(crate) fn queue_read(
        &self,
        st: &mut State,
        read: &mut PendingRead,
    ) -> Option<Result<(), ConnError>> {
        let (len, reply) = (read.len, &mut read.reply);
        self.queue_op(st, "read", read.handle, read.offset, || {
            OpKind::Read(len, reply.take().expect("a READ is queued once"))
        })
    }

    /// The step of queueing operation `op` (made by `kind`): the connection's error if it
    /// is unusable, queued once the queue has room (`max_outbox` operations).
    pub(crate) fn queue_op(
        &self,
        st: &mut State,
        op: &'static str,
        handle: u64,
        offset: u64,
        kind: impl FnOnce() -> OpKind,
    ) -> Option<Result<(), ConnError>> {
        if let Err(e) = self.check_usable(st, op) {
            return Some(Err(e));
        }
        if st.onesided.ops.len() >= self.shared.opts.max_outbox {
            return None;
        }
        st.onesided.ops.push(handle, offset, kind());
        Some(Ok(()))
    }

    /// The outcome of waiting (up to `after`) for [`Connection::queue_op`]: the worker is
    /// woken for a queued operation; no answer means the queue stayed full.
    pub(crate) fn queued(
        &self,
        op: &'static str,
        after: Duration,
        answer: Option<Result<(), ConnError>>,
    ) -> Result<(), ConnError> {
        answer.unwrap_or_else(|| Err(self.onesided_timeout(op, after)))?;
        self.shared.notify_worker();
        Ok(())
    }

    /// `read`'s step once queued: the data once the READ completed. The worker sends it
    /// under the state lock, so looking under the lock misses no wake-up. A dropped sender
    /// means the queue was dropped: the connection failed or closed.
    pub(crate) fn read_step(
        &self,
        st: &State,
        read: &mut PendingRead,
    ) -> Option<Result<Vec<u8>, ConnError>> {
        match read.data.try_recv() {
            Ok(data) => Some(Ok(data)),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(self
                .check_usable(st, "read")
                .err()
                .unwrap_or(ConnError::InvalidState {
                    id: self.shared.id,
                    op: "read",
                    state: st.conn_state,
                }))),
        }
    }

    /// `flush_writes`' step: done once the operation queue is empty.
    pub(crate) fn flushed_step(&self, st: &State) -> Option<Result<(), ConnError>> {
        if st.onesided.ops.is_empty() {
            return Some(Ok(()));
        }
        self.check_usable(st, "flush_writes").err().map(Err)
    }

    /// The error of a one-sided wait that ran out after `after`.
    pub(crate) fn onesided_timeout(&self, op: &'static str, after: Duration) -> ConnError {
        ConnError::OneSidedTimedOut {
            id: self.shared.id,
            op,
            after,
            pending: self.shared.lock().onesided.ops.len(),
        }
    }

    pub(crate) fn check_op(
        &self,
        b: &RemoteBuffer,
        offset: u64,
        len: usize,
        allowed: bool,
        op: &'static str,
    ) -> Result<(), ConnError> {
        if !allowed {
            return Err(ConnError::NotPermitted {
                handle: b.handle,
                op,
            });
        }
        check_range(b.handle, b.len, offset, len)?;
        let st = self.shared.lock();
        self.check_usable(&st, op)?;
        if st.onesided.peer.get(b.handle).is_none() {
            return Err(self.unknown_handle(b.handle, Duration::ZERO));
        }
        Ok(())
    }
}
