//! Finds the shared libraries an ELF file needs, through the host's `ldd`.
//!
//! `ldd` asks the dynamic loader itself, so the answer includes the loader and follows the
//! host's library search path exactly as the guest will (the guest gets the same files at the
//! same paths). It does not see libraries loaded with dlopen(): the image adds those (the
//! libibverbs provider, libgcc_s) explicitly.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Errors of library discovery.
#[derive(Debug, thiserror::Error)]
pub enum LddError {
    /// `ldd` could not be run.
    #[error("running ldd on {binary}")]
    Spawn {
        /// The ELF file examined.
        binary: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `ldd` failed on a dynamic executable.
    #[error("ldd {binary} failed: {stderr}")]
    Failed {
        /// The ELF file examined.
        binary: PathBuf,
        /// What ldd printed on stderr.
        stderr: String,
    },
    /// A needed library is not installed on the host.
    #[error("{binary} needs {library}, which is not installed")]
    NotFound {
        /// The ELF file examined.
        binary: PathBuf,
        /// The library's soname.
        library: String,
    },
    /// A line of ldd's output has an unknown shape.
    #[error("ldd {binary}: cannot parse line {line:?}")]
    Parse {
        /// The ELF file examined.
        binary: PathBuf,
        /// The offending line.
        line: String,
    },
}

/// Tells whether `path` is an ELF file (by its magic number).
pub fn is_elf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|()| magic == *b"\x7fELF")
        .unwrap_or(false)
}

/// The libraries (with the dynamic loader) `binary` needs, as absolute host paths. A static
/// binary needs none.
pub fn libraries(binary: &Path) -> Result<Vec<PathBuf>, LddError> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|source| LddError::Spawn {
            binary: binary.to_owned(),
            source,
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // glibc's ldd says so on stdout (exit 0) or stderr (exit 1) depending on the file.
    if format!("{stdout}{stderr}").contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    if !out.status.success() {
        return Err(LddError::Failed {
            binary: binary.to_owned(),
            stderr: stderr.trim().to_owned(),
        });
    }
    parse(binary, &stdout)
}

/// Parses ldd's output. Lines look like
/// `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)`, `/lib64/ld-linux-x86-64.so.2
/// (0x...)`, `linux-vdso.so.1 (0x...)` (the kernel's, no file) or `libx.so => not found`.
pub fn parse(binary: &Path, text: &str) -> Result<Vec<PathBuf>, LddError> {
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line == "statically linked" {
            continue;
        }
        let parse_error = || LddError::Parse {
            binary: binary.to_owned(),
            line: line.to_owned(),
        };
        let target = match line.split_once(" => ") {
            Some((soname, rest)) => {
                if rest.trim() == "not found" {
                    return Err(LddError::NotFound {
                        binary: binary.to_owned(),
                        library: soname.trim().to_owned(),
                    });
                }
                rest
            }
            None => line,
        };
        let path = target.split(" (0x").next().ok_or_else(parse_error)?.trim();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        } else if !path.starts_with("linux-vdso") && !path.starts_with("linux-gate") {
            return Err(parse_error());
        }
    }
    Ok(libs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RPING: &str = "\
\tlinux-vdso.so.1 (0x00007fb767c77000)
\tlibrdmacm.so.1 => /lib/x86_64-linux-gnu/librdmacm.so.1 (0x00007fb767c3c000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007fb767a39000)
\t/lib64/ld-linux-x86-64.so.2 (0x00007fb767c79000)
";

    #[test]
    fn parses_libraries_and_loader_and_skips_vdso() {
        let libs = parse(Path::new("rping"), RPING).unwrap();
        assert_eq!(
            libs,
            [
                "/lib/x86_64-linux-gnu/librdmacm.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn missing_library_is_named() {
        let err = parse(Path::new("x"), "\tlibfoo.so.1 => not found\n").unwrap_err();
        assert!(matches!(err, LddError::NotFound { library, .. } if library == "libfoo.so.1"));
    }

    #[test]
    fn unknown_shapes_are_errors() {
        assert!(matches!(
            parse(Path::new("x"), "garbage here\n"),
            Err(LddError::Parse { .. })
        ));
    }

    #[test]
    fn real_ldd_on_rping_and_static_busybox() {
        let libs = libraries(Path::new("/usr/bin/rping")).unwrap();
        let names: Vec<_> = libs
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(names.contains(&"librdmacm.so.1".to_owned()), "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("ld-linux")), "{names:?}");
        assert!(libraries(Path::new("/bin/busybox")).unwrap().is_empty());
        assert!(is_elf(Path::new("/bin/busybox")));
        assert!(!is_elf(Path::new("/etc/libibverbs.d/rxe.driver")));
    }
}
