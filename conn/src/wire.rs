//! The migratable connection's wire formats: the header inside every RDMA SEND (and every
//! frame on the TCP bridge) and the HELLO / RESUME / ACCEPT / REJECT records carried in
//! rdma_cm private data (BRIDGE opens the TCP bridge the same way).
//!
//! Decoders check first and parse second: a short buffer is [`WireError::Incomplete`]
//! (separate from protocol errors), a bad tag or length is a typed error, and no input
//! panics. Private data may arrive zero-padded (IB/RoCE deliver 56 bytes on a connect
//! request), so trailing bytes after a record are ignored.

use thiserror::Error;

/// Bytes of the header before each message's payload.
pub const HEADER_LEN: usize = 32;
/// Largest private data a connect request carries on IB/RoCE.
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;

const PD_MAGIC: [u8; 2] = *b"RM";
const PD_VERSION: u8 = 1;

/// Why bytes could not be decoded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    /// Not enough bytes yet.
    #[error("incomplete: {needed} more bytes needed")]
    Incomplete {
        /// At least this many more bytes.
        needed: usize,
    },
    /// Unknown message kind.
    #[error("unknown message kind {kind}")]
    BadKind {
        /// The kind byte.
        kind: u8,
    },
    /// Payload length disagrees with the bytes received.
    #[error("header announces {announced} payload bytes, {actual} received")]
    LengthMismatch {
        /// Length in the header.
        announced: usize,
        /// Bytes after the header.
        actual: usize,
    },
    /// A control message with a payload, or a sequence number where none belongs.
    #[error("malformed {kind:?} message: {reason}")]
    Malformed {
        /// The kind.
        kind: Kind,
        /// What is wrong.
        reason: &'static str,
    },
    /// Private data that is not an rdmamig record.
    #[error("private data is not an rdmamig record (magic {found:02x?})")]
    BadMagic {
        /// The first two bytes.
        found: [u8; 2],
    },
    /// Private data of another version.
    #[error("unsupported private data version {found}")]
    BadVersion {
        /// The version byte.
        found: u8,
    },
    /// Unknown private data record type.
    #[error("unknown private data record {tag}")]
    BadRecord {
        /// The record tag.
        tag: u8,
    },
}

/// Message kinds inside RDMA SENDs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Application data with a sequence number.
    Data = 1,
    /// Standalone acknowledgement / credit update.
    Ack = 2,
    /// The sender stops sending data; `moving` says whether it is about to move.
    Pause = 3,
    /// Answer to PAUSE: the sender has stopped sending data too.
    PauseAck = 4,
    /// The sender closed the connection; no resume will follow.
    Close = 5,
    /// The sender's exposed buffers as registered on this QP: [`RegionEntry`] records.
    Regions = 6,
    /// The side that paused with [`FLAG_HOT`] is back on the same QP (a probe round trip
    /// went through): send again.
    Continue = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => Kind::Data,
            2 => Kind::Ack,
            3 => Kind::Pause,
            4 => Kind::PauseAck,
            5 => Kind::Close,
            6 => Kind::Regions,
            7 => Kind::Continue,
            kind => return Err(WireError::BadKind { kind }),
        })
    }
}

/// Flag on PAUSE: the pausing side is about to move (the peer waits for its resume).
pub const FLAG_MOVING: u8 = 1;
/// Flag on PAUSE: carry messages over the TCP bridge until the RDMA path is back (strategy
/// `bridge`).
pub const FLAG_BRIDGE: u8 = 2;
/// Flag on PAUSE: keep the QP (strategy `hot`: the device moves with the VM); no
/// disconnect follows, a [`Kind::Continue`] does.
pub const FLAG_HOT: u8 = 4;

/// The fixed header of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: Kind,
    /// Flags ([`FLAG_MOVING`]).
    pub flags: u8,
    /// Payload bytes following the header.
    pub len: u32,
    /// Sequence number (DATA only; 0 otherwise).
    pub seq: u64,
    /// Cumulative acknowledgement: highest sequence number the sender has received.
    pub ack: u64,
    /// Cumulative count of receives the sender has posted on this QP (credits).
    pub credits: u64,
}

impl Header {
    /// Encodes the header into the first [`HEADER_LEN`] bytes of `out`.
    ///
    /// # Panics
    /// If `out` is shorter than [`HEADER_LEN`] (a programming error: slots are sized for it).
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..HEADER_LEN];
        out[0] = self.kind as u8;
        out[1] = self.flags;
        out[2..4].copy_from_slice(&[0, 0]);
        out[4..8].copy_from_slice(&self.len.to_be_bytes());
        out[8..16].copy_from_slice(&self.seq.to_be_bytes());
        out[16..24].copy_from_slice(&self.ack.to_be_bytes());
        out[24..32].copy_from_slice(&self.credits.to_be_bytes());
    }

    /// The payload length a message's header announces, read from the first
    /// [`HEADER_LEN`] bytes of `buf` (`None` while fewer have arrived): how a stream of
    /// messages is split before any is checked.
    pub fn announced_len(buf: &[u8]) -> Option<usize> {
        let len = buf.get(4..8)?;
        (buf.len() >= HEADER_LEN)
            .then(|| u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize)
    }

    /// Checks that `buf` holds exactly one whole, well-formed message; returns its header.
    pub fn check(buf: &[u8]) -> Result<Header, WireError> {
        if buf.len() < HEADER_LEN {
            return Err(WireError::Incomplete {
                needed: HEADER_LEN - buf.len(),
            });
        }
        let kind = Kind::from_u8(buf[0])?;
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[i..i + 8]);
            u64::from_be_bytes(b)
        };
        let len = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let actual = buf.len() - HEADER_LEN;
        if (len as usize) > actual {
            return Err(WireError::Incomplete {
                needed: len as usize - actual,
            });
        }
        if (len as usize) != actual {
            return Err(WireError::LengthMismatch {
                announced: len as usize,
                actual,
            });
        }
        let header = Header {
            kind,
            flags: buf[1],
            len,
            seq: u64_at(8),
            ack: u64_at(16),
            credits: u64_at(24),
        };
        match kind {
            Kind::Data if header.seq == 0 => Err(WireError::Malformed {
                kind,
                reason: "data without a sequence number",
            }),
            Kind::Data => Ok(header),
            Kind::Regions if header.seq != 0 => Err(WireError::Malformed {
                kind,
                reason: "control message with a sequence number",
            }),
            Kind::Regions if !(len as usize).is_multiple_of(REGION_ENTRY_LEN) => {
                Err(WireError::Malformed {
                    kind,
                    reason: "payload is not a whole number of region records",
                })
            }
            Kind::Regions => Ok(header),
            _ if len != 0 => Err(WireError::Malformed {
                kind,
                reason: "control message with a payload",
            }),
            _ if header.seq != 0 => Err(WireError::Malformed {
                kind,
                reason: "control message with a sequence number",
            }),
            _ => Ok(header),
        }
    }

    /// Decodes one message: its header and payload.
    pub fn decode(buf: &[u8]) -> Result<(Header, &[u8]), WireError> {
        let header = Self::check(buf)?;
        Ok((header, &buf[HEADER_LEN..]))
    }
}

/// Bytes of one [`RegionEntry`] in a REGIONS message.
pub const REGION_ENTRY_LEN: usize = 8 + 8 + 8 + 4 + 1;
/// [`RegionEntry::access`] bit: the peer may RDMA WRITE.
pub const ACCESS_WRITE: u8 = 1;
/// [`RegionEntry::access`] bit: the peer may RDMA READ.
pub const ACCESS_READ: u8 = 2;

/// One exposed buffer as registered on the current QP: what the peer needs to name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionEntry {
    /// The application's stable handle.
    pub handle: u64,
    /// The buffer's address in this registration.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The registration's remote key (new on every device).
    pub rkey: u32,
    /// [`ACCESS_WRITE`] | [`ACCESS_READ`].
    pub access: u8,
}

impl RegionEntry {
    /// Appends the record to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.handle.to_be_bytes());
        out.extend_from_slice(&self.addr.to_be_bytes());
        out.extend_from_slice(&self.len.to_be_bytes());
        out.extend_from_slice(&self.rkey.to_be_bytes());
        out.push(self.access);
    }

    /// Decodes the records of a REGIONS payload (checked by [`Header::check`] to be a whole
    /// number of records; anything else is [`WireError::Malformed`]).
    pub fn decode_all(payload: &[u8]) -> Result<Vec<RegionEntry>, WireError> {
        if !payload.len().is_multiple_of(REGION_ENTRY_LEN) {
            return Err(WireError::Malformed {
                kind: Kind::Regions,
                reason: "payload is not a whole number of region records",
            });
        }
        let u64_at = |b: &[u8], i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(x)
        };
        payload
            .chunks_exact(REGION_ENTRY_LEN)
            .map(|b| {
                let access = b[28];
                if access & !(ACCESS_WRITE | ACCESS_READ) != 0 {
                    return Err(WireError::Malformed {
                        kind: Kind::Regions,
                        reason: "unknown access bits",
                    });
                }
                Ok(RegionEntry {
                    handle: u64_at(b, 0),
                    addr: u64_at(b, 8),
                    len: u64_at(b, 16),
                    rkey: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
                    access,
                })
            })
            .collect()
    }
}

/// A record in rdma_cm private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrivateData {
    /// First connect of a new connection.
    Hello(Hello),
    /// Reconnect of an existing connection.
    Resume(Hello),
    /// The passive side's answer to HELLO or RESUME.
    Accept(Accept),
    /// Why a connect request was refused.
    Reject(Reject),
    /// Opens the TCP bridge of an existing connection (the first bytes on the stream).
    Bridge(Hello),
}

/// HELLO and RESUME: who connects and what it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The connection's id (chosen by the active side).
    pub conn_id: u64,
    /// Secret proving a RESUME comes from the original peer.
    pub token: [u8; 16],
    /// Highest sequence number the sender has received (0 on HELLO).
    pub last_received: u64,
    /// Receives the sender pre-posted on the new QP (initial credits).
    pub credits: u16,
}

/// The answer to a HELLO or RESUME.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accept {
    /// The connection's id.
    pub conn_id: u64,
    /// Highest sequence number the passive side has received.
    pub last_received: u64,
    /// Receives the passive side pre-posted on the new QP.
    pub credits: u16,
}

/// Why a connect request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// No connection with that id here.
    UnknownConnection = 1,
    /// The token does not match.
    BadToken = 2,
    /// The connection exists but has failed or closed.
    Gone = 3,
    /// The request was malformed.
    Malformed = 4,
    /// Something else (e.g. a resource error).
    Other = 5,
    /// Not now (the connection is quiesced): retry later.
    Busy = 6,
}

/// REJECT record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reject {
    /// The connection id the request named (0 if unknown).
    pub conn_id: u64,
    /// Why.
    pub reason: RejectReason,
}

const TAG_HELLO: u8 = 1;
const TAG_RESUME: u8 = 2;
const TAG_ACCEPT: u8 = 3;
const TAG_REJECT: u8 = 4;
const TAG_BRIDGE: u8 = 5;
const HELLO_LEN: usize = 4 + 8 + 16 + 8 + 2;
const ACCEPT_LEN: usize = 4 + 8 + 8 + 2;
const REJECT_LEN: usize = 4 + 8 + 1;

impl PrivateData {
    /// The bytes every record opens with (a capture finds records by them).
    pub const MAGIC: [u8; 2] = PD_MAGIC;

    /// Encodes the record (at most [`MAX_CONNECT_PRIVATE_DATA`] bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(&PD_MAGIC);
        out.push(PD_VERSION);
        match self {
            PrivateData::Hello(h) | PrivateData::Resume(h) | PrivateData::Bridge(h) => {
                out.push(match self {
                    PrivateData::Hello(_) => TAG_HELLO,
                    PrivateData::Resume(_) => TAG_RESUME,
                    _ => TAG_BRIDGE,
                });
                out.extend_from_slice(&h.conn_id.to_be_bytes());
                out.extend_from_slice(&h.token);
                out.extend_from_slice(&h.last_received.to_be_bytes());
                out.extend_from_slice(&h.credits.to_be_bytes());
            }
            PrivateData::Accept(a) => {
                out.push(TAG_ACCEPT);
                out.extend_from_slice(&a.conn_id.to_be_bytes());
                out.extend_from_slice(&a.last_received.to_be_bytes());
                out.extend_from_slice(&a.credits.to_be_bytes());
            }
            PrivateData::Reject(r) => {
                out.push(TAG_REJECT);
                out.extend_from_slice(&r.conn_id.to_be_bytes());
                out.push(r.reason as u8);
            }
        }
        out
    }

    /// Decodes a record from the start of `buf`; trailing bytes (padding) are ignored.
    pub fn decode(buf: &[u8]) -> Result<PrivateData, WireError> {
        let need = |n: usize| {
            if buf.len() < n {
                Err(WireError::Incomplete {
                    needed: n - buf.len(),
                })
            } else {
                Ok(())
            }
        };
        need(2)?;
        if buf[..2] != PD_MAGIC {
            return Err(WireError::BadMagic {
                found: [buf[0], buf[1]],
            });
        }
        need(4)?;
        if buf[2] != PD_VERSION {
            return Err(WireError::BadVersion { found: buf[2] });
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[i..i + 8]);
            u64::from_be_bytes(b)
        };
        match buf[3] {
            tag @ (TAG_HELLO | TAG_RESUME | TAG_BRIDGE) => {
                need(HELLO_LEN)?;
                let mut token = [0u8; 16];
                token.copy_from_slice(&buf[12..28]);
                let h = Hello {
                    conn_id: u64_at(4),
                    token,
                    last_received: u64_at(28),
                    credits: u16::from_be_bytes([buf[36], buf[37]]),
                };
                Ok(match tag {
                    TAG_HELLO => PrivateData::Hello(h),
                    TAG_RESUME => PrivateData::Resume(h),
                    _ => PrivateData::Bridge(h),
                })
            }
            TAG_ACCEPT => {
                need(ACCEPT_LEN)?;
                Ok(PrivateData::Accept(Accept {
                    conn_id: u64_at(4),
                    last_received: u64_at(12),
                    credits: u16::from_be_bytes([buf[20], buf[21]]),
                }))
            }
            TAG_REJECT => {
                need(REJECT_LEN)?;
                let reason = match buf[12] {
                    1 => RejectReason::UnknownConnection,
                    2 => RejectReason::BadToken,
                    3 => RejectReason::Gone,
                    4 => RejectReason::Malformed,
                    5 => RejectReason::Other,
                    6 => RejectReason::Busy,
                    _ => return Err(WireError::BadRecord { tag: buf[12] }),
                };
                Ok(PrivateData::Reject(Reject {
                    conn_id: u64_at(4),
                    reason,
                }))
            }
            tag => Err(WireError::BadRecord { tag }),
        }
    }
}

/// Compares two tokens in constant time.
pub fn token_eq(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kind_strategy() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::Data),
            Just(Kind::Ack),
            Just(Kind::Pause),
            Just(Kind::PauseAck),
            Just(Kind::Close),
            Just(Kind::Regions),
            Just(Kind::Continue)
        ]
    }

    fn message(h: &Header, payload: &[u8]) -> Vec<u8> {
        let mut buf = vec![0u8; HEADER_LEN + payload.len()];
        h.encode(&mut buf);
        buf[HEADER_LEN..].copy_from_slice(payload);
        buf
    }

    #[test]
    fn hello_fits_in_connect_private_data() {
        let h = PrivateData::Resume(Hello {
            conn_id: u64::MAX,
            token: [0xff; 16],
            last_received: u64::MAX,
            credits: u16::MAX,
        });
        assert!(h.encode().len() <= MAX_CONNECT_PRIVATE_DATA);
    }

    #[test]
    fn padded_private_data_decodes() {
        let a = PrivateData::Accept(Accept {
            conn_id: 7,
            last_received: 9,
            credits: 64,
        });
        let mut bytes = a.encode();
        bytes.resize(196, 0);
        assert_eq!(PrivateData::decode(&bytes), Ok(a));
    }

    #[test]
    fn control_with_payload_is_malformed() {
        let h = Header {
            kind: Kind::Ack,
            flags: 0,
            len: 1,
            seq: 0,
            ack: 3,
            credits: 9,
        };
        assert!(matches!(
            Header::check(&message(&h, b"x")),
            Err(WireError::Malformed { .. })
        ));
    }

    #[test]
    fn extra_bytes_are_a_length_mismatch() {
        let h = Header {
            kind: Kind::Data,
            flags: 0,
            len: 1,
            seq: 1,
            ack: 0,
            credits: 0,
        };
        let mut buf = message(&h, b"x");
        buf.push(0);
        assert_eq!(
            Header::check(&buf),
            Err(WireError::LengthMismatch {
                announced: 1,
                actual: 2
            })
        );
    }

    #[test]
    fn regions_must_be_whole_records_with_known_access() {
        let h = Header {
            kind: Kind::Regions,
            flags: 0,
            len: 5,
            seq: 0,
            ack: 0,
            credits: 0,
        };
        assert!(matches!(
            Header::check(&message(&h, b"12345")),
            Err(WireError::Malformed { .. })
        ));
        let mut payload = Vec::new();
        RegionEntry {
            handle: 1,
            addr: 2,
            len: 3,
            rkey: 4,
            access: 0x80,
        }
        .encode(&mut payload);
        assert!(matches!(
            RegionEntry::decode_all(&payload),
            Err(WireError::Malformed {
                reason: "unknown access bits",
                ..
            })
        ));
    }

    #[test]
    fn tokens_compare() {
        assert!(token_eq(&[1; 16], &[1; 16]));
        let mut b = [1; 16];
        b[15] = 2;
        assert!(!token_eq(&[1; 16], &b));
    }

    proptest! {
        #[test]
        fn header_round_trips(kind in kind_strategy(), flags: u8, seq in 1u64.., ack: u64,
                              credits: u64, payload in proptest::collection::vec(any::<u8>(), 0..300)) {
            let (seq, payload) = match kind {
                Kind::Data => (seq, payload),
                Kind::Regions => (0, payload[..payload.len() / REGION_ENTRY_LEN * REGION_ENTRY_LEN].to_vec()),
                _ => (0, vec![]),
            };
            let h = Header { kind, flags, len: payload.len() as u32, seq, ack, credits };
            let buf = message(&h, &payload);
            let (back, body) = Header::decode(&buf).unwrap();
            prop_assert_eq!(back, h);
            prop_assert_eq!(body, &payload[..]);
        }

        #[test]
        fn truncated_messages_are_incomplete(seq in 1u64.., payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let h = Header { kind: Kind::Data, flags: 0, len: payload.len() as u32, seq, ack: 1, credits: 2 };
            let buf = message(&h, &payload);
            for cut in 0..buf.len() {
                let incomplete = matches!(Header::check(&buf[..cut]), Err(WireError::Incomplete { .. }));
                prop_assert!(incomplete, "cut at {}", cut);
            }
        }

        #[test]
        fn private_data_round_trips(conn_id: u64, token: [u8; 16], last: u64, credits: u16, which in 0u8..5, reason in 1u8..7) {
            let reason = match reason { 1 => RejectReason::UnknownConnection, 2 => RejectReason::BadToken,
                3 => RejectReason::Gone, 4 => RejectReason::Malformed, 5 => RejectReason::Other, _ => RejectReason::Busy };
            let hello = Hello { conn_id, token, last_received: last, credits };
            let pd = match which {
                0 => PrivateData::Hello(hello),
                1 => PrivateData::Resume(hello),
                2 => PrivateData::Accept(Accept { conn_id, last_received: last, credits }),
                3 => PrivateData::Bridge(hello),
                _ => PrivateData::Reject(Reject { conn_id, reason }),
            };
            let bytes = pd.encode();
            prop_assert!(bytes.len() <= MAX_CONNECT_PRIVATE_DATA);
            prop_assert_eq!(PrivateData::decode(&bytes), Ok(pd));
            for cut in 0..bytes.len() {
                let incomplete = matches!(PrivateData::decode(&bytes[..cut]), Err(WireError::Incomplete { .. }));
                prop_assert!(incomplete, "cut at {}", cut);
            }
        }

        #[test]
        fn region_entries_round_trip(entries in proptest::collection::vec(
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>(), 0u8..4), 0..40)) {
            let entries: Vec<RegionEntry> = entries.into_iter()
                .map(|(handle, addr, len, rkey, access)| RegionEntry { handle, addr, len, rkey, access })
                .collect();
            let mut payload = Vec::new();
            for e in &entries {
                e.encode(&mut payload);
            }
            let h = Header { kind: Kind::Regions, flags: 0, len: payload.len() as u32, seq: 0, ack: 1, credits: 2 };
            let buf = message(&h, &payload);
            let (back, body) = Header::decode(&buf).unwrap();
            prop_assert_eq!(back, h);
            prop_assert_eq!(RegionEntry::decode_all(body).unwrap(), entries);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Header::decode(&bytes);
            let _ = PrivateData::decode(&bytes);
            let _ = RegionEntry::decode_all(&bytes);
        }
    }
}
