//! A slow reader holds a fast sender back, on the test bed: one guest sends as fast as it
//! can to another whose application takes no message for its first six seconds. The
//! library withholds the sender's credits once the reader's inbox holds four QPs' worth of
//! receives, so the reader's memory stays bounded whatever the sender does, the sender
//! waits (its outbox fills, its sends block), and once the reader reads again everything
//! arrives: nothing lost, duplicated or reordered.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::steps::{
    assert_clean, collect_report, dump_logs, start_traffic, stop_traffic, wait_ready,
};
use rdmamig_testbed::{error_chain, GuestBinaries, Testbed};

const TAG: &str = "bp";
/// `ConnectOptions::default().recv_depth`.
const RECV_DEPTH: u64 = 64;

#[test]
fn a_slow_reader_holds_a_fast_sender_back_and_loses_nothing() {
    let tb = Testbed::builder("backpr")
        .guest_binaries(GuestBinaries::Required)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let specs = [
        tb.guest_spec("reader").unwrap(),
        tb.guest_spec("sender").unwrap(),
    ];
    let [reader, sender] = std::thread::scope(|s| {
        specs
            .map(|spec| s.spawn(|| tb.start_guest(spec)))
            .map(|h| h.join().expect("boot thread"))
    });
    let (reader, sender) = (
        reader.unwrap_or_else(|e| panic!("{}", error_chain(&e))),
        sender.unwrap_or_else(|e| panic!("{}", error_chain(&e))),
    );
    let server = format!("{}:7471", reader.spec().address());
    let started = start_traffic(
        &reader,
        TAG,
        &format!("serve --listen {server} --rate 1 --stall-reading-ms 6000"),
    )
    .and_then(|()| start_traffic(&sender, TAG, &format!("connect --to {server} --rate 5000")))
    .and_then(|()| wait_ready(&reader, TAG, 1))
    .and_then(|()| wait_ready(&sender, TAG, 1));
    if let Err(e) = started {
        dump_logs(&reader);
        dump_logs(&sender);
        panic!("starting the traffic: {e}");
    }
    // The stall, then a few seconds of reading.
    std::thread::sleep(Duration::from_secs(10));
    let reports = stop_traffic(&sender, TAG)
        .and_then(|()| stop_traffic(&reader, TAG))
        .and_then(|()| Ok((collect_report(&reader, TAG)?, collect_report(&sender, TAG)?)));
    let (read, sent) = reports.unwrap_or_else(|e| {
        dump_logs(&reader);
        dump_logs(&sender);
        panic!("traffic reports: {e}");
    });
    eprintln!("reader: {read:?}\nsender: {sent:?}");
    let bound = 4 * RECV_DEPTH + RECV_DEPTH;
    // The sender really outran the reader: far more than the bound was sent.
    assert!(
        sent.sent > 4 * bound,
        "the sender sent only {} messages; the test shows nothing",
        sent.sent
    );
    assert!(
        read.inbox_high <= bound,
        "the reader's inbox held {} messages at once (bound {bound})",
        read.inbox_high
    );
    assert_clean("reader", &read, &sent);
    assert_clean("sender", &sent, &read);
}
