//! Unmodified programs under `rdmamig-run`, on the test bed: Debian's own `ibv_rc_pingpong`
//! (raw verbs, QP numbers exchanged over TCP) runs between two guests over Soft-RoCE with
//! librdmamig_preload.so on both ends. Every verbs object it holds is one of the library's
//! virtual objects (`RDMAMIG_PRELOAD_TRACE` names each), and its data path (post, poll,
//! completion events) goes through the virtual context's ops table. The library's record of
//! the QP (what a rebuild will need) holds what the program set up. A verb the library
//! does not carry fails at the call.
//!
//! The move of such a program (quiesce, rebuild, resume) is not here yet: docs/preload.md.
//!
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::Duration;

use rdmamig_testbed::steps::wait_listening;
use rdmamig_testbed::{error_chain, Guest, Testbed};

const COMMAND: Duration = Duration::from_secs(120);
/// ibv_rc_pingpong's TCP port.
const PINGPONG_PORT: u16 = 18515;
const ITERS: u32 = 500;

#[test]
fn ibv_rc_pingpong_runs_on_virtual_verbs_objects_with_and_without_completion_events() {
    let bed = Testbed::new("preload").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let (a, b) = two_guests(&bed);
    for (options, channel) in [("", false), ("-e", true)] {
        let (server, client) = pingpong(&a, &b, options)
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

#[test]
fn a_verb_the_library_does_not_carry_fails_at_the_call() {
    let bed = Testbed::new("preload-no").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let (a, _b) = two_guests(&bed);
    // --new_send creates its QP with ibv_create_qp_ex and posts with ibv_wr_*: extended
    // verbs, which find no ops in a virtual context.
    let out = a
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
/// `options`; returns each one's output once both ended with status 0.
fn pingpong(
    a: &Guest,
    b: &Guest,
    options: &str,
) -> Result<(String, String), Box<dyn std::error::Error>> {
    let run =
        format!("RDMAMIG_PRELOAD_TRACE=1 rdmamig-run -- ibv_rc_pingpong -g 1 -n {ITERS} {options}");
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
