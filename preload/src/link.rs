//! The preloaded program's registration with the guest agent, which makes it a managed
//! program: the agent asks it to quiesce and resume instead of listing it as unmanaged.
//!
//! A program with an rdma_cm id listening on one address is not carried ([`cm`]): while it
//! listens, the link tells the agent so ([`AppToAgent::Carried`]). It stays registered (its
//! peers' requests still reach it), but counts as unmanaged: the move's policy (refuse,
//! release, ignore) applies to it at prepare, as without this library.
//!
//! The link starts with the program's first device context, on its own thread: it
//! connects to the agent's application socket (as the connection library does:
//! `$RDMAMIG_AGENT_SOCKET`, or [`DEFAULT_AGENT_SOCKET`]), says Hello, and answers each
//! request on a thread of its own (a peer's pause may wait for sends in flight while the
//! agent asks for a description). While no agent listens it retries every second.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{ConnectionInfo, ConnectionOutcome, ConnectionState, QuiesceMode, Role};
use rdmamig_proto::app::{AgentToApp, AppReply, AppToAgent, DEFAULT_AGENT_SOCKET};
use rdmamig_proto::{Frame, FrameBuffer};

use crate::objects::{self, locked, trace, Qp};
use crate::peer::{self, ip_of};
use crate::{cm, relocate};

/// The environment variable naming the agent's socket (as for the connection library).
pub const AGENT_SOCKET_ENV: &str = "RDMAMIG_AGENT_SOCKET";
/// How often the link retries while no agent listens.
const RETRY: Duration = Duration::from_secs(1);

/// Starts the link, once per process.
pub fn start() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("rdmamig-agent-link".into())
            .spawn(run);
        if spawned.is_err() {
            eprintln!("rdmamig-preload: no thread for the agent link: the program is unmanaged");
        }
    });
}

fn run() {
    let path = std::env::var_os(AGENT_SOCKET_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_AGENT_SOCKET));
    loop {
        if let Ok(stream) = UnixStream::connect(&path) {
            trace(format_args!(
                "registered with the agent at {}",
                path.display()
            ));
            if let Err(e) = serve(stream) {
                trace(format_args!("agent link ended: {e}"));
            }
        }
        std::thread::sleep(RETRY);
    }
}

/// The live connection to the agent, once it has said Hello: what answers and
/// [`tell_carried`] write to.
static AGENT: Mutex<Option<UnixStream>> = Mutex::new(None);

/// Writes `message` to the agent, if connected.
fn send(message: &AppToAgent) -> std::io::Result<()> {
    match locked(&AGENT).as_mut() {
        Some(agent) => agent.write_all(&Frame::encode(message)),
        None => Ok(()),
    }
}

/// Tells the agent whether a move can carry this program now ([`cm::listening`]); called
/// once registered, and by [`cm`] whenever that changes.
pub fn tell_carried() {
    let not_because = cm::listening().then(|| {
        "an rdma_cm id listens on one address (such a listener is not carried)".to_owned()
    });
    trace(format_args!(
        "told the agent whether a move can carry this program: {}",
        not_because.as_deref().unwrap_or("it can")
    ));
    if let Err(e) = send(&AppToAgent::Carried { not_because }) {
        trace(format_args!("the agent was not told: {e}"));
    }
}

fn serve(mut stream: UnixStream) -> std::io::Result<()> {
    let program = std::env::args().next().unwrap_or_default();
    let hello = AppToAgent::Hello {
        pid: std::process::id(),
        program,
    };
    stream.write_all(&Frame::encode(&hello))?;
    *locked(&AGENT) = Some(stream.try_clone()?);
    tell_carried();
    let served = read_requests(&mut stream);
    *locked(&AGENT) = None;
    served
}

/// Reads the agent's requests until it closes, answering each on a thread of its own.
fn read_requests(stream: &mut UnixStream) -> std::io::Result<()> {
    let mut frames = FrameBuffer::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        frames.push(&buf[..n]);
        while let Ok(frame) = frames.pop() {
            let Ok(request) = frame.decode::<AgentToApp>() else {
                continue;
            };
            let answer = move || {
                if let Some(reply) = answer(&request) {
                    let _ = send(&reply);
                }
                cm::deliver_disconnects();
            };
            if std::thread::Builder::new()
                .name("rdmamig-request".into())
                .spawn(answer)
                .is_err()
            {
                eprintln!("rdmamig-preload: no thread to answer the agent");
            }
        }
    }
}

/// The reply to one request (none to a refusal).
fn answer(request: &AgentToApp) -> Option<AppToAgent> {
    let (request, body) = match request {
        AgentToApp::Describe { request } => (
            *request,
            AppReply::Connections {
                connections: describe(),
            },
        ),
        AgentToApp::Quiesce {
            request,
            deadline_ms,
            bridge,
            hot,
        } => {
            let mode = QuiesceMode::from_flags(*bridge, *hot);
            let result = if mode == QuiesceMode::Release {
                relocate::quiesce(deadline(*deadline_ms)).map_err(|e| error_chain(&e))
            } else {
                Err(format!(
                    "a program under rdmamig-run moves only by `reconnect` (asked: {mode:?})"
                ))
            };
            (*request, outcomes(result))
        }
        AgentToApp::Resume {
            request,
            deadline_ms,
        } => {
            let result = relocate::resume(deadline(*deadline_ms)).map_err(|e| error_chain(&e));
            (*request, outcomes(result))
        }
        AgentToApp::Peer {
            request,
            from,
            message,
        } => (
            *request,
            AppReply::Peer {
                answer: peer::handle(from, message),
            },
        ),
        AgentToApp::Refused { reason } => {
            eprintln!("rdmamig-preload: the agent refused what this process sent: {reason}");
            return None;
        }
    };
    Some(AppToAgent::Reply { request, body })
}

fn deadline(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms.min(24 * 3600 * 1000))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    rdmamig_proto::text::error_chain(e)
}

/// The id of the program's QP numbered `qp` (its connections are its QPs).
fn id(qp: u32) -> u64 {
    (u64::from(std::process::id()) << 32) | u64::from(qp)
}

/// The QPs that carry traffic (in RTS), as connections.
fn describe() -> Vec<ConnectionInfo> {
    objects::all::<Qp>()
        .into_iter()
        .filter_map(|qp| {
            // SAFETY: a live virtual QP (the registry holds it).
            let qp = unsafe { &*qp };
            let record = locked(&qp.record);
            if record.setup.state() != rdma_sys::ibv_qp_state::IBV_QPS_RTS {
                return None;
            }
            let attr = record.setup.attr();
            // SAFETY: raw bytes of a GID.
            let remote = ip_of(unsafe { attr.ah_attr.grh.dgid.raw });
            let flow = locked(&qp.flow);
            let real = qp.real.load(std::sync::atomic::Ordering::Acquire);
            Some(ConnectionInfo {
                id: id(qp.public.qp_num),
                pid: std::process::id(),
                role: Role::Active,
                local: format!("qp {:#x}", qp.public.qp_num),
                peer: format!("{remote} qp {:#x}", attr.dest_qp_num),
                state: if real.is_null() {
                    ConnectionState::Quiesced
                } else if flow.held {
                    ConnectionState::Pausing
                } else {
                    ConnectionState::Established
                },
                last_sent: flow.signaled_posted,
                last_received: 0,
                unacked: 0,
                bridge: false,
                // SAFETY: the live real QP, when there is one.
                qp: (!real.is_null()).then(|| unsafe { (*real).qp_num }),
            })
        })
        .collect()
}

/// One outcome per connection the program has, all alike.
fn outcomes(result: Result<(), String>) -> AppReply {
    let outcomes = describe()
        .into_iter()
        .map(|c| ConnectionOutcome {
            id: c.id,
            ok: result.is_ok(),
            elapsed_ms: 0,
            error: result.as_ref().err().cloned(),
            fell_back: None,
        })
        .collect();
    AppReply::Outcomes { outcomes }
}
