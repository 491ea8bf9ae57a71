//! Unmanaged programs: guest processes that hold an RDMA device without rdmamig's library
//! (an rping, a raw-verbs tool). A move breaks them: their connections die with the device,
//! and a verbs context they hold keeps the unplug from completing. The agent lists them at
//! prepare and again right before the unplug; the move's [`UnmanagedPolicy`] decides
//! (refuse, end them, or go on and mark them broken), and the report tells what became of
//! each, so that an operator never learns it from the application's logs.

use rdmamig_proto::agent::{DeviceHolder, UnmanagedProgram};
use serde::{Deserialize, Serialize};

/// What became of one unmanaged program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// The move did not touch it: it was refused, or rolled back before the unplug.
    Untouched,
    /// The move ended it before the unplug (policy `release`).
    Ended,
    /// The move tried to end it and it still held the device.
    NotEnded,
    /// The device was unplugged under it: its RDMA state is gone.
    Broken,
}

impl Fate {
    /// The name metrics and the CLI use.
    pub fn name(self) -> &'static str {
        match self {
            Fate::Untouched => "untouched",
            Fate::Ended => "ended",
            Fate::NotEnded => "not_ended",
            Fate::Broken => "broken",
        }
    }
}

/// One unmanaged program a move found, and its fate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramReport {
    /// What the agent said about it (untrusted guest text, made printable).
    #[serde(flatten)]
    pub program: UnmanagedProgram,
    /// What the move did to it.
    pub fate: Fate,
    /// How it was ended, as the agent tells (`SIGTERM`, `SIGTERM, SIGKILL after 1000 ms`).
    #[serde(default)]
    pub action: Option<String>,
}

impl ProgramReport {
    /// `PID 12 (rping -c -a 10.0.0.1) on rdma_cm, uverbs0`.
    pub fn named(&self) -> String {
        describe(&self.program)
    }
}

/// `PID 12 (rping -c -a 10.0.0.1) on rdma_cm, uverbs0`.
pub fn describe(program: &UnmanagedProgram) -> String {
    format!(
        "PID {} ({}) on {}",
        program.pid,
        program.command,
        program.devices.join(", ")
    )
}

/// The unmanaged programs one move has found so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    programs: Vec<ProgramReport>,
}

impl Found {
    /// Adds what the agent listed (a program already known by PID stays as it is); returns
    /// how many were new.
    pub fn add(&mut self, listed: Vec<UnmanagedProgram>) -> usize {
        let before = self.programs.len();
        for program in listed {
            if !self.programs.iter().any(|p| p.program.pid == program.pid) {
                self.programs.push(ProgramReport {
                    program,
                    fate: Fate::Untouched,
                    action: None,
                });
            }
        }
        self.programs.len() - before
    }

    /// Takes back what an earlier report of the same move said (a workflow's move goes on
    /// in another process).
    pub fn add_reports(&mut self, reports: Vec<ProgramReport>) {
        for report in reports {
            if !self
                .programs
                .iter()
                .any(|p| p.program.pid == report.program.pid)
            {
                self.programs.push(report);
            }
        }
    }

    /// How many were found.
    pub fn len(&self) -> usize {
        self.programs.len()
    }

    /// Whether none were found.
    pub fn is_empty(&self) -> bool {
        self.programs.is_empty()
    }

    /// Every program found, one after another, for an error or a log line.
    pub fn named(&self) -> String {
        self.programs
            .iter()
            .map(ProgramReport::named)
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Records the agent's release: each program it ended (or could not end).
    pub fn released(&mut self, holders: &[DeviceHolder]) {
        for report in &mut self.programs {
            if let Some(holder) = holders.iter().find(|h| h.pid == report.program.pid) {
                report.fate = if holder.released {
                    Fate::Ended
                } else {
                    Fate::NotEnded
                };
                report.action = Some(holder.action.clone());
            }
        }
    }

    /// The fates once the move has ended: a program still running when the device was
    /// unplugged (`unplugged`) lost it.
    pub fn finish(mut self, unplugged: bool) -> Vec<ProgramReport> {
        if unplugged {
            for report in &mut self.programs {
                if matches!(report.fate, Fate::Untouched | Fate::NotEnded) {
                    report.fate = Fate::Broken;
                }
            }
        }
        self.programs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(pid: u32, command: &str, devices: &[&str]) -> UnmanagedProgram {
        UnmanagedProgram {
            pid,
            command: command.into(),
            devices: devices.iter().map(|d| d.to_string()).collect(),
            open_context: devices.iter().any(|d| d.starts_with("uverbs")),
        }
    }

    #[test]
    fn a_program_listed_twice_is_found_once() {
        let mut found = Found::default();
        assert_eq!(found.add(vec![program(12, "rping -c", &["rdma_cm"])]), 1);
        assert_eq!(
            found.add(vec![
                program(12, "rping -c", &["rdma_cm"]),
                program(13, "ibv_rc_pingpong", &["uverbs0"])
            ]),
            1
        );
        assert_eq!(
            found.named(),
            "PID 12 (rping -c) on rdma_cm; PID 13 (ibv_rc_pingpong) on uverbs0"
        );
    }

    #[test]
    fn fates_follow_the_release_and_the_unplug() {
        let mut found = Found::default();
        found.add(vec![
            program(12, "rping -c", &["rdma_cm"]),
            program(13, "ibv_rc_pingpong", &["uverbs0"]),
            program(14, "stubborn", &["uverbs0"]),
        ]);
        found.released(&[
            DeviceHolder {
                pid: 12,
                program: "rping".into(),
                action: "SIGTERM".into(),
                released: true,
            },
            DeviceHolder {
                pid: 14,
                program: "stubborn".into(),
                action: "SIGTERM, SIGKILL failed".into(),
                released: false,
            },
        ]);
        let untouched = found.clone().finish(false);
        let fates: Vec<Fate> = untouched.iter().map(|p| p.fate).collect();
        assert_eq!(fates, [Fate::Ended, Fate::Untouched, Fate::NotEnded]);
        let unplugged = found.finish(true);
        let fates: Vec<Fate> = unplugged.iter().map(|p| p.fate).collect();
        assert_eq!(fates, [Fate::Ended, Fate::Broken, Fate::Broken]);
        assert_eq!(unplugged[0].action.as_deref(), Some("SIGTERM"));
    }

    #[test]
    fn a_report_entry_reads_back_with_its_program_inline() {
        let report = ProgramReport {
            program: program(12, "rping -c", &["rdma_cm"]),
            fate: Fate::Broken,
            action: None,
        };
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["pid"], 12);
        assert_eq!(json["fate"], "broken");
        assert_eq!(
            serde_json::from_value::<ProgramReport>(json).unwrap(),
            report
        );
    }
}
