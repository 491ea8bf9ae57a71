//! The agent's TCP port for preloaded programs' peers ([`rdmamig_proto::preload`]).
//!
//! A program under `rdmamig-run` in another VM that is moving asks, through this port,
//! the program here that holds the other end of its QP to pause, to go on, or to walk its
//! QP to the mover's new one. The agent does not know QPs: it hands each request to every
//! registered process ([`Apps::relay`]) and sends back the answer of the one that holds it.
//!
//! Every connection is another guest's, so it is bounded: one request frame
//! ([`rdmamig_proto::MAX_FRAME_LEN`]) read within [`READ_TIMEOUT`], one answer, then the
//! connection closes; at most [`MAX_CONNECTIONS`] are served at once (more are closed
//! unanswered), each on a short-lived thread.

use std::io::Write;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rdmamig_proto::preload::{PeerAnswer, PeerRequest};
use rdmamig_proto::{read_message, Frame};
use thiserror::Error;
use tracing::{debug, info, warn};

use super::apps::Apps;

/// How long a connection has to send its whole request.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the registered processes have to answer. A pause waits for the program's
/// sends in flight to complete: a retransmission or two on a loaded guest.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound of writing the answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Most connections served at once.
pub const MAX_CONNECTIONS: usize = 16;

/// Why the peer port could not be opened.
#[derive(Debug, Error)]
#[error("cannot listen for preloaded programs' peers on TCP port {port}")]
pub struct PeersError {
    /// The port.
    pub port: u16,
    /// The cause.
    #[source]
    pub source: std::io::Error,
}

/// Listens on every address (IPv4 and IPv6) at `port` (0: any free port) and serves the
/// connections on their own threads; gives back the port it listens on.
pub fn listen(apps: Apps, port: u16) -> Result<u16, PeersError> {
    let error = |source| PeersError { port, source };
    let listener =
        TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))).map_err(error)?;
    let bound = listener.local_addr().map_err(error)?.port();
    thread::Builder::new()
        .name("peer-port".into())
        .spawn(move || accept(listener, apps))
        .map_err(error)?;
    info!(port = bound, "serving preloaded programs' peers");
    Ok(bound)
}

fn accept(listener: TcpListener, apps: Apps) {
    let serving = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if serving.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            serving.fetch_sub(1, Ordering::AcqRel);
            warn!("a peer connection was closed unanswered: {MAX_CONNECTIONS} already served");
            continue;
        }
        let (apps, serving) = (apps.clone(), serving.clone());
        let spawned = thread::Builder::new()
            .name("peer-request".into())
            .spawn(move || {
                serve(stream, &apps);
                serving.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            warn!("no thread for a peer connection");
        }
    }
}

/// Reads one request, relays it, answers.
fn serve(mut stream: TcpStream, apps: &Apps) {
    let Ok(from) = stream.peer_addr() else { return };
    let from = canonical(from.ip());
    let request = match read_message::<PeerRequest>(&mut stream, Instant::now() + READ_TIMEOUT) {
        Ok(request) => request,
        Err(e) => {
            debug!(%from, "peer connection: {}", rdmamig_proto::text::error_chain(&e));
            return;
        }
    };
    let answer = apps.relay(&from.to_string(), &request, Instant::now() + ANSWER_TIMEOUT);
    match &answer {
        PeerAnswer::Failed { reason } => warn!(%from, ?request, %reason, "peer request failed"),
        answer => info!(%from, ?request, ?answer, "peer request"),
    }
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.write_all(&Frame::encode(&answer));
}

/// An IPv4 peer seen through the dual-stack socket is an IPv4-mapped IPv6 address: the
/// address the program's QP names is the IPv4 one.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmamig_proto::app::{AgentToApp, AppReply, AppToAgent};
    use rdmamig_proto::FrameBuffer;
    use std::io::Read;

    fn ask(port: u16, bytes: &[u8]) -> Option<PeerAnswer> {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.write_all(bytes).unwrap();
        let mut out = Vec::new();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.read_to_end(&mut out).unwrap();
        let mut frames = FrameBuffer::new();
        frames.push(&out);
        frames.pop().ok().map(|f| f.decode().unwrap())
    }

    #[test]
    fn a_request_reaches_the_process_that_holds_the_qp_with_the_requesters_address() {
        let (apps, _dir) = super::super::apps::tests::registry_with(|req| match req {
            AgentToApp::Peer {
                request,
                from,
                message,
            } => Some(AppToAgent::Reply {
                request,
                body: AppReply::Peer {
                    answer: if message.qp() == 7 && from == "127.0.0.1" {
                        PeerAnswer::Done
                    } else {
                        PeerAnswer::NotMine
                    },
                },
            }),
            _ => None,
        });
        let port = listen(apps, 0).unwrap();
        let pause = |qp| Frame::encode(&PeerRequest::Pause { qp, from_qp: 1 });
        assert_eq!(ask(port, &pause(7)), Some(PeerAnswer::Done));
        assert_eq!(ask(port, &pause(8)), Some(PeerAnswer::NotMine));
    }

    #[test]
    fn a_bad_or_silent_connection_gets_no_answer_and_the_port_keeps_serving() {
        let (apps, _dir) = super::super::apps::tests::registry_with(|req| match req {
            AgentToApp::Peer { request, .. } => Some(AppToAgent::Reply {
                request,
                body: AppReply::Peer {
                    answer: PeerAnswer::Done,
                },
            }),
            _ => None,
        });
        let port = listen(apps, 0).unwrap();
        assert_eq!(ask(port, b"GET / HTTP/1.0\r\n\r\n"), None, "not a frame");
        let mut huge = Frame::encode(&PeerRequest::Pause { qp: 1, from_qp: 1 });
        huge[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(ask(port, &huge), None, "too large");
        let started = Instant::now();
        assert_eq!(ask(port, b"RMG"), None, "silent after 3 bytes");
        assert!(started.elapsed() >= READ_TIMEOUT);
        let pause = Frame::encode(&PeerRequest::Pause { qp: 1, from_qp: 1 });
        assert_eq!(ask(port, &pause), Some(PeerAnswer::Done));
    }
}
