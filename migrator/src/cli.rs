//! The client side of the `rdmamig` commands: send the plan to the daemon, show progress as
//! it comes, then the timeline, and hand back the report; ask for the running moves, the
//! history and one move's report.
//!
//! Rendering is kept in pure functions so that the operator's view is tested without a
//! daemon.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use rdmamig_proto::text::error_chain;

use serde_json::{Map, Value};
use thiserror::Error;
use tokio::net::UnixStream;

use crate::api::{self, ClientRequest, DaemonMessage};
use crate::channel::{Channel, ChannelError};
use crate::flags::OutputFlags;
use crate::machine::Phase;
use crate::plan::MovePlan;
use crate::pool::{Attachment, FunctionState};
use crate::report::{MoveEvent, MoveReport, VmLocation};
use crate::svg::{timeline_svg, SvgError};
use crate::timeline::PhaseOutcome;
use crate::unmanaged::Fate;

/// Why the CLI could not get a move done (as opposed to a move that ran and failed).
#[derive(Debug, Error)]
pub enum CliError {
    /// The daemon's socket cannot be reached.
    #[error("cannot reach the rdmamig daemon at {socket} (is `rdmamig daemon --socket {socket}` running?)")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// Talking to the daemon failed.
    #[error("talking to the rdmamig daemon failed")]
    Channel(#[from] ChannelError),
    /// The daemon refused the request.
    #[error("the rdmamig daemon refused: {reason}")]
    Rejected {
        /// Its reason.
        reason: String,
    },
    /// The daemon did not answer in time.
    #[error("the rdmamig daemon at {socket} did not answer within {seconds} s (see its log)")]
    TimedOut {
        /// The socket.
        socket: PathBuf,
        /// How long the client waited.
        seconds: u64,
    },
    /// The daemon closed the connection before the report.
    #[error("the rdmamig daemon closed the connection before the final report (see its log)")]
    NoReport,
    /// The daemon answered with a message that does not answer the request.
    #[error("the rdmamig daemon's answer to {request} does not fit the request")]
    Unexpected {
        /// The request.
        request: &'static str,
    },
    /// The timeline could not be drawn.
    #[error(transparent)]
    Svg(#[from] SvgError),
    /// The report file could not be written.
    #[error("cannot write the report to {path}")]
    WriteReport {
        /// The file.
        path: PathBuf,
        /// What write said.
        #[source]
        source: std::io::Error,
    },
}

/// How long a query (status, history, pool, report) may take, connecting included.
const QUERY_TIMEOUT: Duration = Duration::from_secs(30);

async fn connect(socket: &Path) -> Result<Channel<UnixStream>, CliError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| CliError::Connect {
            socket: socket.into(),
            source,
        })?;
    Ok(api::to_daemon(stream))
}

/// Runs `step` against the daemon at `socket` for at most `limit`.
async fn within<T>(
    limit: Duration,
    socket: &Path,
    step: impl std::future::Future<Output = Result<T, CliError>>,
) -> Result<T, CliError> {
    tokio::time::timeout(limit, step).await.unwrap_or_else(|_| {
        Err(CliError::TimedOut {
            socket: socket.into(),
            seconds: limit.as_secs(),
        })
    })
}

/// How to show progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Lines and a table for people.
    Text,
    /// One JSON object per event, then the report, one per line.
    Json,
}

/// Sends `plan` to the daemon at `socket`, prints progress to stdout, writes the report to
/// `report_path` if given, and returns the report.
pub async fn migrate(
    socket: &Path,
    plan: MovePlan,
    output: Output,
    report_path: Option<&Path>,
    svg_path: Option<&Path>,
) -> Result<MoveReport, CliError> {
    // The daemon speaks at least at every phase boundary; a move's silence longer than all
    // its deadlines together means the daemon is stuck. A phase's deadline may grow with
    // the connections (`Deadlines::for_move`): its start says how long it has.
    let mut silence = Duration::from_millis(
        Phase::WORKING
            .iter()
            .map(|&phase| plan.deadlines.of(phase).as_millis() as u64)
            .sum(),
    ) * 3
        + QUERY_TIMEOUT;
    let mut channel = within(QUERY_TIMEOUT, socket, connect(socket)).await?;
    channel
        .send(&ClientRequest::Migrate {
            plan: Box::new(plan),
        })
        .await?;
    let report = loop {
        match within(silence, socket, async { Ok(channel.receive().await?) }).await? {
            Some(DaemonMessage::Event { event }) => {
                if let MoveEvent::PhaseStarted { deadline_ms, .. } = &event {
                    silence = silence.max(Duration::from_millis(*deadline_ms) * 3 + QUERY_TIMEOUT);
                }
                match output {
                    Output::Text => println!("{}", render_event(&event)),
                    Output::Json => println!("{}", to_json(&event)),
                }
            }
            Some(DaemonMessage::Report { report }) => break *report,
            Some(DaemonMessage::Rejected { reason }) => return Err(CliError::Rejected { reason }),
            Some(
                DaemonMessage::Status { .. }
                | DaemonMessage::History { .. }
                | DaemonMessage::Pool { .. }
                | DaemonMessage::Returned { .. }
                | DaemonMessage::Assigned { .. },
            ) => return Err(CliError::Unexpected { request: "migrate" }),
            None => return Err(CliError::NoReport),
        }
    };
    match output {
        Output::Text => print!("{}", render_report(&report)),
        Output::Json => println!("{}", to_json(&report)),
    }
    if let Some(path) = report_path {
        write_report(&report, path)?;
    }
    if let Some(path) = svg_path {
        write_svg(&report, path)?;
    }
    Ok(report)
}

/// Runs `rdmamig migrate` (or a command that does the same, named `program` in messages)
/// for `plan` through the daemon at `socket`; the exit status says how the move ended:
/// 0 done, 4 rolled back, 1 failed, 3 the daemon could not be asked.
pub fn run_migrate(
    runtime: &tokio::runtime::Runtime,
    program: &str,
    socket: &Path,
    plan: MovePlan,
    flags: &OutputFlags,
) -> ExitCode {
    let output = if flags.json {
        Output::Json
    } else {
        Output::Text
    };
    let moved = migrate(
        socket,
        plan,
        output,
        flags.report.as_deref(),
        flags.svg.as_deref(),
    );
    match runtime.block_on(moved) {
        Ok(report) if report.ok => ExitCode::SUCCESS,
        Ok(report) => {
            eprintln!(
                "{program}: {}",
                report.error.as_deref().unwrap_or("the move failed")
            );
            if report.final_phase == Phase::RolledBack {
                ExitCode::from(4)
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("{program}: {}", error_chain(&e));
            ExitCode::from(3)
        }
    }
}

/// Writes the report as pretty JSON.
pub fn write_report(report: &MoveReport, path: &Path) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(report).unwrap_or_default();
    std::fs::write(path, text + "\n").map_err(|source| CliError::WriteReport {
        path: path.into(),
        source,
    })
}

/// Draws the report's timeline to an SVG file.
pub fn write_svg(report: &MoveReport, path: &Path) -> Result<(), CliError> {
    let svg = timeline_svg(report)?;
    std::fs::write(path, svg).map_err(|source| CliError::WriteReport {
        path: path.into(),
        source,
    })
}

/// Sends a one-answer request (status, history, report) and prints the answer.
/// `svg_path`: where to draw the timeline when the answer is a report.
pub async fn query(
    socket: &Path,
    request: ClientRequest,
    output: Output,
    svg_path: Option<&Path>,
) -> Result<(), CliError> {
    let asked = async {
        let mut channel = connect(socket).await?;
        channel.send(&request).await?;
        Ok::<_, CliError>(channel.receive::<DaemonMessage>().await?)
    };
    let answer = match within(QUERY_TIMEOUT, socket, asked).await? {
        Some(DaemonMessage::Rejected { reason }) => return Err(CliError::Rejected { reason }),
        Some(answer) => answer,
        None => return Err(CliError::NoReport),
    };
    if let (Some(path), DaemonMessage::Report { report }) = (svg_path, &answer) {
        write_svg(report, path)?;
    }
    match output {
        Output::Json => match &answer {
            DaemonMessage::Report { report } => println!("{}", to_json(report)),
            DaemonMessage::Status { moves, limit, held } => {
                println!(
                    "{}",
                    to_json(&serde_json::json!({"moves": moves, "limit": limit, "held": held}))
                );
            }
            DaemonMessage::History { moves } => println!("{}", to_json(moves)),
            DaemonMessage::Pool { functions } => println!("{}", to_json(functions)),
            other => println!("{}", to_json(other)),
        },
        Output::Text => print!("{}", render_answer(&answer)),
    }
    Ok(())
}

/// The text of a one-answer request's answer.
pub fn render_answer(answer: &DaemonMessage) -> String {
    let mut text = String::new();
    match answer {
        DaemonMessage::Status { moves, limit, held } => {
            let _ = writeln!(text, "{} moves running (limit {limit})", moves.len());
            for h in held {
                let _ = writeln!(
                    text,
                    "  HELD vm {}: its unfinished move's journal {} cannot be read ({}); check \
                     the VM and its devices by hand, then move the journal aside and restart \
                     the daemon",
                    h.vm, h.journal, h.reason
                );
            }
            for m in moves {
                let _ = writeln!(
                    text,
                    "  {}  vm {}  phase {}{}",
                    m.id,
                    m.vm,
                    m.phase,
                    if m.recovering {
                        "  (recovering after a restart)"
                    } else {
                        ""
                    }
                );
            }
        }
        DaemonMessage::History { moves } => {
            if moves.is_empty() {
                let _ = writeln!(text, "no move has ended yet");
            }
            for m in moves {
                let casualties = if m.casualties > 0 {
                    format!(" ({} unmanaged programs ended or broken)", m.casualties)
                } else {
                    String::new()
                };
                let _ = writeln!(
                    text,
                    "{}  vm {}  {}{casualties}  {} ms{}",
                    m.id,
                    m.vm,
                    m.outcome,
                    m.total_ms,
                    m.error
                        .as_ref()
                        .map(|e| format!("  {e}"))
                        .unwrap_or_default()
                );
            }
        }
        DaemonMessage::Pool { functions } => {
            if functions.is_empty() {
                let _ = writeln!(text, "the pool has no functions (see [pool] in the config)");
            }
            for f in functions {
                let how = match &f.attachment {
                    Attachment::Vfio { pci } => format!("vfio {pci}"),
                    Attachment::Emulated { properties } => format!(
                        "emulated {}",
                        properties
                            .iter()
                            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                };
                let state = match &f.state {
                    FunctionState::Free => "free".to_string(),
                    FunctionState::Reserved {
                        move_id,
                        expires_unix_ms,
                    } => format!("reserved for move {move_id} until {expires_unix_ms} (unix ms)"),
                    FunctionState::Attached { vm } => format!("attached to VM {vm}"),
                    FunctionState::Quarantined { reason } => format!("QUARANTINED: {reason}"),
                };
                let _ = writeln!(text, "{:<12} {:<40} {state}", f.name, how);
            }
        }
        DaemonMessage::Returned { function, check } => {
            let _ = writeln!(text, "{function}: {check}; back in the pool (free)");
        }
        DaemonMessage::Assigned { function, vm } => {
            let _ = writeln!(text, "{function}: attached to VM {vm}");
        }
        DaemonMessage::Report { report } => text = render_report(report),
        DaemonMessage::Event { event } => text = render_event(event) + "\n",
        DaemonMessage::Rejected { reason } => text = format!("refused: {reason}\n"),
    }
    text
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// One progress line.
pub fn render_event(event: &MoveEvent) -> String {
    match event {
        MoveEvent::PhaseStarted {
            phase,
            at_ms,
            deadline_ms,
            ..
        } => format!("[{at_ms:>6} ms] {phase:<8} started (deadline {deadline_ms} ms)"),
        MoveEvent::PhaseEnded { at_ms, record } => {
            let phase = record.phase;
            match &record.outcome {
                PhaseOutcome::Ok => format!(
                    "[{at_ms:>6} ms] {phase:<8} ok in {} ms{}",
                    record.duration_ms,
                    match render_details(&record.details) {
                        d if d.is_empty() => String::new(),
                        d => format!(" ({d})"),
                    }
                ),
                PhaseOutcome::Skipped { reason } => {
                    format!("[{at_ms:>6} ms] {phase:<8} skipped: {reason}")
                }
                PhaseOutcome::Forced { reason } => format!(
                    "[{at_ms:>6} ms] {phase:<8} FORCED after {} ms: {reason}",
                    record.duration_ms
                ),
                PhaseOutcome::Failed { error } => format!(
                    "[{at_ms:>6} ms] {phase:<8} FAILED after {} ms: {error}",
                    record.duration_ms
                ),
            }
        }
        MoveEvent::Migration { at_ms, progress } => {
            let mut line = format!("[{at_ms:>6} ms] migrate  {}", progress.status);
            if let Some(sent) = progress.ram_transferred {
                let _ = write!(line, ": {} sent", mib(sent));
            }
            if let Some(left) = progress.ram_remaining.filter(|left| *left > 0) {
                let _ = write!(line, ", {} left", mib(left));
            }
            if let Some(total) = progress.total_time_ms {
                let _ = write!(line, ", {total} ms");
            }
            if let Some(down) = progress.downtime_ms {
                let _ = write!(line, ", downtime {down} ms");
            }
            if let Some(error) = &progress.error {
                let _ = write!(line, ": {error}");
            }
            line
        }
        MoveEvent::Warning { at_ms, message } => format!("[{at_ms:>6} ms] warning: {message}"),
    }
}

/// The timeline table and the verdict.
pub fn render_report(report: &MoveReport) -> String {
    let start = report.timeline.started_unix_ms;
    let mut text = String::new();
    let strategy = match &report.chosen {
        Some(choice) if choice.strategy != report.plan.strategy => {
            format!("{} strategy: {}", report.plan.strategy, choice.strategy)
        }
        _ => format!("{} strategy", report.plan.strategy),
    };
    let _ = writeln!(text, "\nmove of {} ({strategy}), timeline:", report.plan.vm);
    let _ = writeln!(
        text,
        "  {:<8} {:>9} {:>11} {:>10}  {:<8} details",
        "phase", "start", "duration", "deadline", "result"
    );
    for record in &report.timeline.phases {
        let result = match &record.outcome {
            PhaseOutcome::Ok => "ok",
            PhaseOutcome::Skipped { .. } => "skipped",
            PhaseOutcome::Forced { .. } => "FORCED",
            PhaseOutcome::Failed { .. } => "FAILED",
        };
        let line = format!(
            "  {:<8} {:>9} {:>11} {:>10}  {:<8} {}",
            record.phase.name(),
            format!("+{} ms", record.started_unix_ms.saturating_sub(start)),
            format!("{} ms", record.duration_ms),
            format!("{} ms", record.deadline_ms),
            result,
            render_details(&record.details)
        );
        let _ = writeln!(text, "{}", line.trim_end());
    }
    let _ = writeln!(
        text,
        "  {:<8} {:>9} {:>11}",
        "total",
        "",
        format!("{} ms", report.timeline.total_ms)
    );
    let location = match report.vm_location {
        VmLocation::Source => "the VM is on the source",
        VmLocation::Destination => "the VM is on the destination",
    };
    if let Some(choice) = report
        .chosen
        .as_ref()
        .filter(|c| c.strategy != report.plan.strategy)
    {
        let _ = writeln!(text, "strategy: {}", choice.reason);
    }
    for forced in &report.forced {
        let _ = writeln!(text, "forced path in {}: {}", forced.phase, forced.reason);
    }
    if let Some(phase) = report.recovered_from {
        let _ = writeln!(
            text,
            "the migrator restarted during {phase} and finished this move from its journal"
        );
    }
    for program in &report.unmanaged {
        let fate = match program.fate {
            Fate::Untouched => "untouched (still running)".to_string(),
            Fate::Ended => format!(
                "ENDED by the move ({})",
                program.action.as_deref().unwrap_or("no action given")
            ),
            Fate::NotEnded => format!(
                "could not be ended ({})",
                program.action.as_deref().unwrap_or("no action given")
            ),
            Fate::Broken => "BROKEN by the move (its device was unplugged)".to_string(),
        };
        let _ = writeln!(text, "unmanaged program {}: {fate}", program.named());
    }
    let error = report.error.as_deref().unwrap_or("no error given");
    match report.final_phase {
        Phase::Done => {
            let casualties = report.casualties().count();
            let but = if casualties > 0 {
                format!(", but it ended or broke {casualties} unmanaged RDMA program(s) (above)")
            } else {
                String::new()
            };
            let _ = writeln!(
                text,
                "move {} done in {} ms{but}; {location}",
                report.id, report.timeline.total_ms
            );
        }
        Phase::RolledBack => {
            let _ = writeln!(
                text,
                "move {} ROLLED BACK: {error}; {location} as before the move (device and connections back)",
                report.id
            );
        }
        _ => {
            let _ = writeln!(text, "move {} FAILED: {error}; {location}", report.id);
            if let Some(rollback) = &report.rollback_error {
                let _ = writeln!(text, "the rollback failed too: {rollback}");
            }
        }
    }
    text
}

fn render_details(details: &Map<String, Value>) -> String {
    details
        .iter()
        .map(|(key, value)| match value {
            Value::String(s) => format!("{key}={s}"),
            other => format!("{key}={other}"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn mib(bytes: u64) -> String {
    // Display only: precision loss above 2^52 bytes does not matter.
    #[allow(clippy::cast_precision_loss)]
    let value = bytes as f64 / (1024.0 * 1024.0);
    format!("{value:.1} MiB")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_query_to_a_daemon_that_never_answers_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("silent.sock");
        // Connections wait in its backlog; nothing ever answers.
        let _silent = tokio::net::UnixListener::bind(&socket).unwrap();
        let err = query(&socket, ClientRequest::Status, Output::Json, None)
            .await
            .unwrap_err();
        assert!(
            matches!(err, CliError::TimedOut { seconds: 30, .. }),
            "{err}"
        );
    }
    use crate::plan::{Deadlines, Endpoint, Strategy};
    use crate::timeline::{PhaseRecord, Timeline};
    use rdmamig_vmm::{DeviceSpec, MigrationProgress, MigrationStatus};

    fn record(phase: Phase, start: u64, duration: u64, outcome: PhaseOutcome) -> PhaseRecord {
        let mut details = Map::new();
        if phase == Phase::Detach {
            details.insert("device".into(), "nic0".into());
        }
        PhaseRecord {
            phase,
            started_unix_ms: 1000 + start,
            ended_unix_ms: 1000 + start + duration,
            duration_ms: duration,
            deadline_ms: 5000,
            outcome,
            details,
        }
    }

    #[test]
    fn progress_lines() {
        let started = MoveEvent::PhaseStarted {
            phase: Phase::Detach,
            unix_ms: 1,
            at_ms: 12,
            deadline_ms: 5000,
        };
        assert_eq!(
            render_event(&started),
            "[    12 ms] detach   started (deadline 5000 ms)"
        );
        let ended = MoveEvent::PhaseEnded {
            at_ms: 140,
            record: record(Phase::Detach, 12, 128, PhaseOutcome::Ok),
        };
        assert_eq!(
            render_event(&ended),
            "[   140 ms] detach   ok in 128 ms (device=nic0)"
        );
        let progress = MoveEvent::Migration {
            at_ms: 300,
            progress: MigrationProgress {
                status: MigrationStatus::Active,
                total_time_ms: Some(100),
                setup_time_ms: None,
                downtime_ms: None,
                ram_transferred: Some(3 << 20),
                ram_remaining: Some(1 << 20),
                ram_total: None,
                mbps: None,
                ram_syncs: None,
                error: None,
                vm_stopped_at: None,
            },
        };
        assert_eq!(
            render_event(&progress),
            "[   300 ms] migrate  active: 3.0 MiB sent, 1.0 MiB left, 100 ms"
        );
    }

    #[test]
    fn the_table_has_every_phase_and_the_total() {
        let report = MoveReport {
            id: "m1".into(),
            plan: MovePlan {
                vm: "vm1".into(),
                source: Endpoint::Qemu {
                    qmp: "/s".into(),
                    agent: None,
                },
                destination: Some(Endpoint::Qemu {
                    qmp: "/d".into(),
                    agent: None,
                }),
                destination_migrator: None,
                detach: "nic0".into(),
                attach: Some(DeviceSpec::parse("driver=e1000e,id=nic1").unwrap()),
                reattach: None,
                migration: Default::default(),
                from_pool: false,
                source_function: None,
                unmanaged: None,
                via: "unix:/m".into(),
                limits: Default::default(),
                strategy: Strategy::Naive,
                deadlines: Deadlines::default(),
            },
            ok: false,
            final_phase: Phase::Failed,
            failed_phase: Some(Phase::Detach),
            rollback_error: None,
            forced: vec![],
            recovered_from: None,
            function: None,
            chosen: None,
            error: Some("phase detach missed its deadline of 5000 ms: the guest did not release device nic0".into()),
            vm_location: VmLocation::Source,
            timeline: Timeline {
                started_unix_ms: 1000,
                ended_unix_ms: 6100,
                total_ms: 5100,
                phases: vec![
                    record(Phase::Prepare, 0, 20, PhaseOutcome::Ok),
                    record(Phase::Quiesce, 20, 0, PhaseOutcome::Skipped { reason: "naive".into() }),
                    record(Phase::Detach, 20, 5001, PhaseOutcome::Failed { error: "x".into() }),
                ],
            },
            connections: vec![],
            quiesce: vec![],
            resume: vec![],
            migration: None,
            unmanaged: vec![],
        };
        let text = render_report(&report);
        assert!(
            text.contains("  prepare      +0 ms       20 ms    5000 ms  ok\n"),
            "{text}"
        );
        assert!(
            text.contains("  quiesce     +20 ms        0 ms    5000 ms  skipped\n"),
            "{text}"
        );
        assert!(
            text.contains("  detach      +20 ms     5001 ms    5000 ms  FAILED   device=nic0\n"),
            "{text}"
        );
        assert!(
            text.contains("  total                  5100 ms\n"),
            "{text}"
        );
        assert!(text.contains("move m1 FAILED: phase detach missed its deadline of 5000 ms: the guest did not release device nic0; the VM is on the source"), "{text}");
    }
}
