//! `rdmamig-run`'s logic: where the preload library is, and the LD_PRELOAD that puts it
//! first. The binary (src/bin/rdmamig-run.rs) only parses its arguments and execs.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// The library's file name, as cargo builds it and as the images install it.
pub const LIBRARY: &str = "librdmamig_preload.so";

/// The environment variable that names the library, when it is not beside the wrapper.
pub const LIBRARY_ENV: &str = "RDMAMIG_PRELOAD";

/// Why the wrapper cannot run the program.
#[derive(Debug, Error)]
pub enum RunError {
    /// The library is at none of the places looked at.
    #[error("{LIBRARY} not found (looked at: {}); name it with --library or {LIBRARY_ENV}", looked.join(", "))]
    LibraryNotFound {
        /// Every path looked at, in order.
        looked: Vec<String>,
    },
    /// The library's path has a character LD_PRELOAD cannot carry (it splits on spaces and
    /// colons).
    #[error("the library's path {0:?} has a space or a colon, which LD_PRELOAD cannot carry")]
    UnsafePath(PathBuf),
}

/// The library to preload: `explicit` (--library) if given, else `from_env`
/// ([`LIBRARY_ENV`]), else [`LIBRARY`] beside the wrapper `exe` or in `../lib/rdmamig/`
/// from it. The first that exists wins; an explicit path must exist.
pub fn find_library(
    explicit: Option<&Path>,
    from_env: Option<&OsStr>,
    exe: &Path,
) -> Result<PathBuf, RunError> {
    let candidates: Vec<PathBuf> = match (explicit, from_env) {
        (Some(path), _) => vec![path.to_owned()],
        (None, Some(path)) => vec![PathBuf::from(path)],
        (None, None) => {
            let dir = exe.parent().unwrap_or(Path::new("."));
            vec![dir.join(LIBRARY), dir.join("../lib/rdmamig").join(LIBRARY)]
        }
    };
    let found = candidates.iter().find(|path| path.is_file()).cloned();
    let library = found.ok_or_else(|| RunError::LibraryNotFound {
        looked: candidates.iter().map(|p| p.display().to_string()).collect(),
    })?;
    if library
        .as_os_str()
        .as_bytes()
        .iter()
        .any(|b| *b == b' ' || *b == b':')
    {
        return Err(RunError::UnsafePath(library));
    }
    Ok(library)
}

/// LD_PRELOAD with `library` first, ahead of whatever `existing` already preloads (so its
/// verbs are the ones the program binds to), and never twice.
pub fn preload_value(existing: Option<&OsStr>, library: &Path) -> OsString {
    let mut value = library.as_os_str().as_bytes().to_vec();
    for entry in existing
        .map(|e| e.as_bytes())
        .unwrap_or_default()
        .split(|b| *b == b' ' || *b == b':')
        .filter(|entry| !entry.is_empty() && *entry != library.as_os_str().as_bytes())
    {
        value.push(b':');
        value.extend_from_slice(entry);
    }
    OsString::from_vec(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_goes_first_and_only_once() {
        let lib = Path::new("/usr/lib/rdmamig/librdmamig_preload.so");
        assert_eq!(preload_value(None, lib), lib.as_os_str());
        assert_eq!(
            preload_value(Some(OsStr::new("libfoo.so /x/libbar.so")), lib),
            OsStr::new("/usr/lib/rdmamig/librdmamig_preload.so:libfoo.so:/x/libbar.so")
        );
        assert_eq!(
            preload_value(Some(lib.as_os_str()), lib),
            lib.as_os_str(),
            "already preloaded"
        );
    }

    #[test]
    fn the_library_is_found_beside_the_wrapper_or_where_it_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("bin/rdmamig-run");
        let installed = dir.path().join("lib/rdmamig").join(LIBRARY);
        std::fs::create_dir_all(installed.parent().unwrap()).unwrap();
        std::fs::create_dir_all(exe.parent().unwrap()).unwrap();

        let missing = find_library(None, None, &exe).unwrap_err().to_string();
        assert!(missing.contains("not found"), "{missing}");
        assert!(missing.contains("--library"), "{missing}");

        std::fs::write(&installed, b"").unwrap();
        let found = find_library(None, None, &exe).unwrap();
        assert_eq!(
            found.canonicalize().unwrap(),
            installed.canonicalize().unwrap()
        );

        let beside = exe.with_file_name(LIBRARY);
        std::fs::write(&beside, b"").unwrap();
        assert_eq!(
            find_library(None, None, &exe).unwrap(),
            beside,
            "beside wins"
        );

        let named = dir.path().join("other.so");
        let err = find_library(Some(&named), None, &exe).unwrap_err();
        assert!(
            matches!(err, RunError::LibraryNotFound { .. }),
            "an explicit path must exist"
        );
        std::fs::write(&named, b"").unwrap();
        assert_eq!(
            find_library(None, Some(named.as_os_str()), &exe).unwrap(),
            named
        );

        let spaced = dir.path().join("a b.so");
        std::fs::write(&spaced, b"").unwrap();
        assert!(matches!(
            find_library(Some(&spaced), None, &exe),
            Err(RunError::UnsafePath(_))
        ));
    }
}
