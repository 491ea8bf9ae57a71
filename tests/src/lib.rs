//! The rdmamig test bed: real RDMA (Soft-RoCE), real hot-plug and real live migration in QEMU
//! TCG guests, on a machine without RDMA hardware (see `../shared/TESTBED.md` and
//! `docs/testbed.md`).
//!
//! - [`ch_spec`]: Cloud Hypervisor's API spec as an oracle, and a spec-checked stand-in
//!   for its API socket; [`ch_facade`]: that API over a real QEMU guest, whose VM really
//!   moves.
//! - [`testbed`]: the fixture: a network namespace with a bridge, taps, the guest image, and
//!   cleanup of everything in `Drop`.
//! - [`guest`]: one QEMU guest: command line, process, sockets, console commands.
//! - [`console`]: the serial-console command protocol.
//! - [`qmp`]: a minimal QMP client for the harness's own checks.
//! - [`netns`]: the namespace, bridge and taps.
//! - [`nested`]: hosts that are guests (an IOMMU, an igb SR-IOV PF, QEMU, the daemon) and
//!   the VMs inside them on real VFs through real VFIO.
//! - [`pki`]: a CA and certificates for daemons that talk over mutual TLS.
//! - [`scenario`]: the move scenario the demo and the end-to-end tests run.
//! - [`steps`]: steps the connection tests share (traffic, agent control, NIC swaps).
//! - [`tap`]: a recording tap on a UNIX socket, and [`capture`]: a packet capture in the
//!   namespace (what really crossed the channels: checks, and the fuzz targets' seeds,
//!   kept by [`corpus`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use rdmamig_testbed::{GuestBinaries, Testbed};
//!
//! let tb = Testbed::builder("example")
//!     .guest_binaries(GuestBinaries::IfPresent)
//!     .build()?;
//! let a = tb.start_guest(tb.guest_spec("a")?)?;
//! let out = a.run("ibv_devinfo", Duration::from_secs(10))?;
//! assert!(out.output.contains("PORT_ACTIVE"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod capture;
pub mod ch_facade;
pub mod ch_spec;
pub mod console;
pub mod corpus;
pub mod guest;
pub mod kernel_log;
pub mod nested;
pub mod netns;
pub mod pki;
pub mod qmp;
pub mod scenario;
pub mod steps;
pub mod tap;
pub mod testbed;

/// An error and its causes on one line, for test failure messages.
pub use rdmamig_proto::text::error_chain;

pub use console::{CommandOutput, ConsoleError};
pub use guest::{Guest, GuestError, GuestSpec, NicModel, Shell};
pub use qmp::{Qmp, QmpError};
pub use testbed::{bin_dir, GuestBinaries, Testbed, TestbedBuilder, TestbedError};

/// Wall-clock milliseconds since the Unix epoch, the time base shared with the guests'
/// traffic reports and the migrator's timeline.
pub use rdmamig_proto::clock::unix_ms;
