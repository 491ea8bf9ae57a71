//! The connection's worker: owns every verbs object of one connection and its TCP bridge,
//! and runs its state machine (connect / accept, data path, quiesce, resume, replay,
//! bridging, close) as one async task.
//!
//! Every wait is an await on tokio: the completion channel, the CM event channel and the
//! bridge socket through [`AsyncFd`] (all non-blocking), the application's wake-ups through
//! a `Notify`, the coarse deadlines on a 100 ms interval. AsyncFd is edge-triggered: a
//! readiness is cleared when the worker takes it, before it reads, and every read then goes
//! on until the descriptor has nothing more (EAGAIN), so whatever arrives after the clear
//! raises it again. CM events read ahead while waiting for one in particular wait in a queue.
//!
//! The task runs on the runtime of the async API's caller, or on a current-thread runtime
//! of its own thread for the blocking API ([`spawn`]).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{ConnectionState, Role};
pub(crate) use rdmamig_proto::text::error_chain;
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::io::Interest;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::time::{Interval, MissedTickBehavior};

use crate::bridge::Bridge;
use crate::credits::{classify, Arrival, Credits, StarvedProbe};
use crate::error::ConnError;
use crate::failure::{Failure, LinkEvent};
use crate::onesided::{remote_access, OpKind};
use crate::reply::Reply;
use crate::sendq::SendSlots;
use crate::shared::{Command, ConnShared, State};
use crate::wire::{
    Accept, Header, Hello, Kind, PrivateData, RegionEntry, Reject, RejectReason, FLAG_BRIDGE,
    FLAG_MOVING, HEADER_LEN, REGION_ENTRY_LEN,
};
use rdmamig_verbs::watch;
use rdmamig_verbs::{
    refresh_device_list, CmEvent, CmEventKind, CmId, CompletionChannel, CompletionQueue,
    EventChannel, ExposedRegion, IdKey, MemoryRegion, ProtectionDomain, QpCaps, RdmaOp, SendWr,
    VerbsError, WorkCompletion,
};

/// wr_id of receives: RECV_BASE + slot; sends use the slot number.
pub(crate) const RECV_BASE: u64 = 1 << 32;
/// wr_id of one-sided WRITEs and READs: ONESIDED_BASE + slot.
const ONESIDED_BASE: u64 = 1 << 40;
/// Credits DATA leaves for control messages.
const RESERVE: u64 = 4;
/// Extra send slots beyond the receive depth (room for control messages).
pub(crate) const EXTRA_SEND_SLOTS: u32 = 8;
/// A SEND is signaled at least this often within a chain (see [`SendSlots`]).
const SIGNAL_EVERY: u32 = 16;
/// Bounds of the set-up steps of one connect attempt.
const RESOLVE_TIMEOUT: Duration = Duration::from_millis(1000);
const ESTABLISH_TIMEOUT: Duration = Duration::from_millis(3000);
/// How long to wait for DISCONNECTED after rdma_disconnect.
const DISCONNECT_WAIT: Duration = Duration::from_millis(1000);
/// The worker's tick: the granularity of its deadlines.
const TICK: Duration = Duration::from_millis(100);
/// How often the device list is refreshed while the connection holds no device.
const REFRESH_INTERVAL: Duration = Duration::from_millis(100);
/// Pause between attempts of the active side to open a lost bridge again.
const BRIDGE_RETRY: Duration = Duration::from_secs(1);
/// How often a sender that waits for credits with nothing in flight probes its peer.
const STARVED_PROBE: Duration = Duration::from_secs(1);

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

/// The verbs objects of one QP. `Drop` destroys the QP, then the fields drop in order:
/// CQ, completion channel, MRs, PD, and the cm id last.
pub(crate) struct Endpoint {
    pub(crate) cq: CompletionQueue,
    pub(crate) comp: CompletionChannel,
    pub(crate) send_mr: MemoryRegion,
    pub(crate) recv_mr: MemoryRegion,
    pd: ProtectionDomain,
    pub(crate) id: CmId,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.id.destroy_qp();
    }
}

pub(crate) fn build_endpoint(
    mut id: CmId,
    depth: u32,
    slot: usize,
) -> Result<Endpoint, VerbsError> {
    let send_slots = depth + EXTRA_SEND_SLOTS;
    let pd = id.alloc_pd()?;
    let comp = id.create_comp_channel()?;
    let cq = comp.create_cq(send_slots + depth)?;
    id.create_qp(
        &pd,
        &cq,
        QpCaps {
            max_send_wr: send_slots,
            max_recv_wr: depth,
            max_inline_data: 0,
        },
    )?;
    let send_mr = pd.register(send_slots as usize * slot)?;
    let recv_mr = pd.register(depth as usize * slot)?;
    for i in 0..depth as usize {
        id.post_recv(&recv_mr, i * slot, slot, RECV_BASE + i as u64)?;
    }
    cq.req_notify()?;
    Ok(Endpoint {
        cq,
        comp,
        send_mr,
        recv_mr,
        pd,
        id,
    })
}

/// Our own quiesce in progress on a live link.
#[derive(Debug, Default)]
struct Pause {
    sent: bool,
    got_ack: bool,
    /// The PAUSE asks the peer to carry on over the bridge.
    bridge: bool,
}

struct Link {
    /// The completion channel as the runtime watches it. First, so it is dropped (and the
    /// watch ended) before the QP; it holds the channel open until then either way.
    comp: AsyncFd<CompletionChannel>,
    ep: Endpoint,
    /// This side's exposed buffers as registered on this QP (dropped after the QP).
    exposed: Vec<(u64, ExposedRegion)>,
    /// REGIONS records not yet sent on this QP.
    announce: Vec<RegionEntry>,
    /// The peer's buffers as registered on its side of this QP.
    remote_keys: HashMap<u64, RegionEntry>,
    /// Highest one-sided operation id posted on this QP.
    ops_posted_upto: u64,
    /// One-sided operations on this QP awaiting completion, in posting order: (slot, id).
    inflight: VecDeque<(u32, u64)>,
    credits: Credits,
    /// The CQ is armed: its next completion raises an event on the channel. An event
    /// disarms it; it is armed again only after one was read (an event not yet read keeps
    /// the channel's readiness, which wakes the worker either way).
    cq_armed: bool,
    starved: StarvedProbe,
    slots: SendSlots,
    /// SENDs written into their slots, to be posted as one chain by [`Link::flush`].
    staged: Vec<SendWr>,
    /// Highest DATA sequence number posted on this QP.
    posted_upto: u64,
    last_ack_sent: u64,
    pause: Option<Pause>,
    /// When the peer's PAUSE arrived.
    peer_paused: Option<Instant>,
    /// The peer's PAUSE asked to carry on over the bridge.
    peer_bridging: bool,
    owe_pause_ack: bool,
    pause_ack_sent: bool,
    close_sent: bool,
    disconnecting: Option<Instant>,
    slot: usize,
    /// Receives not posted again because the application's inbox is full: (slot offset,
    /// work request id). Withholding them withholds the peer's credits, which is the
    /// backpressure that keeps a fast sender from growing a slow reader's memory.
    withheld: Vec<(usize, u64)>,
    /// How many messages the inbox may hold before receives are withheld.
    inbox_limit: usize,
}

impl Link {
    fn can_post_control(&self) -> bool {
        self.free_slots() > 0 && self.credits.can_send_control() && self.disconnecting.is_none()
    }

    /// WRITE and READ leave [`RESERVE`] send slots for control messages.
    fn can_post_onesided(&self) -> bool {
        self.free_slots() > RESERVE as usize
            && self.pause.is_none()
            && self.peer_paused.is_none()
            && !self.close_sent
            && self.disconnecting.is_none()
    }

    /// Posts one WRITE or READ of `op` through a send slot.
    fn post_onesided(&mut self, op: &crate::onesided::Op, key: &RegionEntry) -> Result<(), String> {
        let slot = self.slots.take().ok_or("no free send slot")?;
        let off = slot as usize * self.slot;
        let rdma = match &op.kind {
            OpKind::Write(data) => {
                let buf = self
                    .ep
                    .send_mr
                    .write(off, data.len())
                    .ok_or("write larger than a send slot")?;
                buf.copy_from_slice(data);
                RdmaOp::Write
            }
            OpKind::Read(..) => RdmaOp::Read,
        };
        if let Err(e) = self.ep.id.post_rdma(
            rdma,
            &self.ep.send_mr,
            off,
            op.len(),
            key.addr + op.offset,
            key.rkey,
            ONESIDED_BASE + slot as u64,
        ) {
            return Err(format!("posting an RDMA {rdma:?}: {}", error_chain(&e)));
        }
        // Posted alone and signaled: its completion tells which operation is done.
        self.slots.posted(slot, true);
        self.inflight.push_back((slot, op.id));
        Ok(())
    }

    /// Posts a zero-length RDMA WRITE through a send slot ([`StarvedProbe`]): it carries
    /// nothing and takes no receive at the peer (C9-88: no address or rkey is checked), but
    /// must be acknowledged by the peer's QP.
    fn post_probe(&mut self) -> Result<(), String> {
        let slot = self.slots.take().ok_or("no free send slot")?;
        let off = slot as usize * self.slot;
        if let Err(e) =
            self.ep
                .id
                .post_rdma(RdmaOp::Write, &self.ep.send_mr, off, 0, 0, 0, slot as u64)
        {
            return Err(format!("posting a probe: {}", error_chain(&e)));
        }
        // Posted alone and signaled, like a control message.
        self.slots.posted(slot, true);
        Ok(())
    }

    /// Registers the exposures not yet registered on this QP and queues their records.
    fn register_exposures(&mut self, st: &State) -> Result<(), String> {
        // Exposures are never withdrawn: equal counts mean all are registered.
        if self.exposed.len() == st.onesided.exposed.len() {
            return Ok(());
        }
        for (handle, (mem, access)) in &st.onesided.exposed {
            if self.exposed.iter().any(|(h, _)| h == handle) {
                continue;
            }
            let region = self
                .ep
                .pd
                .register_exposed(mem, remote_access(*access))
                .map_err(|e| format!("registering exposed buffer {handle}: {}", error_chain(&e)))?;
            self.announce.push(RegionEntry {
                handle: *handle,
                addr: region.addr(),
                len: region.len() as u64,
                rkey: region.rkey(),
                access: *access,
            });
            self.exposed.push((*handle, region));
        }
        Ok(())
    }

    /// Send slots neither in flight nor staged.
    fn free_slots(&self) -> usize {
        self.slots.free()
    }

    fn can_post_data(&self) -> bool {
        self.free_slots() > 0
            && self.credits.can_send_data()
            && self.pause.is_none()
            && self.peer_paused.is_none()
            && !self.close_sent
            && self.disconnecting.is_none()
    }

    /// Posts one message at once (control messages: each ends its own chain, so it is
    /// signaled). A failed post leaves the link unusable: the caller gives it up.
    fn post(
        &mut self,
        kind: Kind,
        flags: u8,
        seq: u64,
        payload: &[u8],
        last_received: u64,
    ) -> Result<(), String> {
        self.stage(kind, flags, seq, payload, last_received)?;
        self.flush()
    }

    /// Writes a message into a free send slot and stages its SEND for [`Link::flush`].
    fn stage(
        &mut self,
        kind: Kind,
        flags: u8,
        seq: u64,
        payload: &[u8],
        last_received: u64,
    ) -> Result<(), String> {
        let slot = self.slots.take().ok_or("no free send slot")?;
        let off = slot as usize * self.slot;
        let len = HEADER_LEN + payload.len();
        let header = Header {
            kind,
            flags,
            len: payload.len() as u32,
            seq,
            ack: last_received,
            credits: self.credits.on_sent(),
        };
        let buf = self
            .ep
            .send_mr
            .write(off, len)
            .ok_or("message larger than a send slot")?;
        header.encode(buf);
        buf[HEADER_LEN..].copy_from_slice(payload);
        self.staged.push(SendWr {
            offset: off,
            len,
            wr_id: slot as u64,
            signaled: false,
        });
        self.last_ack_sent = last_received;
        Ok(())
    }

    /// Posts the staged SENDs as one chain (one doorbell), signaled as [`SendSlots`]
    /// decides. A failed post leaves the link unusable: the caller gives it up.
    fn flush(&mut self) -> Result<(), String> {
        let n = self.staged.len();
        for (i, wr) in self.staged.iter_mut().enumerate() {
            wr.signaled = self.slots.posted(wr.wr_id as u32, i + 1 == n);
        }
        let result = self.ep.id.post_sends(&self.ep.send_mr, &self.staged);
        self.staged.clear();
        result.map_err(|(posted, e)| {
            format!(
                "posting {n} sends failed after {posted}: {}",
                error_chain(&e)
            )
        })
    }
}

enum Down {
    /// Link up.
    None,
    /// Quiesced by the agent: holds no device; does not reconnect before a resume (or
    /// until `hold_until`, the forced path).
    Quiesced { hold_until: Instant },
    /// Waiting for the peer (active: reconnecting) until `until`.
    Awaiting { until: Instant },
}

struct Worker {
    sh: Arc<ConnShared>,
    rx: mpsc::Receiver<Command>,
    // Field order matters for Drop: the link (QP, CQ, MRs, PD, id) before the channel.
    link: Option<Link>,
    chan: AsyncFd<EventChannel>,
    /// CM events read from `chan` but not yet handled (read ahead by [`Worker::wait_for`]).
    cm_queue: VecDeque<CmEvent>,
    bridge: Option<AsyncFd<Bridge>>,
    /// Drives the coarse deadlines while nothing else wakes the worker.
    tick: Interval,
    /// This side sends its messages over the bridge (from its quiesce with `bridge`, or the
    /// peer's PAUSE asking for it, until a new RDMA link is installed).
    bridging: bool,
    /// When the active side may try to open a lost bridge again.
    next_bridge_attempt: Instant,
    down: Down,
    peer: Option<SocketAddr>,
    quiesce_op: Option<(Instant, Reply)>,
    resume_op: Option<(Instant, Reply)>,
    close_op: Option<(Instant, Reply)>,
    next_attempt: Instant,
    last_refresh: Instant,
    last_error: String,
    /// The link event that started the current wait for the peer.
    last_link: Option<LinkEvent>,
    slot: usize,
    wcs: Vec<WorkCompletion>,
    done: bool,
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

/// Why a connect attempt failed.
struct AttemptError {
    /// The peer refused for good (retrying cannot help).
    refused: Option<RejectReason>,
    msg: String,
}

fn transient(msg: impl Into<String>) -> AttemptError {
    AttemptError {
        refused: None,
        msg: msg.into(),
    }
}

impl From<VerbsError> for AttemptError {
    fn from(e: VerbsError) -> Self {
        transient(error_chain(&e))
    }
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
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let slot = HEADER_LEN + sh.opts.max_message;
        Ok(Worker {
            sh,
            rx,
            link: None,
            chan,
            cm_queue: VecDeque::new(),
            bridge: None,
            tick,
            bridging: false,
            next_bridge_attempt: Instant::now(),
            down: Down::Awaiting {
                until: Instant::now(),
            },
            peer: None,
            quiesce_op: None,
            resume_op: None,
            close_op: None,
            next_attempt: Instant::now(),
            last_refresh: Instant::now(),
            last_error: String::new(),
            last_link: None,
            slot,
            wcs: Vec::with_capacity(64),
            done: false,
        })
    }

    fn depth(&self) -> u32 {
        self.sh.opts.recv_depth.max(2 * RESERVE as u32)
    }

    fn set_state(&self, s: ConnectionState) {
        let mut st = self.sh.lock();
        if st.conn_state != ConnectionState::Failed && st.conn_state != ConnectionState::Closed {
            st.conn_state = s;
        }
        drop(st);
        self.sh.changed();
    }

    async fn start(&mut self, start: Start) {
        match start {
            Start::Active { peer, ready } => {
                self.peer = Some(peer);
                let deadline = Instant::now() + self.sh.opts.connect_timeout;
                loop {
                    match self.attempt(false).await {
                        Ok(()) => {
                            if let Err(err) = self.open_bridge().await {
                                let _ = ready.send(Err(err));
                                self.fail(Failure::Setup("opening the bridge".into()));
                                return;
                            }
                            if ready.send(Ok(())).is_err() {
                                // The caller gave up (its connect was cancelled): nobody
                                // holds the connection, so it closes as a dropped one does.
                                self.abandoned();
                            }
                            return;
                        }
                        Err(e) if e.refused.is_some() || Instant::now() >= deadline => {
                            let err = if let Some(reason) = e.refused {
                                ConnError::Rejected { peer, reason }
                            } else {
                                ConnError::ConnectTimedOut {
                                    peer,
                                    after: self.sh.opts.connect_timeout,
                                    last: e.msg.clone(),
                                }
                            };
                            let _ = ready.send(Err(err));
                            self.fail(Failure::Setup(format!("connect: {}", e.msg)));
                            return;
                        }
                        Err(e) => {
                            self.last_error = e.msg;
                            tokio::time::sleep(self.sh.opts.reconnect_interval).await;
                        }
                    }
                }
            }
            Start::Passive {
                id,
                hello,
                on_ready,
            } => match self.accept_on(id, &hello).await {
                Ok(()) => on_ready(self.sh.clone()),
                Err(e) => self.fail(Failure::Setup(format!("accept: {}", e.msg))),
            },
        }
    }

    /// Closes a connection no application holds, as dropping its handle would.
    fn abandoned(&mut self) {
        self.sh.lock().closed_by_app = true;
        let (reply, _) = oneshot::channel();
        self.close_op = Some((Instant::now() + Duration::from_secs(1), reply));
    }

    async fn run(mut self, start: Start) {
        self.start(start).await;
        while !self.done {
            // Everything that needs prompt action wakes the worker (the application's
            // Notify, the CM channel, the completion channel, the bridge); the tick only
            // drives the coarse deadlines (100 ms granularity, all of them at least 500 ms
            // long). Only channels found readable are read: on a TCG guest each read that
            // would find nothing (EAGAIN) is a system call the round does not need.
            let ready = self.wait().await;
            self.handle_commands().await;
            if self.done {
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
            _ = self.tick.tick() => {}
        }
        ready
    }

    // ---- commands ----

    async fn handle_commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Command::Quiesce {
                    deadline,
                    bridge,
                    reply,
                } => self.on_quiesce(deadline, bridge, reply),
                Command::Bridge { stream, hello } => self.on_bridge(stream, hello),
                Command::Resume { deadline, reply } => self.on_resume(deadline, reply),
                Command::Incoming { id, hello } => self.on_incoming(id, hello).await,
                Command::Close { deadline, reply } => {
                    if self.link.is_none() {
                        let _ = reply.send(Ok(()));
                        self.finish_closed();
                        return;
                    }
                    self.close_op = Some((deadline, reply));
                }
            }
        }
    }

    fn on_quiesce(&mut self, deadline: Instant, bridge: bool, reply: Reply) {
        if let Some((_, r)) = self.resume_op.take() {
            let _ = r.send(Err("a quiesce arrived before the resume completed".into()));
        }
        if bridge {
            self.start_bridging();
        }
        let bridging = self.bridging;
        match &mut self.link {
            Some(link) => {
                if link.pause.is_none() {
                    link.pause = Some(Pause {
                        bridge: bridging,
                        ..Pause::default()
                    });
                }
                self.quiesce_op = Some((deadline, reply));
                self.set_state(ConnectionState::Pausing);
            }
            None => {
                self.down = Down::Quiesced {
                    hold_until: Instant::now() + self.sh.opts.peer_wait,
                };
                self.set_state(ConnectionState::Quiesced);
                let _ = reply.send(Ok(()));
            }
        }
    }

    fn on_resume(&mut self, deadline: Instant, reply: Reply) {
        if let Some(link) = &self.link {
            if link.pause.is_some() {
                let _ = reply.send(Err("cannot resume while a quiesce is in progress".into()));
            } else {
                let _ = reply.send(Ok(()));
            }
            return;
        }
        let now = Instant::now();
        self.down = Down::Awaiting {
            until: now + self.sh.opts.peer_wait,
        };
        self.next_attempt = now;
        self.set_state(ConnectionState::Resuming);
        if let Some((_, r)) = self.resume_op.replace((deadline, reply)) {
            let _ = r.send(Err("superseded by a newer resume".into()));
        }
    }

    async fn on_incoming(&mut self, id: CmId, hello: Hello) {
        let reject = |id: &CmId, reason| {
            let pd = PrivateData::Reject(Reject {
                conn_id: hello.conn_id,
                reason,
            });
            let _ = id.reject(&pd.encode());
        };
        if matches!(self.down, Down::Quiesced { .. }) {
            // Quiesced here: reconnecting now would reopen the device that is going away.
            reject(&id, RejectReason::Busy);
            return;
        }
        if self.link.is_some() {
            self.link_lost(
                LinkEvent::Protocol("the peer reconnected while the link looked up".into()),
                false,
            );
        }
        match self.accept_on(id, &hello).await {
            Ok(()) => {}
            Err(e) => {
                tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %e.msg, "resume accept failed");
                self.last_error = e.msg;
            }
        }
    }

    // ---- connect / accept ----

    /// The next CM event for `id`, waiting up to `timeout`. Events for other ids stay queued
    /// for the main loop (which ignores those of ids already released). While bridging,
    /// the bridge carries the traffic meanwhile.
    async fn wait_for(&mut self, id: IdKey, timeout: Duration) -> Result<CmEvent, AttemptError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(at) = self.cm_queue.iter().position(|ev| ev.id == id) {
                return Ok(self.cm_queue.remove(at).expect("found"));
            }
            let bridging = self.bridging && self.bridge.is_some();
            if bridging {
                self.serve_bridge();
            }
            let bridge = self.bridge.as_ref().filter(|_| bridging);
            tokio::select! {
                taken = self.chan.readable() => {
                    if clear(taken) {
                        self.read_cm_events()?;
                    }
                }
                // The application queued something for the bridge.
                () = self.sh.wake.notified(), if bridging => {}
                taken = bridge_ready(bridge) => {
                    clear(taken);
                }
                () = tokio::time::sleep_until(deadline) => {
                    return Err(transient(format!("no CM event within {timeout:?}")));
                }
            }
        }
    }

    /// Drops the queued events before a new id is made: with no link, they are all of ids
    /// already released, and a new id may reuse a released one's address (its key).
    fn forget_released_ids(&mut self) {
        debug_assert!(self.link.is_none());
        self.cm_queue.clear();
    }

    /// Reads every pending CM event into the queue (until EAGAIN).
    fn read_cm_events(&mut self) -> Result<(), VerbsError> {
        while let Some(ev) = self.chan.get_ref().get_event(Duration::ZERO)? {
            self.cm_queue.push_back(ev);
        }
        Ok(())
    }

    async fn attempt(&mut self, resume: bool) -> Result<(), AttemptError> {
        let peer = self.peer.ok_or_else(|| transient("no peer address"))?;
        self.forget_released_ids();
        let id = CmId::create(self.chan.get_ref())?;
        id.set_ack_timeout(self.sh.opts.ack_timeout)?;
        id.resolve_addr(peer, RESOLVE_TIMEOUT)?;
        let ev = self
            .wait_for(id.key(), RESOLVE_TIMEOUT + Duration::from_millis(500))
            .await?;
        if ev.kind != CmEventKind::AddrResolved {
            return Err(transient(format!(
                "address resolution: {:?} ({})",
                ev.kind, ev.status
            )));
        }
        id.resolve_route(RESOLVE_TIMEOUT)?;
        let ev = self
            .wait_for(id.key(), RESOLVE_TIMEOUT + Duration::from_millis(500))
            .await?;
        if ev.kind != CmEventKind::RouteResolved {
            return Err(transient(format!(
                "route resolution: {:?} ({})",
                ev.kind, ev.status
            )));
        }
        let ep = build_endpoint(id, self.depth(), self.slot)?;
        let last_received = self.sh.lock().last_received;
        let hello = Hello {
            conn_id: self.sh.id,
            token: self.sh.token,
            last_received,
            credits: self.depth() as u16,
        };
        let pd = if resume {
            PrivateData::Resume(hello)
        } else {
            PrivateData::Hello(hello)
        };
        ep.id.connect(
            &pd.encode(),
            self.sh.opts.retry_count,
            self.sh.opts.rnr_retry,
        )?;
        let ev = self.wait_for(ep.id.key(), ESTABLISH_TIMEOUT).await?;
        match ev.kind {
            CmEventKind::Established => match PrivateData::decode(&ev.private_data) {
                Ok(PrivateData::Accept(a)) if a.conn_id == self.sh.id => {
                    self.install(ep, a.credits as u64, a.last_received)
                }
                other => Err(AttemptError {
                    refused: Some(RejectReason::Other),
                    msg: format!("the peer accepted with an unexpected reply: {other:?}"),
                }),
            },
            CmEventKind::Rejected => match PrivateData::decode(&ev.private_data) {
                Ok(PrivateData::Reject(r)) => Err(AttemptError {
                    refused: matches!(
                        r.reason,
                        RejectReason::UnknownConnection
                            | RejectReason::BadToken
                            | RejectReason::Gone
                    )
                    .then_some(r.reason),
                    msg: format!("rejected by the peer: {:?}", r.reason),
                }),
                _ => Err(transient(format!(
                    "rejected (no listener at {peer}?), status {}",
                    ev.status
                ))),
            },
            other => Err(transient(format!("connect: {other:?} ({})", ev.status))),
        }
    }

    async fn accept_on(&mut self, mut id: CmId, hello: &Hello) -> Result<(), AttemptError> {
        self.forget_released_ids();
        id.migrate(self.chan.get_ref())?;
        id.set_ack_timeout(self.sh.opts.ack_timeout)?;
        let ep = build_endpoint(id, self.depth(), self.slot)?;
        let last_received = self.sh.lock().last_received;
        let reply = PrivateData::Accept(Accept {
            conn_id: self.sh.id,
            last_received,
            credits: self.depth() as u16,
        });
        ep.id.accept(
            &reply.encode(),
            self.sh.opts.retry_count,
            self.sh.opts.rnr_retry,
        )?;
        let ev = self.wait_for(ep.id.key(), ESTABLISH_TIMEOUT).await?;
        if ev.kind != CmEventKind::Established {
            return Err(transient(format!("accept: {:?} ({})", ev.kind, ev.status)));
        }
        self.install(ep, hello.credits as u64, hello.last_received)
    }

    fn install(
        &mut self,
        ep: Endpoint,
        peer_credits: u64,
        peer_last: u64,
    ) -> Result<(), AttemptError> {
        let comp = watch(ep.comp.clone())
            .map_err(|e| transient(format!("watching the completion channel: {e}")))?;
        let local = ep
            .id
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let peer = ep.id.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let send_slots = self.depth() + EXTRA_SEND_SLOTS;
        let mut st = self.sh.lock();
        while st.outbox.front().is_some_and(|(seq, _)| *seq <= peer_last) {
            st.outbox.pop_front();
        }
        self.link = Some(Link {
            comp,
            ep,
            exposed: Vec::new(),
            announce: Vec::new(),
            remote_keys: HashMap::new(),
            ops_posted_upto: st.onesided.ops.restart_point(),
            inflight: VecDeque::new(),
            credits: Credits::new(peer_credits, self.depth() as u64, RESERVE),
            // build_endpoint armed it.
            cq_armed: true,
            starved: StarvedProbe::new(STARVED_PROBE),
            slots: SendSlots::new(send_slots, SIGNAL_EVERY),
            staged: Vec::with_capacity(send_slots as usize),
            posted_upto: peer_last,
            last_ack_sent: st.last_received,
            pause: None,
            peer_paused: None,
            peer_bridging: false,
            owe_pause_ack: false,
            pause_ack_sent: false,
            close_sent: false,
            disconnecting: None,
            slot: self.slot,
            withheld: Vec::new(),
            inbox_limit: self.sh.inbox_limit(),
        });
        st.conn_state = ConnectionState::Established;
        st.stats.established += 1;
        st.local = local;
        st.peer = peer;
        drop(st);
        self.sh.changed();
        // Back on RDMA: the bridge stops carrying (what it had in flight arrives as
        // duplicates or in order; see the bridge module).
        self.bridging = false;
        self.down = Down::None;
        self.last_error.clear();
        self.last_link = None;
        if let Some((_, r)) = self.resume_op.take() {
            let _ = r.send(Ok(()));
        }
        tracing::debug!(
            conn = format_args!("{:016x}", self.sh.id),
            peer_last,
            "link established"
        );
        Ok(())
    }

    // ---- link up ----

    /// Handles the queued CM events, after reading the channel dry if `read` (its readiness
    /// was taken).
    fn handle_cm_events(&mut self, read: bool) {
        if read {
            if let Err(e) = self.read_cm_events() {
                tracing::warn!(error = %e, "reading CM events failed");
            }
        }
        while let Some(ev) = self.cm_queue.pop_front() {
            let Some(link) = &self.link else { continue };
            if ev.id != link.ep.id.key() {
                continue;
            }
            match ev.kind {
                CmEventKind::Disconnected => {
                    let expected = link.pause.is_some()
                        || link.peer_paused.is_some()
                        || link.close_sent
                        || link.disconnecting.is_some()
                        || self.sh.lock().peer_closed;
                    self.link_lost(LinkEvent::PeerDisconnected, expected);
                }
                CmEventKind::DeviceRemoval => {
                    self.link_lost(LinkEvent::DeviceRemoved, false);
                }
                _ => {}
            }
        }
    }

    /// Polls the CQ dry and arms it again; reads its channel's events first (until EAGAIN)
    /// if `events` (its readiness was taken). Returns whether it woke the application.
    fn handle_completions(&mut self, events: bool) -> bool {
        let Some(link) = &mut self.link else {
            return false;
        };
        if events {
            match link.ep.cq.ack_events() {
                // The event disarmed the CQ.
                Ok(n) if n > 0 => link.cq_armed = false,
                Ok(_) => {}
                Err(e) => {
                    // Arming again is harmless; missing a disarm would not be.
                    link.cq_armed = false;
                    tracing::warn!(error = %e, "reading CQ events failed");
                }
            }
        }
        let mut failure: Option<LinkEvent> = None;
        let mut woke = false;
        loop {
            self.wcs.clear();
            let Some(link) = &mut self.link else {
                return woke;
            };
            match link.ep.cq.poll(&mut self.wcs, 64) {
                // Still armed from an earlier round (no event read since): the next
                // completion wakes the worker, no need to arm it again.
                Ok(0) if link.cq_armed => break,
                Ok(0) => {
                    if let Err(e) = link.ep.cq.req_notify() {
                        failure = Some(LinkEvent::Local(error_chain(&e)));
                        break;
                    }
                    link.cq_armed = true;
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    failure = Some(LinkEvent::Local(error_chain(&e)));
                    break;
                }
            }
            let wcs = std::mem::take(&mut self.wcs);
            let mut st = self.sh.lock();
            let mut delivered = false;
            for wc in &wcs {
                if let Err(e) = process(link, &mut st, wc, &mut delivered) {
                    failure.get_or_insert(e);
                }
            }
            drop(st);
            if delivered {
                self.sh.changed();
                woke = true;
            }
            self.wcs = wcs;
            if failure.is_some() {
                break;
            }
        }
        if let Some(f) = failure {
            let expected = self
                .link
                .as_ref()
                .is_some_and(|l| l.disconnecting.is_some() || l.peer_paused.is_some())
                || self.sh.lock().peer_closed;
            self.link_lost(f, expected);
        }
        woke
    }

    /// Pause, PAUSE_ACK, close and disconnect progress.
    fn progress(&mut self) {
        let now = Instant::now();
        let Some(link) = &mut self.link else { return };
        let last_received = self.sh.lock().last_received;
        let mut failure: Option<LinkEvent> = None;
        if link.owe_pause_ack && link.can_post_control() {
            match link.post(Kind::PauseAck, 0, 0, &[], last_received) {
                Ok(()) => {
                    link.owe_pause_ack = false;
                    link.pause_ack_sent = true;
                }
                Err(e) => failure = Some(LinkEvent::Local(e)),
            }
        }
        if let Some(p) = &mut link.pause {
            if !p.sent
                && link.slots.in_flight() == 0
                && link.credits.can_send_control()
                && link.slots.free() > 0
            {
                p.sent = true;
                let flags = if p.bridge {
                    FLAG_MOVING | FLAG_BRIDGE
                } else {
                    FLAG_MOVING
                };
                if let Err(e) = link.post(Kind::Pause, flags, 0, &[], last_received) {
                    failure = Some(LinkEvent::Local(e));
                }
            }
        }
        if let Some((deadline, _)) = &self.close_op {
            let drained = {
                let st = self.sh.lock();
                st.outbox.is_empty() && st.onesided.ops.is_empty()
            };
            let late = now + Duration::from_millis(500) >= *deadline;
            if !link.close_sent && (drained || late) && link.can_post_control() {
                link.close_sent = true;
                if let Err(e) = link.post(Kind::Close, 0, 0, &[], last_received) {
                    failure = Some(LinkEvent::Local(e));
                }
            }
        }
        let want_disconnect = link.pause.as_ref().is_some_and(|p| p.got_ack)
            || (link.close_sent && link.slots.in_flight() == 0);
        if want_disconnect && link.disconnecting.is_none() {
            link.disconnecting = Some(now);
            if let Err(e) = link.ep.id.disconnect() {
                failure = Some(LinkEvent::Local(error_chain(&e)));
            }
        }
        if link
            .disconnecting
            .is_some_and(|t| now.duration_since(t) > DISCONNECT_WAIT)
        {
            failure = Some(LinkEvent::Deadline {
                deadline: "disconnect (1 s)",
                what: "the DISCONNECTED event",
            });
        }
        if link
            .peer_paused
            .is_some_and(|t| now.duration_since(t) > self.sh.opts.peer_wait)
        {
            failure = Some(LinkEvent::Deadline {
                deadline: "peer_wait",
                what: "the paused peer to disconnect",
            });
        }
        if let Some(f) = failure {
            let expected = link.disconnecting.is_some();
            self.link_lost(f, expected);
        }
    }

    /// Announces exposed buffers, posts WRITEs and READs, then DATA while credits allow,
    /// then a standalone ACK if one is owed, then a probe if starved ([`StarvedProbe`]).
    ///
    /// One-sided operations go out before DATA queued with them, so a message sent after a
    /// write is never posted before it (and RC executes in posting order at the peer).
    fn pump(&mut self) {
        let Some(link) = &mut self.link else { return };
        let mut st = self.sh.lock();
        let mut failure = repost_withheld(link, &st).err();
        let leaving = link.pause.as_ref().is_some_and(|p| p.sent) || link.close_sent;
        if let Err(e) = link.register_exposures(&st) {
            failure.get_or_insert(LinkEvent::Local(e));
        }
        let per_message = (self.sh.opts.max_message / REGION_ENTRY_LEN).max(1);
        while failure.is_none() && !link.announce.is_empty() && !leaving && link.can_post_control()
        {
            let n = link.announce.len().min(per_message);
            let mut payload = Vec::with_capacity(n * REGION_ENTRY_LEN);
            for e in &link.announce[..n] {
                e.encode(&mut payload);
            }
            match link.post(Kind::Regions, 0, 0, &payload, st.last_received) {
                Ok(()) => {
                    link.announce.drain(..n);
                }
                Err(e) => failure = Some(LinkEvent::Local(e)),
            }
        }
        while failure.is_none() && link.can_post_onesided() {
            let Some(op) = st.onesided.ops.next_to_post(link.ops_posted_upto) else {
                break;
            };
            // The peer's records for this QP come first thing on it; until then, wait.
            let Some(key) = link.remote_keys.get(&op.handle).copied() else {
                break;
            };
            if crate::onesided::check_range(op.handle, key.len, op.offset, op.len()).is_err() {
                failure = Some(LinkEvent::Protocol(format!(
                    "the peer's buffer {} shrank below an operation at {}+{}",
                    op.handle,
                    op.offset,
                    op.len()
                )));
                break;
            }
            let id = op.id;
            if let Err(e) = link.post_onesided(op, &key) {
                failure = Some(LinkEvent::Local(e));
                break;
            }
            link.ops_posted_upto = id;
            if st.onesided.ops.on_posted(id) {
                st.stats.onesided_replayed += 1;
            }
        }
        // DATA goes out as one chain: one doorbell for every message this round.
        let mut staged_upto = link.posted_upto;
        while failure.is_none() && link.can_post_data() {
            let Some((seq, data)) = next_unsent(&st.outbox, staged_upto) else {
                break;
            };
            let (seq, last_received) = (*seq, st.last_received);
            if let Err(e) = link.stage(Kind::Data, 0, seq, data, last_received) {
                failure = Some(LinkEvent::Local(e));
                break;
            }
            staged_upto = seq;
        }
        if failure.is_none() && staged_upto > link.posted_upto {
            match link.flush() {
                Ok(()) => {
                    let first = (link.posted_upto + 1).max(st.outbox.front().map_or(0, |m| m.0));
                    st.stats.replayed += replays(first, staged_upto, st.max_posted);
                    st.max_posted = st.max_posted.max(staged_upto);
                    link.posted_upto = staged_upto;
                }
                Err(e) => failure = Some(LinkEvent::Local(e)),
            }
        }
        let data_waits = next_unsent(&st.outbox, link.posted_upto).is_some();
        let last_received = st.last_received;
        drop(st);
        let quiet =
            link.pause.as_ref().is_some_and(|p| p.sent) || link.pause_ack_sent || link.close_sent;
        let owed = last_received > link.last_ack_sent
            || link.credits.lag() >= (self.sh.opts.recv_depth as u64 / 4).max(1);
        if failure.is_none() && owed && !quiet && link.can_post_control() {
            if let Err(e) = link.post(Kind::Ack, 0, 0, &[], last_received) {
                failure = Some(LinkEvent::Local(e));
            }
        }
        // Out of credits with nothing in flight, a vanished peer would go unnoticed: probe.
        let starved = data_waits
            && !link.credits.can_send_data()
            && link.slots.in_flight() == 0
            && !quiet
            && link.pause.is_none()
            && link.peer_paused.is_none()
            && link.disconnecting.is_none();
        if failure.is_none() && link.starved.due(starved, Instant::now()) && link.free_slots() > 0 {
            if let Err(e) = link.post_probe() {
                failure = Some(LinkEvent::Local(e));
            }
        }
        if let Some(f) = failure {
            self.link_lost(f, false);
        }
    }

    /// The link is gone (or being given up): release every verbs object at once, then decide
    /// what the connection does next.
    fn link_lost(&mut self, why: LinkEvent, expected: bool) {
        let Some(link) = self.link.take() else { return };
        let peer_paused = link.peer_paused.is_some();
        if link.peer_bridging {
            self.start_bridging();
        }
        drop(link); // QP, CQ, comp channel, MRs, PD, cm id.
        let _ = refresh_device_list();
        self.last_refresh = Instant::now();
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), %why, expected, "link released");
        if !expected {
            self.sh.lock().stats.link_events.push(why.to_string());
        }
        let now = Instant::now();
        if let Some((_, reply)) = self.close_op.take() {
            let _ = reply.send(Ok(()));
            self.finish_closed();
            return;
        }
        if self.sh.lock().peer_closed {
            self.finish_closed();
            return;
        }
        if let Some((_, reply)) = self.quiesce_op.take() {
            let _ = reply.send(if expected {
                Ok(())
            } else {
                Err(format!(
                    "the link broke during the quiesce ({why}); resources released"
                ))
            });
            self.down = Down::Quiesced {
                hold_until: now + self.sh.opts.peer_wait,
            };
            self.set_state(ConnectionState::Quiesced);
            return;
        }
        self.down = Down::Awaiting {
            until: now + self.sh.opts.peer_wait,
        };
        // Give a moving peer a moment before the first reconnect attempt.
        self.next_attempt = if peer_paused {
            now + self.sh.opts.reconnect_interval
        } else {
            now
        };
        self.last_error.clear();
        self.last_link = Some(why);
        self.set_state(ConnectionState::AwaitingPeer);
    }

    // ---- bridge ----

    /// The active side opens the bridge (if one is configured) right after its first link.
    async fn open_bridge(&mut self) -> Result<(), ConnError> {
        let Some(addr) = self.sh.opts.bridge else {
            return Ok(());
        };
        let hello = Hello {
            conn_id: self.sh.id,
            token: self.sh.token,
            last_received: self.sh.lock().last_received,
            credits: 0,
        };
        let (bridge, peer_last) = Bridge::open(addr, hello, self.sh.opts.max_message)
            .await
            .map_err(|reason| ConnError::Bridge { addr, reason })?;
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), %addr, "bridge open");
        self.install_bridge(bridge, peer_last)
            .map_err(|reason| ConnError::Bridge { addr, reason })
    }

    /// The active side opens a lost bridge again, at most every [`BRIDGE_RETRY`].
    async fn reopen_bridge(&mut self) {
        let now = Instant::now();
        if self.bridge.is_some()
            || self.sh.role != Role::Active
            || self.sh.opts.bridge.is_none()
            || now < self.next_bridge_attempt
        {
            return;
        }
        self.next_bridge_attempt = now + BRIDGE_RETRY;
        if let Err(e) = self.open_bridge().await {
            tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %e, "bridge not reopened");
        }
    }

    /// The passive side: a bridge stream named this connection (the listener checked the
    /// token).
    fn on_bridge(&mut self, stream: std::net::TcpStream, hello: Hello) {
        if self.sh.role != Role::Passive {
            let reason = RejectReason::Other;
            Bridge::refuse(
                stream,
                Reject {
                    conn_id: hello.conn_id,
                    reason,
                },
            );
            return;
        }
        let accept = Accept {
            conn_id: self.sh.id,
            last_received: self.sh.lock().last_received,
            credits: 0,
        };
        let answered = Bridge::answer(stream, accept, self.sh.opts.max_message)
            .and_then(|bridge| self.install_bridge(bridge, hello.last_received));
        match answered {
            Ok(()) => {}
            Err(e) => {
                tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %e, "bridge not accepted")
            }
        }
    }

    /// Carries on with `bridge`, watched by the runtime from now on.
    fn install_bridge(&mut self, bridge: Bridge, peer_last: u64) -> Result<(), String> {
        let mut bridge = watch(bridge).map_err(|e| format!("watching the bridge socket: {e}"))?;
        let mut st = self.sh.lock();
        while st.outbox.front().is_some_and(|(seq, _)| *seq <= peer_last) {
            st.outbox.pop_front();
        }
        bridge.get_mut().sent_upto = resend_point(&st);
        st.bridge_up = true;
        drop(st);
        self.sh.changed();
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), peer = %bridge.get_ref().peer(), "bridge up");
        self.bridge = Some(bridge);
        Ok(())
    }

    /// This side carries its messages over the bridge from now on, starting at its oldest
    /// unacknowledged one (no-op without a bridge, or when already bridging).
    fn start_bridging(&mut self) {
        let Some(bridge) = self.bridge.as_mut().map(AsyncFd::get_mut) else {
            return;
        };
        if self.bridging {
            return;
        }
        bridge.sent_upto = resend_point(&self.sh.lock());
        self.bridging = true;
        tracing::debug!(
            conn = format_args!("{:016x}", self.sh.id),
            from = bridge.sent_upto + 1,
            "bridging"
        );
    }

    /// Takes what arrived on the bridge, queues this side's messages on it while bridging
    /// and an ACK when one is owed, and writes what the socket takes.
    fn serve_bridge(&mut self) {
        let Some(bridge) = self.bridge.as_mut().map(AsyncFd::get_mut) else {
            return;
        };
        let mut st = self.sh.lock();
        let mut delivered = false;
        let mut got_data = false;
        // An application that is behind leaves the bridge unread: TCP's own flow control
        // then holds the sender back. Its next receive wakes the worker to read again.
        let room = st.inbox.len() < self.sh.inbox_limit();
        let mut result = if !room {
            Ok(())
        } else {
            bridge.receive(|h, payload| {
                while st.outbox.front().is_some_and(|(seq, _)| *seq <= h.ack) {
                    st.outbox.pop_front();
                    delivered = true;
                }
                if h.kind == Kind::Data {
                    got_data = true;
                    match classify(st.last_received, h.seq) {
                        Arrival::Deliver => {
                            st.inbox.push_back(payload.to_vec());
                            st.last_received = h.seq;
                            st.stats.inbox_high = st.stats.inbox_high.max(st.inbox.len() as u64);
                            delivered = true;
                        }
                        Arrival::Duplicate => st.stats.duplicates_dropped += 1,
                        Arrival::Gap { expected } => {
                            return Err(format!(
                                "received sequence {} on the bridge while expecting {expected}",
                                h.seq
                            ))
                        }
                    }
                }
                Ok(())
            })
        };
        bridge.owes_ack |= got_data;
        if result.is_ok() && self.bridging {
            while bridge.has_room() {
                let Some((seq, data)) = next_unsent(&st.outbox, bridge.sent_upto) else {
                    break;
                };
                let seq = *seq;
                bridge.queue(Kind::Data, seq, st.last_received, data);
                bridge.sent_upto = seq;
                st.stats.bridged += 1;
                st.max_posted = st.max_posted.max(seq);
            }
        }
        if result.is_ok() && bridge.owes_ack && st.last_received > bridge.last_ack_sent {
            bridge.queue(Kind::Ack, 0, st.last_received, &[]);
        }
        drop(st);
        if delivered {
            self.sh.changed();
        }
        if result.is_ok() {
            result = bridge.flush();
        }
        if let Err(why) = result {
            self.bridge_lost(why);
        }
    }

    /// The bridge broke or the peer closed it: messages stay queued for the next path.
    fn bridge_lost(&mut self, why: String) {
        self.bridge = None;
        let mut st = self.sh.lock();
        st.bridge_up = false;
        let quiet = st.peer_closed || st.closed_by_app;
        if !quiet {
            st.stats.link_events.push(format!("bridge lost: {why}"));
        }
        drop(st);
        self.sh.changed();
        self.next_bridge_attempt = Instant::now();
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), %why, "bridge lost");
    }

    // ---- link down ----

    async fn down_tick(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_refresh) >= REFRESH_INTERVAL {
            let _ = refresh_device_list();
            self.last_refresh = now;
        }
        match self.down {
            Down::None => {}
            Down::Quiesced { hold_until } => {
                if now >= hold_until {
                    // No resume came: try on our own (the forced path).
                    self.down = Down::Awaiting {
                        until: now + self.sh.opts.peer_wait,
                    };
                    self.next_attempt = now;
                    self.set_state(ConnectionState::AwaitingPeer);
                }
            }
            Down::Awaiting { until } => {
                if now >= until {
                    self.fail(Failure::PeerWaitExpired {
                        after: self.sh.opts.peer_wait,
                        cause: self.last_link.clone(),
                        last_attempt: (!self.last_error.is_empty())
                            .then(|| self.last_error.clone()),
                    });
                    return;
                }
                if self.peer.is_some() && now >= self.next_attempt {
                    match self.attempt(true).await {
                        Ok(()) => {}
                        Err(AttemptError {
                            refused: Some(reason),
                            ..
                        }) => self.fail(Failure::ResumeRefused(reason)),
                        Err(e) => {
                            self.last_error = e.msg;
                            self.next_attempt = Instant::now() + self.sh.opts.reconnect_interval;
                        }
                    }
                }
            }
        }
    }

    fn check_deadlines(&mut self) {
        let now = Instant::now();
        if self.quiesce_op.as_ref().is_some_and(|(d, _)| now >= *d) {
            let what = match &self.link {
                Some(l) if l.disconnecting.is_some() => "the DISCONNECTED event",
                Some(l) if l.pause.as_ref().is_some_and(|p| p.sent) => "the peer's PAUSE_ACK",
                Some(_) => "posted sends to complete",
                None => "the link",
            };
            let (_, reply) = self.quiesce_op.take().expect("checked");
            let _ = reply.send(Err(format!(
                "quiesce timed out waiting for {what}; resources released anyway"
            )));
            self.link_lost(
                LinkEvent::Deadline {
                    deadline: "quiesce",
                    what,
                },
                true,
            );
            self.down = Down::Quiesced {
                hold_until: now + self.sh.opts.peer_wait,
            };
            self.set_state(ConnectionState::Quiesced);
        }
        if self.resume_op.as_ref().is_some_and(|(d, _)| now >= *d) {
            let (_, reply) = self.resume_op.take().expect("checked");
            let _ = reply.send(Err(format!(
                "resume timed out (last error: {})",
                if self.last_error.is_empty() {
                    "none; the peer did not reconnect"
                } else {
                    &self.last_error
                }
            )));
        }
        if self.close_op.as_ref().is_some_and(|(d, _)| now >= *d) {
            let (_, reply) = self.close_op.take().expect("checked");
            self.link = None;
            let _ = refresh_device_list();
            let _ = reply.send(Err("close timed out; resources released".into()));
            self.finish_closed();
        }
    }

    fn finish_closed(&mut self) {
        self.link = None;
        self.bridge = None;
        let mut st = self.sh.lock();
        st.bridge_up = false;
        st.onesided.ops.clear();
        st.conn_state = ConnectionState::Closed;
        drop(st);
        self.sh.changed();
        self.done = true;
    }

    fn fail(&mut self, cause: Failure) {
        self.link = None;
        self.bridge = None;
        let _ = refresh_device_list();
        let reason = cause.to_string();
        tracing::warn!(conn = format_args!("{:016x}", self.sh.id), %reason, "connection failed");
        let mut st = self.sh.lock();
        st.bridge_up = false;
        st.conn_state = ConnectionState::Failed;
        st.failure = Some(cause);
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
            let _ = op.1.send(Err(reason.clone()));
        }
        self.done = true;
    }
}

/// The first message of the outbox after `sent_upto` on a path (what the peer acknowledged
/// meanwhile has left the outbox and is skipped).
fn next_unsent(outbox: &VecDeque<(u64, Vec<u8>)>, sent_upto: u64) -> Option<&(u64, Vec<u8>)> {
    let front = outbox.front()?.0;
    let next = (sent_upto + 1).max(front);
    outbox.get((next - front) as usize)
}

/// How many of the messages `first..=last` just posted were posted before on some QP (up to
/// `max_posted`): replays.
fn replays(first: u64, last: u64, max_posted: u64) -> u64 {
    (last.min(max_posted) + 1).saturating_sub(first)
}

/// Where a path starts carrying this side's messages: just below the oldest unacknowledged
/// one (the receiver has everything before it).
fn resend_point(st: &State) -> u64 {
    st.outbox
        .front()
        .map_or(st.next_seq - 1, |(seq, _)| seq - 1)
}

/// Handles one work completion on a live link.
fn process(
    link: &mut Link,
    st: &mut State,
    wc: &WorkCompletion,
    delivered: &mut bool,
) -> Result<(), LinkEvent> {
    if wc.wr_id >= ONESIDED_BASE {
        return onesided_done(link, st, wc, delivered);
    }
    if wc.wr_id < RECV_BASE {
        if !wc.ok() {
            return Err(LinkEvent::QpError {
                status: wc.status_str(),
                which: "send",
            });
        }
        link.slots
            .completed(wc.wr_id as u32)
            .map_err(LinkEvent::Local)?;
        return Ok(());
    }
    if !wc.ok() {
        return Err(LinkEvent::QpError {
            status: wc.status_str(),
            which: "receive",
        });
    }
    let slot = (wc.wr_id - RECV_BASE) as usize;
    let off = slot * link.slot;
    let bytes = link
        .ep
        .recv_mr
        .read(off, wc.byte_len as usize)
        .ok_or_else(|| LinkEvent::Protocol("receive completion longer than its slot".into()))?;
    let (h, payload) = Header::decode(bytes).map_err(|e| LinkEvent::Protocol(e.to_string()))?;
    link.credits.on_peer_credits(h.credits);
    while st.outbox.front().is_some_and(|(seq, _)| *seq <= h.ack) {
        st.outbox.pop_front();
        *delivered = true; // wakes senders waiting for room, and flush()
    }
    let mut withhold = false;
    match h.kind {
        Kind::Data => match classify(st.last_received, h.seq) {
            Arrival::Deliver => {
                st.inbox.push_back(payload.to_vec());
                st.last_received = h.seq;
                st.stats.inbox_high = st.stats.inbox_high.max(st.inbox.len() as u64);
                *delivered = true;
                withhold = st.inbox.len() >= link.inbox_limit;
            }
            Arrival::Duplicate => st.stats.duplicates_dropped += 1,
            Arrival::Gap { expected } => {
                return Err(LinkEvent::Protocol(format!(
                    "received sequence {} while expecting {expected}",
                    h.seq
                )))
            }
        },
        Kind::Ack => {}
        Kind::Pause => {
            link.peer_paused = Some(Instant::now());
            link.peer_bridging = h.flags & FLAG_BRIDGE != 0;
            link.owe_pause_ack = true;
        }
        Kind::PauseAck => {
            if let Some(p) = &mut link.pause {
                p.got_ack = true;
            }
        }
        Kind::Close => {
            st.peer_closed = true;
            *delivered = true;
        }
        Kind::Regions => {
            let entries =
                RegionEntry::decode_all(payload).map_err(|e| LinkEvent::Protocol(e.to_string()))?;
            st.onesided
                .peer
                .update(&entries)
                .map_err(LinkEvent::Protocol)?;
            for e in entries {
                link.remote_keys.insert(e.handle, e);
            }
            *delivered = true; // wakes `remote`
        }
    }
    if withhold {
        // The application is behind: the peer gets this credit back once it catches up.
        link.withheld.push((off, wc.wr_id));
        return Ok(());
    }
    repost(link, off, wc.wr_id)
}

/// Posts the receive in the slot at `off` again, which gives the peer one more credit.
fn repost(link: &mut Link, off: usize, wr_id: u64) -> Result<(), LinkEvent> {
    link.ep
        .id
        .post_recv(&link.ep.recv_mr, off, link.slot, wr_id)
        .map_err(|e| LinkEvent::Local(format!("re-posting a receive: {}", error_chain(&e))))?;
    link.credits.on_reposted();
    Ok(())
}

/// Posts again the receives withheld while the inbox was full, as far as it has room now.
fn repost_withheld(link: &mut Link, st: &State) -> Result<(), LinkEvent> {
    while st.inbox.len() < link.inbox_limit {
        let Some((off, wr_id)) = link.withheld.pop() else {
            break;
        };
        repost(link, off, wr_id)?;
    }
    Ok(())
}

/// Handles the completion of a WRITE or READ: the oldest in flight on this QP.
fn onesided_done(
    link: &mut Link,
    st: &mut State,
    wc: &WorkCompletion,
    delivered: &mut bool,
) -> Result<(), LinkEvent> {
    let slot = (wc.wr_id - ONESIDED_BASE) as u32;
    let front = link.inflight.pop_front();
    if !wc.ok() {
        // The operation stays queued: the next QP posts it again.
        return Err(LinkEvent::QpError {
            status: wc.status_str(),
            which: "one-sided",
        });
    }
    let Some((posted_slot, id)) = front.filter(|(s, _)| *s == slot) else {
        return Err(LinkEvent::Local(format!(
            "one-sided completion for slot {slot} out of posting order"
        )));
    };
    // Frees its slot and those of the unsignaled SENDs posted before it. A READ's data is
    // taken from the slot below, before anything is posted into it again.
    link.slots.completed(slot).map_err(LinkEvent::Local)?;
    let op = st.onesided.ops.complete(id).map_err(LinkEvent::Local)?;
    if let OpKind::Read(len, reply) = op.kind {
        let data = link
            .ep
            .send_mr
            .read(posted_slot as usize * link.slot, len)
            .ok_or_else(|| LinkEvent::Local("read larger than a send slot".into()))?;
        // The caller may have given up: nobody to tell, then.
        let _ = reply.send(data.to_vec());
    }
    *delivered = true; // wakes flush_writes and writers waiting for room
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_unsent_message_skips_what_was_acknowledged() {
        let outbox: VecDeque<(u64, Vec<u8>)> = (5..=8).map(|seq| (seq, vec![seq as u8])).collect();
        // A path that sent up to 2 while 3 and 4 were acknowledged goes on at 5.
        assert_eq!(next_unsent(&outbox, 2).map(|m| m.0), Some(5));
        assert_eq!(next_unsent(&outbox, 6).map(|m| m.0), Some(7));
        assert_eq!(next_unsent(&outbox, 8), None);
        assert_eq!(next_unsent(&VecDeque::new(), 0), None);
    }

    #[test]
    fn replays_count_the_messages_posted_before() {
        // 5..=9 posted, of which 5..=7 had been posted on an earlier QP.
        assert_eq!(replays(5, 9, 7), 3);
        assert_eq!(replays(5, 9, 4), 0);
        assert_eq!(replays(5, 9, 12), 5);
        assert_eq!(replays(1, 1, 0), 0);
    }

    #[test]
    fn work_request_id_ranges_never_overlap() {
        // Send slots are u32 (below RECV_BASE); receives and one-sided operations add a u32
        // slot to their base, so the three ranges are disjoint for any queue depth.
        assert!(u32::MAX as u64 <= RECV_BASE);
        assert!(RECV_BASE + u32::MAX as u64 <= ONESIDED_BASE);
    }

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
