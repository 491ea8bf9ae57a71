//! A writer for the "newc" cpio format, the only archive format the Linux kernel unpacks as an
//! initramfs.
//!
//! The writer is streaming: each entry goes straight to the underlying writer (normally a gzip
//! encoder over a file), so building an image never holds the whole archive in memory. Every
//! entry gets mtime 0, uid/gid 0 and an inode number from a counter, so the same inputs always
//! give the same bytes (a reproducible image). The kernel creates entries in archive order, so
//! callers must emit a directory before anything inside it.

use std::io::{self, Read, Write};

/// File-type bits of `st_mode`, as the newc header stores them.
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

/// The name of the entry that ends every newc archive.
const TRAILER: &str = "TRAILER!!!";

/// Errors of the cpio writer.
#[derive(Debug, thiserror::Error)]
pub enum CpioError {
    /// Writing an entry to the archive failed.
    #[error("writing cpio entry {name}")]
    WriteEntry {
        /// Path of the entry inside the archive.
        name: String,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// An entry's name or size does not fit the newc header.
    #[error("cpio entry {name} is not representable in newc: {reason}")]
    Unrepresentable {
        /// Path of the entry inside the archive.
        name: String,
        /// What does not fit.
        reason: &'static str,
    },
    /// The data read for a regular file had a different length than announced.
    #[error("cpio entry {name}: announced {announced} bytes, the source gave {actual}")]
    SizeMismatch {
        /// Path of the entry inside the archive.
        name: String,
        /// Size written into the header.
        announced: u64,
        /// Bytes the source actually produced.
        actual: u64,
    },
}

/// The header fields that differ between entry kinds.
struct Header<'a> {
    name: &'a str,
    mode: u32,
    nlink: u32,
    size: u64,
    rdev: (u32, u32),
}

/// Streams a newc cpio archive into `W`.
pub struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
    /// Bytes written so far, to compute the 4-byte alignment padding.
    offset: u64,
}

impl<W: Write> CpioWriter<W> {
    /// Starts an archive on `out`.
    pub fn new(out: W) -> Self {
        CpioWriter {
            out,
            next_ino: 1,
            offset: 0,
        }
    }

    /// Adds a directory with permission bits `perm` (e.g. 0o755).
    pub fn add_dir(&mut self, name: &str, perm: u32) -> Result<(), CpioError> {
        self.header(Header {
            name,
            mode: S_IFDIR | (perm & 0o7777),
            nlink: 2,
            size: 0,
            rdev: (0, 0),
        })
    }

    /// Adds a symbolic link `name` pointing at `target`.
    pub fn add_symlink(&mut self, name: &str, target: &str) -> Result<(), CpioError> {
        self.add_data(name, S_IFLNK | 0o777, target.as_bytes())
    }

    /// Adds a character device node (e.g. /dev/console, 5:1).
    pub fn add_char_device(
        &mut self,
        name: &str,
        perm: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), CpioError> {
        self.header(Header {
            name,
            mode: S_IFCHR | (perm & 0o7777),
            nlink: 1,
            size: 0,
            rdev: (major, minor),
        })
    }

    /// Adds a regular file whose contents are in memory.
    pub fn add_file_bytes(&mut self, name: &str, perm: u32, data: &[u8]) -> Result<(), CpioError> {
        self.add_data(name, S_IFREG | (perm & 0o7777), data)
    }

    /// Adds a regular file of `size` bytes read from `source` (e.g. an open host file).
    pub fn add_file_from(
        &mut self,
        name: &str,
        perm: u32,
        size: u64,
        source: &mut impl Read,
    ) -> Result<(), CpioError> {
        self.header(Header {
            name,
            mode: S_IFREG | (perm & 0o7777),
            nlink: 1,
            size,
            rdev: (0, 0),
        })?;
        let copied = io::copy(&mut source.take(size), &mut self.out).map_err(|source| {
            CpioError::WriteEntry {
                name: name.to_owned(),
                source,
            }
        })?;
        if copied != size {
            return Err(CpioError::SizeMismatch {
                name: name.to_owned(),
                announced: size,
                actual: copied,
            });
        }
        self.offset += size;
        self.pad(name)
    }

    /// Writes the trailer and returns the underlying writer.
    pub fn finish(mut self) -> Result<W, CpioError> {
        self.header(Header {
            name: TRAILER,
            mode: 0,
            nlink: 1,
            size: 0,
            rdev: (0, 0),
        })?;
        Ok(self.out)
    }

    fn add_data(&mut self, name: &str, mode: u32, data: &[u8]) -> Result<(), CpioError> {
        self.header(Header {
            name,
            mode,
            nlink: 1,
            size: data.len() as u64,
            rdev: (0, 0),
        })?;
        self.write(name, data)?;
        self.pad(name)
    }

    fn header(&mut self, h: Header<'_>) -> Result<(), CpioError> {
        let unrepresentable = |reason| CpioError::Unrepresentable {
            name: h.name.to_owned(),
            reason,
        };
        if h.name.contains('\0') {
            return Err(unrepresentable("the name contains a NUL byte"));
        }
        let size = u32::try_from(h.size).map_err(|_| unrepresentable("larger than 4 GiB"))?;
        // The name size counts the terminating NUL.
        let namesize =
            u32::try_from(h.name.len() + 1).map_err(|_| unrepresentable("name too long"))?;
        let ino = if h.name == TRAILER { 0 } else { self.next_ino };
        self.next_ino += 1;
        let fields = [
            ino, h.mode, 0, 0, h.nlink, 0, size, 0, 0, h.rdev.0, h.rdev.1, namesize, 0,
        ];
        let mut header = String::with_capacity(110);
        header.push_str("070701");
        for field in fields {
            header.push_str(&format!("{field:08x}"));
        }
        self.write(h.name, header.as_bytes())?;
        self.write(h.name, h.name.as_bytes())?;
        self.write(h.name, b"\0")?;
        self.pad(h.name)
    }

    fn write(&mut self, name: &str, bytes: &[u8]) -> Result<(), CpioError> {
        self.out
            .write_all(bytes)
            .map_err(|source| CpioError::WriteEntry {
                name: name.to_owned(),
                source,
            })?;
        self.offset += bytes.len() as u64;
        Ok(())
    }

    /// newc aligns both the name and the data to 4 bytes.
    fn pad(&mut self, name: &str) -> Result<(), CpioError> {
        let padding = (4 - (self.offset % 4) as usize) % 4;
        self.write(name, &[0u8; 3][..padding])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Lists an archive with busybox's own cpio, an independent reader.
    fn busybox_list(archive: &[u8], verbose: bool) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.cpio");
        std::fs::write(&path, archive).unwrap();
        let flags = if verbose { "-tv" } else { "-t" };
        let out = Command::new("busybox")
            .args(["cpio", flags, "-F"])
            .arg(&path)
            .output()
            .expect("busybox cpio runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn sample() -> Vec<u8> {
        let mut w = CpioWriter::new(Vec::new());
        w.add_dir("usr", 0o755).unwrap();
        w.add_dir("usr/bin", 0o755).unwrap();
        w.add_file_bytes("usr/bin/hello", 0o755, b"#!/bin/sh\necho hi\n")
            .unwrap();
        // Sizes 0..3 exercise every padding length.
        w.add_file_bytes("a", 0o644, b"").unwrap();
        w.add_file_bytes("ab", 0o644, b"x").unwrap();
        w.add_file_bytes("abc", 0o644, b"xy").unwrap();
        let data = b"streamed contents";
        w.add_file_from("streamed", 0o600, data.len() as u64, &mut &data[..])
            .unwrap();
        w.add_symlink("bin", "usr/bin").unwrap();
        w.add_dir("dev", 0o755).unwrap();
        w.add_char_device("dev/console", 0o600, 5, 1).unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn busybox_lists_every_entry_in_order() {
        let listing = busybox_list(&sample(), false);
        let names: Vec<&str> = listing.lines().collect();
        assert_eq!(
            names,
            [
                "usr",
                "usr/bin",
                "usr/bin/hello",
                "a",
                "ab",
                "abc",
                "streamed",
                "bin",
                "dev",
                "dev/console"
            ]
        );
    }

    #[test]
    fn busybox_sees_types_sizes_and_link_targets() {
        let listing = busybox_list(&sample(), true);
        let line = |name: &str| {
            listing
                .lines()
                .find(|l| l.ends_with(name))
                .unwrap_or_else(|| panic!("{name} missing in {listing}"))
                .to_owned()
        };
        assert!(line(" usr/bin/hello").starts_with("-rwxr-xr-x"));
        assert!(line(" usr/bin/hello").contains(" 18 "));
        assert!(line(" streamed").starts_with("-rw-------"));
        assert!(line("bin -> usr/bin").starts_with("lrwxrwxrwx"));
        assert!(line(" dev/console").starts_with("crw-------"));
        assert!(line(" usr").starts_with("drwxr-xr-x"));
    }

    #[test]
    fn busybox_extracts_identical_contents() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("a.cpio");
        let mut w = CpioWriter::new(Vec::new());
        w.add_dir("d", 0o755).unwrap();
        let big: Vec<u8> = (0..100_003u32).map(|i| (i % 251) as u8).collect();
        w.add_file_bytes("d/big", 0o644, &big).unwrap();
        w.add_file_bytes("d/odd", 0o644, b"12345").unwrap();
        std::fs::write(&archive, w.finish().unwrap()).unwrap();
        let out_dir = dir.path().join("x");
        std::fs::create_dir(&out_dir).unwrap();
        let status = Command::new("busybox")
            .args(["cpio", "-i", "-d", "-F"])
            .arg(&archive)
            .current_dir(&out_dir)
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(std::fs::read(out_dir.join("d/big")).unwrap(), big);
        assert_eq!(std::fs::read(out_dir.join("d/odd")).unwrap(), b"12345");
    }

    #[test]
    fn short_source_is_a_size_mismatch() {
        let mut w = CpioWriter::new(Vec::new());
        let err = w
            .add_file_from("f", 0o644, 10, &mut &b"abc"[..])
            .unwrap_err();
        assert!(matches!(
            err,
            CpioError::SizeMismatch {
                announced: 10,
                actual: 3,
                ..
            }
        ));
    }

    #[test]
    fn nul_in_name_is_rejected() {
        let mut w = CpioWriter::new(Vec::new());
        assert!(matches!(
            w.add_dir("a\0b", 0o755),
            Err(CpioError::Unrepresentable { .. })
        ));
    }
}
