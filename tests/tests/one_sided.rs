//! One-sided RDMA across moves: two VMs expose a buffer each and fill each other's, region by
//! region, with RDMA WRITE through a handle taken once, before any move
//! (`rdmamig-traffic --one-sided`). Each write is followed by a numbered message naming the
//! region, its round and checksum, which the buffer's owner verifies on receipt; once per
//! round the writer also READs the region back. The second VM then moves ten times, back and
//! forth between two QEMU slots (the test bed has one host), with `rdmamig migrate`
//! (strategy `reconnect`). After every move both sides must have verified new regions (so
//! the handles work with the new rkeys, in both directions) and READs must have come back
//! right, with no region ever missing or corrupt; at the end nothing may be lost,
//! duplicated or reordered and neither side may have seen an error.
//!
//! A second test cuts the network instead of moving (no quiesce): what the lost link took
//! must be replayed on the next QP.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::{Duration, Instant};

use rdmamig_guest::traffic::Progress;
use rdmamig_testbed::scenario::{migrate_vm, Daemon};
use rdmamig_testbed::steps::{
    assert_clean, collect_report, dump_logs, set_tap, stop_traffic, MoveGuests, STEP_TIMEOUT,
};
use rdmamig_testbed::{error_chain, Guest, Testbed};

const TAG: &str = "os";
const MOVES: usize = 10;
const REGIONS: u32 = 16;
/// How long, after a move, both sides get to verify fresh regions.
const PROGRESS_WAIT: Duration = Duration::from_secs(20);

/// The guests of the test: the peer, the VM that moves, and where it moves next.
struct Slots {
    peer: Guest,
    vm: Guest,
    next: Option<Guest>,
}

#[test]
fn rdma_writes_through_stable_handles_survive_ten_moves_verified_after_each() {
    let bed = Testbed::new("onesided").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let g = MoveGuests::start(&bed, TAG).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let flow = g.start_flow(
        TAG,
        &format!(
            "--one-sided --rate 50 --regions {REGIONS} --region-size 4096 \
             --progress-file /tmp/{TAG}.progress"
        ),
    );
    let mut slots = Slots {
        peer: g.peer,
        vm: g.src,
        next: Some(g.dst),
    };
    // Assertions panic inside `run`: catch them too, so the guests' logs are printed first.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        flow?;
        run(&bed, &daemon, &mut slots)
    }));
    if !matches!(outcome, Ok(Ok(()))) {
        dump_logs(&slots.peer);
        dump_logs(&slots.vm);
    }
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn run(bed: &Testbed, daemon: &Daemon, s: &mut Slots) -> Result<(), Box<dyn std::error::Error>> {
    // Both sides verify regions before any move.
    let mut last = (
        wait_progress(&s.peer, &Progress::default())?,
        wait_progress(&s.vm, &Progress::default())?,
    );
    for n in 1..=MOVES {
        let next = s.next.take().ok_or("no destination")?;
        let started = Instant::now();
        let (ok, output) = migrate_vm(
            bed,
            daemon,
            "reconnect",
            (&s.vm, &next),
            &bed.dir().join(format!("move-{n}.json")),
            &format!("move-{n}.log"),
            &[],
        )?;
        let moved = started.elapsed();
        s.vm = next;
        if !ok {
            return Err(format!("move {n} failed:\n{output}").into());
        }
        let now = (
            wait_progress(&s.peer, &last.0)?,
            wait_progress(&s.vm, &last.1)?,
        );
        eprintln!(
            "move {n}: {moved:.2?}; verified so far: peer {} regions, {} reads; moving VM {} \
             regions, {} reads",
            now.0.regions_verified,
            now.0.reads_verified,
            now.1.regions_verified,
            now.1.reads_verified
        );
        last = now;
        if n < MOVES {
            // The next move goes back to the other QEMU slot: a new -incoming process there.
            let slot = if n % 2 == 0 { "dst" } else { "src" };
            let spec = bed.incoming_spec(s.vm.spec(), &format!("{TAG}-{slot}{n}"))?;
            s.next = Some(bed.start_incoming(spec)?);
        }
    }
    stop_traffic(&s.peer, TAG)?;
    stop_traffic(&s.vm, TAG)?;
    let rp = collect_report(&s.peer, TAG)?;
    let rv = collect_report(&s.vm, TAG)?;
    eprintln!("report peer: {rp:?}\nreport moving VM: {rv:?}");
    assert_clean("peer", &rp, &rv);
    assert_clean("moving VM", &rv, &rp);
    for (name, r, writer) in [("peer", &rp, &rv), ("moving VM", &rv, &rp)] {
        assert_eq!(r.regions_bad, 0, "{name} found bad regions: {r:?}");
        // Every region written into this side was checked (or written again before its
        // notice arrived); the last one may be in flight when sending stopped.
        assert!(
            r.regions_verified + r.regions_overtaken + 1 >= writer.regions_written,
            "{name} verified {} (+{} overtaken) of the {} regions written into it",
            r.regions_verified,
            r.regions_overtaken,
            writer.regions_written
        );
        assert!(r.reads_verified > MOVES as u64, "{name} READs: {r:?}");
        assert!(
            r.connections_established > MOVES as u64,
            "{name}: every move reconnects: {r:?}"
        );
    }
    Ok(())
}

/// A partition, not a move: the peer's tap goes down for 4 s under one-sided traffic. The
/// WRITE in flight then fails (retry exceeded) and the link is lost without a quiesce; once
/// the network is back the connection resumes on a new QP and must post what had not
/// completed again (a replay), with the new rkeys, and every region must still verify.
#[test]
fn operations_a_partition_took_are_replayed_on_the_next_qp() {
    let bed = Testbed::new("osreplay").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let g = MoveGuests::start(&bed, TAG).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| partition(&bed, &g)));
    if !matches!(outcome, Ok(Ok(()))) {
        dump_logs(&g.peer);
        dump_logs(&g.src);
    }
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn partition(bed: &Testbed, g: &MoveGuests) -> Result<(), Box<dyn std::error::Error>> {
    g.start_flow(
        TAG,
        &format!(
            "--one-sided --rate 50 --regions {REGIONS} --region-size 4096 \
             --progress-file /tmp/{TAG}.progress"
        ),
    )?;
    let before = (
        wait_progress(&g.peer, &Progress::default())?,
        wait_progress(&g.src, &Progress::default())?,
    );
    set_tap(bed, &g.peer, false)?;
    std::thread::sleep(Duration::from_secs(4));
    set_tap(bed, &g.peer, true)?;
    wait_progress(&g.peer, &before.0)?;
    wait_progress(&g.src, &before.1)?;
    stop_traffic(&g.peer, TAG)?;
    stop_traffic(&g.src, TAG)?;
    let rp = collect_report(&g.peer, TAG)?;
    let rv = collect_report(&g.src, TAG)?;
    eprintln!("report peer: {rp:?}\nreport other VM: {rv:?}");
    assert_clean("peer", &rp, &rv);
    assert_clean("other VM", &rv, &rp);
    for (name, r) in [("peer", &rp), ("other VM", &rv)] {
        assert_eq!(r.regions_bad, 0, "{name} found bad regions: {r:?}");
        assert!(
            r.connections_established >= 2 && !r.link_events.is_empty(),
            "{name}: the partition should have broken the link: {r:?}"
        );
    }
    assert!(
        rp.onesided_replayed + rv.onesided_replayed > 0,
        "nothing was replayed: peer {rp:?}, other VM {rv:?}"
    );
    Ok(())
}

/// Waits until `guest`'s traffic has verified regions and READs beyond `before`, with no bad
/// region; returns its progress.
fn wait_progress(guest: &Guest, before: &Progress) -> Result<Progress, Box<dyn std::error::Error>> {
    let end = Instant::now() + PROGRESS_WAIT;
    loop {
        let text = guest.run_ok(
            &format!("cat /tmp/{TAG}.progress 2>/dev/null; true"),
            STEP_TIMEOUT,
        )?;
        let p: Progress = serde_json::from_str(text.trim()).unwrap_or_default();
        if p.regions_bad > 0 {
            return Err(format!("{}: bad regions: {p:?}", guest.name()).into());
        }
        // A full round of fresh regions and a READ since: the data written after the move
        // arrived and checked out.
        if p.regions_verified >= before.regions_verified + REGIONS as u64
            && p.reads_verified > before.reads_verified
        {
            return Ok(p);
        }
        if Instant::now() >= end {
            return Err(format!(
                "{}: no fresh verified regions within {PROGRESS_WAIT:?}: {p:?} (before: {before:?})",
                guest.name()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}
