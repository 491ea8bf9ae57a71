//! `rdmamig-demo`: moves of a VM with live RDMA traffic on the built-in test bed, with
//! rdmamig's two strategies and the naive way, with the timeline and the switching time of
//! each.

use std::process::ExitCode;

use clap::Parser;
use rdmamig_testbed::scenario::{self, Daemon, ScenarioConfig, Strategy};
use rdmamig_testbed::{error_chain, Testbed};

/// Moves a VM with live RDMA traffic to another QEMU process, three times: with rdmamig's
/// `reconnect` (quiesce, detach, migrate, attach, resume), with rdmamig's `bridge` (the
/// same, with the messages carried over TCP on the VM's permanent NIC while the RDMA NIC
/// is away), and the way operators do it today (unplug, migrate, plug; the application
/// reconnects on its own).
///
/// The test bed runs QEMU TCG guests with Soft-RoCE on a bridge in a network namespace of
/// its own, and removes everything when it ends. Needs root. Takes about three minutes.
///
/// Switching time is the largest gap between two consecutive deliveries the receiving
/// application on the peer VM saw; the peer keeps running through the move, so its clock
/// measures the whole blackout.
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// Messages per second each side sends.
    #[arg(long, default_value_t = 200)]
    rate: u32,
    /// Run only rdmamig's moves, not the naive one.
    #[arg(long)]
    skip_naive: bool,
    /// Where each move's JSON report and SVG timeline are written.
    #[arg(long, default_value = "target/demo")]
    out_dir: std::path::PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmamig-demo: {}", error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    println!("== starting the test bed (building the guest image if needed)");
    let bed = Testbed::new("demo")?;
    let daemon = Daemon::start(bed.dir())?;

    let mut outcomes = Vec::new();
    let strategies: &[Strategy] = if args.skip_naive {
        &[Strategy::Reconnect, Strategy::Bridge]
    } else {
        &[Strategy::Reconnect, Strategy::Bridge, Strategy::Naive]
    };
    for &strategy in strategies {
        println!(
            "\n== moving a VM with live RDMA traffic: strategy {} ==",
            strategy.migrator_name()
        );
        let config = ScenarioConfig {
            rate: args.rate,
            ..ScenarioConfig::new(strategy)
        };
        let outcome = scenario::run(&bed, &daemon, &config)?;
        println!("{}", outcome.move_output.trim_end());
        if let Some(report) = &outcome.move_report {
            std::fs::create_dir_all(&args.out_dir)?;
            let base = args
                .out_dir
                .join(format!("move-{}", strategy.migrator_name()));
            let json = base.with_extension("json");
            std::fs::write(&json, serde_json::to_string_pretty(report)? + "\n")?;
            let svg = base.with_extension("svg");
            std::fs::write(&svg, rdmamig_migrator::svg::timeline_svg(report)?)?;
            println!("report: {}\ntimeline: {}", json.display(), svg.display());
        }
        println!("\n{}", scenario::render(&outcome));
        outcomes.push(outcome);
    }
    println!("== side by side ==\n{}", scenario::compare(&outcomes));
    Ok(())
}
