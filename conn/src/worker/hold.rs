//! Quiesce, hold and resume: the agent's commands, the PAUSE / PAUSE_ACK / CLOSE /
//! disconnect progress on a live link, what the connection does when a link is lost, the
//! reconnect attempts while it holds no link, and the deadlines of the pending requests.

use std::time::{Duration, Instant};

use rdmamig_proto::text::error_chain;

use super::link::Pause;
use super::state::Phase;
use super::Worker;
use crate::control::ControlError;
use crate::failure::{Failure, LinkEvent};
use crate::reply::Reply;
use crate::wire::{Kind, FLAG_BRIDGE, FLAG_HOT, FLAG_MOVING};
use rdmamig_proto::agent::QuiesceMode;
use rdmamig_verbs::{refresh_device_list, CmEventKind};

/// How long to wait for DISCONNECTED after rdma_disconnect.
pub(super) const DISCONNECT_WAIT: Duration = Duration::from_millis(1000);

/// How long a QP kept by a `hot` pause has to carry the probe's round trip once the resume
/// asks for it; past it the connection gives the QP up and reconnects.
pub(super) const CONFIRM_WAIT: Duration = Duration::from_secs(3);

impl Worker {
    pub(super) fn on_quiesce(&mut self, deadline: Instant, mode: QuiesceMode, reply: Reply) {
        if let Some((_, r)) = self.resume_op.take() {
            let _ = r.send(Err(ControlError::QuiesceBeforeResume));
        }
        if self.phase == Phase::Paused {
            // Already paused with the QP kept: a second `hot` quiesce has nothing to do,
            // and any other would have to break a link that a resume may still confirm.
            let _ = reply.send(match mode {
                QuiesceMode::Hot => Ok(()),
                QuiesceMode::Release | QuiesceMode::Bridge => Err(ControlError::InvalidState {
                    op: "quiesce",
                    state: self.phase.name(),
                }),
            });
            return;
        }
        if mode == QuiesceMode::Bridge {
            self.start_bridging();
        }
        self.sh.lock().fell_back = None;
        let bridging = self.bridging;
        match &mut self.link {
            Some(link) => {
                if link.pause.is_none() {
                    link.pause = Some(Pause {
                        bridge: bridging,
                        hot: mode == QuiesceMode::Hot,
                        ..Pause::default()
                    });
                }
                self.quiesce_op = Some((deadline, reply));
                // A second quiesce takes over the first one's reply; a quiesce while closing
                // pauses the link too, but the close goes on (and wins).
                if self.phase == Phase::Up {
                    self.enter(Phase::Quiescing);
                }
            }
            None => {
                // Without a link the connection holds at once (again: a second quiesce
                // renews the hold); a `hot` one too: its resume reconnects.
                self.down_until = Instant::now() + self.sh.opts.peer_wait;
                let held = self.phase == Phase::Held || self.enter(Phase::Held);
                if held {
                    let _ = reply.send(Ok(()));
                }
            }
        }
    }

    pub(super) fn on_resume(&mut self, deadline: Instant, reply: Reply) {
        if let Some(link) = &mut self.link {
            let hot = link.pause.as_mut().filter(|p| p.hot);
            if let Some(pause) = hot {
                // Confirm the kept QP (a `hot` pause that has not finished is confirmed the
                // same way: its PAUSE may have reached the peer).
                pause.confirm = true;
                if let Some((_, r)) = self.quiesce_op.take() {
                    let _ = r.send(Err(ControlError::Superseded));
                }
                if let Some((_, r)) = self.resume_op.replace((deadline, reply)) {
                    let _ = r.send(Err(ControlError::Superseded));
                }
                return;
            }
            if link.pause.is_some() {
                let _ = reply.send(Err(ControlError::QuiesceInProgress));
            } else {
                let _ = reply.send(Ok(()));
            }
            return;
        }
        let now = Instant::now();
        self.down_until = now + self.sh.opts.peer_wait;
        self.next_attempt = now;
        if self.phase != Phase::Resuming && !self.enter(Phase::Resuming) {
            // The connection failed (and answered its requests): this one too.
            let _ = reply.send(Err(ControlError::InvalidState {
                op: "resume",
                state: self.phase.name(),
            }));
            return;
        }
        if let Some((_, r)) = self.resume_op.replace((deadline, reply)) {
            let _ = r.send(Err(ControlError::Superseded));
        }
    }

    /// Handles the queued CM events, after reading the channel dry if `read` (its readiness
    /// was taken).
    pub(super) fn handle_cm_events(&mut self, read: bool) {
        if read {
            if let Err(e) = self.read_cm_events() {
                tracing::warn!(error = %e, "reading CM events failed");
            }
        }
        while let Some(ev) = self.cm_queue.pop_front() {
            let Some(link) = &self.link else { continue };
            if ev.id != link.ep.id.key() {
                continue;
            }
            match ev.kind {
                CmEventKind::Disconnected => {
                    let expected = link.pause.as_ref().is_some_and(|p| !p.hot)
                        || link.peer_paused.is_some()
                        || link.close_sent
                        || link.disconnecting.is_some()
                        || self.sh.lock().peer_closed;
                    self.link_lost(LinkEvent::PeerDisconnected, expected);
                }
                CmEventKind::DeviceRemoval => {
                    self.link_lost(LinkEvent::DeviceRemoved, false);
                }
                _ => {}
            }
        }
    }

    /// Pause, PAUSE_ACK, close and disconnect progress.
    pub(super) fn progress(&mut self) {
        let now = Instant::now();
        let Some(link) = &mut self.link else { return };
        let last_received = self.sh.lock().last_received;
        let mut failure: Option<LinkEvent> = None;
        if link.owe_pause_ack && link.can_post_control() {
            match link.post(Kind::PauseAck, 0, 0, &[], last_received) {
                Ok(()) => {
                    link.owe_pause_ack = false;
                    link.pause_ack_sent = true;
                }
                Err(e) => failure = Some(LinkEvent::from(e)),
            }
        }
        if let Some(p) = &mut link.pause {
            if !p.sent
                && !p.confirm
                && link.slots.in_flight() == 0
                && link.credits.can_send_control()
                && link.slots.free() > 0
            {
                p.sent = true;
                let flags = FLAG_MOVING
                    | if p.bridge { FLAG_BRIDGE } else { 0 }
                    | if p.hot { FLAG_HOT } else { 0 };
                if let Err(e) = link.post(Kind::Pause, flags, 0, &[], last_received) {
                    failure = Some(LinkEvent::from(e));
                }
            }
        }
        let mut confirmed = false;
        let hot = link.pause.as_ref().filter(|p| p.hot);
        let paused = hot.is_some_and(|p| p.got_ack && !p.confirm) && self.phase == Phase::Quiescing;
        match hot.map(|p| (p.confirm, p.probe_sent)) {
            // The resume (or the hold's end) asks for the kept QP's proof: a probe, posted
            // once nothing else is in flight, so that its completion means the QP carried a
            // round trip after the move.
            Some((true, None)) if link.slots.in_flight() == 0 && link.free_slots() > 0 => {
                match link.post_probe() {
                    Ok(()) => {
                        if let Some(p) = &mut link.pause {
                            p.probe_sent = Some(now);
                        }
                    }
                    Err(e) => failure = Some(LinkEvent::from(e)),
                }
            }
            Some((true, Some(_))) if link.slots.in_flight() == 0 && link.can_post_control() => {
                match link.post(Kind::Continue, 0, 0, &[], last_received) {
                    Ok(()) => confirmed = true,
                    Err(e) => failure = Some(LinkEvent::from(e)),
                }
            }
            Some((true, Some(at))) if now.duration_since(at) > CONFIRM_WAIT => {
                failure = Some(LinkEvent::Deadline {
                    deadline: "confirm (3 s)",
                    what: "the probe on the kept QP",
                });
            }
            _ => {}
        }
        if confirmed {
            link.pause = None;
        }
        if let Some((deadline, _)) = &self.close_op {
            let drained = {
                let st = self.sh.lock();
                st.outbox.is_empty() && st.onesided.ops.is_empty()
            };
            let late = now + Duration::from_millis(500) >= *deadline;
            if !link.close_sent && (drained || late) && link.can_post_control() {
                link.close_sent = true;
                if let Err(e) = link.post(Kind::Close, 0, 0, &[], last_received) {
                    failure = Some(LinkEvent::from(e));
                }
            }
        }
        let want_disconnect = link.pause.as_ref().is_some_and(|p| p.got_ack && !p.hot)
            || (link.close_sent && link.slots.in_flight() == 0);
        if want_disconnect && link.disconnecting.is_none() {
            link.disconnecting = Some(now);
            if let Err(e) = link.ep.id.disconnect() {
                failure = Some(LinkEvent::Local(error_chain(&e)));
            }
        }
        if link
            .disconnecting
            .is_some_and(|t| now.duration_since(t) > DISCONNECT_WAIT)
        {
            failure = Some(LinkEvent::Deadline {
                deadline: "disconnect (1 s)",
                what: "the DISCONNECTED event",
            });
        }
        if link
            .peer_paused
            .is_some_and(|t| now.duration_since(t) > self.sh.opts.peer_wait)
        {
            failure = Some(LinkEvent::Deadline {
                deadline: "peer_wait",
                what: "the paused peer to continue or disconnect",
            });
        }
        if self.phase == Phase::Paused && now >= self.down_until && failure.is_none() && !confirmed
        {
            // No resume came within `peer_wait`: confirm on our own (the forced path).
            if let Some(p) = &mut link.pause {
                p.confirm = true;
            }
        }
        if let Some(f) = failure {
            let expected = link.disconnecting.is_some();
            self.link_lost(f, expected);
            return;
        }
        if paused {
            // The peer stopped too, at the same sequence boundary: the QP is kept as it is.
            self.down_until = now + self.sh.opts.peer_wait;
            if self.enter(Phase::Paused) {
                if let Some((_, reply)) = self.quiesce_op.take() {
                    let _ = reply.send(Ok(()));
                }
            }
        }
        if confirmed && self.enter(Phase::Up) {
            tracing::debug!(
                conn = format_args!("{:016x}", self.sh.id),
                "kept QP confirmed; sending again"
            );
            if let Some((_, reply)) = self.resume_op.take() {
                let _ = reply.send(Ok(()));
            }
        }
    }

    /// The link is gone (or being given up): release every verbs object at once, then decide
    /// what the connection does next.
    pub(super) fn link_lost(&mut self, why: LinkEvent, expected: bool) {
        let Some(link) = self.link.take() else { return };
        let peer_paused = link.peer_paused.is_some();
        if link.pause.as_ref().is_some_and(|p| p.hot) {
            // The QP a `hot` move meant to keep is gone: the resume reconnects and replays.
            self.sh.lock().fell_back = Some(why.to_string());
        }
        self.sh.lock().qp = None;
        // Messages go over the bridge, if there is one (a no-op otherwise), when the peer's
        // PAUSE asked for it, and when the link broke: a link that broke before the PAUSE
        // came left the side that stays holding its messages until the next link (a test
        // bed run: all 64 links broke before the quiesce, and the peer bridged none of its
        // messages for 120 s).
        if link.peer_bridging || !expected {
            self.start_bridging();
        }
        // QP, CQ, comp channel, MRs, PD, cm id. rxe's destroy of a QP may wait in the kernel
        // for its send path (a failure seen once on the test bed): named if a request waits.
        self.sh.lock().busy = Some("releasing the link");
        drop(link);
        self.sh.lock().busy = None;

        // A device already gone is released now; one that goes later, by the process's
        // device watcher when the kernel says so.
        let _ = refresh_device_list();
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), %why, expected, "link released");
        if !expected {
            self.sh.lock().stats.link_events.push(why.to_string());
        }
        let now = Instant::now();
        if let Some((_, reply)) = self.close_op.take() {
            let _ = reply.send(Ok(()));
            self.finish_closed();
            return;
        }
        if self.sh.lock().peer_closed {
            self.finish_closed();
            return;
        }
        if let Some((_, reply)) = self.quiesce_op.take() {
            let _ = reply.send(if expected {
                Ok(())
            } else {
                Err(ControlError::LinkBroke { why })
            });
            self.down_until = now + self.sh.opts.peer_wait;
            self.enter(Phase::Held);
            return;
        }
        self.down_until = now + self.sh.opts.peer_wait;
        // Give a moving peer a moment before the first reconnect attempt.
        self.next_attempt = if peer_paused {
            now + self.sh.opts.reconnect_interval
        } else {
            now
        };
        self.last_error.clear();
        self.last_link = Some(why);
        if self.phase == Phase::Quiescing {
            // The quiesce's own deadline gave the link up (`check_deadlines` answered it):
            // the connection holds, and a later failure names that deadline.
            self.enter(Phase::Held);
        } else {
            self.enter(Phase::AwaitingPeer);
        }
    }

    /// Nothing of this connection is timed more closely than a second: no request pending,
    /// no bridge to open, and up with a link that waits on no timer ([`Link::timed`]),
    /// holding (for a resume, or `peer_wait`), or the passive side awaiting its peer's
    /// reconnect (which the listener brings). Anything else ticks every 100 ms.
    pub(super) fn quiet(&self) -> bool {
        if self.quiesce_op.is_some()
            || self.resume_op.is_some()
            || self.close_op.is_some()
            || self.bridging
            || self.bridge_reopen_due()
        {
            return false;
        }
        match self.phase {
            Phase::Up => self.link.as_ref().is_some_and(|l| !l.timed()),
            Phase::Held => true,
            Phase::AwaitingPeer => self.peer.is_none(),
            Phase::Connecting
            | Phase::Quiescing
            | Phase::Paused
            | Phase::Resuming
            | Phase::Closing
            | Phase::Closed
            | Phase::Failed => false,
        }
    }

    pub(super) async fn down_tick(&mut self) {
        let now = Instant::now();
        match self.phase {
            Phase::Held => {
                if now >= self.down_until {
                    // No resume came: try on our own (the forced path).
                    self.down_until = now + self.sh.opts.peer_wait;
                    self.next_attempt = now;
                    self.enter(Phase::AwaitingPeer);
                }
            }
            Phase::AwaitingPeer | Phase::Resuming => {
                if now >= self.down_until {
                    self.fail(Failure::PeerWaitExpired {
                        after: self.sh.opts.peer_wait,
                        cause: self.last_link.clone(),
                        last_attempt: (!self.last_error.is_empty())
                            .then(|| self.last_error.clone()),
                    });
                    return;
                }
                if self.peer.is_some() && now >= self.next_attempt {
                    // librdmacm must know a new device first: an old one with the same
                    // GUID would be picked for it otherwise.
                    let _ = refresh_device_list();
                    match self.attempt(true, self.down_until).await {
                        Ok(()) => {}
                        Err(e) => match e.refused() {
                            Some(reason) => self.fail(Failure::ResumeRefused(reason)),
                            None => {
                                self.last_error = e.text();
                                tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %self.last_error, "reconnect attempt failed");
                                self.next_attempt =
                                    Instant::now() + self.sh.opts.reconnect_interval;
                            }
                        },
                    }
                }
            }
            // With a link, or ended: nothing to wait for here.
            Phase::Connecting | Phase::Up | Phase::Quiescing | Phase::Paused | Phase::Closing => {}
            Phase::Closed | Phase::Failed => {}
        }
    }

    pub(super) fn check_deadlines(&mut self) {
        let now = Instant::now();
        if self.quiesce_op.as_ref().is_some_and(|(d, _)| now >= *d) {
            let what = match &self.link {
                Some(l) if l.disconnecting.is_some() => "the DISCONNECTED event",
                Some(l) if l.pause.as_ref().is_some_and(|p| p.sent) => "the peer's PAUSE_ACK",
                Some(_) => "posted sends to complete",
                None => "the link",
            };
            let (_, reply) = self.quiesce_op.take().expect("checked");
            let _ = reply.send(Err(ControlError::QuiesceTimedOut { what }));
            self.link_lost(
                LinkEvent::Deadline {
                    deadline: "quiesce",
                    what,
                },
                true,
            );
            if self.phase == Phase::Quiescing {
                // There was no link to give up: hold all the same.
                self.down_until = now + self.sh.opts.peer_wait;
                self.enter(Phase::Held);
            }
        }
        if self.resume_op.as_ref().is_some_and(|(d, _)| now >= *d) {
            let (_, reply) = self.resume_op.take().expect("checked");
            let _ = reply.send(Err(ControlError::ResumeTimedOut {
                last_error: (!self.last_error.is_empty()).then(|| self.last_error.clone()),
            }));
        }
        if self.close_op.as_ref().is_some_and(|(d, _)| now >= *d) {
            let (_, reply) = self.close_op.take().expect("checked");
            self.link = None;
            let _ = refresh_device_list();
            let _ = reply.send(Err(ControlError::CloseTimedOut));
            self.finish_closed();
        }
    }
}
