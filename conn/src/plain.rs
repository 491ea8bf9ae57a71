//! The naive baseline: a plain rdma_cm RC connection as applications use today.
//!
//! Default-ish settings (retry_cnt 7, rnr_retry 7, librdmacm's ACK timeout; a test may
//! bound the retries with [`PlainOptions`]), no agent, no
//! PAUSE, no sequence numbers, no replay. On a failure (DISCONNECTED, DEVICE_REMOVAL, a
//! completion error) everything is torn down at once (and the device list refreshed, so a
//! hot-unplug can complete); the client reconnects on its own, retrying until it succeeds;
//! the server accepts new connections and switches to the newest. Whatever was in flight
//! or queued is lost: that is the point of the baseline.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use thiserror::Error;

use crate::worker::{build_endpoint, error_chain, Endpoint, EXTRA_SEND_SLOTS, RECV_BASE};
use rdmamig_verbs::{
    refresh_device_list, CmEventKind, CmId, EventChannel, VerbsError, WorkCompletion,
};

const DEPTH: u32 = 64;
const RETRY_INTERVAL: Duration = Duration::from_millis(200);
const STEP_TIMEOUT: Duration = Duration::from_millis(2000);

/// Errors of the plain connection.
#[derive(Debug, Error)]
pub enum PlainError {
    /// No connection right now: the message was dropped.
    #[error("not connected: message dropped")]
    NotConnected,
    /// The send queue is full: the message was dropped.
    #[error("send queue full: message dropped")]
    QueueFull,
    /// The message is larger than the buffers.
    #[error("message of {len} bytes exceeds {max}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Setting up the endpoint's thread or channel failed.
    #[error("starting the plain endpoint failed")]
    Start(#[source] VerbsError),
    /// Spawning its thread failed.
    #[error("spawning the plain endpoint's thread failed")]
    Spawn(#[source] std::io::Error),
}

/// Why one connect attempt of the client failed (it retries on its next round).
#[derive(Debug, Error)]
enum AttemptError {
    /// A verbs or rdma_cm call failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The step's CM event did not come in time.
    #[error("no {want:?} in time")]
    NoEvent {
        /// The event waited for.
        want: CmEventKind,
    },
    /// Another CM event came for the id.
    #[error("{kind:?} ({status})")]
    Unexpected {
        /// The event.
        kind: CmEventKind,
        /// Its status.
        status: i32,
    },
}

/// Settings of a plain endpoint.
#[derive(Debug, Clone, Copy)]
pub struct PlainOptions {
    /// Largest message, in bytes.
    pub max_message: usize,
    /// QP transport retries (7, the default, is "retry forever" on Soft-RoCE).
    pub retry_count: u8,
    /// QP ACK timeout exponent (4.096 us x 2^n); `None` keeps librdmacm's.
    pub ack_timeout: Option<u8>,
}

impl PlainOptions {
    /// What applications commonly use: retry_cnt 7 and librdmacm's ACK timeout.
    pub fn new(max_message: usize) -> Self {
        Self {
            max_message,
            retry_count: 7,
            ack_timeout: None,
        }
    }

    /// Gives `id` the ACK timeout, if one is set (before its QP is made).
    fn apply_ack_timeout(&self, id: &CmId) -> Result<(), VerbsError> {
        match self.ack_timeout {
            Some(timeout) => id.set_ack_timeout(timeout),
            None => Ok(()),
        }
    }
}

/// Counters of a plain endpoint.
#[derive(Debug, Clone, Default)]
pub struct PlainStats {
    /// Connections established (first + reconnects).
    pub established: u64,
    /// Errors observed (disconnects, completion errors, failed attempts are not counted).
    pub errors: Vec<String>,
}

struct Shared {
    inbox: Mutex<VecDeque<Vec<u8>>>,
    cond: Condvar,
    outq: Mutex<VecDeque<Vec<u8>>>,
    connected: AtomicBool,
    stop: AtomicBool,
    wake: EventFd,
    stats: Mutex<PlainStats>,
    options: PlainOptions,
}

/// A plain endpoint (client or server side); its thread reconnects / accepts on its own.
pub struct PlainEndpoint {
    shared: Arc<Shared>,
}

enum Role {
    Client(SocketAddr),
    Server(SocketAddr),
}

impl PlainEndpoint {
    /// Connects to `peer`, and keeps reconnecting after failures.
    pub fn connect(peer: SocketAddr, options: PlainOptions) -> Result<Self, PlainError> {
        Self::start(Role::Client(peer), options)
    }

    /// Listens on `addr`, always using the newest accepted connection.
    pub fn serve(addr: SocketAddr, options: PlainOptions) -> Result<Self, PlainError> {
        Self::start(Role::Server(addr), options)
    }

    fn start(role: Role, options: PlainOptions) -> Result<Self, PlainError> {
        let wake = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK)
            .map_err(|e| PlainError::Spawn(std::io::Error::from_raw_os_error(e as i32)))?;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(VecDeque::new()),
            cond: Condvar::new(),
            outq: Mutex::new(VecDeque::new()),
            connected: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            wake,
            stats: Mutex::new(PlainStats::default()),
            options,
        });
        let chan = EventChannel::new().map_err(PlainError::Start)?;
        let listen = match role {
            Role::Server(addr) => Some(listen(&chan, addr).map_err(PlainError::Start)?),
            Role::Client(_) => None,
        };
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("rdmamig-plain".into())
            .spawn(move || {
                let mut t = PlainThread {
                    sh,
                    role,
                    conn: None,
                    pending: None,
                    listen,
                    chan,
                    slot: options.max_message,
                    next_try: Instant::now(),
                    free: Vec::new(),
                };
                t.run();
            })
            .map_err(PlainError::Spawn)?;
        Ok(Self { shared })
    }

    /// Whether a connection is up.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
    }

    /// Queues `msg` on the current connection; dropped (with an error) if there is none.
    pub fn send(&self, msg: &[u8]) -> Result<(), PlainError> {
        if msg.len() > self.shared.options.max_message {
            return Err(PlainError::TooLarge {
                len: msg.len(),
                max: self.shared.options.max_message,
            });
        }
        if !self.is_connected() {
            return Err(PlainError::NotConnected);
        }
        let mut q = self.shared.outq.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= 4096 {
            return Err(PlainError::QueueFull);
        }
        q.push_back(msg.to_vec());
        drop(q);
        let _ = self.shared.wake.write(1);
        Ok(())
    }

    /// Takes the next received message, waiting up to `timeout`.
    pub fn recv(&self, timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.inbox.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(m) = q.pop_front() {
                return Some(m);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            q = self
                .shared
                .cond
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Counters.
    pub fn stats(&self) -> PlainStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for PlainEndpoint {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let _ = self.shared.wake.write(1);
    }
}

fn listen(chan: &EventChannel, addr: SocketAddr) -> Result<CmId, VerbsError> {
    let id = CmId::create(chan)?;
    id.bind(addr)?;
    id.listen(16)?;
    Ok(id)
}

struct PlainThread {
    sh: Arc<Shared>,
    role: Role,
    // Drop order: connections, listener, then the channel.
    conn: Option<Endpoint>,
    pending: Option<Endpoint>,
    listen: Option<CmId>,
    chan: EventChannel,
    slot: usize,
    next_try: Instant,
    free: Vec<u32>,
}

impl PlainThread {
    fn error(&self, e: String) {
        tracing::info!(error = %e, "plain connection error");
        self.sh
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .errors
            .push(e);
    }

    fn teardown(&mut self, why: String) {
        if self.conn.take().is_some() {
            self.error(why);
        }
        self.sh.connected.store(false, Ordering::Relaxed);
        self.sh
            .outq
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        let _ = refresh_device_list();
    }

    fn install(&mut self, ep: Endpoint) {
        self.conn = Some(ep);
        self.free = (0..DEPTH + EXTRA_SEND_SLOTS).collect();
        self.sh
            .outq
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.sh.connected.store(true, Ordering::Relaxed);
        self.sh
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .established += 1;
    }

    fn run(&mut self) {
        let mut wcs: Vec<WorkCompletion> = Vec::new();
        while !self.sh.stop.load(Ordering::Relaxed) {
            {
                let mut fds = vec![
                    PollFd::new(self.sh.wake.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.chan.fd(), PollFlags::POLLIN),
                ];
                if let Some(c) = &self.conn {
                    fds.push(PollFd::new(c.comp.fd(), PollFlags::POLLIN));
                }
                let _ = poll(&mut fds, PollTimeout::from(50u16));
            }
            let _ = self.sh.wake.read();
            self.events();
            self.completions(&mut wcs);
            self.pump();
            let now = Instant::now();
            if now >= self.next_try {
                self.next_try = now + RETRY_INTERVAL;
                match self.role {
                    Role::Client(peer) if self.conn.is_none() => {
                        let _ = refresh_device_list();
                        if let Ok(ep) = self.connect(peer) {
                            self.install(ep);
                        }
                    }
                    Role::Server(addr) if self.listen.is_none() => {
                        let _ = refresh_device_list();
                        self.listen = listen(&self.chan, addr).ok();
                    }
                    _ => {}
                }
            }
        }
    }

    fn connect(&mut self, peer: SocketAddr) -> Result<Endpoint, AttemptError> {
        let id = CmId::create(&self.chan)?;
        self.sh.options.apply_ack_timeout(&id)?;
        id.resolve_addr(peer, STEP_TIMEOUT)?;
        self.wait(&id, CmEventKind::AddrResolved)?;
        id.resolve_route(STEP_TIMEOUT)?;
        self.wait(&id, CmEventKind::RouteResolved)?;
        let ep = build_endpoint(id, DEPTH, self.slot)?;
        ep.id.connect(&[], self.sh.options.retry_count, 7)?;
        self.wait(&ep.id, CmEventKind::Established)?;
        Ok(ep)
    }

    fn wait(&mut self, id: &CmId, want: CmEventKind) -> Result<(), AttemptError> {
        let deadline = Instant::now() + STEP_TIMEOUT + Duration::from_millis(500);
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(AttemptError::NoEvent { want });
            }
            match self.chan.get_event(deadline - now) {
                Ok(Some(ev)) if ev.id == id.key() => {
                    return if ev.kind == want {
                        Ok(())
                    } else {
                        Err(AttemptError::Unexpected {
                            kind: ev.kind,
                            status: ev.status,
                        })
                    };
                }
                Ok(_) => {}
                Err(e) => return Err(AttemptError::Verbs(e)),
            }
        }
    }

    fn events(&mut self) {
        loop {
            let mut ev = match self.chan.get_event(Duration::ZERO) {
                Ok(Some(ev)) => ev,
                _ => return,
            };
            let is_conn = self.conn.as_ref().is_some_and(|c| c.id.key() == ev.id);
            let is_pending = self.pending.as_ref().is_some_and(|c| c.id.key() == ev.id);
            let is_listen = self.listen.as_ref().is_some_and(|l| l.key() == ev.id);
            match ev.kind {
                CmEventKind::ConnectRequest => {
                    if let Some(id) = ev.new_id.take() {
                        let options = self.sh.options;
                        let built = options
                            .apply_ack_timeout(&id)
                            .and_then(|()| build_endpoint(id, DEPTH, self.slot));
                        match built {
                            Ok(ep) => {
                                if ep.id.accept(&[], options.retry_count, 7).is_ok() {
                                    self.pending = Some(ep);
                                }
                            }
                            Err(e) => self.error(format!("accept: {}", error_chain(&e))),
                        }
                    }
                }
                CmEventKind::Established if is_pending => {
                    // Switch to the newest connection; the old one is dropped.
                    if let Some(ep) = self.pending.take() {
                        if self.conn.is_some() {
                            self.teardown("replaced by a newer connection".into());
                        }
                        self.install(ep);
                    }
                }
                CmEventKind::Disconnected if is_conn => self.teardown("DISCONNECTED".into()),
                CmEventKind::DeviceRemoval if is_conn => self.teardown("DEVICE_REMOVAL".into()),
                CmEventKind::DeviceRemoval if is_listen => {
                    self.listen = None;
                    self.pending = None;
                    let _ = refresh_device_list();
                }
                CmEventKind::DeviceRemoval
                | CmEventKind::Disconnected
                | CmEventKind::ConnectError
                    if is_pending =>
                {
                    self.pending = None;
                }
                _ => {}
            }
        }
    }

    fn completions(&mut self, wcs: &mut Vec<WorkCompletion>) {
        let Some(c) = &self.conn else { return };
        let _ = c.cq.ack_events();
        let mut failure = None;
        let mut armed = false;
        loop {
            wcs.clear();
            let Some(c) = &self.conn else { return };
            match c.cq.poll(wcs, 64) {
                Ok(0) if armed => break,
                Ok(0) => {
                    let _ = c.cq.req_notify();
                    armed = true;
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    failure = Some(error_chain(&e));
                    break;
                }
            }
            let mut delivered = false;
            for wc in wcs.iter() {
                if !wc.ok() {
                    failure.get_or_insert(format!("completion error: {}", wc.status_str()));
                    continue;
                }
                if wc.wr_id < RECV_BASE {
                    self.free.push(wc.wr_id as u32);
                    continue;
                }
                let off = (wc.wr_id - RECV_BASE) as usize * self.slot;
                if let Some(bytes) = c.recv_mr.read(off, wc.byte_len as usize) {
                    self.sh
                        .inbox
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_back(bytes.to_vec());
                    delivered = true;
                }
                if let Err(e) = c.id.post_recv(&c.recv_mr, off, self.slot, wc.wr_id) {
                    failure.get_or_insert(error_chain(&e));
                }
            }
            if delivered {
                self.sh.cond.notify_all();
            }
            if failure.is_some() {
                break;
            }
        }
        if let Some(f) = failure {
            self.teardown(f);
        }
    }

    fn pump(&mut self) {
        let Some(c) = &mut self.conn else { return };
        let mut failure = None;
        let mut q = self.sh.outq.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(slot) = self.free.last().copied() {
            let Some(msg) = q.pop_front() else { break };
            let off = slot as usize * self.slot;
            let Some(buf) = c.send_mr.write(off, msg.len()) else {
                continue;
            };
            buf.copy_from_slice(&msg);
            self.free.pop();
            if let Err(e) = c.id.post_send(&c.send_mr, off, msg.len(), slot as u64) {
                failure = Some(error_chain(&e));
                break;
            }
        }
        drop(q);
        if let Some(f) = failure {
            self.teardown(f);
        }
    }
}
