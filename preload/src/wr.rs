//! Owned copies of the program's work requests: the sends a pause holds, and the requests a
//! post after a move hands the provider with the real keys.
//!
//! The program's chain is only the program's during the call: a held send must be copied
//! whole (its scatter list; for an inline send, the bytes themselves, since the program may
//! reuse an inline send's buffer as soon as the post returns).

use std::os::raw::c_int;

use rdma_sys::{ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode};

use crate::record::PostedReceive;

/// One send request, owned.
pub struct HeldSend {
    /// The request, bitwise; its `next`, `sg_list` and `num_sge` are set when it is posted.
    wr: ibv_send_wr,
    /// Its scatter list (for an inline send: one entry over `inline`).
    sges: Vec<ibv_sge>,
    /// An inline send's bytes.
    inline: Vec<u8>,
}

// SAFETY: the copy's pointers are the program's buffers (valid until the request
// completes, as the verbs contract says) or its own vectors; it is used under a lock.
unsafe impl Send for HeldSend {}

impl HeldSend {
    /// Copies one request of the program's chain.
    ///
    /// # Safety
    /// `wr` is a live request whose scatter list has `num_sge` entries, and whose inline
    /// data (if `IBV_SEND_INLINE`) is readable.
    pub unsafe fn copy(wr: *const ibv_send_wr) -> Self {
        // SAFETY: the caller's live request; a bitwise copy of plain data and pointers.
        let mut copy: ibv_send_wr = unsafe { std::ptr::read(wr) };
        let sges: Vec<ibv_sge> = match copy.num_sge {
            // SAFETY: the caller's scatter list of `num_sge` entries.
            n if n > 0 => unsafe { std::slice::from_raw_parts(copy.sg_list, n as usize) }.to_vec(),
            _ => Vec::new(),
        };
        copy.next = std::ptr::null_mut();
        let mut held = HeldSend {
            wr: copy,
            sges,
            inline: Vec::new(),
        };
        if held.is_inline() {
            for sge in &held.sges {
                // SAFETY: an inline send's data is readable at post time (the caller's).
                let bytes = unsafe {
                    std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize)
                };
                held.inline.extend_from_slice(bytes);
            }
            held.sges = vec![ibv_sge {
                addr: 0,
                length: held.inline.len() as u32,
                lkey: 0,
            }];
        }
        held
    }

    fn is_inline(&self) -> bool {
        self.wr.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 != 0
    }

    /// Whether its completion will be seen (signaled, or every request is).
    pub fn signaled(&self, sig_all: bool) -> bool {
        sig_all || self.wr.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0
    }

    /// Gives the request the real keys: its lkeys, and the remote end's rkey of an RDMA or
    /// atomic request.
    pub fn translate(&mut self, lkey: impl Fn(u32) -> u32, rkey: impl Fn(u32) -> u32) {
        if !self.is_inline() {
            for sge in &mut self.sges {
                sge.lkey = lkey(sge.lkey);
            }
        }
        use ibv_wr_opcode::*;
        // SAFETY: the union member the opcode names (verbs.h).
        unsafe {
            match self.wr.opcode {
                IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM | IBV_WR_RDMA_READ => {
                    self.wr.wr.rdma.rkey = rkey(self.wr.wr.rdma.rkey)
                }
                IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD => {
                    self.wr.wr.atomic.rkey = rkey(self.wr.wr.atomic.rkey)
                }
                _ => {}
            }
        }
    }
}

/// Copies the program's whole chain from `first`.
///
/// # Safety
/// `first` is null or a chain of live requests, as [`HeldSend::copy`] needs.
pub unsafe fn copy_chain(first: *const ibv_send_wr) -> Vec<HeldSend> {
    let mut out = Vec::new();
    let mut next = first;
    while !next.is_null() {
        // SAFETY: the caller's live chain.
        unsafe {
            out.push(HeldSend::copy(next));
            next = (*next).next;
        }
    }
    out
}

/// Links `sends` into one chain for the provider and gives its head (null when empty).
/// The chain points into `sends`, which must stay put until the post returns.
pub fn link_sends(sends: &mut [HeldSend]) -> *mut ibv_send_wr {
    let mut next: *mut ibv_send_wr = std::ptr::null_mut();
    for send in sends.iter_mut().rev() {
        if send.is_inline() {
            send.sges[0].addr = send.inline.as_ptr() as u64;
        }
        send.wr.sg_list = send.sges.as_mut_ptr();
        send.wr.num_sge = send.sges.len() as c_int;
        send.wr.next = next;
        next = &mut send.wr;
    }
    next
}

/// The index in `sends` of the request at `bad` (a pointer into the linked chain).
pub fn index_of(sends: &[HeldSend], bad: *const ibv_send_wr) -> Option<usize> {
    sends.iter().position(|s| std::ptr::eq(&s.wr, bad))
}

/// Receive requests for the provider, owned, with the real lkeys.
pub struct RecvChain {
    wrs: Vec<ibv_recv_wr>,
    sges: Vec<Vec<ibv_sge>>,
}

impl RecvChain {
    /// The receives in `receives`, each scatter entry's lkey through `lkey`.
    pub fn new<'a>(
        receives: impl Iterator<Item = &'a PostedReceive>,
        lkey: impl Fn(u32) -> u32,
    ) -> Self {
        let mut chain = RecvChain {
            wrs: Vec::new(),
            sges: Vec::new(),
        };
        for receive in receives {
            // SAFETY: all-zero is a valid ibv_recv_wr (null pointers, zero counts).
            let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = receive.wr_id;
            chain.wrs.push(wr);
            let mut sges = receive.sges.clone();
            for sge in &mut sges {
                sge.lkey = lkey(sge.lkey);
            }
            chain.sges.push(sges);
        }
        chain
    }

    /// The chain's head (null when empty); it points into `self`.
    pub fn link(&mut self) -> *mut ibv_recv_wr {
        let mut next: *mut ibv_recv_wr = std::ptr::null_mut();
        for (wr, sges) in self.wrs.iter_mut().zip(&mut self.sges).rev() {
            wr.sg_list = sges.as_mut_ptr();
            wr.num_sge = sges.len() as c_int;
            wr.next = next;
            next = wr;
        }
        next
    }

    /// How many requests come before `bad` in the linked chain (all of them if null).
    pub fn accepted_before(&self, bad: *const ibv_recv_wr) -> usize {
        self.wrs
            .iter()
            .position(|w| std::ptr::eq(w, bad))
            .unwrap_or(self.wrs.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(wr_id: u64, flags: u32, sges: &mut [ibv_sge]) -> ibv_send_wr {
        // SAFETY: all-zero is a valid ibv_send_wr.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = flags;
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = sges.len() as c_int;
        wr.wr.rdma.rkey = 70;
        wr
    }

    #[test]
    fn a_held_chain_is_the_programs_with_real_keys_and_its_own_inline_bytes() {
        let mut data = *b"inline!";
        let mut first_sges = [ibv_sge {
            addr: 0x1000,
            length: 64,
            lkey: 7,
        }];
        let mut second_sges = [ibv_sge {
            addr: data.as_mut_ptr() as u64,
            length: data.len() as u32,
            lkey: 7,
        }];
        let mut second = send(2, ibv_send_flags::IBV_SEND_INLINE.0, &mut second_sges);
        let mut first = send(1, ibv_send_flags::IBV_SEND_SIGNALED.0, &mut first_sges);
        first.next = &mut second;
        // SAFETY: a live chain of two requests built above.
        let mut held = unsafe { copy_chain(&first) };
        data.fill(0); // the program reuses its inline buffer at once
        assert_eq!(held.len(), 2);
        assert!(held[0].signaled(false) && !held[1].signaled(false));
        assert!(held[1].signaled(true));
        for h in &mut held {
            h.translate(|l| l + 100, |r| r + 1000);
        }
        let head = link_sends(&mut held);
        // SAFETY: the chain just linked, pointing into `held`.
        unsafe {
            assert_eq!((*head).wr_id, 1);
            assert_eq!((*(*head).sg_list).lkey, 107);
            assert_eq!((*head).wr.rdma.rkey, 1070);
            let second = (*head).next;
            assert_eq!((*second).wr_id, 2);
            let sge = *(*second).sg_list;
            let bytes = std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize);
            assert_eq!(bytes, b"inline!");
            assert!((*second).next.is_null());
            assert_eq!(index_of(&held, second), Some(1));
        }
    }

    #[test]
    fn receives_are_linked_in_order_with_real_lkeys() {
        let posted: Vec<PostedReceive> = (0..3)
            .map(|i| PostedReceive {
                wr_id: i,
                sges: vec![ibv_sge {
                    addr: i * 10,
                    length: 10,
                    lkey: 3,
                }],
            })
            .collect();
        let mut chain = RecvChain::new(posted.iter(), |l| l * 2);
        let head = chain.link();
        let mut ids = Vec::new();
        let mut next = head;
        while !next.is_null() {
            // SAFETY: the chain just linked.
            unsafe {
                ids.push((*next).wr_id);
                assert_eq!((*(*next).sg_list).lkey, 6);
                next = (*next).next;
            }
        }
        assert_eq!(ids, [0, 1, 2]);
        assert_eq!(chain.accepted_before(std::ptr::null()), 3);
        // SAFETY: the head, in the chain.
        let second = unsafe { (*head).next };
        assert_eq!(chain.accepted_before(second), 1);
    }
}
