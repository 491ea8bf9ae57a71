//! Steps the connection tests share: run `rdmamig-traffic` in a guest under a tag, drive its
//! library the way the agent does (`rdmamig-traffic ctl`), swap a guest's RDMA NIC over QMP,
//! and collect the traffic reports.
//!
//! Each traffic process gets files `/tmp/<tag>.{out,err,json,ready,pid}` in its guest, so
//! several can run side by side and a failed test can print their logs.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rdmamig_guest::traffic::Report;
use serde_json::{json, Value};

use crate::guest::Shell;
use crate::{bin_dir, Guest, Testbed, TestbedError};

/// Bound on every console command these steps run.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// [`STEP_TIMEOUT`] for `guest`, scaled by how much slower than a test-bed guest it runs.
fn step_timeout(guest: &dyn Shell) -> Duration {
    STEP_TIMEOUT * guest.pace()
}

/// The steps' error: what was being done, and what went wrong, as text for the test report.
pub type StepResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Starts `rdmamig-traffic <args>` in the background in `guest` under `tag`, with warnings
/// of the library logged to `/tmp/<tag>.err`.
pub fn start_traffic(guest: &dyn Shell, tag: &str, args: &str) -> StepResult<()> {
    guest.run_ok(
        &format!(
            "rm -f /tmp/{tag}.json /tmp/{tag}.ready; \
             RDMAMIG_LOG=rdmamig_guest=debug,rdmamig_conn=debug,rdmamig_verbs=debug rdmamig-traffic {args} --report /tmp/{tag}.json \
             --ready-file /tmp/{tag}.ready >/tmp/{tag}.out 2>/tmp/{tag}.err & echo $! >/tmp/{tag}.pid"
        ),
        step_timeout(guest),
    )?;
    Ok(())
}

/// How long a traffic process may take to connect its first connection (before the guest's
/// pace), and each further one: on a guest limited to 0.8 core 64 connections connected one
/// after another took 72-87 s where they took 4-10 s idle (2026-12-02). The traffic tool now
/// connects 8 at a time; the bound stays that of one after another.
const CONNECT_FIRST: u32 = 25;
const CONNECT_EACH: u32 = 5;

/// Waits until the traffic process `tag`, which has `connections` connections, has connected
/// them all (it creates its ready file). On a timeout or an exit, the error holds the end
/// of the process's log and of the kernel's (a process killed by a signal logs nothing).
pub fn wait_ready(guest: &dyn Shell, tag: &str, connections: u32) -> StepResult<()> {
    let within = (CONNECT_FIRST + CONNECT_EACH * connections.saturating_sub(1)) * guest.pace();
    let logs =
        format!("tail -n 40 /tmp/{tag}.err; echo '--- the kernel log ends:'; dmesg | tail -n 20");
    guest.run_ok(
        &format!(
            "end=$(($(date +%s) + {within})); while [ ! -e /tmp/{tag}.ready ]; do \
               kill -0 $(cat /tmp/{tag}.pid) 2>/dev/null || {{ echo 'the traffic tool exited; its log ends:'; {logs}; exit 1; }}; \
               [ $(date +%s) -ge $end ] && {{ echo 'not connected within {within} s; its log ends:'; {logs}; exit 1; }}; \
               sleep 0.05; done"
        ),
        // The guest's own clock bounds the loop; a guest that slow may lag the host's.
        Duration::from_secs(2 * u64::from(within)) + step_timeout(guest),
    )?;
    Ok(())
}

/// Asks the traffic process `tag` to stop (SIGINT): it flushes, lingers and writes its report.
pub fn stop_traffic(guest: &dyn Shell, tag: &str) -> StepResult<()> {
    guest.run_ok(
        &format!("kill -INT $(cat /tmp/{tag}.pid)"),
        step_timeout(guest),
    )?;
    Ok(())
}

/// Waits for and parses the report of the traffic process `tag`.
pub fn collect_report(guest: &dyn Shell, tag: &str) -> StepResult<Report> {
    collect_report_after_flush(guest, tag, Duration::ZERO)
}

/// [`collect_report`] for a process started with a `--flush-timeout-s` of `flush`: its
/// report may come that much later.
pub fn collect_report_after_flush(
    guest: &dyn Shell,
    tag: &str,
    flush: Duration,
) -> StepResult<Report> {
    let wait = Duration::from_secs(25 * u64::from(guest.pace())) + flush;
    let out = guest.run_ok(
        &format!(
            "end=$(($(date +%s) + {s})); while [ ! -s /tmp/{tag}.json ]; do \
               [ $(date +%s) -ge $end ] && {{ cat /tmp/{tag}.err; exit 1; }}; sleep 0.05; done; \
             cat /tmp/{tag}.json",
            s = wait.as_secs()
        ),
        step_timeout(guest) + wait,
    )?;
    let start = out
        .find('{')
        .ok_or_else(|| format!("{}: no report for {tag}: {out}", guest.name()))?;
    Ok(serde_json::from_str(&out[start..])?)
}

/// Writes the last 4,000 lines of the traffic process `tag`'s log in `guest` to `to` on the
/// host, without its per-message lines; a failure is printed, not returned (a debugging aid).
pub fn keep_traffic_log(guest: &dyn Shell, tag: &str, to: &Path) {
    let read = format!("grep -v -E 'sent|received' /tmp/{tag}.err | tail -n 4000");
    let kept = guest
        .run_ok(&read, step_timeout(guest))
        .map_err(|e| e.to_string())
        .and_then(|log| std::fs::write(to, log).map_err(|e| e.to_string()));
    if let Err(e) = kept {
        eprintln!(
            "{}: {tag}'s log was not kept in {}: {e}",
            guest.name(),
            to.display()
        );
    }
}

/// Prints the tail of every traffic log in `guest`, and where each thread of every traffic
/// process waits in the kernel (for a failing test: a hung unplug is a thread stuck on the
/// device).
pub fn dump_logs(guest: &dyn Shell) {
    let logs = "tail -n 40 /tmp/*.err /tmp/*.out /run/agent.log";
    if let Ok(out) = guest.run(logs, step_timeout(guest)) {
        eprintln!(
            "---- guest {} traffic and agent logs:\n{}",
            guest.name(),
            out.output
        );
    }
    let threads = "for p in $(pidof rdmamig-traffic); do for t in /proc/$p/task/*; do \
                   echo \"$t $(cat $t/comm) wchan=$(cat $t/wchan)\"; cat $t/stack 2>/dev/null | head -8; \
                   done; done";
    if let Ok(out) = guest.run(threads, step_timeout(guest)) {
        eprintln!(
            "---- guest {} traffic threads:\n{}",
            guest.name(),
            out.output
        );
    }
    // The kernel log's tail, after sysrq `w` added the stack of every blocked task: a hung
    // unplug's worker and what it waits for.
    let kernel = "echo w >/proc/sysrq-trigger; dmesg | tail -n 150";
    if let Ok(out) = guest.run(kernel, step_timeout(guest)) {
        eprintln!("---- guest {} kernel log:\n{}", guest.name(), out.output);
    }
}

/// The lines of `guest`'s kernel log (`dmesg`) that report a kernel problem, each headed by
/// the guest's name. The log of a moved guest holds its source's too: it moved with the VM.
pub fn kernel_problems(guest: &dyn Shell) -> StepResult<Vec<String>> {
    let log = guest.run_ok("dmesg", step_timeout(guest))?;
    Ok(crate::kernel_log::problem_lines(&log)
        .map(|line| format!("{}: {line}", guest.name()))
        .collect())
}

/// Soft-RoCE's retransmission counters of a guest, summed over its RDMA devices (rxe's
/// `hw_counters`): what an RC sender did while its peer was silent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retransmissions {
    /// Retransmit timeouts of this guest's requesters (`completer_retry_err`).
    pub timeouts: u64,
    /// QPs of this guest whose retry budget ran out (`retry_exceeded_err`).
    pub exhausted: u64,
    /// Requests this guest's responders received twice (`duplicate_request`): the other
    /// side's retransmissions.
    pub duplicates: u64,
}

impl Retransmissions {
    /// What rose from `before` to `self`.
    pub fn since(self, before: Retransmissions) -> Retransmissions {
        Retransmissions {
            timeouts: self.timeouts.saturating_sub(before.timeouts),
            exhausted: self.exhausted.saturating_sub(before.exhausted),
            duplicates: self.duplicates.saturating_sub(before.duplicates),
        }
    }
}

/// Reads `guest`'s [`Retransmissions`].
pub fn retransmissions(guest: &dyn Shell) -> StepResult<Retransmissions> {
    let out = guest.run_ok(
        "for c in completer_retry_err retry_exceeded_err duplicate_request; do \
           n=0; for f in /sys/class/infiniband/*/ports/1/hw_counters/$c; do \
             [ -r \"$f\" ] && n=$((n + $(cat \"$f\"))); done; echo \"$c $n\"; done",
        step_timeout(guest),
    )?;
    let mut counters = Retransmissions::default();
    for line in out.lines() {
        let Some((name, value)) = line.split_once(' ') else {
            continue;
        };
        let value: u64 = value
            .trim()
            .parse()
            .map_err(|_| format!("{}: hw counter line {line:?}", guest.name()))?;
        match name {
            "completer_retry_err" => counters.timeouts = value,
            "retry_exceeded_err" => counters.exhausted = value,
            "duplicate_request" => counters.duplicates = value,
            _ => {}
        }
    }
    Ok(counters)
}

/// Fails the test on any guest kernel problem [`kernel_problems`] found.
pub fn assert_no_kernel_problems(problems: &[String]) {
    assert!(
        problems.is_empty(),
        "guest kernel problems:\n{}",
        problems.join("\n")
    );
}

/// Starts a raw verbs user the agent does not know, which holds the RDMA device of `guest`:
/// `ibv_rc_pingpong` as a server keeps its device context while it waits for a client on TCP
/// port 18515 (0x4853), which it opens only after its device set-up succeeded. A NIC hook
/// still settling may make the set-up fail (the holder then exits at once): started again,
/// bounded. Returns its PID (also in `/run/holder.pid`).
pub fn start_holder(guest: &dyn Shell) -> StepResult<u32> {
    let out = guest.run_ok(
        "n=0; while [ $n -lt 5 ]; do \
           ibv_rc_pingpong -g 1 >/run/holder.log 2>&1 & echo $! > /run/holder.pid; \
           i=0; while kill -0 $(cat /run/holder.pid) 2>/dev/null && \
                 ! grep -qi ':4853 ' /proc/net/tcp /proc/net/tcp6 2>/dev/null; do \
             i=$((i+1)); [ $i -gt 100 ] && break; sleep 0.05; done; \
           kill -0 $(cat /run/holder.pid) 2>/dev/null && \
             grep -qi ':4853 ' /proc/net/tcp /proc/net/tcp6 2>/dev/null && \
             echo holder $(cat /run/holder.pid) && exit 0; \
           n=$((n+1)); sleep 0.2; done; cat /run/holder.log; exit 1",
        step_timeout(guest),
    )?;
    let pid = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("holder "))
        .and_then(|pid| pid.trim().parse().ok())
        .ok_or_else(|| format!("{}: no holder PID in {out:?}", guest.name()))?;
    Ok(pid)
}

/// Drives the library in the process registered on `socket` like the agent would:
/// `describe`, `quiesce` or `resume`. Fails if any per-connection outcome is not ok.
pub fn ctl(guest: &dyn Shell, socket: &str, op: &str) -> StepResult<Value> {
    let out = guest.run_ok(
        &format!("rdmamig-traffic ctl --socket {socket} --deadline-ms 8000 {op}"),
        step_timeout(guest),
    )?;
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("ctl {op}: no JSON in {out:?}"))?;
    let v: Value = serde_json::from_str(line)?;
    if let Some(list) = v["reply"]["body"]["outcomes"].as_array() {
        for o in list {
            if o["ok"] != json!(true) {
                return Err(format!("ctl {op} on {}: outcome not ok: {o}", guest.name()).into());
            }
        }
    }
    Ok(v)
}

/// Unplugs the NIC `id` of `guest` and waits for DEVICE_DELETED; returns how long it took.
pub fn unplug(guest: &Guest, id: &str, timeout: Duration) -> StepResult<Duration> {
    let mut qmp = guest.qmp()?;
    let started = Instant::now();
    qmp.execute("device_del", json!({ "id": id }))?;
    qmp.wait_event("DEVICE_DELETED", |d| d["device"] == id, timeout)?;
    Ok(started.elapsed())
}

/// Plugs a new RDMA NIC `id` (the guest's [`crate::NicModel`]) on its netdev `nd0` with its
/// own MAC and waits until its Soft-RoCE port is ACTIVE; returns how long it took.
pub fn plug(guest: &Guest, id: &str) -> StepResult<Duration> {
    let started = Instant::now();
    let spec = guest.spec();
    guest.qmp()?.execute(
        "device_add",
        json!({ "driver": spec.rdma_nic.qemu_driver(), "netdev": "nd0", "id": id,
                "bus": "rp1", "mac": spec.mac }),
    )?;
    guest.run_ok("rdmamig-netplug wait-active 10", STEP_TIMEOUT)?;
    Ok(started.elapsed())
}

/// Cuts (`up == false`) or restores `guest`'s network at its tap in the bed's namespace: a
/// partition the guest cannot see (its NIC keeps its carrier); packets in flight are lost.
pub fn set_tap(bed: &Testbed, guest: &Guest, up: bool) -> StepResult<()> {
    let tap = &guest.spec().tap;
    let state = if up { "up" } else { "down" };
    let out = Command::new("ip")
        .args(["-n", bed.netns(), "link", "set", tap, state])
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "ip link set {tap} {state}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(())
}

/// Checks a report of traffic that must have lost nothing and seen no error.
pub fn assert_clean(name: &str, r: &Report, sender: &Report) {
    assert_eq!(r.lost, 0, "{name} lost messages: {r:?}");
    assert_eq!(r.duplicated, 0, "{name} got duplicates: {r:?}");
    assert_eq!(r.reordered, 0, "{name} got reordered messages: {r:?}");
    assert!(r.errors.is_empty(), "{name} saw errors: {r:?}");
    assert_eq!(
        r.received, sender.sent,
        "{name} did not receive everything the other side sent: {r:?} / {sender:?}"
    );
}

/// Ends traffic `tag` between `vm` (the VM that moved, or stayed after a rollback) and
/// `peer`, and checks both directions with [`assert_clean`]. Prints both reports (and, when
/// they cannot be collected, the guests' logs first). Returns `vm`'s report and the peer's.
pub fn finish_clean_flow(
    vm: &dyn Shell,
    vm_name: &str,
    peer: &dyn Shell,
    tag: &str,
) -> (Report, Report) {
    let reports = stop_traffic(vm, tag)
        .and_then(|()| stop_traffic(peer, tag))
        .and_then(|()| Ok((collect_report(vm, tag)?, collect_report(peer, tag)?)));
    let (vm_report, peer_report) = reports.unwrap_or_else(|e| {
        dump_logs(vm);
        dump_logs(peer);
        panic!("{tag}: traffic reports: {}", crate::error_chain(e.as_ref()));
    });
    eprintln!("{tag}: {vm_name}: {vm_report:?}\n{tag}: peer: {peer_report:?}");
    // A report that is not clean comes with the guests' logs (and blocked tasks' stacks).
    let checked = std::panic::catch_unwind(|| {
        assert_clean("peer", &peer_report, &vm_report);
        assert_clean(vm_name, &vm_report, &peer_report);
    });
    if let Err(panic) = checked {
        dump_logs(vm);
        dump_logs(peer);
        std::panic::resume_unwind(panic);
    }
    let problems: Vec<String> = [vm, peer]
        .into_iter()
        .flat_map(|guest| {
            kernel_problems(guest)
                .unwrap_or_else(|e| panic!("{tag}: dmesg: {}", crate::error_chain(e.as_ref())))
        })
        .collect();
    assert_no_kernel_problems(&problems);
    (vm_report, peer_report)
}

/// The `rdmamig migrate` command that moves `src` to the `-incoming` guest `dst` through the
/// daemon listening on `socket`: NIC `nic0` is unplugged on the source and plugged again,
/// with the same MAC, on the destination's netdev `nd0`, over a UNIX migration socket.
/// Callers add the strategy, deadlines, report path or output options they need.
pub fn migrate_command(socket: &Path, src: &Guest, dst: &Guest) -> Command {
    migrate_command_as(socket, &src.spec().name, src, dst)
}

/// Runs [`migrate_command`] for `src` to `dst` through the daemon at `socket`, with `args`
/// added and the report written to `<dir>/<name>.json`; prints the CLI's output and gives
/// it with the report.
pub fn run_move(
    socket: &Path,
    dir: &Path,
    (src, dst): (&Guest, &Guest),
    args: &[&str],
    name: &str,
) -> (Output, Value) {
    let report_path = dir.join(format!("{name}.json"));
    let out = migrate_command(socket, src, dst)
        .args(args)
        .arg("--report")
        .arg(&report_path)
        .output()
        .unwrap_or_else(|e| panic!("rdmamig migrate ({name}): {e}"));
    eprintln!(
        "---- move ({name}):\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report = std::fs::read(&report_path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_else(|| {
            panic!(
                "no report of the move ({name}) at {}",
                report_path.display()
            )
        });
    (out, report)
}

/// [`migrate_command`] for the VM named `vm` (by default a move names the VM after its
/// source guest, whose name changes with every QEMU process it moves to).
pub fn migrate_command_as(socket: &Path, vm: &str, src: &Guest, dst: &Guest) -> Command {
    let mut command = Command::new(bin_dir().join("rdmamig"));
    command
        .arg("migrate")
        .arg("--socket")
        .arg(socket)
        .args(["--vm", vm, "--qmp"])
        .arg(src.qmp_socket())
        .arg("--agent")
        .arg(src.agent_socket())
        .args(["--detach", "nic0", "--to-qmp"])
        .arg(dst.qmp_socket())
        .arg("--to-agent")
        .arg(dst.agent_socket())
        .arg("--attach")
        .arg(format!(
            "driver={},id=nic0,netdev=nd0,bus=rp1,mac={}",
            src.spec().rdma_nic.qemu_driver(),
            src.spec().mac
        ))
        .arg("--via")
        .arg(format!("unix:{}", dst.migration_socket_path().display()));
    command
}

/// Checks that the destination migrator whose log is `log` did each of its duties in a move
/// for the migrator it knows as `peer`, over the peer channel.
pub fn assert_served_a_move(log: &Path, peer: &str) {
    let text = std::fs::read_to_string(log)
        .unwrap_or_else(|e| panic!("the destination's log {}: {e}", log.display()));
    for call in [
        "Reserve",
        "PrepareReceive",
        "ConfirmReceived",
        "Attach",
        "Resume",
    ] {
        assert!(
            text.contains(&format!("peer request peer={peer} call={call} ")),
            "{call}: {text}"
        );
    }
}

/// The port the peer serves a [`MoveGuests::start_flow`] on.
pub const FLOW_PORT: u16 = 7471;

/// How [`MoveGuests::start_with`] departs from the plain move's guests.
#[derive(Debug, Clone, Copy, Default)]
pub struct GuestOptions {
    /// The destination starts with the same RDMA NIC as the source (a `hot` move migrates
    /// the NIC instead of plugging one; on its own tap of the same bridge).
    pub dst_nic: bool,
    /// The moving VM (and its destination) has a vsock device with this CID: the agent's
    /// channel of a Cloud Hypervisor VM ([`crate::ch_facade`]).
    pub vsock_cid: Option<u32>,
    /// The destination keeps the arrived VM paused until the test runs it
    /// ([`crate::guest::Arrival::hold`]).
    pub dst_paused_on_arrival: bool,
}

/// What a move needs on the test bed: a peer, the VM that moves, and its `-incoming`
/// destination (same address and MAC, no NIC yet).
pub struct MoveGuests {
    /// The peer VM, which stays put.
    pub peer: Guest,
    /// The VM that moves.
    pub src: Guest,
    /// The destination QEMU, waiting for the migration.
    pub dst: Guest,
}

impl MoveGuests {
    /// Boots `<prefix>-peer` and `<prefix>-src` side by side, then starts `<prefix>-dst`.
    pub fn start(bed: &Testbed, prefix: &str) -> Result<MoveGuests, TestbedError> {
        MoveGuests::start_with(bed, prefix, GuestOptions::default())
    }

    /// [`MoveGuests::start`], with the [`GuestOptions`] given.
    pub fn start_with(
        bed: &Testbed,
        prefix: &str,
        options: GuestOptions,
    ) -> Result<MoveGuests, TestbedError> {
        let peer_spec = bed.guest_spec(&format!("{prefix}-peer"))?;
        let mut src_spec = bed.guest_spec(&format!("{prefix}-src"))?;
        src_spec.vsock_cid = options.vsock_cid;
        let mut dst_spec = bed.incoming_spec(&src_spec, &format!("{prefix}-dst"))?;
        dst_spec.with_nic = options.dst_nic;
        dst_spec.paused_on_arrival = options.dst_paused_on_arrival;
        let (peer, src) = std::thread::scope(|s| {
            let peer = s.spawn(|| bed.start_guest(peer_spec));
            let src = s.spawn(|| bed.start_guest(src_spec));
            (
                peer.join().expect("boot thread"),
                src.join().expect("boot thread"),
            )
        });
        let (peer, src) = (peer?, src?);
        let dst = bed.start_incoming(dst_spec)?;
        Ok(MoveGuests { peer, src, dst })
    }

    /// Starts traffic `tag` both ways between the peer (serving on [`FLOW_PORT`]) and the
    /// moving VM, with `args` added on both sides, and waits until both are connected.
    pub fn start_flow(&self, tag: &str, args: &str) -> StepResult<()> {
        self.start_flow_sides(tag, args, args)
    }

    /// [`MoveGuests::start_flow`] with `peer_args` added on the peer and `mover_args` on
    /// the moving VM.
    pub fn start_flow_sides(&self, tag: &str, peer_args: &str, mover_args: &str) -> StepResult<()> {
        let server = format!("{}:{FLOW_PORT}", self.peer.spec().address());
        start_traffic(
            &self.peer,
            tag,
            &format!("serve --listen {server} {peer_args}"),
        )?;
        start_traffic(
            &self.src,
            tag,
            &format!("connect --to {server} {mover_args}"),
        )?;
        wait_ready(&self.peer, tag, 1)?;
        wait_ready(&self.src, tag, 1)
    }
}

/// Waits (`bound` at most) until an rdma_cm id in `guest` listens on `port` (`rdma resource
/// show cm_id`): a client started before that is rejected at every attempt ("no
/// listener"), and on a slow nested VM the serving process took longer to listen than the
/// client's connect timeout.
pub fn wait_rdma_listening(guest: &dyn Shell, port: u16, bound: Duration) -> StepResult<()> {
    let out = guest.run(
        &format!(
            "end=$(($(date +%s) + {secs})); \
             until rdma resource show cm_id | awk '/state LISTEN/ {{ for (i = 1; i < NF; i++) \
               if ($i == \"src-addr\" && $(i + 1) ~ /:{port}$/) f = 1 }} END {{ exit !f }}'; do \
               [ $(date +%s) -ge $end ] && {{ echo 'no rdma_cm listener on port {port}:'; \
                 rdma resource show cm_id; exit 1; }}; sleep 0.2; done",
            secs = bound.as_secs()
        ),
        bound + step_timeout(guest),
    )?;
    if out.status != 0 {
        return Err(format!("{}: {}", guest.name(), out.output.trim()).into());
    }
    Ok(())
}

/// Waits (10 s at most) until a socket in `guest` listens on TCP `port`. Only the LISTEN
/// state counts: a connection of an earlier run on that port lingers in TIME_WAIT, and a
/// client started on its sight finds nobody listening yet.
pub fn wait_listening(guest: &dyn Shell, port: u16) -> StepResult<()> {
    guest.run_ok(
        &format!(
            "i=0; until awk '$2 ~ /:{port:04X}$/ && $4 == \"0A\" {{ f = 1 }} END {{ exit !f }}' \
               /proc/net/tcp /proc/net/tcp6; do \
               i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.05; done"
        ),
        step_timeout(guest),
    )?;
    Ok(())
}
