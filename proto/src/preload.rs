//! Preload library <-> the peer's preload library, relayed by the peer's guest agent.
//!
//! A QP of a program under `rdmamig-run` has a peer QP in another program, also preloaded,
//! usually in another VM. A move of one end needs the other: it must stop sending before
//! the moving end releases its device, and it must be walked to the moving end's new QP
//! after. Neither end knows a port of the other's library (the program exchanged QP
//! numbers its own way), but each knows the other's address (the QP's remote GID). So the
//! moving end's library opens a TCP connection to [`PEER_PORT`] at that address, where the
//! peer's agent listens, and sends one [`PeerRequest`]; the agent hands it to its
//! registered processes ([`crate::app::AgentToApp::Peer`]), the one that holds the QP
//! answers, and the agent sends back that one [`PeerAnswer`].
//!
//! Trust: the peer is another guest. The agent bounds the connection (one frame each way,
//! [`crate::MAX_FRAME_LEN`], a timeout), and a library acts only on a request about one of
//! its QPs whose remote address is the requester's address, and whose remote QP is the
//! requester's QP: a guest can pause or re-point only QPs connected to itself.

use serde::{Deserialize, Serialize};

/// The TCP port each guest's agent listens on for [`PeerRequest`]s.
pub const PEER_PORT: u16 = 18_601;

/// Most rkeys one [`PeerRequest::Reconnect`] carries (bounded by the frame size).
pub const MAX_RKEYS: usize = 1024;

/// What one end of a QP asks of the other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum PeerRequest {
    /// "I am moving: stop posting on your QP `qp`, and answer once every send you posted
    /// on it has completed." The sends the program posts meanwhile are held, not failed.
    Pause {
        /// The receiver's QP, by the number its program was given.
        qp: u32,
        /// The sender's QP, by the number its program was given.
        from_qp: u32,
    },
    /// "The move did not happen (or my QP survived it): go on as before."
    Unpause {
        /// The receiver's QP.
        qp: u32,
        /// The sender's QP.
        from_qp: u32,
    },
    /// "My QP is now the real QP `new_qp`: walk yours to it again, and go on."
    Reconnect {
        /// The receiver's QP.
        qp: u32,
        /// The sender's QP, by the number its program was given.
        from_qp: u32,
        /// The sender's new real QP number.
        new_qp: u32,
        /// The first PSN the sender's new QP sends with (the receiver's RQ PSN).
        sq_psn: u32,
        /// The first PSN the receiver sends with (the sender's new RQ PSN).
        rq_psn: u32,
        /// The sender's GID (unchanged, unless the new device has another).
        gid: [u8; 16],
        /// The sender's memory regions' rkeys, old (the program's) to new.
        rkeys: Vec<(u32, u32)>,
    },
    /// "My program disconnected the rdma_cm connection of my QP (one a move carried, which
    /// the kernel's rdma_cm no longer connects): give yours its DISCONNECTED event."
    Disconnect {
        /// The receiver's QP.
        qp: u32,
        /// The sender's QP.
        from_qp: u32,
    },
}

impl PeerRequest {
    /// The receiver's QP the request is about.
    pub fn qp(&self) -> u32 {
        match self {
            PeerRequest::Pause { qp, .. }
            | PeerRequest::Unpause { qp, .. }
            | PeerRequest::Reconnect { qp, .. }
            | PeerRequest::Disconnect { qp, .. } => *qp,
        }
    }

    /// The sender's QP.
    pub fn from_qp(&self) -> u32 {
        match self {
            PeerRequest::Pause { from_qp, .. }
            | PeerRequest::Unpause { from_qp, .. }
            | PeerRequest::Reconnect { from_qp, .. }
            | PeerRequest::Disconnect { from_qp, .. } => *from_qp,
        }
    }
}

/// The answer to one [`PeerRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum PeerAnswer {
    /// Done as asked.
    Done,
    /// No process here holds that QP connected to that requester.
    NotMine,
    /// The QP is here, and what was asked failed.
    Failed {
        /// Why.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Frame, FrameBuffer};

    #[test]
    fn requests_and_answers_round_trip() {
        let requests = [
            PeerRequest::Pause {
                qp: 17,
                from_qp: 18,
            },
            PeerRequest::Unpause {
                qp: 17,
                from_qp: 18,
            },
            PeerRequest::Reconnect {
                qp: 17,
                from_qp: 18,
                new_qp: 40,
                sq_psn: 0xabc,
                rq_psn: 0xdef,
                gid: [1; 16],
                rkeys: vec![(5, 9)],
            },
            PeerRequest::Disconnect {
                qp: 17,
                from_qp: 18,
            },
        ];
        for m in requests {
            let mut fb = FrameBuffer::new();
            fb.push(&Frame::encode(&m));
            assert_eq!(fb.pop().unwrap().decode::<PeerRequest>().unwrap(), m);
            assert_eq!((m.qp(), m.from_qp()), (17, 18));
        }
        for a in [
            PeerAnswer::Done,
            PeerAnswer::NotMine,
            PeerAnswer::Failed { reason: "x".into() },
        ] {
            let mut fb = FrameBuffer::new();
            fb.push(&Frame::encode(&a));
            assert_eq!(fb.pop().unwrap().decode::<PeerAnswer>().unwrap(), a);
        }
    }

    #[test]
    fn the_largest_reconnect_fits_in_a_frame() {
        let m = PeerRequest::Reconnect {
            qp: u32::MAX,
            from_qp: u32::MAX,
            new_qp: u32::MAX,
            sq_psn: u32::MAX,
            rq_psn: u32::MAX,
            gid: [255; 16],
            rkeys: vec![(u32::MAX, u32::MAX); MAX_RKEYS],
        };
        assert!(Frame::encode(&m).len() <= crate::MAX_FRAME_LEN);
    }
}
