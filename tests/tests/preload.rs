//! Unmodified programs under `rdmamig-run`, on the test bed: Debian's own `ibv_rc_pingpong`
//! (raw verbs, QP numbers exchanged over TCP) runs between two guests over Soft-RoCE with
//! librdmamig_preload.so on both ends. Every verbs object it holds is one of the library's
//! virtual objects (`RDMAMIG_PRELOAD_TRACE` names each), and its data path (post, poll,
//! completion events) goes through the virtual context's ops table. The library's record of
//! the QP (what a rebuild will need) holds what the program set up. A verb the library
//! does not carry fails at the call.
//!
//! And it moves: an `ibv_rc_pingpong` client in the moving VM keeps its connection to the
//! server on the peer through a `reconnect` move, polling, then back again with completion
//! events (asleep in ibv_get_cq_event while the move takes its channel away). Its library
//! registers with the agent, pauses the server's QP through the peer's agent, lets go of
//! the device, rebuilds every object on the new one and has the server's QP walked to the
//! new QP; both ends complete every exchange (a lost message would stall the ping-pong, an
//! extra one would end one side early). Beside it in the first move runs a copy not under
//! rdmamig-run: the move's `--unmanaged release` ends that one, and only that one.
//!
//! And rdma_cm programs move: rping with data verification (`-V`: RDMA READ and WRITE to
//! rkeys sent in band), then perftest's `ib_send_bw -R` and `ib_write_bw -R`, each client in
//! the moving VM and its server on the peer, each across its own `reconnect` move. Both
//! ends exit 0, perftest's with every iteration done; the move's DEVICE_REMOVAL never
//! reaches the program, and rping's server gets its DISCONNECTED from its peer's library.
//! An rping server in the moving VM listening on one address cannot be carried (its kernel
//! listener goes with the device): the move is refused at prepare, naming it, and the
//! rping pair goes on. A persistent one listening on any address moves: its connection
//! lives through the move, and a new client connects after it.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{run_move, wait_listening, MoveGuests, STEP_TIMEOUT};
use rdmamig_testbed::{error_chain, Guest, Testbed};

const COMMAND: Duration = Duration::from_secs(120);
/// ibv_rc_pingpong's TCP port.
const PINGPONG_PORT: u16 = 18515;
const ITERS: u32 = 500;

#[test]
fn ibv_rc_pingpong_runs_on_virtual_verbs_objects_and_a_verb_not_carried_fails_at_the_call() {
    let bed = Testbed::new("preload").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let (a, b) = two_guests(&bed);
    for (options, channel) in [("", false), ("-e", true)] {
        let (server, client) = pingpong(&a, &b, ITERS, options)
            .unwrap_or_else(|e| panic!("ibv_rc_pingpong {options}: {}", error_chain(&*e)));
        for (side, out) in [("server", &server), ("client", &client)] {
            eprintln!("----- {side} ({options}) -----\n{out}");
            assert!(
                out.contains(&format!("{ITERS} iters in")),
                "{side} ({options}) did not complete:\n{out}"
            );
            let mut kinds = vec!["Context", "Pd", "Mr", "Cq", "Qp"];
            if channel {
                kinds.push("Channel");
            }
            for kind in kinds {
                assert!(
                    out.contains(&format!("virtual {kind} at")),
                    "{side} ({options}) holds no virtual {kind}:\n{out}"
                );
            }
            assert!(!out.contains("not supported"), "{side} ({options}):\n{out}");
            check_record(side, out);
        }
    }
    a_verb_the_library_does_not_carry_fails_at_the_call(&a);
}

/// What the library recorded of the QP must be what the program set up: the remote QP
/// number, PSN and GID it printed as its peer's, and receives outstanding at the end (it
/// keeps receives posted throughout), tracked throughout.
fn check_record(side: &str, out: &str) {
    let remote = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("remote address:"))
        .unwrap_or_else(|| panic!("{side}: no remote address:\n{out}"));
    let field = |line: &str, name: &str| -> String {
        line.split([',', ' '])
            .skip_while(|w| *w != name)
            .find(|w| !w.is_empty() && *w != name)
            .unwrap_or_else(|| panic!("{side}: no {name} in {line:?}"))
            .to_owned()
    };
    let hex = |v: String| u32::from_str_radix(v.trim_start_matches("0x"), 16).unwrap();
    let recorded = out
        .lines()
        .find(|l| l.contains("recorded at RTS"))
        .unwrap_or_else(|| panic!("{side}: the QP's record was not traced:\n{out}"));
    assert_eq!(
        hex(field(recorded, "dest_qp")),
        hex(field(remote, "QPN")),
        "{side}: {recorded}"
    );
    assert_eq!(
        hex(field(recorded, "rq_psn")),
        hex(field(remote, "PSN")),
        "{side}: {recorded}"
    );
    assert_eq!(
        field(recorded, "dgid"),
        field(remote, "GID"),
        "{side}: {recorded}"
    );
    let destroyed = out
        .lines()
        .find(|l| l.contains("destroyed with"))
        .unwrap_or_else(|| panic!("{side}: the QP's end was not traced:\n{out}"));
    let outstanding: u32 = field(destroyed, "with").parse().unwrap();
    assert!(
        (1..=500).contains(&outstanding) && !destroyed.contains("lost track"),
        "{side}: {destroyed}"
    );
}

/// A verb the library does not carry fails at the call: `--new_send` creates its QP with
/// ibv_create_qp_ex and posts with ibv_wr_* (extended verbs, which find no ops in a virtual
/// context).
fn a_verb_the_library_does_not_carry_fails_at_the_call(guest: &Guest) {
    let out = guest
        .run(
            "timeout 60 rdmamig-run -- ibv_rc_pingpong -g 1 --new_send",
            COMMAND,
        )
        .unwrap();
    assert_ne!(out.status, 0, "{}", out.output);
    assert!(out.output.contains("Couldn't create QP"), "{}", out.output);
}

fn two_guests(bed: &Testbed) -> (Guest, Guest) {
    let specs = [bed.guest_spec("a"), bed.guest_spec("b")].map(|s| s.unwrap());
    let [a, b] = std::thread::scope(|s| {
        specs
            .map(|spec| s.spawn(move || bed.start_guest(spec)))
            .map(|boot| boot.join().expect("boot thread"))
    });
    let a = a.unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let b = b.unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    (a, b)
}

/// Runs an ibv_rc_pingpong server on `a` and its client on `b`, both under rdmamig-run with
/// `iters` exchanges and `options`; returns each one's output once both ended with status 0.
fn pingpong(
    a: &Guest,
    b: &Guest,
    iters: u32,
    options: &str,
) -> Result<(String, String), Box<dyn std::error::Error>> {
    let run =
        format!("RDMAMIG_PRELOAD_TRACE=1 rdmamig-run -- ibv_rc_pingpong -g 1 -n {iters} {options}");
    a.run_ok(
        &format!("rm -f /tmp/pp.status; ({run} >/tmp/pp.log 2>&1; echo $? >/tmp/pp.status) &"),
        COMMAND,
    )?;
    wait_listening(a, PINGPONG_PORT)?;
    let client = b.run(&format!("{run} {}", a.spec().address()), COMMAND)?;
    let server = a.run_ok(
        "i=0; until [ -f /tmp/pp.status ]; do i=$((i+1)); [ $i -gt 300 ] && break; sleep 0.1; done; \
         cat /tmp/pp.log; echo status $(cat /tmp/pp.status)",
        COMMAND,
    )?;
    if client.status != 0 || !server.trim_end().ends_with("status 0") {
        return Err(format!(
            "client exited {}:\n{}\nserver:\n{server}",
            client.status, client.output
        )
        .into());
    }
    Ok((server, client.output))
}

/// How long a moved program is meant to run. Its move's quiesce comes about 2 s after it
/// connected, and from there the program is paused until the resume, so it cannot end
/// before the move does; the rest of the run checks that it goes on after.
const MOVED_RUN: Duration = Duration::from_secs(8);

#[test]
fn ibv_rc_pingpong_under_rdmamig_run_keeps_its_connection_through_moves() {
    let bed = Testbed::new("preload-move").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let MoveGuests { peer, src, dst } =
        MoveGuests::start(&bed, "pm").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    // Polling, beside a copy not under rdmamig-run (released by the move's policy), then
    // back with completion events (the program sleeps in ibv_get_cq_event while the move
    // takes its channel away).
    let vm = moved_pingpong(&bed, &daemon, &peer, src, dst, "");
    let back = incoming(&bed, &vm, "pm-back");
    moved_pingpong(&bed, &daemon, &peer, vm, back, "-e");
}

/// Runs an ibv_rc_pingpong server on `peer` and its client on `src`, both under rdmamig-run
/// with `options`, moves `src` to `dst` in the middle, and checks that both completed every
/// exchange; returns the VM where it arrived. Polling, an unpreloaded copy runs beside it,
/// and the move, told `--unmanaged release`, must end that one and only that one.
fn moved_pingpong(
    bed: &Testbed,
    daemon: &Daemon,
    peer: &Guest,
    src: Guest,
    dst: Guest,
    options: &str,
) -> Guest {
    let round = if options.is_empty() { "poll" } else { "events" };
    // The rate here, so that the moved run lasts about MOVED_RUN whatever the machine.
    let (_, client) = pingpong(peer, &src, ITERS, options)
        .unwrap_or_else(|e| panic!("{round}: the rate's ping-pong: {}", error_chain(&*e)));
    let seconds: f64 = client
        .lines()
        .find_map(|l| l.split(" iters in ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{round}: no duration in:\n{client}"));
    let iters = ((f64::from(ITERS) / seconds.max(1e-3)) * MOVED_RUN.as_secs_f64()) as u32;
    let iters = iters.clamp(2 * ITERS, 2_000_000);
    eprintln!("{round}: {ITERS} iters in {seconds} s: the moved run does {iters}");

    let (server_log, client_log) = (format!("server-{round}"), format!("client-{round}"));
    let run =
        format!("RDMAMIG_PRELOAD_TRACE=1 rdmamig-run -- ibv_rc_pingpong -g 1 -n {iters} {options}");
    background(peer, &run, &server_log);
    wait_listening(peer, PINGPONG_PORT).unwrap();
    background(
        &src,
        &format!("{run} {}", peer.spec().address()),
        &client_log,
    );
    // Both registered, the QP in RTS: the ping-pong is under way.
    for (guest, log) in [(&src, &client_log), (peer, &server_log)] {
        wait_for_line(guest, log, "registered with the agent")
            .and_then(|_| wait_for_line(guest, log, "recorded at RTS"))
            .unwrap_or_else(|e| panic!("{log}: {e}"));
    }
    let unpreloaded = options.is_empty().then(|| unpreloaded_copy(peer, &src));
    std::thread::sleep(Duration::from_secs(2));

    let Moved {
        report,
        vm,
        client,
        server,
    } = move_mid_run(
        (bed, daemon, peer),
        (src, dst),
        &["--strategy", "reconnect", "--unmanaged", "release"],
        &format!("move-{round}"),
        (&client_log, &server_log),
    );
    // The preloaded program is managed; only the unpreloaded copy is not, and it was ended.
    let unmanaged: Vec<(u64, &str)> = report["unmanaged"]
        .as_array()
        .unwrap_or_else(|| panic!("{round}: no unmanaged list: {report:#}"))
        .iter()
        .map(|p| (p["pid"].as_u64().unwrap(), p["fate"].as_str().unwrap()))
        .collect();
    let expected: Vec<(u64, &str)> = unpreloaded.iter().map(|pid| (*pid, "ended")).collect();
    assert_eq!(unmanaged, expected, "{round}: {report:#}");
    for (log, out) in [(&client_log, &client), (&server_log, &server)] {
        assert!(
            out.contains(&format!("{iters} iters in")) && out.trim_end().ends_with("status 0"),
            "{log} did not complete every exchange:\n{out}"
        );
    }
    for line in [
        "paused with its peer",
        "released the device",
        "rebuilt as real qp",
    ] {
        assert!(
            client.contains(line),
            "{client_log}: no {line:?}:\n{client}"
        );
    }
    for line in ["Pause", "Reconnect"] {
        assert!(
            server
                .lines()
                .any(|l| l.contains(line) && l.contains(": Ok(())")),
            "{server_log}: no {line} done:\n{server}"
        );
    }
    vm
}

/// rping under rdmamig-run, traced, with data verification (`-V`).
const RPING: &str = "RDMAMIG_PRELOAD_TRACE=1 rdmamig-run -- rping -V";

/// A destination QEMU for `vm`'s next move, named `name`.
fn incoming(bed: &Testbed, vm: &Guest, name: &str) -> Guest {
    bed.start_incoming(bed.incoming_spec(vm.spec(), name).unwrap())
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)))
}

/// rping's iterations for measuring its rate before the moved run.
const RPING_RATE_COUNT: u32 = 200;

#[test]
fn rdma_cm_programs_under_rdmamig_run_keep_their_connections_through_moves() {
    let bed = Testbed::new("preload-cm").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let daemon = Daemon::start(bed.dir()).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let MoveGuests { peer, src, dst } =
        MoveGuests::start(&bed, "pc").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let (vm, pings) = moved_rping(&bed, &daemon, &peer, src, dst);
    let mut vm = Some(vm);
    for (round, tool) in ["ib_send_bw", "ib_write_bw"].into_iter().enumerate() {
        let here = vm.take().unwrap();
        let there = incoming(&bed, &here, &format!("pc-{round}"));
        vm = Some(moved_perftest(&bed, &daemon, &peer, here, there, tool));
    }
    let vm = vm.unwrap();
    a_listener_refuses_the_move(&bed, &daemon, &peer, &vm, pings);
    a_server_listening_on_any_address_moves(&bed, &daemon, &peer, vm, pings);
}

/// A persistent rping server in the moving VM listening on any address, its client on the
/// peer: the kernel keeps such a listener on every device, so the program is carried. The
/// connection lives through the move (the server's QP is the one rebuilt, and the client's
/// walked to it), and a new client connects to the server after it.
fn a_server_listening_on_any_address_moves(
    bed: &Testbed,
    daemon: &Daemon,
    peer: &Guest,
    vm: Guest,
    pings: u32,
) {
    let there = incoming(bed, &vm, "pc-any");
    let address = vm.spec().address().to_owned();
    // -P: a thread per connection, and no end; no -a: bound to any address.
    background(&vm, &format!("{RPING} -s -P"), "any-server");
    wait_rdma_listening(&vm);
    let client = |count: u32| format!("{RPING} -c -C {count} -a {address}");
    background(peer, &client(pings), "any-client");
    wait_for_line(&vm, "any-server", "recorded at RTS").unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_secs(2));
    let (out, report) = run_move(
        daemon.socket(),
        bed.dir(),
        (&vm, &there),
        &["--strategy", "reconnect"],
        "move-any",
    );
    vm.kill();
    there.reattach_console().unwrap();
    let moved_client = finished(peer, "any-client");
    let after = peer.run(&client(20), COMMAND).unwrap();
    let _ = there.run("kill $(pidof rping)", STEP_TIMEOUT);
    let server = finished(&there, "any-server");
    eprintln!(
        "----- any-address server -----\n{server}\n----- its client through the move -----\n\
         {moved_client}\n----- a client after the move -----\n{}",
        after.output
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "the move did not complete: {report:#}"
    );
    assert!(
        moved_client.trim_end().ends_with("status 0"),
        "the client through the move did not end well:\n{moved_client}"
    );
    assert_eq!(
        after.status, 0,
        "a client after the move did not get through:\n{}",
        after.output
    );
    assert!(
        server.contains("released the device") && server.contains("rebuilt as real qp"),
        "the server was not moved:\n{server}"
    );
    for error in ["data mismatch", "error", "failed", "removal"] {
        assert!(
            !server
                .lines()
                .filter(|l| !l.starts_with("rdmamig-preload"))
                .any(|l| l.contains(error)),
            "the server says {error:?}:\n{server}"
        );
    }
}

/// An rping server in the moving VM, with its client on the peer: its listening id cannot
/// be carried, so its library tells the agent, the program counts as unmanaged, and the
/// move (the default policy: refuse) is refused at prepare, naming it, before anything
/// changes; the rping pair goes on to the end untouched.
fn a_listener_refuses_the_move(
    bed: &Testbed,
    daemon: &Daemon,
    peer: &Guest,
    vm: &Guest,
    pings: u32,
) {
    let there = incoming(bed, vm, "pc-listener");
    let address = vm.spec().address().to_owned();
    background(vm, &format!("{RPING} -s -a {address}"), "listener-server");
    wait_rdma_listening(vm);
    background(
        peer,
        &format!("{RPING} -c -C {pings} -a {address}"),
        "listener-client",
    );
    wait_for_line(vm, "listener-server", "recorded at RTS")
        .and_then(|_| wait_for_line(vm, "listener-server", "an rdma_cm id listens"))
        .unwrap_or_else(|e| panic!("{e}"));
    let pid = vm.run_ok("pidof rping", STEP_TIMEOUT).unwrap();
    let pid = pid.trim();
    let (out, report) = run_move(
        daemon.socket(),
        bed.dir(),
        (vm, &there),
        &["--strategy", "reconnect"],
        "move-listener",
    );
    there.kill();
    let server = finished(vm, "listener-server");
    let client = finished(peer, "listener-client");
    eprintln!("----- listener server -----\n{server}\n----- listener client -----\n{client}");
    assert_eq!(out.status.code(), Some(4), "not refused: {report:#}");
    assert_eq!(report["failed_phase"], "prepare", "{report:#}");
    let error = report["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&format!("PID {pid} (rping -V -s")),
        "the refusal does not name the rping server (PID {pid}): {error}"
    );
    for (log, out) in [("listener server", &server), ("listener client", &client)] {
        assert!(
            out.trim_end().ends_with("status 0"),
            "{log} did not end well after the refused move:\n{out}"
        );
    }
}

/// perftest over rdma_cm, as it runs by default with `-R` (its banner says "ibv_wr* API:
/// OFF": it posts with ibv_post_send), one send in 64 signaled (`-Q`, moderation as on
/// hardware: a pause that comes while perftest posts finds the last send unsignaled, and
/// needs the library's fence).
const PERFTEST_OPTIONS: &str = "-R -F -Q 64";
/// perftest's iterations for measuring its rate before the moved run.
const PERFTEST_RATE_ITERS: u32 = 500;

/// Runs `tool` (ib_send_bw or ib_write_bw) over rdma_cm, its server on `peer` and its client
/// on `src`, both under rdmamig-run, moves `src` to `dst` in the middle (perftest signals
/// one send in a hundred, so the pause needs a fence), and checks that both ends completed
/// every iteration and exited 0; returns the VM where it arrived.
fn moved_perftest(
    bed: &Testbed,
    daemon: &Daemon,
    peer: &Guest,
    src: Guest,
    dst: Guest,
    tool: &str,
) -> Guest {
    let run = |iters: u32, server: Option<&str>| {
        format!(
            "RDMAMIG_PRELOAD_TRACE=1 rdmamig-run -- {tool} {PERFTEST_OPTIONS} -n {iters} {}",
            server.unwrap_or("")
        )
    };
    let address = peer.spec().address().to_owned();
    let (server_log, client_log) = (format!("{tool}-server"), format!("{tool}-client"));
    // The rate here, so that the moved run lasts about MOVED_RUN whatever the machine.
    background(peer, &run(PERFTEST_RATE_ITERS, None), &server_log);
    wait_rdma_listening(peer);
    let started = std::time::Instant::now();
    let timed = src
        .run(&run(PERFTEST_RATE_ITERS, Some(&address)), COMMAND)
        .unwrap();
    let seconds = started.elapsed().as_secs_f64();
    if timed.status != 0 {
        let _ = peer.run(&format!("kill $(pidof {tool})"), STEP_TIMEOUT);
    }
    let server = finished(peer, &server_log);
    assert!(
        timed.status == 0 && server.trim_end().ends_with("status 0"),
        "{tool}: the rate's run failed ({}): {}\nserver:\n{server}",
        timed.status,
        timed.output
    );
    let iters =
        (f64::from(PERFTEST_RATE_ITERS) / seconds.max(1e-3) * MOVED_RUN.as_secs_f64()) as u32;
    let iters = iters.clamp(4 * PERFTEST_RATE_ITERS, 10_000_000);
    eprintln!(
        "{tool}: {PERFTEST_RATE_ITERS} iterations in {seconds:.1} s: the moved run does {iters}"
    );

    background(peer, &run(iters, None), &server_log);
    wait_rdma_listening(peer);
    background(&src, &run(iters, Some(&address)), &client_log);
    wait_for_line(&src, &client_log, "recorded at RTS").unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_secs(2));
    let Moved {
        vm, client, server, ..
    } = move_mid_run(
        (bed, daemon, peer),
        (src, dst),
        &["--strategy", "reconnect"],
        &format!("move-{tool}"),
        (&client_log, &server_log),
    );
    for (log, out) in [(&client_log, &client), (&server_log, &server)] {
        assert!(
            out.trim_end().ends_with("status 0"),
            "{log} did not end well:\n{out}"
        );
        // perftest's result line: bytes, then the iterations completed.
        let completed = out.lines().any(|l| {
            let mut fields = l.split_whitespace();
            fields.next().is_some_and(|b| b.parse::<u64>().is_ok())
                && fields.next() == Some(iters.to_string().as_str())
        });
        assert!(
            completed,
            "{log}: no result line for {iters} iterations:\n{out}"
        );
    }
    assert!(
        client.contains("released the device") && client.contains("rebuilt as real qp"),
        "{client_log}: not moved:\n{client}"
    );
    vm
}

/// Runs an rping server on `peer` and its client on `src` (rdma_cm; data verified, `-V`;
/// RDMA READ and WRITE with rkeys sent in band), both under rdmamig-run, moves `src` to
/// `dst` in the middle, and checks that both ended with status 0 and no error; returns the
/// VM where it arrived, and the pings that last about [`MOVED_RUN`].
fn moved_rping(
    bed: &Testbed,
    daemon: &Daemon,
    peer: &Guest,
    src: Guest,
    dst: Guest,
) -> (Guest, u32) {
    let server_run = format!("{RPING} -s -a {}", peer.spec().address());
    let client_run = |count: u32| format!("{RPING} -c -C {count} -a {}", peer.spec().address());
    // The rate here, so that the moved run lasts about MOVED_RUN whatever the machine.
    background(peer, &server_run, "rping-rate-server");
    wait_rdma_listening(peer);
    let started = std::time::Instant::now();
    let timed = src.run(&client_run(RPING_RATE_COUNT), COMMAND).unwrap();
    let millis = started.elapsed().as_secs_f64() * 1000.0;
    if timed.status != 0 {
        let _ = peer.run("kill $(pidof rping)", STEP_TIMEOUT);
    }
    let server = finished(peer, "rping-rate-server");
    assert!(
        timed.status == 0 && server.trim_end().ends_with("status 0"),
        "the rate's rping failed ({}): {}\nserver:\n{server}",
        timed.status,
        timed.output
    );
    let count = (f64::from(RPING_RATE_COUNT) / (millis / 1000.0).max(1e-3)
        * MOVED_RUN.as_secs_f64()) as u32;
    let count = count.clamp(2 * RPING_RATE_COUNT, 1_000_000);
    eprintln!("rping: {RPING_RATE_COUNT} pings in {millis} ms: the moved run does {count}");

    background(peer, &server_run, "rping-server");
    wait_rdma_listening(peer);
    background(&src, &client_run(count), "rping-client");
    for (guest, log) in [(&src, "rping-client"), (peer, "rping-server")] {
        wait_for_line(guest, log, "registered with the agent")
            .and_then(|_| wait_for_line(guest, log, "recorded at RTS"))
            .unwrap_or_else(|e| panic!("{log}: {e}"));
    }
    std::thread::sleep(Duration::from_secs(2));
    let Moved {
        vm, client, server, ..
    } = move_mid_run(
        (bed, daemon, peer),
        (src, dst),
        &["--strategy", "reconnect"],
        "move-rping",
        ("rping-client", "rping-server"),
    );
    for (log, out) in [("rping client", &client), ("rping server", &server)] {
        assert!(
            out.trim_end().ends_with("status 0"),
            "{log} did not end well:\n{out}"
        );
        for error in ["data mismatch", "error", "failed", "removal"] {
            assert!(
                !out.lines()
                    .filter(|l| !l.starts_with("rdmamig-preload"))
                    .any(|l| l.contains(error)),
                "{log} says {error:?}:\n{out}"
            );
        }
    }
    assert!(
        client.contains("released the device") && client.contains("rebuilt as real qp"),
        "rping client: not moved:\n{client}"
    );
    assert!(
        client.contains("held back: a move caused it"),
        "rping client: the move's DEVICE_REMOVAL was not held back:\n{client}"
    );
    assert!(
        server.contains("its peer disconnected: DISCONNECTED"),
        "rping server: no DISCONNECTED from its peer's library:\n{server}"
    );
    (vm, count)
}

/// Waits (30 s at most) until an rdma_cm id in `guest` listens.
fn wait_rdma_listening(guest: &Guest) {
    let out = guest
        .run(
            "i=0; until rdma resource show cm_id 2>/dev/null | grep -q LISTEN; do \
               i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done",
            STEP_TIMEOUT,
        )
        .unwrap();
    assert_eq!(out.status, 0, "no rdma_cm listener in 30 s: {}", out.output);
}

/// What a move in the middle of a client's run gave.
struct Moved {
    /// The move's report.
    report: serde_json::Value,
    /// The VM where it arrived.
    vm: Guest,
    /// The client's output (in the VM that moved) and status, once it ended.
    client: String,
    /// The server's output (on the peer) and status, once it ended.
    server: String,
}

/// Moves `src` to `dst` with `args` (the report named `name`) while a client runs there and
/// its server on the peer, waits for both to end (their logs `logs`: client, server), and
/// checks that the move completed.
fn move_mid_run(
    (bed, daemon, peer): (&Testbed, &Daemon, &Guest),
    (src, dst): (Guest, Guest),
    args: &[&str],
    name: &str,
    (client_log, server_log): (&str, &str),
) -> Moved {
    let (out, report) = run_move(daemon.socket(), bed.dir(), (&src, &dst), args, name);
    src.kill();
    dst.reattach_console().unwrap();
    let client = finished(&dst, client_log);
    let server = finished(peer, server_log);
    eprintln!("----- {client_log} -----\n{client}\n----- {server_log} -----\n{server}");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{name}: the move did not complete: {report:#}"
    );
    Moved {
        report,
        vm: dst,
        client,
        server,
    }
}

/// The port of the unpreloaded copy's server.
const UNPRELOADED_PORT: u16 = 18516;

/// Starts an ibv_rc_pingpong pair not under rdmamig-run, its server on `peer` and its
/// client in `vm`, with no end; returns the client's PID once it has its device open.
fn unpreloaded_copy(peer: &Guest, vm: &Guest) -> u64 {
    let run = format!("ibv_rc_pingpong -g 1 -p {UNPRELOADED_PORT} -n 1000000000");
    peer.run_ok(
        &format!("{run} >/tmp/pp-plain-server.log 2>&1 &"),
        STEP_TIMEOUT,
    )
    .unwrap();
    wait_listening(peer, UNPRELOADED_PORT).unwrap();
    let out = vm
        .run_ok(
            &format!(
                "{run} {} >/tmp/pp-plain-client.log 2>&1 & pid=$!; echo pid $pid; \
                 i=0; until ls -l /proc/$pid/fd 2>/dev/null | grep -q /dev/infiniband; do \
                   kill -0 $pid || exit 1; i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.05; done",
                peer.spec().address()
            ),
            STEP_TIMEOUT,
        )
        .unwrap_or_else(|e| panic!("the unpreloaded copy did not start: {e}"));
    out.lines()
        .find_map(|l| l.trim().strip_prefix("pid "))
        .and_then(|pid| pid.trim().parse().ok())
        .unwrap_or_else(|| panic!("no PID for the unpreloaded copy: {out}"))
}

/// Runs `command` in the background in `guest`, its output in `/tmp/pp-<log>.log` and its
/// status in `/tmp/pp-<log>.status`.
fn background(guest: &Guest, command: &str, log: &str) {
    guest
        .run_ok(
            &format!(
                "rm -f /tmp/pp-{log}.status; \
                 ({command} >/tmp/pp-{log}.log 2>&1; echo $? >/tmp/pp-{log}.status) &"
            ),
            STEP_TIMEOUT,
        )
        .unwrap();
}

/// Waits (30 s at most) until `/tmp/pp-<log>.log` in `guest` has a line with `text`.
fn wait_for_line(guest: &Guest, log: &str, text: &str) -> Result<(), String> {
    let out = guest
        .run(
            &format!(
                "i=0; until grep -q '{text}' /tmp/pp-{log}.log; do \
                   i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done"
            ),
            STEP_TIMEOUT,
        )
        .map_err(|e| e.to_string())?;
    if out.status == 0 {
        return Ok(());
    }
    let log = guest.run(&format!("cat /tmp/pp-{log}.log"), STEP_TIMEOUT);
    Err(format!("no {text:?} in 30 s: {log:?}"))
}

/// Waits (5 minutes at most) until `/tmp/pp-<log>` in `guest` has ended; returns its output
/// and `status N`.
fn finished(guest: &Guest, log: &str) -> String {
    let out = guest
        .run(
            &format!(
                "i=0; until [ -f /tmp/pp-{log}.status ]; do i=$((i+1)); [ $i -gt 3000 ] && break; \
                   sleep 0.1; done; cat /tmp/pp-{log}.log; echo status $(cat /tmp/pp-{log}.status)"
            ),
            Duration::from_secs(330),
        )
        .unwrap();
    out.output
}
