//! Prometheus metrics of the daemon: moves by outcome, phase durations, the switching time
//! the migrator saw, forced paths, unmanaged programs by fate, running moves.
//!
//! Kept as plain counters folded from each move's report and rendered in the text
//! exposition format (version 0.0.4), served on a TCP address of the operator's choosing
//! (`rdmamig daemon --metrics 127.0.0.1:9477`). The switching time here is the migrator's
//! view, from the start of the detach to the end of the resume: the window in which the
//! guest's RDMA path is down. What applications saw is measured by them (docs/testbed.md).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::machine::Phase;
use crate::report::MoveReport;
use crate::unmanaged::Fate;

/// The daemon's counters.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Metrics {
    moves: BTreeMap<&'static str, u64>,
    phase_ms: BTreeMap<&'static str, (u64, u64)>,
    forced: BTreeMap<&'static str, u64>,
    switching_ms: (u64, u64),
    recovered: u64,
    unmanaged: BTreeMap<&'static str, u64>,
}

impl Metrics {
    /// Folds one ended move in.
    pub fn record(&mut self, report: &MoveReport) {
        *self.moves.entry(report.final_phase.name()).or_default() += 1;
        for record in &report.timeline.phases {
            let entry = self.phase_ms.entry(record.phase.name()).or_default();
            entry.0 += record.duration_ms;
            entry.1 += 1;
        }
        for forced in &report.forced {
            *self.forced.entry(forced.phase.name()).or_default() += 1;
        }
        if report.recovered_from.is_some() {
            self.recovered += 1;
        }
        for program in &report.unmanaged {
            *self.unmanaged.entry(program.fate.name()).or_default() += 1;
        }
        if report.final_phase == Phase::Done {
            let start = report
                .timeline
                .phase(Phase::Detach)
                .map(|p| p.started_unix_ms);
            let end = report
                .timeline
                .phase(Phase::Resume)
                .map(|p| p.ended_unix_ms);
            if let (Some(start), Some(end)) = (start, end) {
                self.switching_ms.0 += end.saturating_sub(start);
                self.switching_ms.1 += 1;
            }
        }
    }

    /// The text exposition, with `running` moves in progress.
    pub fn render(&self, running: usize) -> String {
        let mut text = String::new();
        let mut family = |name: &str, kind: &str, help: &str| {
            let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} {kind}");
            name.to_string()
        };
        let name = family(
            "rdmamig_moves_total",
            "counter",
            "Moves that ended, by outcome (done, rolled_back, failed).",
        );
        let mut body = String::new();
        for outcome in ["done", "rolled_back", "failed"] {
            let n = self.moves.get(outcome).copied().unwrap_or(0);
            let _ = writeln!(body, "{name}{{outcome=\"{outcome}\"}} {n}");
        }
        let name = family(
            "rdmamig_phase_duration_ms",
            "summary",
            "Time spent in each phase, ms.",
        );
        for (phase, (sum, count)) in &self.phase_ms {
            let _ = writeln!(body, "{name}_sum{{phase=\"{phase}\"}} {sum}");
            let _ = writeln!(body, "{name}_count{{phase=\"{phase}\"}} {count}");
        }
        let name = family(
            "rdmamig_forced_paths_total",
            "counter",
            "Forced paths taken, by phase.",
        );
        for (phase, n) in &self.forced {
            let _ = writeln!(body, "{name}{{phase=\"{phase}\"}} {n}");
        }
        let name = family(
            "rdmamig_switching_ms",
            "summary",
            "Detach start to resume end of completed moves (RDMA path down), ms.",
        );
        let _ = writeln!(body, "{name}_sum {}", self.switching_ms.0);
        let _ = writeln!(body, "{name}_count {}", self.switching_ms.1);
        let name = family(
            "rdmamig_recovered_moves_total",
            "counter",
            "Moves a restarted daemon finished or rolled back from the journal.",
        );
        let _ = writeln!(body, "{name} {}", self.recovered);
        let name = family(
            "rdmamig_unmanaged_programs_total",
            "counter",
            "RDMA programs without the library that moves found, by what the move did to them \
             (untouched, ended, not_ended, broken).",
        );
        for fate in [Fate::Untouched, Fate::Ended, Fate::NotEnded, Fate::Broken] {
            let n = self.unmanaged.get(fate.name()).copied().unwrap_or(0);
            let _ = writeln!(body, "{name}{{fate=\"{}\"}} {n}", fate.name());
        }
        let name = family("rdmamig_moves_running", "gauge", "Moves in progress.");
        let _ = writeln!(body, "{name} {running}");
        // The HELP/TYPE lines were gathered first; interleave them with their samples.
        interleave(&text, &body)
    }
}

/// Puts each family's samples right after its `# TYPE` line.
fn interleave(headers: &str, samples: &str) -> String {
    let mut out = String::new();
    let mut lines = headers.lines();
    while let (Some(help), Some(kind)) = (lines.next(), lines.next()) {
        let name = kind.split_whitespace().nth(2).unwrap_or_default();
        let _ = writeln!(out, "{help}\n{kind}");
        for sample in samples.lines() {
            let metric = sample.split(['{', ' ']).next().unwrap_or_default();
            if metric == name
                || metric
                    .strip_prefix(name)
                    .is_some_and(|rest| rest == "_sum" || rest == "_count")
            {
                let _ = writeln!(out, "{sample}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::plan;
    use crate::report::{ForcedPath, VmLocation};
    use crate::timeline::{PhaseOutcome, PhaseRecord, Timeline};
    use crate::unmanaged::ProgramReport;
    use rdmamig_proto::agent::UnmanagedProgram;
    use serde_json::Map;

    fn report(final_phase: Phase, phases: &[(Phase, u64, u64)]) -> MoveReport {
        MoveReport {
            id: "m".into(),
            plan: plan(),
            ok: final_phase == Phase::Done,
            final_phase,
            failed_phase: None,
            error: None,
            rollback_error: None,
            vm_location: VmLocation::Source,
            forced: vec![ForcedPath {
                phase: Phase::Quiesce,
                reason: "x".into(),
            }],
            recovered_from: None,
            function: None,
            chosen: None,
            timeline: Timeline {
                started_unix_ms: 0,
                ended_unix_ms: 0,
                total_ms: 0,
                phases: phases
                    .iter()
                    .map(|(phase, start, end)| PhaseRecord {
                        phase: *phase,
                        started_unix_ms: *start,
                        ended_unix_ms: *end,
                        duration_ms: end - start,
                        deadline_ms: 1,
                        outcome: PhaseOutcome::Ok,
                        details: Map::new(),
                    })
                    .collect(),
            },
            connections: vec![],
            quiesce: vec![],
            resume: vec![],
            migration: None,
            unmanaged: vec![],
        }
    }

    #[test]
    fn the_exposition_has_every_family_with_its_samples() {
        let mut metrics = Metrics::default();
        metrics.record(&report(
            Phase::Done,
            &[(Phase::Detach, 100, 300), (Phase::Resume, 900, 1000)],
        ));
        let mut refused = report(Phase::RolledBack, &[(Phase::Detach, 0, 50)]);
        let program = |pid, fate| ProgramReport {
            program: UnmanagedProgram {
                pid,
                command: "rping -c".into(),
                devices: vec!["rdma_cm".into()],
                open_context: false,
            },
            fate,
            action: None,
        };
        refused.unmanaged = vec![program(1, Fate::Untouched), program(2, Fate::Broken)];
        metrics.record(&refused);
        let text = metrics.render(2);
        for line in [
            "# TYPE rdmamig_moves_total counter",
            "rdmamig_moves_total{outcome=\"done\"} 1",
            "rdmamig_moves_total{outcome=\"rolled_back\"} 1",
            "rdmamig_moves_total{outcome=\"failed\"} 0",
            "rdmamig_phase_duration_ms_sum{phase=\"detach\"} 250",
            "rdmamig_phase_duration_ms_count{phase=\"detach\"} 2",
            "rdmamig_forced_paths_total{phase=\"quiesce\"} 2",
            "rdmamig_switching_ms_sum 900",
            "rdmamig_switching_ms_count 1",
            "rdmamig_moves_running 2",
            "rdmamig_unmanaged_programs_total{fate=\"untouched\"} 1",
            "rdmamig_unmanaged_programs_total{fate=\"broken\"} 1",
            "rdmamig_unmanaged_programs_total{fate=\"ended\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
        // Every sample follows its own family's TYPE line.
        let type_of = |sample: &str| {
            let lines: Vec<&str> = text.lines().collect();
            let at = lines.iter().position(|l| *l == sample).unwrap();
            lines[..at]
                .iter()
                .rev()
                .find(|l| l.starts_with("# TYPE"))
                .unwrap()
                .to_string()
        };
        assert_eq!(
            type_of("rdmamig_switching_ms_count 1"),
            "# TYPE rdmamig_switching_ms summary"
        );
    }
}
