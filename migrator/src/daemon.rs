//! `rdmamig daemon`: runs moves on behalf of clients on a local UNIX socket.
//!
//! The socket can make the host unplug devices and migrate VMs, so it is created with mode
//! 0600 (bound under a temporary name, restricted, then renamed into place, so it is never
//! reachable with wider permissions) and every client's credentials are checked: only root
//! and the daemon's own user are served.
//!
//! A move belongs to the daemon, not to the client that asked for it: a client that goes
//! away mid-move does not stop it halfway (a half-done move is worse than either end). A
//! second move of a VM that is already moving is refused. On SIGINT/SIGTERM the daemon stops
//! accepting and waits for running moves, which are all bounded by their deadlines.

use std::collections::HashSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::api::{ApiError, Channel, ClientRequest, DaemonMessage};
use crate::mover::{error_chain, run_move};

/// Time a client has to send its request after connecting.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the daemon could not run.
#[derive(Debug, Error)]
pub enum DaemonError {
    /// Another daemon answers on the socket.
    #[error("another rdmamig daemon is listening on {socket}")]
    AlreadyRunning {
        /// The socket.
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
    /// Accepting a connection failed.
    #[error("cannot accept a connection on {socket}")]
    Accept {
        /// The socket.
        socket: PathBuf,
        /// What accept said.
        #[source]
        source: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("cannot install the signal handlers")]
    Signals(#[source] std::io::Error),
}

/// Listens on `socket` and serves clients until SIGINT or SIGTERM.
pub async fn serve(socket: &Path) -> Result<(), DaemonError> {
    let listener = bind(socket).await?;
    let owner = std::fs::metadata(socket)
        .map_err(|source| DaemonError::Bind {
            socket: socket.into(),
            source,
        })?
        .uid();
    tracing::info!(socket = %socket.display(), "rdmamig daemon listening");
    let mut interrupt = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let moving = Arc::new(Mutex::new(HashSet::new()));
    let mut clients = JoinSet::new();
    let result = loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let moving = moving.clone();
                    clients.spawn(async move { serve_client(stream, owner, moving).await });
                }
                Err(source) => break Err(DaemonError::Accept { socket: socket.into(), source }),
            },
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
            _ = interrupt.recv() => break Ok(()),
            _ = terminate.recv() => break Ok(()),
        }
    };
    drop(listener);
    let _ = std::fs::remove_file(socket);
    if !clients.is_empty() {
        tracing::info!(clients = clients.len(), "waiting for running moves to end");
    }
    while clients.join_next().await.is_some() {}
    result
}

/// Creates the listening socket with mode 0600, replacing a stale socket file.
async fn bind(socket: &Path) -> Result<UnixListener, DaemonError> {
    let bind_error = |source| DaemonError::Bind {
        socket: socket.into(),
        source,
    };
    if socket.exists() {
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

/// Removes a VM from the set of moving VMs when its move ends, however it ends.
struct MovingGuard {
    moving: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl Drop for MovingGuard {
    fn drop(&mut self) {
        lock(&self.moving).remove(&self.key);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn serve_client(stream: UnixStream, owner: u32, moving: Arc<Mutex<HashSet<String>>>) {
    let peer_uid = stream.peer_cred().map(|c| c.uid()).ok();
    let mut channel = Channel::new(stream);
    if !matches!(peer_uid, Some(uid) if uid == 0 || uid == owner) {
        tracing::warn!(
            ?peer_uid,
            "refused a client that is neither root nor the daemon's user"
        );
        let reason = "permission denied: only root and the daemon's user may ask for moves";
        let _ = channel
            .send(&DaemonMessage::Rejected {
                reason: reason.into(),
            })
            .await;
        return;
    }
    let request = match tokio::time::timeout(REQUEST_TIMEOUT, channel.receive()).await {
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            let reason = format!("bad request: {}", error_chain(&e));
            tracing::warn!("{reason}");
            let _ = channel.send(&DaemonMessage::Rejected { reason }).await;
            return;
        }
        Err(_) => {
            let reason = format!("no request within {} s", REQUEST_TIMEOUT.as_secs());
            let _ = channel.send(&DaemonMessage::Rejected { reason }).await;
            return;
        }
    };
    let ClientRequest::Migrate { plan } = request;
    if let Err(e) = plan.validate() {
        let reason = format!("the plan cannot run: {e}");
        let _ = channel.send(&DaemonMessage::Rejected { reason }).await;
        return;
    }
    let key = plan.source.qmp.display().to_string();
    if !lock(&moving).insert(key.clone()) {
        let reason = format!(
            "VM {} (QMP {key}) is already moving; one move at a time",
            plan.vm
        );
        let _ = channel.send(&DaemonMessage::Rejected { reason }).await;
        return;
    }
    let _guard = MovingGuard { moving, key };
    tracing::info!(vm = %plan.vm, strategy = %plan.strategy, "move started");
    let (events, mut received) = mpsc::unbounded_channel();
    let task = tokio::spawn(run_move(plan, events));
    let mut client_alive = true;
    while let Some(event) = received.recv().await {
        if client_alive {
            client_alive = forward(&mut channel, &DaemonMessage::Event { event }).await;
        }
    }
    let report = match task.await {
        Ok(report) => report,
        Err(e) => {
            tracing::error!("the move task ended abnormally: {e}");
            let reason = format!("internal error: the move task ended abnormally: {e}");
            let _ = channel.send(&DaemonMessage::Rejected { reason }).await;
            return;
        }
    };
    match &report.error {
        None => {
            tracing::info!(vm = %report.plan.vm, total_ms = report.timeline.total_ms, "move done")
        }
        Some(error) => tracing::warn!(vm = %report.plan.vm, "move failed: {error}"),
    }
    if client_alive {
        forward(
            &mut channel,
            &DaemonMessage::Report {
                report: Box::new(report),
            },
        )
        .await;
    }
}

/// Sends one message; returns whether the client is still there.
async fn forward(channel: &mut Channel<UnixStream>, message: &DaemonMessage) -> bool {
    match channel.send(message).await {
        Ok(()) => true,
        Err(e @ ApiError::TooLarge { .. }) => {
            tracing::error!("{}", error_chain(&e));
            let reason = format!("the daemon could not send its answer: {e}");
            channel
                .send(&DaemonMessage::Rejected { reason })
                .await
                .is_ok()
        }
        Err(e) => {
            tracing::info!("client gone ({}); the move goes on", error_chain(&e));
            false
        }
    }
}
