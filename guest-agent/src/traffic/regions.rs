//! The traffic tool's one-sided mode: each side exposes one buffer of `regions` regions and
//! the peer fills it, region by region, with RDMA WRITE. Every region written is stamped with
//! its round and a checksum of its contents, and the numbered message sent right after the
//! write names the region, the round and the checksum, so the buffer's owner verifies on
//! receipt that the data is in place (a message sent after a completed write arrives after
//! the data). The contents of round `r` of region `i` are a fixed function of `(r, i)`, so
//! the verification also catches stale or mixed data.

/// Bytes of a region's stamp: round, then checksum of the rest.
pub const STAMP_LEN: usize = 16;
/// Bytes the notice takes in a traffic message, after the counter and timestamp.
pub const NOTICE_LEN: usize = 2 + 4 + 8 + 8;
const NOTICE_MAGIC: [u8; 2] = *b"WR";

/// What a traffic message says about a region it follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notice {
    /// The region written.
    pub region: u32,
    /// Its round (how many times the region was written before).
    pub round: u64,
    /// The checksum of what was written after the stamp.
    pub checksum: u64,
}

impl Notice {
    /// Writes the notice into `out` (at least [`NOTICE_LEN`] bytes).
    pub fn encode(&self, out: &mut [u8]) {
        out[..2].copy_from_slice(&NOTICE_MAGIC);
        out[2..6].copy_from_slice(&self.region.to_be_bytes());
        out[6..14].copy_from_slice(&self.round.to_be_bytes());
        out[14..22].copy_from_slice(&self.checksum.to_be_bytes());
    }

    /// Reads a notice from the start of `b`; `None` if there is none.
    pub fn decode(b: &[u8]) -> Option<Notice> {
        if b.len() < NOTICE_LEN || b[..2] != NOTICE_MAGIC {
            return None;
        }
        Some(Notice {
            region: u32::from_be_bytes(b[2..6].try_into().ok()?),
            round: u64::from_be_bytes(b[6..14].try_into().ok()?),
            checksum: u64::from_be_bytes(b[14..22].try_into().ok()?),
        })
    }
}

/// FNV-1a, 64 bits: enough to tell written data from anything else.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The contents of round `round` of region `region`, `size` bytes (at least the stamp),
/// and the checksum its stamp carries.
pub fn fill(round: u64, region: u32, size: usize) -> (Vec<u8>, u64) {
    let mut data = vec![0u8; size.max(STAMP_LEN)];
    // xorshift64 seeded by (round, region): cheap, and different for every pair.
    let mut x = (round << 20) ^ region as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in data[STAMP_LEN..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_be_bytes()[..chunk.len()]);
    }
    let sum = checksum(&data[STAMP_LEN..]);
    data[..8].copy_from_slice(&round.to_be_bytes());
    data[8..16].copy_from_slice(&sum.to_be_bytes());
    (data, sum)
}

/// What the owner of a region finds when a notice for it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The region holds exactly what the notice announced.
    Good,
    /// The region was written again since (a later round): nothing to check any more.
    Overtaken,
    /// The data is missing, stale or corrupt.
    Bad(String),
}

/// Checks `found` (the region's bytes) against `notice`.
pub fn verify(found: &[u8], notice: &Notice) -> Verdict {
    if found.len() < STAMP_LEN {
        return Verdict::Bad(format!("region {} is too small", notice.region));
    }
    let round = u64::from_be_bytes(found[..8].try_into().expect("8 bytes"));
    let stamped = u64::from_be_bytes(found[8..16].try_into().expect("8 bytes"));
    if round > notice.round {
        return Verdict::Overtaken;
    }
    if round < notice.round {
        return Verdict::Bad(format!(
            "region {}: round {round} found where round {} was announced (the write is missing)",
            notice.region, notice.round
        ));
    }
    let actual = checksum(&found[STAMP_LEN..]);
    if actual != notice.checksum || stamped != notice.checksum {
        return Verdict::Bad(format!(
            "region {} round {round}: checksum {actual:016x}, stamped {stamped:016x}, announced {:016x}",
            notice.region, notice.checksum
        ));
    }
    if found != fill(round, notice.region, found.len()).0 {
        return Verdict::Bad(format!(
            "region {} round {round}: contents differ from what was written",
            notice.region
        ));
    }
    Verdict::Good
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip() {
        let n = Notice {
            region: 7,
            round: 1 << 40,
            checksum: 0xfeed,
        };
        let mut b = [0u8; NOTICE_LEN + 3];
        n.encode(&mut b);
        assert_eq!(Notice::decode(&b), Some(n));
        assert_eq!(Notice::decode(&b[..NOTICE_LEN - 1]), None);
        assert_eq!(Notice::decode(&[0u8; NOTICE_LEN]), None);
    }

    #[test]
    fn a_written_region_verifies() {
        let (data, sum) = fill(3, 5, 4096);
        let n = Notice {
            region: 5,
            round: 3,
            checksum: sum,
        };
        assert_eq!(verify(&data, &n), Verdict::Good);
        // Rounds and regions give different contents.
        assert_ne!(fill(4, 5, 4096).1, sum);
        assert_ne!(fill(3, 6, 4096).1, sum);
    }

    #[test]
    fn missing_stale_and_corrupt_data_is_caught() {
        let (data, sum) = fill(3, 5, 256);
        let n = Notice {
            region: 5,
            round: 3,
            checksum: sum,
        };
        let (older, _) = fill(2, 5, 256);
        assert!(matches!(verify(&older, &n), Verdict::Bad(m) if m.contains("missing")));
        assert!(matches!(verify(&vec![0u8; 256], &n), Verdict::Bad(_)));
        let mut flipped = data.clone();
        flipped[200] ^= 1;
        assert!(matches!(verify(&flipped, &n), Verdict::Bad(m) if m.contains("checksum")));
        let (newer, _) = fill(4, 5, 256);
        assert_eq!(verify(&newer, &n), Verdict::Overtaken);
        // Another region's data, stamped as this round: caught by the contents check.
        let (mut other, other_sum) = fill(3, 6, 256);
        other[8..16].copy_from_slice(&other_sum.to_be_bytes());
        let n6 = Notice {
            region: 5,
            round: 3,
            checksum: other_sum,
        };
        assert!(matches!(verify(&other, &n6), Verdict::Bad(m) if m.contains("differ")));
    }
}
