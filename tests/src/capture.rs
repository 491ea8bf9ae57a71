//! A packet capture inside the test bed's network namespace: what the guests really sent
//! each other, for checks and for the fuzz targets' seeds (`fuzz/seeds/`).
//!
//! [`Capture::start`] opens a packet socket (every interface: each tap of the bridge) on a
//! thread that entered the namespace; [`Capture::finish`] returns the IPv4 frames. A frame
//! is seen once per interface it crosses, so the extractors take each TCP segment by its
//! sequence number and each RDMA payload once.
//!
//! What is extracted:
//! - [`Packets::tcp_streams`]: each direction of each TCP connection, its bytes in order
//!   (the TCP bridges between the guests' libraries among them);
//! - [`Packets::rdma_sends`]: the payload of every RoCEv2 RC SEND that fits one packet
//!   (a whole message of the library's wire protocol);
//! - [`Packets::cm_private_data`]: the library's records in rdma_cm's connection messages
//!   (from their magic to the end of the MAD).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::sched::{setns, CloneFlags};
use nix::sys::socket::{
    setsockopt, socket, sockopt, AddressFamily, SockFlag, SockProtocol, SockType,
};
use nix::sys::time::TimeVal;

/// At most this many frames are kept (a few minutes of a test's traffic).
const MAX_FRAMES: usize = 500_000;

/// RoCEv2's UDP port.
const ROCE_PORT: u16 = 4791;

/// A capture running on its own thread.
pub struct Capture {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<std::io::Result<Vec<Vec<u8>>>>>,
}

impl Capture {
    /// Starts capturing every IPv4 frame in network namespace `netns`.
    pub fn start(netns: &str) -> std::io::Result<Capture> {
        let namespace = std::fs::File::open(format!("/run/netns/{netns}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let socket = open(&namespace);
                let failed = socket
                    .as_ref()
                    .err()
                    .map(|e| std::io::Error::new(e.kind(), e.to_string()));
                let _ = ready_tx.send(failed);
                capture(socket?, &stop)
            })
        };
        match ready_rx.recv() {
            Ok(None) => Ok(Capture {
                stop,
                thread: Some(thread),
            }),
            Ok(Some(e)) => Err(e),
            Err(_) => Err(std::io::Error::other("the capture thread ended")),
        }
    }

    /// Stops the capture and returns what it saw.
    pub fn finish(mut self) -> std::io::Result<Packets> {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread.take().expect("finished once");
        let frames = thread
            .join()
            .map_err(|_| std::io::Error::other("the capture thread panicked"))??;
        Ok(Packets {
            frames: frames.iter().filter_map(|f| Ipv4::parse(f)).collect(),
        })
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// On the calling thread: enters `namespace` and opens a packet socket for every protocol,
/// whose reads give up after 100 ms (so that the loop sees `stop`).
fn open(namespace: &std::fs::File) -> std::io::Result<std::fs::File> {
    setns(namespace.as_fd(), CloneFlags::CLONE_NEWNET)?;
    let fd = socket(
        AddressFamily::Packet,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::EthAll,
    )?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 100_000))?;
    Ok(std::fs::File::from(fd))
}

fn capture(mut socket: std::fs::File, stop: &AtomicBool) -> std::io::Result<Vec<Vec<u8>>> {
    let mut frames = Vec::new();
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Acquire) {
        match socket.read(&mut buf) {
            Ok(n) if frames.len() < MAX_FRAMES && Ipv4::parse(&buf[..n]).is_some() => {
                frames.push(buf[..n].to_vec());
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(frames)
}

/// An IPv4 packet out of an Ethernet frame.
struct Ipv4 {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    /// The IP payload (the TCP or UDP header and its data).
    payload: Vec<u8>,
}

impl Ipv4 {
    fn parse(frame: &[u8]) -> Option<Ipv4> {
        let ip = frame.get(14..)?;
        if frame.get(12..14)? != [0x08, 0x00] || ip.first()? >> 4 != 4 {
            return None;
        }
        let header = usize::from(ip[0] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([*ip.get(2)?, *ip.get(3)?]));
        let at = |i: usize| Ipv4Addr::new(ip[i], ip[i + 1], ip[i + 2], ip[i + 3]);
        Some(Ipv4 {
            src: at(12),
            dst: at(16),
            protocol: *ip.get(9)?,
            payload: ip.get(header..total.min(ip.len()))?.to_vec(),
        })
    }

    /// Source and destination ports, and the data after the TCP or UDP header.
    fn transport(&self) -> Option<(u16, u16, &[u8])> {
        let p = &self.payload;
        let ports = (
            u16::from_be_bytes([*p.first()?, *p.get(1)?]),
            u16::from_be_bytes([*p.get(2)?, *p.get(3)?]),
        );
        let data = match self.protocol {
            6 => p.get(usize::from(p.get(12)? >> 4) * 4..)?,
            17 => p.get(8..)?,
            _ => return None,
        };
        Some((ports.0, ports.1, data))
    }
}

/// One direction of a TCP connection.
type Flow = (Ipv4Addr, u16, Ipv4Addr, u16);

/// What a capture saw: IPv4 packets, in arrival order.
pub struct Packets {
    frames: Vec<Ipv4>,
}

impl Packets {
    /// How many IPv4 packets were seen (counting each interface a packet crossed).
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether nothing was seen.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Each direction of each TCP connection with data, its bytes in sequence order (each
    /// segment once, however many interfaces it crossed; a gap ends the stream there).
    pub fn tcp_streams(&self) -> Vec<Vec<u8>> {
        let mut flows: BTreeMap<Flow, BTreeMap<u32, Vec<u8>>> = BTreeMap::new();
        for packet in self.frames.iter().filter(|p| p.protocol == 6) {
            let Some((sport, dport, data)) = packet.transport() else {
                continue;
            };
            if data.is_empty() {
                continue;
            }
            let seq = u32::from_be_bytes(packet.payload[4..8].try_into().expect("4 bytes"));
            flows
                .entry((packet.src, sport, packet.dst, dport))
                .or_default()
                .entry(seq)
                .or_insert_with(|| data.to_vec());
        }
        flows
            .into_values()
            .map(|segments| {
                let mut stream = Vec::new();
                let mut next = None;
                for (seq, data) in segments {
                    match next {
                        Some(expected) if seq != expected => break,
                        _ => {}
                    }
                    stream.extend_from_slice(&data);
                    next = Some(seq.wrapping_add(data.len() as u32));
                }
                stream
            })
            .collect()
    }

    /// The payloads of RC SEND packets that carry a whole message (SEND ONLY, with or
    /// without immediate data), each once.
    pub fn rdma_sends(&self) -> Vec<Vec<u8>> {
        let mut sends = BTreeSet::new();
        for (opcode, body) in self.roce() {
            let skip = match opcode {
                0x04 => 0, // RC SEND ONLY
                0x05 => 4, // RC SEND ONLY with immediate
                _ => continue,
            };
            if let Some(payload) = body.get(skip..) {
                sends.insert(payload.to_vec());
            }
        }
        sends.into_iter().collect()
    }

    /// The library's records in rdma_cm's connection messages (UD SEND ONLY on QP 1): from
    /// their magic to the end of the message, each once.
    pub fn cm_private_data(&self, magic: [u8; 2]) -> Vec<Vec<u8>> {
        let mut records = BTreeSet::new();
        for (opcode, body) in self.roce() {
            // UD SEND ONLY carries an 8-byte DETH before the MAD.
            if opcode != 0x64 {
                continue;
            }
            let Some(mad) = body.get(8..) else { continue };
            if let Some(at) = mad.windows(2).position(|w| w == magic) {
                records.insert(mad[at..].to_vec());
            }
        }
        records.into_iter().collect()
    }

    /// Each RoCEv2 packet's BTH opcode and its payload: the bytes between the BTH and the
    /// ICRC, less the BTH's pad count (payloads are padded to 4 bytes).
    fn roce(&self) -> impl Iterator<Item = (u8, &[u8])> {
        self.frames
            .iter()
            .filter(|p| p.protocol == 17)
            .filter_map(|p| {
                let (_, dport, data) = p.transport()?;
                let pad = usize::from((data.get(1)? >> 4) & 0x3);
                if dport != ROCE_PORT || data.len() < 12 + 4 + pad {
                    return None;
                }
                Some((data[0], &data[12..data.len() - 4 - pad]))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ethernet frame with an IPv4 packet of `protocol` carrying `transport`.
    fn frame(protocol: u8, transport: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&[0x08, 0x00]);
        let total = (20 + transport.len()) as u16;
        let mut ip = vec![
            0x45, 0, 0, 0, 0, 0, 0, 0, 64, protocol, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        f.extend_from_slice(&ip);
        f.extend_from_slice(transport);
        f
    }

    fn tcp(seq: u32, data: &[u8]) -> Vec<u8> {
        let mut t = vec![0u8; 20];
        t[0..2].copy_from_slice(&1000u16.to_be_bytes());
        t[2..4].copy_from_slice(&2000u16.to_be_bytes());
        t[4..8].copy_from_slice(&seq.to_be_bytes());
        t[12] = 5 << 4;
        t.extend_from_slice(data);
        frame(6, &t)
    }

    fn packets(frames: &[Vec<u8>]) -> Packets {
        Packets {
            frames: frames.iter().filter_map(|f| Ipv4::parse(f)).collect(),
        }
    }

    #[test]
    fn a_tcp_stream_is_put_together_once_by_sequence_number() {
        let seen = [
            tcp(100, b"hello "),
            tcp(100, b"hello "),
            tcp(106, b"world"),
            tcp(200, b"gap"),
        ];
        assert_eq!(packets(&seen).tcp_streams(), vec![b"hello world".to_vec()]);
    }

    #[test]
    fn roce_sends_and_cm_records_are_taken_from_their_packets() {
        let roce = |opcode: u8, body: &[u8]| {
            let mut udp = vec![0u8; 8];
            udp[2..4].copy_from_slice(&ROCE_PORT.to_be_bytes());
            let mut bth = vec![0u8; 12];
            bth[0] = opcode;
            let pad = (4 - body.len() % 4) % 4;
            bth[1] = (pad as u8) << 4;
            udp.extend_from_slice(&bth);
            udp.extend_from_slice(body);
            udp.extend_from_slice(&vec![0; pad]);
            udp.extend_from_slice(&[0xee; 4]); // ICRC
            frame(17, &udp)
        };
        let mut mad = vec![0u8; 8]; // DETH
        mad.extend_from_slice(b"..RMrecord");
        let seen = [
            roce(0x04, b"message"),
            roce(0x04, b"message"),
            roce(0x00, b"first"),
            roce(0x64, &mad),
        ];
        let p = packets(&seen);
        assert_eq!(p.rdma_sends(), vec![b"message".to_vec()]);
        assert_eq!(p.cm_private_data(*b"RM"), vec![b"RMrecord".to_vec()]);
        assert!(p.tcp_streams().is_empty());
    }
}
