//! The guest kernel for a PVH boot.
//!
//! A Debian bzImage is a real-mode loader plus an XZ-compressed ELF `vmlinux`. Booted as is,
//! QEMU's firmware loads it in real mode and the kernel then decompresses itself: 4.3 s to
//! the kernel's first line under TCG here, and minutes for a VM nested in a TCG guest,
//! where every instruction of the decompressor is emulated twice. The ELF inside carries
//! the PVH entry note (CONFIG_PVH), and QEMU boots such an ELF directly (its pvh.bin
//! option ROM): 0.5 s to the same line. So the image gives QEMU the ELF, taken out of the
//! bzImage once per kernel: the boot protocol's header says where the payload is, and
//! xz(1) decompresses it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Why the ELF kernel could not be taken out of a bzImage.
#[derive(Debug, thiserror::Error)]
pub enum PvhError {
    /// Reading the bzImage or writing the ELF failed.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a bzImage with an XZ payload this code knows.
    #[error("{path} is not a bzImage with an XZ-compressed payload: {why}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What did not match.
        why: String,
    },
    /// xz(1) could not run or failed.
    #[error("decompressing the kernel of {path} with xz (scripts/setup.sh installs xz-utils)")]
    Xz {
        /// The bzImage.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Where the compressed kernel is inside a bzImage: the x86 boot protocol's header (2.08 and
/// later) gives its offset after the real-mode setup and its length.
fn payload(image: &[u8]) -> Result<&[u8], String> {
    let u32_at = |at: usize| {
        image
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    if image.get(0x202..0x206) != Some(b"HdrS") {
        return Err("no boot protocol header (HdrS at 0x202)".into());
    }
    let version = image
        .get(0x206..0x208)
        .map(|b| u16::from_le_bytes([b[0], b[1]]));
    if version.is_none_or(|v| v < 0x0208) {
        return Err(format!(
            "boot protocol {version:x?} predates payload fields"
        ));
    }
    let setup_sects = match image.get(0x1f1).copied() {
        Some(0) => 4,
        Some(n) => usize::from(n),
        None => return Err("truncated header".into()),
    };
    let (offset, length) = match (u32_at(0x248), u32_at(0x24c)) {
        (Some(o), Some(l)) => (o, l),
        _ => return Err("truncated header".into()),
    };
    let start = (setup_sects + 1) * 512 + offset;
    let payload = image
        .get(start..start + length)
        .ok_or_else(|| format!("payload {start}+{length} is past the end"))?;
    if !payload.starts_with(b"\xfd7zXZ\x00") {
        return Err("payload is not XZ (CONFIG_KERNEL_XZ)".into());
    }
    Ok(payload)
}

/// Writes the ELF kernel inside bzImage `image` to `out`, unless `out` is already newer than
/// `image`.
pub fn extract(image: &Path, out: &Path) -> Result<(), PvhError> {
    let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    if let (Some(built), Some(source)) = (modified(out), modified(image)) {
        if built >= source {
            return Ok(());
        }
    }
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| PvhError::Io { path, source }
    };
    let bytes = fs::read(image).map_err(io(image))?;
    let compressed = payload(&bytes).map_err(|why| PvhError::Format {
        path: image.to_owned(),
        why,
    })?;
    let xz = |source| PvhError::Xz {
        path: image.to_owned(),
        source,
    };
    // The payload ends with the kernel's size after the XZ stream: --single-stream stops at
    // the stream's end.
    let mut child = Command::new("xz")
        .args(["--decompress", "--stdout", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(xz)?;
    let mut stdin = child.stdin.take().expect("stdin was piped");
    let feeder = std::thread::scope(|s| {
        let feeder = s.spawn(move || stdin.write_all(compressed));
        let output = child.wait_with_output();
        (feeder.join(), output)
    });
    let output = match feeder {
        (Ok(Ok(())), Ok(output)) => output,
        (Ok(Err(e)), _) | (_, Err(e)) => return Err(xz(e)),
        (Err(_), _) => return Err(xz(std::io::Error::other("the feeding thread panicked"))),
    };
    if !output.status.success() || !output.stdout.starts_with(b"\x7fELF") {
        return Err(xz(std::io::Error::other(format!(
            "xz exited with {} and wrote {} bytes that are not an ELF: {}",
            output.status,
            output.stdout.len(),
            String::from_utf8_lossy(&output.stderr).trim()
        ))));
    }
    let partial = out.with_extension("partial");
    fs::write(&partial, &output.stdout).map_err(io(&partial))?;
    fs::rename(&partial, out).map_err(io(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bzImage header with `setup_sects` and a payload at `offset`.
    fn image(setup_sects: u8, offset: usize, payload: &[u8]) -> Vec<u8> {
        let sects = if setup_sects == 0 {
            4
        } else {
            usize::from(setup_sects)
        };
        let mut image = vec![0u8; (sects + 1) * 512 + offset];
        image[0x1f1] = setup_sects;
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        image[0x248..0x24c].copy_from_slice(&(offset as u32).to_le_bytes());
        image[0x24c..0x250].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        image.extend_from_slice(payload);
        image.extend_from_slice(b"trailing");
        image
    }

    #[test]
    fn the_payload_is_found_by_the_header_and_must_be_xz() {
        let xz = b"\xfd7zXZ\x00rest of the stream";
        assert_eq!(payload(&image(27, 100, xz)).unwrap(), xz);
        // setup_sects 0 means 4.
        assert_eq!(payload(&image(0, 0, xz)).unwrap(), xz);
        let gzip = b"\x1f\x8b\x08 compressed";
        assert!(payload(&image(27, 0, gzip)).unwrap_err().contains("not XZ"));
        assert!(payload(b"MZ not a kernel").unwrap_err().contains("HdrS"));
        let mut truncated = image(27, 0, xz);
        truncated.truncate(27 * 512);
        assert!(payload(&truncated).unwrap_err().contains("past the end"));
    }

    #[test]
    fn the_installed_kernel_yields_an_elf() {
        let kernel =
            crate::modules::Kernel::find(Path::new("/boot"), Path::new("/lib/modules"), None)
                .expect("a kernel in /boot (scripts/setup.sh installs linux-image-amd64)");
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("vmlinux");
        extract(&kernel.image, &out).unwrap();
        let elf = fs::read(&out).unwrap();
        assert!(
            elf.starts_with(b"\x7fELF") && elf.len() > 10 << 20,
            "{}",
            elf.len()
        );
    }
}
