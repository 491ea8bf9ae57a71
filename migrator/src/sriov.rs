//! The VFs the pool config asks for (`[[pool.sriov]]`), made ready at daemon start as an
//! operator would: the PF gets its VFs (`sriov_numvfs`), each VF is bound to vfio-pci through
//! driver_override and its IOMMU group is checked, and the pool then lists every VF by its PCI
//! address (`<prefix><index>`), like a `[[pool.function]]` with `pci =`.
//!
//! Every entry is checked before sysfs is touched, so a bad config changes nothing. A PF that
//! already has the asked number of VFs keeps them (a restarted daemon must not pull VFs out
//! from under running VMs); a VF already on vfio-pci stays bound.

use thiserror::Error;

use crate::pool::{is_pci_address, FunctionConfig, PoolConfig};
use crate::vfio::{Sysfs, VfioError};

/// The most VFs one PF may be asked for (PCIe allows 65535; real PFs have at most 256).
const MAX_VFS: u32 = 256;

/// Why the VFs could not be made ready.
#[derive(Debug, Error)]
pub enum SriovError {
    /// A `[[pool.sriov]]` entry is not usable; nothing was changed.
    #[error("[[pool.sriov]] pf = {pf:?}: {reason}")]
    BadEntry {
        /// The PF as configured.
        pf: String,
        /// What is wrong.
        reason: String,
    },
    /// A sysfs step failed.
    #[error("[[pool.sriov]] pf = {pf:?}: {step}")]
    Step {
        /// The PF.
        pf: String,
        /// What was being done.
        step: String,
        /// What sysfs or VFIO said (boxed: it is large, and this error is rare).
        #[source]
        source: Box<VfioError>,
    },
    /// The PF shows fewer VFs than it was given.
    #[error("[[pool.sriov]] pf = {pf:?}: {found} VFs appeared, {asked} asked")]
    Missing {
        /// The PF.
        pf: String,
        /// How many `virtfn` links it has.
        found: usize,
        /// How many were asked.
        asked: u32,
    },
}

/// One VF made ready, for the daemon's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedVf {
    /// Its name in the pool.
    pub name: String,
    /// Its PCI address.
    pub pci: String,
    /// Its IOMMU group.
    pub group: u32,
}

/// Makes the VFs of every `[[pool.sriov]]` entry ready; returns the config with them listed
/// as functions (and no `sriov` entries left), and what was done.
pub fn prepare(
    config: &PoolConfig,
    sysfs: &Sysfs,
) -> Result<(PoolConfig, Vec<PreparedVf>), SriovError> {
    check(config)?;
    let mut functions = config.functions.clone();
    let mut prepared = Vec::new();
    for entry in &config.sriov {
        let step = |step: String| {
            let pf = entry.pf.clone();
            move |source| SriovError::Step {
                pf,
                step,
                source: Box::new(source),
            }
        };
        sysfs
            .set_vfs(&entry.pf, entry.vfs)
            .map_err(step(format!("giving it {} VFs", entry.vfs)))?;
        let vfs = sysfs
            .vfs(&entry.pf)
            .map_err(step("listing its VFs".into()))?;
        if vfs.len() < entry.vfs as usize {
            return Err(SriovError::Missing {
                pf: entry.pf.clone(),
                found: vfs.len(),
                asked: entry.vfs,
            });
        }
        for (index, pci) in vfs.iter().take(entry.vfs as usize).enumerate() {
            sysfs
                .bind_vfio(pci)
                .map_err(step(format!("binding VF {pci} to vfio-pci")))?;
            let group = sysfs
                .check_group(pci)
                .map_err(step(format!("checking the IOMMU group of VF {pci}")))?;
            let name = format!("{}{index}", entry.prefix);
            functions.push(FunctionConfig {
                name: name.clone(),
                pci: Some(pci.clone()),
                device: None,
            });
            prepared.push(PreparedVf {
                name,
                pci: pci.clone(),
                group,
            });
        }
    }
    let config = PoolConfig {
        functions,
        sriov: Vec::new(),
        ..config.clone()
    };
    Ok((config, prepared))
}

/// Checks every entry, and that no VF name is taken, before anything is changed.
fn check(config: &PoolConfig) -> Result<(), SriovError> {
    let mut names: Vec<String> = config.functions.iter().map(|f| f.name.clone()).collect();
    let mut pfs: Vec<&str> = Vec::new();
    for entry in &config.sriov {
        let bad = |reason: String| SriovError::BadEntry {
            pf: entry.pf.clone(),
            reason,
        };
        if !is_pci_address(&entry.pf) {
            return Err(bad("pf must be a PCI address like 0000:3b:00.0".into()));
        }
        if !(1..=MAX_VFS).contains(&entry.vfs) {
            return Err(bad(format!("vfs must be between 1 and {MAX_VFS}")));
        }
        if entry.prefix.is_empty()
            || !entry
                .prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(bad("prefix must be letters, digits, '-' or '_'".into()));
        }
        if pfs.contains(&entry.pf.as_str()) {
            return Err(bad("the PF appears twice".into()));
        }
        pfs.push(&entry.pf);
        for index in 0..entry.vfs {
            let name = format!("{}{index}", entry.prefix);
            if names.contains(&name) {
                return Err(bad(format!("its VF name {name:?} is already a function's")));
            }
            names.push(name);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::SriovConfig;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    const PF: &str = "0000:01:00.0";

    /// A fake sysfs with a PF of `total` VFs whose `sriov_numvfs` is `numvfs`, and the VFs
    /// that many VFs would be (unbound, each in its own group). Writing sriov_numvfs does not
    /// create VFs in a fake, so the VFs exist from the start, as after an earlier run.
    fn fake(total: u32, numvfs: u32) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let devices = root.path().join("bus/pci/devices");
        let pf = devices.join(PF);
        std::fs::create_dir_all(&pf).unwrap();
        std::fs::write(pf.join("sriov_totalvfs"), format!("{total}\n")).unwrap();
        std::fs::write(pf.join("sriov_numvfs"), format!("{numvfs}\n")).unwrap();
        std::fs::create_dir_all(root.path().join("bus/pci/drivers/vfio-pci")).unwrap();
        for index in 0..numvfs {
            let address = format!("0000:01:10.{}", index * 2);
            let vf = devices.join(&address);
            std::fs::create_dir_all(&vf).unwrap();
            symlink(&vf, pf.join(format!("virtfn{index}"))).unwrap();
            // Already on vfio-pci, as a fake cannot bind: the bind is then a no-op.
            symlink(
                root.path().join("bus/pci/drivers/vfio-pci"),
                vf.join("driver"),
            )
            .unwrap();
            let group = root
                .path()
                .join(format!("kernel/iommu_groups/{}", 6 + index));
            std::fs::create_dir_all(group.join("devices")).unwrap();
            symlink(&group, vf.join("iommu_group")).unwrap();
            symlink(&vf, group.join("devices").join(&address)).unwrap();
        }
        root
    }

    fn config(vfs: u32, prefix: &str) -> PoolConfig {
        PoolConfig {
            sriov: vec![SriovConfig {
                pf: PF.into(),
                vfs,
                prefix: prefix.into(),
            }],
            ..PoolConfig::default()
        }
    }

    fn numvfs(root: &Path) -> String {
        std::fs::read_to_string(root.join("bus/pci/devices").join(PF).join("sriov_numvfs")).unwrap()
    }

    #[test]
    fn the_vfs_are_listed_by_pci_address_with_their_groups() {
        let root = fake(7, 2);
        let (config, prepared) = prepare(&config(2, "vf"), &Sysfs::new(root.path())).unwrap();
        assert!(config.sriov.is_empty());
        let listed: Vec<(String, Option<String>)> = config
            .functions
            .iter()
            .map(|f| (f.name.clone(), f.pci.clone()))
            .collect();
        assert_eq!(
            listed,
            [
                ("vf0".to_string(), Some("0000:01:10.0".to_string())),
                ("vf1".to_string(), Some("0000:01:10.2".to_string()))
            ]
        );
        assert_eq!(prepared[1].group, 7);
        // The PF already had two VFs: they are kept, not recreated.
        assert_eq!(numvfs(root.path()), "2\n");
    }

    #[test]
    fn a_bad_entry_changes_nothing() {
        let root = fake(7, 1);
        let sysfs = Sysfs::new(root.path());
        for (config, says) in [
            (config(0, "vf"), "vfs must be between 1 and 256"),
            (config(2, "v f"), "prefix must be"),
            (
                PoolConfig {
                    functions: vec![FunctionConfig {
                        name: "vf1".into(),
                        pci: Some("0000:3b:00.2".into()),
                        device: None,
                    }],
                    ..config(2, "vf")
                },
                "its VF name \"vf1\" is already a function's",
            ),
            (
                PoolConfig {
                    sriov: vec![
                        config(1, "a").sriov[0].clone(),
                        config(1, "b").sriov[0].clone(),
                    ],
                    ..PoolConfig::default()
                },
                "the PF appears twice",
            ),
        ] {
            let err = prepare(&config, &sysfs).unwrap_err();
            assert!(err.to_string().contains(says), "{err}");
            assert_eq!(numvfs(root.path()), "1\n");
        }
        let err = rdmamig_proto::text::error_chain(&prepare(&config(8, "vf"), &sysfs).unwrap_err());
        assert!(
            err.contains("giving it 8 VFs: 0000:01:00.0 supports at most 7 VFs, 8 asked"),
            "{err}"
        );
        assert_eq!(numvfs(root.path()), "1\n");
    }

    #[test]
    fn a_pf_that_shows_too_few_vfs_is_an_error() {
        // sriov_numvfs says 2, but the fake has no virtfn links for a second VF.
        let root = fake(7, 1);
        std::fs::write(
            root.path()
                .join("bus/pci/devices")
                .join(PF)
                .join("sriov_numvfs"),
            "2\n",
        )
        .unwrap();
        let err = prepare(&config(2, "vf"), &Sysfs::new(root.path())).unwrap_err();
        assert!(
            matches!(
                err,
                SriovError::Missing {
                    found: 1,
                    asked: 2,
                    ..
                }
            ),
            "{err}"
        );
    }
}
