//! The async API across a move: `rdmamig-perf --api async` streams numbered messages from the
//! moving VM to the peer for 25 s, and the peer's server (async API too) checks that every
//! number arrives exactly once and in order. Beside it, on a second connection, the moving
//! VM writes region after region of a buffer the peer exposed, through a handle taken before
//! the move (`rdmamig-perf write`, one-sided through the async API): after each WRITE has
//! completed it sends a notice with the region's checksum, the peer verifies the region in
//! its own memory and answers, and the writer READs the region back and compares. The VM
//! is moved with `rdmamig migrate` (strategy `reconnect`) while both run; both must still be
//! running after the move and end cleanly, the server must have received exactly what the
//! client sent, the peer must have verified every region written (and some were), and
//! every region must have been read back. A latency run through the async API on the moved
//! VM follows. Last, `rdmamig-perf pair` runs a server and a client connected to it in one
//! process on its one runtime thread, with both connections' workers as tasks there: it
//! cannot pass if a worker ever blocks its runtime thread (the other end's worker, which it
//! waits for, would never run).
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::scenario::{migrate_vm, Daemon};
use rdmamig_testbed::steps::MoveGuests;
use rdmamig_testbed::{error_chain, Guest, Testbed};
use serde_json::Value;

/// How long the stream runs; the move (a few seconds) happens inside it.
const STREAM_SECONDS: u32 = 25;
/// Bound on waiting for a run to end in a guest.
const END_WAIT: Duration = Duration::from_secs(120);
const PORT: u16 = 7480;
/// The one-sided run's server, which owns the buffer.
const WRITE_PORT: u16 = 7481;
/// `pair`'s listener, on the peer.
const PAIR_PORT: u16 = 7482;

#[test]
fn the_async_api_streams_through_a_move_exactly_once_and_in_order() {
    let bed = Testbed::new("async").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let g = MoveGuests::start(&bed, "as").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    if let Err(e) = run(&bed, &daemon, &g) {
        panic!("{}", error_chain(&*e));
    }
}

fn run(bed: &Testbed, daemon: &Daemon, g: &MoveGuests) -> Result<(), Box<dyn std::error::Error>> {
    let server = format!("{}:{PORT}", g.peer.spec().address());
    let owner = format!("{}:{WRITE_PORT}", g.peer.spec().address());
    start(&g.peer, "serve", &format!("serve --listen {server}"))?;
    start(&g.peer, "owner", &format!("serve --listen {owner}"))?;
    start(
        &g.src,
        "bw",
        &format!("bw --to {server} --seconds {STREAM_SECONDS} --ready-file /tmp/bw.ready"),
    )?;
    start(
        &g.src,
        "write",
        &format!(
            "write --to {owner} --seconds {STREAM_SECONDS} --size 4096 --regions 16 \
             --ready-file /tmp/write.ready"
        ),
    )?;
    g.src.run_ok(&wait_for("/tmp/bw.ready"), END_WAIT)?;
    g.src.run_ok(&wait_for("/tmp/write.ready"), END_WAIT)?;

    let (ok, output) = migrate_vm(
        bed,
        daemon,
        "reconnect",
        (&g.src, &g.dst),
        &bed.dir().join("async-move.json"),
        "async-move.log",
        &[],
    )?;
    assert!(ok, "the move failed:\n{output}");
    // Both runs outlived the move: they were carried through it, not run before or after.
    for (tag, server) in [("bw", "serve"), ("write", "owner")] {
        let ended = g
            .dst
            .run(&format!("[ -e /tmp/{tag}.rc ]"), END_WAIT)?
            .status
            == 0;
        if ended {
            // Both sides' errors if it failed (a server's error ends its client); too short a
            // run otherwise.
            let said = |r: Result<Value, _>| r.map_or_else(|e| format!("{e}"), |v| v.to_string());
            panic!(
                "{tag} ended before the move did:\n{}\nits server:\n{}",
                said(finished(&g.dst, tag)),
                said(finished(&g.peer, server))
            );
        }
    }

    let sent = finished(&g.dst, "bw")?;
    let served = finished(&g.peer, "serve")?;
    let count = sent["count"].as_u64().ok_or("no count in the bw report")?;
    assert!(count > 0, "{sent}");
    assert_eq!(served["received"], sent["count"], "{served} / {sent}");
    println!("through the move: {sent}");

    let written = finished(&g.dst, "write")?;
    let owned = finished(&g.peer, "owner")?;
    let regions = written["count"]
        .as_u64()
        .ok_or("no count in the write report")?;
    assert!(regions > 0, "no region was written: {written}");
    assert_eq!(owned["verified"], written["count"], "{owned} / {written}");
    assert_eq!(written["reads"], written["count"], "{written}");
    assert!(
        written["established"].as_u64() >= Some(2),
        "the one-sided connection did not reconnect: {written}"
    );
    println!("one-sided through the move: {written}");

    // Latency through the async API on the moved VM.
    start(&g.peer, "serve", &format!("serve --listen {server}"))?;
    start(&g.dst, "lat", &format!("lat --to {server} --iters 200"))?;
    let lat = finished(&g.dst, "lat")?;
    let served = finished(&g.peer, "serve")?;
    assert_eq!(served["echoed"].as_u64(), Some(300), "{served}");
    println!("after the move: {lat}");

    // Both ends and both workers on one runtime thread.
    let pair = format!("{}:{PAIR_PORT}", g.peer.spec().address());
    start(
        &g.peer,
        "pair",
        &format!("pair --listen {pair} --iters 200"),
    )?;
    let paired = finished(&g.peer, "pair")?;
    assert_eq!(paired["echoed"].as_u64(), Some(300), "{paired}");
    println!("both ends on one runtime thread: {paired}");
    Ok(())
}

/// Starts `rdmamig-perf --api async <args>` in the background under `tag`: its JSON goes to
/// /tmp/<tag>.json, its errors to /tmp/<tag>.err, its exit status to /tmp/<tag>.rc.
fn start(guest: &Guest, tag: &str, args: &str) -> Result<(), Box<dyn std::error::Error>> {
    guest.run_ok(
        &format!(
            "rm -f /tmp/{tag}.rc; (rdmamig-perf --api async {args} >/tmp/{tag}.json \
             2>/tmp/{tag}.err; echo $? >/tmp/{tag}.rc) &"
        ),
        END_WAIT,
    )?;
    Ok(())
}

/// Waits for run `tag` to end; its report if it succeeded, its errors otherwise.
fn finished(guest: &Guest, tag: &str) -> Result<Value, Box<dyn std::error::Error>> {
    guest.run_ok(&wait_for(&format!("/tmp/{tag}.rc")), END_WAIT)?;
    let out = guest.run_ok(
        &format!("cat /tmp/{tag}.rc /tmp/{tag}.json /tmp/{tag}.err"),
        END_WAIT,
    )?;
    let mut lines = out.lines();
    if lines.next().map(str::trim) != Some("0") {
        return Err(format!("rdmamig-perf {tag} on {} failed:\n{out}", guest.name()).into());
    }
    let json = lines
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| format!("rdmamig-perf {tag} printed no report:\n{out}"))?;
    Ok(serde_json::from_str(json)?)
}

/// A guest command that waits (bounded, about 100 s) until `path` exists.
fn wait_for(path: &str) -> String {
    format!("i=0; until [ -e {path} ]; do i=$((i+1)); [ $i -gt 2000 ] && exit 1; sleep 0.05; done")
}
