//! A RESUME or a BRIDGE from a stranger: connects to a listener (over rdma_cm, or to its
//! TCP bridge address) naming an existing connection but carrying a token of the caller's
//! choice, or sends the bridge listener bytes that are no record at all, and reports the
//! answer.
//!
//! A third probe connects as a new connection but answers the listener's accept late, as a
//! busy VM does: the test bed checks that the listener waits for the handshake instead of
//! giving the connection up while its peer already counts it as established.
//!
//! The token is the only thing that stops another host on the network from taking over a
//! connection by reconnecting in its name or by opening its bridge; the test bed uses this
//! (through `rdmamig-traffic probe-resume` and `probe-bridge`) to check, on a live
//! connection, that a wrong token is refused and that the connection it names carries on
//! unharmed.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdmamig_proto::text::error_chain;
use rdmamig_proto::ConnectionId;
use rdmamig_verbs::{CmEvent, CmEventKind, CmId, EventChannel, VerbsError};
use thiserror::Error;

use crate::bridge::{self, BridgeError};
use crate::wire::{Hello, PrivateData, RejectReason, MAX_CONNECT_PRIVATE_DATA};
use crate::worker::{build_endpoint, Endpoint};

/// How the listener answered a probing RESUME.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeAnswer {
    /// Refused with this reason (what a wrong token must get).
    Refused(RejectReason),
    /// Accepted: the listener handed the connection to whoever knew its id and this token
    /// (a RESUME), or kept the slow handshake's new connection.
    Accepted,
    /// No listener, or no usable answer; the text says what happened.
    NoAnswer(String),
}

const STEP: Duration = Duration::from_secs(2);

/// Why a probe got no answer (reported as [`ProbeAnswer::NoAnswer`] with its whole chain).
#[derive(Debug, Error)]
enum ProbeError {
    /// A verbs or rdma_cm call failed.
    #[error(transparent)]
    Verbs(VerbsError),
    /// The step's CM event did not come within [`STEP`].
    #[error("no CM event for {what} within {STEP:?}")]
    NoEvent {
        /// The step.
        what: &'static str,
    },
    /// Address resolution ended in another event.
    #[error("address resolution: {0:?}")]
    AddrResolution(CmEventKind),
    /// Route resolution ended in another event.
    #[error("route resolution: {0:?}")]
    RouteResolution(CmEventKind),
    /// The probe's runtime could not be started.
    #[error("starting a tokio runtime")]
    Runtime(#[source] std::io::Error),
    /// The bridge's set-up failed.
    #[error(transparent)]
    Bridge(BridgeError),
}

impl ProbeError {
    fn answer(self) -> ProbeAnswer {
        ProbeAnswer::NoAnswer(error_chain(&self))
    }
}

/// Sends a RESUME for `conn_id` with `token` to `peer` and waits (bounded) for the answer.
/// An accepted probe is disconnected at once.
pub fn probe_resume(peer: SocketAddr, conn_id: ConnectionId, token: [u8; 16]) -> ProbeAnswer {
    match attempt(peer, conn_id, token) {
        Ok(a) => a,
        Err(e) => e.answer(),
    }
}

/// Connects to `peer` as a new connection (a HELLO with a random id and token) but reads the
/// listener's answer only `delay` after the connect, so that the handshake's last step (the
/// RTU, which librdmacm sends when the answer is read) reaches the listener that late; then
/// watches the connection for [`STEP`]. `Accepted` if it was established and kept, the
/// listener's refusal or what happened otherwise. The connection is disconnected at the end.
pub fn probe_slow_handshake(peer: SocketAddr, delay: Duration) -> ProbeAnswer {
    match slow_handshake(peer, delay) {
        Ok(a) => a,
        Err(e) => e.answer(),
    }
}

/// Opens a TCP stream to the bridge listener at `peer` and sends a BRIDGE record for
/// `conn_id` with `token` (or, with `garbage`, bytes that are no record); returns how the
/// listener answered. An accepted probe is closed at once.
pub fn probe_bridge(
    peer: SocketAddr,
    conn_id: ConnectionId,
    token: [u8; 16],
    garbage: bool,
) -> ProbeAnswer {
    let greeting = if garbage {
        [0xa5; MAX_CONNECT_PRIVATE_DATA]
    } else {
        bridge::padded(PrivateData::Bridge(Hello {
            conn_id,
            token,
            last_received: 0,
            credits: 0,
        }))
    };
    // A one-off probe: a runtime of its own for the bridge's set-up steps.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return ProbeError::Runtime(e).answer(),
    };
    match runtime.block_on(bridge::introduce(peer, &greeting)) {
        Ok((_, PrivateData::Reject(r))) => ProbeAnswer::Refused(r.reason),
        Ok((_, PrivateData::Accept(_))) => ProbeAnswer::Accepted,
        Ok((_, other)) => ProbeAnswer::NoAnswer(format!("unexpected answer {other:?}")),
        Err(e) => ProbeError::Bridge(e).answer(),
    }
}

fn wait(chan: &EventChannel, id: &CmId, what: &'static str) -> Result<CmEvent, ProbeError> {
    let end = Instant::now() + STEP;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ProbeError::NoEvent { what });
        }
        match chan.get_event(left) {
            Ok(Some(ev)) if ev.id == id.key() => return Ok(ev),
            Ok(_) => {}
            Err(e) => return Err(ProbeError::Verbs(e)),
        }
    }
}

/// Resolves `peer` on a new id of `chan` and sends it a connect request carrying `pd`.
fn connect(chan: &EventChannel, peer: SocketAddr, pd: PrivateData) -> Result<Endpoint, ProbeError> {
    let verbs = ProbeError::Verbs;
    let id = CmId::create(chan).map_err(verbs)?;
    id.resolve_addr(peer, STEP).map_err(verbs)?;
    let ev = wait(chan, &id, "address resolution")?;
    if ev.kind != CmEventKind::AddrResolved {
        return Err(ProbeError::AddrResolution(ev.kind));
    }
    id.resolve_route(STEP).map_err(verbs)?;
    let ev = wait(chan, &id, "route resolution")?;
    if ev.kind != CmEventKind::RouteResolved {
        return Err(ProbeError::RouteResolution(ev.kind));
    }
    let ep = build_endpoint(id, 8, 64).map_err(verbs)?;
    ep.id.connect(&pd.encode(), 3, 3).map_err(verbs)?;
    Ok(ep)
}

fn attempt(
    peer: SocketAddr,
    conn_id: ConnectionId,
    token: [u8; 16],
) -> Result<ProbeAnswer, ProbeError> {
    let chan = EventChannel::new().map_err(ProbeError::Verbs)?;
    let pd = PrivateData::Resume(Hello {
        conn_id,
        token,
        last_received: 0,
        credits: 8,
    });
    let ep = connect(&chan, peer, pd)?;
    let ev = wait(&chan, &ep.id, "the connect")?;
    Ok(match ev.kind {
        CmEventKind::Rejected => match PrivateData::decode(&ev.private_data) {
            Ok(PrivateData::Reject(r)) => ProbeAnswer::Refused(r.reason),
            other => ProbeAnswer::NoAnswer(format!(
                "rejected without a reject record ({other:?}), status {}",
                ev.status
            )),
        },
        CmEventKind::Established => {
            let _ = ep.id.disconnect();
            let _ = wait(&chan, &ep.id, "the disconnect");
            ProbeAnswer::Accepted
        }
        other => ProbeAnswer::NoAnswer(format!("connect: {other:?} ({})", ev.status)),
    })
}

fn slow_handshake(peer: SocketAddr, delay: Duration) -> Result<ProbeAnswer, ProbeError> {
    let chan = EventChannel::new().map_err(ProbeError::Verbs)?;
    let pd = PrivateData::Hello(Hello {
        conn_id: rand::random(),
        token: rand::random(),
        last_received: 0,
        credits: 8,
    });
    let ep = connect(&chan, peer, pd)?;
    std::thread::sleep(delay);
    let ev = wait(&chan, &ep.id, "the connect")?;
    let answer = match ev.kind {
        CmEventKind::Established => match wait(&chan, &ep.id, "a drop") {
            Err(ProbeError::NoEvent { .. }) => ProbeAnswer::Accepted,
            Ok(ev) => ProbeAnswer::NoAnswer(format!(
                "established, then {:?} ({}): the listener dropped the connection",
                ev.kind, ev.status
            )),
            Err(e) => e.answer(),
        },
        CmEventKind::Rejected => match PrivateData::decode(&ev.private_data) {
            Ok(PrivateData::Reject(r)) => ProbeAnswer::Refused(r.reason),
            _ => ProbeAnswer::NoAnswer(format!("rejected, status {}", ev.status)),
        },
        other => ProbeAnswer::NoAnswer(format!("connect: {other:?} ({})", ev.status)),
    };
    if answer == ProbeAnswer::Accepted {
        let _ = ep.id.disconnect();
        let _ = wait(&chan, &ep.id, "the disconnect");
    }
    Ok(answer)
}
