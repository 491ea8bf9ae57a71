//! Durable writes: what the migrator writes to disk is either all there after a crash or
//! not there at all, owner-only (journals, reports and pool states name VMs, devices and
//! hosts). Each write goes through a temporary name and an fsync; the directory is synced
//! after the rename (or link), since only that makes the new name itself durable.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Writes `path` (replacing it) so that a reader never sees half of it.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = path.with_extension("tmp");
    write_temporary(&temporary, bytes)?;
    std::fs::rename(&temporary, path)?;
    sync_parent(path)
}

/// Creates `path` with `bytes`, failing with `AlreadyExists` if it exists: never two
/// writers of one file. Nothing is left behind when it fails.
pub fn create_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = temporary_beside(path);
    // A hard link fails if the target exists, where a rename would replace it.
    let linked =
        write_temporary(&temporary, bytes).and_then(|()| std::fs::hard_link(&temporary, path));
    let _ = std::fs::remove_file(&temporary);
    linked?;
    sync_parent(path).inspect_err(|_| {
        let _ = std::fs::remove_file(path);
    })
}

/// Syncs the directory that holds `path`, making a new name in it durable.
pub fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

fn write_temporary(temporary: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(temporary)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// `.<name>.new` beside `path`: hidden, so that a scan of the directory skips it.
fn temporary_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    path.with_file_name(format!(".{name}.new"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_write_replaces_the_file_owner_only_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write(&path, b"one").unwrap();
        write(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn create_new_never_replaces_and_leaves_nothing_when_it_fails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.journal");
        create_new(&path, b"first").unwrap();
        let second = create_new(&path, b"second").unwrap_err();
        assert_eq!(second.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let missing = dir.path().join("no-such-dir").join("m.journal");
        assert!(create_new(&missing, b"x").is_err());
    }
}
