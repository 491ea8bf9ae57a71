//! The crash-safe move journal: one append-only file per move, one JSON record per line.
//!
//! Every record is written and `fsync`ed before the step it announces acts (a phase is
//! journaled before its first VMM or agent call), and the journal's directory is synced when
//! the file is created, so a migrator killed at any instant leaves a journal that says at
//! least as much as the VMMs have seen. A restarted migrator reads every journal that has no
//! [`Record::End`] and finishes or rolls back that move ([`crate::moving::recover`]).
//!
//! A torn last line (the kill came during a write) is ignored: the step it announced never
//! acted, because acting waits for the fsync.
//!
//! A journal exists only once its `begin` record is on disk: it is written under a
//! temporary name and linked into place, so a full disk leaves nothing behind. At start-up a
//! journal that cannot be read never stops the daemon ([`scan`]): one whose move had ended,
//! or never acted, is set aside (renamed `*.damaged`); one whose move may be half done is
//! reported, and its VM is kept from moving until an operator looks.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rdmamig_proto::ConnectionId;
use rdmamig_vmm::DeviceSpec;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::durable;
use crate::machine::Phase;
use crate::plan::{Endpoint, MovePlan};
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
    /// The source VMM is about to be asked to unplug the detached device: from here the
    /// guest may remove it at any time, and a rollback must wait for that before plugging.
    Unplugging,
    /// The migration completed: the VM now runs on the destination.
    Migrated,
    /// A function was reserved in the destination's pool for this move.
    Reserved {
        /// Its name.
        function: String,
        /// How it is plugged.
        attachment: Attachment,
    },
    /// A workflow's move stopped after its detach: the workflow migrates the VM, and its
    /// `post-migrate` goes on from here.
    HandedOver {
        /// The host whose VMM is the source (a `post-migrate` on another host cannot roll
        /// the move back there).
        host: String,
    },
    /// A workflow's `post-migrate` named the destination: from here the plan has it.
    Arrived {
        /// The VMM the VM migrated to.
        destination: Endpoint,
        /// The device to plug there.
        attach: DeviceSpec,
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

/// A new move's id: when it was made, the VM's name as it may appear in a file name (the
/// journal and the report are named by the id; at most 64 characters of it), and `n` to tell
/// moves of one instant apart.
pub fn move_id(vm: &str, n: u64) -> String {
    let vm: String = vm.chars().map(file_safe).take(64).collect();
    format!("{}-{vm}-{n}", rdmamig_proto::clock::unix_ms())
}

/// Whether `id` can be a move's id (and so names no file outside the moves' directory).
pub fn is_move_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.chars().all(|c| file_safe(c) == c)
}

/// `c` as it may appear in a file name: letters, digits, `-` and `_` stay, the rest is `_`.
fn file_safe(c: char) -> char {
    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
        c
    } else {
        '_'
    }
}

/// An open journal, appended to as the move goes.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
}

impl Journal {
    /// Creates `dir/<id>.journal` with its `begin` record, durably; refuses an id that has a
    /// journal already. On any failure nothing is left behind.
    pub fn create(dir: &Path, id: &str, plan: &MovePlan) -> Result<Journal, JournalError> {
        let path = dir.join(format!("{id}.journal"));
        let create = |source| JournalError::Create {
            path: path.clone(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(create)?;
        let begin = Record::Begin {
            id: id.into(),
            plan: Box::new(plan.clone()),
            unix_ms: rdmamig_proto::clock::unix_ms(),
        };
        let mut line = serde_json::to_vec(&begin).map_err(|e| create(std::io::Error::other(e)))?;
        line.push(b'\n');
        durable::create_new(&path, &line).map_err(create)?;
        let opened = OpenOptions::new().append(true).open(&path);
        match opened {
            Ok(file) => Ok(Journal { path, file }),
            Err(source) => {
                let _ = std::fs::remove_file(&path);
                Err(create(source))
            }
        }
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

    /// Whether the source VMM was (about to be) asked to unplug the device.
    pub fn unplugging(&self) -> bool {
        self.records.iter().any(|r| matches!(r, Record::Unplugging))
    }

    /// Whether the migration was journaled as completed.
    pub fn migrated(&self) -> bool {
        self.records.iter().any(|r| matches!(r, Record::Migrated))
    }

    /// The source's host, when the move was handed over to a workflow.
    pub fn handed_over(&self) -> Option<&str> {
        self.records.iter().find_map(|r| match r {
            Record::HandedOver { host } => Some(host.as_str()),
            _ => None,
        })
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

/// Reads one journal. A torn last line is dropped, even one cut inside a character.
pub fn read(path: &Path) -> Result<Replay, JournalError> {
    let bytes = std::fs::read(path).map_err(|source| JournalError::Read {
        path: path.into(),
        source,
    })?;
    parse(path, &bytes)
}

/// Replays a journal's bytes (`path` names it in errors); what [`read`] does once it has
/// read the file.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Replay, JournalError> {
    let corrupt = |line: usize, reason: String| JournalError::Corrupt {
        path: path.into(),
        line,
        reason,
    };
    let complete = bytes
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |end| end + 1);
    let mut records = Vec::new();
    for (index, line) in bytes[..complete]
        .split_inclusive(|b| *b == b'\n')
        .enumerate()
    {
        let record: Record =
            serde_json::from_slice(line).map_err(|e| corrupt(index + 1, e.to_string()))?;
        records.push(record);
    }
    let mut records = records.into_iter();
    match records.next() {
        Some(Record::Begin { id, plan, .. }) => {
            let mut plan = *plan;
            let records: Vec<Record> = records.collect();
            for record in &records {
                if let Record::Arrived {
                    destination,
                    attach,
                } = record
                {
                    plan.destination = Some(destination.clone());
                    plan.attach = Some(attach.clone());
                }
            }
            Ok(Replay { id, plan, records })
        }
        Some(other) => Err(corrupt(1, format!("the first record is {other:?}"))),
        None => Err(corrupt(1, "no complete begin record".into())),
    }
}

/// What [`scan`] found in a journal directory.
#[derive(Debug, Default)]
pub struct Scan {
    /// Moves that have not ended, oldest first: to finish or roll back.
    pub unfinished: Vec<(PathBuf, Replay)>,
    /// Journals that could not be read and whose move is over (it ended, it has a report,
    /// or it never acted): renamed out of the way, so they are never read again.
    pub set_aside: Vec<SetAside>,
    /// Journals that could not be read and whose move may be half done: left in place for
    /// an operator, never recovered automatically.
    pub damaged: Vec<Damaged>,
}

/// A journal [`scan`] renamed out of the way.
#[derive(Debug)]
pub struct SetAside {
    /// Where it was.
    pub from: PathBuf,
    /// Where it is now, or why the rename failed too.
    pub to: Result<PathBuf, std::io::Error>,
    /// What is wrong with it.
    pub error: JournalError,
    /// Why its move is over.
    pub over: &'static str,
}

/// A journal of a move that may be half done and that cannot be read.
#[derive(Debug)]
pub struct Damaged {
    /// The journal.
    pub path: PathBuf,
    /// The VM, when the `begin` record could still be read.
    pub vm: Option<String>,
    /// What is wrong with it.
    pub error: JournalError,
}

/// Sorts the journals in `dir`: moves to recover, journals set aside, damaged journals.
/// Only a directory that cannot be listed is an error.
pub fn scan(dir: &Path) -> Result<Scan, JournalError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Scan::default()),
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
    let mut scan = Scan::default();
    for path in paths {
        let error = match read(&path) {
            Ok(replay) if replay.ended().is_none() => {
                scan.unfinished.push((path, replay));
                continue;
            }
            Ok(_) => continue,
            Err(error) => error,
        };
        let salvage = salvage(&path);
        let report = path.with_extension("json");
        let over = if salvage.ended {
            Some("its move had ended")
        } else if report.exists() {
            Some("its move has a report")
        } else if salvage.vm.is_none() {
            Some("it has no complete begin record, so its move never acted")
        } else {
            None
        };
        match over {
            Some(over) => {
                let mut to = path.clone().into_os_string();
                to.push(format!(".{}.damaged", rdmamig_proto::clock::unix_ms()));
                let to = PathBuf::from(to);
                let renamed = std::fs::rename(&path, &to).map(|()| to);
                scan.set_aside.push(SetAside {
                    from: path,
                    to: renamed,
                    error,
                    over,
                });
            }
            None => scan.damaged.push(Damaged {
                path,
                vm: salvage.vm,
                error,
            }),
        }
    }
    Ok(scan)
}

/// What can still be read from a damaged journal, line by line.
struct Salvage {
    /// The VM of a readable `begin` record.
    vm: Option<String>,
    /// Whether a readable `end` record is there.
    ended: bool,
}

fn salvage(path: &Path) -> Salvage {
    let bytes = std::fs::read(path).unwrap_or_default();
    let records: Vec<Record> = bytes
        .split(|b| *b == b'\n')
        .filter_map(|line| serde_json::from_slice(line).ok())
        .collect();
    Salvage {
        vm: match records.first() {
            Some(Record::Begin { plan, .. }) => Some(plan.vm.clone()),
            _ => None,
        },
        ended: records.iter().any(|r| matches!(r, Record::End { .. })),
    }
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
        assert_eq!(scan(dir.path()).unwrap().unfinished.len(), 1);

        let mut journal = Journal::reopen(&path).unwrap();
        journal.append(&Record::End { phase: Phase::Done }).unwrap();
        let replay = read(&path).unwrap();
        assert_eq!(replay.ended(), Some(Phase::Done));
        assert_eq!(replay.records.len(), 4);
    }

    #[test]
    fn an_ended_move_is_not_unfinished_and_an_id_is_journaled_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = Journal::create(dir.path(), "m2", &plan()).unwrap();
        journal
            .append(&Record::End {
                phase: Phase::RolledBack,
            })
            .unwrap();
        let found = scan(dir.path()).unwrap();
        assert!(found.unfinished.is_empty() && found.set_aside.is_empty());
        assert!(Journal::create(dir.path(), "m2", &plan()).is_err());
        assert_eq!(
            read(&dir.path().join("m2.journal")).unwrap().records.len(),
            1
        );
        assert!(scan(&dir.path().join("absent"))
            .unwrap()
            .unfinished
            .is_empty());
    }

    #[test]
    fn a_journal_that_cannot_be_written_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the journal's temporary file would go: the write fails, as on
        // a full disk, after the create.
        std::fs::create_dir(dir.path().join(".m3.journal.new")).unwrap();
        assert!(Journal::create(dir.path(), "m3", &plan()).is_err());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != ".m3.journal.new")
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_torn_tail_inside_a_character_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut named = plan();
        named.vm = "vm\u{e9}".into();
        let journal = Journal::create(dir.path(), "m4", &named).unwrap();
        let path = journal.path().to_path_buf();
        drop(journal);
        let line = serde_json::to_vec(&Record::Begin {
            id: "x".into(),
            plan: Box::new(named.clone()),
            unix_ms: 1,
        })
        .unwrap();
        let cut = line.iter().position(|b| *b == 0xc3).unwrap() + 1;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        file.write_all(&line[..cut]).unwrap();
        let replay = read(&path).unwrap();
        assert_eq!(replay.plan.vm, "vm\u{e9}");
        assert_eq!(scan(dir.path()).unwrap().unfinished.len(), 1);
    }

    #[test]
    fn bad_journals_are_set_aside_or_reported_never_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let moves = dir.path();
        // Over: empty (a create cut short by an old migrator), a begin cut mid-line, a
        // corrupt line before an end, and a corrupt journal whose move has a report.
        std::fs::write(moves.join("empty.journal"), "").unwrap();
        let begin = serde_json::to_string(&Record::Begin {
            id: "x".into(),
            plan: Box::new(plan()),
            unix_ms: 1,
        })
        .unwrap();
        std::fs::write(moves.join("cut.journal"), &begin[..begin.len() / 2]).unwrap();
        let end = serde_json::to_string(&Record::End { phase: Phase::Done }).unwrap();
        std::fs::write(
            moves.join("ended.journal"),
            format!("{begin}\nnot a record\n{end}\n"),
        )
        .unwrap();
        std::fs::write(moves.join("reported.journal"), format!("{begin}\n{{\n")).unwrap();
        std::fs::write(moves.join("reported.json"), "{}").unwrap();
        // Maybe half done: a readable begin, then a line that is not a record, no end.
        std::fs::write(moves.join("half.journal"), format!("{begin}\n{{bad\n")).unwrap();
        // Fine, and unfinished.
        Journal::create(moves, "open", &plan()).unwrap();

        let found = scan(moves).unwrap();
        assert_eq!(found.unfinished.len(), 1);
        assert_eq!(found.unfinished[0].1.id, "open");
        let mut aside: Vec<String> = found
            .set_aside
            .iter()
            .map(|a| a.from.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        aside.sort();
        assert_eq!(
            aside,
            [
                "cut.journal",
                "empty.journal",
                "ended.journal",
                "reported.journal"
            ]
        );
        for a in &found.set_aside {
            let to = a.to.as_ref().unwrap();
            assert!(to.exists() && !a.from.exists(), "{a:?}");
            assert!(to.to_string_lossy().ends_with(".damaged"), "{a:?}");
        }
        assert_eq!(found.damaged.len(), 1);
        assert_eq!(found.damaged[0].vm.as_deref(), Some("vm1"));
        assert!(
            found.damaged[0]
                .error
                .to_string()
                .contains("half.journal is corrupt at line 2"),
            "{}",
            found.damaged[0].error
        );
        // Set aside once: the next scan finds only what is left.
        let again = scan(moves).unwrap();
        assert!(again.set_aside.is_empty());
        assert_eq!(again.damaged.len(), 1);
    }
}
