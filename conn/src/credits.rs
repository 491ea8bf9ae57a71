//! Pure bookkeeping of one QP's credits and of in-order delivery (no verbs), unit tested.

use std::time::{Duration, Instant};

/// Credits on one QP: how many SENDs the peer has receives posted for, and what we owe it.
///
/// All counters are cumulative since the QP was set up. The peer's header field `credits`
/// is the number of receives it has posted so far; we may have at most that many messages
/// outstanding in total. DATA keeps `reserve` credits back for control messages (ACK, PAUSE,
/// PAUSE_ACK, CLOSE), so control can always flow.
#[derive(Debug, Clone)]
pub(crate) struct Credits {
    peer_limit: u64,
    sent: u64,
    my_posted: u64,
    advertised: u64,
    reserve: u64,
}

impl Credits {
    /// `peer_initial`: receives the peer pre-posted; `my_initial`: ours (already announced in
    /// the private data).
    pub(crate) fn new(peer_initial: u64, my_initial: u64, reserve: u64) -> Self {
        Self {
            peer_limit: peer_initial,
            sent: 0,
            my_posted: my_initial,
            advertised: my_initial,
            reserve,
        }
    }

    pub(crate) fn can_send_data(&self) -> bool {
        self.sent + self.reserve < self.peer_limit
    }

    pub(crate) fn can_send_control(&self) -> bool {
        self.sent < self.peer_limit
    }

    /// Records one message sent; returns the credit value to put in its header.
    pub(crate) fn on_sent(&mut self) -> u64 {
        self.sent += 1;
        self.advertised = self.my_posted;
        self.my_posted
    }

    /// The peer announced `credits` (cumulative receives posted).
    pub(crate) fn on_peer_credits(&mut self, credits: u64) {
        self.peer_limit = self.peer_limit.max(credits);
    }

    /// We re-posted one receive.
    pub(crate) fn on_reposted(&mut self) {
        self.my_posted += 1;
    }

    /// Receives posted since we last told the peer.
    pub(crate) fn lag(&self) -> u64 {
        self.my_posted - self.advertised
    }
}

/// When a sender that waits for credits, with nothing in flight, probes its peer.
///
/// Such a sender would never learn that the peer's device vanished: nothing it has posted
/// can time out, and no credits will come. A zero-length RDMA WRITE every `every` takes no
/// receive (no credit) at the peer, completes if the peer is there and fails with retry
/// exceeded if it is gone.
#[derive(Debug, Clone)]
pub(crate) struct StarvedProbe {
    every: Duration,
    since: Option<Instant>,
}

impl StarvedProbe {
    pub(crate) fn new(every: Duration) -> Self {
        Self { every, since: None }
    }

    /// The sender is starved and a probe will be due: its owner must look again within
    /// `every`.
    pub(crate) fn armed(&self) -> bool {
        self.since.is_some()
    }

    /// Called on every pass with whether the sender is starved (DATA waits for credits and
    /// nothing is in flight); says whether to probe now.
    pub(crate) fn due(&mut self, starved: bool, now: Instant) -> bool {
        if !starved {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) < self.every {
            return false;
        }
        self.since = Some(now);
        true
    }
}

/// What to do with an arriving DATA sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// The next one in order: deliver.
    Deliver,
    /// Already delivered (a replay overlap): drop.
    Duplicate,
    /// Skips ahead: a protocol violation (RC delivers in order and replay starts at the
    /// peer's last received + 1).
    Gap {
        /// The sequence number expected.
        expected: u64,
    },
}

pub(crate) fn classify(last_received: u64, seq: u64) -> Arrival {
    if seq == last_received + 1 {
        Arrival::Deliver
    } else if seq <= last_received {
        Arrival::Duplicate
    } else {
        Arrival::Gap {
            expected: last_received + 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_keeps_the_reserve_for_control() {
        let mut c = Credits::new(8, 8, 2);
        let mut data = 0;
        while c.can_send_data() {
            c.on_sent();
            data += 1;
        }
        assert_eq!(data, 6);
        assert!(c.can_send_control());
        c.on_sent();
        c.on_sent();
        assert!(!c.can_send_control());
        c.on_peer_credits(12);
        assert!(c.can_send_data());
        // Stale (smaller) announcements never shrink the limit.
        c.on_peer_credits(3);
        assert!(c.can_send_data());
    }

    #[test]
    fn lag_counts_reposts_since_the_last_message() {
        let mut c = Credits::new(8, 8, 2);
        c.on_reposted();
        c.on_reposted();
        assert_eq!(c.lag(), 2);
        assert_eq!(c.on_sent(), 10);
        assert_eq!(c.lag(), 0);
    }

    #[test]
    fn a_starved_sender_probes_once_per_interval() {
        let every = Duration::from_secs(1);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut p = StarvedProbe::new(every);
        assert!(!p.due(true, at(0)));
        assert!(!p.due(true, at(999)));
        assert!(p.due(true, at(1000)));
        assert!(!p.due(true, at(1500)));
        assert!(p.due(true, at(2000)));
        // Credits came (or something is in flight): the interval starts again.
        assert!(!p.due(false, at(2100)));
        assert!(!p.due(true, at(2200)));
        assert!(!p.due(true, at(3100)));
        assert!(p.due(true, at(3200)));
        assert!(!p.due(false, at(9000)));
    }

    #[test]
    fn arrivals() {
        assert_eq!(classify(0, 1), Arrival::Deliver);
        assert_eq!(classify(5, 5), Arrival::Duplicate);
        assert_eq!(classify(5, 2), Arrival::Duplicate);
        assert_eq!(classify(5, 7), Arrival::Gap { expected: 6 });
    }
}
