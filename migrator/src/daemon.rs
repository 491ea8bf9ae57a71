//! `rdmamig daemon`: runs moves on behalf of clients on a local UNIX socket, journals them,
//! keeps their reports, and finishes the moves a killed daemon left behind.
//!
//! The socket can make the host unplug devices and migrate VMs, so it is created with mode
//! 0600 (bound under a temporary name, restricted, then renamed into place, so it is never
//! reachable with wider permissions) and every client's credentials are checked: only root
//! and the daemon's own user are served.
//!
//! A move belongs to the daemon, not to the client that asked for it: a client that goes
//! away mid-move does not stop it halfway (a half-done move is worse than either end). Moves
//! of different VMs run concurrently up to a limit; a second move of a VM that is already
//! moving (or being recovered) is refused. Every move has a journal and, once it ended, a JSON
//! report under `<state-dir>/moves/`. At start-up, every journal without an end is recovered
//! ([`crate::moving::recover`]) before the socket accepts a move of that VM. On SIGINT/SIGTERM
//! the daemon stops accepting and waits for running moves, which are all bounded by their
//! deadlines.

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::api::{ClientRequest, DaemonMessage, HeldVm, MoveSummary, RunningMove};
use crate::channel::{Channel, ChannelError};
use crate::config::MovesConfig;
use crate::journal::{self, Journal, JournalError};
use crate::listen::{Admission, API_CONNECTIONS, METRICS_CONNECTIONS};
use crate::machine::Phase;
use crate::metrics::Metrics;
use crate::moving::{recover, run_move, MoveContext};
use crate::peer::{Destination, Scope};
use crate::plan::MovePlan;
use crate::report::{MoveEvent, MoveReport};
use crate::retention::{self, Retention};
use crate::strategy::choose_for;
use rdmamig_proto::clock::unix_ms;
use rdmamig_proto::text::error_chain;

/// Time a client has to send its request after connecting.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Time one message to a client may take to write: a client that stops reading (a stopped
/// terminal, `rdmamig migrate | less`) is dropped after it, and never holds up a move.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Events a move's client may fall behind by before it misses some.
const CLIENT_BACKLOG: usize = 1024;

/// How the daemon runs.
#[derive(Clone)]
pub struct DaemonConfig {
    /// The socket to listen on.
    pub socket: PathBuf,
    /// Where journals and reports live (`<state_dir>/moves/`).
    pub state_dir: PathBuf,
    /// How many moves may run at once.
    pub max_moves: usize,
    /// The defaults of moves (`[moves]` in the config file).
    pub moves: MovesConfig,
    /// How moves reach VMMs and agents, and the boundary hook.
    pub context: MoveContext,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<std::net::SocketAddr>,
    /// Where to serve the destination's duties to other migrators (mutual TLS), if anywhere;
    /// the identity is the context's `peers`.
    pub peer_listen: Option<String>,
    /// The VMM paths those migrators may name (`[peer] vmm_paths`).
    pub peer_vmm_paths: Vec<PathBuf>,
    /// How many finished moves' journals and reports to keep.
    pub retention: Retention,
}

/// Why the daemon could not run.
#[derive(Debug, Error)]
pub enum DaemonError {
    /// Another daemon answers on the socket.
    #[error("another rdmamig daemon is listening on {socket}")]
    AlreadyRunning {
        /// The socket.
        socket: PathBuf,
    },
    /// The socket path holds something that is not a socket, which the daemon will not
    /// remove.
    #[error("{socket} exists and is not a socket; give --socket a path of its own")]
    NotASocket {
        /// The path.
        socket: PathBuf,
    },
    /// The socket could not be created, restricted or put in place.
    #[error("cannot create the daemon socket {socket}")]
    Bind {
        /// The socket.
        socket: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("cannot install the signal handlers")]
    Signals(#[source] std::io::Error),
    /// The metrics address could not be bound.
    #[error("cannot serve metrics on {address}")]
    Metrics {
        /// The address.
        address: std::net::SocketAddr,
        /// What bind said.
        #[source]
        source: std::io::Error,
    },
    /// The peer address could not be bound.
    #[error("cannot listen for peer migrators on {address}")]
    Peer {
        /// The address.
        address: String,
        /// What bind said.
        #[source]
        source: std::io::Error,
    },
    /// The journal directory could not be listed.
    #[error("cannot list the move journals")]
    Journals(#[source] JournalError),
}

/// What every client task shares.
struct Shared {
    config: DaemonConfig,
    /// Running moves by id.
    running: Mutex<HashMap<String, RunningMove>>,
    /// VMs whose unfinished move's journal is damaged: never moved by this daemon.
    held: Vec<HeldVm>,
    next_id: AtomicU64,
    metrics: Mutex<Metrics>,
}

impl Shared {
    fn moves_dir(&self) -> PathBuf {
        self.config.state_dir.join("moves")
    }

    /// Registers a move of `plan`'s VM unless the VM is already moving (by its name, or by
    /// a VMM another move drives: two names for one VM are still one VM) or the limit is
    /// reached.
    fn admit(&self, plan: &MovePlan, recovering: bool) -> Result<String, String> {
        let vm = &plan.vm;
        if let Some(held) = self.held.iter().find(|h| &h.vm == vm) {
            return Err(format!(
                "VM {vm} is held: its unfinished move's journal {} cannot be read ({}), so \
                 how far that move got is unknown; check the VM and its devices by hand, then \
                 move the journal aside and restart the daemon",
                held.journal, held.reason
            ));
        }
        let vmms = vmms_of(plan);
        let mut running = lock(&self.running);
        let busy = running
            .values()
            .find(|m| &m.vm == vm || m.vmms.iter().any(|v| vmms.contains(v)));
        if let Some(other) = busy {
            return Err(format!(
                "VM {vm} is already moving (move {} of VM {}, phase {}, with VMMs {}); one \
                 move per VM at a time",
                other.id,
                other.vm,
                other.phase,
                other.vmms.join(", ")
            ));
        }
        if !recovering && running.len() >= self.config.max_moves {
            return Err(format!(
                "{} moves are running, the limit (--max-moves {}); try again later",
                running.len(),
                self.config.max_moves
            ));
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let id = journal::move_id(vm, n);
        running.insert(
            id.clone(),
            RunningMove {
                id: id.clone(),
                vm: vm.clone(),
                phase: Phase::Prepare,
                started_unix_ms: unix_ms(),
                recovering,
                vmms,
            },
        );
        Ok(id)
    }

    fn register_recovery(&self, id: &str, plan: &MovePlan, phase: Phase) {
        lock(&self.running).insert(
            id.into(),
            RunningMove {
                id: id.into(),
                vm: plan.vm.clone(),
                phase,
                started_unix_ms: unix_ms(),
                recovering: true,
                vmms: vmms_of(plan),
            },
        );
    }

    fn set_phase(&self, id: &str, phase: Phase) {
        if let Some(m) = lock(&self.running).get_mut(id) {
            m.phase = phase;
        }
    }

    /// Stores the report and forgets the running move.
    fn finish(&self, report: &MoveReport) {
        lock(&self.running).remove(&report.id);
        lock(&self.metrics).record(report);
        let path = self.moves_dir().join(format!("{}.json", report.id));
        let text = serde_json::to_string_pretty(report).unwrap_or_default() + "\n";
        if let Err(e) = crate::durable::write(&path, text.as_bytes()) {
            tracing::error!(path = %path.display(), "cannot store the move report: {e}");
        }
        let svg = path.with_extension("svg");
        match crate::svg::timeline_svg(report) {
            Ok(picture) => {
                if let Err(e) = crate::durable::write(&svg, picture.as_bytes()) {
                    tracing::error!(path = %svg.display(), "cannot store the timeline: {e}");
                }
            }
            Err(e) => tracing::error!("{e}"),
        }
        self.prune();
        match &report.error {
            None => tracing::info!(
                move_id = %report.id,
                vm = %report.plan.vm,
                total_ms = report.timeline.total_ms,
                "move done"
            ),
            Some(error) => tracing::warn!(
                move_id = %report.id,
                vm = %report.plan.vm,
                outcome = %report.final_phase,
                "move did not complete: {error}"
            ),
        }
    }
}

impl Shared {
    /// Removes the files of finished moves the retention does not keep.
    fn prune(&self) {
        let pruned = retention::prune(
            &self.moves_dir(),
            &self.config.retention,
            std::time::SystemTime::now(),
        );
        if !pruned.moves.is_empty() {
            tracing::info!(moves = ?pruned.moves, "pruned the journals and reports of old moves");
        }
        for failure in pruned.failures {
            tracing::warn!("cannot prune {failure}");
        }
    }
}

/// The control sockets of the VMMs a move drives on this host, as they identify a VM
/// better than the free-text name: the source's, and the destination's unless another
/// migrator drives it (its path is on that host).
fn vmms_of(plan: &MovePlan) -> Vec<String> {
    let mut endpoints = vec![&plan.source];
    if plan.destination_migrator.is_none() {
        endpoints.extend(&plan.destination);
    }
    endpoints
        .into_iter()
        .map(|endpoint| {
            let socket = endpoint.control_socket();
            std::fs::canonicalize(socket)
                .unwrap_or_else(|_| socket.into())
                .display()
                .to_string()
        })
        .collect()
}

/// Raises the soft limit on open descriptors to the hard one: the listeners' limits
/// (docs/migrator.md) and the moves fit the usual 1024, but a host's VMM count should not
/// be what decides it. Failing to raise it is not fatal.
fn raise_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid, exclusively borrowed `limit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit only reads the valid `raised`.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            tracing::warn!(
                "cannot raise the descriptor limit: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Listens on the configured socket and serves clients until SIGINT or SIGTERM.
pub async fn serve(config: DaemonConfig) -> Result<(), DaemonError> {
    raise_descriptor_limit();
    let socket = config.socket.clone();
    let listener = bind(&socket).await?;
    let placed = match std::fs::metadata(&socket) {
        Ok(placed) => placed,
        Err(source) => {
            let _ = std::fs::remove_file(&socket);
            return Err(DaemonError::Bind { socket, source });
        }
    };
    // Whatever ends the daemon, from here on (a metrics port in use, say), the socket goes
    // with it: a socket left behind would only refuse connections.
    let served = serve_on(listener, placed.uid(), placed.ino(), config).await;
    remove_own_socket(&socket, placed.ino());
    served
}

/// [`serve`] once the socket is in place: `owner` owns it, `inode` is its file's.
async fn serve_on(
    listener: UnixListener,
    owner: u32,
    inode: u64,
    config: DaemonConfig,
) -> Result<(), DaemonError> {
    let socket = config.socket.clone();
    let journals = journal::scan(&config.state_dir.join("moves")).map_err(DaemonError::Journals)?;
    for aside in &journals.set_aside {
        let error = error_chain(&aside.error);
        match &aside.to {
            Ok(to) => tracing::warn!(
                journal = %aside.from.display(),
                set_aside = %to.display(),
                "a journal that cannot be read was set aside ({}): {error}",
                aside.over
            ),
            Err(e) => tracing::error!(
                journal = %aside.from.display(),
                "a journal that cannot be read ({}) could not be set aside ({e}): {error}",
                aside.over
            ),
        }
    }
    let mut held = Vec::new();
    for damaged in journals.damaged {
        let reason = error_chain(&damaged.error);
        match damaged.vm {
            Some(vm) => {
                tracing::error!(
                    journal = %damaged.path.display(),
                    %vm,
                    "an unfinished move's journal cannot be read, so it is not recovered and \
                     its VM is held: {reason}"
                );
                held.push(HeldVm {
                    vm,
                    journal: damaged.path.display().to_string(),
                    reason,
                });
            }
            None => tracing::error!(
                journal = %damaged.path.display(),
                "a journal cannot be read and was left in place: {reason}"
            ),
        }
    }
    let shared = Arc::new(Shared {
        config,
        held,
        running: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
        metrics: Mutex::new(Metrics::default()),
    });
    if let Some(address) = shared.config.metrics {
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|source| DaemonError::Metrics { address, source })?;
        tracing::info!(%address, "serving Prometheus metrics");
        let shared = shared.clone();
        tokio::spawn(serve_metrics(listener, shared));
    }
    let listen = shared.config.peer_listen.clone();
    if let Some((address, tls)) = listen.zip(shared.config.context.peers.clone()) {
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|source| DaemonError::Peer {
                address: address.clone(),
                source,
            })?;
        tracing::info!(%address, "serving peer migrators (mutual TLS)");
        let destination = Arc::new(Destination {
            tls,
            pool: shared.config.context.pool.clone(),
            backends: shared.config.context.backends.clone(),
            scope: Scope::new(shared.config.peer_vmm_paths.clone()),
        });
        tokio::spawn(async move {
            if let Err(e) = crate::peer::serve(listener, destination).await {
                tracing::error!("peer service stopped: {}", error_chain(&e));
            }
        });
    }
    let mut interrupt = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut clients = JoinSet::new();
    shared.prune();
    for (path, replay) in journals.unfinished {
        let shared = shared.clone();
        shared.register_recovery(
            &replay.id,
            &replay.plan,
            replay.last_phase().unwrap_or(Phase::Prepare),
        );
        tracing::warn!(move_id = %replay.id, vm = %replay.plan.vm, "recovering an unfinished move");
        clients.spawn(async move {
            let id = replay.id.clone();
            let (events, received) = mpsc::unbounded_channel();
            match Journal::reopen(&path) {
                Ok(journal) => {
                    let task = recover(replay, journal, shared.config.context.clone(), events);
                    drive::<UnixStream>(&shared, &id, task, received, None).await;
                }
                Err(e) => {
                    tracing::error!(move_id = %id, "{}", error_chain(&e));
                    lock(&shared.running).remove(&id);
                }
            }
        });
    }
    tracing::info!(socket = %socket.display(), "rdmamig daemon listening");
    let admission = Admission::new("api", API_CONNECTIONS);
    loop {
        tokio::select! {
            ((stream, _), slot) = admission.next(|| listener.accept()) => {
                let shared = shared.clone();
                clients.spawn(async move {
                    serve_client(stream, owner, shared).await;
                    drop(slot);
                });
            }
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
        }
    }
    drop(listener);
    remove_own_socket(&socket, inode);
    if !clients.is_empty() {
        tracing::info!(clients = clients.len(), "waiting for running moves to end");
    }
    while clients.join_next().await.is_some() {}
    Ok(())
}

/// Creates the listening socket with mode 0600, replacing a stale socket; anything at the
/// path that is not a socket is left alone and refused.
async fn bind(socket: &Path) -> Result<UnixListener, DaemonError> {
    use std::os::unix::fs::FileTypeExt;
    let bind_error = |source| DaemonError::Bind {
        socket: socket.into(),
        source,
    };
    if let Ok(existing) = std::fs::symlink_metadata(socket) {
        if !existing.file_type().is_socket() {
            return Err(DaemonError::NotASocket {
                socket: socket.into(),
            });
        }
        if UnixStream::connect(socket).await.is_ok() {
            return Err(DaemonError::AlreadyRunning {
                socket: socket.into(),
            });
        }
        std::fs::remove_file(socket).map_err(bind_error)?;
    }
    let mut temporary = socket.as_os_str().to_owned();
    temporary.push(format!(".{}.tmp", std::process::id()));
    let temporary = PathBuf::from(temporary);
    let _ = std::fs::remove_file(&temporary);
    let listener = UnixListener::bind(&temporary).map_err(bind_error)?;
    let placed = std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&temporary, socket));
    if let Err(source) = placed {
        let _ = std::fs::remove_file(&temporary);
        return Err(bind_error(source));
    }
    Ok(listener)
}

/// Removes the daemon's socket at shutdown, unless something else has replaced it since.
fn remove_own_socket(socket: &Path, inode: u64) {
    if std::fs::symlink_metadata(socket).is_ok_and(|m| m.ino() == inode) {
        let _ = std::fs::remove_file(socket);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn reject<S: AsyncRead + AsyncWrite + Unpin>(channel: &mut Channel<S>, reason: String) {
    forward(channel, &DaemonMessage::Rejected { reason }).await;
}

async fn serve_client(stream: UnixStream, owner: u32, shared: Arc<Shared>) {
    let peer_uid = stream.peer_cred().map(|c| c.uid()).ok();
    let mut channel = Channel::new(stream);
    if !matches!(peer_uid, Some(uid) if uid == 0 || uid == owner) {
        tracing::warn!(
            ?peer_uid,
            "refused a client that is neither root nor the daemon's user"
        );
        let reason = "permission denied: only root and the daemon's user may ask for moves";
        reject(&mut channel, reason.into()).await;
        return;
    }
    let request = match tokio::time::timeout(REQUEST_TIMEOUT, channel.receive()).await {
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            let reason = format!("bad request: {}", error_chain(&e));
            tracing::warn!("{reason}");
            reject(&mut channel, reason).await;
            return;
        }
        Err(_) => {
            let reason = format!("no request within {} s", REQUEST_TIMEOUT.as_secs());
            reject(&mut channel, reason).await;
            return;
        }
    };
    match request {
        ClientRequest::Migrate { plan } => serve_move(channel, *plan, shared).await,
        ClientRequest::Pool => {
            let functions = shared.config.context.pool.list();
            forward(&mut channel, &DaemonMessage::Pool { functions }).await;
        }
        ClientRequest::PoolReturn { function } => {
            let pool = shared.config.context.pool.clone();
            // The check may reset a real device: off the async threads.
            let name = function.clone();
            let checked = tokio::task::spawn_blocking(move || {
                pool.return_to_pool(&name, crate::pool::reset)
                    .map_err(|e| error_chain(&e))
            })
            .await
            .unwrap_or_else(|e| Err(format!("internal error: the check ended abnormally: {e}")));
            match checked {
                Ok(check) => {
                    tracing::info!(%function, %check, "function returned to the pool");
                    forward(&mut channel, &DaemonMessage::Returned { function, check }).await;
                }
                Err(reason) => {
                    tracing::warn!(%function, "refused to return a function to the pool: {reason}");
                    reject(&mut channel, reason).await;
                }
            }
        }
        ClientRequest::PoolAssign { function, vm } => {
            match shared.config.context.pool.assign(&function, &vm) {
                Ok(()) => {
                    tracing::info!(%function, %vm, "function assigned to a VM started outside a move");
                    forward(&mut channel, &DaemonMessage::Assigned { function, vm }).await;
                }
                Err(e) => reject(&mut channel, error_chain(&e)).await,
            }
        }
        ClientRequest::Status => {
            let mut moves: Vec<RunningMove> = lock(&shared.running).values().cloned().collect();
            moves.sort_by(|a, b| a.id.cmp(&b.id));
            let limit = shared.config.max_moves;
            let held = shared.held.clone();
            forward(&mut channel, &DaemonMessage::Status { moves, limit, held }).await;
        }
        ClientRequest::History { limit } => {
            let moves = history(&shared.moves_dir(), limit);
            forward(&mut channel, &DaemonMessage::History { moves }).await;
        }
        ClientRequest::Report { id } => match load_report(&shared.moves_dir(), &id) {
            Ok(report) => {
                let message = DaemonMessage::Report {
                    report: Box::new(report),
                };
                forward(&mut channel, &message).await;
            }
            Err(reason) => reject(&mut channel, reason).await,
        },
    }
}

/// The reports of ended moves, newest first.
fn history(dir: &Path, limit: usize) -> Vec<MoveSummary> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut moves: Vec<MoveSummary> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|bytes| serde_json::from_slice::<MoveReport>(&bytes).ok())
        .map(|r| MoveSummary {
            casualties: r.casualties().count(),
            id: r.id,
            vm: r.plan.vm,
            outcome: r.final_phase,
            started_unix_ms: r.timeline.started_unix_ms,
            total_ms: r.timeline.total_ms,
            error: r.error,
        })
        .collect();
    moves.sort_by(|a, b| {
        b.started_unix_ms
            .cmp(&a.started_unix_ms)
            .then(b.id.cmp(&a.id))
    });
    moves.truncate(limit);
    moves
}

fn load_report(dir: &Path, id: &str) -> Result<MoveReport, String> {
    if !journal::is_move_id(id) {
        return Err(format!("{id:?} is not a move id"));
    }
    let path = dir.join(format!("{id}.json"));
    let bytes = std::fs::read(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            format!("no report for move {id} (running moves have none yet; see `rdmamig status`)")
        }
        _ => format!("cannot read {}: {e}", path.display()),
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("the report {} is corrupt: {e}", path.display()))
}

async fn serve_move(mut channel: Channel<UnixStream>, mut plan: MovePlan, shared: Arc<Shared>) {
    // Journaled as it runs: a recovery, and the report, see the policy this daemon chose.
    plan.unmanaged.get_or_insert(shared.config.moves.unmanaged);
    if let Err(e) = plan.validate() {
        reject(&mut channel, format!("the plan cannot run: {e}")).await;
        return;
    }
    let context = &shared.config.context;
    let choice = match choose_for(&plan, context.backends.as_ref(), &context.pool).await {
        Ok(choice) => choice,
        Err(e) => {
            reject(&mut channel, format!("the plan cannot run: {e}")).await;
            return;
        }
    };
    if let Err(e) = shared.config.context.destination(&plan) {
        reject(
            &mut channel,
            format!("the plan cannot run: {}", error_chain(&e)),
        )
        .await;
        return;
    }
    let id = match shared.admit(&plan, false) {
        Ok(id) => id,
        Err(reason) => {
            reject(&mut channel, reason).await;
            return;
        }
    };
    let journal = match Journal::create(&shared.moves_dir(), &id, &plan) {
        Ok(journal) => journal,
        Err(e) => {
            lock(&shared.running).remove(&id);
            reject(
                &mut channel,
                format!("the move cannot be journaled: {}", error_chain(&e)),
            )
            .await;
            return;
        }
    };
    tracing::info!(move_id = %id, vm = %plan.vm, strategy = %plan.strategy, "move started");
    let (events, received) = mpsc::unbounded_channel();
    let task = run_move(
        id.clone(),
        plan,
        choice,
        journal,
        shared.config.context.clone(),
        events,
    );
    let report = drive(&shared, &id, task, received, Some(&mut channel)).await;
    if let Some(report) = report {
        forward(
            &mut channel,
            &DaemonMessage::Report {
                report: Box::new(report),
            },
        )
        .await;
    }
}

/// Runs a move task to its end, tracking its phase, and records its end (report, metrics,
/// the running list) the moment it ends, whatever its client does. Events are forwarded to
/// the client while it keeps up: one that falls [`CLIENT_BACKLOG`] events behind misses the
/// rest of them (it still gets the report), and one that stops reading for
/// [`WRITE_TIMEOUT`] is dropped.
async fn drive<S: AsyncRead + AsyncWrite + Unpin>(
    shared: &Shared,
    id: &str,
    task: impl std::future::Future<Output = MoveReport> + Send + 'static,
    mut received: mpsc::UnboundedReceiver<MoveEvent>,
    client: Option<&mut Channel<S>>,
) -> Option<MoveReport> {
    let task = tokio::spawn(task);
    let (to_client, mut for_client) = mpsc::channel(CLIENT_BACKLOG);
    let track = async move {
        let mut lagging = false;
        while let Some(event) = received.recv().await {
            if let MoveEvent::PhaseStarted { phase, .. } = &event {
                shared.set_phase(id, *phase);
            }
            if to_client.try_send(event).is_err() && !lagging && !to_client.is_closed() {
                lagging = true;
                tracing::warn!(move_id = %id, "the client is not keeping up; it misses events");
            }
        }
        drop(to_client);
        match task.await {
            Ok(report) => {
                shared.finish(&report);
                Some(report)
            }
            Err(e) => {
                tracing::error!(move_id = %id, "the move task ended abnormally: {e}");
                lock(&shared.running).remove(id);
                None
            }
        }
    };
    let forwarding = async move {
        let channel = client?;
        while let Some(event) = for_client.recv().await {
            if !forward(channel, &DaemonMessage::Event { event }).await {
                return None;
            }
        }
        Some(channel)
    };
    let (report, client) = tokio::join!(track, forwarding);
    if report.is_none() {
        if let Some(channel) = client {
            let reason = "internal error: the move task ended abnormally".to_string();
            reject(channel, reason).await;
        }
    }
    report
}

/// Sends one message within [`WRITE_TIMEOUT`]; returns whether the client is still there.
async fn forward<S: AsyncRead + AsyncWrite + Unpin>(
    channel: &mut Channel<S>,
    message: &DaemonMessage,
) -> bool {
    match tokio::time::timeout(WRITE_TIMEOUT, channel.send(message)).await {
        Ok(Ok(())) => true,
        Ok(Err(e @ ChannelError::TooLarge { .. })) => {
            tracing::error!("{}", error_chain(&e));
            let reason = format!("the daemon could not send its answer: {e}");
            let rejected = DaemonMessage::Rejected { reason };
            matches!(
                tokio::time::timeout(WRITE_TIMEOUT, channel.send(&rejected)).await,
                Ok(Ok(()))
            )
        }
        Ok(Err(e)) => {
            tracing::info!("client gone ({}); the move goes on", error_chain(&e));
            false
        }
        Err(_) => {
            tracing::warn!(
                "a client stopped reading for {} s; it is dropped (a move goes on)",
                WRITE_TIMEOUT.as_secs()
            );
            false
        }
    }
}

/// How long a scrape has to send its request headers.
const METRICS_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Serves the metrics over HTTP/1 (hyper) on `listener`: `GET /metrics` gets the text
/// exposition, another path 404, another method 405. A connection has
/// [`METRICS_REQUEST_TIMEOUT`] to send its headers and [`WRITE_TIMEOUT`] more to take the
/// answer; at most [`METRICS_CONNECTIONS`] are served at once.
async fn serve_metrics(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Method, Request, Response, StatusCode};
    use hyper_util::rt::{TokioIo, TokioTimer};

    let admission = Admission::new("metrics", METRICS_CONNECTIONS);
    loop {
        let ((stream, _), slot) = admission.next(|| listener.accept()).await;
        let shared = shared.clone();
        let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
            let shared = shared.clone();
            async move {
                let (status, body) = match (request.method(), request.uri().path()) {
                    (&Method::GET, "/metrics") => {
                        let running = lock(&shared.running).len();
                        (StatusCode::OK, lock(&shared.metrics).render(running))
                    }
                    (&Method::GET, _) => (StatusCode::NOT_FOUND, "try /metrics\n".to_string()),
                    _ => (
                        StatusCode::METHOD_NOT_ALLOWED,
                        "only GET /metrics\n".to_string(),
                    ),
                };
                Response::builder()
                    .status(status)
                    .header("Content-Type", "text/plain; version=0.0.4")
                    .body(Full::new(Bytes::from(body)))
            }
        });
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(METRICS_REQUEST_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            let limit = METRICS_REQUEST_TIMEOUT + WRITE_TIMEOUT;
            if let Ok(Err(e)) = tokio::time::timeout(limit, connection).await {
                tracing::debug!(error = %e, "a metrics connection failed");
            }
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fakes::{FakeBackends, FakeHost};
    use crate::plan::tests::plan;
    use crate::pool::{Pool, PoolConfig};
    use crate::strategy::Choice;

    fn shared(dir: &Path) -> Shared {
        let pool = Pool::open(&PoolConfig::default(), &dir.join("pool.json")).unwrap();
        Shared {
            config: DaemonConfig {
                socket: dir.join("daemon.sock"),
                state_dir: dir.into(),
                max_moves: 4,
                moves: MovesConfig::default(),
                context: MoveContext {
                    backends: Arc::new(FakeBackends(FakeHost::new())),
                    pool: Arc::new(pool),
                    peers: None,
                    boundary: None,
                },
                metrics: None,
                peer_listen: None,
                peer_vmm_paths: Vec::new(),
                retention: Retention::default(),
            },
            held: Vec::new(),
            running: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            metrics: Mutex::new(Metrics::default()),
        }
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_never_holds_up_the_end_of_its_move() {
        let dir = tempfile::tempdir().unwrap();
        let shared = shared(dir.path());
        // The client's end takes 16 bytes and is never read: the first event blocks.
        let (daemon_end, _client_end) = tokio::io::duplex(16);
        let mut channel = Channel::new(daemon_end);
        let id = shared.admit(&plan(), false).unwrap();
        let journal = Journal::create(&shared.moves_dir(), &id, &plan()).unwrap();
        let (events, received) = mpsc::unbounded_channel();
        let context = shared.config.context.clone();
        let task = run_move(
            id.clone(),
            plan(),
            Choice::asked(plan().strategy),
            journal,
            context,
            events,
        );
        let driven = drive(&shared, &id, task, received, Some(&mut channel));
        let report = tokio::time::timeout(WRITE_TIMEOUT * 3, driven)
            .await
            .expect("the move's end waited for a client that does not read")
            .unwrap();
        assert!(report.ok, "{report:#?}");
        // Recorded as ended: not running, its report stored, the VM free to move again.
        assert!(lock(&shared.running).is_empty());
        assert!(shared.moves_dir().join(format!("{id}.json")).exists());
        assert!(shared.admit(&plan(), false).is_ok());
    }

    #[test]
    fn one_move_per_vm_by_name_and_by_vmm() {
        let dir = tempfile::tempdir().unwrap();
        let shared = shared(dir.path());
        shared.admit(&plan(), false).unwrap();
        let mut renamed = plan();
        renamed.vm = "same-vm-other-name".into();
        let refused = shared.admit(&renamed, false).unwrap_err();
        assert!(
            refused.contains("already moving (move") && refused.contains("/s/qmp"),
            "{refused}"
        );
        let mut other = plan();
        other.vm = "vm2".into();
        other.source = crate::plan::Endpoint::Qemu {
            qmp: "/s2/qmp".into(),
            agent: None,
        };
        other.destination = Some(crate::plan::Endpoint::Qemu {
            qmp: "/d2/qmp".into(),
            agent: None,
        });
        shared.admit(&other, false).unwrap();
    }
}
