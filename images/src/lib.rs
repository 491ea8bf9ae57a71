//! Builds the rdmamig test-bed guest image: the host's Debian kernel and an initramfs made from
//! the host's installed packages, in about a second and without network access.
//!
//! The test bed (see `docs/testbed.md` and the shared TESTBED.md) runs RDMA in QEMU TCG guests
//! with Soft-RoCE. The guest needs: busybox, the NIC, virtio-serial and RDMA kernel modules,
//! libibverbs/librdmacm with the rxe provider, iproute2's `ip` and `rdma`, a few RDMA tools for
//! smoke tests, and the project's guest binaries (the agent, the traffic tool). Everything is
//! copied from the host at its host path, with every library `ldd` reports plus the ones glibc
//! and libibverbs dlopen() (libgcc_s, the provider).
//!
//! Layout: [`cpio`] writes the archive, [`tree`] holds the file manifest, [`modules`] picks the
//! kernel and resolves module dependencies, [`ldd`] finds libraries, [`init`] generates /init
//! and the NIC hook, [`pvh`] takes the ELF kernel out of the bzImage for a PVH boot. [`build`]
//! ties them together and skips the write when nothing changed.

pub mod cpio;
pub mod init;
pub mod ldd;
pub mod modules;
pub mod pvh;
pub mod tree;

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use flate2::write::GzEncoder;
use flate2::Compression;
use nix::fcntl::{Flock, FlockArg};

use crate::init::ScriptPaths;
use crate::modules::{Kernel, ModuleDeps, ModulesError};
use crate::tree::{Tree, TreeError};

/// Kernel modules every test-bed image loads, in this order. crc32_generic is a soft
/// dependency of rdma_rxe that modules.dep does not list (without it `rdma link add` fails).
/// e1000e comes before virtio_net so that an RDMA NIC that is an e1000e is named before the
/// permanent virtio-net NIC: `eth0`, as a virtio-net RDMA NIC is. vsock_loopback lets a
/// guest process dial the agent's vsock port itself, which the agent must refuse.
pub const DEFAULT_MODULES: &[&str] = &[
    "e1000e",
    "virtio_pci",
    "virtio_net",
    "virtio_console",
    "ib_uverbs",
    "rdma_ucm",
    "rdma_rxe",
    "crc32_generic",
    "vmw_vsock_virtio_transport",
    "vsock_loopback",
];

/// Host programs copied into every image (with their libraries), found in [`TOOL_DIRS`].
pub const TOOLS: &[&str] = &[
    "ip",
    "rdma",
    "rping",
    "ibv_devinfo",
    "ibv_rc_pingpong",
    "ib_send_lat",
    "ib_send_bw",
    "ib_write_bw",
];

/// Where [`TOOLS`] are looked for, in order.
const TOOL_DIRS: &[&str] = &["/usr/sbin", "/usr/bin", "/sbin", "/bin"];

/// The statically linked busybox of Debian's busybox-static.
const BUSYBOX: &str = "/bin/busybox";

/// Directories searched for libgcc_s.so.1, which glibc dlopen()s for pthread_exit and
/// pthread_cancel: threaded programs abort without it, and ldd does not list it.
const LIBGCC_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib64",
];

/// libibverbs' provider directory and driver configuration directory.
const VERBS_PROVIDER_DIR: &str = "/usr/lib/x86_64-linux-gnu/libibverbs";
const VERBS_DRIVER_CONF: &str = "/etc/libibverbs.d/rxe.driver";

/// Name of the initramfs inside the output directory.
const INITRAMFS_NAME: &str = "initramfs.cpio.gz";
/// Its name when [`ImageSpec::uncompressed`].
const PLAIN_INITRAMFS_NAME: &str = "initramfs.cpio";
/// Name of the file recording the fingerprint of the inputs the initramfs was built from.
const STAMP_NAME: &str = "initramfs.stamp";
/// The ELF kernel's file name in the output directory.
const KERNEL_NAME: &str = "vmlinux";

/// What to build.
#[derive(Debug, Clone, Default)]
pub struct ImageSpec {
    /// Where the initramfs (and its stamp and lock files) go; created if missing.
    pub out_dir: PathBuf,
    /// The project's guest programs, installed to /usr/bin under their file names.
    pub guest_binaries: Vec<PathBuf>,
    /// The kernel version to use; `None` picks the newest installed kernel with modules.
    pub kernel_version: Option<String>,
    /// Kernel modules to load at boot beyond [`DEFAULT_MODULES`], e.g. `vfio_pci`.
    pub extra_modules: Vec<String>,
    /// Host programs and shared objects copied at their host paths with every library they
    /// need: what an image that plays a host runs (qemu-system-x86_64, and the accelerator
    /// module Debian's QEMU dlopen()s).
    pub host_programs: Vec<PathBuf>,
    /// Files copied to a guest path: `(host file, guest path)`, e.g. a nested VM's kernel.
    pub files: Vec<(PathBuf, PathBuf)>,
    /// Installs the guest binaries without their debug info (`strip --strip-debug`; symbols
    /// stay): line tables make them about five times larger, and a VM nested in a host
    /// decompresses its initramfs at nested-TCG speed.
    pub strip_debug: bool,
    /// Writes the initramfs as a plain cpio, not gzip-compressed: a VM nested in a host
    /// spent about 120 s of its boot unpacking the gzip at nested-TCG speed (2026-12-02),
    /// where the host, which carries the image in its own compressed initramfs, unpacks it
    /// at its faster speed.
    pub uncompressed: bool,
}

/// A built image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The ELF kernel for QEMU's PVH boot, taken out of `/boot/vmlinuz-<version>`
    /// ([`pvh`]).
    pub kernel: PathBuf,
    /// The newc initramfs, gzip-compressed unless [`ImageSpec::uncompressed`].
    pub initramfs: PathBuf,
    /// The kernel version.
    pub kernel_version: String,
    /// False when an initramfs built from identical inputs was already there.
    pub rebuilt: bool,
}

/// Errors of building an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No usable kernel.
    #[error("finding the guest kernel")]
    FindKernel(#[source] ModulesError),
    /// The ELF kernel could not be taken out of the bzImage.
    #[error("preparing the guest kernel for a PVH boot")]
    Kernel(#[source] pvh::PvhError),
    /// The module set could not be resolved.
    #[error("resolving kernel modules for {version}")]
    ResolveModules {
        /// The kernel version.
        version: String,
        /// What went wrong.
        #[source]
        source: ModulesError,
    },
    /// A required host program or file is not installed.
    #[error("{what} not found (looked in {searched}); install {package}")]
    Missing {
        /// What is missing.
        what: String,
        /// Where it was looked for.
        searched: String,
        /// The Debian package that provides it.
        package: &'static str,
    },
    /// A guest binary given by the caller does not exist or is not an ELF file.
    #[error("guest binary {path} does not exist or is not an ELF executable")]
    GuestBinary {
        /// The path given.
        path: PathBuf,
    },
    /// Adding something to the file manifest failed.
    #[error("adding {what} to the image")]
    Add {
        /// What was being added.
        what: String,
        /// What went wrong.
        #[source]
        source: TreeError,
    },
    /// Listing busybox's applets failed.
    #[error("listing the applets of {busybox}")]
    BusyboxApplets {
        /// The busybox binary.
        busybox: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The output directory or its lock could not be set up.
    #[error("preparing output directory {path}")]
    OutDir {
        /// The output directory or lock file.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Writing the archive failed.
    #[error("writing {path}")]
    WriteArchive {
        /// The file being written.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: TreeError,
    },
    /// Compressing, flushing or installing the archive failed.
    #[error("finishing {path}")]
    FinishArchive {
        /// The file being written.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Builds the image described by `spec`, or reuses the one in `spec.out_dir` when it was built
/// from identical inputs (same manifest, same host files by size and modification time).
///
/// Concurrent builds into one directory (parallel test processes) serialise on a lock file,
/// and the initramfs is replaced atomically by rename, so a QEMU reading the old one is never
/// disturbed.
pub fn build(spec: &ImageSpec) -> Result<Image, ImageError> {
    let kernel = Kernel::find(
        Path::new("/boot"),
        Path::new("/lib/modules"),
        spec.kernel_version.as_deref(),
    )
    .map_err(ImageError::FindKernel)?;
    let tree = manifest(spec, &kernel)?;

    fs::create_dir_all(&spec.out_dir).map_err(|source| ImageError::OutDir {
        path: spec.out_dir.clone(),
        source,
    })?;
    let lock_path = spec.out_dir.join(".build.lock");
    let lock_file = fs::File::create(&lock_path).map_err(|source| ImageError::OutDir {
        path: lock_path.clone(),
        source,
    })?;
    let _lock = Flock::lock(lock_file, FlockArg::LockExclusive).map_err(|(_, errno)| {
        ImageError::OutDir {
            path: lock_path.clone(),
            source: errno.into(),
        }
    })?;

    let vmlinux = spec.out_dir.join(KERNEL_NAME);
    pvh::extract(&kernel.image, &vmlinux).map_err(ImageError::Kernel)?;
    let name = if spec.uncompressed {
        PLAIN_INITRAMFS_NAME
    } else {
        INITRAMFS_NAME
    };
    let initramfs = spec.out_dir.join(name);
    let stamp_path = spec.out_dir.join(STAMP_NAME);
    // The name too: the stamp must not vouch for the other format's file.
    let stamp = format!("{:016x} {} {name}\n", tree.fingerprint(), kernel.version);
    let image = |rebuilt| Image {
        kernel: vmlinux.clone(),
        initramfs: initramfs.clone(),
        kernel_version: kernel.version.clone(),
        rebuilt,
    };
    if initramfs.is_file() && fs::read_to_string(&stamp_path).ok().as_deref() == Some(&stamp) {
        return Ok(image(false));
    }
    write_archive(&tree, &initramfs, !spec.uncompressed)?;
    fs::write(&stamp_path, stamp).map_err(|source| ImageError::FinishArchive {
        path: stamp_path.clone(),
        source,
    })?;
    Ok(image(true))
}

/// Collects every file of the guest root file system.
fn manifest(spec: &ImageSpec, kernel: &Kernel) -> Result<Tree, ImageError> {
    let add = |what: &str| {
        let what = what.to_owned();
        move |source| ImageError::Add { what, source }
    };
    let mut tree = Tree::new();
    tree.mirror_top_level_links(&["bin", "sbin", "lib", "lib64"])
        .map_err(add("the merged-/usr symlinks"))?;
    for dir in ["dev", "proc", "sys", "tmp", "run", "root", "etc"] {
        tree.add_dir(dir).map_err(add(dir))?;
    }
    // The kernel opens /dev/console for /init's stdio before devtmpfs is mounted.
    tree.add_char_device("dev/console", 5, 1, 0o600)
        .map_err(add("/dev/console"))?;

    // Programs: iproute2 and the RDMA tools at their host paths.
    let mut tool_paths = Vec::new();
    for tool in TOOLS {
        let host = TOOL_DIRS
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.is_file())
            .ok_or_else(|| ImageError::Missing {
                what: format!("program {tool}"),
                searched: TOOL_DIRS.join(", "),
                package: "iproute2 rdmacm-utils ibverbs-utils perftest",
            })?;
        let guest = tree.add_elf(&host).map_err(add(&host.to_string_lossy()))?;
        tool_paths.push(format!("/{}", guest.display()));
    }

    // libibverbs' rxe provider and its configuration (dlopen()ed, invisible to ldd).
    let provider = fs::read_dir(VERBS_PROVIDER_DIR)
        .ok()
        .and_then(|entries| {
            entries.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("librxe-rdmav") && n.ends_with(".so"))
            })
        })
        .ok_or_else(|| ImageError::Missing {
            what: "the Soft-RoCE provider librxe-rdmav*.so".into(),
            searched: VERBS_PROVIDER_DIR.into(),
            package: "ibverbs-providers",
        })?;
    tree.add_elf(&provider)
        .map_err(add(&provider.to_string_lossy()))?;
    tree.add_host_file(Path::new(VERBS_DRIVER_CONF))
        .map_err(add(VERBS_DRIVER_CONF))?;
    let libgcc = LIBGCC_DIRS
        .iter()
        .map(|d| Path::new(d).join("libgcc_s.so.1"))
        .find(|p| p.exists())
        .ok_or_else(|| ImageError::Missing {
            what: "libgcc_s.so.1".into(),
            searched: LIBGCC_DIRS.join(", "),
            package: "libgcc-s1",
        })?;
    tree.add_elf(&libgcc).map_err(add("libgcc_s.so.1"))?;

    // The project's guest programs.
    for binary in &spec.guest_binaries {
        let name = binary
            .file_name()
            .filter(|_| ldd::is_elf(binary))
            .ok_or_else(|| ImageError::GuestBinary {
                path: binary.clone(),
            })?;
        let what = binary.to_string_lossy();
        let installed = if spec.strip_debug {
            stripped(binary, &spec.out_dir)?
        } else {
            binary.clone()
        };
        tree.add_host_file_as(&installed, &Path::new("usr/bin").join(name))
            .map_err(add(&what))?;
        tree.add_libraries_of(binary).map_err(add(&what))?;
    }

    // What a host-playing image runs, and the files it carries.
    for program in &spec.host_programs {
        tree.add_elf(program)
            .map_err(add(&program.to_string_lossy()))?;
    }
    for (host, guest) in &spec.files {
        let guest = guest.strip_prefix("/").unwrap_or(guest);
        tree.add_host_file_as(host, guest)
            .map_err(add(&host.to_string_lossy()))?;
    }

    // Kernel modules, resolved on the host into insmod order.
    let mut names: Vec<&str> = DEFAULT_MODULES.to_vec();
    names.extend(spec.extra_modules.iter().map(String::as_str));
    let resolve_error = |source| ImageError::ResolveModules {
        version: kernel.version.clone(),
        source,
    };
    let order = ModuleDeps::load(&kernel.modules_dir)
        .and_then(|deps| deps.resolve(&names))
        .map_err(resolve_error)?;
    let mut module_paths = Vec::new();
    for rel in &order {
        let host = kernel.modules_dir.join(rel);
        let guest = tree
            .add_host_file(&host)
            .map_err(add(&host.to_string_lossy()))?;
        module_paths.push(format!("/{}", guest.display()));
    }

    // Busybox and its applets; real programs keep their paths (iproute2's ip wins over the
    // applet).
    let busybox = tree
        .add_host_file(Path::new(BUSYBOX))
        .map_err(add(BUSYBOX))?;
    let busybox_target = format!("/{}", busybox.display());
    for applet in busybox_applets()? {
        let guest = Tree::guest_path(&Path::new("/").join(&applet))
            .map_err(add(&format!("busybox applet {applet}")))?;
        tree.add_symlink_if_absent(&guest, &busybox_target)
            .map_err(add(&format!("busybox applet {applet}")))?;
    }

    // Scripts.
    let paths = ScriptPaths {
        ip: &tool_paths[0],
        rdma: &tool_paths[1],
        modules: &module_paths,
    };
    tree.add_bytes("init", 0o755, init::init_script(&paths).into_bytes())
        .map_err(add("/init"))?;
    tree.add_bytes(
        init::NETPLUG_PATH.trim_start_matches('/'),
        0o755,
        init::netplug_script(&paths).into_bytes(),
    )
    .map_err(add(init::NETPLUG_PATH))?;
    tree.add_bytes(
        init::CONSOLE_PATH.trim_start_matches('/'),
        0o755,
        init::console_script().into_bytes(),
    )
    .map_err(add(init::CONSOLE_PATH))?;
    Ok(tree)
}

/// A copy of `binary` without debug info in `<out_dir>/stripped/`, made again only when the
/// binary is newer than the copy (so that an unchanged image is reused).
fn stripped(binary: &Path, out_dir: &Path) -> Result<PathBuf, ImageError> {
    let dir = out_dir.join("stripped");
    let out_error = |source| ImageError::OutDir {
        path: dir.clone(),
        source,
    };
    fs::create_dir_all(&dir).map_err(out_error)?;
    let copy = dir.join(binary.file_name().unwrap_or_default());
    let modified = |path: &Path| fs::metadata(path).and_then(|m| m.modified()).ok();
    if modified(&copy).is_some() && modified(&copy) >= modified(binary) {
        return Ok(copy);
    }
    let status = Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&copy)
        .arg(binary)
        .status();
    match status {
        Ok(status) if status.success() => Ok(copy),
        _ => Err(ImageError::Missing {
            what: format!("a working `strip` for {}", binary.display()),
            searched: "PATH".into(),
            package: "binutils",
        }),
    }
}

/// Busybox's applets as paths relative to / (`bin/sh`, `sbin/insmod`, ...).
fn busybox_applets() -> Result<Vec<String>, ImageError> {
    let out = Command::new(BUSYBOX)
        .arg("--list-full")
        .output()
        .map_err(|source| ImageError::BusyboxApplets {
            busybox: BUSYBOX.into(),
            source,
        })?;
    if !out.status.success() {
        return Err(ImageError::Missing {
            what: format!("a working {BUSYBOX}"),
            searched: BUSYBOX.into(),
            package: "busybox-static",
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect())
}

/// Writes the archive, gzip-compressed when `compress`, to a temporary file beside `dest` and
/// renames it over `dest`.
fn write_archive(tree: &Tree, dest: &Path, compress: bool) -> Result<(), ImageError> {
    let tmp = dest.with_extension(format!("tmp{}", std::process::id()));
    let finish_error = |source| ImageError::FinishArchive {
        path: tmp.clone(),
        source,
    };
    let write_error = |source| ImageError::WriteArchive {
        path: tmp.clone(),
        source,
    };
    let file = BufWriter::new(fs::File::create(&tmp).map_err(finish_error)?);
    let mut out = if compress {
        let gz = tree
            .write(GzEncoder::new(file, Compression::default()))
            .map_err(write_error)?;
        gz.finish().map_err(finish_error)?
    } else {
        tree.write(file).map_err(write_error)?
    };
    out.flush().map_err(finish_error)?;
    fs::rename(&tmp, dest).map_err(|source| ImageError::FinishArchive {
        path: dest.to_owned(),
        source,
    })
}
