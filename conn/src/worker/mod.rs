//! The connection's worker: owns every verbs object of one connection and its TCP bridge,
//! and runs the connection (connect / accept, data path, quiesce, resume, replay, bridging,
//! close) as one async task.
//!
//! Every wait is an await on tokio: the completion channel, the CM event channel and the
//! bridge socket through [`AsyncFd`] (all non-blocking), the application's wake-ups through
//! a `Notify`, the coarse deadlines on a tick (100 ms, or 1 s while nothing is timed
//! closely: [`Worker::tick`]). AsyncFd is edge-triggered: a
//! readiness is cleared when the worker takes it, before it reads, and every read then goes
//! on until the descriptor has nothing more (EAGAIN), so whatever arrives after the clear
//! raises it again. CM events read ahead while waiting for one in particular wait in a queue.
//!
//! The task runs on the runtime of the async API's caller, or on a current-thread runtime
//! of its own thread for the blocking API ([`spawn`]).
//!
//! This file holds the worker's loop and its dispatch; the rest is split by concern, each an
//! `impl Worker` block of its own: `setup` (connect, accept, reconnect, install a link),
//! `link` (one QP's verbs objects and what is posted on it), `data` (completions, the send
//! path, credits and replay), `hold` (quiesce, hold, resume, losing a link, the deadlines),
//! `bridging` (the TCP bridge side). `state` is the connection's state machine.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmamig_proto::agent::ConnectionState;
pub(crate) use rdmamig_proto::text::error_chain;
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::io::Interest;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

mod bridging;
mod data;
mod hold;
mod link;
mod setup;
mod state;

pub(crate) use link::{build_endpoint, Endpoint, EXTRA_SEND_SLOTS, RECV_BASE};
use link::{Link, RESERVE};
use state::{transition, InvalidTransition, Phase};

use crate::bridge::Bridge;
use crate::control::ControlError;
use crate::error::ConnError;
use crate::failure::{Failure, LinkEvent};
use crate::reply::Reply;
use crate::shared::{Command, ConnShared};
use crate::wire::{Hello, HEADER_LEN};
use rdmamig_verbs::watch;
use rdmamig_verbs::{refresh_device_list, CmEvent, CmId, EventChannel, WorkCompletion};

/// The worker's tick: the granularity of its deadlines.
const TICK: Duration = Duration::from_millis(100);

/// The tick of a quiet connection ([`Worker::quiet`]): on a TCG guest each wake-up costs
/// CPU the VM's other work needs, and a nested VM's vCPU was most of its host's.
const QUIET_TICK: Duration = Duration::from_secs(1);

/// How the worker starts.
pub(crate) enum Start {
    /// Connect to `peer` with HELLO; report on `ready`.
    Active {
        peer: SocketAddr,
        ready: oneshot::Sender<Result<(), ConnError>>,
    },
    /// Accept the HELLO connect request on `id`; `on_ready` gets the connection once
    /// established.
    Passive {
        id: CmId,
        hello: Hello,
        on_ready: Box<dyn FnOnce(Arc<ConnShared>) + Send>,
    },
}

/// Starts the worker of `sh`: as a task on `runtime` if given (the async API), else on a
/// current-thread runtime of a thread of its own (the blocking API).
pub(crate) fn spawn(
    sh: Arc<ConnShared>,
    rx: mpsc::Receiver<Command>,
    start: Start,
    runtime: Option<Handle>,
) -> Result<(), ConnError> {
    let chan = EventChannel::new().map_err(|source| ConnError::Verbs {
        op: "creating the connection's event channel",
        source,
    })?;
    let name = format!("rdmamig-conn-{:04x}", sh.id & 0xffff);
    match runtime {
        Some(handle) => {
            let worker = {
                let _in = handle.enter();
                Worker::new(sh, rx, chan)?
            };
            handle.spawn(worker.run(start));
        }
        None => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()
                .map_err(|source| ConnError::Spawn {
                    what: "worker runtime",
                    source,
                })?;
            let worker = {
                let _in = runtime.enter();
                Worker::new(sh, rx, chan)?
            };
            std::thread::Builder::new()
                .name(name)
                .spawn(move || runtime.block_on(worker.run(start)))
                .map_err(|source| ConnError::Spawn {
                    what: "worker thread",
                    source,
                })?;
        }
    }
    Ok(())
}

struct Worker {
    sh: Arc<ConnShared>,
    /// Where the connection stands; changed only through [`Worker::enter`] (and, for the
    /// final states and `Up`, by [`Worker::finish_closed`], [`Worker::fail`] and
    /// [`Worker::install`], which check the same [`transition`]).
    phase: Phase,
    /// The end of the wait of a state without a link: the hold of `Held` (then the forced
    /// path), the wait for the peer of `AwaitingPeer` and `Resuming` (then the failure).
    down_until: Instant,
    rx: mpsc::Receiver<Command>,
    // Field order matters for Drop: the link (QP, CQ, MRs, PD, id) before the channel.
    link: Option<Link>,
    chan: AsyncFd<EventChannel>,
    /// CM events read from `chan` but not yet handled (read ahead by [`Worker::wait_for`]).
    cm_queue: VecDeque<CmEvent>,
    bridge: Option<AsyncFd<Bridge>>,
    /// This side sends its messages over the bridge (from its quiesce with `bridge`, or the
    /// peer's PAUSE asking for it, until a new RDMA link is installed).
    bridging: bool,
    /// When the active side may try to open a lost bridge again.
    next_bridge_attempt: Instant,
    peer: Option<SocketAddr>,
    quiesce_op: Option<(Instant, Reply)>,
    resume_op: Option<(Instant, Reply)>,
    close_op: Option<(Instant, Reply)>,
    next_attempt: Instant,
    /// Set-up steps in a row that got no CM event in time: each doubles the next attempt's
    /// bounds (`setup::patient`).
    setup_timeouts: u32,
    last_error: String,
    /// The link event that started the current wait for the peer.
    last_link: Option<LinkEvent>,
    slot: usize,
    wcs: Vec<WorkCompletion>,
}

/// Which of the worker's descriptors became readable (their readiness is cleared: each must
/// now be read until it has nothing more).
#[derive(Default)]
struct Ready {
    /// The rdma_cm event channel.
    cm: bool,
    /// The link's completion channel.
    completions: bool,
}

/// Takes a readiness tokio reported: clears it, so the next one comes from an edge after
/// this point (the caller reads until EAGAIN now). `false` if the descriptor failed.
fn clear<T: AsRawFd>(taken: std::io::Result<AsyncFdReadyGuard<'_, T>>) -> bool {
    match taken {
        Ok(mut guard) => {
            guard.clear_ready();
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "waiting for a descriptor failed");
            false
        }
    }
}

/// Readable `fd`; never, without one.
async fn readable<T: AsRawFd>(
    fd: Option<&AsyncFd<T>>,
) -> std::io::Result<AsyncFdReadyGuard<'_, T>> {
    match fd {
        Some(fd) => fd.readable().await,
        None => std::future::pending().await,
    }
}

/// The bridge readable, or writable while it holds unsent bytes (the last write then found
/// the socket full: its next edge is the one to wait for); never, without a bridge.
async fn bridge_ready(
    bridge: Option<&AsyncFd<Bridge>>,
) -> std::io::Result<AsyncFdReadyGuard<'_, Bridge>> {
    match bridge {
        Some(b) if b.get_ref().wants_write() => {
            b.ready(Interest::READABLE | Interest::WRITABLE).await
        }
        Some(b) => b.ready(Interest::READABLE).await,
        None => std::future::pending().await,
    }
}

impl Worker {
    /// A worker that has yet to start; called within the runtime it will run on (the
    /// channel is registered with that runtime's reactor).
    fn new(
        sh: Arc<ConnShared>,
        rx: mpsc::Receiver<Command>,
        chan: EventChannel,
    ) -> Result<Worker, ConnError> {
        let chan = watch(chan).map_err(|source| ConnError::Spawn {
            what: "watch on the CM event channel",
            source,
        })?;
        let slot = HEADER_LEN + sh.opts.max_message;
        Ok(Worker {
            sh,
            phase: Phase::Connecting,
            down_until: Instant::now(),
            rx,
            link: None,
            chan,
            cm_queue: VecDeque::new(),
            bridge: None,
            bridging: false,
            next_bridge_attempt: Instant::now(),
            peer: None,
            quiesce_op: None,
            resume_op: None,
            close_op: None,
            next_attempt: Instant::now(),
            setup_timeouts: 0,
            last_error: String::new(),
            last_link: None,
            slot,
            wcs: Vec::with_capacity(64),
        })
    }

    fn depth(&self) -> u32 {
        self.sh.opts.recv_depth.max(2 * RESERVE as u32)
    }

    /// Moves the connection to `to` if [`transition`] allows it, and shows the application
    /// and the agent the state it reached (`Closing` leaves the former one in view). An
    /// invalid move is logged and fails the connection (see [`Worker::refused`]); returns
    /// whether the move was made.
    fn enter(&mut self, to: Phase) -> bool {
        match transition(self.phase, to) {
            Ok(to) => {
                self.phase = to;
                if let Some(visible) = to.visible() {
                    self.sh.lock().conn_state = visible;
                }
                self.sh.changed();
                true
            }
            Err(invalid) => {
                self.refused(invalid);
                false
            }
        }
    }

    /// A move the state machine refused: a bug in the worker. Logged; the connection fails
    /// cleanly (everything released, every request answered), unless it has already ended.
    fn refused(&mut self, invalid: InvalidTransition) {
        tracing::warn!(conn = format_args!("{:016x}", self.sh.id), error = %invalid, "invalid connection state transition");
        if !self.phase.is_final() {
            self.fail(Failure::InvalidTransition {
                from: invalid.from.name(),
                to: invalid.to.name(),
            });
        }
    }

    /// Closes a connection no application holds, as dropping its handle would.
    fn abandoned(&mut self) {
        self.sh.lock().closed_by_app = true;
        let (reply, _) = oneshot::channel();
        self.close_op = Some((Instant::now() + Duration::from_secs(1), reply));
        self.enter(Phase::Closing);
    }

    async fn run(mut self, start: Start) {
        self.start(start).await;
        while !self.phase.is_final() {
            // Everything that needs prompt action wakes the worker (the application's
            // Notify, the CM channel, the completion channel, the bridge); the tick only
            // drives the coarse deadlines (100 ms granularity, all of them at least 500 ms
            // long, or 1 s while none is near). Only channels found readable are read: on a
            // TCG guest each read that would find nothing (EAGAIN) is a system call the
            // round does not need.
            let ready = self.wait().await;
            self.handle_commands().await;
            if self.phase.is_final() {
                break;
            }
            // Completions first: a CLOSE (or PAUSE) the peer sent just before it disconnected
            // must be seen before its DISCONNECTED event, or a clean close would look like a
            // broken link (and the resume that follows would be refused).
            if self.handle_completions(ready.completions) {
                // The application was just woken (a message, room in the outbox): its turn
                // first, so that what it answers is posted this round and carries the
                // acknowledgement. Without it, on a runtime the application shares, the
                // round went on to post a standalone ACK for every message received, which
                // the peer's worker must take as one more completion.
                tokio::task::yield_now().await;
            }
            if self.link.as_ref().is_some_and(|l| l.peer_bridging) {
                self.start_bridging();
            }
            self.handle_cm_events(ready.cm);
            self.serve_bridge();
            if self.link.is_some() {
                self.progress();
                if self.link.is_some() {
                    self.pump();
                }
            } else {
                self.down_tick().await;
            }
            self.reopen_bridge().await;
            self.check_deadlines();
        }
        // Whatever remains is released here: link first, then the channel (field order).
        self.link = None;
    }

    /// Sleeps until the application wakes the worker, a channel or the bridge is ready
    /// (the bridge writable only while it holds unsent bytes) or the tick; says which
    /// channels became readable. A queued CM event ends the sleep at once.
    async fn wait(&mut self) -> Ready {
        let mut ready = Ready::default();
        if !self.cm_queue.is_empty() {
            return ready;
        }
        let comp = self.link.as_ref().map(|l| &l.comp);
        tokio::select! {
            () = self.sh.wake.notified() => {}
            taken = self.chan.readable() => ready.cm = clear(taken),
            taken = readable(comp) => ready.completions = clear(taken),
            taken = bridge_ready(self.bridge.as_ref()) => {
                clear(taken);
            }
            () = tokio::time::sleep(self.tick()) => {}
        }
        ready
    }

    /// How long the worker sleeps at most when nothing wakes it.
    fn tick(&self) -> Duration {
        if self.quiet() {
            QUIET_TICK
        } else {
            TICK
        }
    }

    async fn handle_commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Command::Quiesce {
                    deadline,
                    mode,
                    reply,
                } => self.on_quiesce(deadline, mode, reply),
                Command::Bridge { stream, hello } => self.on_bridge(stream, hello),
                Command::Resume { deadline, reply } => self.on_resume(deadline, reply),
                Command::Incoming { id, hello } => self.on_incoming(id, hello).await,
                Command::Close { deadline, reply } => {
                    if self.link.is_none() {
                        let _ = reply.send(Ok(()));
                        self.finish_closed();
                        return;
                    }
                    // A second close (the handle's drop after `close`) takes over the
                    // first one's deadline and reply, as before.
                    self.close_op = Some((deadline, reply));
                    if self.phase != Phase::Closing {
                        self.enter(Phase::Closing);
                    }
                }
            }
        }
    }

    /// The connection is closed: releases everything and ends the worker.
    fn finish_closed(&mut self) {
        if let Err(invalid) = transition(self.phase, Phase::Closed) {
            self.refused(invalid);
            return;
        }
        self.phase = Phase::Closed;
        self.link = None;
        self.bridge = None;
        let mut st = self.sh.lock();
        st.bridge_up = false;
        st.onesided.ops.clear();
        st.conn_state = ConnectionState::Closed;
        drop(st);
        self.sh.changed();
    }

    /// The connection fails for good: releases everything, answers every pending request
    /// with the reason and ends the worker. A connection that has already ended stays as it
    /// ended.
    fn fail(&mut self, cause: Failure) {
        if let Err(invalid) = transition(self.phase, Phase::Failed) {
            tracing::warn!(conn = format_args!("{:016x}", self.sh.id), error = %invalid, reason = %cause, "invalid connection state transition");
            return;
        }
        self.phase = Phase::Failed;
        self.link = None;
        self.bridge = None;
        let _ = refresh_device_list();
        tracing::warn!(conn = format_args!("{:016x}", self.sh.id), reason = %cause, "connection failed");
        let mut st = self.sh.lock();
        st.bridge_up = false;
        st.conn_state = ConnectionState::Failed;
        st.failure = Some(cause.clone());
        st.onesided.ops.clear();
        drop(st);
        self.sh.changed();
        for op in [
            self.quiesce_op.take(),
            self.resume_op.take(),
            self.close_op.take(),
        ]
        .into_iter()
        .flatten()
        {
            let _ = op.1.send(Err(ControlError::Failed(cause.clone())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmamig_verbs::VerbsError;

    #[test]
    fn error_chains_join_every_cause() {
        let e = ConnError::Verbs {
            op: "listening",
            source: VerbsError::Listen(std::io::Error::from_raw_os_error(libc::EADDRINUSE)),
        };
        let s = error_chain(&e);
        assert!(
            s.starts_with("listening failed: rdma_listen failed: "),
            "{s}"
        );
        assert!(s.contains("in use"), "{s}");
    }
}
