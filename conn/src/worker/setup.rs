//! Setting a link up: the first connect (active side) or accept (passive side), the
//! reconnects of a resume, and the accept of a peer's RESUME; each ends in `install`, which
//! makes the new QP the connection's link. Attempts fail with an [`AttemptError`] that says
//! whether retrying can help.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdmamig_proto::agent::ConnectionState;
use rdmamig_proto::text::error_chain;
use thiserror::Error;

use super::link::{build_endpoint, Endpoint, Link, EXTRA_SEND_SLOTS, RESERVE, SIGNAL_EVERY};
use super::state::{transition, InvalidTransition, Phase};
use super::{bridge_ready, clear, Start, Worker};
use crate::credits::{Credits, StarvedProbe};
use crate::error::ConnError;
use crate::failure::{Failure, LinkEvent};
use crate::sendq::SendSlots;
use crate::wire::{Accept, Hello, PrivateData, Reject, RejectReason, WireError};
use rdmamig_verbs::watch;
use rdmamig_verbs::{CmEvent, CmEventKind, CmId, IdKey, VerbsError};

/// Bounds of the set-up steps of one connect attempt, before any of them timed out
/// ([`patient`]).
pub(super) const RESOLVE_TIMEOUT: Duration = Duration::from_millis(1000);

pub(super) const ESTABLISH_TIMEOUT: Duration = Duration::from_millis(3000);

/// How many times the set-up bounds may double: 16x, so 48 s for ESTABLISHED.
const MAX_DOUBLINGS: u32 = 4;

/// The bound of a set-up step whose `base` bound was too short `timeouts` times in a row:
/// doubled each time, at most [`MAX_DOUBLINGS`] times, and no longer than the `left` of the
/// connection's own deadline (but never shorter than `base`).
///
/// A peer that is merely slow then gets through on a later attempt. With fixed bounds a
/// nested VM that took more than 3 s to accept was given up on at every attempt, and each
/// give-up made its pending accept fail (rdma_create_qp and rdma_accept with EINVAL, the CM
/// request gone) while costing it the work of one more accept.
pub(super) fn patient(base: Duration, timeouts: u32, left: Duration) -> Duration {
    (base * (1 << timeouts.min(MAX_DOUBLINGS)))
        .min(left)
        .max(base)
}

/// How often a sender that waits for credits with nothing in flight probes its peer.
pub(super) const STARVED_PROBE: Duration = Duration::from_secs(1);

/// Why a connect, reconnect or accept attempt failed. Its chain (`error_chain`) is the text
/// the connection keeps as the last attempt's error.
#[derive(Debug, Error)]
pub(super) enum AttemptError {
    /// A verbs or rdma_cm call failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The passive side has no peer address to connect to.
    #[error("no peer address")]
    NoPeer,
    /// The step's CM event did not come in time.
    #[error("no {awaited} within {timeout:?}")]
    NoEvent {
        /// The event waited for.
        awaited: &'static str,
        /// The wait.
        timeout: Duration,
    },
    /// Address resolution ended in another event.
    #[error("address resolution: {kind:?} ({status})")]
    AddrResolution {
        /// The event.
        kind: CmEventKind,
        /// Its status.
        status: i32,
    },
    /// Route resolution ended in another event.
    #[error("route resolution: {kind:?} ({status})")]
    RouteResolution {
        /// The event.
        kind: CmEventKind,
        /// Its status.
        status: i32,
    },
    /// The peer accepted with something else than an ACCEPT of this connection.
    #[error("the peer accepted with an unexpected reply: {reply:?}")]
    UnexpectedAccept {
        /// The reply as decoded.
        reply: Result<PrivateData, WireError>,
    },
    /// The peer rejected the connect request with a REJECT record.
    #[error("rejected by the peer: {0:?}")]
    Rejected(RejectReason),
    /// A reject without a record: no listener (or not ours) at the address.
    #[error("rejected (no listener at {peer}?), status {status}")]
    RejectedBare {
        /// The peer address.
        peer: SocketAddr,
        /// The event's status.
        status: i32,
    },
    /// The connect ended in another event than ESTABLISHED or REJECTED.
    #[error("connect: {kind:?} ({status})")]
    Connect {
        /// The event.
        kind: CmEventKind,
        /// Its status.
        status: i32,
    },
    /// The accept ended in another event than ESTABLISHED.
    #[error("accept: {kind:?} ({status})")]
    Accept {
        /// The event.
        kind: CmEventKind,
        /// Its status.
        status: i32,
    },
    /// The application closed the connection meanwhile: the close is answered at once, a
    /// set-up step's bound (up to 48 s) would outlast its wait.
    #[error("the application closed the connection")]
    Closed,
    /// The runtime could not watch the new QP's completion channel.
    #[error("watching the completion channel")]
    Watch(#[source] std::io::Error),
    /// The connection's state machine refused the new link (the connection has ended).
    #[error(transparent)]
    Invalid(InvalidTransition),
}

impl AttemptError {
    /// The reason when the peer refused for good (retrying cannot help).
    pub(super) fn refused(&self) -> Option<RejectReason> {
        match self {
            AttemptError::UnexpectedAccept { .. } => Some(RejectReason::Other),
            AttemptError::Rejected(
                reason @ (RejectReason::UnknownConnection
                | RejectReason::BadToken
                | RejectReason::Gone),
            ) => Some(*reason),
            _ => None,
        }
    }

    /// The attempt's error with its causes, as the connection reports it.
    pub(super) fn text(&self) -> String {
        error_chain(self)
    }
}

impl Worker {
    pub(super) async fn start(&mut self, start: Start) {
        match start {
            Start::Active { peer, ready } => {
                self.peer = Some(peer);
                let deadline = Instant::now() + self.sh.opts.connect_timeout;
                loop {
                    match self.attempt(false, deadline).await {
                        Ok(()) => {
                            if let Err(err) = self.open_first_bridge(deadline).await {
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
                        Err(e) if e.refused().is_some() || Instant::now() >= deadline => {
                            let err = if let Some(reason) = e.refused() {
                                ConnError::Rejected { peer, reason }
                            } else {
                                ConnError::ConnectTimedOut {
                                    peer,
                                    after: self.sh.opts.connect_timeout,
                                    last: e.text(),
                                }
                            };
                            let _ = ready.send(Err(err));
                            self.fail(Failure::Setup(format!("connect: {}", e.text())));
                            return;
                        }
                        Err(e) => {
                            self.last_error = e.text();
                            tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %self.last_error, "connect attempt failed");
                            tokio::time::sleep(self.sh.opts.reconnect_interval).await;
                        }
                    }
                }
            }
            Start::Passive {
                id,
                hello,
                on_ready,
            } => match self
                .accept_on(id, &hello, self.sh.opts.connect_timeout)
                .await
            {
                Ok(()) => on_ready(self.sh.clone()),
                Err(e) => self.fail(Failure::Setup(format!("accept: {}", e.text()))),
            },
        }
    }

    pub(super) async fn on_incoming(&mut self, id: CmId, hello: Hello) {
        let reject = |id: &CmId, reason| {
            let pd = PrivateData::Reject(Reject {
                conn_id: hello.conn_id,
                reason,
            });
            let _ = id.reject(&pd.encode());
        };
        if self.phase == Phase::Held {
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
        let establish = patient(ESTABLISH_TIMEOUT, self.setup_timeouts, Duration::MAX);
        match self.accept_on(id, &hello, establish).await {
            Ok(()) => {}
            Err(e) => {
                let text = e.text();
                tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %text, "resume accept failed");
                self.last_error = text;
            }
        }
    }

    /// The next CM event for `id` (the step waits for `awaited`), waiting up to `timeout`.
    /// Events for other ids stay queued for the main loop (which ignores those of ids already
    /// released). While bridging, the bridge carries the traffic meanwhile.
    pub(super) async fn wait_for(
        &mut self,
        id: IdKey,
        awaited: &'static str,
        timeout: Duration,
    ) -> Result<CmEvent, AttemptError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut woken = false;
        let result = loop {
            if let Some(at) = self.cm_queue.iter().position(|ev| ev.id == id) {
                break Ok(self.cm_queue.remove(at).expect("found"));
            }
            let bridging = self.bridging && self.bridge.is_some();
            if bridging {
                self.serve_bridge();
            }
            let bridge = self.bridge.as_ref().filter(|_| bridging);
            tokio::select! {
                taken = self.chan.readable() => {
                    if clear(taken) {
                        if let Err(e) = self.read_cm_events() {
                            break Err(e.into());
                        }
                    }
                }
                // The application queued something (for the bridge), or closed.
                () = self.sh.wake.notified() => {
                    woken = true;
                    if self.sh.lock().closed_by_app {
                        break Err(AttemptError::Closed);
                    }
                }
                taken = bridge_ready(bridge) => {
                    clear(taken);
                }
                () = tokio::time::sleep_until(deadline) => {
                    break Err(AttemptError::NoEvent { awaited, timeout });
                }
            }
        };
        if woken {
            // The main loop takes the commands that came meanwhile at once.
            self.sh.notify_worker();
        }
        result
    }

    /// Drops the queued events before a new id is made: with no link, they are all of ids
    /// already released, and a new id may reuse a released one's address (its key).
    pub(super) fn forget_released_ids(&mut self) {
        debug_assert!(self.link.is_none());
        self.cm_queue.clear();
    }

    /// Reads every pending CM event into the queue (until EAGAIN).
    pub(super) fn read_cm_events(&mut self) -> Result<(), VerbsError> {
        while let Some(ev) = self.chan.get_ref().get_event(Duration::ZERO)? {
            self.cm_queue.push_back(ev);
        }
        Ok(())
    }

    /// Counts the set-up steps that timed out in a row (an attempt that got through starts
    /// the count again), for the next attempt's bounds ([`patient`]).
    fn count_timeouts<T>(&mut self, result: &Result<T, AttemptError>) {
        match result {
            Ok(_) => self.setup_timeouts = 0,
            Err(AttemptError::NoEvent { .. }) => {
                self.setup_timeouts = self.setup_timeouts.saturating_add(1);
            }
            Err(_) => {}
        }
    }

    /// The bound of a set-up step now, for a connection that must be up by `until`.
    fn bound(&self, base: Duration, until: Instant) -> Duration {
        patient(
            base,
            self.setup_timeouts,
            until.saturating_duration_since(Instant::now()),
        )
    }

    /// One connect attempt (a RESUME if `resume`), with set-up bounds that stretch while
    /// they time out, within `until`.
    pub(super) async fn attempt(
        &mut self,
        resume: bool,
        until: Instant,
    ) -> Result<(), AttemptError> {
        self.sh.lock().busy = Some(if resume { "reconnecting" } else { "connecting" });
        let result = self.connect_once(resume, until).await;
        self.sh.lock().busy = None;
        self.count_timeouts(&result);
        result
    }

    async fn connect_once(&mut self, resume: bool, until: Instant) -> Result<(), AttemptError> {
        let peer = self.peer.ok_or(AttemptError::NoPeer)?;
        self.forget_released_ids();
        let resolve = self.bound(RESOLVE_TIMEOUT, until);
        let establish = self.bound(ESTABLISH_TIMEOUT, until);
        let id = CmId::create(self.chan.get_ref())?;
        id.set_ack_timeout(self.sh.opts.ack_timeout)?;
        id.resolve_addr(peer, resolve)?;
        let ev = self
            .wait_for(
                id.key(),
                "ADDR_RESOLVED",
                resolve + Duration::from_millis(500),
            )
            .await?;
        if ev.kind != CmEventKind::AddrResolved {
            return Err(AttemptError::AddrResolution {
                kind: ev.kind,
                status: ev.status,
            });
        }
        id.resolve_route(resolve)?;
        let ev = self
            .wait_for(
                id.key(),
                "ROUTE_RESOLVED",
                resolve + Duration::from_millis(500),
            )
            .await?;
        if ev.kind != CmEventKind::RouteResolved {
            return Err(AttemptError::RouteResolution {
                kind: ev.kind,
                status: ev.status,
            });
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
        let ev = self.wait_for(ep.id.key(), "ESTABLISHED", establish).await?;
        match ev.kind {
            CmEventKind::Established => match PrivateData::decode(&ev.private_data) {
                Ok(PrivateData::Accept(a)) if a.conn_id == self.sh.id => {
                    self.install(ep, a.credits as u64, a.last_received)
                }
                reply => Err(AttemptError::UnexpectedAccept { reply }),
            },
            CmEventKind::Rejected => match PrivateData::decode(&ev.private_data) {
                Ok(PrivateData::Reject(r)) => Err(AttemptError::Rejected(r.reason)),
                _ => Err(AttemptError::RejectedBare {
                    peer,
                    status: ev.status,
                }),
            },
            kind => Err(AttemptError::Connect {
                kind,
                status: ev.status,
            }),
        }
    }

    /// Accepts the connect request on `id` and waits up to `establish` for the CM's verdict:
    /// ESTABLISHED, or the event that ends the handshake (an active side that gives up
    /// destroys its id, and its CM rejects).
    ///
    /// A new connection's first accept waits for that verdict as long as the connection may
    /// take to connect: a failed first accept ends the connection, and the active side's
    /// next attempt is a new connection, so no bound could stretch there. With a fixed 3 s
    /// one, a slow active side (whose librdmacm sends the RTU only when its process reads
    /// the answer) saw ESTABLISHED after the passive side had given up, and its resumes were
    /// then refused (UnknownConnection). A resume's accept (`on_incoming`) stays on the
    /// stretching bound ([`patient`]): its failure costs one more attempt, not the
    /// connection, and the worker serves nothing else while it waits.
    pub(super) async fn accept_on(
        &mut self,
        id: CmId,
        hello: &Hello,
        establish: Duration,
    ) -> Result<(), AttemptError> {
        self.sh.lock().busy = Some("accepting");
        let result = self.accept_once(id, hello, establish).await;
        self.sh.lock().busy = None;
        self.count_timeouts(&result);
        result
    }

    async fn accept_once(
        &mut self,
        mut id: CmId,
        hello: &Hello,
        establish: Duration,
    ) -> Result<(), AttemptError> {
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
        let ev = self.wait_for(ep.id.key(), "ESTABLISHED", establish).await?;
        if ev.kind != CmEventKind::Established {
            return Err(AttemptError::Accept {
                kind: ev.kind,
                status: ev.status,
            });
        }
        self.install(ep, hello.credits as u64, hello.last_received)
    }

    /// Makes the established QP of `ep` the connection's link (state `Up`).
    pub(super) fn install(
        &mut self,
        ep: Endpoint,
        peer_credits: u64,
        peer_last: u64,
    ) -> Result<(), AttemptError> {
        // The link becomes the connection's only through the state machine: a connection
        // that ended meanwhile (a close or the peer's CLOSE while the QP was set up) drops it.
        if let Err(invalid) = transition(self.phase, Phase::Up) {
            self.refused(invalid);
            return Err(AttemptError::Invalid(invalid));
        }
        let comp = watch(ep.comp.clone()).map_err(AttemptError::Watch)?;
        let local = ep
            .id
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let peer = ep.id.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let qp = ep.id.qp_num();
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
        self.phase = Phase::Up;
        st.conn_state = ConnectionState::Established;
        st.stats.established += 1;
        st.local = local;
        st.peer = peer;
        st.qp = qp;
        st.stats.qps.extend(qp);
        drop(st);
        self.sh.changed();
        // Back on RDMA: the bridge stops carrying (what it had in flight arrives as
        // duplicates or in order; see the bridge module).
        self.bridging = false;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_final_refusal_stops_the_retries() {
        use RejectReason::*;
        for (reason, final_) in [
            (UnknownConnection, true),
            (BadToken, true),
            (Gone, true),
            (Malformed, false),
            (Other, false),
            (Busy, false),
        ] {
            let refused = AttemptError::Rejected(reason).refused();
            assert_eq!(refused, final_.then_some(reason), "{reason:?}");
        }
        let odd = AttemptError::UnexpectedAccept {
            reply: Err(WireError::Incomplete { needed: 4 }),
        };
        assert_eq!(odd.refused(), Some(Other));
        assert_eq!(AttemptError::NoPeer.refused(), None);
        assert_eq!(
            AttemptError::NoEvent {
                awaited: "ESTABLISHED",
                timeout: Duration::from_secs(3)
            }
            .text(),
            "no ESTABLISHED within 3s"
        );
    }

    #[test]
    fn set_up_bounds_double_with_each_timeout_up_to_sixteen_times_within_the_deadline() {
        let s = Duration::from_secs;
        let plenty = s(3600);
        let bounds: Vec<_> = (0..7).map(|n| patient(s(3), n, plenty)).collect();
        assert_eq!(bounds, [s(3), s(6), s(12), s(24), s(48), s(48), s(48)]);
        // The connection's deadline caps the stretch, never the base bound.
        assert_eq!(patient(s(3), 3, s(10)), s(10));
        assert_eq!(patient(s(3), 3, s(1)), s(3));
        assert_eq!(patient(s(3), 0, Duration::ZERO), s(3));
        // No overflow however many timeouts.
        assert_eq!(patient(s(1), u32::MAX, Duration::MAX), s(16));
    }
}
