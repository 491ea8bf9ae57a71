//! The other end of each QP: asking it ([`ask`], the moving end) and answering it
//! ([`handle`], the end that stays), through the agents' peer port
//! ([`rdmamig_proto::preload`]).
//!
//! The end that stays acts only on a request about one of its QPs whose remote address is
//! the requester's and whose remote QP is the requester's: a guest can pause or re-point
//! only QPs connected to itself. A pause it cannot end itself is bounded: after
//! [`PAUSE_LIMIT`] without a reconnect, the held sends go to the old QP, and the program
//! meets the error it would have met without this library.

use std::io::Write;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdma_sys::{ibv_qp_attr_mask, ibv_qp_state};
use rdmamig_proto::preload::{PeerAnswer, PeerRequest, PEER_PORT};
use rdmamig_proto::{read_message, Frame, ReadError};
use thiserror::Error;

use crate::cm;
use crate::objects::{self, locked, trace, Qp};
use crate::relocate::{self, hold, release_held, walk, INIT_MASK, RTR_MASK, RTS_MASK};

/// Longest wait to reach the other end's agent.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the end that stays waits for its own sends in flight to complete at a pause.
const PAUSE_DRAIN: Duration = Duration::from_secs(10);
/// How long a pause lasts without a reconnect or an unpause.
pub const PAUSE_LIMIT: Duration = Duration::from_secs(180);

/// Why the other end did not do what was asked.
#[derive(Debug, Error)]
pub enum PeerError {
    /// Its agent's port could not be reached.
    #[error("cannot reach its agent at {addr}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The request could not be sent.
    #[error("cannot send to its agent at {addr}")]
    Send {
        /// Where.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Its agent gave no answer in time, or none that is one.
    #[error("no answer from its agent at {addr}")]
    Answer {
        /// Where.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: ReadError,
    },
    /// No process there holds the QP connected to this one.
    #[error("no program there holds that QP connected to this one (is it under rdmamig-run?)")]
    NotMine,
    /// The QP is there, and what was asked failed.
    #[error("it failed: {0}")]
    Failed(String),
}

/// The IP address a GID stands for (RoCE v2: IPv4-mapped, or an IPv6 address).
pub fn ip_of(gid: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(gid);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

/// Sends `request` to the agent at `ip` and waits for the answer until `deadline`.
pub fn ask(ip: IpAddr, request: &PeerRequest, deadline: Instant) -> Result<(), PeerError> {
    Link::connect(ip, deadline)?.ask(request, deadline)
}

/// A connection to the other end's agent, for one request.
pub struct Link {
    stream: TcpStream,
    addr: SocketAddr,
}

impl Link {
    /// Connects to the agent at `ip`, within [`CONNECT_TIMEOUT`] and `deadline`.
    pub fn connect(ip: IpAddr, deadline: Instant) -> Result<Link, PeerError> {
        let addr = SocketAddr::new(ip, PEER_PORT);
        let stream = TcpStream::connect_timeout(&addr, left(deadline).min(CONNECT_TIMEOUT))
            .map_err(|source| PeerError::Connect { addr, source })?;
        Ok(Link { stream, addr })
    }

    /// Sends `request` and waits for the answer until `deadline`.
    pub fn ask(self, request: &PeerRequest, deadline: Instant) -> Result<(), PeerError> {
        let Link { mut stream, addr } = self;
        let send = |source| PeerError::Send { addr, source };
        stream
            .set_write_timeout(Some(left(deadline)))
            .map_err(send)?;
        stream.write_all(&Frame::encode(request)).map_err(send)?;
        let answer = read_message(&mut stream, deadline)
            .map_err(|source| PeerError::Answer { addr, source })?;
        match answer {
            PeerAnswer::Done => Ok(()),
            PeerAnswer::NotMine => Err(PeerError::NotMine),
            PeerAnswer::Failed { reason } => Err(PeerError::Failed(reason)),
        }
    }
}

/// What is left until `deadline` (a millisecond at least: a zero timeout means none).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// The virtual QP `request` is about: numbered as it says, its remote end the requester's
/// QP at the requester's address.
fn find(from: &str, request: &PeerRequest) -> Option<&'static Qp> {
    objects::all::<Qp>().into_iter().find_map(|qp| {
        // SAFETY: a live virtual QP (a destroy waits at the gate the caller holds).
        let qp: &'static Qp = unsafe { &*qp };
        let record = locked(&qp.record);
        let attr = record.setup.attr();
        // SAFETY: raw bytes of a GID.
        let remote_ip = ip_of(unsafe { attr.ah_attr.grh.dgid.raw });
        (qp.public.qp_num == request.qp()
            && attr.dest_qp_num == request.from_qp()
            && remote_ip.to_string() == from)
            .then_some(qp)
    })
}

/// Answers one request from the other end of one of this process's QPs.
pub fn handle(from: &str, request: &PeerRequest) -> PeerAnswer {
    let _gate = relocate::control();
    let Some(qp) = find(from, request) else {
        return PeerAnswer::NotMine;
    };
    let result = match request {
        PeerRequest::Pause { .. } => pause(qp),
        PeerRequest::Unpause { .. } => {
            release_held(qp);
            Ok(())
        }
        PeerRequest::Reconnect {
            new_qp,
            sq_psn,
            rq_psn,
            gid,
            rkeys,
            ..
        } => reconnect(qp, *new_qp, *sq_psn, *rq_psn, *gid, rkeys),
        PeerRequest::Disconnect { .. } => {
            cm::disconnected_by_peer(qp);
            Ok(())
        }
    };
    trace(format_args!(
        "qp {:#x}: {request:?} from {from}: {result:?}",
        qp.public.qp_num
    ));
    match result {
        Ok(()) => PeerAnswer::Done,
        Err(reason) => PeerAnswer::Failed { reason },
    }
}

/// Holds the QP's new sends and waits until its sends in flight completed; the pause ends
/// by itself after [`PAUSE_LIMIT`].
fn pause(qp: &'static Qp) -> Result<(), String> {
    hold(qp).map_err(str::to_owned)?;
    if !relocate::drain_sends(qp, Instant::now() + PAUSE_DRAIN) {
        release_held(qp);
        return Err("its sends in flight did not complete".into());
    }
    let pause = locked(&qp.flow).pause;
    let address = qp as *const Qp as usize;
    let expire = move || {
        std::thread::sleep(PAUSE_LIMIT);
        let _gate = relocate::control();
        let Some(qp) = objects::find::<Qp>(address as *mut _) else {
            return; // the program destroyed it meanwhile
        };
        // SAFETY: live (the registry holds it; a destroy waits at the gate held here).
        let qp = unsafe { &*qp };
        let expired = {
            let flow = locked(&qp.flow);
            flow.held && flow.pause == pause
        };
        if expired {
            eprintln!(
                "rdmamig-preload: QP {:#x}: paused for {} s with no reconnect; going on",
                qp.public.qp_num,
                PAUSE_LIMIT.as_secs()
            );
            release_held(qp);
        }
    };
    std::thread::Builder::new()
        .name("rdmamig-pause".into())
        .spawn(expire)
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Walks the QP from RESET to RTS again, to the other end's new QP, and goes on.
fn reconnect(
    qp: &'static Qp,
    new_qp: u32,
    sq_psn: u32,
    rq_psn: u32,
    gid: [u8; 16],
    rkeys: &[(u32, u32)],
) -> Result<(), String> {
    relocate::drain_cqs(qp);
    {
        let mut flow = locked(&qp.flow);
        let real = qp.real.load(Ordering::Acquire);
        if real.is_null() {
            return Err("its device is away (both ends moving at once)".into());
        }
        let mut record = locked(&qp.record);
        if record.receives.lost_track() {
            return Err("its receives were not tracked (a failed completion)".into());
        }
        let mut attr = record.setup.attr_copy();
        let state = ibv_qp_attr_mask::IBV_QP_STATE.0;
        let err = |e: relocate::MoveError| e.to_string();
        attr.dest_qp_num = new_qp;
        attr.rq_psn = sq_psn;
        attr.ah_attr.grh.dgid.raw = gid;
        attr.sq_psn = rq_psn;
        // SAFETY: `real` is this QP's live real QP (checked non-null above, and the flow lock
        // keeps a move from releasing it meanwhile).
        unsafe {
            walk(real, &attr, ibv_qp_state::IBV_QPS_RESET, state).map_err(err)?;
            walk(real, &attr, ibv_qp_state::IBV_QPS_INIT, INIT_MASK).map_err(err)?;
            relocate::post_receives(real, &record.receives).map_err(err)?;
            walk(real, &attr, ibv_qp_state::IBV_QPS_RTR, RTR_MASK).map_err(err)?;
            walk(real, &attr, ibv_qp_state::IBV_QPS_RTS, RTS_MASK).map_err(err)?;
        }
        record.remote_real_qpn = Some(new_qp);
        let kept = ibv_qp_attr_mask::IBV_QP_AV.0
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN.0
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0;
        record.setup.apply(&attr, kept as c_int);
        flow.remote_rkeys.extend(rkeys.iter().copied());
        flow.signaled_posted = flow.signaled_done;
        flow.moved = true;
    }
    release_held(qp);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roce_v2_gid_stands_for_its_ipv4_address() {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 0, 7]);
        assert_eq!(ip_of(gid).to_string(), "10.0.0.7");
        let link_local = "fe80::1".parse::<Ipv6Addr>().unwrap().octets();
        assert_eq!(ip_of(link_local).to_string(), "fe80::1");
    }

    #[test]
    fn only_the_other_end_of_a_qp_may_ask_about_it() {
        // SAFETY: all-zero is a valid ibv_qp and ibv_qp_attr (plain C structs, null pointers).
        let (mut public, mut attr): (rdma_sys::ibv_qp, rdma_sys::ibv_qp_attr) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        public.qp_num = 7;
        attr.dest_qp_num = 9;
        attr.ah_attr.grh.dgid.raw = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7];
        let qp = Qp {
            public,
            real: Default::default(),
            record: Default::default(),
            flow: Default::default(),
        };
        let mask = ibv_qp_attr_mask::IBV_QP_DEST_QPN.0 | ibv_qp_attr_mask::IBV_QP_AV.0;
        locked(&qp.record).setup.apply(&attr, mask as c_int);
        let published = objects::publish(qp);
        let pause = |qp, from_qp| PeerRequest::Pause { qp, from_qp };
        for (from, request) in [
            ("10.0.0.8", pause(7, 9)),
            ("10.0.0.7", pause(7, 8)),
            ("10.0.0.7", pause(8, 9)),
        ] {
            assert!(
                matches!(handle(from, &request), PeerAnswer::NotMine),
                "{from} {request:?}"
            );
        }
        assert!(find("10.0.0.7", &pause(7, 9)).is_some());
        drop(objects::retire::<Qp>(published));
    }

    #[test]
    fn an_unreachable_peer_is_a_clear_error_within_the_deadline() {
        // A port nothing listens on, on loopback: refused at once.
        let started = Instant::now();
        let err = ask(
            IpAddr::from([127, 0, 0, 1]),
            &PeerRequest::Pause { qp: 1, from_qp: 2 },
            Instant::now() + Duration::from_secs(2),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                PeerError::Connect { .. } | PeerError::Send { .. } | PeerError::Answer { .. }
            ),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
