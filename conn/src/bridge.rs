//! The bridge: a TCP path beside the RDMA QP, over the VM's paravirtual NIC. That NIC
//! migrates with the VM, and an open TCP stream with it, so during a move with strategy
//! `bridge` both sides carry their messages here while the QP is gone, and go back to RDMA
//! once the resume has rebuilt it.
//!
//! Set-up: the active side connects to the passive side's bridge address and sends a BRIDGE
//! record (connection id, token, last sequence received; padded to
//! [`MAX_CONNECT_PRIVATE_DATA`] bytes). The listener routes it to the connection it names
//! after checking the token, as it does a RESUME; the connection answers with an ACCEPT
//! record (its own last received) or a REJECT. After that each direction is a stream of
//! frames, each the connection's wire [`Header`] and its payload. Only DATA and ACK travel
//! here; anything else, or a payload above `max_message`, ends the bridge (not the
//! connection).
//!
//! Why two paths cannot lose, duplicate or reorder anything: every DATA keeps its sequence
//! number on either path, the receiver takes only the next one in order and drops what it
//! already has, and a sender starts (or restarts) a path at its oldest unacknowledged
//! message, which the receiver's next expected one is never below. Each path is ordered, so
//! what arrives on it is either a duplicate or exactly the next message.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

use crate::wire::{
    Accept, Header, Hello, Kind, PrivateData, Reject, RejectReason, WireError, HEADER_LEN,
    MAX_CONNECT_PRIVATE_DATA,
};

/// Bound of each set-up step (TCP connect, the greeting, the answer).
pub(crate) const SETUP_TIMEOUT: Duration = Duration::from_secs(2);
/// Unsent bytes a bridge holds before its sender waits; TCP's window does the rest.
const TX_LIMIT: usize = 256 * 1024;

/// What failed in setting up, reading or writing a bridge. Each message names one step; the
/// cause is its `source` (logs and `ConnError::Bridge` print the
/// whole chain, `a: b`).
#[derive(Debug, Error)]
pub enum BridgeError {
    /// The listener could not listen for bridges on its bridge address.
    #[error("listening")]
    Listen(#[source] std::io::Error),
    /// The passive side refused the bridge.
    #[error("refused: {0:?}")]
    Refused(RejectReason),
    /// The passive side answered with something else than an ACCEPT of this connection.
    #[error("unexpected answer: {0:?}")]
    UnexpectedAnswer(PrivateData),
    /// Making the socket blocking or not, or setting its timeouts or TCP_NODELAY, failed.
    #[error("configuring the socket")]
    Configure(#[source] std::io::Error),
    /// The greeting took longer than the set-up timeout (2 s).
    #[error("the BRIDGE record did not arrive within {SETUP_TIMEOUT:?}")]
    GreetingLate,
    /// The stream ended before the whole greeting.
    #[error("the stream ended inside the BRIDGE record")]
    GreetingCut,
    /// Reading the greeting failed.
    #[error("reading the BRIDGE record")]
    ReadGreeting(#[source] std::io::Error),
    /// The greeting was a record of another kind.
    #[error("expected a BRIDGE record, got {0:?}")]
    NotAGreeting(PrivateData),
    /// The greeting did not decode.
    #[error(transparent)]
    BadGreeting(WireError),
    /// The accepted stream has no peer address.
    #[error("the stream has no peer")]
    NoPeer(#[source] std::io::Error),
    /// Writing the ACCEPT to the active side failed.
    #[error("answering {peer}")]
    Answer {
        /// The active side.
        peer: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A set-up step of the active side timed out.
    #[error("{step}: timed out after {SETUP_TIMEOUT:?}")]
    StepTimedOut {
        /// connecting, sending the greeting or waiting for the answer.
        step: &'static str,
    },
    /// The TCP connect failed.
    #[error("connecting to {peer}")]
    Connect {
        /// The passive side's bridge address.
        peer: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Sending the greeting failed.
    #[error("sending the greeting")]
    SendGreeting(#[source] std::io::Error),
    /// Reading the answer failed.
    #[error("waiting for the answer")]
    ReadAnswer(#[source] std::io::Error),
    /// The answer did not decode.
    #[error("the answer")]
    BadAnswer(#[source] WireError),
    /// The runtime could not watch the socket.
    #[error("watching the bridge socket")]
    Watch(#[source] std::io::Error),
    /// The socket accepted no bytes.
    #[error("the socket took no bytes")]
    WriteZero,
    /// Writing to the socket failed.
    #[error("writing to {peer}")]
    Write {
        /// The other side.
        peer: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The other side closed the stream.
    #[error("{peer} closed the bridge")]
    Closed {
        /// The other side.
        peer: SocketAddr,
    },
    /// Reading from the socket failed.
    #[error("reading from {peer}")]
    Read {
        /// The other side.
        peer: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A frame from the other side was refused.
    #[error("from {peer}")]
    Frame {
        /// The other side.
        peer: SocketAddr,
        /// What is wrong with the frame.
        #[source]
        source: FrameError,
    },
}

/// A frame that does not belong on the bridge (it ends the bridge, not the connection).
#[derive(Debug, Error)]
pub enum FrameError {
    /// The header announces a payload above `max_message`.
    #[error("a frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The header does not decode.
    #[error(transparent)]
    Malformed(WireError),
    /// Only DATA and ACK travel on the bridge.
    #[error("{0:?} does not belong on the bridge")]
    WrongKind(Kind),
    /// A DATA frame skipped sequence numbers.
    #[error("received sequence {seq} on the bridge while expecting {expected}")]
    OutOfOrder {
        /// The sequence number received.
        seq: u64,
        /// The one expected.
        expected: u64,
    },
}

/// One open bridge (non-blocking).
pub(crate) struct Bridge {
    stream: TcpStream,
    peer: SocketAddr,
    max_payload: usize,
    rx: Vec<u8>,
    tx: Vec<u8>,
    /// Bytes at the front of `tx` already written to the socket.
    tx_written: usize,
    /// Highest DATA sequence number queued on this bridge since this side began carrying on it.
    pub(crate) sent_upto: u64,
    /// The `ack` of the last frame queued.
    pub(crate) last_ack_sent: u64,
    /// A DATA frame arrived since the last frame this side queued.
    pub(crate) owes_ack: bool,
}

impl BridgeError {
    /// Whether another attempt may succeed where this one failed: a step that timed out or
    /// a connect or answer the network cut short (a loaded peer accepts late), not what
    /// the passive side said.
    pub(crate) fn may_pass(&self) -> bool {
        matches!(
            self,
            BridgeError::StepTimedOut { .. }
                | BridgeError::Connect { .. }
                | BridgeError::SendGreeting(_)
                | BridgeError::ReadAnswer(_)
        )
    }
}

impl Bridge {
    /// The active side: connects to `peer`, introduces the connection with `hello`, and
    /// returns the bridge and the passive side's last received sequence number. Awaited by
    /// the connection's worker, so its runtime thread is never blocked meanwhile.
    pub(crate) async fn open(
        peer: SocketAddr,
        hello: Hello,
        max_payload: usize,
    ) -> Result<(Bridge, u64), BridgeError> {
        match introduce(peer, &padded(PrivateData::Bridge(hello))).await? {
            (stream, PrivateData::Accept(a)) if a.conn_id == hello.conn_id => {
                Ok((Bridge::new(stream, peer, max_payload)?, a.last_received))
            }
            (_, PrivateData::Reject(r)) => Err(BridgeError::Refused(r.reason)),
            (_, other) => Err(BridgeError::UnexpectedAnswer(other)),
        }
    }

    /// The listener's half of the set-up: reads the BRIDGE record of a new stream, all of
    /// it within [`SETUP_TIMEOUT`] (a client sending a byte at a time gets no longer).
    pub(crate) fn read_greeting(stream: &mut TcpStream) -> Result<Hello, BridgeError> {
        set_blocking_with_timeout(stream).map_err(BridgeError::Configure)?;
        let deadline = std::time::Instant::now() + SETUP_TIMEOUT;
        let mut greeting = [0u8; MAX_CONNECT_PRIVATE_DATA];
        let mut got = 0;
        while got < greeting.len() {
            let left = deadline
                .checked_duration_since(std::time::Instant::now())
                .filter(|left| !left.is_zero())
                .ok_or(BridgeError::GreetingLate)?;
            stream
                .set_read_timeout(Some(left))
                .map_err(BridgeError::Configure)?;
            match stream.read(&mut greeting[got..]) {
                Ok(0) => return Err(BridgeError::GreetingCut),
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(BridgeError::GreetingLate)
                }
                Err(e) => return Err(BridgeError::ReadGreeting(e)),
            }
        }
        match PrivateData::decode(&greeting) {
            Ok(PrivateData::Bridge(hello)) => Ok(hello),
            Ok(other) => Err(BridgeError::NotAGreeting(other)),
            Err(e) => Err(BridgeError::BadGreeting(e)),
        }
    }

    /// The passive side: accepts a stream whose greeting named this connection.
    pub(crate) fn answer(
        mut stream: TcpStream,
        accept: Accept,
        max_payload: usize,
    ) -> Result<Bridge, BridgeError> {
        let peer = stream.peer_addr().map_err(BridgeError::NoPeer)?;
        stream
            .write_all(&padded(PrivateData::Accept(accept)))
            .map_err(|source| BridgeError::Answer { peer, source })?;
        Bridge::new(stream, peer, max_payload)
    }

    /// Refuses a stream (best effort: the stream is dropped either way).
    pub(crate) fn refuse(mut stream: TcpStream, reject: Reject) {
        let _ = stream.write_all(&padded(PrivateData::Reject(reject)));
    }

    fn new(stream: TcpStream, peer: SocketAddr, max_payload: usize) -> Result<Bridge, BridgeError> {
        stream
            .set_nonblocking(true)
            .and_then(|()| stream.set_nodelay(true))
            .map_err(BridgeError::Configure)?;
        Ok(Bridge {
            stream,
            peer,
            max_payload,
            rx: Vec::new(),
            tx: Vec::new(),
            tx_written: 0,
            sent_upto: 0,
            last_ack_sent: 0,
            owes_ack: false,
        })
    }

    /// The peer's address (for logs).
    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Whether queued bytes wait for the socket to take them.
    pub(crate) fn wants_write(&self) -> bool {
        self.tx_written < self.tx.len()
    }

    /// Whether another frame may be queued.
    pub(crate) fn has_room(&self) -> bool {
        self.tx.len() - self.tx_written < TX_LIMIT
    }

    /// Queues one frame; [`Bridge::flush`] writes it.
    pub(crate) fn queue(&mut self, kind: Kind, seq: u64, ack: u64, payload: &[u8]) {
        let header = Header {
            kind,
            flags: 0,
            len: payload.len() as u32,
            seq,
            ack,
            credits: 0,
        };
        let start = self.tx.len();
        self.tx.resize(start + HEADER_LEN, 0);
        header.encode(&mut self.tx[start..]);
        self.tx.extend_from_slice(payload);
        self.last_ack_sent = ack;
        self.owes_ack = false;
    }

    /// Writes what the socket takes now.
    pub(crate) fn flush(&mut self) -> Result<(), BridgeError> {
        while self.wants_write() {
            match self.stream.write(&self.tx[self.tx_written..]) {
                Ok(0) => return Err(BridgeError::WriteZero),
                Ok(n) => self.tx_written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(BridgeError::Write {
                        peer: self.peer,
                        source,
                    })
                }
            }
        }
        if self.tx_written == self.tx.len() {
            self.tx.clear();
            self.tx_written = 0;
        }
        Ok(())
    }

    /// Reads what has arrived and hands each whole frame to `on_frame`, in order. An error
    /// (end of stream, a malformed or oversized frame, or one `on_frame` refuses) ends the
    /// bridge.
    pub(crate) fn receive(
        &mut self,
        mut on_frame: impl FnMut(Header, &[u8]) -> Result<(), FrameError>,
    ) -> Result<(), BridgeError> {
        let peer = self.peer;
        let mut chunk = [0u8; 64 * 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(BridgeError::Closed { peer }),
                Ok(n) => self.rx.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(source) => return Err(BridgeError::Read { peer, source }),
            }
            let used = take_frames(&self.rx, self.max_payload, &mut on_frame)
                .map_err(|source| BridgeError::Frame { peer, source })?;
            self.rx.drain(..used);
        }
        Ok(())
    }
}

/// The socket, for the worker's reactor (tokio's `AsyncFd`).
impl AsRawFd for Bridge {
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

// SAFETY: the bridge owns its stream, which is never replaced, so the descriptor stays open
// and the same for the bridge's lifetime.
unsafe impl rdmamig_verbs::OwnsFd for Bridge {}

/// Hands every whole frame at the start of `buf` to `on_frame`, in order, and returns the
/// bytes they took (a partial frame stays for the next read). A payload above
/// `max_payload` is refused from its header, before it is buffered; a malformed header, or
/// a kind other than DATA and ACK, is refused too.
pub(crate) fn take_frames(
    buf: &[u8],
    max_payload: usize,
    on_frame: &mut impl FnMut(Header, &[u8]) -> Result<(), FrameError>,
) -> Result<usize, FrameError> {
    let mut used = 0;
    while let Some(len) = Header::announced_len(&buf[used..]) {
        let rest = &buf[used..];
        if len > max_payload {
            return Err(FrameError::TooLarge {
                len,
                max: max_payload,
            });
        }
        if rest.len() < HEADER_LEN + len {
            break;
        }
        let (header, payload) =
            Header::decode(&rest[..HEADER_LEN + len]).map_err(FrameError::Malformed)?;
        if !matches!(header.kind, Kind::Data | Kind::Ack) {
            return Err(FrameError::WrongKind(header.kind));
        }
        on_frame(header, payload)?;
        used += HEADER_LEN + len;
    }
    Ok(used)
}

/// Connects to a bridge listener at `peer`, sends `greeting` and returns the stream
/// (non-blocking) and the listener's answer record. Each step is bounded by
/// [`SETUP_TIMEOUT`].
pub(crate) async fn introduce(
    peer: SocketAddr,
    greeting: &[u8; MAX_CONNECT_PRIVATE_DATA],
) -> Result<(TcpStream, PrivateData), BridgeError> {
    let step = |step: &'static str| {
        move |_: tokio::time::error::Elapsed| BridgeError::StepTimedOut { step }
    };
    let mut stream = timeout(SETUP_TIMEOUT, tokio::net::TcpStream::connect(peer))
        .await
        .map_err(step("connecting"))?
        .map_err(|source| BridgeError::Connect { peer, source })?;
    timeout(SETUP_TIMEOUT, stream.write_all(greeting))
        .await
        .map_err(step("sending the greeting"))?
        .map_err(BridgeError::SendGreeting)?;
    let mut answer = [0u8; MAX_CONNECT_PRIVATE_DATA];
    timeout(SETUP_TIMEOUT, stream.read_exact(&mut answer))
        .await
        .map_err(step("waiting for the answer"))?
        .map_err(BridgeError::ReadAnswer)?;
    let answer = PrivateData::decode(&answer).map_err(BridgeError::BadAnswer)?;
    // Out of tokio's reactor, still non-blocking: the worker watches it as a bridge.
    let stream = stream.into_std().map_err(BridgeError::Configure)?;
    Ok((stream, answer))
}

/// The listener's set-up steps run blocking (on its own thread), each bounded by
/// [`SETUP_TIMEOUT`].
fn set_blocking_with_timeout(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(SETUP_TIMEOUT))?;
    stream.set_write_timeout(Some(SETUP_TIMEOUT))
}

/// A record padded to the fixed set-up size (decoding ignores the padding).
pub(crate) fn padded(record: PrivateData) -> [u8; MAX_CONNECT_PRIVATE_DATA] {
    let mut out = [0u8; MAX_CONNECT_PRIVATE_DATA];
    let bytes = record.encode();
    out[..bytes.len()].copy_from_slice(&bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmamig_proto::text::error_chain;
    use std::net::TcpListener;

    const MAX: usize = 4096;

    fn hello() -> Hello {
        Hello {
            conn_id: 0x51,
            token: [7; 16],
            last_received: 3,
            credits: 0,
        }
    }

    #[test]
    fn timeouts_and_cut_connects_may_pass_and_a_refusal_does_not() {
        let peer: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
        let io = || std::io::Error::from(ErrorKind::ConnectionReset);
        for passing in [
            BridgeError::StepTimedOut { step: "connecting" },
            BridgeError::Connect { peer, source: io() },
            BridgeError::SendGreeting(io()),
            BridgeError::ReadAnswer(io()),
        ] {
            assert!(passing.may_pass(), "{passing}");
        }
        for lasting in [
            BridgeError::Refused(RejectReason::Other),
            BridgeError::Configure(io()),
            BridgeError::Closed { peer },
        ] {
            assert!(!lasting.may_pass(), "{lasting}");
        }
    }

    /// Opens a bridge to `addr` as a worker would (on a runtime of its own here).
    fn open(addr: std::net::SocketAddr) -> Result<(Bridge, u64), BridgeError> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(Bridge::open(addr, hello(), MAX))
    }

    /// A bridge opened on loopback, and the listener's end of it.
    fn pair() -> (Bridge, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            assert_eq!(Bridge::read_greeting(&mut stream).unwrap(), hello());
            let accept = Accept {
                conn_id: 0x51,
                last_received: 9,
                credits: 0,
            };
            stream
                .write_all(&padded(PrivateData::Accept(accept)))
                .unwrap();
            stream
        });
        let (bridge, peer_last) = open(addr).unwrap();
        assert_eq!(peer_last, 9);
        (bridge, server.join().unwrap())
    }

    fn frame(kind: Kind, seq: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; HEADER_LEN];
        Header {
            kind,
            flags: 0,
            len: payload.len() as u32,
            seq,
            ack: 1,
            credits: 0,
        }
        .encode(&mut out);
        out.extend_from_slice(payload);
        out
    }

    /// Receives until `want` frames arrived or the bridge failed.
    fn collect(bridge: &mut Bridge, want: usize) -> Result<Vec<(u64, Vec<u8>)>, BridgeError> {
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while got.len() < want && std::time::Instant::now() < deadline {
            bridge.receive(|h, p| {
                got.push((h.seq, p.to_vec()));
                Ok(())
            })?;
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(got)
    }

    #[test]
    fn frames_split_across_reads_arrive_whole_and_in_order() {
        let (mut bridge, mut far) = pair();
        let mut bytes = frame(Kind::Data, 1, b"first");
        bytes.extend(frame(Kind::Data, 2, &[9u8; 3000]));
        bytes.extend(frame(Kind::Ack, 0, b""));
        for piece in bytes.chunks(7) {
            far.write_all(piece).unwrap();
        }
        let got = collect(&mut bridge, 3).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], (1, b"first".to_vec()));
        assert_eq!(got[1], (2, vec![9u8; 3000]));
    }

    #[test]
    fn an_oversized_frame_ends_the_bridge_before_it_is_buffered() {
        let (mut bridge, mut far) = pair();
        let mut header = frame(Kind::Data, 1, b"");
        header[4..8].copy_from_slice(&((MAX + 1) as u32).to_be_bytes());
        far.write_all(&header).unwrap();
        let err = error_chain(&collect(&mut bridge, 1).unwrap_err());
        assert!(err.contains("exceeds the limit"), "{err}");
    }

    #[test]
    fn control_messages_other_than_ack_are_refused() {
        let (mut bridge, mut far) = pair();
        far.write_all(&frame(Kind::Pause, 0, b"")).unwrap();
        let err = error_chain(&collect(&mut bridge, 1).unwrap_err());
        assert!(err.contains("does not belong on the bridge"), "{err}");
    }

    #[test]
    fn queued_frames_reach_the_far_end() {
        let (mut bridge, mut far) = pair();
        bridge.queue(Kind::Data, 4, 2, b"four");
        assert_eq!(bridge.last_ack_sent, 2);
        while bridge.wants_write() {
            bridge.flush().unwrap();
        }
        let mut buf = vec![0u8; HEADER_LEN + 4];
        far.read_exact(&mut buf).unwrap();
        let (h, payload) = Header::decode(&buf).unwrap();
        assert_eq!(
            (h.kind, h.seq, h.ack, payload),
            (Kind::Data, 4, 2, &b"four"[..])
        );
    }

    #[test]
    fn a_refusal_is_reported_with_its_reason() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let hello = Bridge::read_greeting(&mut stream).unwrap();
            Bridge::refuse(
                stream,
                Reject {
                    conn_id: hello.conn_id,
                    reason: RejectReason::BadToken,
                },
            );
        });
        let err = error_chain(&open(addr).err().unwrap());
        server.join().unwrap();
        assert!(err.contains("BadToken"), "{err}");
    }

    proptest::proptest! {
        /// However a stream of frames is cut into reads, the frames come out whole, in
        /// order and unchanged.
        #[test]
        fn frames_survive_any_cutting(
            payloads in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300), 1..20),
            cuts in proptest::collection::vec(1usize..500, 1..40),
        ) {
            let mut stream = Vec::new();
            for (i, p) in payloads.iter().enumerate() {
                stream.extend(frame(Kind::Data, i as u64 + 1, p));
            }
            let (mut pending, mut got, mut at) = (Vec::new(), Vec::new(), 0);
            for cut in cuts.iter().cycle() {
                if at == stream.len() {
                    break;
                }
                let end = (at + cut).min(stream.len());
                pending.extend_from_slice(&stream[at..end]);
                at = end;
                let used = take_frames(&pending, MAX, &mut |h, p| {
                    got.push((h.seq, p.to_vec()));
                    Ok(())
                }).unwrap();
                pending.drain(..used);
            }
            proptest::prop_assert!(pending.is_empty());
            let want: Vec<_> = payloads.into_iter().enumerate().map(|(i, p)| (i as u64 + 1, p)).collect();
            proptest::prop_assert_eq!(got, want);
        }

        /// Arbitrary bytes are taken, kept for later or refused; never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2000)) {
            let _ = take_frames(&bytes, MAX, &mut |_, _| Ok(()));
        }
    }

    #[test]
    fn a_greeting_that_trickles_in_gets_the_set_up_timeout_in_all() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let trickle = std::thread::spawn(move || {
            let mut client = std::net::TcpStream::connect(addr).unwrap();
            // A byte every half second: each read is quick, the whole record never comes.
            for _ in 0..12 {
                if client.write_all(&[0]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        let (mut stream, _) = listener.accept().unwrap();
        let start = std::time::Instant::now();
        let err = error_chain(&Bridge::read_greeting(&mut stream).unwrap_err());
        let took = start.elapsed();
        assert!(err.contains("did not arrive within"), "{err}");
        assert!(
            took < SETUP_TIMEOUT + Duration::from_millis(500),
            "took {took:?}"
        );
        drop(stream);
        trickle.join().unwrap();
    }

    #[test]
    fn a_greeting_that_is_not_a_bridge_record_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream
                .write_all(&padded(PrivateData::Resume(hello())))
                .unwrap();
            stream
        });
        let (mut stream, _) = listener.accept().unwrap();
        let err = error_chain(&Bridge::read_greeting(&mut stream).unwrap_err());
        drop(client.join().unwrap());
        assert!(err.contains("expected a BRIDGE record"), "{err}");
    }
}
