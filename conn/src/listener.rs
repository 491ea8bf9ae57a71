//! The listener: accepts new connections (HELLO) and routes RESUME connect requests to the
//! existing connection they name, after checking its token; with a bridge address it also
//! routes the connections' TCP bridges (BRIDGE records) the same way.
//!
//! A listener thread owns the event channel and the listening cm id. Quiesce releases the
//! listening id (it holds the device's context); resume binds and listens again, retrying
//! until the address exists on the new device. The bridge listener has a thread of its own
//! and holds no device, so it listens throughout.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tokio::runtime::Handle;
use tokio::sync::Notify;

use rdmamig_proto::agent::{ConnectionInfo, QuiesceMode, Role};
use rdmamig_proto::text::error_chain;
use rdmamig_proto::ConnectionId;

use crate::bridge::{Bridge, BridgeError};
use crate::connection::Connection;
use crate::control::ControlError;
use crate::error::ConnError;
use crate::options::ConnectOptions;
use crate::registry::{self, Migratable};
use crate::shared::{Command, ConnShared};
use crate::wire::{token_eq, Hello, PrivateData, Reject, RejectReason};
use crate::worker::{self, Start};
use rdmamig_verbs::{refresh_device_list, CmEvent, CmEventKind, CmId, EventChannel};

const BACKLOG: i32 = 64;
const RELISTEN_INTERVAL: Duration = Duration::from_millis(100);

/// The longest the listener's threads sleep when nothing wakes them: commands and the
/// listener's drop wake them at once, and on a TCG guest each needless wake-up costs CPU
/// the VM's other work needs.
const IDLE_WAIT: Duration = Duration::from_secs(1);

enum ListenerCommand {
    Quiesce(mpsc::Sender<Result<(), ControlError>>),
    Resume(Instant, mpsc::Sender<Result<(), ControlError>>),
}

pub(crate) struct ListenerShared {
    addr: SocketAddr,
    opts: ConnectOptions,
    /// Where the workers of accepted connections run: a task on this runtime (the async
    /// API), or a thread each.
    runtime: Option<Handle>,
    queue: Mutex<VecDeque<Connection>>,
    /// Wakes blocking `accept` when a connection is queued.
    cond: Condvar,
    /// Wakes async `accept`, as `cond` wakes blocking ones.
    pub(crate) arrived: Notify,
    routes: Mutex<HashMap<ConnectionId, Weak<ConnShared>>>,
    failure: Mutex<Option<String>>,
    commands: Mutex<mpsc::Sender<ListenerCommand>>,
    /// Wakes the listener thread: a command was sent, or the listener was dropped.
    wake: Arc<EventFd>,
    /// Wakes the bridge listener's thread when the listener is dropped.
    bridges_wake: Arc<EventFd>,
    /// Bridge streams whose greeting is being read (at most [`MAX_PENDING_BRIDGES`]).
    pending_bridges: Arc<AtomicUsize>,
}

impl ListenerShared {
    fn request(
        &self,
        cmd: ListenerCommand,
        rx: mpsc::Receiver<Result<(), ControlError>>,
        deadline: Instant,
    ) -> Result<(), ControlError> {
        self.commands
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(cmd)
            .map_err(|_| ControlError::ListenerStopped)?;
        let _ = self.wake.write(1);
        let wait = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(2);
        rx.recv_timeout(wait)
            .map_err(|_| ControlError::ListenerNoAnswer)?
    }
}

impl Migratable for ListenerShared {
    fn describe(&self) -> Option<ConnectionInfo> {
        None
    }

    /// The TCP bridge listener stays: it holds no device.
    fn quiesce(&self, deadline: Instant, mode: QuiesceMode) -> Result<(), ControlError> {
        if mode == QuiesceMode::Hot {
            // The device stays: the listening id and its bound address stay with it.
            return Ok(());
        }
        let (tx, rx) = mpsc::channel();
        self.request(ListenerCommand::Quiesce(tx), rx, deadline)
    }

    fn resume(&self, deadline: Instant) -> Result<(), ControlError> {
        let (tx, rx) = mpsc::channel();
        self.request(ListenerCommand::Resume(deadline, tx), rx, deadline)
    }

    fn is_listener(&self) -> bool {
        true
    }

    fn conn_id(&self) -> Option<ConnectionId> {
        None
    }
}

/// Accepts migratable connections on an address.
pub struct Listener {
    shared: Arc<ListenerShared>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Listener({})", self.shared.addr)
    }
}

impl Listener {
    /// Binds and listens on `addr` (an address of an RDMA device). The workers of the
    /// connections it accepts run on threads of their own.
    pub fn bind(addr: SocketAddr, opts: &ConnectOptions) -> Result<Listener, ConnError> {
        Self::bind_on(addr, opts, None)
    }

    /// [`Listener::bind`], with the accepted connections' workers as tasks on `runtime` if
    /// given.
    pub(crate) fn bind_on(
        addr: SocketAddr,
        opts: &ConnectOptions,
        runtime: Option<Handle>,
    ) -> Result<Listener, ConnError> {
        let chan = EventChannel::new().map_err(|source| ConnError::Verbs {
            op: "creating the listener's event channel",
            source,
        })?;
        let id = listen_on(&chan, addr).map_err(|source| ConnError::Verbs {
            op: "listening",
            source,
        })?;
        let bridge = opts
            .bridge
            .map(|addr| {
                TcpListener::bind(addr)
                    .and_then(|l| l.set_nonblocking(true).map(|()| l))
                    .map_err(|e| ConnError::Bridge {
                        addr,
                        reason: BridgeError::Listen(e),
                    })
            })
            .transpose()?;
        let (tx, rx) = mpsc::channel();
        let new_wake = || {
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map(Arc::new)
                .map_err(|e| ConnError::Spawn {
                    what: "listener wake-up eventfd",
                    source: e.into(),
                })
        };
        let (wake, bridges_wake) = (new_wake()?, new_wake()?);
        let shared = Arc::new(ListenerShared {
            addr,
            opts: opts.clone(),
            runtime,
            queue: Mutex::new(VecDeque::new()),
            cond: Condvar::new(),
            arrived: Notify::new(),
            routes: Mutex::new(HashMap::new()),
            failure: Mutex::new(None),
            commands: Mutex::new(tx),
            wake: wake.clone(),
            bridges_wake: bridges_wake.clone(),
            pending_bridges: Arc::new(AtomicUsize::new(0)),
        });
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("rdmamig-listener".into())
            .spawn(move || {
                let mut t = ListenerThread {
                    shared: weak,
                    rx,
                    wake,
                    id: Some(id),
                    chan,
                    state: Listening::Up,
                    addr,
                };
                t.run();
            })
            .map_err(|source| ConnError::Spawn {
                what: "listener thread",
                source,
            })?;
        if let Some(bridge) = bridge {
            let weak = Arc::downgrade(&shared);
            std::thread::Builder::new()
                .name("rdmamig-bridges".into())
                .spawn(move || serve_bridges(bridge, weak, &bridges_wake))
                .map_err(|source| ConnError::Spawn {
                    what: "bridge listener thread",
                    source,
                })?;
        }
        if opts.register {
            let arc: Arc<dyn Migratable> = shared.clone();
            registry::register(Arc::downgrade(&arc));
        }
        Ok(Listener { shared })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Waits up to `timeout` for a new, established connection.
    pub fn accept(&self, timeout: Duration) -> Result<Connection, ConnError> {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(answer) = self.next(&mut q) {
                return answer;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.accept_timed_out(timeout));
            }
            q = self
                .shared
                .cond
                .wait_timeout(q, (deadline - now).min(Duration::from_millis(200)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The state the listener thread shares with the handles.
    pub(crate) fn shared(&self) -> &ListenerShared {
        &self.shared
    }

    /// One look for an accepted connection (or the listener's failure), for the async
    /// `accept`.
    pub(crate) fn take_next(&self) -> Option<Result<Connection, ConnError>> {
        self.next(&mut self.shared.queue.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The next queued connection, or the listener's failure; `None` to wait on.
    fn next(&self, q: &mut VecDeque<Connection>) -> Option<Result<Connection, ConnError>> {
        if let Some(c) = q.pop_front() {
            return Some(Ok(c));
        }
        let failure = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        failure.map(|reason| {
            Err(ConnError::ListenerFailed {
                addr: self.shared.addr,
                reason,
            })
        })
    }

    pub(crate) fn accept_timed_out(&self, after: Duration) -> ConnError {
        ConnError::AcceptTimedOut {
            addr: self.shared.addr,
            after,
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Connections not yet accepted hold the shared state: release them to break the cycle.
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        // The threads end once they find the shared state gone: wake them to look.
        let _ = self.shared.wake.write(1);
        let _ = self.shared.bridges_wake.write(1);
    }
}

/// The bridge listener's thread: accepts TCP streams until the listener is dropped, and
/// hands each, once its BRIDGE record names a connection of this listener with the right
/// token, to that connection. Each greeting is read on a thread of its own within the
/// bridge's set-up timeout, at most [`MAX_PENDING_BRIDGES`] at once (a stream past that is
/// closed at once), so a slow or silent client never holds up another's bridge.
fn serve_bridges(listener: TcpListener, shared: Weak<ListenerShared>, wake: &EventFd) {
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        match listener.accept() {
            Ok((stream, from)) => {
                let pending = strong.pending_bridges.clone();
                if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING_BRIDGES {
                    pending.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!(%from, "bridge refused: {MAX_PENDING_BRIDGES} greetings pending");
                    continue;
                }
                let routed = std::thread::Builder::new()
                    .name("rdmamig-bridge-greeting".into())
                    .spawn(move || {
                        route_bridge(stream, from, &strong);
                        pending.fetch_sub(1, Ordering::SeqCst);
                    });
                if let Err(e) = routed {
                    tracing::warn!(%from, error = %e, "bridge refused: no thread for its greeting");
                    if let Some(strong) = shared.upgrade() {
                        strong.pending_bridges.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Not holding the listener while idle: dropping it ends this thread (and
                // wakes it to see that).
                drop(strong);
                let mut fds = [
                    PollFd::new(listener.as_fd(), PollFlags::POLLIN),
                    PollFd::new(wake.as_fd(), PollFlags::POLLIN),
                ];
                let _ = poll(&mut fds, poll_timeout(IDLE_WAIT));
                let _ = wake.read();
            }
            Err(e) => {
                tracing::warn!(error = %e, "bridge listener: accept failed");
                std::thread::sleep(RELISTEN_INTERVAL);
            }
        }
    }
}

/// Bridge greetings read at once (each for at most the set-up timeout).
const MAX_PENDING_BRIDGES: usize = 16;

fn route_bridge(mut stream: TcpStream, from: SocketAddr, shared: &ListenerShared) {
    let refuse = |stream, hello: &Hello, reason| {
        Bridge::refuse(
            stream,
            Reject {
                conn_id: hello.conn_id,
                reason,
            },
        )
    };
    let hello = match Bridge::read_greeting(&mut stream) {
        Ok(hello) => hello,
        Err(e) => {
            tracing::warn!(%from, error = %error_chain(&e), "bridge refused");
            let reject = Reject {
                conn_id: 0,
                reason: RejectReason::Malformed,
            };
            Bridge::refuse(stream, reject);
            return;
        }
    };
    let existing = shared
        .routes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&hello.conn_id)
        .and_then(|w| w.upgrade());
    let Some(conn) = existing else {
        refuse(stream, &hello, RejectReason::UnknownConnection);
        return;
    };
    if !token_eq(&conn.token, &hello.token) {
        tracing::warn!(%from, conn = format_args!("{:016x}", hello.conn_id), "bridge with a wrong token refused");
        refuse(stream, &hello, RejectReason::BadToken);
        return;
    }
    if let Err(Command::Bridge { stream, .. }) = conn.command(Command::Bridge { stream, hello }) {
        refuse(stream, &hello, RejectReason::Gone);
    }
}

fn listen_on(chan: &EventChannel, addr: SocketAddr) -> Result<CmId, rdmamig_verbs::VerbsError> {
    let id = CmId::create(chan)?;
    id.bind(addr)?;
    id.listen(BACKLOG)?;
    Ok(id)
}

/// `wait` as a poll timeout (a millisecond more, so the deadline has passed on waking).
fn poll_timeout(wait: Duration) -> PollTimeout {
    PollTimeout::try_from(wait.as_millis() + 1).unwrap_or(PollTimeout::MAX)
}

enum Listening {
    Up,
    /// Quiesced: no listening id until a resume (or until `hold_until`).
    Quiesced {
        hold_until: Instant,
    },
    /// Lost (device removal) or resuming: re-listen every RELISTEN_INTERVAL.
    Retrying {
        next: Instant,
        resume: Option<(Instant, mpsc::Sender<Result<(), ControlError>>)>,
    },
}

impl Listening {
    /// How long the listener thread may sleep when no event or command comes.
    fn wait(&self, now: Instant) -> Duration {
        match self {
            Listening::Up => IDLE_WAIT,
            Listening::Quiesced { hold_until } => hold_until.saturating_duration_since(now),
            Listening::Retrying { next, .. } => next.saturating_duration_since(now),
        }
        .min(IDLE_WAIT)
    }
}

struct ListenerThread {
    shared: Weak<ListenerShared>,
    rx: mpsc::Receiver<ListenerCommand>,
    wake: Arc<EventFd>,
    // Before `chan`: the listening id goes first.
    id: Option<CmId>,
    chan: EventChannel,
    state: Listening,
    addr: SocketAddr,
}

impl ListenerThread {
    fn run(&mut self) {
        loop {
            let Some(shared) = self.shared.upgrade() else {
                break;
            };
            let _ = self.wake.read();
            while let Ok(cmd) = self.rx.try_recv() {
                self.command(cmd, &shared);
            }
            loop {
                match self.chan.get_event(Duration::ZERO) {
                    Ok(Some(ev)) => self.event(ev, &shared),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "listener: reading CM events failed");
                        break;
                    }
                }
            }
            self.tick(Instant::now(), &shared);
            // Not holding the shared state while asleep: its drop ends this thread.
            drop(shared);
            let mut fds = [
                PollFd::new(self.chan.fd(), PollFlags::POLLIN),
                PollFd::new(self.wake.as_fd(), PollFlags::POLLIN),
            ];
            let _ = poll(&mut fds, poll_timeout(self.state.wait(Instant::now())));
        }
        self.id = None;
    }

    fn command(&mut self, cmd: ListenerCommand, shared: &ListenerShared) {
        match cmd {
            ListenerCommand::Quiesce(reply) => {
                self.id = None;
                let _ = refresh_device_list();
                self.state = Listening::Quiesced {
                    hold_until: Instant::now() + shared.opts.peer_wait,
                };
                let _ = reply.send(Ok(()));
            }
            ListenerCommand::Resume(deadline, reply) => {
                if self.id.is_some() {
                    let _ = reply.send(Ok(()));
                    return;
                }
                self.state = Listening::Retrying {
                    next: Instant::now(),
                    resume: Some((deadline, reply)),
                };
            }
        }
    }

    fn tick(&mut self, now: Instant, _shared: &ListenerShared) {
        match &mut self.state {
            Listening::Up => {}
            Listening::Quiesced { hold_until } => {
                if now >= *hold_until {
                    self.state = Listening::Retrying {
                        next: now,
                        resume: None,
                    };
                }
            }
            Listening::Retrying { next, resume } => {
                if now < *next {
                    return;
                }
                // librdmacm must know the new device first: an old one with the same GUID
                // would be picked for it otherwise.
                let _ = refresh_device_list();
                match listen_on(&self.chan, self.addr) {
                    Ok(id) => {
                        self.id = Some(id);
                        if let Some((_, reply)) = resume.take() {
                            let _ = reply.send(Ok(()));
                        }
                        self.state = Listening::Up;
                        tracing::debug!(addr = %self.addr, "listening again");
                    }
                    Err(e) => {
                        *next = now + RELISTEN_INTERVAL;
                        if resume.as_ref().is_some_and(|(d, _)| now >= *d) {
                            let (_, reply) = resume.take().expect("checked");
                            let _ = reply.send(Err(ControlError::Relisten {
                                addr: self.addr,
                                error: e,
                            }));
                        }
                    }
                }
            }
        }
    }

    fn event(&mut self, mut ev: CmEvent, shared: &Arc<ListenerShared>) {
        match ev.kind {
            CmEventKind::ConnectRequest => {
                let Some(new_id) = ev.new_id.take() else {
                    return;
                };
                self.request(new_id, &ev.private_data, shared);
            }
            CmEventKind::DeviceRemoval if self.id.as_ref().is_some_and(|id| id.key() == ev.id) => {
                // Release the device at once; listen again when an address is back.
                self.id = None;
                let _ = refresh_device_list();
                if matches!(self.state, Listening::Up) {
                    self.state = Listening::Retrying {
                        next: Instant::now() + RELISTEN_INTERVAL,
                        resume: None,
                    };
                }
            }
            _ => {}
        }
    }

    fn request(&mut self, new_id: CmId, private_data: &[u8], shared: &Arc<ListenerShared>) {
        let reject = |id: &CmId, conn_id, reason| {
            let pd = PrivateData::Reject(Reject { conn_id, reason });
            let _ = id.reject(&pd.encode());
        };
        let hello = match PrivateData::decode(private_data) {
            Ok(PrivateData::Hello(h)) | Ok(PrivateData::Resume(h)) => h,
            _ => {
                reject(&new_id, 0, RejectReason::Malformed);
                return;
            }
        };
        let existing = {
            let mut routes = shared.routes.lock().unwrap_or_else(|p| p.into_inner());
            routes.retain(|_, w| w.strong_count() > 0);
            routes.get(&hello.conn_id).and_then(|w| w.upgrade())
        };
        let is_resume = matches!(
            PrivateData::decode(private_data),
            Ok(PrivateData::Resume(_))
        );
        tracing::debug!(
            conn = format_args!("{:016x}", hello.conn_id),
            resume = is_resume,
            to_its_worker = existing.is_some(),
            "connect request"
        );
        match existing {
            Some(conn) => {
                if !token_eq(&conn.token, &hello.token) {
                    tracing::warn!(
                        conn = format_args!("{:016x}", hello.conn_id),
                        "RESUME with a wrong token rejected"
                    );
                    reject(&new_id, hello.conn_id, RejectReason::BadToken);
                    return;
                }
                if let Err(Command::Incoming { id, .. }) =
                    conn.command(Command::Incoming { id: new_id, hello })
                {
                    reject(&id, hello.conn_id, RejectReason::Gone);
                }
            }
            None if is_resume => reject(&new_id, hello.conn_id, RejectReason::UnknownConnection),
            None => self.new_connection(new_id, hello, shared),
        }
    }

    fn new_connection(&mut self, id: CmId, hello: Hello, shared: &Arc<ListenerShared>) {
        let (conn, rx) = match ConnShared::new(
            hello.conn_id,
            hello.token,
            Role::Passive,
            shared.opts.clone(),
        ) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "cannot create a connection");
                return;
            }
        };
        shared
            .routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hello.conn_id, Arc::downgrade(&conn));
        let weak = Arc::downgrade(shared);
        let on_ready = Box::new(move |sh: Arc<ConnShared>| match weak.upgrade() {
            Some(l) => {
                let c = Connection::from_shared(sh, Some(l.clone()));
                l.queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_back(c);
                l.cond.notify_all();
                l.arrived.notify_waiters();
            }
            // Nobody will accept it: dropping the handle closes it.
            None => drop(Connection::from_shared(sh, None)),
        });
        if let Err(e) = worker::spawn(
            conn,
            rx,
            Start::Passive {
                id,
                hello,
                on_ready,
            },
            shared.runtime.clone(),
        ) {
            tracing::warn!(error = %e, "cannot start a connection worker");
        }
    }
}
