//! Pruning the files of finished moves, so that `<state-dir>/moves/` does not grow forever.
//!
//! A move leaves `<id>.journal`, `<id>.json` (its report) and `<id>.svg`. Once its journal
//! ends, they are history: kept up to a count and, optionally, an age, newest first (by the
//! journal's last write, which is the move's end). A journal without an end is a move that
//! is running or that a restarted daemon must still finish: it is never pruned, whatever
//! its age, and neither is a journal that cannot be read (whether it ended is unknown).
//! The report and timeline go before the journal, so a prune cut short leaves an ended
//! journal that the next prune removes, never a report whose journal is gone unnoticed.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::journal;

/// How much history to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// At most this many finished moves (the newest).
    pub keep: usize,
    /// Finished moves older than this go, even within `keep`.
    pub max_age: Option<Duration>,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            keep: 1000,
            max_age: None,
        }
    }
}

/// What one prune did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// The moves whose files were removed.
    pub moves: Vec<String>,
    /// Files that could not be removed, with why (they are tried again next time).
    pub failures: Vec<String>,
}

/// Removes the files of the finished moves in `dir` that `retention` does not keep, as of
/// `now`.
pub fn prune(dir: &Path, retention: &Retention, now: SystemTime) -> Pruned {
    let mut pruned = Pruned::default();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return pruned;
    };
    let mut finished: Vec<(SystemTime, String, PathBuf)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "journal"))
        .filter_map(|path| {
            let replay = journal::read(&path).ok()?;
            replay.ended()?;
            let ended = std::fs::metadata(&path).and_then(|m| m.modified()).ok()?;
            Some((ended, replay.id, path))
        })
        .collect();
    // Newest first; the id breaks ties (it starts with the start time).
    finished.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1.cmp(&a.1)));
    for (index, (ended, id, path)) in finished.into_iter().enumerate() {
        let too_old = retention
            .max_age
            .is_some_and(|age| now.duration_since(ended).unwrap_or_default() > age);
        if index < retention.keep && !too_old {
            continue;
        }
        let mut ok = true;
        for file in [
            path.with_extension("json"),
            path.with_extension("svg"),
            path,
        ] {
            match std::fs::remove_file(&file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    pruned.failures.push(format!("{}: {e}", file.display()));
                    ok = false;
                    break;
                }
            }
        }
        if ok {
            pruned.moves.push(id);
        }
    }
    pruned
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::{Journal, Record};
    use crate::machine::Phase;
    use crate::plan::tests::plan;

    /// A move `id` in `dir` with its report and timeline, ended when `end` is given.
    fn a_move(dir: &Path, id: &str, end: Option<Phase>) {
        let mut journal = Journal::create(dir, id, &plan()).unwrap();
        if let Some(phase) = end {
            journal.append(&Record::End { phase }).unwrap();
            std::fs::write(dir.join(format!("{id}.json")), "{}").unwrap();
            std::fs::write(dir.join(format!("{id}.svg")), "<svg/>").unwrap();
        }
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn the_newest_finished_moves_are_kept_and_unfinished_ones_never_go() {
        let dir = tempfile::tempdir().unwrap();
        a_move(dir.path(), "1-old", Some(Phase::Done));
        a_move(dir.path(), "2-running", None);
        std::thread::sleep(Duration::from_millis(20));
        a_move(dir.path(), "3-mid", Some(Phase::RolledBack));
        std::thread::sleep(Duration::from_millis(20));
        a_move(dir.path(), "4-new", Some(Phase::Failed));
        std::fs::write(dir.path().join("5-torn.journal"), "not json\n").unwrap();

        let keep_two = Retention {
            keep: 2,
            max_age: None,
        };
        let pruned = prune(dir.path(), &keep_two, SystemTime::now());
        assert_eq!(pruned.moves, ["1-old"]);
        assert!(pruned.failures.is_empty());
        assert_eq!(
            files(dir.path()),
            [
                "2-running.journal",
                "3-mid.journal",
                "3-mid.json",
                "3-mid.svg",
                "4-new.journal",
                "4-new.json",
                "4-new.svg",
                "5-torn.journal"
            ]
        );
        // Again: nothing more to do.
        assert_eq!(
            prune(dir.path(), &keep_two, SystemTime::now()),
            Pruned::default()
        );
    }

    #[test]
    fn an_age_limit_prunes_old_finished_moves_but_not_an_old_unfinished_one() {
        let dir = tempfile::tempdir().unwrap();
        a_move(dir.path(), "1-done", Some(Phase::Done));
        a_move(dir.path(), "2-running", None);
        let week = Retention {
            keep: 1000,
            max_age: Some(Duration::from_secs(7 * 86400)),
        };
        let in_a_week = SystemTime::now() + Duration::from_secs(7 * 86400 + 60);
        assert_eq!(
            prune(dir.path(), &week, SystemTime::now()),
            Pruned::default()
        );
        let pruned = prune(dir.path(), &week, in_a_week);
        assert_eq!(pruned.moves, ["1-done"]);
        assert_eq!(files(dir.path()), ["2-running.journal"]);
    }

    #[test]
    fn a_missing_directory_prunes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let pruned = prune(
            &dir.path().join("none"),
            &Retention::default(),
            SystemTime::now(),
        );
        assert_eq!(pruned, Pruned::default());
    }
}
