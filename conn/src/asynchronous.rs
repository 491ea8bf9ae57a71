//! The async API on tokio: [`AsyncConnection`] and [`AsyncListener`].
//!
//! A connection's verbs objects belong to its worker, an async state machine that must own
//! them across a quiesce, a device swap and a resume. An async connection's worker is a task
//! on the caller's runtime (the one `connect` or `bind` ran on): it awaits the completion
//! channel, the CM event channel and the TCP bridge through tokio's
//! [`AsyncFd`](tokio::io::unix::AsyncFd), the application's wake-ups through a
//! [`tokio::sync::Notify`] and its deadlines on tokio's timer, so nothing busy-polls and no
//! runtime thread is ever blocked. (The blocking [`Connection`] runs the same worker on a
//! small runtime of its own thread.) What an application waits for (a message, room in the
//! outbox, the peer's acknowledgement, a failure) is state the worker changes, and it wakes
//! async callers through another `Notify`: an async `send` or `recv` never blocks a runtime
//! thread. Connect, accept and close await the worker's answer. The blocking handle of the
//! same connection stays available ([`AsyncConnection::blocking`]); its waits block, so it
//! is not for a runtime thread.
//!
//! The runtime needs IO and time enabled (`enable_all`), and must keep running for as long
//! as the connection lives: a runtime that is blocked or shut down also stops its
//! connections' workers (a quiesce from the agent then times out). Any flavour works,
//! including a current-thread runtime.
//!
//! ```no_run
//! use rdmamig_conn::{AsyncConnection, AsyncListener, ConnectOptions};
//! use std::time::Duration;
//! # async fn example() -> Result<(), rdmamig_conn::ConnError> {
//! let opts = ConnectOptions::default();
//! // Server: echo every message back.
//! let listener = AsyncListener::bind("10.77.0.1:7471".parse().unwrap(), &opts)?;
//! tokio::spawn(async move {
//!     let conn = listener.accept(Duration::from_secs(30)).await?;
//!     while let Some(msg) = conn.recv(Duration::from_secs(60)).await? {
//!         conn.send(&msg).await?;
//!     }
//!     conn.close().await
//! });
//! // Client.
//! let conn = AsyncConnection::connect("10.77.0.1:7471".parse().unwrap(), &opts).await?;
//! conn.send(b"hello").await?;
//! let echo = conn.recv(Duration::from_secs(1)).await?;
//! assert_eq!(echo.as_deref(), Some(&b"hello"[..]));
//! conn.close().await
//! # }
//! ```
//!
//! One-sided RDMA WRITE and READ (see the crate docs for what they promise across
//! moves) have async forms too; each is the blocking call's check and queueing with an
//! awaited wait, under the same deadline and with the same errors. A READ's data is awaited,
//! never waited for on a runtime thread. The owner of a buffer exposes it; the writer takes
//! its handle once, writes, waits for the WRITEs to complete and then says so by a message,
//! which arrives after the data:
//!
//! ```no_run
//! use rdmamig_conn::{Access, AsyncConnection, AsyncListener, ConnectOptions};
//! use std::time::Duration;
//! # async fn example() -> Result<(), rdmamig_conn::ConnError> {
//! let (addr, t) = ("10.77.0.1:7472".parse().unwrap(), Duration::from_secs(30));
//! // Writer (in practice on another machine): the handle stays valid across moves.
//! let writer = tokio::spawn(async move {
//!     let conn = AsyncConnection::connect(addr, &ConnectOptions::default()).await?;
//!     let inbox = conn.remote(7, t).await?; // waits for the owner's map
//!     let data = vec![0xab; 8192];
//!     conn.write(&inbox, 0, &data).await?; // queued, in max_message-sized WRITEs
//!     conn.flush_writes(t).await?; // completed: the data is in place
//!     conn.send(&(data.len() as u32).to_be_bytes()).await?; // arrives after the data
//!     let back = conn.read(&inbox, 0, 4096, t).await?; // RDMA READ
//!     assert_eq!(back, data[..4096]);
//!     conn.close().await
//! });
//! // Owner: exposes buffer 7 and reads what arrived once the writer's message says so.
//! let listener = AsyncListener::bind(addr, &ConnectOptions::default())?;
//! let conn = listener.accept(t).await?;
//! let inbox = conn.expose(Some(7), 1 << 16, Access::ReadWrite)?;
//! if let Some(note) = conn.recv(t).await? {
//!     let mut data = vec![0u8; u32::from_be_bytes(note[..4].try_into().unwrap()) as usize];
//!     inbox.read(0, &mut data)?;
//! }
//! writer.await.expect("the writer task")?;
//! conn.close().await
//! # }
//! ```

use std::net::SocketAddr;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use rdmamig_proto::agent::ConnectionInfo;
use rdmamig_proto::ConnectionId;

use tokio::runtime::Handle;

use crate::connection::Connection;
use crate::error::ConnError;
use crate::listener::Listener;
use crate::onesided::{Access, Exposed, RemoteBuffer};
use crate::options::ConnectOptions;
use crate::reply;
use crate::shared::{Command, ConnStats, State};

/// A migratable connection with an async API; see the module docs.
#[derive(Debug, Clone)]
pub struct AsyncConnection {
    conn: Arc<Connection>,
}

impl From<Connection> for AsyncConnection {
    fn from(conn: Connection) -> Self {
        AsyncConnection {
            conn: Arc::new(conn),
        }
    }
}

impl AsyncConnection {
    /// Connects to a listener at `peer`, retrying until `opts.connect_timeout`. The
    /// connection's worker becomes a task on the current runtime.
    pub async fn connect(
        peer: SocketAddr,
        opts: &ConnectOptions,
    ) -> Result<AsyncConnection, ConnError> {
        let runtime = current("connect")?;
        let (shared, ready) = Connection::start_connect(peer, opts, Some(runtime))?;
        let answer = reply::wait_async(ready, Connection::connect_deadline(opts)).await;
        Connection::connected(shared, peer, answer).map(AsyncConnection::from)
    }

    /// The blocking handle of the same connection.
    pub fn blocking(&self) -> &Connection {
        &self.conn
    }

    /// The connection's id.
    pub fn id(&self) -> ConnectionId {
        self.conn.id()
    }

    /// A snapshot for the agent.
    pub fn info(&self) -> ConnectionInfo {
        self.conn.info()
    }

    /// Counters.
    pub fn stats(&self) -> ConnStats {
        self.conn.stats()
    }

    /// Queues `msg` for delivery; waits up to `send_timeout` while the outbox is full.
    /// Accepted while quiesced or resuming: it is sent once the connection is back.
    pub async fn send(&self, msg: &[u8]) -> Result<(), ConnError> {
        self.conn.check_size(msg)?;
        let timeout = self.conn.shared.opts.send_timeout;
        let mut queued = 0;
        let sent = self
            .wait_until(Instant::now() + timeout, |st| {
                if let Err(e) = self.conn.check_usable(&st, "send") {
                    return Some(Err(e));
                }
                if self.conn.has_room(&st) {
                    self.conn.enqueue(st, msg);
                    return Some(Ok(()));
                }
                queued = st.outbox.len();
                None
            })
            .await;
        sent.unwrap_or(Err(ConnError::SendTimedOut {
            id: self.id(),
            after: timeout,
            queued,
        }))
    }

    /// Takes the next message, waiting up to `timeout`; `Ok(None)` if none arrived.
    pub async fn recv(&self, timeout: Duration) -> Result<Option<Vec<u8>>, ConnError> {
        self.wait_until(Instant::now() + timeout, |mut st| {
            match self.conn.shared.take_message(&mut st) {
                Some(msg) => Some(Ok(Some(msg))),
                None => self.conn.check_usable(&st, "recv").err().map(Err),
            }
        })
        .await
        .unwrap_or(Ok(None))
    }

    /// Waits up to `timeout` until every message sent so far has been acknowledged by the
    /// peer; returns whether it was.
    pub async fn flush(&self, timeout: Duration) -> bool {
        self.wait_until(Instant::now() + timeout, |st| {
            (st.outbox.is_empty() || st.failure.is_some()).then(|| st.outbox.is_empty())
        })
        .await
        .unwrap_or(false)
    }

    /// Exposes a new zeroed buffer to the peer; see [`Connection::expose`] (does not wait).
    pub fn expose(
        &self,
        handle: Option<u64>,
        len: usize,
        access: Access,
    ) -> Result<Exposed, ConnError> {
        self.conn.expose(handle, len, access)
    }

    /// The peer's buffer `handle`, waiting up to `timeout` for the peer to expose it; see
    /// [`Connection::remote`].
    pub async fn remote(&self, handle: u64, timeout: Duration) -> Result<RemoteBuffer, ConnError> {
        let found = self
            .wait_until(Instant::now() + timeout, |st| {
                self.conn.remote_step(&st, handle)
            })
            .await;
        found.unwrap_or_else(|| Err(self.conn.unknown_handle(handle, timeout)))
    }

    /// Queues an RDMA WRITE of `data` into the peer's buffer at `offset`, waiting up to
    /// `send_timeout` for room in the queue; see [`Connection::write`].
    pub async fn write(
        &self,
        to: &RemoteBuffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ConnError> {
        let timeout = self.conn.shared.opts.send_timeout;
        let deadline = Instant::now() + timeout;
        for (at, part) in self.conn.write_parts(to, offset, data)? {
            let queued = self
                .wait_until(deadline, |mut st| {
                    self.conn.queue_write(&mut st, to, at, part)
                })
                .await;
            self.conn.queued("write", timeout, queued)?;
        }
        Ok(())
    }

    /// RDMA READs `len` bytes of the peer's buffer at `offset`, waiting up to `timeout`;
    /// see [`Connection::read`]. The reply is awaited, not waited for on a runtime thread.
    pub async fn read(
        &self,
        from: &RemoteBuffer,
        offset: u64,
        len: usize,
        timeout: Duration,
    ) -> Result<Vec<u8>, ConnError> {
        let mut read = self.conn.start_read(from, offset, len)?;
        let deadline = Instant::now() + timeout;
        let queued = self
            .wait_until(deadline, |mut st| self.conn.queue_read(&mut st, &mut read))
            .await;
        self.conn.queued("read", timeout, queued)?;
        let answer = self
            .wait_until(deadline, |st| self.conn.read_step(&st, &mut read))
            .await;
        answer.unwrap_or_else(|| Err(self.conn.onesided_timeout("read", timeout)))
    }

    /// Waits up to `timeout` until every queued WRITE and READ has completed; see
    /// [`Connection::flush_writes`].
    pub async fn flush_writes(&self, timeout: Duration) -> Result<(), ConnError> {
        let done = self
            .wait_until(Instant::now() + timeout, |st| self.conn.flushed_step(&st))
            .await;
        done.unwrap_or_else(|| Err(self.conn.onesided_timeout("flush_writes", timeout)))
    }

    /// Calls `decide` with the locked state until it returns an answer, waiting for the
    /// worker's changes in between; `None` once `deadline` has passed. The wake-up is
    /// registered before each look at the state, so a change in between is not missed.
    async fn wait_until<T>(
        &self,
        deadline: Instant,
        mut decide: impl FnMut(MutexGuard<'_, State>) -> Option<T>,
    ) -> Option<T> {
        let shared = &self.conn.shared;
        loop {
            let changed = shared.changed_async.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(answer) = decide(shared.lock()) {
                return Some(answer);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, changed).await.is_err() {
                return None;
            }
        }
    }

    /// Closes the connection; see [`Connection::close`].
    pub async fn close(&self) -> Result<(), ConnError> {
        let deadline = self.conn.begin_close()?;
        self.conn
            .shared
            .request_async(|reply| Command::Close { deadline, reply }, deadline)
            .await
            .map_err(|reason| self.conn.close_failed(reason))
    }
}

/// A listener with an async `accept`; see the module docs.
#[derive(Debug, Clone)]
pub struct AsyncListener {
    listener: Arc<Listener>,
}

impl AsyncListener {
    /// Listens on `addr` (an address of an RDMA device); see [`Listener::bind`]. The
    /// workers of the connections it accepts become tasks on the current runtime.
    pub fn bind(addr: SocketAddr, opts: &ConnectOptions) -> Result<AsyncListener, ConnError> {
        let runtime = current("bind")?;
        Ok(AsyncListener {
            listener: Arc::new(Listener::bind_on(addr, opts, Some(runtime))?),
        })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }

    /// Waits up to `timeout` for a new, established connection.
    pub async fn accept(&self, timeout: Duration) -> Result<AsyncConnection, ConnError> {
        let deadline = Instant::now() + timeout;
        let arrived = &self.listener.shared().arrived;
        loop {
            // Registered before the look, so an arrival in between is not missed.
            let next = arrived.notified();
            tokio::pin!(next);
            next.as_mut().enable();
            if let Some(answer) = self.listener.take_next() {
                return answer.map(AsyncConnection::from);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, next).await.is_err() {
                return Err(self.listener.accept_timed_out(timeout));
            }
        }
    }
}

/// The runtime the caller runs on, which the connection's worker joins.
fn current(op: &'static str) -> Result<Handle, ConnError> {
    Handle::try_current().map_err(|source| ConnError::NoRuntime { op, source })
}
