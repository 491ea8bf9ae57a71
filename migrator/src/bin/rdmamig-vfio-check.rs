//! `rdmamig-vfio-check`: runs the migrator's VFIO layer against every PCI device with the
//! given vendor:device ids, as a host would, and prints one JSON line per device.
//!
//! It is the in-guest half of the test-bed VFIO test (tests/tests/vfio.rs): a guest with an
//! emulated IOMMU plays the host, and this program does what the migrator does with a
//! passthrough function, for real: refuse it while it is not on vfio-pci, bind it through
//! driver_override, check its IOMMU group, open it through vfio-ioctls, reset it (or say that
//! it advertises no reset), map and unmap DMA, and ask whether it supports VFIO migration.
//!
//! Usage: `rdmamig-vfio-check 1234:11e8 8086:10d3 ...`

use std::process::ExitCode;

use clap::Parser;

use rdmamig_migrator::vfio::{dma_memory, Sysfs, VfioFunction};
use rdmamig_proto::text::error_chain;
use serde_json::{json, Map, Value};
use vm_memory::{Bytes, GuestAddress};

/// Where the DMA check maps its buffer.
const IOVA: u64 = 0x10_0000;

/// The DMA buffer's size.
const DMA_LEN: usize = 64 * 1024;

/// Runs the migrator's VFIO layer (bind to vfio-pci, IOMMU group, open, reset, DMA map and
/// unmap, the migration query) against every PCI device with the given ids, and prints one
/// JSON line per device. It binds devices to vfio-pci: run it where that is wanted (the
/// test bed's guest that plays a host).
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// PCI vendor:device ids in hex, as lspci -n shows them (e.g. 8086:10ca for an igbvf VF).
    #[arg(required = true, value_name = "VENDOR:DEVICE")]
    ids: Vec<String>,
}

fn main() -> ExitCode {
    let wanted = Cli::parse().ids;
    let sysfs = Sysfs::default();
    let mut addresses: Vec<(String, String)> = match std::fs::read_dir("/sys/bus/pci/devices") {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let address = e.file_name().to_string_lossy().into_owned();
                let id = |file: &str| {
                    std::fs::read_to_string(e.path().join(file))
                        .map(|s| s.trim().trim_start_matches("0x").to_string())
                        .unwrap_or_default()
                };
                let ids = format!("{}:{}", id("vendor"), id("device"));
                wanted.contains(&ids).then_some((address, ids))
            })
            .collect(),
        Err(e) => {
            eprintln!("rdmamig-vfio-check: cannot list PCI devices: {e}");
            return ExitCode::from(1);
        }
    };
    addresses.sort();
    for (address, ids) in addresses {
        println!("{}", Value::Object(check(&sysfs, &address, &ids)));
    }
    ExitCode::SUCCESS
}

fn outcome<T>(result: Result<T, impl std::error::Error>) -> Value {
    match result {
        Ok(_) => json!("ok"),
        Err(e) => json!({ "error": error_chain(&e) }),
    }
}

fn check(sysfs: &Sysfs, address: &str, ids: &str) -> Map<String, Value> {
    let mut report = Map::new();
    report.insert("address".into(), address.into());
    report.insert("ids".into(), ids.into());
    report.insert(
        "driver_before".into(),
        json!(sysfs.driver(address).ok().flatten()),
    );
    report.insert(
        "open_before_bind".into(),
        outcome(VfioFunction::open(sysfs, address)),
    );
    report.insert("bind".into(), outcome(sysfs.bind_vfio(address)));
    report.insert("group".into(), json!(sysfs.iommu_group(address).ok()));
    let function = match VfioFunction::open(sysfs, address) {
        Ok(function) => {
            report.insert("open".into(), json!("ok"));
            function
        }
        Err(e) => {
            report.insert("open".into(), json!({ "error": error_chain(&e) }));
            return report;
        }
    };
    report.insert(
        "reset_advertised".into(),
        function.reset_advertised().into(),
    );
    report.insert("reset".into(), outcome(function.reset()));
    // Mapped, written and read back through vm-memory while mapped (the CPU side of what
    // the device would reach), then unmapped.
    let dma = dma_memory(IOVA, DMA_LEN).and_then(|memory| {
        function.dma_map(&memory)?;
        let pattern = [0x5a_u8; 64];
        let mut back = [0_u8; 64];
        let checked = memory
            .write_slice(&pattern, GuestAddress(IOVA))
            .and_then(|()| memory.read_slice(&mut back, GuestAddress(IOVA)));
        function.dma_unmap(&memory)?;
        Ok(checked.is_ok() && back == pattern)
    });
    report.insert(
        "dma".into(),
        match dma {
            Ok(true) => json!("ok"),
            Ok(false) => json!({ "error": "the mapped memory did not read back what was written" }),
            Err(e) => json!({ "error": error_chain(&e) }),
        },
    );
    report.insert(
        "migration".into(),
        match function.migration_support() {
            Ok(None) => json!("not supported"),
            Ok(Some(flags)) => json!({ "flags": flags }),
            Err(e) => json!({ "error": error_chain(&e) }),
        },
    );
    report
}
