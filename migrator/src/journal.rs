//! The crash-safe move journal: one append-only file per move, one JSON record per line.
//!
//! Every record is written and `fsync`ed before the step it announces acts (a phase is
//! journaled before its first VMM or agent call), and the journal's directory is synced when
//! the file is created, so a migrator killed at any instant leaves a journal that says at
//! least as much as the VMMs have seen. A restarted migrator reads every journal that has no
//! [`Record::End`] and finishes or rolls back that move ([`crate::mover::recover`]).
//!
//! A torn last line (the kill came during a write) is ignored: the step it announced never
//! acted, because acting waits for the fsync.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use rdmamig_proto::ConnectionId;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::machine::Phase;
use crate::plan::MovePlan;
use crate::pool::Attachment;
use crate::strategy::Choice;

/// One journal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    /// The move was accepted; always the first record.
    Begin {
        /// The move's id.
        id: String,
        /// What it was asked to do.
        plan: Box<MovePlan>,
        /// When, ms since the epoch.
        unix_ms: u64,
    },
    /// The connections the agent listed at prepare (rollback and resume name them).
    Listed {
        /// Their ids.
        connections: Vec<ConnectionId>,
    },
    /// A phase is about to act.
    Enter {
        /// The phase.
        phase: Phase,
    },
    /// The strategy the move runs (`auto` decided, before anything acted).
    Chose {
        /// The strategy and why.
        choice: Choice,
    },
    /// The migration completed: the VM now runs on the destination.
    Migrated,
    /// A function was reserved in the destination's pool for this move.
    Reserved {
        /// Its name.
        function: String,
        /// How it is plugged.
        attachment: Attachment,
    },
    /// The move is being rolled back.
    RollingBack {
        /// Why.
        reason: String,
    },
    /// The move ended; nothing follows.
    End {
        /// `done`, `rolled_back` or `failed`.
        phase: Phase,
    },
}

/// Why the journal could not be written or read.
#[derive(Debug, Error)]
pub enum JournalError {
    /// Creating the journal (or its directory) failed.
    #[error("cannot create the move journal {path}")]
    Create {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Writing or syncing a record failed.
    #[error("cannot write to the move journal {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Reading a journal failed.
    #[error("cannot read the move journal {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A journal's first record is not a `begin`, or a complete line is not a record.
    #[error("the move journal {path} is corrupt at line {line}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

/// An open journal, appended to as the move goes.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
}

impl Journal {
    /// Creates `dir/<id>.journal` with its `begin` record, durably.
    pub fn create(dir: &Path, id: &str, plan: &MovePlan) -> Result<Journal, JournalError> {
        let path = dir.join(format!("{id}.journal"));
        let create = |source| JournalError::Create {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(create)?;
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&path)
            .map_err(create)?;
        File::open(dir).and_then(|d| d.sync_all()).map_err(create)?;
        let mut journal = Journal { path, file };
        journal.append(&Record::Begin {
            id: id.into(),
            plan: Box::new(plan.clone()),
            unix_ms: crate::timeline::unix_ms(),
        })?;
        Ok(journal)
    }

    /// Reopens an existing journal to go on appending (recovery), cutting a torn last line
    /// first so that the next record starts on a line of its own.
    pub fn reopen(path: &Path) -> Result<Journal, JournalError> {
        let create = |source| JournalError::Create {
            path: path.into(),
            source,
        };
        let bytes = std::fs::read(path).map_err(create)?;
        let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let file = OpenOptions::new().append(true).open(path).map_err(create)?;
        if complete < bytes.len() {
            file.set_len(complete as u64)
                .and_then(|()| file.sync_data())
                .map_err(create)?;
        }
        Ok(Journal {
            path: path.into(),
            file,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record and returns once it is on disk.
    pub fn append(&mut self, record: &Record) -> Result<(), JournalError> {
        let mut line = serde_json::to_vec(record).map_err(|e| JournalError::Write {
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|()| self.file.sync_data())
            .map_err(|source| JournalError::Write {
                path: self.path.clone(),
                source,
            })
    }
}

/// Writes a file through a temporary name and an fsync, so a reader never sees half of it.
pub fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = path.with_extension("tmp");
    let mut file = std::fs::File::create(&temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&temporary, path)?;
    // The rename itself is durable only once the directory is.
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// A journal read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    /// The move's id.
    pub id: String,
    /// Its plan.
    pub plan: MovePlan,
    /// Every record after `begin`, in order.
    pub records: Vec<Record>,
}

impl Replay {
    /// How the move ended, if it did.
    pub fn ended(&self) -> Option<Phase> {
        self.records.iter().find_map(|r| match r {
            Record::End { phase } => Some(*phase),
            _ => None,
        })
    }

    /// The last phase that was entered.
    pub fn last_phase(&self) -> Option<Phase> {
        self.records.iter().rev().find_map(|r| match r {
            Record::Enter { phase } => Some(*phase),
            _ => None,
        })
    }

    /// Whether the migration was journaled as completed.
    pub fn migrated(&self) -> bool {
        self.records.iter().any(|r| matches!(r, Record::Migrated))
    }

    /// Whether a rollback had started.
    pub fn rolling_back(&self) -> Option<&str> {
        self.records.iter().find_map(|r| match r {
            Record::RollingBack { reason } => Some(reason.as_str()),
            _ => None,
        })
    }

    /// The strategy the move chose, if it got that far.
    pub fn chosen(&self) -> Option<Choice> {
        self.records.iter().find_map(|r| match r {
            Record::Chose { choice } => Some(choice.clone()),
            _ => None,
        })
    }

    /// The function reserved for the move, if one was.
    pub fn reserved(&self) -> Option<(String, Attachment)> {
        self.records.iter().find_map(|r| match r {
            Record::Reserved {
                function,
                attachment,
            } => Some((function.clone(), attachment.clone())),
            _ => None,
        })
    }

    /// The connections listed at prepare.
    pub fn connections(&self) -> Vec<ConnectionId> {
        self.records
            .iter()
            .find_map(|r| match r {
                Record::Listed { connections } => Some(connections.clone()),
                _ => None,
            })
            .unwrap_or_default()
    }
}

/// Reads one journal. A torn last line is dropped.
pub fn read(path: &Path) -> Result<Replay, JournalError> {
    let text = std::fs::read_to_string(path).map_err(|source| JournalError::Read {
        path: path.into(),
        source,
    })?;
    let corrupt = |line: usize, reason: String| JournalError::Corrupt {
        path: path.into(),
        line,
        reason,
    };
    let complete = match text.rfind('\n') {
        Some(end) => &text[..end],
        None => "",
    };
    let mut records = Vec::new();
    for (index, line) in complete.lines().enumerate() {
        let record: Record =
            serde_json::from_str(line).map_err(|e| corrupt(index + 1, e.to_string()))?;
        records.push(record);
    }
    let mut records = records.into_iter();
    match records.next() {
        Some(Record::Begin { id, plan, .. }) => Ok(Replay {
            id,
            plan: *plan,
            records: records.collect(),
        }),
        Some(other) => Err(corrupt(1, format!("the first record is {other:?}"))),
        None => Err(corrupt(1, "no complete begin record".into())),
    }
}

/// Every journal in `dir` whose move has not ended, oldest first.
pub fn unfinished(dir: &Path) -> Result<Vec<(PathBuf, Replay)>, JournalError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(JournalError::Read {
                path: dir.into(),
                source,
            })
        }
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "journal"))
        .collect();
    paths.sort();
    let mut open = Vec::new();
    for path in paths {
        let replay = read(&path)?;
        if replay.ended().is_none() {
            open.push((path, replay));
        }
    }
    Ok(open)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::plan;

    #[test]
    fn records_read_back_in_order_and_a_torn_line_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::create(dir.path(), "m1", &plan()).unwrap();
        journal
            .append(&Record::Listed {
                connections: vec![7, 9],
            })
            .unwrap();
        journal
            .append(&Record::Enter {
                phase: Phase::Migrate,
            })
            .unwrap();
        journal.append(&Record::Migrated).unwrap();
        let path = journal.path().to_path_buf();
        drop(journal);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"record\":\"enter\",\"pha")
            .unwrap();
        let replay = read(&path).unwrap();
        assert_eq!(replay.id, "m1");
        assert_eq!(replay.plan, plan());
        assert_eq!(replay.connections(), vec![7, 9]);
        assert_eq!(replay.last_phase(), Some(Phase::Migrate));
        assert!(replay.migrated());
        assert_eq!(replay.ended(), None);
        assert_eq!(unfinished(dir.path()).unwrap().len(), 1);

        let mut journal = Journal::reopen(&path).unwrap();
        journal.append(&Record::End { phase: Phase::Done }).unwrap();
        let replay = read(&path).unwrap();
        assert_eq!(replay.ended(), Some(Phase::Done));
        assert_eq!(replay.records.len(), 4);
    }

    #[test]
    fn an_ended_move_is_not_unfinished_and_corruption_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::create(dir.path(), "m2", &plan()).unwrap();
        journal
            .append(&Record::End {
                phase: Phase::RolledBack,
            })
            .unwrap();
        assert!(unfinished(dir.path()).unwrap().is_empty());
        assert!(Journal::create(dir.path(), "m2", &plan()).is_err());
        std::fs::write(
            dir.path().join("bad.journal"),
            "{\"record\":\"migrated\"}\n",
        )
        .unwrap();
        let err = unfinished(dir.path()).unwrap_err();
        assert!(
            err.to_string().contains("bad.journal is corrupt at line 1"),
            "{err}"
        );
        assert!(unfinished(&dir.path().join("absent")).unwrap().is_empty());
    }
}
