//! What the application's handle and the connection's worker share: the [`State`] behind one
//! mutex (outbox, inbox, sequence numbers, failure, counters), the wake-ups both ways, and the
//! command queue to the worker ([`Command`]). The worker module and the handle modules
//! (`Connection`, `AsyncConnection`, the
//! listener) all build on this one, and it on none of them.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{ConnectionInfo, ConnectionState, QuiesceMode, Role};
use rdmamig_proto::ConnectionId;
use rdmamig_verbs::CmId;
use tokio::sync::oneshot;

use crate::control::ControlError;
use crate::error::ConnError;
use crate::failure::Failure;
use crate::onesided;
use crate::options::ConnectOptions;
use crate::registry::Migratable;
use crate::reply::{self, NoAnswer, Reply};
use crate::wire::Hello;

/// An inbox holds this many QPs' worth of receives (`recv_depth`) before the peer is held
/// back.
const INBOX_DEPTHS: usize = 4;

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
    /// The number of each QP that carried the connection, in order (a `hot` move keeps
    /// the one it has).
    pub qps: Vec<u32>,
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
    /// The number of the QP that carries the connection now.
    pub(crate) qp: Option<u32>,
    /// Why the last link a `hot` quiesce kept was given up (the resume then reconnected).
    pub(crate) fell_back: Option<String>,
    /// What the worker is doing that keeps it from taking requests (a set-up attempt, the
    /// release of a link in the kernel), named when a request gets no answer.
    pub(crate) busy: Option<&'static str>,
}

pub(crate) enum Command {
    Quiesce {
        deadline: Instant,
        /// What the quiesce leaves of the link (bridge, or the QP kept).
        mode: QuiesceMode,
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
    pub(crate) commands: Mutex<mpsc::Sender<Command>>,
}

impl ConnShared {
    pub(crate) fn new(
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
                busy: None,
                local: String::new(),
                peer: String::new(),
                stats: ConnStats::default(),
                onesided: Default::default(),
                bridge_up: false,
                qp: None,
                fell_back: None,
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
    pub(crate) fn ask(
        &self,
        make: impl FnOnce(Reply) -> Command,
    ) -> Option<oneshot::Receiver<Result<(), ControlError>>> {
        let (tx, rx) = oneshot::channel();
        self.command(make(tx)).ok().map(|()| rx)
    }

    /// How long a request waits: the worker answers by the deadline itself, at its next
    /// round; the margin covers a connect attempt in progress (a few seconds).
    pub(crate) fn answer_by(deadline: Instant) -> Instant {
        deadline.max(Instant::now()) + Duration::from_secs(5)
    }

    /// What a request's wait came to.
    pub(crate) fn answered(
        &self,
        answer: Result<Result<(), ControlError>, NoAnswer>,
    ) -> Result<(), ControlError> {
        match answer {
            Ok(answer) => answer,
            // The worker ended (closed or failed) before it took the command: the command
            // was dropped with its queue.
            Err(NoAnswer::Dropped) => self.stopped(),
            Err(NoAnswer::TimedOut) => {
                let st = self.lock();
                Err(ControlError::NoAnswer {
                    state: st.conn_state,
                    busy: st.busy,
                })
            }
        }
    }

    pub(crate) fn request(
        &self,
        make: impl FnOnce(Reply) -> Command,
        deadline: Instant,
    ) -> Result<(), ControlError> {
        match self.ask(make) {
            Some(rx) => self.answered(reply::wait(rx, Self::answer_by(deadline))),
            None => self.stopped(),
        }
    }

    pub(crate) async fn request_async(
        &self,
        make: impl FnOnce(Reply) -> Command,
        deadline: Instant,
    ) -> Result<(), ControlError> {
        match self.ask(make) {
            Some(rx) => self.answered(reply::wait_async(rx, Self::answer_by(deadline)).await),
            None => self.stopped(),
        }
    }

    /// The answer to a request the worker can no longer take: done if it closed.
    pub(crate) fn stopped(&self) -> Result<(), ControlError> {
        match self.lock().conn_state {
            ConnectionState::Closed => Ok(()),
            state => Err(ControlError::WorkerStopped { state }),
        }
    }

    pub(crate) fn info(&self) -> ConnectionInfo {
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
            qp: st.qp,
        }
    }
}

impl Migratable for ConnShared {
    fn describe(&self) -> Option<ConnectionInfo> {
        Some(self.info())
    }

    fn quiesce(&self, deadline: Instant, mode: QuiesceMode) -> Result<(), ControlError> {
        self.request(
            |reply| Command::Quiesce {
                deadline,
                mode,
                reply,
            },
            deadline,
        )
    }

    fn resume(&self, deadline: Instant) -> Result<(), ControlError> {
        self.request(|reply| Command::Resume { deadline, reply }, deadline)
    }

    fn fell_back(&self) -> Option<String> {
        self.lock().fell_back.clone()
    }

    fn is_listener(&self) -> bool {
        false
    }

    fn conn_id(&self) -> Option<ConnectionId> {
        Some(self.id)
    }
}
