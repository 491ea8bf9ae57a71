//! The worker's side of the TCP bridge: opening (active) or answering (passive) it, carrying
//! messages over it while the RDMA path is down, and losing it. The framing is in
//! `crate::bridge`.

use std::time::{Duration, Instant};

use rdmamig_proto::agent::Role;
use rdmamig_proto::text::error_chain;
use tokio::io::unix::AsyncFd;

use super::data::next_unsent;
use super::Worker;
use crate::bridge::{Bridge, BridgeError, FrameError};
use crate::credits::{classify, Arrival};
use crate::error::ConnError;
use crate::shared::State;
use crate::wire::{Accept, Hello, Kind, Reject, RejectReason};
use rdmamig_verbs::watch;

/// Pause between attempts of the active side to open a lost bridge again.
pub(super) const BRIDGE_RETRY: Duration = Duration::from_secs(1);

impl Worker {
    /// The active side opens the bridge (if one is configured) right after its first link.
    pub(super) async fn open_bridge(&mut self) -> Result<(), ConnError> {
        let Some(addr) = self.sh.opts.bridge else {
            return Ok(());
        };
        let hello = Hello {
            conn_id: self.sh.id,
            token: self.sh.token,
            last_received: self.sh.lock().last_received,
            credits: 0,
        };
        let (bridge, peer_last) = Bridge::open(addr, hello, self.sh.opts.max_message)
            .await
            .map_err(|reason| ConnError::Bridge { addr, reason })?;
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), %addr, "bridge open");
        self.install_bridge(bridge, peer_last)
            .map_err(|reason| ConnError::Bridge { addr, reason })
    }

    /// The active side's first bridge, right after its first link: tried again every
    /// [`BRIDGE_RETRY`] until `deadline` (the connect's) while the failure may pass. A loaded
    /// peer (64 connections on a guest limited to 0.8 CPU) took longer than a set-up step's
    /// 2 s to accept one, which failed the whole connection.
    pub(super) async fn open_first_bridge(&mut self, deadline: Instant) -> Result<(), ConnError> {
        loop {
            match self.open_bridge().await {
                Err(ConnError::Bridge { reason, .. })
                    if reason.may_pass() && Instant::now() + BRIDGE_RETRY < deadline =>
                {
                    tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %error_chain(&reason), "bridge not open yet");
                    tokio::time::sleep(BRIDGE_RETRY).await;
                }
                done => return done,
            }
        }
    }

    /// The active side of a connection with a bridge address has lost its bridge: it tries
    /// again every [`BRIDGE_RETRY`].
    pub(super) fn bridge_reopen_due(&self) -> bool {
        self.bridge.is_none() && self.sh.role == Role::Active && self.sh.opts.bridge.is_some()
    }

    /// The active side opens a lost bridge again, at most every [`BRIDGE_RETRY`].
    pub(super) async fn reopen_bridge(&mut self) {
        let now = Instant::now();
        if !self.bridge_reopen_due() || now < self.next_bridge_attempt {
            return;
        }
        self.next_bridge_attempt = now + BRIDGE_RETRY;
        if let Err(e) = self.open_bridge().await {
            tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %e, "bridge not reopened");
        }
    }

    /// The passive side: a bridge stream named this connection (the listener checked the
    /// token).
    pub(super) fn on_bridge(&mut self, stream: std::net::TcpStream, hello: Hello) {
        if self.sh.role != Role::Passive {
            let reason = RejectReason::Other;
            Bridge::refuse(
                stream,
                Reject {
                    conn_id: hello.conn_id,
                    reason,
                },
            );
            return;
        }
        let accept = Accept {
            conn_id: self.sh.id,
            last_received: self.sh.lock().last_received,
            credits: 0,
        };
        let answered = Bridge::answer(stream, accept, self.sh.opts.max_message)
            .and_then(|bridge| self.install_bridge(bridge, hello.last_received));
        match answered {
            Ok(()) => {}
            Err(e) => {
                tracing::debug!(conn = format_args!("{:016x}", self.sh.id), error = %error_chain(&e), "bridge not accepted")
            }
        }
    }

    /// Carries on with `bridge`, watched by the runtime from now on.
    pub(super) fn install_bridge(
        &mut self,
        bridge: Bridge,
        peer_last: u64,
    ) -> Result<(), BridgeError> {
        let mut bridge = watch(bridge).map_err(BridgeError::Watch)?;
        let mut st = self.sh.lock();
        while st.outbox.front().is_some_and(|(seq, _)| *seq <= peer_last) {
            st.outbox.pop_front();
        }
        bridge.get_mut().sent_upto = resend_point(&st);
        st.bridge_up = true;
        drop(st);
        self.sh.changed();
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), peer = %bridge.get_ref().peer(), "bridge up");
        self.bridge = Some(bridge);
        Ok(())
    }

    /// This side carries its messages over the bridge from now on, starting at its oldest
    /// unacknowledged one (no-op without a bridge, or when already bridging).
    pub(super) fn start_bridging(&mut self) {
        let Some(bridge) = self.bridge.as_mut().map(AsyncFd::get_mut) else {
            return;
        };
        if self.bridging {
            return;
        }
        bridge.sent_upto = resend_point(&self.sh.lock());
        self.bridging = true;
        tracing::debug!(
            conn = format_args!("{:016x}", self.sh.id),
            from = bridge.sent_upto + 1,
            "bridging"
        );
    }

    /// Takes what arrived on the bridge, queues this side's messages on it while bridging
    /// and an ACK when one is owed, and writes what the socket takes.
    pub(super) fn serve_bridge(&mut self) {
        let Some(bridge) = self.bridge.as_mut().map(AsyncFd::get_mut) else {
            return;
        };
        let mut st = self.sh.lock();
        let mut delivered = false;
        let mut got_data = false;
        // An application that is behind leaves the bridge unread: TCP's own flow control
        // then holds the sender back. Its next receive wakes the worker to read again.
        let room = st.inbox.len() < self.sh.inbox_limit();
        let mut result = if !room {
            Ok(())
        } else {
            bridge.receive(|h, payload| {
                while st.outbox.front().is_some_and(|(seq, _)| *seq <= h.ack) {
                    st.outbox.pop_front();
                    delivered = true;
                }
                if h.kind == Kind::Data {
                    got_data = true;
                    match classify(st.last_received, h.seq) {
                        Arrival::Deliver => {
                            st.inbox.push_back(payload.to_vec());
                            st.last_received = h.seq;
                            st.stats.inbox_high = st.stats.inbox_high.max(st.inbox.len() as u64);
                            delivered = true;
                        }
                        Arrival::Duplicate => st.stats.duplicates_dropped += 1,
                        Arrival::Gap { expected } => {
                            return Err(FrameError::OutOfOrder {
                                seq: h.seq,
                                expected,
                            })
                        }
                    }
                }
                Ok(())
            })
        };
        bridge.owes_ack |= got_data;
        if result.is_ok() && self.bridging {
            while bridge.has_room() {
                let Some((seq, data)) = next_unsent(&st.outbox, bridge.sent_upto) else {
                    break;
                };
                let seq = *seq;
                bridge.queue(Kind::Data, seq, st.last_received, data);
                bridge.sent_upto = seq;
                st.stats.bridged += 1;
                st.max_posted = st.max_posted.max(seq);
            }
        }
        if result.is_ok() && bridge.owes_ack && st.last_received > bridge.last_ack_sent {
            bridge.queue(Kind::Ack, 0, st.last_received, &[]);
        }
        drop(st);
        if delivered {
            self.sh.changed();
        }
        if result.is_ok() {
            result = bridge.flush();
        }
        if let Err(why) = result {
            self.bridge_lost(why);
        }
    }

    /// The bridge broke or the peer closed it: messages stay queued for the next path.
    pub(super) fn bridge_lost(&mut self, why: BridgeError) {
        let why = error_chain(&why);
        self.bridge = None;
        let mut st = self.sh.lock();
        st.bridge_up = false;
        let quiet = st.peer_closed || st.closed_by_app;
        if !quiet {
            st.stats.link_events.push(format!("bridge lost: {why}"));
        }
        drop(st);
        self.sh.changed();
        self.next_bridge_attempt = Instant::now();
        tracing::debug!(conn = format_args!("{:016x}", self.sh.id), %why, "bridge lost");
    }
}

/// Where a path starts carrying this side's messages: just below the oldest unacknowledged
/// one (the receiver has everything before it).
pub(super) fn resend_point(st: &State) -> u64 {
    st.outbox
        .front()
        .map_or(st.next_seq - 1, |(seq, _)| seq - 1)
}
