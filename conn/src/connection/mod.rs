//! [`Connection`], the blocking handle of a migratable connection: connect, send, recv,
//! flush, quiesce, resume, close (and, in [`onesided`], the one-sided RDMA calls). The handle
//! only queues and waits on the [`ConnShared`] state; the worker does the rest.

mod onesided;

use std::any::Any;
use std::net::SocketAddr;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{ConnectionInfo, ConnectionState, QuiesceMode, Role};
use rdmamig_proto::ConnectionId;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::control::ControlError;
use crate::error::ConnError;
use crate::options::ConnectOptions;
use crate::registry::{self, Migratable};
use crate::reply::{self, NoAnswer};
use crate::shared::{Command, ConnShared, ConnStats, State};
use crate::worker;

/// The report of a connecting worker: connected, or why not.
type Connected = oneshot::Receiver<Result<(), ConnError>>;

/// A migratable connection. Cheap to share between threads (Send + Sync); dropping the last
/// handle closes it.
pub struct Connection {
    pub(crate) shared: Arc<ConnShared>,
    // Keeps the listener that routes RESUME requests to this connection alive. Held as
    // `Any`: the handle only keeps it, and so needs nothing of the listener's module (which
    // builds connections, and so imports this one).
    _listener: Option<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Connection({:016x})", self.shared.id)
    }
}

impl Connection {
    /// Connects to a `Listener` at `peer`, retrying until `opts.connect_timeout`. The
    /// connection's worker runs on a thread of its own.
    pub fn connect(peer: SocketAddr, opts: &ConnectOptions) -> Result<Connection, ConnError> {
        let (shared, ready) = Self::start_connect(peer, opts, None)?;
        let answer = reply::wait(ready, Self::connect_deadline(opts));
        Self::connected(shared, peer, answer)
    }

    /// Starts a connection's worker (as a task on `runtime`, or on a thread of its own)
    /// connecting to `peer`; it reports on the receiver.
    pub(crate) fn start_connect(
        peer: SocketAddr,
        opts: &ConnectOptions,
        runtime: Option<Handle>,
    ) -> Result<(Arc<ConnShared>, Connected), ConnError> {
        let id: ConnectionId = rand::random::<u64>() | 1;
        let token: [u8; 16] = rand::random();
        let (shared, rx) = ConnShared::new(id, token, Role::Active, opts.clone())?;
        let (ready_tx, ready_rx) = oneshot::channel();
        worker::spawn(
            shared.clone(),
            rx,
            worker::Start::Active {
                peer,
                ready: ready_tx,
            },
            runtime,
        )?;
        Ok((shared, ready_rx))
    }

    /// The worker ends its connect attempts by `connect_timeout`; the margin covers the
    /// attempt in progress.
    pub(crate) fn connect_deadline(opts: &ConnectOptions) -> Instant {
        Instant::now() + opts.connect_timeout + Duration::from_secs(10)
    }

    /// The connection, once its worker reported success.
    pub(crate) fn connected(
        shared: Arc<ConnShared>,
        peer: SocketAddr,
        answer: Result<Result<(), ConnError>, NoAnswer>,
    ) -> Result<Connection, ConnError> {
        match answer {
            Ok(Ok(())) => Ok(Self::from_shared(shared, None)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ConnError::ConnectTimedOut {
                peer,
                after: shared.opts.connect_timeout,
                last: "the connection worker did not report".into(),
            }),
        }
    }

    pub(crate) fn from_shared(
        shared: Arc<ConnShared>,
        listener: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Connection {
        if shared.opts.register {
            let weak: std::sync::Weak<dyn Migratable> = {
                let arc: Arc<dyn Migratable> = shared.clone();
                Arc::downgrade(&arc)
            };
            registry::register(weak);
        }
        Connection {
            shared,
            _listener: listener,
        }
    }

    /// The connection's id.
    pub fn id(&self) -> ConnectionId {
        self.shared.id
    }

    /// Queues `msg` for delivery; waits up to `send_timeout` while the outbox is full.
    /// Accepted while quiesced or resuming: it is sent once the connection is back.
    pub fn send(&self, msg: &[u8]) -> Result<(), ConnError> {
        self.check_size(msg)?;
        let opts = &self.shared.opts;
        let deadline = Instant::now() + opts.send_timeout;
        let mut st = self.shared.lock();
        loop {
            self.check_usable(&st, "send")?;
            if self.has_room(&st) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ConnError::SendTimedOut {
                    id: self.shared.id,
                    after: opts.send_timeout,
                    queued: st.outbox.len(),
                });
            }
            st = self
                .shared
                .cond
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.enqueue(st, msg);
        Ok(())
    }

    /// Checks a message against `max_message` before it is queued.
    pub(crate) fn check_size(&self, msg: &[u8]) -> Result<(), ConnError> {
        let max = self.shared.opts.max_message;
        if msg.len() > max {
            return Err(ConnError::MessageTooLarge {
                len: msg.len(),
                max,
            });
        }
        Ok(())
    }

    /// Whether the outbox has room for one more message.
    pub(crate) fn has_room(&self, st: &State) -> bool {
        st.outbox.len() < self.shared.opts.max_outbox
    }

    /// Numbers `msg`, queues it and wakes the worker.
    pub(crate) fn enqueue(&self, mut st: MutexGuard<'_, State>, msg: &[u8]) {
        let seq = st.next_seq;
        st.next_seq += 1;
        st.outbox.push_back((seq, msg.to_vec()));
        drop(st);
        self.shared.notify_worker();
    }

    pub(crate) fn check_usable(&self, st: &State, op: &'static str) -> Result<(), ConnError> {
        let id = self.shared.id;
        if st.closed_by_app {
            return Err(ConnError::InvalidState {
                id,
                op,
                state: ConnectionState::Closed,
            });
        }
        if let Some(cause) = &st.failure {
            return Err(ConnError::Failed {
                id,
                cause: cause.clone(),
            });
        }
        if st.peer_closed {
            return Err(ConnError::PeerClosed { id });
        }
        Ok(())
    }

    /// Calls `decide` with the locked state until it returns an answer, waiting on the
    /// condvar for the worker's changes in between; `None` once `deadline` has passed. The
    /// blocking twin of the async API's wait: an operation that has both forms is one
    /// `decide` step that both waits call.
    pub(crate) fn wait_until<T>(
        &self,
        deadline: Instant,
        mut decide: impl FnMut(&mut State) -> Option<T>,
    ) -> Option<T> {
        let mut st = self.shared.lock();
        loop {
            if let Some(answer) = decide(&mut st) {
                return Some(answer);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st = self
                .shared
                .cond
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Takes the next message, waiting up to `timeout`; `Ok(None)` if none arrived.
    pub fn recv(&self, timeout: Duration) -> Result<Option<Vec<u8>>, ConnError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        loop {
            if let Some(msg) = self.shared.take_message(&mut st) {
                return Ok(Some(msg));
            }
            self.check_usable(&st, "recv")?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            st = self
                .shared
                .cond
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits up to `timeout` until every message sent so far has been acknowledged by the
    /// peer; returns whether it was.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        while !st.outbox.is_empty() && st.failure.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self
                .shared
                .cond
                .wait_timeout(st, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.outbox.is_empty()
    }

    /// A snapshot for the agent.
    pub fn info(&self) -> ConnectionInfo {
        self.shared.info()
    }

    /// Counters.
    pub fn stats(&self) -> ConnStats {
        self.shared.lock().stats.clone()
    }

    /// Quiesces this connection (as the agent would): see the module docs. `mode` says
    /// whether messages go on over the TCP bridge meanwhile, or whether the QP is kept.
    pub fn quiesce(&self, timeout: Duration, mode: QuiesceMode) -> Result<(), ConnError> {
        self.control("quiesce", timeout, |sh, d| sh.quiesce(d, mode))
    }

    /// Resumes this connection (as the agent would).
    pub fn resume(&self, timeout: Duration) -> Result<(), ConnError> {
        self.control("resume", timeout, |sh, d| sh.resume(d))
    }

    pub(crate) fn control(
        &self,
        op: &'static str,
        timeout: Duration,
        f: impl FnOnce(&ConnShared, Instant) -> Result<(), ControlError>,
    ) -> Result<(), ConnError> {
        self.check_usable(&self.shared.lock(), op)?;
        f(&self.shared, Instant::now() + timeout).map_err(|reason| ConnError::Control {
            id: self.shared.id,
            op,
            reason,
        })
    }

    /// Closes the connection: waits (up to `close_timeout`) for the outbox to be
    /// acknowledged, tells the peer, disconnects and releases everything. A second close is an
    /// [`ConnError::InvalidState`], as are `send` and `recv` after it.
    pub fn close(&self) -> Result<(), ConnError> {
        let deadline = self.begin_close()?;
        self.shared
            .request(|reply| Command::Close { deadline, reply }, deadline)
            .map_err(|reason| self.close_failed(reason))
    }

    /// Marks the connection closed by the application; the close's deadline.
    pub(crate) fn begin_close(&self) -> Result<Instant, ConnError> {
        let mut st = self.shared.lock();
        if st.closed_by_app {
            return Err(ConnError::InvalidState {
                id: self.shared.id,
                op: "close",
                state: ConnectionState::Closed,
            });
        }
        st.closed_by_app = true;
        Ok(Instant::now() + self.shared.opts.close_timeout)
    }

    pub(crate) fn close_failed(&self, reason: ControlError) -> ConnError {
        ConnError::Control {
            id: self.shared.id,
            op: "close",
            reason,
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // The handle is the application's only one (not Clone): dropping it closes the
        // connection. The registry and the listener hold only Weak references. Marked
        // closed first, so that a set-up attempt in progress gives up at once.
        self.shared.lock().closed_by_app = true;
        let (tx, _rx) = oneshot::channel();
        let _ = self.shared.command(Command::Close {
            deadline: Instant::now() + Duration::from_secs(1),
            reply: tx,
        });
    }
}
