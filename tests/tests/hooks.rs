//! End-to-end: the workflow entry points (`rdmamig-vmm`) drive a coordinated move on the test
//! bed while RDMA traffic runs both ways.
//!
//! - Hooks: `rdmamig-vmm pre-migrate` on the source (quiesce, unplug), then the workflow's
//!   own migration (here plain QMP `migrate-incoming` + `migrate`, as libvirt would issue),
//!   then `rdmamig-vmm post-migrate` on the destination (plug, resume): one move, with a
//!   journal and a report like a daemon's move. A post-migrate whose attach fails rolls the
//!   move back to the source, traffic and all.
//! - Wrapper: `rdmamig-vmm migrate <destination_url>` in place of
//!   `ch-remote send-migration <destination_url>`, through the rdmamig daemon.
//!
//! Both run strategy `bridge` (traffic with a TCP bridge on the permanent NICs;
//! `pre-migrate --bridge`, `migrate --strategy bridge`): either way nothing may be lost,
//! duplicated or reordered, neither side may see an error, and both sides must have carried
//! messages over the bridge while the NIC was away. Needs root, /dev/net/tun, qemu-system-x86_64 and the workspace's binaries
//! (scripts/setup.sh builds them); fails (never skips) without them.

use std::process::Command;
use std::time::{Duration, Instant};

use rdmamig_testbed::scenario::Daemon;
use rdmamig_testbed::steps::{self, MoveGuests, StepResult};
use rdmamig_testbed::{bin_dir, error_chain, Guest, Testbed};
use serde_json::{json, Value};

const PORT: u16 = 7481;
const RATE: u32 = 200;
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `rdmamig-vmm <args>`; returns its exit code and the JSON line it printed.
fn rdmamig_vmm(args: &[String]) -> StepResult<(i32, Value, String)> {
    let program = bin_dir().join("rdmamig-vmm");
    if !program.exists() {
        return Err(format!(
            "{} is missing: build the workspace's binaries (scripts/setup.sh)",
            program.display()
        )
        .into());
    }
    let output = Command::new(&program).args(args).output()?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let report = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str::<Value>(line).ok())
        .unwrap_or(Value::Null);
    Ok((output.status.code().unwrap_or(-1), report, stdout + &stderr))
}

/// The hooks' state directory of a test bed: where a hooks move's journal and report go.
fn state_dir(bed: &Testbed) -> String {
    bed.dir().join("hooks").display().to_string()
}

fn vmm_args(guest: &Guest) -> Vec<String> {
    vec![
        "--qmp".into(),
        guest.qmp_socket().display().to_string(),
        "--agent".into(),
        guest.agent_socket().display().to_string(),
    ]
}

fn nic(guest: &Guest) -> String {
    format!(
        "driver=virtio-net-pci,id=nic0,netdev=nd0,bus=rp1,mac={}",
        guest.spec().mac
    )
}

/// The workflow's own migration: what libvirt or an operator does between the hooks.
fn workflow_migrates(src: &Guest, dst: &Guest) -> StepResult<Duration> {
    let uri = format!("unix:{}", dst.migration_socket_path().display());
    dst.qmp()?
        .execute("migrate-incoming", json!({ "uri": uri }))?;
    let mut qmp = src.qmp()?;
    let started = Instant::now();
    qmp.execute("migrate", json!({ "uri": uri }))?;
    loop {
        let status = qmp.execute("query-migrate", json!({}))?;
        match status["status"].as_str() {
            Some("completed") => return Ok(started.elapsed()),
            Some("failed" | "cancelled") => return Err(format!("migration: {status}").into()),
            _ if started.elapsed() > MIGRATION_TIMEOUT => {
                return Err(format!("migration not done in {MIGRATION_TIMEOUT:?}: {status}").into())
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Boots a peer and a source with traffic both ways and a destination, runs `move_vm`,
/// then checks the traffic on the destination and the peer.
/// Starts bridged traffic between a peer and a source VM, moves the source with `move_vm`,
/// and checks the traffic: clean both ways, and carried over the bridge by both sides.
fn run(
    name: &str,
    move_vm: impl FnOnce(&Testbed, &Guest, &Guest) -> StepResult<()>,
) -> StepResult<()> {
    let bed = Testbed::new(name)?;
    let g = MoveGuests::start(&bed, name)?;
    let result = (|| {
        let bridge = format!("{}:{}", g.peer.spec().permanent_address(), steps::FLOW_PORT);
        g.start_flow(
            "h",
            &format!("--mode migratable --rate {RATE} --bridge {bridge}"),
        )?;
        std::thread::sleep(Duration::from_secs(2));

        move_vm(&bed, &g.src, &g.dst)?;
        g.src.kill();
        g.dst.reattach_console()?;
        std::thread::sleep(Duration::from_secs(3));
        steps::stop_traffic(&g.dst, "h")?;
        steps::stop_traffic(&g.peer, "h")?;
        let moved = steps::collect_report(&g.dst, "h")?;
        let peer_report = steps::collect_report(&g.peer, "h")?;
        eprintln!("peer received: {peer_report:?}\nmoved VM received: {moved:?}");
        steps::assert_clean("peer", &peer_report, &moved);
        steps::assert_clean("moved VM", &moved, &peer_report);
        assert!(
            moved.bridged > 0 && peer_report.bridged > 0,
            "nothing went over the bridge: moved VM sent {}, peer sent {}",
            moved.bridged,
            peer_report.bridged
        );
        Ok(())
    })();
    if result.is_err() {
        steps::dump_logs(&g.peer);
        steps::dump_logs(&g.dst);
    }
    result
}

#[test]
fn hooks_around_the_workflows_migration_keep_every_message() {
    let outcome = run("hooks", |bed, src, dst| {
        let mut pre = vmm_args(src);
        pre.extend([
            "pre-migrate".into(),
            "--detach".into(),
            "nic0".into(),
            "--bridge".into(),
            "--state-dir".into(),
            state_dir(bed),
        ]);
        let (code, report, output) = rdmamig_vmm(&pre)?;
        eprintln!("pre-migrate: {output}");
        assert_eq!(code, 0, "pre-migrate failed: {output}");
        assert_eq!(report["ok"], true);
        assert!(report["connections"].as_u64() >= Some(1), "{report}");
        assert_eq!(report["quiesced"], report["connections"], "{report}");
        let id = report["move"].as_str().unwrap_or_default().to_string();
        let journal = report["journal"].as_str().unwrap_or_default().to_string();
        assert!(!id.is_empty() && !journal.is_empty(), "{report}");

        let migration = workflow_migrates(src, dst)?;
        eprintln!("workflow migration: {migration:?}");

        let mut post = vmm_args(dst);
        post.extend([
            "post-migrate".into(),
            "--attach".into(),
            nic(dst),
            "--state-dir".into(),
            state_dir(bed),
        ]);
        let (code, report, output) = rdmamig_vmm(&post)?;
        eprintln!("post-migrate: {output}");
        assert_eq!(code, 0, "post-migrate failed: {output}");
        assert_eq!(report["resumed"], report["connections"], "{report}");
        assert_eq!(report["bdf"], "0000:01:00.0", "{report}");
        assert_eq!(
            report["move"],
            id.as_str(),
            "post-migrate went on with another move"
        );
        assert_journaled_and_reported(&journal, &report, "done")?;
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{}", error_chain(&*e));
    }
}

/// Checks a hooks move's journal and report, as a daemon move's are checked: the journal
/// ends with the move's end, and the report holds the whole move (every working phase, in
/// order, from both hooks) and ended in `final_phase`.
fn assert_journaled_and_reported(journal: &str, line: &Value, final_phase: &str) -> StepResult<()> {
    let text = std::fs::read_to_string(journal)?;
    let records: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(records[0]["record"], "begin", "{text}");
    let last = records.last().cloned().unwrap_or_default();
    assert_eq!(last["record"], "end", "{text}");
    assert_eq!(last["phase"], final_phase, "{text}");
    for record in ["handed_over", "arrived", "migrated"] {
        assert!(
            records.iter().any(|r| r["record"] == record),
            "no {record} record in the journal:\n{text}"
        );
    }
    let path = line["report"].as_str().unwrap_or_default();
    let report: Value = serde_json::from_slice(&std::fs::read(path)?)?;
    assert_eq!(report["final_phase"], final_phase, "{report}");
    let phases: Vec<&str> = report["timeline"]["phases"]
        .as_array()
        .map(|phases| phases.iter().filter_map(|p| p["phase"].as_str()).collect())
        .unwrap_or_default();
    let working = ["prepare", "quiesce", "detach", "migrate", "attach"];
    assert_eq!(&phases[..working.len()], &working, "{report}");
    Ok(())
}

#[test]
fn a_post_migrate_hook_whose_attach_fails_rolls_the_move_back() {
    let bed = Testbed::new("hookback").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let outcome = (|| -> StepResult<()> {
        let g = MoveGuests::start(&bed, "back")?;
        g.start_flow("h", &format!("--mode migratable --rate {RATE}"))?;
        let (peer, src, dst) = (&g.peer, &g.src, &g.dst);
        std::thread::sleep(Duration::from_secs(2));

        let mut pre = vmm_args(src);
        pre.extend([
            "pre-migrate".into(),
            "--detach".into(),
            "nic0".into(),
            "--reattach".into(),
            nic(src),
            "--state-dir".into(),
            state_dir(&bed),
        ]);
        let (code, report, output) = rdmamig_vmm(&pre)?;
        eprintln!("pre-migrate: {output}");
        assert_eq!(code, 0, "pre-migrate failed: {output}");
        let journal = report["journal"].as_str().unwrap_or_default().to_string();
        workflow_migrates(src, dst)?;
        // The destination has no backend of that name: QEMU refuses the device_add.
        let mut post = vmm_args(dst);
        post.extend([
            "post-migrate".into(),
            "--attach".into(),
            "driver=virtio-net-pci,id=nic0,netdev=no-such-netdev,bus=rp1".into(),
            "--state-dir".into(),
            state_dir(&bed),
        ]);
        let (code, report, output) = rdmamig_vmm(&post)?;
        eprintln!("post-migrate with a NIC the destination cannot plug: {output}");
        assert_eq!(code, 1, "{output}");
        assert_eq!(report["ok"], false, "{report}");
        assert_eq!(report["failed_phase"], "attach", "{report}");
        assert_eq!(report["phase"], "rolled_back", "{report}");
        assert_eq!(report["vm_location"], "source", "{report}");
        assert_eq!(report["resumed"], report["connections"], "{report}");
        assert_journaled_and_reported(&journal, &report, "rolled_back")?;
        // The VM runs on the source again, with its NIC, and its traffic went on there.
        let status = src.qmp()?.execute("query-status", json!({}))?;
        assert_eq!(status["status"], "running", "{status}");
        std::thread::sleep(Duration::from_secs(3));
        steps::stop_traffic(src, "h")?;
        steps::stop_traffic(peer, "h")?;
        let back = steps::collect_report(src, "h")?;
        let peer_report = steps::collect_report(peer, "h")?;
        eprintln!("peer received: {peer_report:?}\nrolled-back VM received: {back:?}");
        steps::assert_clean("peer", &peer_report, &back);
        steps::assert_clean("rolled-back VM", &back, &peer_report);
        Ok(())
    })();
    if let Err(e) = outcome {
        panic!("{}", error_chain(&*e));
    }
}

#[test]
fn a_pre_migrate_hook_that_cannot_unplug_fails_and_says_why() {
    let bed = Testbed::new("hookfail").unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let outcome = (|| -> StepResult<()> {
        let peer_spec = bed.guest_spec("peer")?;
        let src = bed.start_guest(bed.guest_spec("src")?)?;
        let peer = bed.start_guest(peer_spec.clone())?;
        let server = format!("{}:{PORT}", peer_spec.address());
        let mode = format!("--mode migratable --rate {RATE}");
        steps::start_traffic(&peer, "h", &format!("serve --listen {server} {mode}"))?;
        steps::start_traffic(&src, "h", &format!("connect --to {server} {mode}"))?;
        steps::wait_ready(&peer, "h", 1)?;
        steps::wait_ready(&src, "h", 1)?;
        // A raw verbs user the agent does not know holds the NIC. By default the hook
        // refuses, naming it, before anything changes.
        let holder = steps::start_holder(&src)?;
        let mut pre = vmm_args(&src);
        pre.extend([
            "pre-migrate".into(),
            "--detach".into(),
            "nic0".into(),
            "--reattach".into(),
            nic(&src),
            "--deadline".into(),
            "detach=2000".into(),
            "--deadline".into(),
            "rollback=5000".into(),
            "--state-dir".into(),
            state_dir(&bed),
        ]);
        let (code, report, output) = rdmamig_vmm(&pre)?;
        eprintln!("pre-migrate with an unmanaged program: {output}");
        assert_eq!(code, 1, "{output}");
        let error = report["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(&format!("PID {holder} (ibv_rc_pingpong"))
                && error.contains("Nothing was changed"),
            "{report}"
        );
        assert_eq!(report["unmanaged"][0]["pid"], holder, "{report}");
        let links = src.run_ok("rdma link show", steps::STEP_TIMEOUT)?;
        assert!(links.contains("ACTIVE"), "the NIC was touched: {links}");
        src.run_ok(&format!("kill -0 {holder}"), steps::STEP_TIMEOUT)?;
        // With ignore, the hook unplugs, and the unplug cannot complete.
        pre.extend(["--unmanaged".into(), "ignore".into()]);
        let (code, report, output) = rdmamig_vmm(&pre)?;
        eprintln!("pre-migrate with a held NIC: {output}");
        assert_eq!(code, 1, "{output}");
        assert_eq!(report["ok"], false);
        assert!(
            report["error"]
                .as_str()
                .is_some_and(|e| e.contains("did not release device nic0")),
            "{report}"
        );
        // Measured: the guest had begun removing the NIC (`unregister_netdevice: waiting
        // for eth0`) and cannot finish while the holder runs, so the rollback can neither
        // plug the NIC again nor resume on it; the hook says so instead of claiming the VM
        // is as it was.
        assert_eq!(report["phase"], "failed", "{report}");
        assert!(
            report["rollback_error"]
                .as_str()
                .is_some_and(|e| e.contains("has not finished removing device nic0")),
            "{report}"
        );
        // Once the holder exits, the pending unplug completes without a new request.
        src.run_ok("kill $(cat /run/holder.pid)", steps::STEP_TIMEOUT)?;
        src.run_ok(
            "i=0; while [ -e /sys/class/net/eth0 ]; do i=$((i+1)); [ $i -gt 200 ] && exit 1; \
             sleep 0.05; done",
            steps::STEP_TIMEOUT,
        )?;
        Ok(())
    })();
    if let Err(e) = outcome {
        panic!("{}", error_chain(&*e));
    }
}

#[test]
fn the_migrate_wrapper_moves_through_the_daemon() {
    let outcome = run("wrapper", |bed, src, dst| {
        let daemon = Daemon::start(bed.dir())?;
        let report = bed.dir().join("wrapper-move.json");
        let mut args = vmm_args(src);
        args.extend([
            "migrate".into(),
            format!("unix:{}", dst.migration_socket_path().display()),
            "--migration-timeout-s".into(),
            "60".into(),
            "--strategy".into(),
            "bridge".into(),
            "--socket".into(),
            daemon.socket().display().to_string(),
            "--vm".into(),
            "src".into(),
            "--detach".into(),
            "nic0".into(),
            "--to-qmp".into(),
            dst.qmp_socket().display().to_string(),
            "--to-agent".into(),
            dst.agent_socket().display().to_string(),
            "--attach".into(),
            nic(dst),
            "--report".into(),
            report.display().to_string(),
        ]);
        let (code, _, output) = rdmamig_vmm(&args)?;
        eprintln!("rdmamig-vmm migrate:\n{output}");
        assert_eq!(code, 0, "the wrapped move failed:\n{output}");
        let report: Value = serde_json::from_slice(&std::fs::read(&report)?)?;
        assert_eq!(report["ok"], true, "{report}");
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{}", error_chain(&*e));
    }
}
