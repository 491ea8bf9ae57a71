//! What a rebuild on a new device needs, recorded while the program makes and drives its
//! objects: a move replaces the device, and nothing of the old one can be asked afterwards.
//!
//! - [`QpSetup`]: a QP's attributes as the program set them, accumulated over its
//!   ibv_modify_qp calls (path MTU, PSNs, timeouts, the remote GID and QP number), so that
//!   the new QP can be walked through the same states.
//! - [`Receives`]: the receives posted and not yet completed, with their scatter lists and
//!   `wr_id`s, so that the new QP gets them again: the program posted them once and waits
//!   for their completions, not for a chance to post again.
//!
//! Plain data and pure logic: the exported verbs and the data path ([`crate::exports`],
//! [`crate::ops`]) feed them.

use std::collections::VecDeque;
use std::os::raw::c_int;

use rdma_sys::{ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_state, ibv_sge};

/// A QP's attributes as the program set them: each ibv_modify_qp's fields, by its mask.
pub struct QpSetup {
    attr: ibv_qp_attr,
    mask: u32,
}

impl Default for QpSetup {
    fn default() -> Self {
        Self {
            // SAFETY: ibv_qp_attr is plain data (integers and GIDs): all-zero is valid.
            attr: unsafe { std::mem::zeroed() },
            mask: 0,
        }
    }
}

/// Copies the fields one mask bit names from the second attributes to the first.
type CopyFields = fn(&mut ibv_qp_attr, &ibv_qp_attr);

/// Which fields of `ibv_qp_attr` each mask bit names (verbs.h, `enum ibv_qp_attr_mask`).
const FIELDS: &[(ibv_qp_attr_mask, CopyFields)] = &[
    (ibv_qp_attr_mask::IBV_QP_STATE, |to, from| {
        to.qp_state = from.qp_state
    }),
    (ibv_qp_attr_mask::IBV_QP_CUR_STATE, |to, from| {
        to.cur_qp_state = from.cur_qp_state
    }),
    (ibv_qp_attr_mask::IBV_QP_EN_SQD_ASYNC_NOTIFY, |to, from| {
        to.en_sqd_async_notify = from.en_sqd_async_notify
    }),
    (ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS, |to, from| {
        to.qp_access_flags = from.qp_access_flags
    }),
    (ibv_qp_attr_mask::IBV_QP_PKEY_INDEX, |to, from| {
        to.pkey_index = from.pkey_index
    }),
    (ibv_qp_attr_mask::IBV_QP_PORT, |to, from| {
        to.port_num = from.port_num
    }),
    (ibv_qp_attr_mask::IBV_QP_QKEY, |to, from| {
        to.qkey = from.qkey
    }),
    (ibv_qp_attr_mask::IBV_QP_AV, |to, from| {
        to.ah_attr = from.ah_attr
    }),
    (ibv_qp_attr_mask::IBV_QP_PATH_MTU, |to, from| {
        to.path_mtu = from.path_mtu
    }),
    (ibv_qp_attr_mask::IBV_QP_TIMEOUT, |to, from| {
        to.timeout = from.timeout
    }),
    (ibv_qp_attr_mask::IBV_QP_RETRY_CNT, |to, from| {
        to.retry_cnt = from.retry_cnt
    }),
    (ibv_qp_attr_mask::IBV_QP_RNR_RETRY, |to, from| {
        to.rnr_retry = from.rnr_retry
    }),
    (ibv_qp_attr_mask::IBV_QP_RQ_PSN, |to, from| {
        to.rq_psn = from.rq_psn
    }),
    (ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC, |to, from| {
        to.max_rd_atomic = from.max_rd_atomic
    }),
    (ibv_qp_attr_mask::IBV_QP_ALT_PATH, |to, from| {
        to.alt_ah_attr = from.alt_ah_attr;
        to.alt_pkey_index = from.alt_pkey_index;
        to.alt_port_num = from.alt_port_num;
        to.alt_timeout = from.alt_timeout;
    }),
    (ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER, |to, from| {
        to.min_rnr_timer = from.min_rnr_timer
    }),
    (ibv_qp_attr_mask::IBV_QP_SQ_PSN, |to, from| {
        to.sq_psn = from.sq_psn
    }),
    (ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC, |to, from| {
        to.max_dest_rd_atomic = from.max_dest_rd_atomic
    }),
    (ibv_qp_attr_mask::IBV_QP_PATH_MIG_STATE, |to, from| {
        to.path_mig_state = from.path_mig_state
    }),
    (ibv_qp_attr_mask::IBV_QP_CAP, |to, from| to.cap = from.cap),
    (ibv_qp_attr_mask::IBV_QP_DEST_QPN, |to, from| {
        to.dest_qp_num = from.dest_qp_num
    }),
    (ibv_qp_attr_mask::IBV_QP_RATE_LIMIT, |to, from| {
        to.rate_limit = from.rate_limit
    }),
];

impl QpSetup {
    /// Takes the fields `mask` names from `attr`: what a successful ibv_modify_qp set.
    pub fn apply(&mut self, attr: &ibv_qp_attr, mask: c_int) {
        let mask = mask as u32;
        for (bit, copy) in FIELDS {
            if mask & bit.0 != 0 {
                copy(&mut self.attr, attr);
            }
        }
        self.mask |= mask;
    }

    /// Every field the program has set, the rest zero.
    pub fn attr(&self) -> &ibv_qp_attr {
        &self.attr
    }

    /// A copy of [`QpSetup::attr`], to walk a new QP with.
    pub fn attr_copy(&self) -> ibv_qp_attr {
        copy_attr(&self.attr)
    }

    /// Whether the program has set the fields `bit` names.
    pub fn has(&self, bit: ibv_qp_attr_mask) -> bool {
        self.mask & bit.0 != 0
    }

    /// The state the program last moved the QP to (RESET before any).
    pub fn state(&self) -> ibv_qp_state::Type {
        if self.has(ibv_qp_attr_mask::IBV_QP_STATE) {
            self.attr.qp_state
        } else {
            ibv_qp_state::IBV_QPS_RESET
        }
    }
}

/// A copy of `attr` (plain data: integers and GIDs, which bindgen leaves without `Copy`).
pub fn copy_attr(attr: &ibv_qp_attr) -> ibv_qp_attr {
    // SAFETY: ibv_qp_attr holds no pointers and no ownership: a bitwise copy is a copy.
    unsafe { std::ptr::read(attr) }
}

/// One receive the program posted: what the new QP must be given again.
#[derive(Clone)]
pub struct PostedReceive {
    /// The program's `wr_id`, which its completion will carry.
    pub wr_id: u64,
    /// Its scatter list, with the program's lkeys.
    pub sges: Vec<ibv_sge>,
}

/// The receives of one QP posted and not yet completed, oldest first.
///
/// A QP without an SRQ completes its receives in the order they were posted, so a
/// successful receive completion is always the oldest one. A failed completion carries no
/// opcode (verbs.h), and it puts the QP in the error state, where every receive is flushed:
/// from then on nothing is tracked ([`Receives::lost_track`]).
#[derive(Clone, Default)]
pub struct Receives {
    posted: VecDeque<PostedReceive>,
    lost: bool,
}

impl Receives {
    /// Records a receive the provider accepted.
    pub fn posted(&mut self, receive: PostedReceive) {
        if !self.lost {
            self.posted.push_back(receive);
        }
    }

    /// Records a successful receive completion with `wr_id`. One that is not the oldest
    /// posted receive's breaks the order the rebuild relies on: tracking stops.
    pub fn completed(&mut self, wr_id: u64) {
        match self.posted.front() {
            Some(oldest) if oldest.wr_id == wr_id => {
                self.posted.pop_front();
            }
            _ => self.lose_track(),
        }
    }

    /// The QP failed a work request or entered the error state: what was posted is flushed.
    pub fn lose_track(&mut self) {
        self.posted.clear();
        self.lost = true;
    }

    /// The receives posted and not completed, oldest first.
    pub fn outstanding(&self) -> impl ExactSizeIterator<Item = &PostedReceive> {
        self.posted.iter()
    }

    /// Whether tracking stopped (a failed completion, or one out of order).
    pub fn lost_track(&self) -> bool {
        self.lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rdma_sys::ibv_mtu;

    fn attr() -> ibv_qp_attr {
        // SAFETY: plain data, as in `QpSetup::default`.
        unsafe { std::mem::zeroed() }
    }

    #[test]
    fn a_modify_takes_only_the_fields_its_mask_names() {
        let mut setup = QpSetup::default();
        let mut rtr = attr();
        rtr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        rtr.path_mtu = ibv_mtu::IBV_MTU_1024;
        rtr.dest_qp_num = 0x12;
        rtr.rq_psn = 0xabcdef;
        rtr.ah_attr.is_global = 1;
        rtr.ah_attr.grh.dgid.raw = [7; 16];
        rtr.sq_psn = 99; // not in the mask: ignored
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_AV;
        setup.apply(&rtr, mask.0 as c_int);
        assert_eq!(setup.state(), ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(setup.attr().dest_qp_num, 0x12);
        assert_eq!(setup.attr().rq_psn, 0xabcdef);
        assert_eq!(setup.attr().path_mtu, ibv_mtu::IBV_MTU_1024);
        // SAFETY: reading the GID's raw bytes, which are plain data.
        assert_eq!(unsafe { setup.attr().ah_attr.grh.dgid.raw }, [7; 16]);
        assert_eq!(setup.attr().sq_psn, 0, "not named by the mask");
        assert!(!setup.has(ibv_qp_attr_mask::IBV_QP_SQ_PSN));

        let mut rts = attr();
        rts.qp_state = ibv_qp_state::IBV_QPS_RTS;
        rts.sq_psn = 0x123;
        rts.timeout = 14;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT;
        setup.apply(&rts, mask.0 as c_int);
        assert_eq!(setup.state(), ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(setup.attr().sq_psn, 0x123);
        assert_eq!(setup.attr().timeout, 14);
        assert_eq!(setup.attr().dest_qp_num, 0x12, "kept from the RTR");
    }

    #[test]
    fn a_new_qp_is_in_reset() {
        assert_eq!(QpSetup::default().state(), ibv_qp_state::IBV_QPS_RESET);
    }

    #[test]
    fn every_mask_bit_verbs_h_names_for_an_rc_qp_is_carried() {
        let all = FIELDS.iter().fold(0, |all, (bit, _)| all | bit.0);
        // IBV_QP_STATE .. IBV_QP_DEST_QPN, and the rate limit.
        assert_eq!(all, 0x1f_ffff | ibv_qp_attr_mask::IBV_QP_RATE_LIMIT.0);
    }

    fn receive(wr_id: u64) -> PostedReceive {
        PostedReceive {
            wr_id,
            sges: vec![ibv_sge {
                addr: wr_id * 4096,
                length: 4096,
                lkey: 5,
            }],
        }
    }

    #[test]
    fn a_failed_or_unordered_completion_stops_the_tracking() {
        let mut receives = Receives::default();
        receives.posted(receive(1));
        receives.posted(receive(2));
        receives.completed(2);
        assert!(receives.lost_track());
        assert_eq!(receives.outstanding().len(), 0);
        receives.posted(receive(3));
        assert_eq!(receives.outstanding().len(), 0, "nothing tracked once lost");
    }

    proptest! {
        /// Posting receives and completing them in order, interleaved any way, leaves
        /// exactly the ones not yet completed, oldest first, with their scatter lists.
        #[test]
        fn the_outstanding_receives_are_the_posted_ones_not_yet_completed(
            steps in proptest::collection::vec(any::<bool>(), 0..200)
        ) {
            let mut receives = Receives::default();
            let (mut next_post, mut next_completion) = (0u64, 0u64);
            for post in steps {
                if post || next_completion == next_post {
                    receives.posted(receive(next_post));
                    next_post += 1;
                } else {
                    receives.completed(next_completion);
                    next_completion += 1;
                }
            }
            prop_assert!(!receives.lost_track());
            let left: Vec<u64> = receives.outstanding().map(|r| r.wr_id).collect();
            prop_assert_eq!(left, (next_completion..next_post).collect::<Vec<_>>());
            for r in receives.outstanding() {
                prop_assert_eq!(r.sges[0].addr, r.wr_id * 4096);
            }
        }
    }
}
