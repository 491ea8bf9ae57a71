//! One QP of a connection: its verbs objects ([`Endpoint`], released in dependency order) and
//! the per-link bookkeeping ([`Link`]: credits, send slots, the pause in progress, the
//! one-sided keys), with the calls that write and post on it. A link lives from its
//! `install` to its loss; everything that must survive a move lives in the shared state.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use rdmamig_proto::text::error_chain;
use tokio::io::unix::AsyncFd;

use thiserror::Error;

use crate::credits::{Credits, StarvedProbe};
use crate::failure::LinkEvent;
use crate::onesided::{remote_access, OpKind};
use crate::sendq::SendSlots;
use crate::shared::State;
use crate::wire::{Header, Kind, RegionEntry, HEADER_LEN};
use rdmamig_verbs::{
    CmId, CompletionChannel, CompletionQueue, ExposedRegion, MemoryRegion, ProtectionDomain,
    QpCaps, RdmaOp, SendWr, VerbsError,
};

/// wr_id of receives: RECV_BASE + slot; sends use the slot number.
pub(crate) const RECV_BASE: u64 = 1 << 32;

/// wr_id of one-sided WRITEs and READs: ONESIDED_BASE + slot.
pub(super) const ONESIDED_BASE: u64 = 1 << 40;

/// Credits DATA leaves for control messages.
pub(super) const RESERVE: u64 = 4;

/// Extra send slots beyond the receive depth (room for control messages).
pub(crate) const EXTRA_SEND_SLOTS: u32 = 8;

/// A SEND is signaled at least this often within a chain (see [`SendSlots`]).
pub(super) const SIGNAL_EVERY: u32 = 16;

/// The verbs objects of one QP. `Drop` destroys the QP, then the fields drop in order:
/// CQ, completion channel, MRs, PD, and the cm id last.
pub(crate) struct Endpoint {
    pub(crate) cq: CompletionQueue,
    pub(crate) comp: CompletionChannel,
    pub(crate) send_mr: MemoryRegion,
    pub(crate) recv_mr: MemoryRegion,
    pub(super) pd: ProtectionDomain,
    pub(crate) id: CmId,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.id.destroy_qp();
    }
}

pub(crate) fn build_endpoint(
    mut id: CmId,
    depth: u32,
    slot: usize,
) -> Result<Endpoint, VerbsError> {
    let send_slots = depth + EXTRA_SEND_SLOTS;
    let pd = id.alloc_pd()?;
    let comp = id.create_comp_channel()?;
    let cq = comp.create_cq(send_slots + depth)?;
    id.create_qp(
        &pd,
        &cq,
        QpCaps {
            max_send_wr: send_slots,
            max_recv_wr: depth,
            max_inline_data: 0,
        },
    )?;
    let send_mr = pd.register(send_slots as usize * slot)?;
    let recv_mr = pd.register(depth as usize * slot)?;
    for i in 0..depth as usize {
        id.post_recv(&recv_mr, i * slot, slot, RECV_BASE + i as u64)?;
    }
    cq.req_notify()?;
    Ok(Endpoint {
        cq,
        comp,
        send_mr,
        recv_mr,
        pd,
        id,
    })
}

/// What failed in writing or posting on a link. Any of them leaves the link unusable: the
/// worker gives it up as a local [`LinkEvent`] naming the whole chain.
#[derive(Debug, Error)]
pub(super) enum PostError {
    /// Every send slot is in flight or staged.
    #[error("no free send slot")]
    NoFreeSlot,
    /// A WRITE's data does not fit a send slot.
    #[error("write larger than a send slot")]
    WriteTooLarge,
    /// A message does not fit a send slot.
    #[error("message larger than a send slot")]
    MessageTooLarge,
    /// ibv_post_send of a WRITE or READ failed.
    #[error("posting an RDMA {op:?}")]
    Rdma {
        /// WRITE or READ.
        op: RdmaOp,
        /// The cause.
        #[source]
        source: VerbsError,
    },
    /// ibv_post_send of the starved sender's probe failed.
    #[error("posting a probe")]
    Probe(#[source] VerbsError),
    /// Registering an exposed buffer on this QP's PD failed.
    #[error("registering exposed buffer {handle}")]
    RegisterExposed {
        /// The buffer's handle.
        handle: u64,
        /// The cause.
        #[source]
        source: VerbsError,
    },
    /// ibv_post_send of a chain of SENDs failed part way.
    #[error("posting {n} sends failed after {posted}")]
    Sends {
        /// SENDs in the chain.
        n: usize,
        /// How many were posted.
        posted: usize,
        /// The cause.
        #[source]
        source: VerbsError,
    },
}

impl From<PostError> for LinkEvent {
    fn from(e: PostError) -> Self {
        LinkEvent::Local(error_chain(&e))
    }
}

/// Our own quiesce in progress on a live link.
#[derive(Debug, Default)]
pub(super) struct Pause {
    pub(super) sent: bool,
    pub(super) got_ack: bool,
    /// The PAUSE asks the peer to carry on over the bridge.
    pub(super) bridge: bool,
    /// Strategy `hot`: the PAUSE keeps the QP; no disconnect follows the PAUSE_ACK.
    pub(super) hot: bool,
    /// A `hot` pause being confirmed: when the probe on the kept QP was posted.
    pub(super) probe_sent: Option<Instant>,
    /// A `hot` pause to confirm: post the probe as soon as a send slot allows.
    pub(super) confirm: bool,
}

pub(super) struct Link {
    /// The completion channel as the runtime watches it. First, so it is dropped (and the
    /// watch ended) before the QP; it holds the channel open until then either way.
    pub(super) comp: AsyncFd<CompletionChannel>,
    pub(super) ep: Endpoint,
    /// This side's exposed buffers as registered on this QP (dropped after the QP).
    pub(super) exposed: Vec<(u64, ExposedRegion)>,
    /// REGIONS records not yet sent on this QP.
    pub(super) announce: Vec<RegionEntry>,
    /// The peer's buffers as registered on its side of this QP.
    pub(super) remote_keys: HashMap<u64, RegionEntry>,
    /// Highest one-sided operation id posted on this QP.
    pub(super) ops_posted_upto: u64,
    /// One-sided operations on this QP awaiting completion, in posting order: (slot, id).
    pub(super) inflight: VecDeque<(u32, u64)>,
    pub(super) credits: Credits,
    /// The CQ is armed: its next completion raises an event on the channel. An event
    /// disarms it; it is armed again only after one was read (an event not yet read keeps
    /// the channel's readiness, which wakes the worker either way).
    pub(super) cq_armed: bool,
    pub(super) starved: StarvedProbe,
    pub(super) slots: SendSlots,
    /// SENDs written into their slots, to be posted as one chain by [`Link::flush`].
    pub(super) staged: Vec<SendWr>,
    /// Highest DATA sequence number posted on this QP.
    pub(super) posted_upto: u64,
    pub(super) last_ack_sent: u64,
    pub(super) pause: Option<Pause>,
    /// When the peer's PAUSE arrived.
    pub(super) peer_paused: Option<Instant>,
    /// The peer's PAUSE asked to carry on over the bridge.
    pub(super) peer_bridging: bool,
    pub(super) owe_pause_ack: bool,
    pub(super) pause_ack_sent: bool,
    pub(super) close_sent: bool,
    pub(super) disconnecting: Option<Instant>,
    pub(super) slot: usize,
    /// Receives not posted again because the application's inbox is full: (slot offset,
    /// work request id). Withholding them withholds the peer's credits, which is the
    /// backpressure that keeps a fast sender from growing a slow reader's memory.
    pub(super) withheld: Vec<(usize, u64)>,
    /// How many messages the inbox may hold before receives are withheld.
    pub(super) inbox_limit: usize,
}

impl Link {
    /// Something on this link waits on a timer: our pause (PAUSE_ACK, DISCONNECTED, a `hot`
    /// probe), the peer's pause, or the probe of a sender starved of credits.
    pub(super) fn timed(&self) -> bool {
        self.pause.is_some()
            || self.peer_paused.is_some()
            || self.owe_pause_ack
            || self.disconnecting.is_some()
            || self.starved.armed()
    }

    pub(super) fn can_post_control(&self) -> bool {
        self.free_slots() > 0 && self.credits.can_send_control() && self.disconnecting.is_none()
    }

    /// WRITE and READ leave [`RESERVE`] send slots for control messages.
    pub(super) fn can_post_onesided(&self) -> bool {
        self.free_slots() > RESERVE as usize
            && self.pause.is_none()
            && self.peer_paused.is_none()
            && !self.close_sent
            && self.disconnecting.is_none()
    }

    /// Posts one WRITE or READ of `op` through a send slot.
    pub(super) fn post_onesided(
        &mut self,
        op: &crate::onesided::Op,
        key: &RegionEntry,
    ) -> Result<(), PostError> {
        let slot = self.slots.take().ok_or(PostError::NoFreeSlot)?;
        let off = slot as usize * self.slot;
        let rdma = match &op.kind {
            OpKind::Write(data) => {
                let buf = self
                    .ep
                    .send_mr
                    .write(off, data.len())
                    .ok_or(PostError::WriteTooLarge)?;
                buf.copy_from_slice(data);
                RdmaOp::Write
            }
            OpKind::Read(..) => RdmaOp::Read,
        };
        if let Err(e) = self.ep.id.post_rdma(
            rdma,
            &self.ep.send_mr,
            off,
            op.len(),
            key.addr + op.offset,
            key.rkey,
            ONESIDED_BASE + slot as u64,
        ) {
            return Err(PostError::Rdma {
                op: rdma,
                source: e,
            });
        }
        // Posted alone and signaled: its completion tells which operation is done.
        self.slots.posted(slot, true);
        self.inflight.push_back((slot, op.id));
        Ok(())
    }

    /// Posts a zero-length RDMA WRITE through a send slot ([`StarvedProbe`]): it carries
    /// nothing and takes no receive at the peer (C9-88: no address or rkey is checked), but
    /// must be acknowledged by the peer's QP.
    pub(super) fn post_probe(&mut self) -> Result<(), PostError> {
        let slot = self.slots.take().ok_or(PostError::NoFreeSlot)?;
        let off = slot as usize * self.slot;
        if let Err(e) =
            self.ep
                .id
                .post_rdma(RdmaOp::Write, &self.ep.send_mr, off, 0, 0, 0, slot as u64)
        {
            return Err(PostError::Probe(e));
        }
        // Posted alone and signaled, like a control message.
        self.slots.posted(slot, true);
        Ok(())
    }

    /// Registers the exposures not yet registered on this QP and queues their records.
    pub(super) fn register_exposures(&mut self, st: &State) -> Result<(), PostError> {
        // Exposures are never withdrawn: equal counts mean all are registered.
        if self.exposed.len() == st.onesided.exposed.len() {
            return Ok(());
        }
        for (handle, (mem, access)) in &st.onesided.exposed {
            if self.exposed.iter().any(|(h, _)| h == handle) {
                continue;
            }
            let region = self
                .ep
                .pd
                .register_exposed(mem, remote_access(*access))
                .map_err(|source| PostError::RegisterExposed {
                    handle: *handle,
                    source,
                })?;
            self.announce.push(RegionEntry {
                handle: *handle,
                addr: region.addr(),
                len: region.len() as u64,
                rkey: region.rkey(),
                access: *access,
            });
            self.exposed.push((*handle, region));
        }
        Ok(())
    }

    /// Send slots neither in flight nor staged.
    pub(super) fn free_slots(&self) -> usize {
        self.slots.free()
    }

    pub(super) fn can_post_data(&self) -> bool {
        self.free_slots() > 0
            && self.credits.can_send_data()
            && self.pause.is_none()
            && self.peer_paused.is_none()
            && !self.close_sent
            && self.disconnecting.is_none()
    }

    /// Posts one message at once (control messages: each ends its own chain, so it is
    /// signaled). A failed post leaves the link unusable: the caller gives it up.
    pub(super) fn post(
        &mut self,
        kind: Kind,
        flags: u8,
        seq: u64,
        payload: &[u8],
        last_received: u64,
    ) -> Result<(), PostError> {
        self.stage(kind, flags, seq, payload, last_received)?;
        self.flush()
    }

    /// Writes a message into a free send slot and stages its SEND for [`Link::flush`].
    pub(super) fn stage(
        &mut self,
        kind: Kind,
        flags: u8,
        seq: u64,
        payload: &[u8],
        last_received: u64,
    ) -> Result<(), PostError> {
        let slot = self.slots.take().ok_or(PostError::NoFreeSlot)?;
        let off = slot as usize * self.slot;
        let len = HEADER_LEN + payload.len();
        let header = Header {
            kind,
            flags,
            len: payload.len() as u32,
            seq,
            ack: last_received,
            credits: self.credits.on_sent(),
        };
        let buf = self
            .ep
            .send_mr
            .write(off, len)
            .ok_or(PostError::MessageTooLarge)?;
        header.encode(buf);
        buf[HEADER_LEN..].copy_from_slice(payload);
        self.staged.push(SendWr {
            offset: off,
            len,
            wr_id: slot as u64,
            signaled: false,
        });
        self.last_ack_sent = last_received;
        Ok(())
    }

    /// Posts the staged SENDs as one chain (one doorbell), signaled as [`SendSlots`]
    /// decides. A failed post leaves the link unusable: the caller gives it up.
    pub(super) fn flush(&mut self) -> Result<(), PostError> {
        let n = self.staged.len();
        for (i, wr) in self.staged.iter_mut().enumerate() {
            wr.signaled = self.slots.posted(wr.wr_id as u32, i + 1 == n);
        }
        let result = self.ep.id.post_sends(&self.ep.send_mr, &self.staged);
        self.staged.clear();
        result.map_err(|(posted, source)| PostError::Sends { n, posted, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_request_id_ranges_never_overlap() {
        // Send slots are u32 (below RECV_BASE); receives and one-sided operations add a u32
        // slot to their base, so the three ranges are disjoint for any queue depth.
        assert!(u32::MAX as u64 <= RECV_BASE);
        assert!(RECV_BASE + u32::MAX as u64 <= ONESIDED_BASE);
    }
}
