//! Smoke test of the test bed: two guests on one bridge reach each other over Soft-RoCE.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::{Duration, Instant};

use rdmamig_testbed::{error_chain, GuestBinaries, Testbed};

const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn two_guests_ping_over_soft_roce() {
    let tb = Testbed::builder("smoke")
        .guest_binaries(GuestBinaries::IfPresent)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    // Panicking while `tb` lives makes its drop print every guest's console.
    if let Err(e) = scenario(&tb) {
        panic!("{}", error_chain(&*e));
    }
}

fn scenario(tb: &Testbed) -> Result<(), Box<dyn std::error::Error>> {
    let specs = [tb.guest_spec("a")?, tb.guest_spec("b")?];
    // Both boot at once; each TCG guest uses about one core.
    let started = Instant::now();
    let [a, b] = std::thread::scope(|s| {
        let boots = specs.map(|spec| {
            s.spawn(move || {
                let result = tb.start_guest(spec);
                (result, started.elapsed())
            })
        });
        boots.map(|boot| boot.join().expect("boot thread"))
    });
    let (a, a_boot) = (a.0?, a.1);
    let (b, b_boot) = (b.0?, b.1);
    eprintln!("boot to RDMAMIG-READY: a {a_boot:.2?}, b {b_boot:.2?} (in parallel)");

    for guest in [&a, &b] {
        // /init starts the agent when the image has it.
        let agent = guest.run(
            "[ -x /usr/bin/rdmamig-agent ] || exit 0; pidof rdmamig-agent",
            COMMAND_TIMEOUT,
        )?;
        assert_eq!(
            agent.status,
            0,
            "{}: the agent is not running:\n{}",
            guest.name(),
            guest.run("cat /run/agent.log", COMMAND_TIMEOUT)?.output
        );
        let info = guest.run_ok("ibv_devinfo", COMMAND_TIMEOUT)?;
        assert!(
            info.contains("PORT_ACTIVE"),
            "{}: ibv_devinfo shows no active port:\n{info}",
            guest.name()
        );
    }

    let server = a.spec().address().to_owned();
    a.run_ok(
        &format!("rping -s -a {server} -C 10 >/tmp/rping-server.log 2>&1 &"),
        COMMAND_TIMEOUT,
    )?;
    // The server is up once its rdma_cm id listens.
    a.run_ok(
        "for i in $(seq 100); do rdma res show cm_id | grep -q LISTEN && exit 0; sleep 0.05; done; exit 1",
        COMMAND_TIMEOUT,
    )?;
    let ping_started = Instant::now();
    let client = b.run(&format!("rping -c -a {server} -C 10 -v"), COMMAND_TIMEOUT)?;
    let ping_time = ping_started.elapsed();
    assert_eq!(client.status, 0, "rping client failed:\n{}", client.output);
    let pings = client
        .output
        .lines()
        .filter(|l| l.starts_with("ping data: rdma-ping-"))
        .count();
    assert_eq!(pings, 10, "rping client output:\n{}", client.output);
    eprintln!("rping 10 iterations: {ping_time:.2?} (console round trip included)");

    // The server finishes its one connection and exits cleanly.
    a.run_ok(
        "for i in $(seq 100); do pidof rping >/dev/null || exit 0; sleep 0.05; done; exit 1",
        COMMAND_TIMEOUT,
    )?;
    let server_log = a.run_ok("cat /tmp/rping-server.log", COMMAND_TIMEOUT)?;
    assert!(
        !server_log.to_lowercase().contains("error"),
        "rping server log:\n{server_log}"
    );
    Ok(())
}
