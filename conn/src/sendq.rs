//! Pure bookkeeping of one QP's send slots (no verbs), unit tested: which slots are free,
//! which the send queue still holds, and which SENDs ask for a completion.
//!
//! Not every SEND is signaled: a completion costs Soft-RoCE a CQE and, on an armed CQ, an
//! event that wakes the worker. A SEND is signaled when it ends the chain posted in one
//! doorbell, or when `signal_every` sends in a row would otherwise go unsignaled (so slots
//! come back while a long chain is still being sent). RC completes a QP's sends in posting
//! order, so a signaled completion also completes every send posted before it: their slots
//! are free again. Since the last send of every chain is signaled, nothing stays in flight
//! without a completion to come (a quiesce waits for none in flight).

use std::collections::VecDeque;
use thiserror::Error;

#[derive(Debug)]
pub(crate) struct SendSlots {
    free: Vec<u32>,
    /// Slots posted whose completion has not been seen (directly or through a later
    /// signaled one), in posting order.
    posted: VecDeque<u32>,
    /// Unsignaled sends posted since the last signaled one.
    unsignaled: u32,
    signal_every: u32,
}

impl SendSlots {
    /// `slots` slots (0..slots), a completion at least every `signal_every` sends.
    pub(crate) fn new(slots: u32, signal_every: u32) -> Self {
        Self {
            free: (0..slots).rev().collect(),
            posted: VecDeque::with_capacity(slots as usize),
            unsignaled: 0,
            signal_every: signal_every.max(1),
        }
    }

    /// Slots free to take.
    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }

    /// Sends posted and not yet complete.
    pub(crate) fn in_flight(&self) -> usize {
        self.posted.len()
    }

    /// A free slot to write a message into; it is posted next ([`SendSlots::posted`]).
    pub(crate) fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Records `slot` as posted; returns whether its send must be signaled. `ends_chain`: it
    /// is the last work request of its `ibv_post_send` (one-sided operations, which each need
    /// their own completion, are posted as chains of one).
    pub(crate) fn posted(&mut self, slot: u32, ends_chain: bool) -> bool {
        self.posted.push_back(slot);
        let signaled = ends_chain || self.unsignaled + 1 >= self.signal_every;
        self.unsignaled = if signaled { 0 } else { self.unsignaled + 1 };
        signaled
    }

    /// A completion for `slot`: it and every send posted before it are complete, their slots
    /// free again. Returns how many were freed; an error if `slot` is not in flight.
    pub(crate) fn completed(&mut self, slot: u32) -> Result<usize, NotInFlight> {
        let at = self
            .posted
            .iter()
            .position(|s| *s == slot)
            .ok_or(NotInFlight { slot })?;
        self.free.extend(self.posted.drain(..=at));
        Ok(at + 1)
    }
}

/// A send completion for a slot that holds no posted send (the QP or the worker is broken).
#[derive(Debug, Error, PartialEq, Eq)]
#[error("a send completion for slot {slot}, which is not in flight")]
pub(crate) struct NotInFlight {
    /// The completion's slot.
    pub(crate) slot: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Posts `n` slots as one chain; returns the slots and their signaled flags.
    fn chain(s: &mut SendSlots, n: usize) -> Vec<(u32, bool)> {
        (0..n)
            .map(|i| {
                let slot = s.take().expect("a free slot");
                (slot, s.posted(slot, i + 1 == n))
            })
            .collect()
    }

    #[test]
    fn a_chain_is_signaled_at_its_end_and_every_nth_send() {
        let mut s = SendSlots::new(16, 4);
        let flags: Vec<bool> = chain(&mut s, 10).iter().map(|c| c.1).collect();
        assert_eq!(
            flags,
            [false, false, false, true, false, false, false, true, false, true]
        );
        // A chain of one (a control message, a one-sided operation) is always signaled.
        assert!(chain(&mut s, 1)[0].1);
        assert_eq!(s.in_flight(), 11);
        assert_eq!(s.free(), 5);
    }

    #[test]
    fn a_signaled_completion_frees_every_send_before_it() {
        let mut s = SendSlots::new(8, 4);
        let c = chain(&mut s, 6);
        // The 4th is signaled: it completes the first four.
        assert!(c[3].1);
        assert_eq!(s.completed(c[3].0), Ok(4));
        assert_eq!(s.in_flight(), 2);
        assert_eq!(s.free(), 6);
        assert_eq!(s.completed(c[5].0), Ok(2));
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.free(), 8);
        // Every slot is handed out again, each once.
        let mut all: Vec<u32> = (0..8).map(|_| s.take().unwrap()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        assert_eq!(s.take(), None);
    }

    #[test]
    fn a_completion_for_a_slot_not_in_flight_is_an_error() {
        let mut s = SendSlots::new(4, 2);
        let c = chain(&mut s, 2);
        assert_eq!(s.completed(c[1].0), Ok(2));
        assert!(s.completed(c[1].0).is_err());
        assert!(s.completed(3).is_err());
        assert_eq!(s.free(), 4);
    }

    #[test]
    fn nothing_stays_in_flight_without_a_completion_to_come() {
        // Whatever the chain lengths, the last send posted is signaled: once its completion
        // arrives nothing is left in flight.
        for every in 1..6 {
            let mut s = SendSlots::new(64, every);
            for n in [1, 3, 7, 2, 9, 1] {
                let c = chain(&mut s, n);
                let last = *c.last().unwrap();
                assert!(last.1, "every={every} n={n}");
                s.completed(last.0).unwrap();
                assert_eq!(s.in_flight(), 0);
            }
        }
    }
}
