//! The SVG timeline of a move: one bar per phase on a common time axis, coloured by how the
//! phase ended, drawn with plotters' SVG backend.
//!
//! An operator looking at a failed or slow move wants to see at a glance which phase took the
//! time and which one failed, was forced, or was rolled back; the JSON report has the numbers,
//! this picture has the shape. Only plotters' primitives are used (rectangles, lines, text),
//! so no font files are needed: the SVG backend writes text as SVG text.

use plotters::prelude::*;

use crate::machine::Phase;
use crate::report::MoveReport;
use crate::timeline::PhaseOutcome;

const WIDTH: u32 = 900;
const ROW: u32 = 34;
const LEFT: i32 = 110;
const RIGHT: i32 = 20;
const TOP: i32 = 50;

/// Why the picture could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw the SVG timeline: {0}")]
pub struct SvgError(String);

/// Draws the report's timeline as an SVG document.
pub fn timeline_svg(report: &MoveReport) -> Result<String, SvgError> {
    let phases = &report.timeline.phases;
    let rows = u32::try_from(phases.len()).unwrap_or(u32::MAX).max(1);
    let height = u32::try_from(TOP).unwrap_or(0) + rows * ROW + 40;
    let start = report.timeline.started_unix_ms;
    let span = phases
        .iter()
        .map(|p| p.ended_unix_ms.saturating_sub(start))
        .max()
        .unwrap_or(0)
        .max(report.timeline.total_ms)
        .max(1);
    let plot_width = i64::from(WIDTH) - i64::from(LEFT) - i64::from(RIGHT);
    let x = |ms: u64| -> i32 {
        let offset = i64::try_from(ms.min(span)).unwrap_or(0) * plot_width
            / i64::try_from(span).unwrap_or(1);
        LEFT + i32::try_from(offset).unwrap_or(0)
    };
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, height)).into_drawing_area();
        let draw = |e: plotters::drawing::DrawingAreaErrorKind<_>| SvgError(e.to_string());
        root.fill(&WHITE).map_err(draw)?;
        let title = format!(
            "move {} of {} ({}): {} in {} ms",
            report.id,
            report.plan.vm,
            report.plan.strategy,
            report.final_phase.name(),
            report.timeline.total_ms
        );
        root.draw(&Text::new(title, (10, 18), ("sans-serif", 16).into_font()))
            .map_err(draw)?;
        let axis_y = TOP + i32::try_from(rows * ROW).unwrap_or(0) + 6;
        root.draw(&PathElement::new(
            vec![(LEFT, axis_y), (x(span), axis_y)],
            BLACK.stroke_width(1),
        ))
        .map_err(draw)?;
        for tick in 0..=4u64 {
            let ms = span * tick / 4;
            root.draw(&Text::new(
                format!("{ms} ms"),
                (x(ms) - 12, axis_y + 8),
                ("sans-serif", 11).into_font(),
            ))
            .map_err(draw)?;
        }
        for (row, record) in phases.iter().enumerate() {
            let y = TOP + i32::try_from(row).unwrap_or(0) * i32::try_from(ROW).unwrap_or(0);
            let from = x(record.started_unix_ms.saturating_sub(start));
            let to = x(record.ended_unix_ms.saturating_sub(start)).max(from + 2);
            let (color, verdict) = match &record.outcome {
                PhaseOutcome::Ok if record.phase == Phase::Rollback => (BLUE, "rolled back"),
                PhaseOutcome::Ok => (GREEN, "ok"),
                PhaseOutcome::Skipped { .. } => (RGBColor(170, 170, 170), "skipped"),
                PhaseOutcome::Forced { .. } => (RGBColor(230, 140, 0), "FORCED"),
                PhaseOutcome::Failed { .. } => (RED, "FAILED"),
            };
            root.draw(&Text::new(
                record.phase.name().to_string(),
                (10, y + 8),
                ("sans-serif", 13).into_font(),
            ))
            .map_err(draw)?;
            root.draw(&Rectangle::new(
                [(from, y + 2), (to, y + ROW as i32 - 8)],
                color.filled(),
            ))
            .map_err(draw)?;
            let label = format!("{} ms {verdict}", record.duration_ms);
            let label_x = if to + 150 < i32::try_from(WIDTH).unwrap_or(0) {
                to + 6
            } else {
                from - 150
            };
            root.draw(&Text::new(
                label,
                (label_x, y + 8),
                ("sans-serif", 12).into_font(),
            ))
            .map_err(draw)?;
        }
        root.present().map_err(draw)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::plan;
    use crate::report::VmLocation;
    use crate::timeline::{PhaseRecord, Timeline};
    use serde_json::Map;

    #[test]
    fn every_phase_is_a_coloured_bar_with_its_label() {
        let phases = [
            (Phase::Prepare, 0, 80, PhaseOutcome::Ok),
            (
                Phase::Quiesce,
                80,
                160,
                PhaseOutcome::Forced {
                    reason: "silent".into(),
                },
            ),
            (Phase::Detach, 160, 370, PhaseOutcome::Ok),
            (
                Phase::Migrate,
                370,
                470,
                PhaseOutcome::Failed { error: "x".into() },
            ),
            (Phase::Rollback, 470, 700, PhaseOutcome::Ok),
        ];
        let report = MoveReport {
            id: "m7".into(),
            plan: plan(),
            ok: false,
            final_phase: Phase::RolledBack,
            failed_phase: Some(Phase::Migrate),
            error: None,
            rollback_error: None,
            vm_location: VmLocation::Source,
            forced: vec![],
            recovered_from: None,
            function: None,
            chosen: None,
            timeline: Timeline {
                started_unix_ms: 1000,
                ended_unix_ms: 1700,
                total_ms: 700,
                phases: phases
                    .iter()
                    .map(|(phase, from, to, outcome)| PhaseRecord {
                        phase: *phase,
                        started_unix_ms: 1000 + from,
                        ended_unix_ms: 1000 + to,
                        duration_ms: to - from,
                        deadline_ms: 100,
                        outcome: outcome.clone(),
                        details: Map::new(),
                    })
                    .collect(),
            },
            connections: vec![],
            quiesce: vec![],
            resume: vec![],
            migration: None,
            unmanaged: vec![],
        };
        let svg = timeline_svg(&report).unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("move m7 of vm1 (reconnect): rolled_back in 700 ms"));
        for label in [
            "80 ms ok",
            "80 ms FORCED",
            "210 ms ok",
            "100 ms FAILED",
            "230 ms rolled back",
            "rollback",
            "700 ms",
        ] {
            assert!(svg.contains(label), "{label}\n{svg}");
        }
        assert_eq!(svg.matches("<rect").count(), 1 + phases.len(), "{svg}");
    }
}
