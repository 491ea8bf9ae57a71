//! Host-side VFIO for passthrough functions: SR-IOV preparation through sysfs, and the
//! device itself through vfio-ioctls (open, reset, DMA map/unmap, migration support).
//!
//! Two layers. [`Sysfs`] does what an operator would do with `echo` under
//! `/sys/bus/pci/devices/<address>` (create VFs, bind a VF to vfio-pci through
//! `driver_override`, find its IOMMU group and check that every device in the group is safe to
//! hand out); it takes the sysfs root as a parameter so its logic is unit-tested on a fake
//! tree. [`VfioFunction`] opens the device through vfio-ioctls after those checks, so that a
//! host without VFIO, a device on another driver, or a group that is not viable is an error
//! that names what is missing instead of an ioctl failure (or a panic) deep inside the crate.
//!
//! Reset: vfio-ioctls' `VfioDevice::reset()` returns nothing and silently does nothing when
//! the device does not advertise VFIO_DEVICE_FLAGS_RESET. A VF that goes back to the pool
//! unreset may still process work posted before the detach, so [`VfioFunction::reset`] reads
//! the flag itself (VFIO_DEVICE_GET_INFO) and reports a device without reset as an error the
//! caller acts on (quarantine), never as a success.
//!
//! Tested for real inside a test-bed guest that plays the host (an emulated IOMMU, QEMU's
//! `edu` device and an e1000e bound to vfio-pci): `rdmamig-vfio-check` and
//! tests/tests/vfio.rs.

use std::os::fd::OwnedFd;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rdmamig_vmm::VfioHandover;

use thiserror::Error;
use vfio_bindings::bindings::vfio::{vfio_device_info, VFIO_DEVICE_FLAGS_RESET};
use vfio_ioctls::{VfioContainer, VfioDevice};
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// The driver a passthrough function must be bound to.
pub const VFIO_DRIVER: &str = "vfio-pci";

/// The VFIO container device.
pub const VFIO_CONTAINER: &str = "/dev/vfio/vfio";

/// VFIO_DEVICE_GET_INFO: _IO(VFIO_TYPE ';', VFIO_BASE 100 + 7).
const VFIO_DEVICE_GET_INFO: libc::c_ulong = (b';' as libc::c_ulong) << 8 | (100 + 7);

/// Drivers that may share an IOMMU group with a passthrough function without making the
/// group unsafe: none (an unbound device), vfio-pci itself, and PCIe port drivers (a bridge
/// in the group does no DMA of its own).
const GROUP_SAFE_DRIVERS: &[&str] = &[VFIO_DRIVER, "pcieport"];

/// Why a VFIO step failed.
#[derive(Debug, Error)]
pub enum VfioError {
    /// The host has no VFIO (module not loaded, or no IOMMU).
    #[error("this host has no VFIO: {missing} is missing ({hint})")]
    NoVfio {
        /// What is missing.
        missing: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// The PCI device does not exist.
    #[error("no PCI device {address} (looked for {path})")]
    NoDevice {
        /// The address.
        address: String,
        /// The sysfs path.
        path: PathBuf,
    },
    /// A sysfs file could not be read or written.
    #[error("cannot {action} {path}")]
    Sysfs {
        /// `read` or `write`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The device is bound to another driver (or none).
    #[error("PCI device {address} is not bound to vfio-pci (its driver: {driver})")]
    NotBoundToVfio {
        /// The address.
        address: String,
        /// Its driver, or `none`.
        driver: String,
    },
    /// The device has no IOMMU group (no IOMMU, or it is disabled).
    #[error("PCI device {address} has no IOMMU group (is the IOMMU enabled? intel_iommu=on)")]
    NoIommuGroup {
        /// The address.
        address: String,
    },
    /// Another device in the group is bound to a driver that makes the group unsafe.
    #[error(
        "IOMMU group {group} of {address} is not viable: {other} in the same group is bound \
         to {driver} (bind it to vfio-pci or unbind it)"
    )]
    GroupNotViable {
        /// The group.
        group: u32,
        /// The function asked for.
        address: String,
        /// The device that spoils the group.
        other: String,
        /// Its driver.
        driver: String,
    },
    /// The device has no VFIO cdev (the kernel lacks CONFIG_VFIO_DEVICE_CDEV, before Linux
    /// 6.6, or the device is not on vfio-pci).
    #[error(
        "PCI device {address} has no VFIO cdev ({path} is missing: needs vfio-pci and a kernel \
         with CONFIG_VFIO_DEVICE_CDEV, Linux 6.6 or later)"
    )]
    NoCdev {
        /// The address.
        address: String,
        /// The sysfs directory that names it.
        path: PathBuf,
    },
    /// A device node could not be opened.
    #[error("cannot open {path}")]
    OpenNode {
        /// The node.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A PF cannot have that many VFs.
    #[error("{address} supports at most {total} VFs, {asked} asked")]
    TooManyVfs {
        /// The PF.
        address: String,
        /// Its sriov_totalvfs.
        total: u32,
        /// The number asked for.
        asked: u32,
    },
    /// Binding to vfio-pci did not take.
    #[error("PCI device {address} did not bind to vfio-pci (its driver: {driver})")]
    BindFailed {
        /// The address.
        address: String,
        /// Its driver afterwards.
        driver: String,
    },
    /// vfio-ioctls could not open the container or the device.
    #[error("cannot open VFIO device {address}")]
    Open {
        /// The address.
        address: String,
        /// What vfio-ioctls said.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// VFIO_DEVICE_GET_INFO failed.
    #[error("cannot read the VFIO device info of {address}")]
    DeviceInfo {
        /// The address.
        address: String,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// The device does not advertise a reset, so vfio-ioctls' reset() would do nothing.
    #[error(
        "PCI device {address} advertises no reset (VFIO_DEVICE_FLAGS_RESET is clear): it \
         cannot be reset before it returns to the pool"
    )]
    ResetNotAdvertised {
        /// The address.
        address: String,
    },
    /// A DMA mapping failed.
    #[error("cannot {action} DMA at IOVA {iova:#x} ({size} bytes) for {address}")]
    Dma {
        /// `map` or `unmap`.
        action: &'static str,
        /// The IOVA.
        iova: u64,
        /// The size.
        size: usize,
        /// The device.
        address: String,
        /// What vfio-ioctls said.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// The memory to map for DMA could not be made.
    #[error("cannot make {len} bytes of DMA memory at IOVA {iova:#x}")]
    DmaMemory {
        /// Where it was to be mapped.
        iova: u64,
        /// Its size.
        len: usize,
        /// What vm-memory said.
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
    /// The migration support query failed.
    #[error("cannot query VFIO migration support of {address}")]
    Migration {
        /// The device.
        address: String,
        /// What vfio-ioctls said.
        #[source]
        source: vfio_ioctls::VfioError,
    },
}

/// The PCI part of sysfs, under a root that is `/sys` on a host.
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Sysfs {
        Sysfs::new("/sys")
    }
}

impl Sysfs {
    /// Sysfs mounted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs { root: root.into() }
    }

    /// The device's directory.
    pub fn device(&self, address: &str) -> PathBuf {
        self.root.join("bus/pci/devices").join(address)
    }

    fn existing(&self, address: &str) -> Result<PathBuf, VfioError> {
        let path = self.device(address);
        if path.exists() {
            Ok(path)
        } else {
            Err(VfioError::NoDevice {
                address: address.into(),
                path,
            })
        }
    }

    fn read(&self, path: &Path) -> Result<String, VfioError> {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .map_err(|source| VfioError::Sysfs {
                action: "read",
                path: path.into(),
                source,
            })
    }

    fn write(&self, path: &Path, value: &str) -> Result<(), VfioError> {
        std::fs::write(path, value).map_err(|source| VfioError::Sysfs {
            action: "write",
            path: path.into(),
            source,
        })
    }

    /// The driver the device is bound to, if any.
    pub fn driver(&self, address: &str) -> Result<Option<String>, VfioError> {
        let path = self.existing(address)?.join("driver");
        Ok(std::fs::read_link(path)
            .ok()
            .and_then(|target| target.file_name().map(|n| n.to_string_lossy().into_owned())))
    }

    /// Gives the PF `address` exactly `count` VFs (sriov_numvfs must go through 0 to change).
    pub fn set_vfs(&self, address: &str, count: u32) -> Result<(), VfioError> {
        let dir = self.existing(address)?;
        let total: u32 = self.read(&dir.join("sriov_totalvfs"))?.parse().unwrap_or(0);
        if count > total {
            return Err(VfioError::TooManyVfs {
                address: address.into(),
                total,
                asked: count,
            });
        }
        let numvfs = dir.join("sriov_numvfs");
        let current: u32 = self.read(&numvfs)?.parse().unwrap_or(0);
        if current == count {
            return Ok(());
        }
        if current != 0 {
            self.write(&numvfs, "0")?;
        }
        self.write(&numvfs, &count.to_string())
    }

    /// The PF's VFs (its `virtfn<N>` links), in VF order.
    pub fn vfs(&self, pf: &str) -> Result<Vec<String>, VfioError> {
        let dir = self.existing(pf)?;
        let entries = std::fs::read_dir(&dir).map_err(|source| VfioError::Sysfs {
            action: "read",
            path: dir.clone(),
            source,
        })?;
        let mut vfs: Vec<(u32, String)> = entries
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let index = entry
                    .file_name()
                    .to_str()?
                    .strip_prefix("virtfn")?
                    .parse()
                    .ok()?;
                let target = std::fs::read_link(entry.path()).ok()?;
                Some((index, target.file_name()?.to_str()?.to_owned()))
            })
            .collect();
        vfs.sort();
        Ok(vfs.into_iter().map(|(_, address)| address).collect())
    }

    /// Binds the device to vfio-pci through driver_override (unbinding it from its current
    /// driver first), then checks that it took.
    pub fn bind_vfio(&self, address: &str) -> Result<(), VfioError> {
        let dir = self.existing(address)?;
        if self.driver(address)?.as_deref() == Some(VFIO_DRIVER) {
            return Ok(());
        }
        self.write(&dir.join("driver_override"), VFIO_DRIVER)?;
        if self.driver(address)?.is_some() {
            self.write(&dir.join("driver/unbind"), address)?;
        }
        self.write(&self.root.join("bus/pci/drivers_probe"), address)?;
        match self.driver(address)? {
            Some(driver) if driver == VFIO_DRIVER => Ok(()),
            other => Err(VfioError::BindFailed {
                address: address.into(),
                driver: other.unwrap_or_else(|| "none".into()),
            }),
        }
    }

    /// The device's VFIO cdev under `dev` (`<dev>/vfio/devices/vfioN`, N named by its
    /// `vfio-dev/` directory).
    pub fn vfio_cdev(&self, address: &str, dev: &Path) -> Result<PathBuf, VfioError> {
        let named = self.existing(address)?.join("vfio-dev");
        let missing = || VfioError::NoCdev {
            address: address.into(),
            path: named.clone(),
        };
        let entry = std::fs::read_dir(&named)
            .map_err(|_| missing())?
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().into_string().ok())
            .find(|name| name.starts_with("vfio"))
            .ok_or_else(missing)?;
        Ok(dev.join("vfio/devices").join(entry))
    }

    /// The device's IOMMU group.
    pub fn iommu_group(&self, address: &str) -> Result<u32, VfioError> {
        let link = self.existing(address)?.join("iommu_group");
        std::fs::read_link(&link)
            .ok()
            .and_then(|target| target.file_name()?.to_str()?.parse().ok())
            .ok_or_else(|| VfioError::NoIommuGroup {
                address: address.into(),
            })
    }

    /// Checks that every device in the function's IOMMU group is unbound, on vfio-pci, or a
    /// PCIe port; returns the group.
    pub fn check_group(&self, address: &str) -> Result<u32, VfioError> {
        let group = self.iommu_group(address)?;
        let devices = self
            .root
            .join("kernel/iommu_groups")
            .join(group.to_string())
            .join("devices");
        let entries = std::fs::read_dir(&devices).map_err(|source| VfioError::Sysfs {
            action: "read",
            path: devices.clone(),
            source,
        })?;
        let mut others: Vec<String> = entries
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        others.sort();
        for other in others {
            if let Some(driver) = self.driver(&other)? {
                if !GROUP_SAFE_DRIVERS.contains(&driver.as_str()) {
                    return Err(VfioError::GroupNotViable {
                        group,
                        address: address.into(),
                        other,
                        driver,
                    });
                }
            }
        }
        Ok(group)
    }
}

/// A passthrough function opened through VFIO on this host.
pub struct VfioFunction {
    address: String,
    group: u32,
    container: Arc<VfioContainer>,
    device: VfioDevice,
    flags: u32,
}

impl VfioFunction {
    /// Opens the function: checks that the host has VFIO, that the function is bound to
    /// vfio-pci and that its IOMMU group is viable, then opens container, group and device.
    pub fn open(sysfs: &Sysfs, address: &str) -> Result<VfioFunction, VfioError> {
        VfioFunction::open_checking(sysfs, address, Path::new(VFIO_CONTAINER))
    }

    /// [`VfioFunction::open`], with the container device's path to check for.
    fn open_checking(
        sysfs: &Sysfs,
        address: &str,
        container: &Path,
    ) -> Result<VfioFunction, VfioError> {
        if !container.exists() {
            return Err(VfioError::NoVfio {
                missing: container.display().to_string(),
                hint: "load the vfio-pci module; the kernel needs an IOMMU (intel_iommu=on)",
            });
        }
        let driver = sysfs.driver(address)?;
        if driver.as_deref() != Some(VFIO_DRIVER) {
            return Err(VfioError::NotBoundToVfio {
                address: address.into(),
                driver: driver.unwrap_or_else(|| "none".into()),
            });
        }
        let group = sysfs.check_group(address)?;
        let open = |source| VfioError::Open {
            address: address.into(),
            source,
        };
        let container = Arc::new(VfioContainer::new(None).map_err(open)?);
        let device =
            VfioDevice::new(&sysfs.device(address), container.clone(), false).map_err(open)?;
        let flags = device_flags(&device).map_err(|source| VfioError::DeviceInfo {
            address: address.into(),
            source,
        })?;
        Ok(VfioFunction {
            address: address.into(),
            group,
            container,
            device,
            flags,
        })
    }

    /// The PCI address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The IOMMU group.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// Whether the device advertises VFIO_DEVICE_FLAGS_RESET.
    pub fn reset_advertised(&self) -> bool {
        self.flags & VFIO_DEVICE_FLAGS_RESET != 0
    }

    /// Resets the device, or says that it cannot (vfio-ioctls would silently skip it).
    pub fn reset(&self) -> Result<(), VfioError> {
        if !self.reset_advertised() {
            return Err(VfioError::ResetNotAdvertised {
                address: self.address.clone(),
            });
        }
        self.device.reset();
        Ok(())
    }

    /// Maps `memory` for the device's DMA, each region at its guest address as the IOVA
    /// (the layout a VMM gives guest memory).
    pub fn dma_map(&self, memory: &DmaMemory) -> Result<(), VfioError> {
        // SAFETY: every region of a GuestMemoryMmap is a mapping it owns, which stays mapped
        // as long as `memory` lives; callers unmap it (dma_unmap) before dropping it, and the
        // kernel unmaps every IOVA when the container closes.
        unsafe { self.container.vfio_map_guest_memory(memory) }
            .map_err(|source| self.dma_error("map", memory, source))
    }

    /// Unmaps what [`VfioFunction::dma_map`] mapped.
    pub fn dma_unmap(&self, memory: &DmaMemory) -> Result<(), VfioError> {
        self.container
            .vfio_unmap_guest_memory(memory)
            .map_err(|source| self.dma_error("unmap", memory, source))
    }

    fn dma_error(
        &self,
        action: &'static str,
        memory: &DmaMemory,
        source: vfio_ioctls::VfioError,
    ) -> VfioError {
        let iova = memory.iter().map(|r| r.start_addr().raw_value()).min();
        VfioError::Dma {
            action,
            iova: iova.unwrap_or(0),
            size: usize::try_from(memory.iter().map(|r| r.len()).sum::<u64>())
                .unwrap_or(usize::MAX),
            address: self.address.clone(),
            source,
        }
    }

    /// The device's VFIO migration (uAPI v2) capabilities, `None` when it cannot migrate
    /// (`rdmamig-vfio-check` reports it for a free function; a move never opens a function
    /// its VMM holds).
    pub fn migration_support(&self) -> Result<Option<u64>, VfioError> {
        self.device
            .query_migration_support()
            .map_err(|source| VfioError::Migration {
                address: self.address.clone(),
                source,
            })
    }
}

/// Reads the device's flags with VFIO_DEVICE_GET_INFO.
fn device_flags(device: &VfioDevice) -> std::io::Result<u32> {
    let mut info = vfio_device_info {
        argsz: u32::try_from(std::mem::size_of::<vfio_device_info>()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    // SAFETY: the fd is the open VFIO device; VFIO_DEVICE_GET_INFO writes at most `argsz`
    // bytes into `info`, which is a live, exclusively borrowed vfio_device_info of that size.
    let ret = unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            VFIO_DEVICE_GET_INFO,
            std::ptr::addr_of_mut!(info),
        )
    };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info.flags)
}

/// Opens what a receiving VMM needs to take `devices` over (Cloud Hypervisor's `vfio_fds`
/// and `iommufd_fd`): each device's VFIO cdev under its id in the VM, and a fresh
/// `<dev>/iommu`. `devices` are (id in the VM, PCI address).
pub fn open_handover(
    sysfs: &Sysfs,
    dev: &Path,
    devices: &[(String, String)],
) -> Result<VfioHandover, VfioError> {
    let open = |path: PathBuf| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map(|file| Arc::new(OwnedFd::from(file)))
            .map_err(|source| VfioError::OpenNode { path, source })
    };
    let mut handover = VfioHandover::default();
    for (id, address) in devices {
        let cdev = sysfs.vfio_cdev(address, dev)?;
        handover.devices.push((id.clone(), open(cdev)?));
    }
    handover.iommufd = Some(open(dev.join("iommu"))?);
    Ok(handover)
}

/// Memory a function may reach by DMA: vm-memory's guest memory, the rust-vmm type VMMs
/// give their devices, so that what this layer maps is laid out as a VMM lays it out.
pub type DmaMemory = GuestMemoryMmap;

/// Anonymous memory of `len` bytes (a multiple of the page size) at guest address `iova`,
/// for [`VfioFunction::dma_map`].
pub fn dma_memory(iova: u64, len: usize) -> Result<DmaMemory, VfioError> {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(iova), len)])
        .map_err(|source| VfioError::DmaMemory { iova, len, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake sysfs with PCI devices (address, driver) in IOMMU group 7 (`None`: no group).
    fn fake(devices: &[(&str, Option<&str>, Option<u32>)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (address, driver, group) in devices {
            let dir = root.path().join("bus/pci/devices").join(address);
            std::fs::create_dir_all(&dir).unwrap();
            if let Some(driver) = driver {
                let d = root.path().join("bus/pci/drivers").join(driver);
                std::fs::create_dir_all(&d).unwrap();
                symlink(&d, dir.join("driver")).unwrap();
            }
            if let Some(group) = group {
                let g = root.path().join(format!("kernel/iommu_groups/{group}"));
                std::fs::create_dir_all(g.join("devices")).unwrap();
                symlink(&g, dir.join("iommu_group")).unwrap();
                symlink(&dir, g.join("devices").join(address)).unwrap();
            }
        }
        root
    }

    #[test]
    fn a_handover_opens_each_devices_cdev_and_a_fresh_iommufd() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let root = fake(&[
            ("0000:3b:02.1", Some("vfio-pci"), Some(7)),
            ("0000:3b:02.2", Some("vfio-pci"), Some(8)),
        ]);
        let sys_root = root.path();
        std::fs::create_dir_all(sys_root.join("bus/pci/devices/0000:3b:02.1/vfio-dev/vfio3"))
            .unwrap();
        // Device nodes under a fake /dev: regular files stand in for them.
        let dev = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dev.path().join("vfio/devices")).unwrap();
        std::fs::write(dev.path().join("vfio/devices/vfio3"), "").unwrap();
        std::fs::write(dev.path().join("iommu"), "").unwrap();
        let sysfs_at_root = Sysfs::new(sys_root);
        let handover = open_handover(
            &sysfs_at_root,
            dev.path(),
            &[("vf0".into(), "0000:3b:02.1".into())],
        )
        .unwrap();
        let inode = |path: &Path| std::fs::metadata(path).unwrap().ino();
        let fd_inode = |fd: &OwnedFd| {
            std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .unwrap()
                .ino()
        };
        assert_eq!(handover.devices.len(), 1);
        assert_eq!(handover.devices[0].0, "vf0");
        assert_eq!(
            fd_inode(&handover.devices[0].1),
            inode(&dev.path().join("vfio/devices/vfio3"))
        );
        assert_eq!(
            fd_inode(handover.iommufd.as_ref().unwrap()),
            inode(&dev.path().join("iommu"))
        );
        // A function without a cdev (an older kernel) is named, with what is missing.
        let err = open_handover(
            &sysfs_at_root,
            dev.path(),
            &[("vf1".into(), "0000:3b:02.2".into())],
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("PCI device 0000:3b:02.2 has no VFIO cdev"),
            "{err}"
        );
        // A device this sysfs does not have.
        assert!(matches!(
            Sysfs::new(sys_root.join("elsewhere")).vfio_cdev("0000:3b:02.1", dev.path()),
            Err(VfioError::NoDevice { .. })
        ));
    }

    #[test]
    fn drivers_groups_and_viability() {
        let root = fake(&[
            ("0000:00:02.0", Some("vfio-pci"), Some(7)),
            ("0000:00:01.0", Some("pcieport"), Some(7)),
            ("0000:00:03.0", Some("e1000e"), Some(8)),
            ("0000:00:04.0", Some("vfio-pci"), Some(8)),
            ("0000:00:05.0", None, None),
        ]);
        let sysfs = Sysfs::new(root.path());
        assert_eq!(
            sysfs.driver("0000:00:02.0").unwrap().as_deref(),
            Some("vfio-pci")
        );
        assert_eq!(sysfs.driver("0000:00:05.0").unwrap(), None);
        assert_eq!(sysfs.check_group("0000:00:02.0").unwrap(), 7);
        let err = sysfs.check_group("0000:00:04.0").unwrap_err();
        assert_eq!(
            err.to_string(),
            "IOMMU group 8 of 0000:00:04.0 is not viable: 0000:00:03.0 in the same group is \
             bound to e1000e (bind it to vfio-pci or unbind it)"
        );
        assert!(matches!(
            sysfs.iommu_group("0000:00:05.0"),
            Err(VfioError::NoIommuGroup { .. })
        ));
        assert!(matches!(
            sysfs.driver("0000:09:00.0"),
            Err(VfioError::NoDevice { .. })
        ));
    }

    #[test]
    fn vfs_go_through_zero_and_are_bounded() {
        let root = fake(&[("0000:3b:00.0", Some("mlx5_core"), Some(1))]);
        let sysfs = Sysfs::new(root.path());
        let dir = sysfs.device("0000:3b:00.0");
        std::fs::write(dir.join("sriov_totalvfs"), "8\n").unwrap();
        std::fs::write(dir.join("sriov_numvfs"), "2\n").unwrap();
        sysfs.set_vfs("0000:3b:00.0", 4).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("sriov_numvfs")).unwrap(),
            "4"
        );
        let err = sysfs.set_vfs("0000:3b:00.0", 9).unwrap_err();
        assert_eq!(
            err.to_string(),
            "0000:3b:00.0 supports at most 8 VFs, 9 asked"
        );
    }

    #[test]
    fn binding_writes_the_override_and_reports_a_bind_that_did_not_take() {
        let root = fake(&[("0000:00:03.0", Some("e1000e"), Some(3))]);
        let sysfs = Sysfs::new(root.path());
        std::fs::create_dir_all(root.path().join("bus/pci")).unwrap();
        // A fake sysfs has no kernel behind it: the device stays on e1000e.
        let err = sysfs.bind_vfio("0000:00:03.0").unwrap_err();
        assert_eq!(
            err.to_string(),
            "PCI device 0000:00:03.0 did not bind to vfio-pci (its driver: e1000e)"
        );
        let dir = sysfs.device("0000:00:03.0");
        assert_eq!(
            std::fs::read_to_string(dir.join("driver_override")).unwrap(),
            "vfio-pci"
        );
        assert_eq!(
            std::fs::read_to_string(root.path().join("bus/pci/drivers_probe")).unwrap(),
            "0000:00:03.0"
        );
    }

    #[test]
    fn a_host_without_vfio_gets_an_error_naming_what_is_missing() {
        let root = fake(&[
            ("0000:00:02.0", Some("vfio-pci"), Some(7)),
            ("0000:00:03.0", Some("e1000e"), Some(8)),
        ]);
        let sysfs = Sysfs::new(root.path());
        let missing = root.path().join("dev/vfio/vfio");
        let err = VfioFunction::open_checking(&sysfs, "0000:00:02.0", &missing)
            .err()
            .expect("no container device");
        assert_eq!(
            err.to_string(),
            format!(
                "this host has no VFIO: {} is missing (load the vfio-pci module; the kernel \
                 needs an IOMMU (intel_iommu=on))",
                missing.display()
            )
        );
        // With a container device, a function on another driver is refused before any ioctl.
        let present = root.path().join("bus");
        let err = VfioFunction::open_checking(&sysfs, "0000:00:03.0", &present)
            .err()
            .expect("not on vfio-pci");
        assert_eq!(
            err.to_string(),
            "PCI device 0000:00:03.0 is not bound to vfio-pci (its driver: e1000e)"
        );
    }

    #[test]
    fn the_get_info_request_number_matches_the_kernel() {
        // vfio-ioctls' own test pins the same number.
        assert_eq!(VFIO_DEVICE_GET_INFO, 15211);
    }
}
