//! The migratable connection on the test bed: two guests exchange numbered messages both
//! ways with `rdmamig-traffic --mode migratable`, then
//! 1. a quiesce + resume without moving (driven through the agent protocol by
//!    `rdmamig-traffic ctl`, the same code path the agent uses), traffic continuing;
//! 2. a quiesce, a QMP `device_del` of guest b's NIC (which must complete at once: the
//!    library released every verbs context), a `device_add` of a new NIC, and a resume.
//!
//! Nothing may be lost, duplicated or reordered, and neither side may see an error.
//! Needs root, /dev/net/tun and qemu-system-x86_64; fails (never skips) without them.

use std::time::{Duration, Instant};

use rdmamig_testbed::{error_chain, GuestBinaries, Testbed};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);
const PORT: u16 = 7471;
const RATE: u32 = 200;
const AGENT_SOCKET: &str = "/run/rdmamig-test.sock";

#[test]
fn migratable_connection_survives_quiesce_unplug_plug_resume() {
    let tb = Testbed::builder("conn")
        .guest_binaries(GuestBinaries::Required)
        .build()
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    if let Err(e) = scenario(&tb) {
        panic!("{}", error_chain(&*e));
    }
}

fn ctl(guest: &rdmamig_testbed::Guest, op: &str) -> Result<Value, Box<dyn std::error::Error>> {
    let out = guest.run_ok(
        &format!("rdmamig-traffic ctl --socket {AGENT_SOCKET} --deadline-ms 8000 {op}"),
        T,
    )?;
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("ctl {op}: no JSON in {out:?}"))?;
    let v: Value = serde_json::from_str(line)?;
    let outcomes = &v["reply"]["body"]["outcomes"];
    if let Some(list) = outcomes.as_array() {
        for o in list {
            if o["ok"] != json!(true) {
                return Err(format!("ctl {op}: outcome not ok: {o}").into());
            }
        }
    }
    eprintln!("ctl {op} on {}: {v}", guest.name());
    Ok(v)
}

fn scenario(tb: &Testbed) -> Result<(), Box<dyn std::error::Error>> {
    let specs = [tb.guest_spec("a")?, tb.guest_spec("b")?];
    let b_spec = specs[1].clone();
    let [a, b] = std::thread::scope(|s| {
        specs
            .map(|spec| s.spawn(move || tb.start_guest(spec)))
            .map(|h| h.join().expect("boot thread"))
    });
    let (a, b) = (a?, b?);
    let result = traffic_phases(&a, &b, &b_spec);
    if result.is_err() {
        for g in [&a, &b] {
            if let Ok(out) = g.run("tail -n 60 /tmp/*.err /tmp/*.out", T) {
                eprintln!("---- guest {} logs:\n{}", g.name(), out.output);
            }
        }
    }
    result
}

fn traffic_phases(
    a: &rdmamig_testbed::Guest,
    b: &rdmamig_testbed::Guest,
    b_spec: &rdmamig_testbed::GuestSpec,
) -> Result<(), Box<dyn std::error::Error>> {
    let server = format!("{}:{PORT}", a.spec().address());
    let common = format!("--mode migratable --rate {RATE} --agent-socket {AGENT_SOCKET}");
    a.run_ok(
        &format!(
            "RDMAMIG_LOG=rdmamig_guest=debug,rdmamig_conn=debug,rdmamig_verbs=debug rdmamig-traffic serve --listen {server} {common} \
             --report /tmp/a.json --ready-file /tmp/a.ready >/tmp/a.out 2>/tmp/a.err &"
        ),
        T,
    )?;
    b.run_ok(
        &format!(
            "RDMAMIG_LOG=rdmamig_guest=debug,rdmamig_conn=debug,rdmamig_verbs=debug rdmamig-traffic connect --to {server} {common} \
             --report /tmp/b.json --ready-file /tmp/b.ready >/tmp/b.out 2>/tmp/b.err &"
        ),
        T,
    )?;
    for g in [a, b] {
        let f = if g.name() == "a" {
            "/tmp/a.ready"
        } else {
            "/tmp/b.ready"
        };
        g.run_ok(
            &format!("for i in $(seq 100); do [ -e {f} ] && exit 0; sleep 0.1; done; exit 1"),
            T,
        )?;
    }
    eprintln!("connected; traffic both ways at {RATE} msg/s");
    std::thread::sleep(Duration::from_secs(3));

    // 1. Quiesce and resume in place.
    let t0 = Instant::now();
    let q = ctl(b, "quiesce")?;
    let r = ctl(b, "resume")?;
    eprintln!(
        "in-place: quiesce {} ms, resume {} ms (wall incl. registration {:.2?})",
        q["elapsed_ms"],
        r["elapsed_ms"],
        t0.elapsed()
    );
    std::thread::sleep(Duration::from_secs(3));

    // 2. Quiesce, unplug, plug a new NIC, resume.
    let q = ctl(b, "quiesce")?;
    let fds = b.run("for p in /proc/[0-9]*; do for f in $p/fd/*; do l=$(readlink $f); case $l in *uverbs*|*rdma_cm*|anon_inode*) echo \"$p $(cat $p/comm) $l\";; esac; done; done", T)?;
    eprintln!("verbs descriptors after quiesce:\n{}", fds.output);
    let mut qmp = b.qmp()?;
    let unplug_started = Instant::now();
    qmp.execute("device_del", json!({ "id": "nic0" }))?;
    if let Err(e) = qmp.wait_event(
        "DEVICE_DELETED",
        |d| d["device"] == "nic0",
        Duration::from_secs(10),
    ) {
        let diag = b.run(
            "for p in /proc/[0-9]*; do for f in $p/fd/*; do echo \"$p $(cat $p/comm) $f $(readlink $f)\"; done; \
             grep -i -E 'uverbs|infiniband' $p/maps; done 2>/dev/null | grep -v -E 'console|ttyS0|null|pipe:|socket:'",
            T,
        )?;
        eprintln!("descriptors while the unplug hangs:\n{}", diag.output);
        return Err(e.into());
    }
    let unplug = unplug_started.elapsed();
    let plug_started = Instant::now();
    qmp.execute(
        "device_add",
        json!({ "driver": "virtio-net-pci", "netdev": "nd0", "id": "nic1", "bus": "rp1", "mac": b_spec.mac }),
    )?;
    drop(qmp);
    b.run_ok("rdmamig-netplug wait-active 10", T)?;
    let plug = plug_started.elapsed();
    let r = ctl(b, "resume")?;
    eprintln!(
        "move: quiesce {} ms; device_del -> DEVICE_DELETED {unplug:.2?}; device_add -> rxe ACTIVE {plug:.2?}; resume {} ms",
        q["elapsed_ms"], r["elapsed_ms"]
    );
    std::thread::sleep(Duration::from_secs(3));

    // Stop both at once, collect the reports.
    for g in [a, b] {
        g.run_ok("kill -TERM $(pidof rdmamig-traffic)", T)?;
    }
    let mut reports = Vec::new();
    for (g, f) in [(a, "/tmp/a.json"), (b, "/tmp/b.json")] {
        let out = g.run_ok(
            &format!("for i in $(seq 200); do [ -s {f} ] && break; sleep 0.1; done; cat {f}"),
            T,
        )?;
        let start = out
            .find('{')
            .ok_or_else(|| format!("{}: no report: {out}", g.name()))?;
        let v: Value = serde_json::from_str(&out[start..])?;
        eprintln!("report {}: {v}", g.name());
        reports.push(v);
    }
    let log = b.run_ok("tail -n 40 /tmp/b.err", T)?;
    eprintln!("b log tail:\n{log}");
    let (ra, rb) = (&reports[0], &reports[1]);
    for (name, r) in [("a", ra), ("b", rb)] {
        assert_eq!(r["lost"], json!(0), "{name} lost messages: {r}");
        assert_eq!(r["duplicated"], json!(0), "{name} got duplicates: {r}");
        assert_eq!(
            r["reordered"],
            json!(0),
            "{name} got reordered messages: {r}"
        );
        assert_eq!(r["errors"], json!([]), "{name} saw errors: {r}");
    }
    assert_eq!(ra["received"], rb["sent"], "a did not receive all b sent");
    assert_eq!(rb["received"], ra["sent"], "b did not receive all a sent");
    assert!(
        unplug < Duration::from_secs(3),
        "device_del took {unplug:?}"
    );
    assert!(rb["connections_established"].as_u64() >= Some(3), "b: {rb}");
    Ok(())
}
