//! The test-bed fixture: owns the network namespace, the guests' QEMU processes and the
//! temporary directory, and cleans all of them up in `Drop`, panics included.
//!
//! A test creates a [`Testbed`], asks it for guest specs (each with a fresh tap on the bridge,
//! a MAC and an address in 10.77.0.0/24 for the RDMA NIC, and another tap, MAC and address in
//! 10.78.0.0/24 for the permanent NIC), and starts guests from them. When the test bed is
//! dropped while the thread panics (a failed assertion), it prints every guest's console tail
//! to stderr first. `RDMAMIG_KEEP=1` keeps the temporary directory (sockets, console logs) for
//! inspection.
//!
//! The guest image is built by the harness itself (`rdmamig_images::build`, about a second,
//! reused when unchanged) into `<workspace>/target/testbed`, with the project's guest binaries
//! from `RDMAMIG_BIN_DIR` (default `<workspace>/target/release`). Each test bed then copies the
//! initramfs into its own directory, so a rebuild by another process during a test (e.g.
//! between starting a migration source and its destination) cannot change what a test boots.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use rdmamig_images::{Image, ImageError, ImageSpec};

use crate::guest::{Guest, GuestError, GuestSpec, Launch, NicModel, VmProcess};
use crate::netns::{self, NetNs, NetnsError};

/// The guest programs the project builds, installed into the image.
pub const GUEST_BINARIES: &[&str] = &[
    "rdmamig-agent",
    "rdmamig-traffic",
    "rdmamig-perf",
    "rdmamig-run",
];
/// The preload library `rdmamig-run` loads, and where the images install it (rdmamig-run
/// finds it in `../lib/rdmamig/` from itself).
pub const PRELOAD_LIBRARY: (&str, &str) = (
    "librdmamig_preload.so",
    "/usr/lib/rdmamig/librdmamig_preload.so",
);
/// The subnet guests live in (inside the test bed's namespace only).
pub const SUBNET_PREFIX: &str = "10.77.0";
/// The subnet of the guests' permanent NICs (same bridge and namespace, separate subnet).
pub const PERMANENT_SUBNET_PREFIX: &str = "10.78.0";
/// The first host number handed out (guest a gets .11, b .12, ...).
const FIRST_HOST: u8 = 11;
/// Memory per guest, MiB.
const GUEST_MEMORY_MIB: u32 = 512;

/// Errors of setting up a test bed or starting guests on it.
#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    /// Something the test bed needs is missing on this machine.
    #[error("test bed prerequisite missing: {what} ({hint})")]
    Prerequisite {
        /// What is missing.
        what: String,
        /// How to provide it.
        hint: String,
    },
    /// A required guest binary is not built.
    #[error("guest binary {path} does not exist (build it: cargo build --release -p rdmamig-guest; or set RDMAMIG_BIN_DIR)")]
    GuestBinaryMissing {
        /// Where it was expected.
        path: PathBuf,
    },
    /// Building the guest image failed.
    #[error("building the guest image in {out_dir}")]
    BuildImage {
        /// The image directory.
        out_dir: PathBuf,
        /// What went wrong.
        #[source]
        source: Box<ImageError>,
    },
    /// The temporary directory could not be set up.
    #[error("preparing the test bed directory for {testbed}")]
    TempDir {
        /// The test bed's name.
        testbed: String,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Creating the network namespace failed.
    #[error("creating network namespace {netns}")]
    CreateNamespace {
        /// The namespace's name.
        netns: String,
        /// What went wrong.
        #[source]
        source: NetnsError,
    },
    /// Removing namespaces left by killed test runs failed.
    #[error("removing network namespaces left by killed test runs")]
    SweepStale(#[source] NetnsError),
    /// Creating a tap failed.
    #[error("adding a tap in network namespace {netns}")]
    AddTap {
        /// The namespace's name.
        netns: String,
        /// What went wrong.
        #[source]
        source: NetnsError,
    },
    /// Taking a tap off the bridge, or putting it back, failed.
    #[error("setting tap {tap} on or off the bridge of network namespace {netns}")]
    JoinTap {
        /// The tap.
        tap: String,
        /// The namespace's name.
        netns: String,
        /// What went wrong.
        #[source]
        source: NetnsError,
    },
    /// Giving the bridge an address failed.
    #[error("giving the bridge of network namespace {netns} an address")]
    BridgeAddress {
        /// The namespace's name.
        netns: String,
        /// What went wrong.
        #[source]
        source: NetnsError,
    },
    /// All guest addresses are taken.
    #[error("no guest address left in {SUBNET_PREFIX}.0/24")]
    AddressesExhausted,
    /// A guest failed to start.
    #[error("starting guest {guest}")]
    StartGuest {
        /// The guest's name.
        guest: String,
        /// What went wrong.
        #[source]
        source: Box<GuestError>,
    },
}

/// Whether the project's guest binaries must be in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestBinaries {
    /// Every one of [`GUEST_BINARIES`] must exist in the bin dir, or the test bed fails.
    Required,
    /// Those that exist are installed; the others are left out.
    IfPresent,
}

/// Configures a [`Testbed`].
#[derive(Debug, Clone)]
pub struct TestbedBuilder {
    name: String,
    guest_binaries: GuestBinaries,
}

/// A network namespace with a bridge, and the guests running on it.
#[derive(Debug)]
pub struct Testbed {
    name: String,
    dir: PathBuf,
    /// `None` when RDMAMIG_KEEP=1 keeps the directory.
    _tempdir: Option<tempfile::TempDir>,
    netns: NetNs,
    image: Image,
    next_host: AtomicU8,
    guests: Mutex<Vec<Arc<VmProcess>>>,
}

/// Makes namespace names unique among the test beds of one process.
static NEXT_TESTBED: AtomicU32 = AtomicU32::new(0);

impl TestbedBuilder {
    /// Chooses whether the guest binaries are required (the default) or optional.
    pub fn guest_binaries(mut self, guest_binaries: GuestBinaries) -> Self {
        self.guest_binaries = guest_binaries;
        self
    }

    /// Checks the prerequisites, builds (or reuses) the image, and creates the namespace, the
    /// bridge and the temporary directory.
    pub fn build(self) -> Result<Testbed, TestbedError> {
        check_prerequisites()?;
        let image = build_image(self.guest_binaries)?;
        let tmp_error = |source| TestbedError::TempDir {
            testbed: self.name.clone(),
            source,
        };
        let tempdir = tempfile::Builder::new()
            .prefix(&format!("rdmamig-{}-", self.name))
            .tempdir()
            .map_err(tmp_error)?;
        let (dir, tempdir) = if std::env::var("RDMAMIG_KEEP").as_deref() == Ok("1") {
            let dir = tempdir.keep();
            eprintln!("rdmamig-testbed: keeping {}", dir.display());
            (dir, None)
        } else {
            (tempdir.path().to_owned(), Some(tempdir))
        };
        // A private copy: see the module docs.
        let initramfs = dir.join(image.initramfs.file_name().unwrap_or("initramfs".as_ref()));
        fs::copy(&image.initramfs, &initramfs).map_err(tmp_error)?;
        let image = Image { initramfs, ..image };
        for stale in netns::sweep_stale().map_err(TestbedError::SweepStale)? {
            eprintln!("rdmamig-testbed: removed namespace {stale} left by a killed test run");
        }
        let netns_name = netns::namespace_name(NEXT_TESTBED.fetch_add(1, Ordering::Relaxed));
        let netns = NetNs::create(&netns_name).map_err(|source| TestbedError::CreateNamespace {
            netns: netns_name.clone(),
            source,
        })?;
        Ok(Testbed {
            name: self.name,
            dir,
            _tempdir: tempdir,
            netns,
            image,
            next_host: AtomicU8::new(FIRST_HOST),
            guests: Mutex::new(Vec::new()),
        })
    }
}

impl Testbed {
    /// A test bed with the guest binaries required (see [`Testbed::builder`]).
    pub fn new(name: &str) -> Result<Testbed, TestbedError> {
        Testbed::builder(name).build()
    }

    /// A builder for a test bed named `name` (used in the temporary directory's name).
    pub fn builder(name: &str) -> TestbedBuilder {
        TestbedBuilder {
            name: name.to_owned(),
            guest_binaries: GuestBinaries::Required,
        }
    }

    /// The test bed's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The network namespace's name (for `ip netns exec`).
    pub fn netns(&self) -> &str {
        self.netns.name()
    }

    /// The temporary directory (one subdirectory per guest).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The image guests boot (the initramfs is the test bed's private copy).
    pub fn image(&self) -> &Image {
        &self.image
    }

    /// Gives the namespace's bridge an address, so that the harness can reach guests in
    /// its subnet over TCP ([`crate::netns::connect_tcp`]).
    pub fn add_bridge_address(&self, cidr: &str) -> Result<(), TestbedError> {
        self.netns
            .add_bridge_address(cidr)
            .map_err(|source| TestbedError::BridgeAddress {
                netns: self.netns.name().to_owned(),
                source,
            })
    }

    /// Creates a tap on the bridge and returns its name.
    pub fn add_tap(&self) -> Result<String, TestbedError> {
        self.netns.add_tap().map_err(|source| TestbedError::AddTap {
            netns: self.netns.name().to_owned(),
            source,
        })
    }

    /// Takes `tap` off the test bed's bridge, or puts it back ([`NetNs::set_tap_joined`]).
    pub fn set_tap_joined(&self, tap: &str, joined: bool) -> Result<(), TestbedError> {
        self.netns
            .set_tap_joined(tap, joined)
            .map_err(|source| TestbedError::JoinTap {
                tap: tap.to_owned(),
                netns: self.netns.name().to_owned(),
                source,
            })
    }

    /// A spec for a new guest: a new tap, the next address in 10.77.0.0/24 (from .11) and a
    /// matching MAC `52:54:00:77:00:<host in hex>`, with the NIC present; and for the
    /// permanent NIC another new tap, the same host number in 10.78.0.0/24 and MAC
    /// `52:54:00:78:00:<host in hex>`.
    pub fn guest_spec(&self, name: &str) -> Result<GuestSpec, TestbedError> {
        let host = self
            .next_host
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| h.checked_add(1))
            .ok()
            .filter(|&h| h < 255)
            .ok_or(TestbedError::AddressesExhausted)?;
        Ok(GuestSpec {
            name: name.to_owned(),
            ip: format!("{SUBNET_PREFIX}.{host}/24"),
            mac: format!("52:54:00:77:00:{host:02x}"),
            tap: self.add_tap()?,
            permanent_ip: format!("{PERMANENT_SUBNET_PREFIX}.{host}/24"),
            permanent_mac: format!("52:54:00:78:00:{host:02x}"),
            permanent_tap: self.add_tap()?,
            with_nic: true,
            rdma_nic: NicModel::default(),
            memory_mib: GUEST_MEMORY_MIB,
            vsock_cid: None,
            with_vsock: true,
            iommu: false,
            cpus: 1,
            paused_on_arrival: false,
        })
    }

    /// A spec for the migration destination of `source`: the same addresses and MACs, new
    /// taps for both NICs, and no RDMA NIC device (it is plugged after the move); the
    /// permanent NIC is there, as on the source. Nor a vsock device, which cannot migrate
    /// ([`GuestSpec::with_vsock`]).
    pub fn incoming_spec(&self, source: &GuestSpec, name: &str) -> Result<GuestSpec, TestbedError> {
        Ok(GuestSpec {
            name: name.to_owned(),
            tap: self.add_tap()?,
            permanent_tap: self.add_tap()?,
            with_nic: false,
            with_vsock: false,
            ..source.clone()
        })
    }

    /// Starts a guest and waits (at most [`crate::guest::BOOT_TIMEOUT`]) until it prints
    /// `RDMAMIG-READY`: booted, and its RDMA NIC (if any) has an ACTIVE Soft-RoCE device.
    pub fn start_guest(&self, spec: GuestSpec) -> Result<Guest, TestbedError> {
        self.start_guest_from(spec, &self.image.clone(), crate::guest::BOOT_TIMEOUT)
    }

    /// Starts a guest from another image (a host image: [`crate::nested`]) and waits at most
    /// `boot_timeout` until it prints `RDMAMIG-READY`.
    pub fn start_guest_from(
        &self,
        spec: GuestSpec,
        image: &Image,
        boot_timeout: std::time::Duration,
    ) -> Result<Guest, TestbedError> {
        let name = spec.name.clone();
        let guest = self.launch(spec, false, image)?;
        guest
            .wait_ready(boot_timeout)
            .map_err(|source| TestbedError::StartGuest {
                guest: name,
                source: Box::new(source),
            })?;
        Ok(guest)
    }

    /// Starts a migration destination (`-incoming defer`); returns once its QMP socket accepts
    /// clients. The migrator sets the URI with `migrate-incoming`; after the move,
    /// [`Guest::run`] attaches to its console, where the source's shell loop carries on.
    pub fn start_incoming(&self, spec: GuestSpec) -> Result<Guest, TestbedError> {
        self.launch(spec, true, &self.image)
    }

    /// Starts a guest saved by [`Guest::save`] again from `snapshot`, with `spec` and `image`
    /// as it was started (the same command line; its taps may be the same once the saved
    /// QEMU is gone), and returns once it runs.
    pub fn restore_guest(
        &self,
        spec: GuestSpec,
        image: &Image,
        snapshot: &Path,
    ) -> Result<Guest, TestbedError> {
        let name = spec.name.clone();
        let guest = self.launch(spec, true, image)?;
        guest
            .load(snapshot)
            .map_err(|source| TestbedError::StartGuest {
                guest: name,
                source: Box::new(source),
            })?;
        Ok(guest)
    }

    /// Prints every guest's console tail and QEMU log tail to stderr. Also done automatically
    /// when the test bed is dropped during a panic.
    pub fn dump_on_failure(&self) {
        let guests = self.guests.lock().unwrap_or_else(|p| p.into_inner());
        eprintln!(
            "rdmamig-testbed {}: namespace {}, directory {}",
            self.name,
            self.netns.name(),
            self.dir.display()
        );
        for guest in guests.iter() {
            eprintln!("{}", guest.dump());
        }
    }

    fn launch(
        &self,
        spec: GuestSpec,
        incoming: bool,
        image: &Image,
    ) -> Result<Guest, TestbedError> {
        let name = spec.name.clone();
        let dir = self.dir.join(&name);
        let guest = Guest::launch(
            spec,
            Launch {
                netns: self.netns.name(),
                image,
                dir,
                incoming,
            },
        )
        .map_err(|source| TestbedError::StartGuest {
            guest: name,
            source: Box::new(source),
        })?;
        self.guests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::clone(guest.process()));
        Ok(guest)
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_on_failure();
        }
        let guests = self.guests.lock().unwrap_or_else(|p| p.into_inner());
        for guest in guests.iter() {
            guest.stop();
        }
        // Then the fields drop: the namespace (with its bridge and taps), then the directory.
    }
}

/// Fails clearly when something the test bed needs is missing; never skips.
fn check_prerequisites() -> Result<(), TestbedError> {
    let missing = |what: &str, hint: &str| {
        Err(TestbedError::Prerequisite {
            what: what.into(),
            hint: hint.into(),
        })
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return missing(
            "root",
            "network namespaces and taps need CAP_NET_ADMIN; run the tests as root",
        );
    }
    if !Path::new("/dev/net/tun").exists() {
        return missing("/dev/net/tun", "load the tun module: modprobe tun");
    }
    for (program, package) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("ip", "iproute2"),
    ] {
        if !in_path(program) {
            return missing(program, &format!("apt-get install {package}"));
        }
    }
    let version = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default();
    match qemu_major(&version) {
        Some(major) if major >= QEMU_MIN_MAJOR => Ok(()),
        _ => missing(
            &format!(
                "QEMU {QEMU_MIN_MAJOR} or newer (found: {})",
                version.lines().next().unwrap_or("no version")
            ),
            "QEMU 7.2's TCG migration now and then damages a moved guest's kernel memory \
             (docs/testbed.md); scripts/setup.sh installs QEMU 10 from bookworm-backports",
        ),
    }
}

/// The oldest QEMU whose migrations the test bed trusts (see [`check_prerequisites`]).
const QEMU_MIN_MAJOR: u32 = 10;

/// The major version in `qemu-system-x86_64 --version`'s first line.
fn qemu_major(version: &str) -> Option<u32> {
    version
        .lines()
        .next()?
        .strip_prefix("QEMU emulator version ")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

fn in_path(program: &str) -> bool {
    find_in_path(program).is_some()
}

/// Where `program` is in PATH, if anywhere.
pub(crate) fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// The workspace root (this crate lives in `<workspace>/tests`).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_owned()
}

/// Where the project's binaries are: `RDMAMIG_BIN_DIR`, else `<workspace>/target/release`.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("RDMAMIG_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/release"))
}

/// Builds (or reuses) the image in `<workspace>/target/testbed`.
fn build_image(guest_binaries: GuestBinaries) -> Result<Image, TestbedError> {
    let root = workspace_root();
    let bin_dir = bin_dir();
    let mut binaries = Vec::new();
    for name in GUEST_BINARIES {
        let path = bin_dir.join(name);
        if path.is_file() {
            binaries.push(path);
        } else if guest_binaries == GuestBinaries::Required {
            return Err(TestbedError::GuestBinaryMissing { path });
        }
    }
    let mut files = Vec::new();
    let (library, installed) = PRELOAD_LIBRARY;
    let library = bin_dir.join(library);
    if library.is_file() {
        files.push((library, PathBuf::from(installed)));
    } else if guest_binaries == GuestBinaries::Required {
        return Err(TestbedError::GuestBinaryMissing { path: library });
    }
    let out_dir = root.join("target/testbed");
    rdmamig_images::build(&ImageSpec {
        out_dir: out_dir.clone(),
        guest_binaries: binaries,
        files,
        // Plain and without debug info: a guest spent 2.9-4.5 s of its ~6-9 s boot
        // inflating the 28 MB gzip (the kernel's async unpacking, which crypto_kdf108_init
        // waits for), 0.6 s reading the 27 MB plain cpio (2026-12-07, initcall_debug).
        strip_debug: true,
        uncompressed: true,
        ..ImageSpec::default()
    })
    .map_err(|source| TestbedError::BuildImage {
        out_dir,
        source: Box::new(source),
    })
}

#[cfg(test)]
mod tests {
    use super::qemu_major;

    #[test]
    fn the_qemu_major_version_is_read_from_the_first_line() {
        let debian = "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\n\
                      Copyright (c) 2003-2025 Fabrice Bellard and the QEMU Project developers\n";
        assert_eq!(qemu_major(debian), Some(10));
        assert_eq!(
            qemu_major("QEMU emulator version 7.2.22 (Debian)\n"),
            Some(7)
        );
        assert_eq!(qemu_major(""), None);
        assert_eq!(qemu_major("qemu-system-x86_64: not found\n"), None);
    }
}
