//! The bytes a peer puts in an RDMA message header, a REGIONS message's records or rdma_cm
//! private data are untrusted: decoding must never panic, and whatever decodes must re-encode to the same
//! meaning.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_conn::wire::{Header, Kind, PrivateData, RegionEntry, WireError};

fuzz_target!(|data: &[u8]| {
    if let Ok(records) = RegionEntry::decode_all(data) {
        let mut again = Vec::new();
        for r in &records {
            r.encode(&mut again);
        }
        assert_eq!(again, data);
    }
    if let Ok((header, payload)) = Header::decode(data) {
        if header.kind == Kind::Regions {
            // Checked to be whole records: only their contents can be refused.
            if let Err(e) = RegionEntry::decode_all(payload) {
                assert!(
                    matches!(e, WireError::Malformed { reason: "unknown access bits", .. }),
                    "{e}"
                );
            }
        }
        // Same payload, header re-encoded in place.
        let mut again = data.to_vec();
        header.encode(&mut again);
        let (decoded, _) = Header::decode(&again).expect("an encoded header decodes");
        assert_eq!(decoded, header);
    }
    if let Ok(private) = PrivateData::decode(data) {
        assert_eq!(PrivateData::decode(&private.encode()).ok(), Some(private));
    }
});
