//! The move's timeline: when each phase started and ended, how long it took, what it found.
//!
//! Timestamps are wall-clock milliseconds since the epoch, so they can be laid next to what
//! applications in the guests and on peers logged; durations come from the monotonic clock,
//! so a clock step during a move does not distort them.

use std::time::Instant;

use rdmamig_proto::clock::{millis, unix_ms};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::machine::Phase;

/// How a phase ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum PhaseOutcome {
    /// The phase did its work.
    Ok,
    /// The strategy has nothing to do in this phase.
    Skipped {
        /// Why.
        reason: String,
    },
    /// The deadline passed or the guest did not cooperate, and the phase took its forced
    /// path (the move went on without what it waited for).
    Forced {
        /// What was forced and why.
        reason: String,
    },
    /// The phase failed; the move stopped here.
    Failed {
        /// The error, with its causes.
        error: String,
    },
}

/// One phase in the timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseRecord {
    /// The phase.
    pub phase: Phase,
    /// When it started, ms since the epoch.
    pub started_unix_ms: u64,
    /// When it ended, ms since the epoch.
    pub ended_unix_ms: u64,
    /// How long it took (monotonic clock), ms.
    pub duration_ms: u64,
    /// Its deadline, ms.
    pub deadline_ms: u64,
    /// How it ended.
    pub outcome: PhaseOutcome,
    /// What it found (device ids, connection counts, migration figures).
    pub details: Map<String, Value>,
}

/// The whole move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// When the move started, ms since the epoch.
    pub started_unix_ms: u64,
    /// When it ended, ms since the epoch (0 while running).
    pub ended_unix_ms: u64,
    /// Its duration (monotonic clock), ms.
    pub total_ms: u64,
    /// The phases, in the order they ran.
    pub phases: Vec<PhaseRecord>,
}

impl Timeline {
    /// The record of `phase`, if it ran.
    pub fn phase(&self, phase: Phase) -> Option<&PhaseRecord> {
        self.phases.iter().find(|r| r.phase == phase)
    }
}

/// Builds a [`Timeline`] while the move runs.
#[derive(Debug)]
pub struct TimelineRecorder {
    start: Instant,
    timeline: Timeline,
    open: Option<(Phase, Instant, u64, u64)>,
}

impl TimelineRecorder {
    /// Starts the clock.
    pub fn start() -> TimelineRecorder {
        TimelineRecorder {
            start: Instant::now(),
            timeline: Timeline {
                started_unix_ms: unix_ms(),
                ended_unix_ms: 0,
                total_ms: 0,
                phases: Vec::new(),
            },
            open: None,
        }
    }

    /// Goes on with `earlier`, the timeline of the same move's first part in another
    /// process (a workflow's `pre-migrate`): its phases stay, and times count from its start.
    pub fn continuing(earlier: Timeline) -> TimelineRecorder {
        let since =
            std::time::Duration::from_millis(unix_ms().saturating_sub(earlier.started_unix_ms));
        let now = Instant::now();
        TimelineRecorder {
            start: now.checked_sub(since).unwrap_or(now),
            timeline: Timeline {
                ended_unix_ms: 0,
                total_ms: 0,
                ..earlier
            },
            open: None,
        }
    }

    /// When the move started (monotonic clock).
    pub fn started_at(&self) -> Instant {
        self.start
    }

    /// Milliseconds since the move started.
    pub fn elapsed_ms(&self) -> u64 {
        millis(self.start.elapsed())
    }

    /// Opens `phase`. Returns its start time (ms since the epoch).
    pub fn begin(&mut self, phase: Phase, deadline_ms: u64) -> u64 {
        let now = unix_ms();
        self.open = Some((phase, Instant::now(), now, deadline_ms));
        now
    }

    /// Closes the open phase with its outcome and details. Returns the record, or `None` if
    /// no phase was open.
    pub fn end(
        &mut self,
        outcome: PhaseOutcome,
        details: Map<String, Value>,
    ) -> Option<&PhaseRecord> {
        let (phase, start, started_unix_ms, deadline_ms) = self.open.take()?;
        self.timeline.phases.push(PhaseRecord {
            phase,
            started_unix_ms,
            ended_unix_ms: unix_ms(),
            duration_ms: millis(start.elapsed()),
            deadline_ms,
            outcome,
            details,
        });
        self.timeline.phases.last()
    }

    /// Stops the clock and returns the timeline.
    pub fn finish(mut self) -> Timeline {
        self.timeline.ended_unix_ms = unix_ms();
        self.timeline.total_ms = self.elapsed_ms();
        self.timeline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_phases_in_order_with_times() {
        let mut rec = TimelineRecorder::start();
        assert!(rec.end(PhaseOutcome::Ok, Map::new()).is_none());
        let started = rec.begin(Phase::Prepare, 100);
        let mut details = Map::new();
        details.insert("connections".into(), 2.into());
        let record = rec.end(PhaseOutcome::Ok, details).unwrap().clone();
        assert_eq!(record.phase, Phase::Prepare);
        assert_eq!(record.started_unix_ms, started);
        assert!(record.ended_unix_ms >= started);
        assert_eq!(record.deadline_ms, 100);
        assert_eq!(record.details["connections"], 2);
        rec.begin(Phase::Quiesce, 5);
        rec.end(
            PhaseOutcome::Skipped {
                reason: "naive".into(),
            },
            Map::new(),
        );
        let timeline = rec.finish();
        assert_eq!(timeline.phases.len(), 2);
        assert!(timeline.ended_unix_ms >= timeline.started_unix_ms);
        let json = serde_json::to_value(&timeline).unwrap();
        assert_eq!(json["phases"][1]["outcome"]["result"], "skipped");
        assert_eq!(serde_json::from_value::<Timeline>(json).unwrap(), timeline);
    }
}
