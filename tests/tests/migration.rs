//! Live migration on the test bed, driven by hand through QMP: the harness's destination
//! guest receives the migration, its console carries on the source's shell, and a NIC plugged
//! after the move gets an ACTIVE Soft-RoCE device. This is the naive move (no quiesce, no
//! agent), checking only that the test bed supports what the migrator does.
//!
//! A second, ignored test checks the test bed's migrations themselves: that guest memory
//! arrives intact, without rdmamig (see its doc comment).
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::thread;
use std::time::{Duration, Instant};

use rdmamig_testbed::steps::kernel_problems;
use rdmamig_testbed::{error_chain, Guest, GuestBinaries, Testbed};
use serde_json::{json, Value};

const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
const QMP_EVENT_TIMEOUT: Duration = Duration::from_secs(60);

type TestError = Box<dyn std::error::Error + Send + Sync>;

#[test]
fn destination_carries_on_after_migration() {
    let tb = Testbed::builder("migration")
        .guest_binaries(GuestBinaries::IfPresent)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    // Panicking while `tb` lives makes its drop print every guest's console.
    if let Err(e) = scenario(&tb) {
        panic!("{}", error_chain(&*e));
    }
}

fn scenario(tb: &Testbed) -> Result<(), TestError> {
    let spec = tb.guest_spec("src")?;
    let src = tb.start_guest(spec.clone())?;
    let dst = tb.start_incoming(tb.incoming_spec(&spec, "dst")?)?;
    // State in guest RAM (/tmp is a tmpfs) that must arrive with the move.
    src.run_ok("echo carried-over >/tmp/state", COMMAND_TIMEOUT)?;

    let started = Instant::now();
    let stats = migrate_by_hand(&src, &dst)?;
    let wall = started.elapsed();
    eprintln!(
        "migration: {wall:.2?} wall to RESUME on the destination; total-time {} ms, downtime {} ms",
        stats["total-time"], stats["downtime"]
    );
    src.kill();

    // The destination's console is the source's shell loop, carried over.
    dst.reattach_console()?;
    let state = dst.run_ok("cat /tmp/state", COMMAND_TIMEOUT)?;
    assert_eq!(state, "carried-over\n");

    let plug_started = Instant::now();
    let mut dst_qmp = dst.qmp()?;
    dst_qmp.execute(
        "device_add",
        json!({
            "driver": "virtio-net-pci",
            "netdev": "nd0",
            "id": "nic1",
            "bus": "rp1",
            "mac": spec.mac,
        }),
    )?;
    drop(dst_qmp);
    dst.run_ok("rdmamig-netplug wait-active 10", COMMAND_TIMEOUT)?;
    eprintln!(
        "destination: device_add -> rxe ACTIVE {:.2?}",
        plug_started.elapsed()
    );
    let info = dst.run_ok("ibv_devinfo", COMMAND_TIMEOUT)?;
    assert!(info.contains("PORT_ACTIVE"), "{info}");
    Ok(())
}

/// Moves `src` to the `-incoming` guest `dst` by hand (unplugging the source's RDMA NIC
/// first, as the migrator does) and returns the source's `query-migrate` answer.
fn migrate_by_hand(src: &Guest, dst: &Guest) -> Result<Value, TestError> {
    let mut src_qmp = src.qmp()?;
    if src.spec().with_nic {
        src_qmp.execute("device_del", json!({ "id": "nic0" }))?;
        src_qmp.wait_event(
            "DEVICE_DELETED",
            |d| d["device"] == "nic0",
            QMP_EVENT_TIMEOUT,
        )?;
    }
    let mut dst_qmp = dst.qmp()?;
    let uri = format!("unix:{}", dst.migration_socket_path().display());
    dst_qmp.execute("migrate-incoming", json!({ "uri": uri }))?;
    src_qmp.execute(
        "migrate-set-capabilities",
        json!({ "capabilities": [{ "capability": "events", "state": true }] }),
    )?;
    src_qmp.execute("migrate", json!({ "uri": uri }))?;
    let end = src_qmp.wait_event(
        "MIGRATION",
        |d| d["status"] == "completed" || d["status"] == "failed",
        QMP_EVENT_TIMEOUT,
    )?;
    if end["data"]["status"] != "completed" {
        return Err(format!("migrating {}: {end}", src.name()).into());
    }
    dst_qmp.wait_event("RESUME", |_| true, QMP_EVENT_TIMEOUT)?;
    Ok(src_qmp.execute("query-migrate", Value::Null)?)
}

/// Rounds of [`guest_memory_survives_concurrent_migrations`].
const ROUNDS: usize = 10;

/// Two guests churn their memory (copy a 32 MiB random file in the tmpfs and checksum the
/// copy, over and over) and ping each other over the permanent NICs, while both migrate at
/// once, `ROUNDS` times. Every checksum must match the file's, and neither guest kernel may
/// log a problem ([`kernel_problems`]). No rdmamig and no RDMA traffic take part.
///
/// Ignored: it fails intermittently, which is the point of keeping it. On 2026-11-29, across
/// about 200 guest migrations of this kind (QEMU 7.2 under TCG, two at once on 2 CPUs), one
/// guest's kernel hit `list_del corruption` in its LRU lists right after its 6th migration,
/// and one more run lost a guest's console at the same point. The same corruption (in the page
/// allocator) hit a guest moved by rdmamig in a `both_ends` run. Guest kernel memory is
/// occasionally corrupted by the test bed's migrations themselves, below rdmamig. A user-space
/// checker (one word per page, each sweep checking the previous one) saw no lost store in 24
/// of these migrations (docs/testbed.md). Run with `-- --ignored`.
#[test]
#[ignore = "checks the test bed's QEMU; fails intermittently (see the doc comment)"]
fn guest_memory_survives_concurrent_migrations() {
    let tb = Testbed::builder("memint")
        .guest_binaries(GuestBinaries::IfPresent)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    if let Err(e) = churn_and_migrate(&tb) {
        panic!("{}", error_chain(&*e));
    }
}

fn churn_and_migrate(tb: &Testbed) -> Result<(), TestError> {
    let specs = [tb.guest_spec("a")?, tb.guest_spec("b")?];
    let mut guests = [
        tb.start_guest(specs[0].clone())?,
        tb.start_guest(specs[1].clone())?,
    ];
    let mut sums = Vec::new();
    for (guest, peer) in guests.iter().zip(specs.iter().rev()) {
        guest.run_ok(
            "dd if=/dev/urandom of=/tmp/a bs=64k count=512 2>/dev/null",
            COMMAND_TIMEOUT,
        )?;
        sums.push(guest.run_ok("md5sum </tmp/a", COMMAND_TIMEOUT)?);
        guest.run_ok(
            "(while :; do cp /tmp/a /tmp/b; md5sum </tmp/b >>/tmp/sums; rm /tmp/b; done) \
             >/dev/null 2>&1 &",
            COMMAND_TIMEOUT,
        )?;
        guest.run_ok(
            &format!(
                "ping -q -i 0.01 {} >/dev/null 2>&1 &",
                peer.permanent_address()
            ),
            COMMAND_TIMEOUT,
        )?;
    }
    for round in 0..ROUNDS {
        let [a, b] = &guests;
        let dst_a = tb.start_incoming(tb.incoming_spec(a.spec(), &format!("a{round}"))?)?;
        let dst_b = tb.start_incoming(tb.incoming_spec(b.spec(), &format!("b{round}"))?)?;
        let (moved_a, moved_b) = thread::scope(|s| {
            let first = s.spawn(|| migrate_by_hand(a, &dst_a));
            thread::sleep(Duration::from_millis(300));
            let second = migrate_by_hand(b, &dst_b);
            (first.join().expect("migration thread"), second)
        });
        moved_a?;
        moved_b?;
        for (guest, dst) in guests.iter_mut().zip([dst_a, dst_b]) {
            guest.kill();
            *guest = dst;
            guest.reattach_console()?;
        }
        thread::sleep(Duration::from_secs(3));
        for (guest, sum) in guests.iter().zip(&sums) {
            let wrong = guest.run_ok(
                &format!("grep -v -c '{}' /tmp/sums || true", sum.trim()),
                COMMAND_TIMEOUT,
            )?;
            let checked = guest.run_ok("wc -l </tmp/sums", COMMAND_TIMEOUT)?;
            eprintln!(
                "round {round}, {}: {} checksums, {} wrong",
                guest.name(),
                checked.trim(),
                wrong.trim()
            );
            assert_eq!(
                wrong.trim(),
                "0",
                "{}: a copy's checksum changed",
                guest.name()
            );
            let problems = kernel_problems(guest).map_err(|e| e.to_string())?;
            assert!(problems.is_empty(), "{}", problems.join("\n"));
        }
    }
    Ok(())
}
