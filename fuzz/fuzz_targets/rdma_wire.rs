//! The bytes a peer puts in an RDMA message header or in rdma_cm private data are
//! untrusted: decoding must never panic, and whatever decodes must re-encode to the same
//! meaning.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmamig_guest::conn::wire::{Header, PrivateData};

fuzz_target!(|data: &[u8]| {
    if let Ok((header, _payload)) = Header::decode(data) {
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
