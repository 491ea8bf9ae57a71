//! The library's side of the agent socket.
//!
//! Every `Connection` and `Listener` of the process registers
//! here. On first registration a background thread connects to the agent's UNIX socket
//! ([`rdmamig_proto::app::DEFAULT_AGENT_SOCKET`], or `$RDMAMIG_AGENT_SOCKET`, or the path set
//! with [`set_agent_socket`]); while there is no agent it retries quietly every second, so the
//! library works without one. Once connected it says Hello and answers Describe / Quiesce /
//! Resume for all live connections; quiesce and resume run on the connections in parallel,
//! at most [`MAX_PARALLEL`] at a time (a resume is a reconnect: bounded so that a process
//! with many connections does not storm its peers), and report one outcome per connection.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{ConnectionInfo, ConnectionOutcome, QuiesceMode};
use rdmamig_proto::app::{AgentToApp, AppReply, AppToAgent, DEFAULT_AGENT_SOCKET};
use rdmamig_proto::message;
use rdmamig_proto::preload::PeerAnswer;
use rdmamig_proto::{ConnectionId, Frame, FrameBuffer, FrameError};
use thiserror::Error;

use crate::control::ControlError;

/// Environment variable naming the agent socket.
pub const AGENT_SOCKET_ENV: &str = "RDMAMIG_AGENT_SOCKET";
/// How often the background thread retries while no agent listens.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Errors of the agent link (logged by the background thread; never fatal to connections).
#[derive(Debug, Error)]
pub enum RegistryError {
    /// Reading from or writing to the agent socket failed.
    #[error("agent socket {path}: I/O failed")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The agent sent bytes that are not a frame.
    #[error("agent socket {path}: bad frame")]
    Frame {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: FrameError,
    },
}

/// Something the agent can describe, quiesce and resume: a connection or a listener.
pub(crate) trait Migratable: Send + Sync {
    /// The connection's snapshot (None for listeners).
    fn describe(&self) -> Option<ConnectionInfo>;
    /// Quiesce within `deadline`, as `mode` says.
    fn quiesce(&self, deadline: Instant, mode: QuiesceMode) -> Result<(), ControlError>;
    /// Resume within `deadline`.
    fn resume(&self, deadline: Instant) -> Result<(), ControlError>;
    /// Why the last resume reconnected instead of going on on the QP a `hot` quiesce kept.
    fn fell_back(&self) -> Option<String> {
        None
    }
    /// Listeners are quiesced after and resumed before connections.
    fn is_listener(&self) -> bool;
    /// The connection id (None for listeners).
    fn conn_id(&self) -> Option<ConnectionId>;
}

struct Registry {
    entries: Mutex<Vec<Weak<dyn Migratable>>>,
    socket: Mutex<PathBuf>,
    started: OnceLock<()>,
}

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| Registry {
        entries: Mutex::new(Vec::new()),
        socket: Mutex::new(
            std::env::var_os(AGENT_SOCKET_ENV)
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_AGENT_SOCKET)),
        ),
        started: OnceLock::new(),
    })
}

/// Sets the agent socket path (takes effect at the next connection attempt).
pub fn set_agent_socket(path: impl Into<PathBuf>) {
    *registry().socket.lock().unwrap_or_else(|p| p.into_inner()) = path.into();
}

pub(crate) fn register(entry: Weak<dyn Migratable>) {
    let reg = registry();
    {
        let mut entries = reg.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|e| e.strong_count() > 0);
        entries.push(entry);
    }
    reg.started.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("rdmamig-registry".into())
            .spawn(agent_link);
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start the agent link thread");
        }
    });
}

fn live() -> Vec<std::sync::Arc<dyn Migratable>> {
    let entries = registry().entries.lock().unwrap_or_else(|p| p.into_inner());
    entries.iter().filter_map(|e| e.upgrade()).collect()
}

/// Answers one agent request for every live connection of the process (`None`: the
/// agent's refusal of something this process sent, which needs no answer).
pub fn handle(request: &AgentToApp) -> Option<AppToAgent> {
    let all = live();
    Some(match *request {
        AgentToApp::Describe { request } => AppToAgent::Reply {
            request,
            body: AppReply::Connections {
                connections: all.iter().filter_map(|c| c.describe()).collect(),
            },
        },
        AgentToApp::Quiesce {
            request,
            deadline_ms,
            bridge,
            hot,
        } => {
            let deadline = Instant::now() + Duration::from_millis(deadline_ms);
            let mode = QuiesceMode::from_flags(bridge, hot);
            let (listeners, conns): (Vec<_>, Vec<_>) =
                all.into_iter().partition(|c| c.is_listener());
            let mut outcomes = run_all(&conns, |c| c.quiesce(deadline, mode));
            outcomes.extend(run_all(&listeners, |l| l.quiesce(deadline, mode)));
            AppToAgent::Reply {
                request,
                body: AppReply::Outcomes { outcomes },
            }
        }
        AgentToApp::Resume {
            request,
            deadline_ms,
        } => {
            let deadline = Instant::now() + Duration::from_millis(deadline_ms);
            let (listeners, conns): (Vec<_>, Vec<_>) =
                all.into_iter().partition(|c| c.is_listener());
            let mut outcomes = run_all(&listeners, |l| l.resume(deadline));
            outcomes.extend(run_all(&conns, |c| c.resume(deadline)));
            AppToAgent::Reply {
                request,
                body: AppReply::Outcomes { outcomes },
            }
        }
        // The library's connections carry their own peer protocol; preloaded programs'
        // peers ask about raw QPs, which are never the library's.
        AgentToApp::Peer { request, .. } => AppToAgent::Reply {
            request,
            body: AppReply::Peer {
                answer: PeerAnswer::NotMine,
            },
        },
        AgentToApp::Refused { ref reason } => {
            tracing::warn!(%reason, "the agent refused what this process sent");
            return None;
        }
    })
}

/// How many connections of one process are quiesced or resumed at the same time.
pub const MAX_PARALLEL: usize = 8;

/// Runs `f` on every item with at most `limit` running at once (scoped worker threads that
/// take the next item as they finish one); the results come back in the items' order. A
/// panicking `f` yields `None` for its item.
pub fn bounded_parallel<T: Sync, R: Send>(
    items: &[T],
    limit: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<Option<R>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..limit.max(1).min(items.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(item)));
                if let Ok(r) = r {
                    results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// Runs `op` on every entry, [`MAX_PARALLEL`] at a time; listeners' failures are reported
/// with id 0.
fn run_all(
    entries: &[std::sync::Arc<dyn Migratable>],
    op: impl Fn(&dyn Migratable) -> Result<(), ControlError> + Sync,
) -> Vec<ConnectionOutcome> {
    bounded_parallel(entries, MAX_PARALLEL, |e| {
        let start = Instant::now();
        let result = op(e.as_ref());
        (e.conn_id(), start.elapsed(), result, e.fell_back())
    })
    .into_iter()
    .filter_map(|r| {
        let (id, elapsed, result, fell_back) =
            r.unwrap_or((None, Duration::ZERO, Err(ControlError::Panicked), None));
        // Listeners appear only when they failed: the agent lists connections.
        if id.is_none() && result.is_ok() {
            return None;
        }
        Some(ConnectionOutcome {
            id: id.unwrap_or(0),
            ok: result.is_ok(),
            elapsed_ms: elapsed.as_millis() as u64,
            error: result.err().map(|e| {
                if id.is_none() {
                    format!("listener: {e}")
                } else {
                    e.to_string()
                }
            }),
            fell_back,
        })
    })
    .collect()
}

fn agent_link() {
    let mut logged = false;
    loop {
        let path = registry()
            .socket
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match UnixStream::connect(&path) {
            Ok(stream) => {
                logged = false;
                tracing::info!(path = %path.display(), "connected to the rdmamig agent");
                if let Err(e) = serve(stream, &path) {
                    tracing::warn!(error = %e, "agent link ended");
                }
            }
            Err(e) => {
                if !logged {
                    tracing::debug!(path = %path.display(), error = %e, "no rdmamig agent; retrying every second");
                    logged = true;
                }
            }
        }
        std::thread::sleep(RETRY_INTERVAL);
    }
}

fn serve(mut stream: UnixStream, path: &std::path::Path) -> Result<(), RegistryError> {
    let io = |source| RegistryError::Io {
        path: path.to_owned(),
        source,
    };
    let hello = AppToAgent::Hello {
        pid: std::process::id(),
        program: std::env::args()
            .next()
            .unwrap_or_default()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string(),
    };
    stream.write_all(&Frame::encode(&hello)).map_err(io)?;
    let mut fb = FrameBuffer::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).map_err(io)?;
        if n == 0 {
            return Ok(());
        }
        fb.push(&buf[..n]);
        loop {
            let frame = match fb.pop() {
                Ok(f) => f,
                Err(FrameError::Incomplete { .. }) => break,
                Err(source) => {
                    return Err(RegistryError::Frame {
                        path: path.to_owned(),
                        source,
                    })
                }
            };
            match frame.decode::<AgentToApp>() {
                Ok(req) => {
                    if let Some(reply) = handle(&req) {
                        // In pieces when it lists more connections than a frame holds.
                        match message::encode(&reply) {
                            Ok(bytes) => stream.write_all(&bytes).map_err(io)?,
                            Err(e) => tracing::error!(error = %e, "cannot answer the agent"),
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "ignoring a malformed agent request"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn bounded_parallel_never_exceeds_the_limit_and_keeps_the_order() {
        let running = AtomicUsize::new(0);
        let peak = AtomicUsize::new(0);
        let items: Vec<u32> = (0..40).collect();
        let out = bounded_parallel(&items, 6, |i| {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(5));
            running.fetch_sub(1, Ordering::SeqCst);
            i * 2
        });
        let peak = peak.load(Ordering::SeqCst);
        assert!(peak <= 6, "peak concurrency {peak}");
        assert!(peak >= 2, "ran sequentially (peak {peak})");
        let expected: Vec<Option<u32>> = items.iter().map(|i| Some(i * 2)).collect();
        assert_eq!(out, expected);
    }

    #[test]
    fn a_panicking_item_yields_none_and_the_others_complete() {
        let items = [1u32, 2, 3, 4];
        let out = bounded_parallel(&items, 2, |i| {
            assert_ne!(*i, 3, "item 3 fails");
            *i
        });
        assert_eq!(out, vec![Some(1), Some(2), None, Some(4)]);
        assert!(bounded_parallel(&[] as &[u32], 4, |i| *i).is_empty());
    }
}
