//! The migratable connection: a reliable, ordered, exactly-once message stream over an RC
//! QP set up with rdma_cm, that survives a quiesce, a device swap and a resume.
//!
//! One worker per connection owns every verbs object of it: an async task that awaits its
//! descriptors through tokio (conn/src/worker.rs), on a runtime of its own thread for a
//! [`Connection`], on the application's runtime for an [`AsyncConnection`]. The
//! [`Connection`] handle (Send + Sync) talks to the worker through shared queues. The
//! protocol (wire header, credits, PAUSE/PAUSE_ACK, HELLO/RESUME private data, replay) is
//! described in docs/architecture.md.
//!
//! Beside the connection: [`registry`], the library's side of the agent socket (it
//! registers the process and runs the agent's quiesce and resume on its connections), and
//! [`plain`], a plain rdma_cm connection with no quiesce or replay, as applications use
//! today: the baseline the benchmarks compare against. The verbs themselves are
//! `rdmamig-verbs`'.
//!
//! ```no_run
//! use rdmamig_conn::{ConnectOptions, Connection, Listener};
//! use std::time::Duration;
//! let opts = ConnectOptions::default();
//! let listener = Listener::bind("10.77.0.1:7471".parse().unwrap(), &opts)?;
//! let conn = listener.accept(Duration::from_secs(30))?;
//! conn.send(b"hello")?;
//! let reply = conn.recv(Duration::from_secs(1))?;
//! # Ok::<(), rdmamig_conn::ConnError>(())
//! ```
//!
//! # One-sided RDMA WRITE and READ
//!
//! A side exposes a buffer under a handle ([`Connection::expose`]); the other takes it once
//! ([`Connection::remote`]) and writes into it or reads from it by handle and offset. The
//! [`RemoteBuffer`] stays valid across any number of moves of either side: the library
//! registers the buffer again on every new device and tells the peer the new address and
//! rkey before any operation is posted on the new QP. Operations are queued and posted in
//! order; those a link took without completing are posted again on the next QP (writing
//! the same bytes to the same place again changes nothing). A message sent after
//! [`Connection::flush_writes`] returned is delivered after the data is in place.
//!
//! The owner of the buffer (here the server) exposes it and reads what arrived once the
//! writer's message says so:
//!
//! ```no_run
//! use rdmamig_conn::{Access, ConnectOptions, Listener};
//! use std::time::Duration;
//! let listener = Listener::bind("10.77.0.1:7471".parse().unwrap(), &ConnectOptions::default())?;
//! let conn = listener.accept(Duration::from_secs(30))?;
//! let inbox = conn.expose(Some(7), 1 << 20, Access::ReadWrite)?;
//! if let Some(note) = conn.recv(Duration::from_secs(10))? {
//!     let len = u32::from_be_bytes(note[..4].try_into().unwrap()) as usize;
//!     let mut data = vec![0u8; len];
//!     inbox.read(0, &mut data)?;
//!     println!("peer wrote {} bytes", data.len());
//! }
//! # Ok::<(), rdmamig_conn::ConnError>(())
//! ```
//!
//! The writer takes the handle once, before any move, and keeps using it:
//!
//! ```no_run
//! use rdmamig_conn::{ConnectOptions, Connection};
//! use std::time::Duration;
//! let conn = Connection::connect("10.77.0.1:7471".parse().unwrap(), &ConnectOptions::default())?;
//! let inbox = conn.remote(7, Duration::from_secs(10))?; // waits for the peer's map
//! let data = vec![0xab; 64 * 1024];
//! conn.write(&inbox, 0, &data)?; // queued; split into max_message-sized WRITEs
//! conn.flush_writes(Duration::from_secs(30))?; // completed: the data is in place
//! conn.send(&(data.len() as u32).to_be_bytes())?; // delivered after the data
//! let back = conn.read(&inbox, 0, 4096, Duration::from_secs(30))?; // RDMA READ
//! assert_eq!(back, data[..4096]);
//! # Ok::<(), rdmamig_conn::ConnError>(())
//! ```
//!
//! Errors: [`ConnError::UnknownHandle`] (the peer exposed nothing under that handle within
//! the wait), [`ConnError::OutOfBounds`], [`ConnError::NotPermitted`] (the peer did not
//! allow that operation), [`ConnError::HandleInUse`], [`ConnError::OneSidedTimedOut`]
//! (naming `write`, `flush_writes` or `read`), and the connection's own errors. The same
//! operations have async forms on [`AsyncConnection`].

mod asynchronous;
mod bridge;
mod credits;
mod failure;
mod listener;
mod onesided;
pub mod plain;
mod probe;
pub mod registry;
mod reply;
mod sendq;
pub mod wire;
pub(crate) mod worker;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{ConnectionInfo, ConnectionState, Role};
use rdmamig_proto::ConnectionId;
use thiserror::Error;

pub use asynchronous::{AsyncConnection, AsyncListener};
pub use failure::{Failure, LinkEvent};
pub use listener::Listener;
pub use onesided::{Access, Exposed, RemoteBuffer};
pub use probe::{probe_bridge, probe_resume, ProbeAnswer};
pub use wire::RejectReason;

use crate::registry::Migratable;
use rdmamig_verbs::{CmId, VerbsError};
use reply::{NoAnswer, Reply};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use wire::Hello;

/// An inbox holds this many QPs' worth of receives (`recv_depth`) before the peer is held
/// back.
const INBOX_DEPTHS: usize = 4;

/// Settings of a connection (and of the connections a listener accepts).
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Largest message accepted by `send`, in bytes.
    pub max_message: usize,
    /// Receives pre-posted per QP (the credits the peer gets).
    pub recv_depth: u32,
    /// Messages kept for (re)transmission; `send` waits while this many are unacknowledged.
    pub max_outbox: usize,
    /// How long `send` waits for room in the outbox.
    pub send_timeout: Duration,
    /// How long `Connection::connect` keeps trying.
    pub connect_timeout: Duration,
    /// How long a connection waits for its peer to come back (after a PAUSE from a moving
    /// peer, a lost link, or its own quiesce without resume) before failing.
    pub peer_wait: Duration,
    /// QP ACK timeout exponent (4.096 us x 2^n): 14 = ~67 ms, 16 = ~268 ms.
    pub ack_timeout: u8,
    /// QP transport retries (below 7: Soft-RoCE treats 7 as infinite).
    pub retry_count: u8,
    /// RNR retries (below 7).
    pub rnr_retry: u8,
    /// Pause between reconnect attempts.
    pub reconnect_interval: Duration,
    /// How long `close` waits for the outbox to be acknowledged and the disconnect to
    /// complete before releasing everything anyway.
    pub close_timeout: Duration,
    /// Register with the agent (see [`crate::registry`]).
    pub register: bool,
    /// The TCP bridge (strategy `bridge`), over an address of a NIC that moves with the VM:
    /// a listener accepts bridges on it, a connecting side opens one to the peer's. Both
    /// ends need it; then a move with strategy `bridge` carries the messages over TCP
    /// while the RDMA path is rebuilt.
    pub bridge: Option<SocketAddr>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            max_message: 4096,
            recv_depth: 64,
            max_outbox: 4096,
            send_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            peer_wait: Duration::from_secs(60),
            ack_timeout: 16,
            retry_count: 6,
            rnr_retry: 6,
            reconnect_interval: Duration::from_millis(150),
            close_timeout: Duration::from_secs(5),
            register: true,
            bridge: None,
        }
    }
}

/// Errors of the migratable connection.
#[derive(Debug, Error)]
pub enum ConnError {
    /// The peer closed the connection (and everything it sent has been received).
    #[error("connection {id:016x} was closed by the peer")]
    PeerClosed {
        /// The connection.
        id: ConnectionId,
    },
    /// The connection failed for good; every pending and later operation reports this.
    #[error("connection {id:016x} failed")]
    Failed {
        /// The connection.
        id: ConnectionId,
        /// What happened.
        #[source]
        cause: Failure,
    },
    /// A quiesce, resume or close did not complete.
    #[error("{op} of connection {id:016x} failed: {reason}")]
    Control {
        /// The connection.
        id: ConnectionId,
        /// quiesce, resume or close.
        op: &'static str,
        /// Why (names the deadline when one passed).
        reason: String,
    },
    /// The TCP bridge could not be set up (listening on, or connecting to, `addr`).
    #[error("the bridge at {addr} could not be set up: {reason}")]
    Bridge {
        /// The bridge address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// Connecting did not succeed before the connect deadline.
    #[error("connecting to {peer} timed out after {after:?} (last error: {last})")]
    ConnectTimedOut {
        /// The peer.
        peer: SocketAddr,
        /// The deadline.
        after: Duration,
        /// The last attempt's error.
        last: String,
    },
    /// The peer refused the connection.
    #[error("{peer} rejected the connection: {reason:?}")]
    Rejected {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        reason: RejectReason,
    },
    /// `send` found the outbox full until its deadline.
    #[error(
        "send on connection {id:016x} timed out after {after:?}: {queued} messages unacknowledged"
    )]
    SendTimedOut {
        /// The connection.
        id: ConnectionId,
        /// The deadline.
        after: Duration,
        /// Messages waiting.
        queued: usize,
    },
    /// The message is larger than `max_message`.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    MessageTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `accept` found no connection before its deadline.
    #[error("no connection arrived at {addr} within {after:?}")]
    AcceptTimedOut {
        /// The listener's address.
        addr: SocketAddr,
        /// The deadline.
        after: Duration,
    },
    /// The listener failed or was shut down.
    #[error("listener on {addr} failed: {reason}")]
    ListenerFailed {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// A verbs or rdma_cm call failed while setting up.
    #[error("{op} failed")]
    Verbs {
        /// What was being done.
        op: &'static str,
        /// The cause.
        #[source]
        source: VerbsError,
    },
    /// An async operation was called outside a tokio runtime: the connection's worker runs
    /// as a task on the caller's runtime.
    #[error("{op} needs a tokio runtime to run the connection on")]
    NoRuntime {
        /// The operation.
        op: &'static str,
        /// What tokio said.
        #[source]
        source: tokio::runtime::TryCurrentError,
    },
    /// A thread, a runtime or a descriptor watch could not be created.
    #[error("could not start the connection's {what}")]
    Spawn {
        /// What.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The peer has not exposed a buffer under this handle (within the wait).
    #[error(
        "connection {id:016x}: the peer exposed no buffer with handle {handle} (waited {after:?})"
    )]
    UnknownHandle {
        /// The connection.
        id: ConnectionId,
        /// The handle.
        handle: u64,
        /// How long it waited for the peer's map.
        after: Duration,
    },
    /// A range outside the buffer.
    #[error("{len} bytes at offset {offset} are outside buffer {handle} of {size} bytes")]
    OutOfBounds {
        /// The buffer's handle.
        handle: u64,
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: usize,
        /// The buffer's size.
        size: u64,
    },
    /// The peer did not expose the buffer for this operation.
    #[error("buffer {handle} does not allow RDMA {op}")]
    NotPermitted {
        /// The buffer's handle.
        handle: u64,
        /// write or read.
        op: &'static str,
    },
    /// This side already exposed a buffer under the handle.
    #[error("a buffer with handle {handle} is already exposed")]
    HandleInUse {
        /// The handle.
        handle: u64,
    },
    /// This side already exposes as many buffers as a connection may.
    #[error("a connection exposes at most {limit} buffers")]
    TooManyExposed {
        /// The limit.
        limit: usize,
    },
    /// One-sided operations did not complete before the deadline.
    #[error("{op} on connection {id:016x} timed out after {after:?}: {pending} one-sided operations pending")]
    OneSidedTimedOut {
        /// The connection.
        id: ConnectionId,
        /// write (no room in the queue within send_timeout), read or flush_writes.
        op: &'static str,
        /// The deadline.
        after: Duration,
        /// Operations still queued.
        pending: usize,
    },
    /// The operation is not valid in the connection's state.
    #[error("connection {id:016x}: cannot {op} while {state:?}")]
    InvalidState {
        /// The connection.
        id: ConnectionId,
        /// The operation.
        op: &'static str,
        /// The state.
        state: ConnectionState,
    },
}

/// An error and its causes on one line (`a: b: c`), as tools print it.
pub use rdmamig_proto::text::error_chain;

/// Counters of one connection, for tools and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Times a QP was established (1 + reconnects).
    pub established: u64,
    /// Messages posted again on a new QP because the peer had not received them.
    pub replayed: u64,
    /// Duplicate messages dropped on receipt.
    pub duplicates_dropped: u64,
    /// One-sided operations (WRITE, READ) posted again on a new QP.
    pub onesided_replayed: u64,
    /// Messages sent over the TCP bridge.
    pub bridged: u64,
    /// The most messages that waited at once in the inbox for the application.
    pub inbox_high: u64,
    /// Link-level events the connection recovered from (not errors for the application).
    pub link_events: Vec<String>,
}

/// What the application and the worker share.
pub(crate) struct State {
    pub(crate) conn_state: ConnectionState,
    /// Unacknowledged messages, oldest first, contiguous sequence numbers.
    pub(crate) outbox: VecDeque<(u64, Vec<u8>)>,
    /// Next sequence number to assign.
    pub(crate) next_seq: u64,
    /// Messages received in order, not yet taken by `recv`.
    pub(crate) inbox: VecDeque<Vec<u8>>,
    /// Highest sequence number received.
    pub(crate) last_received: u64,
    /// Highest sequence number ever posted on any QP (re-sends up to it are replays).
    pub(crate) max_posted: u64,
    /// Why the connection failed, once it has.
    pub(crate) failure: Option<Failure>,
    /// The application called `close`.
    pub(crate) closed_by_app: bool,
    /// The peer closed.
    pub(crate) peer_closed: bool,
    pub(crate) local: String,
    pub(crate) peer: String,
    pub(crate) stats: ConnStats,
    /// Exposed buffers, the peer's map and the queue of WRITEs and READs.
    pub(crate) onesided: onesided::OneSided,
    /// A TCP bridge is open.
    pub(crate) bridge_up: bool,
}

pub(crate) enum Command {
    Quiesce {
        deadline: Instant,
        /// Carry messages over the bridge until the RDMA path is back.
        bridge: bool,
        reply: Reply,
    },
    Resume {
        deadline: Instant,
        reply: Reply,
    },
    Incoming {
        id: CmId,
        hello: Hello,
    },
    /// A bridge stream whose greeting named this connection (token checked).
    Bridge {
        stream: std::net::TcpStream,
        hello: Hello,
    },
    Close {
        deadline: Instant,
        reply: Reply,
    },
}

pub(crate) struct ConnShared {
    pub(crate) id: ConnectionId,
    pub(crate) token: [u8; 16],
    pub(crate) role: Role,
    pub(crate) opts: ConnectOptions,
    pub(crate) state: Mutex<State>,
    /// Wakes blocking callers when the worker changed the state (see [`ConnShared::changed`]).
    pub(crate) cond: Condvar,
    /// Wakes async callers, as `cond` wakes blocking ones.
    pub(crate) changed_async: tokio::sync::Notify,
    /// Wakes the worker when the application queued something or sent a command. Its
    /// permit (`notify_one`) is kept until the worker takes it, so a wake-up between two of
    /// its looks is never lost, and a stream of them costs one wake of the worker per round.
    pub(crate) wake: tokio::sync::Notify,
    commands: Mutex<mpsc::Sender<Command>>,
}

impl ConnShared {
    fn new(
        id: ConnectionId,
        token: [u8; 16],
        role: Role,
        opts: ConnectOptions,
    ) -> Result<(Arc<Self>, mpsc::Receiver<Command>), ConnError> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Self {
            id,
            token,
            role,
            opts,
            state: Mutex::new(State {
                conn_state: ConnectionState::Connecting,
                outbox: VecDeque::new(),
                next_seq: 1,
                inbox: VecDeque::new(),
                last_received: 0,
                max_posted: 0,
                failure: None,
                closed_by_app: false,
                peer_closed: false,
                local: String::new(),
                peer: String::new(),
                stats: ConnStats::default(),
                onesided: Default::default(),
                bridge_up: false,
            }),
            cond: Condvar::new(),
            changed_async: tokio::sync::Notify::new(),
            wake: tokio::sync::Notify::new(),
            commands: Mutex::new(tx),
        });
        Ok((shared, rx))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many received messages may wait for the application before the worker stops
    /// giving the peer credits (RDMA) or reading the bridge (TCP): a connection's inbox
    /// holds at most this many messages plus one QP's receives, whatever the peer sends.
    pub(crate) fn inbox_limit(&self) -> usize {
        INBOX_DEPTHS * self.opts.recv_depth as usize
    }

    /// Takes the application's next message; wakes the worker when that makes room in an
    /// inbox that was full, so that it gives the peer its credits back.
    pub(crate) fn take_message(&self, st: &mut State) -> Option<Vec<u8>> {
        let full = st.inbox.len() >= self.inbox_limit();
        let message = st.inbox.pop_front();
        if full && message.is_some() {
            self.notify_worker();
        }
        message
    }

    /// The worker changed what callers wait for (a message arrived, the outbox drained, the
    /// state or a failure): wakes blocking and async callers alike.
    pub(crate) fn changed(&self) {
        self.cond.notify_all();
        self.changed_async.notify_waiters();
    }

    /// The worker takes the wake-up before it looks at the shared state: whatever is queued
    /// before it wakes is seen in that round, whatever comes after leaves a new permit.
    pub(crate) fn notify_worker(&self) {
        self.wake.notify_one();
    }

    pub(crate) fn command(&self, cmd: Command) -> Result<(), Command> {
        let tx = self.commands.lock().unwrap_or_else(|p| p.into_inner());
        tx.send(cmd).map_err(|e| e.0)?;
        drop(tx);
        self.notify_worker();
        Ok(())
    }

    /// Sends the command `make` builds; the receiver of its answer, or `None` if the worker
    /// has ended.
    fn ask(
        &self,
        make: impl FnOnce(Reply) -> Command,
    ) -> Option<oneshot::Receiver<Result<(), String>>> {
        let (tx, rx) = oneshot::channel();
        self.command(make(tx)).ok().map(|()| rx)
    }

    /// How long a request waits: the worker answers by the deadline itself, at its next
    /// round; the margin covers a connect attempt in progress (a few seconds).
    fn answer_by(deadline: Instant) -> Instant {
        deadline.max(Instant::now()) + Duration::from_secs(5)
    }

    /// What a request's wait came to.
    fn answered(&self, answer: Result<Result<(), String>, NoAnswer>) -> Result<(), String> {
        match answer {
            Ok(answer) => answer,
            // The worker ended (closed or failed) before it took the command: the command
            // was dropped with its queue.
            Err(NoAnswer::Dropped) => self.stopped(),
            Err(NoAnswer::TimedOut) => Err("the connection did not answer in time".to_string()),
        }
    }

    fn request(
        &self,
        make: impl FnOnce(Reply) -> Command,
        deadline: Instant,
    ) -> Result<(), String> {
        match self.ask(make) {
            Some(rx) => self.answered(reply::wait(rx, Self::answer_by(deadline))),
            None => self.stopped(),
        }
    }

    async fn request_async(
        &self,
        make: impl FnOnce(Reply) -> Command,
        deadline: Instant,
    ) -> Result<(), String> {
        match self.ask(make) {
            Some(rx) => self.answered(reply::wait_async(rx, Self::answer_by(deadline)).await),
            None => self.stopped(),
        }
    }

    /// The answer to a request the worker can no longer take: done if it closed.
    fn stopped(&self) -> Result<(), String> {
        match self.lock().conn_state {
            ConnectionState::Closed => Ok(()),
            s => Err(format!("connection worker has stopped ({s:?})")),
        }
    }

    fn info(&self) -> ConnectionInfo {
        let st = self.lock();
        ConnectionInfo {
            id: self.id,
            pid: std::process::id(),
            role: self.role,
            local: st.local.clone(),
            peer: st.peer.clone(),
            state: st.conn_state,
            last_sent: st.next_seq - 1,
            last_received: st.last_received,
            unacked: st.outbox.len() as u64,
            bridge: st.bridge_up,
        }
    }
}

impl Migratable for ConnShared {
    fn describe(&self) -> Option<ConnectionInfo> {
        Some(self.info())
    }

    fn quiesce(&self, deadline: Instant, bridge: bool) -> Result<(), String> {
        self.request(
            |reply| Command::Quiesce {
                deadline,
                bridge,
                reply,
            },
            deadline,
        )
    }

    fn resume(&self, deadline: Instant) -> Result<(), String> {
        self.request(|reply| Command::Resume { deadline, reply }, deadline)
    }

    fn is_listener(&self) -> bool {
        false
    }

    fn conn_id(&self) -> Option<ConnectionId> {
        Some(self.id)
    }
}

/// The report of a connecting worker: connected, or why not.
type Connected = oneshot::Receiver<Result<(), ConnError>>;

/// A migratable connection. Cheap to share between threads (Send + Sync); dropping the last
/// handle closes it.
pub struct Connection {
    shared: Arc<ConnShared>,
    // Keeps the listener that routes RESUME requests to this connection alive.
    _listener: Option<Arc<listener::ListenerShared>>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Connection({:016x})", self.shared.id)
    }
}

impl Connection {
    /// Connects to a [`Listener`] at `peer`, retrying until `opts.connect_timeout`. The
    /// connection's worker runs on a thread of its own.
    pub fn connect(peer: SocketAddr, opts: &ConnectOptions) -> Result<Connection, ConnError> {
        let (shared, ready) = Self::start_connect(peer, opts, None)?;
        let answer = reply::wait(ready, Self::connect_deadline(opts));
        Self::connected(shared, peer, answer)
    }

    /// Starts a connection's worker (as a task on `runtime`, or on a thread of its own)
    /// connecting to `peer`; it reports on the receiver.
    fn start_connect(
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
    fn connect_deadline(opts: &ConnectOptions) -> Instant {
        Instant::now() + opts.connect_timeout + Duration::from_secs(10)
    }

    /// The connection, once its worker reported success.
    fn connected(
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
        listener: Option<Arc<listener::ListenerShared>>,
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
    fn check_size(&self, msg: &[u8]) -> Result<(), ConnError> {
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
    fn has_room(&self, st: &State) -> bool {
        st.outbox.len() < self.shared.opts.max_outbox
    }

    /// Numbers `msg`, queues it and wakes the worker.
    fn enqueue(&self, mut st: MutexGuard<'_, State>, msg: &[u8]) {
        let seq = st.next_seq;
        st.next_seq += 1;
        st.outbox.push_back((seq, msg.to_vec()));
        drop(st);
        self.shared.notify_worker();
    }

    fn check_usable(&self, st: &State, op: &'static str) -> Result<(), ConnError> {
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
    fn wait_until<T>(
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

    /// Quiesces this connection (as the agent would): see the module docs. With `bridge`,
    /// messages go on over the TCP bridge (if one is open) until the RDMA path is back.
    pub fn quiesce(&self, timeout: Duration, bridge: bool) -> Result<(), ConnError> {
        self.control("quiesce", timeout, |sh, d| sh.quiesce(d, bridge))
    }

    /// Resumes this connection (as the agent would).
    pub fn resume(&self, timeout: Duration) -> Result<(), ConnError> {
        self.control("resume", timeout, |sh, d| sh.resume(d))
    }

    fn control(
        &self,
        op: &'static str,
        timeout: Duration,
        f: impl FnOnce(&ConnShared, Instant) -> Result<(), String>,
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
    fn begin_close(&self) -> Result<Instant, ConnError> {
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

    fn close_failed(&self, reason: String) -> ConnError {
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
        // connection. The registry and the listener hold only Weak references.
        let (tx, _rx) = oneshot::channel();
        let _ = self.shared.command(Command::Close {
            deadline: Instant::now() + Duration::from_secs(1),
            reply: tx,
        });
    }
}
