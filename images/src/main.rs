//! `rdmamig-image`: builds the test-bed guest image (see the `rdmamig_images` crate docs).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

/// Build the rdmamig test-bed guest image: the host's Debian kernel plus an initramfs made from
/// the host's installed packages (busybox-static, rdma-core, iproute2, perftest, ...).
///
/// The guest reads `rdmamig.ip=<addr>/<prefix>` and `rdmamig.mac=<mac>` from its kernel command
/// line: the NIC with that MAC gets the address and a Soft-RoCE device, at boot and whenever
/// one is hot-plugged. `RDMAMIG-READY` on the serial console means the device is ACTIVE; the
/// console then runs one shell command per line.
///
/// Example:
///   rdmamig-image --out target/testbed --binary target/release/rdmamig-agent
///   qemu-system-x86_64 -accel tcg -machine q35 -m 512 -nographic -kernel <kernel> \
///     -initrd target/testbed/initramfs.cpio.gz \
///     -append "console=ttyS0 panic=-1 quiet rdmamig.ip=10.77.0.11/24 rdmamig.mac=52:54:00:77:00:11" ...
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// Output directory for initramfs.cpio.gz (created if missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// A guest program to install to /usr/bin (with its libraries); repeatable.
    #[arg(long = "binary", value_name = "PATH")]
    binaries: Vec<PathBuf>,
    /// Kernel version (default: the newest /boot/vmlinuz-<v> with /lib/modules/<v>).
    #[arg(long, value_name = "VERSION")]
    kernel_version: Option<String>,
    /// An extra kernel module to load at boot (dependencies included); repeatable.
    #[arg(long = "module", value_name = "NAME")]
    modules: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let spec = rdmamig_images::ImageSpec {
        out_dir: args.out,
        guest_binaries: args.binaries,
        kernel_version: args.kernel_version,
        extra_modules: args.modules,
        ..Default::default()
    };
    let started = Instant::now();
    match rdmamig_images::build(&spec) {
        Ok(image) => {
            let size = std::fs::metadata(&image.initramfs)
                .map(|m| m.len())
                .unwrap_or(0);
            println!("kernel    {}", image.kernel.display());
            println!(
                "initramfs {} ({size} bytes, {})",
                image.initramfs.display(),
                if image.rebuilt {
                    "built"
                } else {
                    "unchanged, reused"
                }
            );
            println!("took      {:.2} s", started.elapsed().as_secs_f64());
            ExitCode::SUCCESS
        }
        Err(err) => {
            let mut message = format!("error: {err}");
            let mut source = std::error::Error::source(&err);
            while let Some(cause) = source {
                message.push_str(&format!("\n  caused by: {cause}"));
                source = cause.source();
            }
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}
