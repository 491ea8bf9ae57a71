//! The applications registered with the agent.
//!
//! Every process that uses the connection library keeps one UNIX socket open to the
//! agent and introduces itself with `Hello`. The agent sends it requests
//! ([`AgentToApp`]) and waits, with a deadline, for the one reply each request gets. A
//! process that disconnects is forgotten at once; one that does not answer in time is
//! reported per connection, using the connections it last described.
//!
//! The socket is a trust boundary inside the guest: any local process that may open it can
//! talk to the agent, and a registered process is asked to quiesce rather than ended at a
//! forced release. So:
//! - its mode and group are the operator's ([`SocketAccess`]; default 0660, the agent's
//!   group), not open to every user;
//! - a `Hello` is believed only for the process that sends it: the pid it names must be
//!   the connecting process's, as the kernel tells it (SO_PEERCRED); another is refused;
//! - a connection has [`HELLO_TIMEOUT`] to say `Hello`, and at most
//!   [`MAX_UNREGISTERED`] accepted connections may be waiting to, so that silent
//!   connections cannot take the agent's descriptors; further ones wait in the socket's
//!   backlog until one of those has spoken or timed out (a burst of applications starting
//!   at once is served, not refused);
//! - one thread serves every connection ([`Server`]), so that no number of them costs a
//!   thread each.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use rdmamig_proto::agent::{ConnectionInfo, ConnectionOutcome, COMMAND_LEN};
use rdmamig_proto::app::{AgentToApp, AppReply, AppToAgent};
use rdmamig_proto::message::{Assembler, MessageError};
use rdmamig_proto::preload::{PeerAnswer, PeerRequest};
use rdmamig_proto::text::printable;
use rdmamig_proto::{Frame, FrameBuffer, FrameError, MAX_FRAME_LEN};
use thiserror::Error;
use tracing::{debug, info, warn};

/// How many processes are asked to quiesce or resume at the same time.
pub const MAX_PARALLEL_APPS: usize = 8;

/// Why the application socket could not be served.
#[derive(Debug, Error)]
pub enum AppsError {
    /// The socket's directory could not be created.
    #[error("cannot create the directory of the application socket {path}")]
    CreateDir {
        /// The directory.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The socket could not be bound.
    #[error("cannot listen on the application socket {path}")]
    Bind {
        /// The socket path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The socket's mode or group could not be set.
    #[error("cannot set the mode {mode:o} or group of the application socket {path}")]
    Access {
        /// The socket path.
        path: String,
        /// The mode asked for.
        mode: u32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Who may open the application socket: its mode, and the group that owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketAccess {
    /// The socket file's permission bits.
    pub mode: u32,
    /// The group that owns it (`None`: the agent's own).
    pub group: Option<u32>,
}

impl Default for SocketAccess {
    /// 0660 with the agent's group: the agent's user and group, not every user.
    fn default() -> Self {
        SocketAccess {
            mode: 0o660,
            group: None,
        }
    }
}

/// How long a new connection has to say `Hello`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest number of accepted connections waiting to say `Hello`; more are not accepted
/// until one of them has said it or timed out.
pub const MAX_UNREGISTERED: usize = 32;

/// Why one application did not answer a request.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AppRequestError {
    /// No reply before the deadline.
    #[error("process {pid} did not answer within {deadline_ms} ms")]
    Timeout {
        /// The process.
        pid: u32,
        /// The deadline that passed.
        deadline_ms: u64,
    },
    /// The process closed its socket (it exited or crashed).
    #[error("process {pid} went away")]
    Gone {
        /// The process.
        pid: u32,
    },
    /// The reply was of the wrong kind for the request.
    #[error("process {pid} answered with the wrong kind of reply")]
    WrongReply {
        /// The process.
        pid: u32,
    },
}

/// One registered process.
struct App {
    pid: u32,
    program: String,
    writer: Mutex<UnixStream>,
    pending: Mutex<HashMap<u64, Sender<AppReply>>>,
    /// The connections it reported last, used to report on it when it stops answering.
    last_described: Mutex<Vec<ConnectionInfo>>,
    /// Why a move cannot carry it now, if it said so ([`AppToAgent::Carried`]).
    not_carried: Mutex<Option<String>>,
}

/// The set of registered processes, shared by the socket listener and the host server.
#[derive(Clone, Default)]
pub struct Apps {
    apps: Arc<Mutex<HashMap<u64, Arc<App>>>>,
    /// Connections accepted that have not said `Hello` yet (kept by the [`Server`]).
    unregistered: Arc<AtomicUsize>,
    next_app: Arc<AtomicU64>,
    next_request: Arc<AtomicU64>,
}

/// Largest number of processes served at once; further connections are refused, so a
/// runaway guest program cannot exhaust the agent.
const MAX_APPS: usize = 256;

/// The largest message a registered process may send: a reply lists its connections (about
/// 200 bytes each), so one with more than a few hundred sends it in pieces, and 1 MiB holds
/// about 5,000. Before its `Hello`, a connection is held to one frame. So all processes
/// together can make the agent hold at most [`MAX_APPS`] MiB.
const MAX_REPLY_LEN: usize = 1024 * 1024;

impl Apps {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds `path` (replacing a stale socket) with `access`, and serves it on one thread
    /// ([`Server`]).
    pub fn listen(&self, path: &Path, access: SocketAccess) -> Result<(), AppsError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| AppsError::CreateDir {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let _ = std::fs::remove_file(path);
        let bind_error = |source| AppsError::Bind {
            path: path.display().to_string(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let restrict = std::os::unix::fs::chown(path, None, access.group).and_then(|()| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(access.mode))
        });
        restrict.map_err(|source| AppsError::Access {
            path: path.display().to_string(),
            mode: access.mode,
            source,
        })?;
        let server = Server {
            apps: self.clone(),
            listener,
            clients: Vec::new(),
        };
        thread::Builder::new()
            .name("apps-socket".into())
            .spawn(move || server.run())
            .expect("spawning a thread");
        Ok(())
    }

    /// Acts on one message of a connection: registers it, hands a reply to its waiter, or
    /// refuses what is unusable.
    fn on_message(&self, client: &mut Client, message: Result<AppToAgent, MessageError>) -> Keep {
        match message {
            Ok(AppToAgent::Hello { pid, program }) if client.app.is_none() => {
                if let Err(refused) = check_sender(&client.stream, pid) {
                    warn!(pid, "Hello refused: {refused}");
                    refuse(&client.stream, &None, refused.to_string());
                    return Keep::Close;
                }
                let Ok(writer) = client.stream.try_clone() else {
                    return Keep::Close;
                };
                let key = self.next_app.fetch_add(1, Ordering::Relaxed);
                let entry = Arc::new(App {
                    pid,
                    program,
                    writer: Mutex::new(writer),
                    pending: Mutex::new(HashMap::new()),
                    last_described: Mutex::new(Vec::new()),
                    not_carried: Mutex::new(None),
                });
                info!(pid, program = %entry.program, "application registered");
                self.apps.lock().unwrap().insert(key, entry.clone());
                client.app = Some((key, entry));
                // Registered: no longer bounded as a silent connection, and its replies
                // may list its connections.
                client.hello_by = None;
                client.assembler = Assembler::new(MAX_REPLY_LEN);
            }
            Ok(AppToAgent::Reply { request, body }) => {
                let waiter = client
                    .app
                    .as_ref()
                    .and_then(|(_, a)| a.pending.lock().unwrap().remove(&request));
                match waiter {
                    Some(tx) => drop(tx.send(body)),
                    None => debug!(request, "reply to no pending request (late?)"),
                }
            }
            Ok(AppToAgent::Carried { not_because }) => match &client.app {
                Some((_, app)) => {
                    let reason = not_because.map(|r| printable(&r, COMMAND_LEN));
                    match &reason {
                        Some(why) => info!(pid = app.pid, "a move cannot carry it now: {why}"),
                        None => info!(pid = app.pid, "a move can carry it again"),
                    }
                    *app.not_carried.lock().unwrap() = reason;
                }
                None => refuse(&client.stream, &None, "Carried before Hello".into()),
            },
            Ok(AppToAgent::Hello { .. }) => {
                warn!("second Hello on one socket refused");
                refuse(
                    &client.stream,
                    &client.app,
                    "a second Hello on one socket".into(),
                );
            }
            Err(e) if e.is_recoverable() => {
                warn!("bad message from an application: {e}");
                refuse(&client.stream, &client.app, e.to_string());
            }
            Err(e) => {
                warn!("dropping an application whose stream is corrupt: {e}");
                refuse(&client.stream, &client.app, e.to_string());
                return Keep::Close;
            }
        }
        Keep::Open
    }

    fn forget(&self, app: &Option<(u64, Arc<App>)>) {
        if let Some((key, entry)) = app {
            info!(pid = entry.pid, "application went away");
            self.apps.lock().unwrap().remove(key);
            // Dropping the senders wakes every waiter with "gone".
            entry.pending.lock().unwrap().clear();
        }
    }

    /// The process ids of the registered processes a move can carry (those that said it
    /// cannot, [`AppToAgent::Carried`], count as unmanaged).
    pub fn carried_pids(&self) -> Vec<u32> {
        self.snapshot()
            .iter()
            .filter(|app| app.not_carried.lock().unwrap().is_none())
            .map(|app| app.pid)
            .collect()
    }

    fn snapshot(&self) -> Vec<Arc<App>> {
        self.apps.lock().unwrap().values().cloned().collect()
    }

    /// Sends one request to one app and waits for its reply until `deadline`.
    fn request(
        &self,
        app: &App,
        make: impl FnOnce(u64) -> AgentToApp,
        deadline: Instant,
    ) -> Result<AppReply, AppRequestError> {
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let (tx, rx): (Sender<AppReply>, Receiver<AppReply>) = mpsc::channel();
        app.pending.lock().unwrap().insert(id, tx);
        let sent = app
            .writer
            .lock()
            .unwrap()
            .write_all(&Frame::encode(&make(id)));
        if sent.is_err() {
            app.pending.lock().unwrap().remove(&id);
            return Err(AppRequestError::Gone { pid: app.pid });
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        let reply = rx.recv_timeout(wait);
        app.pending.lock().unwrap().remove(&id);
        match reply {
            Ok(reply) => Ok(reply),
            Err(RecvTimeoutError::Timeout) => Err(AppRequestError::Timeout {
                pid: app.pid,
                deadline_ms: wait.as_millis() as u64,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(AppRequestError::Gone { pid: app.pid }),
        }
    }

    /// Every connection of every registered process, asked in parallel.
    pub fn describe(&self, timeout: Duration) -> Vec<ConnectionInfo> {
        let deadline = Instant::now() + timeout;
        self.fan_out(|apps, app| {
            match apps.request(app, |request| AgentToApp::Describe { request }, deadline) {
                Ok(AppReply::Connections { connections }) => {
                    *app.last_described.lock().unwrap() = connections.clone();
                    connections
                }
                Ok(_) => {
                    warn!(pid = app.pid, "wrong reply to describe");
                    app.last_described.lock().unwrap().clone()
                }
                Err(e) => {
                    warn!("{e}");
                    app.last_described.lock().unwrap().clone()
                }
            }
        })
    }

    /// Sends a quiesce or resume to every process in parallel and gathers per-connection
    /// outcomes. A process that fails as a whole yields a failed outcome for each
    /// connection it last described.
    pub fn drive(
        &self,
        make: impl Fn(u64) -> AgentToApp + Sync,
        deadline: Instant,
    ) -> Vec<ConnectionOutcome> {
        self.fan_out(|apps, app| match apps.request(app, &make, deadline) {
            Ok(AppReply::Outcomes { outcomes }) => outcomes,
            Ok(_) => failed_outcomes(app, &AppRequestError::WrongReply { pid: app.pid }),
            Err(e) => failed_outcomes(app, &e),
        })
    }

    /// Hands a preloaded program's peer request to every registered process; the answer is
    /// the one process's that holds the QP ([`PeerAnswer::NotMine`] when none does, or
    /// none answered by `deadline`).
    pub fn relay(&self, from: &str, message: &PeerRequest, deadline: Instant) -> PeerAnswer {
        let answers = self.fan_out(|apps, app| {
            let asked = apps.request(
                app,
                |request| AgentToApp::Peer {
                    request,
                    from: from.to_owned(),
                    message: message.clone(),
                },
                deadline,
            );
            match asked {
                Ok(AppReply::Peer { answer }) => vec![answer],
                Ok(_) => {
                    warn!(pid = app.pid, "wrong reply to a peer request");
                    Vec::new()
                }
                Err(e) => {
                    debug!("peer request: {e}");
                    Vec::new()
                }
            }
        });
        answers
            .into_iter()
            .find(|a| *a != PeerAnswer::NotMine)
            .unwrap_or(PeerAnswer::NotMine)
    }

    /// Runs `per_app` for every registered process, at most [`MAX_PARALLEL_APPS`] at once
    /// (each process in turn resumes its own connections [`rdmamig_conn::registry::MAX_PARALLEL`]
    /// at a time, so reconnects reach the peers in bounded waves).
    fn fan_out<T: Send>(&self, per_app: impl Fn(&Apps, &App) -> Vec<T> + Sync) -> Vec<T> {
        let apps = self.snapshot();
        rdmamig_conn::registry::bounded_parallel(&apps, MAX_PARALLEL_APPS, |app| per_app(self, app))
            .into_iter()
            .flatten()
            .flatten()
            .collect()
    }
}

/// The application socket's one thread. It accepts connections and reads all of them,
/// waiting on every descriptor at once (poll), so that neither a registered process nor a
/// silent connection costs the agent a thread. Requests to a registered process are written
/// by the thread that makes them ([`Apps::request`]); only reading happens here.
struct Server {
    apps: Apps,
    listener: UnixListener,
    clients: Vec<Client>,
}

/// One connection to the application socket.
struct Client {
    stream: UnixStream,
    frames: FrameBuffer,
    /// Assembles messages sent in pieces, up to one frame before `Hello` and
    /// [`MAX_REPLY_LEN`] after.
    assembler: Assembler,
    /// Until its `Hello` is accepted: when it must have said it by.
    hello_by: Option<Instant>,
    /// Once registered: its key and entry.
    app: Option<(u64, Arc<App>)>,
}

/// Whether a connection stays open after what it sent.
#[derive(Debug, PartialEq, Eq)]
enum Keep {
    Open,
    Close,
}

/// Bound of a write to an application (a request, or a refusal). One that does not read
/// cannot stall the agent: the write fails and the process counts as gone.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);

impl Server {
    fn run(mut self) {
        loop {
            self.close_silent(Instant::now());
            self.publish_unregistered();
            let (listener_ready, ready) = match self.wait() {
                Ok(ready) => ready,
                Err(e) => {
                    warn!("waiting on the application socket failed: {e}");
                    thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            // Readable connections first (by index, before new ones are appended).
            let mut closed = Vec::new();
            for index in ready {
                if self.read(index) == Keep::Close {
                    closed.push(index);
                }
            }
            for index in closed.into_iter().rev() {
                let client = self.clients.swap_remove(index);
                self.apps.forget(&client.app);
            }
            if listener_ready {
                self.accept_all();
            }
        }
    }

    /// Waits until the listener or a connection is readable, or the next `Hello` is due;
    /// returns whether the listener is, and the indexes of the connections that are. The
    /// listener is left out while [`MAX_UNREGISTERED`] connections wait to say `Hello`.
    fn wait(&self) -> nix::Result<(bool, Vec<usize>)> {
        let mut fds = Vec::with_capacity(self.clients.len() + 1);
        let listen = if self.unregistered() < MAX_UNREGISTERED {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        fds.push(PollFd::new(self.listener.as_fd(), listen));
        fds.extend(
            self.clients
                .iter()
                .map(|c| PollFd::new(c.stream.as_fd(), PollFlags::POLLIN)),
        );
        let timeout = match self.clients.iter().filter_map(|c| c.hello_by).min() {
            // Rounded up, so that the wake-up is never before the time.
            Some(due) => {
                let ms = due.saturating_duration_since(Instant::now()).as_millis() + 1;
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            }
            None => PollTimeout::NONE,
        };
        match poll(&mut fds, timeout) {
            Ok(_) => {}
            Err(nix::Error::EINTR) => return Ok((false, Vec::new())),
            Err(e) => return Err(e),
        }
        let readable = |fd: &PollFd| fd.revents().is_some_and(|r| !r.is_empty());
        let ready = fds[1..]
            .iter()
            .enumerate()
            .filter(|(_, fd)| readable(fd))
            .map(|(index, _)| index)
            .collect();
        Ok((readable(&fds[0]), ready))
    }

    /// Accepts waiting connections while fewer than [`MAX_UNREGISTERED`] wait to say
    /// `Hello`; the rest stay in the socket's backlog.
    fn accept_all(&mut self) {
        while self.unregistered() < MAX_UNREGISTERED {
            match self.listener.accept() {
                Ok((stream, _)) => self.admit(stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    warn!("accepting an application failed: {e}");
                    return;
                }
            }
        }
    }

    fn admit(&mut self, stream: UnixStream) {
        if self.apps.apps.lock().unwrap().len() >= MAX_APPS {
            warn!("refusing an application: {MAX_APPS} already registered");
            return;
        }
        if let Err(e) = stream.set_write_timeout(Some(WRITE_TIMEOUT)) {
            warn!("refusing a connection: cannot bound writes to it: {e}");
            return;
        }
        self.clients.push(Client {
            stream,
            frames: FrameBuffer::new(),
            assembler: Assembler::new(MAX_FRAME_LEN),
            hello_by: Some(Instant::now() + HELLO_TIMEOUT),
            app: None,
        });
    }

    /// Closes the connections that have not said `Hello` in time.
    fn close_silent(&mut self, now: Instant) {
        self.clients.retain(|c| match c.hello_by {
            Some(due) if due <= now => {
                info!("closing a connection that did not say Hello within {HELLO_TIMEOUT:?}");
                false
            }
            _ => true,
        });
    }

    fn unregistered(&self) -> usize {
        self.clients.iter().filter(|c| c.app.is_none()).count()
    }

    /// Makes the number of connections waiting to say `Hello` visible outside this thread.
    fn publish_unregistered(&self) {
        self.apps
            .unregistered
            .store(self.unregistered(), Ordering::Release);
    }

    /// Reads what one readable connection sent (one read: poll said it will not block) and
    /// acts on each whole message.
    fn read(&mut self, index: usize) -> Keep {
        let client = &mut self.clients[index];
        let mut chunk = [0u8; 4096];
        let n = match (&client.stream).read(&mut chunk) {
            Ok(0) => return Keep::Close,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => return Keep::Open,
            Err(_) => return Keep::Close,
        };
        client.frames.push(&chunk[..n]);
        loop {
            let message = match client.frames.pop() {
                Ok(frame) => match client.assembler.take::<AppToAgent>(frame) {
                    Ok(Some(message)) => Ok(message),
                    Ok(None) => continue,
                    Err(e) => Err(e),
                },
                Err(FrameError::Incomplete { .. }) => return Keep::Open,
                Err(e) => Err(MessageError::Malformed(e)),
            };
            if self.apps.on_message(client, message) == Keep::Close {
                return Keep::Close;
            }
        }
    }
}

/// Why a `Hello` was refused.
#[derive(Debug, Error)]
pub enum HelloRefused {
    /// The kernel could not say which process is connected.
    #[error("cannot tell which process is connected")]
    Credentials(#[source] nix::Error),
    /// The `Hello` names another process than the one connected.
    #[error("the Hello names PID {named}, but the connecting process is PID {actual}")]
    NotItsPid {
        /// The pid the `Hello` gives.
        named: u32,
        /// The connecting process's.
        actual: i32,
    },
}

/// Whether the process at the other end of `stream` is `pid`, as the kernel says
/// (SO_PEERCRED).
fn check_sender(stream: &UnixStream, pid: u32) -> Result<(), HelloRefused> {
    let actual = getsockopt(stream, PeerCredentials)
        .map_err(HelloRefused::Credentials)?
        .pid();
    if u32::try_from(actual).ok() != Some(pid) {
        return Err(HelloRefused::NotItsPid { named: pid, actual });
    }
    Ok(())
}

/// Answers something unusable with [`AgentToApp::Refused`], through the registered app's
/// writer (so the answer cannot interleave with a request) or the bare socket before Hello.
fn refuse(socket: &UnixStream, app: &Option<(u64, Arc<App>)>, reason: String) {
    let frame = Frame::encode(&AgentToApp::Refused { reason });
    let sent = match app {
        Some((_, a)) => a.writer.lock().unwrap().write_all(&frame),
        None => (&*socket).write_all(&frame),
    };
    if let Err(e) = sent {
        debug!("answering a bad message failed: {e}");
    }
}

fn failed_outcomes(app: &App, error: &AppRequestError) -> Vec<ConnectionOutcome> {
    app.last_described
        .lock()
        .unwrap()
        .iter()
        .map(|c| ConnectionOutcome {
            id: c.id,
            ok: false,
            elapsed_ms: 0,
            error: Some(error.to_string()),
            fell_back: None,
        })
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    //! These drive the registry through a real UNIX socket with a scripted client: the
    //! logic under test is the agent's fan-out, deadlines and bookkeeping.
    use super::*;
    use rdmamig_proto::agent::{ConnectionState, Role};

    fn info(id: u64) -> ConnectionInfo {
        ConnectionInfo {
            id,
            pid: 7,
            role: Role::Active,
            local: "10.0.0.1:1".into(),
            peer: "10.0.0.2:2".into(),
            state: ConnectionState::Established,
            last_sent: 0,
            last_received: 0,
            unacked: 0,
            bridge: false,
            qp: None,
        }
    }

    /// A connection's successful outcome.
    fn ok(id: u64) -> ConnectionOutcome {
        ConnectionOutcome {
            id,
            ok: true,
            elapsed_ms: 1,
            error: None,
            fell_back: None,
        }
    }

    /// A scripted application: says hello, then answers each request with `answer`.
    fn client(path: &Path, answer: fn(AgentToApp) -> Option<AppToAgent>) {
        let mut stream = UnixStream::connect(path).unwrap();
        stream
            .write_all(&Frame::encode(&AppToAgent::Hello {
                pid: std::process::id(),
                program: "test".into(),
            }))
            .unwrap();
        thread::spawn(move || {
            let mut fb = FrameBuffer::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = stream.read(&mut buf) {
                if n == 0 {
                    break;
                }
                fb.push(&buf[..n]);
                while let Ok(frame) = fb.pop() {
                    if let Some(reply) = answer(frame.decode().unwrap()) {
                        let bytes = rdmamig_proto::message::encode(&reply).unwrap();
                        stream.write_all(&bytes).unwrap();
                    }
                }
            }
        });
    }

    /// A registry with one fake process that answers with `answer`.
    pub(in crate::agent) fn registry_with(
        answer: fn(AgentToApp) -> Option<AppToAgent>,
    ) -> (Apps, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let apps = Apps::new();
        apps.listen(&path, SocketAccess::default()).unwrap();
        client(&path, answer);
        let end = Instant::now() + Duration::from_secs(5);
        while apps.snapshot().is_empty() && Instant::now() < end {
            thread::sleep(Duration::from_millis(5));
        }
        (apps, dir)
    }

    #[test]
    fn describe_and_drive_collect_per_connection_results() {
        let (apps, _dir) = registry_with(|req| match req {
            AgentToApp::Describe { request } => Some(AppToAgent::Reply {
                request,
                body: AppReply::Connections {
                    connections: vec![info(1), info(2)],
                },
            }),
            AgentToApp::Quiesce { request, .. } | AgentToApp::Resume { request, .. } => {
                Some(AppToAgent::Reply {
                    request,
                    body: AppReply::Outcomes {
                        outcomes: vec![ok(1), ok(2)],
                    },
                })
            }
            AgentToApp::Peer { .. } | AgentToApp::Refused { .. } => None,
        });
        assert_eq!(apps.describe(Duration::from_secs(5)).len(), 2);
        let outcomes = apps.drive(
            |request| AgentToApp::Quiesce {
                request,
                deadline_ms: 100,
                bridge: false,
                hot: false,
            },
            Instant::now() + Duration::from_secs(5),
        );
        assert_eq!(outcomes.len(), 2);
        assert!(outcomes.iter().all(|o| o.ok));
    }

    /// A process with thousands of connections: its replies outgrow a frame, come in pieces
    /// and are taken whole.
    #[test]
    fn a_process_with_thousands_of_connections_answers_in_pieces() {
        const MANY: u64 = 3000;
        let (apps, _dir) = registry_with(|req| match req {
            AgentToApp::Describe { request } => Some(AppToAgent::Reply {
                request,
                body: AppReply::Connections {
                    connections: (1..=MANY).map(info).collect(),
                },
            }),
            AgentToApp::Quiesce { request, .. } | AgentToApp::Resume { request, .. } => {
                let outcomes = (1..=MANY).map(ok).collect();
                let body = AppReply::Outcomes { outcomes };
                assert!(serde_json::to_vec(&body).unwrap().len() > MAX_FRAME_LEN);
                Some(AppToAgent::Reply { request, body })
            }
            AgentToApp::Peer { .. } | AgentToApp::Refused { .. } => None,
        });
        assert_eq!(apps.describe(Duration::from_secs(5)).len(), MANY as usize);
        let outcomes = apps.drive(
            |request| AgentToApp::Resume {
                request,
                deadline_ms: 100,
            },
            Instant::now() + Duration::from_secs(5),
        );
        assert_eq!(outcomes.len(), MANY as usize);
        assert!(outcomes.iter().all(|o| o.ok));
    }

    /// Reads one frame from `stream` as the agent's answer.
    fn answer(stream: &mut UnixStream) -> Option<AgentToApp> {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut fb = FrameBuffer::new();
        let mut buf = [0u8; 4096];
        loop {
            match fb.pop() {
                Ok(frame) => return Some(frame.decode().unwrap()),
                Err(FrameError::Incomplete { .. }) => {}
                Err(e) => panic!("the agent sent a bad frame: {e}"),
            }
            let n = stream.read(&mut buf).ok()?;
            if n == 0 {
                return None;
            }
            fb.push(&buf[..n]);
        }
    }

    fn refused(answer: Option<AgentToApp>, what: &str) {
        match answer {
            Some(AgentToApp::Refused { reason }) => assert!(reason.contains(what), "{reason}"),
            other => panic!("expected a refusal naming {what:?}, got {other:?}"),
        }
    }

    #[test]
    fn bad_frames_are_refused_and_the_agent_keeps_serving() {
        let (apps, dir) = registry_with(|req| match req {
            AgentToApp::Describe { request } => Some(AppToAgent::Reply {
                request,
                body: AppReply::Connections {
                    connections: vec![info(3)],
                },
            }),
            _ => None,
        });
        let path = dir.path().join("agent.sock");
        // A frame whose payload is not a message: refused, the socket stays usable.
        let mut s = UnixStream::connect(&path).unwrap();
        let mut bad = b"RMG\x01".to_vec();
        bad.extend_from_slice(&5u32.to_be_bytes());
        bad.extend_from_slice(b"{oops");
        s.write_all(&bad).unwrap();
        refused(answer(&mut s), "malformed");
        s.write_all(&Frame::encode(&AppToAgent::Hello {
            pid: std::process::id(),
            program: "late".into(),
        }))
        .unwrap();
        // Oversized and garbage: refused, then the socket is closed.
        let mut s2 = UnixStream::connect(&path).unwrap();
        let mut oversized = b"RMG\x01".to_vec();
        oversized.extend_from_slice(&u32::MAX.to_be_bytes());
        s2.write_all(&oversized).unwrap();
        refused(answer(&mut s2), "exceeds");
        assert_eq!(answer(&mut s2), None, "the socket should be closed");
        let mut s3 = UnixStream::connect(&path).unwrap();
        s3.write_all(b"hello agent, please run rm -rf /").unwrap();
        refused(answer(&mut s3), "magic");
        // The agent still serves the well-behaved process (and the late one registered).
        let end = Instant::now() + Duration::from_secs(5);
        while apps.snapshot().len() < 2 && Instant::now() < end {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(apps.snapshot().len(), 2);
        let described = apps.describe(Duration::from_millis(500));
        assert!(described.iter().any(|c| c.id == 3), "{described:?}");
    }

    #[test]
    fn a_silent_process_fails_each_of_its_connections_at_the_deadline() {
        let (apps, _dir) = registry_with(|req| match req {
            AgentToApp::Describe { request } => Some(AppToAgent::Reply {
                request,
                body: AppReply::Connections {
                    connections: vec![info(5)],
                },
            }),
            _ => None,
        });
        apps.describe(Duration::from_secs(5));
        let start = Instant::now();
        let outcomes = apps.drive(
            |request| AgentToApp::Quiesce {
                request,
                deadline_ms: 100,
                bridge: false,
                hot: false,
            },
            Instant::now() + Duration::from_millis(200),
        );
        assert!(start.elapsed() < Duration::from_secs(3));
        assert_eq!(outcomes.len(), 1);
        assert!(!outcomes[0].ok);
        assert!(outcomes[0]
            .error
            .as_ref()
            .unwrap()
            .contains("did not answer"));
    }

    #[test]
    fn a_process_that_says_it_cannot_be_carried_counts_as_unmanaged_until_it_can() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let apps = Apps::new();
        apps.listen(&path, SocketAccess::default()).unwrap();
        let mut s = UnixStream::connect(&path).unwrap();
        let me = std::process::id();
        s.write_all(&Frame::encode(&AppToAgent::Hello {
            pid: me,
            program: "listener".into(),
        }))
        .unwrap();
        let until = |carried: bool| {
            let end = Instant::now() + Duration::from_secs(5);
            while apps.carried_pids().contains(&me) != carried && Instant::now() < end {
                thread::sleep(Duration::from_millis(5));
            }
            apps.carried_pids().contains(&me) == carried
        };
        assert!(until(true), "registered and carried");
        s.write_all(&Frame::encode(&AppToAgent::Carried {
            not_because: Some("an rdma_cm id listens".into()),
        }))
        .unwrap();
        assert!(until(false), "still counted as carried");
        assert_eq!(
            apps.snapshot().len(),
            1,
            "it stays registered (its peers' requests)"
        );
        s.write_all(&Frame::encode(&AppToAgent::Carried { not_because: None }))
            .unwrap();
        assert!(until(true), "carried again");
    }

    #[test]
    fn a_hello_that_names_another_process_is_refused() {
        let (apps, dir) = registry_with(|_| None);
        let before = apps.snapshot().len();
        let mut s = UnixStream::connect(dir.path().join("agent.sock")).unwrap();
        s.write_all(&Frame::encode(&AppToAgent::Hello {
            pid: 1,
            program: "impostor".into(),
        }))
        .unwrap();
        refused(
            answer(&mut s),
            "the Hello names PID 1, but the connecting process is PID",
        );
        assert_eq!(answer(&mut s), None, "the impostor's socket was not closed");
        assert_eq!(apps.snapshot().len(), before, "the impostor was registered");
        assert!(!apps.carried_pids().contains(&1));
    }

    #[test]
    fn silent_connections_are_bounded_in_number_and_in_time() {
        let (apps, dir) = registry_with(|_| None);
        let path = dir.path().join("agent.sock");
        let silent: Vec<UnixStream> = (0..MAX_UNREGISTERED)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        // Until they are counted, a newcomer may still get in: wait for the count.
        let end = Instant::now() + Duration::from_secs(5);
        while apps.unregistered.load(Ordering::Acquire) < MAX_UNREGISTERED && Instant::now() < end {
            thread::sleep(Duration::from_millis(5));
        }
        // One more waits in the backlog, unserved, while they hold every place.
        let mut one_more = UnixStream::connect(&path).unwrap();
        one_more
            .write_all(&Frame::encode(&AppToAgent::Hello {
                pid: std::process::id(),
                program: "late".into(),
            }))
            .unwrap();
        thread::sleep(Duration::from_millis(500));
        assert_eq!(
            apps.snapshot().len(),
            1,
            "a connection past the bound was served while the silent ones waited"
        );
        let mut byte = [0u8; 1];
        // The silent ones are closed once their time to say Hello is up.
        let started = Instant::now();
        for mut stream in silent {
            stream
                .set_read_timeout(Some(HELLO_TIMEOUT + Duration::from_secs(5)))
                .unwrap();
            assert_eq!(stream.read(&mut byte).unwrap_or(0), 0);
        }
        assert!(started.elapsed() < HELLO_TIMEOUT + Duration::from_secs(5));
        let end = Instant::now() + Duration::from_secs(5);
        while apps.unregistered.load(Ordering::Acquire) > 0 && Instant::now() < end {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(apps.unregistered.load(Ordering::Acquire), 0);
        // The one that waited is served once they are gone; the first is still served.
        let end = Instant::now() + Duration::from_secs(5);
        while apps.snapshot().len() < 2 && Instant::now() < end {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            apps.snapshot().len(),
            2,
            "the waiting Hello was never served"
        );
        drop(one_more);
    }

    /// The threads of this process (every test's, since they share it).
    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task").unwrap().count()
    }

    #[test]
    fn connections_cost_no_thread_each() {
        let (apps, dir) = registry_with(|_| None);
        let path = dir.path().join("agent.sock");
        let before = threads();
        // Registered processes that never read, and silent connections: no client thread.
        let registered: Vec<UnixStream> = (0..100)
            .map(|_| {
                let mut s = UnixStream::connect(&path).unwrap();
                s.write_all(&Frame::encode(&AppToAgent::Hello {
                    pid: std::process::id(),
                    program: "many".into(),
                }))
                .unwrap();
                s
            })
            .collect();
        let end = Instant::now() + Duration::from_secs(5);
        while apps.snapshot().len() < 101 && Instant::now() < end {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(apps.snapshot().len(), 101);
        let silent: Vec<UnixStream> = (0..MAX_UNREGISTERED)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        thread::sleep(Duration::from_millis(200));
        // Other tests run threads in this process meanwhile: a thread per connection would
        // be 132 more, far above what they start.
        let added = threads().saturating_sub(before);
        assert!(added < 32, "{added} threads for 132 connections");
        drop((registered, silent));
    }
}
