//! The data path on a live link: completions (deliveries in order, duplicates dropped,
//! acknowledgements, the peer's credits, PAUSE/PAUSE_ACK/CLOSE/REGIONS), and the pump that
//! announces exposures and posts WRITEs, READs, DATA, ACKs and probes as credits allow.
//! The pure parts (which message is next, what counts as a replay) are unit tested below.

use std::collections::VecDeque;
use std::time::Instant;

use rdmamig_proto::text::error_chain;

use super::link::{Link, ONESIDED_BASE, RECV_BASE};
use super::Worker;
use crate::credits::{classify, Arrival};
use crate::failure::LinkEvent;
use crate::onesided::OpKind;
use crate::shared::State;
use crate::wire::{Header, Kind, RegionEntry, FLAG_BRIDGE, REGION_ENTRY_LEN};
use rdmamig_verbs::WorkCompletion;

impl Worker {
    /// Polls the CQ dry and arms it again; reads its channel's events first (until EAGAIN)
    /// if `events` (its readiness was taken). Returns whether it woke the application.
    pub(super) fn handle_completions(&mut self, events: bool) -> bool {
        let Some(link) = &mut self.link else {
            return false;
        };
        if events {
            match link.ep.cq.ack_events() {
                // The event disarmed the CQ.
                Ok(n) if n > 0 => link.cq_armed = false,
                Ok(_) => {}
                Err(e) => {
                    // Arming again is harmless; missing a disarm would not be.
                    link.cq_armed = false;
                    tracing::warn!(error = %e, "reading CQ events failed");
                }
            }
        }
        let mut failure: Option<LinkEvent> = None;
        let mut woke = false;
        loop {
            self.wcs.clear();
            let Some(link) = &mut self.link else {
                return woke;
            };
            match link.ep.cq.poll(&mut self.wcs, 64) {
                // Still armed from an earlier round (no event read since): the next
                // completion wakes the worker, no need to arm it again.
                Ok(0) if link.cq_armed => break,
                Ok(0) => {
                    if let Err(e) = link.ep.cq.req_notify() {
                        failure = Some(LinkEvent::Local(error_chain(&e)));
                        break;
                    }
                    link.cq_armed = true;
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    failure = Some(LinkEvent::Local(error_chain(&e)));
                    break;
                }
            }
            let wcs = std::mem::take(&mut self.wcs);
            let mut st = self.sh.lock();
            let mut delivered = false;
            for wc in &wcs {
                if let Err(e) = process(link, &mut st, wc, &mut delivered) {
                    failure.get_or_insert(e);
                }
            }
            drop(st);
            if delivered {
                self.sh.changed();
                woke = true;
            }
            self.wcs = wcs;
            if failure.is_some() {
                break;
            }
        }
        if let Some(f) = failure {
            let expected = self
                .link
                .as_ref()
                .is_some_and(|l| l.disconnecting.is_some() || l.peer_paused.is_some())
                || self.sh.lock().peer_closed;
            self.link_lost(f, expected);
        }
        woke
    }

    /// Announces exposed buffers, posts WRITEs and READs, then DATA while credits allow,
    /// then a standalone ACK if one is owed, then a probe if starved ([`StarvedProbe`]).
    ///
    /// One-sided operations go out before DATA queued with them, so a message sent after a
    /// write is never posted before it (and RC executes in posting order at the peer).
    pub(super) fn pump(&mut self) {
        let Some(link) = &mut self.link else { return };
        let mut st = self.sh.lock();
        let mut failure = repost_withheld(link, &st).err();
        let leaving = link.pause.as_ref().is_some_and(|p| p.sent) || link.close_sent;
        if let Err(e) = link.register_exposures(&st) {
            failure.get_or_insert(LinkEvent::from(e));
        }
        let per_message = (self.sh.opts.max_message / REGION_ENTRY_LEN).max(1);
        while failure.is_none() && !link.announce.is_empty() && !leaving && link.can_post_control()
        {
            let n = link.announce.len().min(per_message);
            let mut payload = Vec::with_capacity(n * REGION_ENTRY_LEN);
            for e in &link.announce[..n] {
                e.encode(&mut payload);
            }
            match link.post(Kind::Regions, 0, 0, &payload, st.last_received) {
                Ok(()) => {
                    link.announce.drain(..n);
                }
                Err(e) => failure = Some(LinkEvent::from(e)),
            }
        }
        while failure.is_none() && link.can_post_onesided() {
            let Some(op) = st.onesided.ops.next_to_post(link.ops_posted_upto) else {
                break;
            };
            // The peer's records for this QP come first thing on it; until then, wait.
            let Some(key) = link.remote_keys.get(&op.handle).copied() else {
                break;
            };
            if crate::onesided::check_range(op.handle, key.len, op.offset, op.len()).is_err() {
                failure = Some(LinkEvent::Protocol(format!(
                    "the peer's buffer {} shrank below an operation at {}+{}",
                    op.handle,
                    op.offset,
                    op.len()
                )));
                break;
            }
            let id = op.id;
            if let Err(e) = link.post_onesided(op, &key) {
                failure = Some(LinkEvent::from(e));
                break;
            }
            link.ops_posted_upto = id;
            if st.onesided.ops.on_posted(id) {
                st.stats.onesided_replayed += 1;
            }
        }
        // DATA goes out as one chain: one doorbell for every message this round.
        let mut staged_upto = link.posted_upto;
        while failure.is_none() && link.can_post_data() {
            let Some((seq, data)) = next_unsent(&st.outbox, staged_upto) else {
                break;
            };
            let (seq, last_received) = (*seq, st.last_received);
            if let Err(e) = link.stage(Kind::Data, 0, seq, data, last_received) {
                failure = Some(LinkEvent::from(e));
                break;
            }
            staged_upto = seq;
        }
        if failure.is_none() && staged_upto > link.posted_upto {
            match link.flush() {
                Ok(()) => {
                    let first = (link.posted_upto + 1).max(st.outbox.front().map_or(0, |m| m.0));
                    st.stats.replayed += replays(first, staged_upto, st.max_posted);
                    st.max_posted = st.max_posted.max(staged_upto);
                    link.posted_upto = staged_upto;
                }
                Err(e) => failure = Some(LinkEvent::from(e)),
            }
        }
        let data_waits = next_unsent(&st.outbox, link.posted_upto).is_some();
        let last_received = st.last_received;
        drop(st);
        let quiet =
            link.pause.as_ref().is_some_and(|p| p.sent) || link.pause_ack_sent || link.close_sent;
        let owed = last_received > link.last_ack_sent
            || link.credits.lag() >= (self.sh.opts.recv_depth as u64 / 4).max(1);
        if failure.is_none() && owed && !quiet && link.can_post_control() {
            if let Err(e) = link.post(Kind::Ack, 0, 0, &[], last_received) {
                failure = Some(LinkEvent::from(e));
            }
        }
        // Out of credits with nothing in flight, a vanished peer would go unnoticed: probe.
        let starved = data_waits
            && !link.credits.can_send_data()
            && link.slots.in_flight() == 0
            && !quiet
            && link.pause.is_none()
            && link.peer_paused.is_none()
            && link.disconnecting.is_none();
        if failure.is_none() && link.starved.due(starved, Instant::now()) && link.free_slots() > 0 {
            if let Err(e) = link.post_probe() {
                failure = Some(LinkEvent::from(e));
            }
        }
        if let Some(f) = failure {
            self.link_lost(f, false);
        }
    }
}

/// The first message of the outbox after `sent_upto` on a path (what the peer acknowledged
/// meanwhile has left the outbox and is skipped).
pub(super) fn next_unsent(
    outbox: &VecDeque<(u64, Vec<u8>)>,
    sent_upto: u64,
) -> Option<&(u64, Vec<u8>)> {
    let front = outbox.front()?.0;
    let next = (sent_upto + 1).max(front);
    outbox.get((next - front) as usize)
}

/// How many of the messages `first..=last` just posted were posted before on some QP (up to
/// `max_posted`): replays.
pub(super) fn replays(first: u64, last: u64, max_posted: u64) -> u64 {
    (last.min(max_posted) + 1).saturating_sub(first)
}

/// Handles one work completion on a live link.
pub(super) fn process(
    link: &mut Link,
    st: &mut State,
    wc: &WorkCompletion,
    delivered: &mut bool,
) -> Result<(), LinkEvent> {
    if wc.wr_id >= ONESIDED_BASE {
        return onesided_done(link, st, wc, delivered);
    }
    if wc.wr_id < RECV_BASE {
        if !wc.ok() {
            return Err(LinkEvent::QpError {
                status: wc.status_str(),
                which: "send",
            });
        }
        link.slots
            .completed(wc.wr_id as u32)
            .map_err(|e| LinkEvent::Local(e.to_string()))?;
        return Ok(());
    }
    if !wc.ok() {
        return Err(LinkEvent::QpError {
            status: wc.status_str(),
            which: "receive",
        });
    }
    let slot = (wc.wr_id - RECV_BASE) as usize;
    let off = slot * link.slot;
    let bytes = link
        .ep
        .recv_mr
        .read(off, wc.byte_len as usize)
        .ok_or_else(|| LinkEvent::Protocol("receive completion longer than its slot".into()))?;
    let (h, payload) = Header::decode(bytes).map_err(|e| LinkEvent::Protocol(e.to_string()))?;
    link.credits.on_peer_credits(h.credits);
    while st.outbox.front().is_some_and(|(seq, _)| *seq <= h.ack) {
        st.outbox.pop_front();
        *delivered = true; // wakes senders waiting for room, and flush()
    }
    let mut withhold = false;
    match h.kind {
        Kind::Data => match classify(st.last_received, h.seq) {
            Arrival::Deliver => {
                st.inbox.push_back(payload.to_vec());
                st.last_received = h.seq;
                st.stats.inbox_high = st.stats.inbox_high.max(st.inbox.len() as u64);
                *delivered = true;
                withhold = st.inbox.len() >= link.inbox_limit;
            }
            Arrival::Duplicate => st.stats.duplicates_dropped += 1,
            Arrival::Gap { expected } => {
                return Err(LinkEvent::Protocol(format!(
                    "received sequence {} while expecting {expected}",
                    h.seq
                )))
            }
        },
        Kind::Ack => {}
        Kind::Pause => {
            link.peer_paused = Some(Instant::now());
            link.peer_bridging = h.flags & FLAG_BRIDGE != 0;
            link.owe_pause_ack = true;
        }
        Kind::PauseAck => {
            if let Some(p) = &mut link.pause {
                p.got_ack = true;
            }
        }
        Kind::Continue => {
            // The peer paused with its QP kept and is back on it: send again.
            link.peer_paused = None;
            link.peer_bridging = false;
            link.owe_pause_ack = false;
            link.pause_ack_sent = false;
            *delivered = true; // wakes senders waiting for room
        }
        Kind::Close => {
            st.peer_closed = true;
            *delivered = true;
        }
        Kind::Regions => {
            let entries =
                RegionEntry::decode_all(payload).map_err(|e| LinkEvent::Protocol(e.to_string()))?;
            st.onesided
                .peer
                .update(&entries)
                .map_err(|e| LinkEvent::Protocol(e.to_string()))?;
            for e in entries {
                link.remote_keys.insert(e.handle, e);
            }
            *delivered = true; // wakes `remote`
        }
    }
    if withhold {
        // The application is behind: the peer gets this credit back once it catches up.
        link.withheld.push((off, wc.wr_id));
        return Ok(());
    }
    repost(link, off, wc.wr_id)
}

/// Posts the receive in the slot at `off` again, which gives the peer one more credit.
pub(super) fn repost(link: &mut Link, off: usize, wr_id: u64) -> Result<(), LinkEvent> {
    link.ep
        .id
        .post_recv(&link.ep.recv_mr, off, link.slot, wr_id)
        .map_err(|e| LinkEvent::Local(format!("re-posting a receive: {}", error_chain(&e))))?;
    link.credits.on_reposted();
    Ok(())
}

/// Posts again the receives withheld while the inbox was full, as far as it has room now.
pub(super) fn repost_withheld(link: &mut Link, st: &State) -> Result<(), LinkEvent> {
    while st.inbox.len() < link.inbox_limit {
        let Some((off, wr_id)) = link.withheld.pop() else {
            break;
        };
        repost(link, off, wr_id)?;
    }
    Ok(())
}

/// Handles the completion of a WRITE or READ: the oldest in flight on this QP.
pub(super) fn onesided_done(
    link: &mut Link,
    st: &mut State,
    wc: &WorkCompletion,
    delivered: &mut bool,
) -> Result<(), LinkEvent> {
    let slot = (wc.wr_id - ONESIDED_BASE) as u32;
    let front = link.inflight.pop_front();
    if !wc.ok() {
        // The operation stays queued: the next QP posts it again.
        return Err(LinkEvent::QpError {
            status: wc.status_str(),
            which: "one-sided",
        });
    }
    let Some((posted_slot, id)) = front.filter(|(s, _)| *s == slot) else {
        return Err(LinkEvent::Local(format!(
            "one-sided completion for slot {slot} out of posting order"
        )));
    };
    // Frees its slot and those of the unsignaled SENDs posted before it. A READ's data is
    // taken from the slot below, before anything is posted into it again.
    link.slots
        .completed(slot)
        .map_err(|e| LinkEvent::Local(e.to_string()))?;
    let op = st
        .onesided
        .ops
        .complete(id)
        .map_err(|e| LinkEvent::Local(e.to_string()))?;
    if let OpKind::Read(len, reply) = op.kind {
        let data = link
            .ep
            .send_mr
            .read(posted_slot as usize * link.slot, len)
            .ok_or_else(|| LinkEvent::Local("read larger than a send slot".into()))?;
        // The caller may have given up: nobody to tell, then.
        let _ = reply.send(data.to_vec());
    }
    *delivered = true; // wakes flush_writes and writers waiting for room
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_unsent_message_skips_what_was_acknowledged() {
        let outbox: VecDeque<(u64, Vec<u8>)> = (5..=8).map(|seq| (seq, vec![seq as u8])).collect();
        // A path that sent up to 2 while 3 and 4 were acknowledged goes on at 5.
        assert_eq!(next_unsent(&outbox, 2).map(|m| m.0), Some(5));
        assert_eq!(next_unsent(&outbox, 6).map(|m| m.0), Some(7));
        assert_eq!(next_unsent(&outbox, 8), None);
        assert_eq!(next_unsent(&VecDeque::new(), 0), None);
    }

    #[test]
    fn replays_count_the_messages_posted_before() {
        // 5..=9 posted, of which 5..=7 had been posted on an earlier QP.
        assert_eq!(replays(5, 9, 7), 3);
        assert_eq!(replays(5, 9, 4), 0);
        assert_eq!(replays(5, 9, 12), 5);
        assert_eq!(replays(1, 1, 0), 0);
    }
}
