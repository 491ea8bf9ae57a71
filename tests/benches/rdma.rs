//! The rdmamig benchmark: ratios measured in one run on the test bed, never absolute targets
//! (the guests are TCG-emulated, so absolute numbers say little; a ratio against a baseline
//! measured on the same guests in the same run does).
//!
//! 1. Library overhead: message rate and latency of rdmamig's connection library
//!    (`rdmamig-perf`) against raw verbs (perftest's `ib_send_bw`, rdma-core's
//!    `ibv_rc_pingpong`) between the same two guests, interleaved, several rounds, medians of
//!    the rounds compared.
//! 2. Switching time: the largest delivery gap at the peer during a move with `reconnect`,
//!    with `bridge` and with the naive unplug-migrate-plug, and with `hot` beside the same
//!    migration with the NIC attached and nothing paused (plain rdma_cm traffic), each
//!    beside the VMM's reported downtime and the VM's pause.
//! 3. Preload cost: the same unmodified programs (`ib_send_bw`, `ibv_rc_pingpong`) with and
//!    without `rdmamig-run`, interleaved, medians compared (docs/preload.md).
//! 4. Scale: `reconnect` moves with 1, 16, 64 (16 per process) and 1,024 connections (16
//!    processes of 64), their quiesce and resume against the one-connection move's (the
//!    goal: at most 3x).
//!
//! Run it with `cargo bench -p rdmamig-testbed --bench rdma` (root; scripts/setup.sh first
//! builds the guest binaries); `-- overhead`, `-- switching`, `-- preload` or `-- scale` runs
//! only that part.
//! docs/benchmarks.md records the results.

use std::time::Duration;

use rdmamig_testbed::scenario::{self, Daemon, ScenarioConfig, ScenarioOutcome, Strategy};
use rdmamig_testbed::steps::{wait_listening, Retransmissions};
use rdmamig_testbed::{error_chain, Guest, Testbed};
use serde_json::Value;

/// Message size of every overhead measurement, bytes (the traffic tool's default too).
const SIZE: usize = 256;
/// Messages per message-rate run.
const COUNT: u32 = 20_000;
/// Round trips per latency run.
const ITERS: u32 = 1_000;
/// Interleaved rounds (raw, then library) per measurement; the medians are compared.
const ROUNDS: usize = 5;
/// Port of the library's server (perftest uses its default, 18515).
const PERF_PORT: u16 = 7480;
/// Bound on one command in a guest.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

fn main() {
    if let Err(e) = run() {
        eprintln!("benchmark failed: {}", error_chain(&*e));
        std::process::exit(1);
    }
}

/// The parts of the benchmark.
const PARTS: [&str; 4] = ["overhead", "switching", "preload", "scale"];

/// The parts named on the command line (cargo passes its own `--bench` too), all by default.
fn parts() -> Result<Vec<String>, String> {
    let named: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if let Some(bad) = named.iter().find(|a| !PARTS.contains(&a.as_str())) {
        return Err(format!("unknown part {bad:?}: the parts are {PARTS:?}"));
    }
    Ok(if named.is_empty() {
        PARTS.iter().map(|p| p.to_string()).collect()
    } else {
        named
    })
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let parts = parts()?;
    let bed = Testbed::new("bench")?;
    if parts.iter().any(|p| p == "overhead") {
        println!("== library overhead: {SIZE}-byte messages, {ROUNDS} interleaved rounds");
        let overhead = {
            let server = bed.start_guest(bed.guest_spec("srv")?)?;
            let client = bed.start_guest(bed.guest_spec("cli")?)?;
            measure_overhead(&server, &client)?
        };
        println!("\n{}", overhead.render());
    }
    if parts.iter().any(|p| p == "preload") {
        println!("\n== preload cost: {SIZE}-byte messages, {ROUNDS} interleaved rounds");
        let server = bed.start_guest(bed.guest_spec("psrv")?)?;
        let client = bed.start_guest(bed.guest_spec("pcli")?)?;
        println!("\n{}", measure_preload(&server, &client)?);
    }
    let moves = |part: &str| parts.iter().any(|p| p == part);
    if !moves("scale") && !moves("switching") {
        return Ok(());
    }
    let daemon = Daemon::start(bed.dir())?;
    if moves("scale") {
        println!("\n== scale: reconnect moves with 1, 16, 64 and 1,024 connections");
        println!("\n{}", measure_scale(&bed, &daemon)?);
    }
    if !moves("switching") {
        return Ok(());
    }
    println!("\n== switching time: one move with each strategy");
    let mut outcomes = Vec::new();
    for strategy in [
        Strategy::Reconnect,
        Strategy::Bridge,
        Strategy::Naive,
        Strategy::Hot,
        Strategy::Attached,
    ] {
        let outcome = scenario::run(&bed, &daemon, &ScenarioConfig::new(strategy))?;
        let name = strategy.label();
        println!("\n== the {name} move\n{}", outcome.move_output.trim_end());
        println!("{}", scenario::render(&outcome));
        outcomes.push(outcome);
    }
    println!(
        "\n{}",
        render_switching(&outcomes[0], &outcomes[1], &outcomes[2])
    );
    println!("{}", render_hot(&outcomes[3], &outcomes[4]));
    Ok(())
}

/// Every round's value of each way of sending: raw verbs, the library's blocking API, and
/// its async API.
#[derive(Default)]
struct Series {
    raw: Vec<f64>,
    blocking: Vec<f64>,
    asynchronous: Vec<f64>,
}

impl Series {
    fn row(&self, what: &str) -> String {
        let raw = median(&self.raw);
        format!(
            "| {what:<27} | {:>20} | {:>20} | {:>20} | {:>8.3} | {:>8.3} |\n",
            spread(&self.raw),
            spread(&self.blocking),
            spread(&self.asynchronous),
            median(&self.blocking) / raw,
            median(&self.asynchronous) / raw,
        )
    }
}

/// The library-overhead measurements.
#[derive(Default)]
struct Overhead {
    rate: Series,
    latency_us: Series,
    /// Host CPU time both guests' QEMU processes took per message of a rate run, us.
    rate_cpu_us: Series,
    /// The same per round trip of a latency run.
    latency_cpu_us: Series,
}

impl Overhead {
    fn render(&self) -> String {
        let worst = (median(&self.rate.blocking).min(median(&self.rate.asynchronous)))
            / median(&self.rate.raw);
        format!(
            "| {SIZE} B, median (range)      | raw verbs            | library, blocking    | library, async       | blk/raw  | async/raw |\n\
             |-----------------------------|---------------------:|---------------------:|---------------------:|---------:|---------:|\n\
             {}{}{}{}\
             host CPU: both guests' QEMU processes (user + system) over the whole run, set-up \
             included, divided by its messages (round trips); the rate depends on what else \
             the host runs, the CPU a message takes much less\n\
             target: message rate overhead under 10% (library / raw >= 0.900, worse API): {} ({:.1}% overhead)\n",
            self.rate.row("message rate (msg/s)"),
            self.latency_us.row("latency (us, one way, mean)"),
            self.rate_cpu_us.row("host CPU per message (us)"),
            self.latency_cpu_us.row("host CPU per round trip (us)"),
            verdict(worst >= 0.9),
            (1.0 - worst) * 100.0,
        )
    }
}

/// "median (min-max)": on a loaded 2-core host the rounds vary, and the reader should see by
/// how much before trusting a ratio.
fn spread(values: &[f64]) -> String {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.0} ({min:.0}-{max:.0})", median(values))
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}

fn measure_overhead(
    server: &Guest,
    client: &Guest,
) -> Result<Overhead, Box<dyn std::error::Error>> {
    let at = server.spec().address().to_owned();
    let mut o = Overhead::default();
    let guests = [server, client];
    let per = |cpu: f64, n: u32| cpu * 1e6 / f64::from(n);
    for round in 1..=ROUNDS {
        let (raw, cpu) = host_cpu(guests, || {
            raw_verbs(server, client, &at, &SEND_BW, &format!("-n {COUNT}"))
        })?;
        o.rate.raw.push(column(&raw, "MsgRate[Mpps]")? * 1e6);
        o.rate_cpu_us.raw.push(per(cpu, COUNT));
        let (raw, cpu) = host_cpu(guests, || {
            raw_verbs(server, client, &at, &RC_PINGPONG, &format!("-n {ITERS}"))
        })?;
        o.latency_us.raw.push(usec_per_iter(&raw)? / 2.0);
        o.latency_cpu_us.raw.push(per(cpu, ITERS));
        for (api, rate, latency, rate_cpu, latency_cpu) in [
            (
                "blocking",
                &mut o.rate.blocking,
                &mut o.latency_us.blocking,
                &mut o.rate_cpu_us.blocking,
                &mut o.latency_cpu_us.blocking,
            ),
            (
                "async",
                &mut o.rate.asynchronous,
                &mut o.latency_us.asynchronous,
                &mut o.rate_cpu_us.asynchronous,
                &mut o.latency_cpu_us.asynchronous,
            ),
        ] {
            let (lib, cpu) = host_cpu(guests, || {
                library(server, client, &at, api, &format!("bw --count {COUNT}"))
            })?;
            rate.push(number(&lib, "msg_rate")?);
            rate_cpu.push(per(cpu, COUNT));
            let (lib, cpu) = host_cpu(guests, || {
                library(server, client, &at, api, &format!("lat --iters {ITERS}"))
            })?;
            latency.push(number(&lib, "mean_us")?);
            latency_cpu.push(per(cpu, ITERS));
        }
        let last = |v: &Vec<f64>| v.last().copied().unwrap_or(f64::NAN);
        println!(
            "round {round}: rate raw {:.0} blocking {:.0} async {:.0} msg/s; \
             latency raw {:.1} blocking {:.1} async {:.1} us",
            last(&o.rate.raw),
            last(&o.rate.blocking),
            last(&o.rate.asynchronous),
            last(&o.latency_us.raw),
            last(&o.latency_us.blocking),
            last(&o.latency_us.asynchronous),
        );
    }
    Ok(o)
}

/// Without and with the preload library, every round's value.
#[derive(Default)]
struct Pair {
    plain: Vec<f64>,
    preloaded: Vec<f64>,
}

impl Pair {
    fn row(&self, what: &str) -> String {
        format!(
            "| {what:<27} | {:>20} | {:>20} | {:>8.3} |\n",
            spread(&self.plain),
            spread(&self.preloaded),
            median(&self.preloaded) / median(&self.plain),
        )
    }
}

/// The preload library's cost on the data path: ib_send_bw's message rate and
/// ibv_rc_pingpong's latency, each without and with `rdmamig-run`, interleaved. A program
/// the library cannot run is reported as such, not measured.
fn measure_preload(server: &Guest, client: &Guest) -> Result<String, Box<dyn std::error::Error>> {
    let at = server.spec().address().to_owned();
    let mut rate = Pair::default();
    let mut latency = Pair::default();
    let mut refused = Vec::new();
    for round in 1..=ROUNDS {
        for (tool, preloaded) in [(&SEND_BW_OLD_POST, false), (&SEND_BW_OLD_POST, true)] {
            if preloaded && refused.iter().any(|(p, _)| *p == tool.program) {
                continue;
            }
            match raw_verbs_as(server, client, &at, tool, &format!("-n {COUNT}"), preloaded) {
                Ok(out) => {
                    let value = column(&out, "MsgRate[Mpps]")? * 1e6;
                    if preloaded {
                        &mut rate.preloaded
                    } else {
                        &mut rate.plain
                    }
                    .push(value);
                }
                Err(e) if preloaded => {
                    // Its server may still wait for a client that gave up.
                    let _ = server.run("kill $(cat /tmp/server.pid) 2>/dev/null", RUN_TIMEOUT);
                    refused.push((tool.program, error_chain(&*e)));
                }
                Err(e) => return Err(e),
            }
        }
        for preloaded in [false, true] {
            let out = raw_verbs_as(
                server,
                client,
                &at,
                &RC_PINGPONG,
                &format!("-n {ITERS}"),
                preloaded,
            )?;
            let value = usec_per_iter(&out)? / 2.0;
            if preloaded {
                &mut latency.preloaded
            } else {
                &mut latency.plain
            }
            .push(value);
        }
        println!(
            "round {round}: rate {:?} / {:?} msg/s; latency {:?} / {:?} us (without / with)",
            rate.plain.last(),
            rate.preloaded.last(),
            latency.plain.last(),
            latency.preloaded.last()
        );
    }
    let mut table = format!(
        "| {SIZE} B, median (range)      | without              | with rdmamig-run     | with/without |\n\
         |-----------------------------|---------------------:|---------------------:|---------:|\n"
    );
    if rate.preloaded.is_empty() {
        table.push_str(&format!(
            "| message rate (msg/s)        | {:>20} | {:>20} | {:>8} |\n",
            spread(&rate.plain),
            "not run",
            "-"
        ));
    } else {
        table.push_str(&rate.row("message rate (msg/s)"));
    }
    table.push_str(&latency.row("latency (us, one way, mean)"));
    for (program, why) in &refused {
        table.push_str(&format!("{program} under rdmamig-run failed: {why}\n"));
    }
    if !rate.preloaded.is_empty() {
        let ratio = median(&rate.preloaded) / median(&rate.plain);
        table.push_str(&format!(
            "target: message rate within 3% (with/without >= 0.970): {}\n",
            verdict(ratio >= 0.97)
        ));
    }
    let ratio = median(&latency.preloaded) / median(&latency.plain);
    table.push_str(&format!(
        "target: latency within 5% (with/without <= 1.050): {}\n",
        verdict(ratio <= 1.05)
    ));
    Ok(table)
}

/// Runs `run` and returns its result with the host CPU time (seconds, user + system) the
/// QEMU processes of `guests` took meanwhile.
fn host_cpu<T>(
    guests: [&Guest; 2],
    run: impl FnOnce() -> Result<T, Box<dyn std::error::Error>>,
) -> Result<(T, f64), Box<dyn std::error::Error>> {
    let before = cpu_seconds(guests)?;
    let value = run()?;
    Ok((value, cpu_seconds(guests)? - before))
}

/// User + system CPU seconds the QEMU processes of `guests` have used so far.
fn cpu_seconds(guests: [&Guest; 2]) -> Result<f64, Box<dyn std::error::Error>> {
    // SAFETY: sysconf has no preconditions.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks_per_second <= 0 {
        return Err("sysconf(_SC_CLK_TCK) failed".into());
    }
    let mut ticks = 0u64;
    for guest in guests {
        let path = format!("/proc/{}/stat", guest.pid());
        let stat = std::fs::read_to_string(&path)?;
        // utime and stime are fields 14 and 15; the name (field 2, in parentheses) may hold
        // blanks, so count from its closing parenthesis: the 12th and 13th fields after it.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        match (fields.get(11), fields.get(12)) {
            (Some(user), Some(system)) => ticks += user.parse::<u64>()? + system.parse::<u64>()?,
            _ => return Err(format!("no utime and stime in {path}: {stat}").into()),
        }
    }
    Ok(ticks as f64 / ticks_per_second as f64)
}

/// A raw-verbs tool run as a pair: the same command on both sides, the client naming the
/// server's address; both wait on the completion channel, as the library does (busy polling
/// starves Soft-RoCE's own packet processing on the guests' single vCPU: ib_send_lat's
/// t_typical measured 15-28 ms that way, instead of hundreds of us).
struct RawTool {
    program: &'static str,
    options: &'static str,
}

/// perftest's message rate, RoCE v2 GID 1 (TESTBED.md), `-e` for events.
const SEND_BW: RawTool = RawTool {
    program: "ib_send_bw",
    options: "-x 1 -F -e",
};

/// [`SEND_BW`] posting with ibv_post_send, both ways in the preload part: perftest's
/// default posts with the extended ibv_wr_* verbs, which the preload library refuses
/// (docs/preload.md); its CQs fall back to ibv_create_cq by themselves.
const SEND_BW_OLD_POST: RawTool = RawTool {
    program: "ib_send_bw",
    options: "-x 1 -F -e --use_old_post_send",
};

/// rdma-core's ping-pong, events (`-e`): perftest's ib_send_lat hangs with `-e` here.
const RC_PINGPONG: RawTool = RawTool {
    program: "ibv_rc_pingpong",
    options: "-g 1 -e",
};

/// Runs `tool` (server in the background on `server`, client on `client`) and returns the
/// client's output.
fn raw_verbs(
    server: &Guest,
    client: &Guest,
    at: &str,
    tool: &RawTool,
    args: &str,
) -> Result<String, Box<dyn std::error::Error>> {
    raw_verbs_as(server, client, at, tool, args, false)
}

/// [`raw_verbs`], both sides under `rdmamig-run` when `preloaded`.
fn raw_verbs_as(
    server: &Guest,
    client: &Guest,
    at: &str,
    tool: &RawTool,
    args: &str,
    preloaded: bool,
) -> Result<String, Box<dyn std::error::Error>> {
    let wrapper = if preloaded { "rdmamig-run -- " } else { "" };
    let command = format!(
        "{wrapper}{} {} -s {SIZE} {args}",
        tool.program, tool.options
    );
    start_server(server, &command)?;
    // Both tools' clients give up at once when the server is not listening yet (TCP 18515).
    wait_listening(server, 18515)?;
    let out = client.run_ok(&format!("{command} {at} 2>&1"), RUN_TIMEOUT)?;
    wait_server(server)?;
    Ok(out)
}

/// ibv_rc_pingpong's round-trip time: "<n> iters in <s> seconds = <t> usec/iter".
fn usec_per_iter(output: &str) -> Result<f64, Box<dyn std::error::Error>> {
    let value = output
        .lines()
        .find_map(|l| l.strip_suffix(" usec/iter"))
        .and_then(|l| l.rsplit(' ').next())
        .ok_or_else(|| format!("no usec/iter in:\n{output}"))?;
    Ok(value.parse()?)
}

/// Runs `rdmamig-perf --api <api> <test>` against a fresh `rdmamig-perf serve` and returns its
/// JSON.
fn library(
    server: &Guest,
    client: &Guest,
    at: &str,
    api: &str,
    test: &str,
) -> Result<Value, Box<dyn std::error::Error>> {
    start_server(
        server,
        &format!("rdmamig-perf --api {api} serve --listen {at}:{PERF_PORT}"),
    )?;
    let out = client.run_ok(
        &format!("rdmamig-perf --api {api} {test} --size {SIZE} --to {at}:{PERF_PORT}"),
        RUN_TIMEOUT,
    )?;
    wait_server(server)?;
    let line = out
        .lines()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| format!("rdmamig-perf printed no report: {out}"))?;
    Ok(serde_json::from_str(line)?)
}

/// Starts a server command in the background; [`wait_server`] waits for it (each console
/// command runs in a shell of its own, so a later `wait` would not see it).
fn start_server(guest: &Guest, command: &str) -> Result<(), Box<dyn std::error::Error>> {
    guest.run_ok(
        &format!("{command} >/tmp/server.log 2>&1 & echo $! >/tmp/server.pid"),
        RUN_TIMEOUT,
    )?;
    Ok(())
}

/// Waits (bounded) until the server [`start_server`] started has exited.
fn wait_server(guest: &Guest) -> Result<(), Box<dyn std::error::Error>> {
    guest.run_ok(
        "i=0; while kill -0 $(cat /tmp/server.pid) 2>/dev/null; do \
           i=$((i+1)); [ $i -gt 600 ] && exit 1; sleep 0.05; done",
        RUN_TIMEOUT,
    )?;
    Ok(())
}

/// The value under `header` in the first data row after perftest's header line.
fn column(output: &str, header: &str) -> Result<f64, Box<dyn std::error::Error>> {
    let mut lines = output.lines();
    let heading = lines
        .find(|l| l.contains(header))
        .ok_or_else(|| format!("no {header} column in:\n{output}"))?;
    // A heading is `#name` or ends in `[unit]`, and may contain blanks ("BW peak[MB/sec]").
    let mut headings = Vec::new();
    let mut pending = String::new();
    for word in heading.split_whitespace() {
        pending.push_str(word);
        if word.starts_with('#') || word.contains('[') {
            headings.push(std::mem::take(&mut pending));
        } else {
            pending.push(' ');
        }
    }
    let index = headings
        .iter()
        .position(|h| h == header)
        .ok_or_else(|| format!("cannot place the {header} column in {heading:?}"))?;
    let data = lines
        .find(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .ok_or_else(|| format!("no data row under {header} in:\n{output}"))?;
    let field = data
        .split_whitespace()
        .nth(index)
        .ok_or_else(|| format!("no field {index} in {data:?}"))?;
    Ok(field.parse()?)
}

fn number(report: &Value, key: &str) -> Result<f64, Box<dyn std::error::Error>> {
    report[key]
        .as_f64()
        .ok_or_else(|| format!("no {key} in {report}").into())
}

fn median(values: &[f64]) -> f64 {
    let mut values = values.to_vec();
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn render_switching(
    reconnect: &ScenarioOutcome,
    bridge: &ScenarioOutcome,
    naive: &ScenarioOutcome,
) -> String {
    let downtime = ScenarioOutcome::vmm_downtime_ms;
    let paused = ScenarioOutcome::vm_paused_ms;
    let shown = |d: Option<u64>| d.map_or("?".to_owned(), |d| d.to_string());
    let lost = |o: &ScenarioOutcome| o.peer.lost + o.mover.lost;
    let gap = |o: &ScenarioOutcome| o.peer.max_gap_ms;
    let reconnect_ratio = gap(reconnect) / gap(naive);
    let naive_over_bridge = gap(naive) / gap(bridge);
    let over_downtime = downtime(bridge).map(|d| gap(bridge) - d as f64);
    format!(
        "| switching time                         | naive | reconnect | bridge |\n\
         |----------------------------------------|------:|----------:|-------:|\n\
         | largest gap at the peer (ms)           | {:>5.0} | {:>9.0} | {:>6.0} |\n\
         | VMM downtime (ms)                      | {:>5} | {:>9} | {:>6} |\n\
         | VM paused, STOP to RESUME (ms)         | {:>5} | {:>9} | {:>6} |\n\
         | messages lost                          | {:>5} | {:>9} | {:>6} |\n\
         reconnect / naive gap: {reconnect_ratio:.2} (target <= 0.60: {}); nothing lost with reconnect: {}\n\
         bridge gap - its VMM downtime: {} ms (target <= 10: {}); nothing lost with bridge: {}\n\
         naive / bridge gap: {naive_over_bridge:.1} (target >= 20: {})\n",
        gap(naive),
        gap(reconnect),
        gap(bridge),
        shown(downtime(naive)),
        shown(downtime(reconnect)),
        shown(downtime(bridge)),
        shown(paused(naive)),
        shown(paused(reconnect)),
        shown(paused(bridge)),
        lost(naive),
        lost(reconnect),
        lost(bridge),
        verdict(reconnect_ratio <= 0.6),
        verdict(lost(reconnect) == 0),
        over_downtime.map_or("?".to_owned(), |d| format!("{d:+.0}")),
        verdict(over_downtime.is_some_and(|d| d <= 10.0)),
        verdict(lost(bridge) == 0),
        verdict(naive_over_bridge >= 20.0),
    )
}

/// `hot` beside the same attached migration with nothing paused: its goals are a gap at the
/// peer within the VM's own pause + 5 ms, and below the uncoordinated one's.
fn render_hot(hot: &ScenarioOutcome, attached: &ScenarioOutcome) -> String {
    let shown = |d: Option<u64>| d.map_or("?".to_owned(), |d| d.to_string());
    let gap = |o: &ScenarioOutcome| o.peer.max_gap_ms;
    let lost = |o: &ScenarioOutcome| o.peer.lost + o.mover.lost;
    let over_pause = hot.vm_paused_ms().map(|p| gap(hot) - p as f64);
    let ratio = gap(hot) / gap(attached);
    let retransmitted = |o: &ScenarioOutcome, counter: fn(&Retransmissions) -> u64| {
        shown(o.peer_retransmissions.as_ref().map(counter))
    };
    format!(
        "| NIC attached, migrating with the VM     | attached, nothing paused | hot |\n\
         |----------------------------------------|-------------------------:|----:|\n\
         | largest gap at the peer (ms)           | {:>24.0} | {:>3.0} |\n\
         | VMM downtime (ms)                      | {:>24} | {:>3} |\n\
         | VM paused, STOP to RESUME (ms)         | {:>24} | {:>3} |\n\
         | messages lost                          | {:>24} | {:>3} |\n\
         | errors the peer saw                    | {:>24} | {:>3} |\n\
         | peer's retransmit timeouts             | {:>24} | {:>3} |\n\
         | duplicate requests the peer received   | {:>24} | {:>3} |\n\
         hot gap - its VM pause: {} ms (target <= 5: {}); nothing lost with hot: {}\n\
         hot / attached gap: {ratio:.2} (target < 1: {})\n",
        gap(attached),
        gap(hot),
        shown(attached.vmm_downtime_ms()),
        shown(hot.vmm_downtime_ms()),
        shown(attached.vm_paused_ms()),
        shown(hot.vm_paused_ms()),
        lost(attached),
        lost(hot),
        attached.peer.errors.len(),
        hot.peer.errors.len(),
        retransmitted(attached, |r| r.timeouts),
        retransmitted(hot, |r| r.timeouts),
        retransmitted(attached, |r| r.duplicates),
        retransmitted(hot, |r| r.duplicates),
        over_pause.map_or("?".to_owned(), |d| format!("{d:+.0}")),
        verdict(over_pause.is_some_and(|d| d <= 5.0)),
        verdict(lost(hot) == 0),
        verdict(ratio < 1.0),
    )
}

/// The scale part's moves, as (traffic processes, connections each): up to 1,024
/// connections, the goal.
const SCALE_MOVES: [(u32, u32); 4] = [(1, 1), (1, 16), (4, 16), (16, 64)];

/// A phase of one scale move: how long it took, and how much of that the guest's agent
/// spent (its `agent_ms`), ms.
#[derive(Clone, Copy)]
struct Took {
    ms: u64,
    agent_ms: Option<u64>,
}

impl std::fmt::Display for Took {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.agent_ms {
            Some(agent) => write!(f, "{} ({agent})", self.ms),
            None => write!(f, "{}", self.ms),
        }
    }
}

/// One scale move's figures.
struct ScaleRow {
    connections: u32,
    quiesce: Took,
    detach: Took,
    resume: Took,
    lost: u64,
}

/// Moves the VM with `reconnect` once per size of [`SCALE_MOVES`], with traffic on every
/// connection, and renders each move's quiesce, detach and resume beside the
/// one-connection move's.
fn measure_scale(bed: &Testbed, daemon: &Daemon) -> Result<String, Box<dyn std::error::Error>> {
    use rdmamig_migrator::machine::Phase;
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for (processes, connections) in SCALE_MOVES {
        let mut config = ScenarioConfig::many(Strategy::Reconnect, processes, connections);
        // 16 processes connecting 8 at a time each keep the guests' one CPU far busier than
        // 64 connections do: within the 60 s of `many` some connects never got through.
        config.connect_timeout_s = config.connect_timeout_s.max(connections * 5);
        let total = processes * connections;
        // A size that fails is reported beside the others' figures, not instead of them.
        let outcome = match scenario::run(bed, daemon, &config) {
            Ok(outcome) => outcome,
            Err(e) if !rows.is_empty() => {
                failed.push(format!("{total} connections: FAILED: {}", error_chain(&e)));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        println!(
            "\n== the move with {total} connections\n{}",
            outcome.move_output.trim_end()
        );
        let report = outcome
            .move_report
            .as_ref()
            .ok_or("the move wrote no report")?;
        let took = |phase: Phase| {
            report
                .timeline
                .phase(phase)
                .map(|r| Took {
                    ms: r.duration_ms,
                    agent_ms: r.details.get("agent_ms").and_then(Value::as_u64),
                })
                .ok_or_else(|| format!("the {total}-connection move has no {phase} phase"))
        };
        rows.push(ScaleRow {
            connections: total,
            quiesce: took(Phase::Quiesce)?,
            detach: took(Phase::Detach)?,
            resume: took(Phase::Resume)?,
            lost: outcome.peer.lost + outcome.mover.lost,
        });
    }
    let one = &rows[0];
    let ratio = |took: Took, base: Took| took.ms as f64 / base.ms.max(1) as f64;
    let mut out = String::from(
        "| connections | quiesce ms (agent) | detach ms | resume ms (agent) | quiesce / 1 | resume / 1 | lost |\n\
         |------------:|-------------------:|----------:|------------------:|------------:|-----------:|-----:|\n",
    );
    for row in &rows {
        out.push_str(&format!(
            "| {:>11} | {:>18} | {:>9} | {:>17} | {:>11.1} | {:>10.1} | {:>4} |\n",
            row.connections,
            row.quiesce.to_string(),
            row.detach.to_string(),
            row.resume.to_string(),
            ratio(row.quiesce, one.quiesce),
            ratio(row.resume, one.resume),
            row.lost,
        ));
    }
    let most = rows.last().expect("a scale move");
    out.push_str(&format!(
        "{} connections: quiesce within 3x of one connection's: {}; resume: {}\n",
        most.connections,
        verdict(ratio(most.quiesce, one.quiesce) <= 3.0),
        verdict(ratio(most.resume, one.resume) <= 3.0),
    ));
    for failure in failed {
        out.push_str(&failure);
        out.push('\n');
    }
    Ok(out)
}
