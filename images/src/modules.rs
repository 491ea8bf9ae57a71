//! Picks the guest kernel and resolves the kernel modules the image needs.
//!
//! The guest runs the host's own Debian kernel (`/boot/vmlinuz-<v>`), so its modules come from
//! `/lib/modules/<v>`. Module dependencies are resolved here, on the host, through
//! `modules.dep`, and /init loads the result with plain `insmod` in dependency order: that needs
//! neither depmod nor a modprobe that understands the host's module database. Soft
//! dependencies that modules.dep does not list (rdma_rxe needs the crc32 crypto algorithm from
//! crc32_generic) must be named explicitly by the caller.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Errors of kernel and module resolution.
#[derive(Debug, thiserror::Error)]
pub enum ModulesError {
    /// No /boot/vmlinuz-<v> has a matching /lib/modules/<v>.
    #[error("no kernel in {boot} has modules in {modules}: install linux-image-amd64")]
    NoKernel {
        /// The directory searched for vmlinuz-* files.
        boot: PathBuf,
        /// The directory searched for module trees.
        modules: PathBuf,
    },
    /// A kernel version was requested but its kernel image or modules are missing.
    #[error("kernel {version}: {missing} does not exist")]
    KernelMissing {
        /// The requested version.
        version: String,
        /// The missing file or directory.
        missing: PathBuf,
    },
    /// Reading a directory or modules.dep failed.
    #[error("reading {path}")]
    Read {
        /// What was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A module is neither in modules.dep nor built in.
    #[error("kernel module {module} is not in {dep_file}")]
    UnknownModule {
        /// The module name asked for.
        module: String,
        /// The modules.dep searched.
        dep_file: PathBuf,
    },
    /// A module file is compressed; busybox insmod cannot load it.
    #[error("kernel module {path} is compressed; busybox insmod loads only plain .ko files")]
    CompressedModule {
        /// The module file.
        path: PathBuf,
    },
}

/// The guest kernel: its version, its image and its module tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// The version string, e.g. `6.1.0-57-amd64`.
    pub version: String,
    /// `/boot/vmlinuz-<version>`.
    pub image: PathBuf,
    /// `/lib/modules/<version>`.
    pub modules_dir: PathBuf,
}

impl Kernel {
    /// Finds the kernel to boot: `version` if given, else the newest `<boot>/vmlinuz-<v>` that
    /// has a `<modules_root>/<v>/modules.dep`.
    pub fn find(
        boot: &Path,
        modules_root: &Path,
        version: Option<&str>,
    ) -> Result<Kernel, ModulesError> {
        let kernel = |v: &str| Kernel {
            version: v.to_owned(),
            image: boot.join(format!("vmlinuz-{v}")),
            modules_dir: modules_root.join(v),
        };
        if let Some(v) = version {
            let k = kernel(v);
            for missing in [&k.image, &k.modules_dir.join("modules.dep")] {
                if !missing.exists() {
                    return Err(ModulesError::KernelMissing {
                        version: v.to_owned(),
                        missing: missing.clone(),
                    });
                }
            }
            return Ok(k);
        }
        let entries = fs::read_dir(boot).map_err(|source| ModulesError::Read {
            path: boot.to_owned(),
            source,
        })?;
        let mut versions: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix("vmlinuz-"))
                    .map(str::to_owned)
            })
            .filter(|v| modules_root.join(v).join("modules.dep").is_file())
            .collect();
        versions.sort_by(|a, b| version_cmp(a, b));
        versions
            .last()
            .map(|v| kernel(v))
            .ok_or_else(|| ModulesError::NoKernel {
                boot: boot.to_owned(),
                modules: modules_root.to_owned(),
            })
    }
}

/// Compares kernel versions naturally: digit runs as numbers, everything else as text, so
/// `6.10.0` sorts after `6.9.0`.
fn version_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn chunks(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        for i in 1..=bytes.len() {
            if i == bytes.len() || bytes[i].is_ascii_digit() != bytes[start].is_ascii_digit() {
                out.push((bytes[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let (ca, cb) = (chunks(a), chunks(b));
    for (x, y) in ca.iter().zip(cb.iter()) {
        let ord = match (x, y) {
            ((true, x), (true, y)) => x
                .trim_start_matches('0')
                .len()
                .cmp(&y.trim_start_matches('0').len())
                .then_with(|| x.trim_start_matches('0').cmp(y.trim_start_matches('0'))),
            ((_, x), (_, y)) => x.cmp(y),
        };
        if ord.is_ne() {
            return ord;
        }
    }
    ca.len().cmp(&cb.len())
}

/// The module name of a module file path: base name without `.ko[.xz|.zst|.gz]`, with `-`
/// written as `_` (the kernel treats both the same).
fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

/// The dependency graph from a `modules.dep` file: module name -> (relative path, direct
/// dependencies by path).
#[derive(Debug)]
pub struct ModuleDeps {
    dep_file: PathBuf,
    modules: BTreeMap<String, (String, Vec<String>)>,
    builtin: HashSet<String>,
}

impl ModuleDeps {
    /// Loads `<dir>/modules.dep` and `<dir>/modules.builtin`.
    pub fn load(dir: &Path) -> Result<ModuleDeps, ModulesError> {
        let read = |name: &str| {
            let path = dir.join(name);
            fs::read_to_string(&path).map_err(|source| ModulesError::Read { path, source })
        };
        let dep = read("modules.dep")?;
        // modules.builtin is optional: a kernel may build nothing in that we ask for.
        let builtin = read("modules.builtin").unwrap_or_default();
        Ok(ModuleDeps::parse(dir.join("modules.dep"), &dep, &builtin))
    }

    /// Parses the text of modules.dep (`path: dep dep ...` per line) and modules.builtin.
    pub fn parse(dep_file: PathBuf, dep: &str, builtin: &str) -> ModuleDeps {
        let modules = dep
            .lines()
            .filter_map(|line| line.split_once(':'))
            .map(|(path, deps)| {
                let deps = deps.split_whitespace().map(str::to_owned).collect();
                (module_name(path), (path.trim().to_owned(), deps))
            })
            .collect();
        let builtin = builtin.lines().map(module_name).collect();
        ModuleDeps {
            dep_file,
            modules,
            builtin,
        }
    }

    /// Resolves `names` and everything they depend on into module paths (relative to the
    /// module directory), each dependency before its users: the `insmod` order. Built-in
    /// modules are skipped.
    pub fn resolve(&self, names: &[&str]) -> Result<Vec<String>, ModulesError> {
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        for name in names {
            let name = name.replace('-', "_");
            if self.builtin.contains(&name) && !self.modules.contains_key(&name) {
                continue;
            }
            self.visit(&name, &mut seen, &mut order)?;
        }
        Ok(order)
    }

    fn visit(
        &self,
        name: &str,
        seen: &mut HashSet<String>,
        order: &mut Vec<String>,
    ) -> Result<(), ModulesError> {
        if !seen.insert(name.to_owned()) {
            return Ok(());
        }
        let (path, deps) = self
            .modules
            .get(name)
            .ok_or_else(|| ModulesError::UnknownModule {
                module: name.to_owned(),
                dep_file: self.dep_file.clone(),
            })?;
        if !path.ends_with(".ko") {
            return Err(ModulesError::CompressedModule {
                path: PathBuf::from(path),
            });
        }
        for dep in deps {
            self.visit(&module_name(dep), seen, order)?;
        }
        order.push(path.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/a.ko: kernel/b.ko kernel/c-d.ko
kernel/b.ko: kernel/c-d.ko
kernel/c-d.ko:
kernel/z.ko.xz:
";

    fn deps() -> ModuleDeps {
        ModuleDeps::parse(PathBuf::from("modules.dep"), DEP, "kernel/builtin.ko\n")
    }

    #[test]
    fn dependencies_come_first_and_once() {
        let order = deps().resolve(&["a", "b"]).unwrap();
        assert_eq!(order, ["kernel/c-d.ko", "kernel/b.ko", "kernel/a.ko"]);
    }

    #[test]
    fn dashes_and_underscores_are_the_same_module() {
        assert_eq!(deps().resolve(&["c_d"]).unwrap(), ["kernel/c-d.ko"]);
    }

    #[test]
    fn builtin_modules_are_skipped_unknown_ones_fail() {
        assert!(deps().resolve(&["builtin"]).unwrap().is_empty());
        assert!(matches!(
            deps().resolve(&["nope"]),
            Err(ModulesError::UnknownModule { module, .. }) if module == "nope"
        ));
    }

    #[test]
    fn compressed_modules_are_refused() {
        assert!(matches!(
            deps().resolve(&["z"]),
            Err(ModulesError::CompressedModule { .. })
        ));
    }

    #[test]
    fn versions_sort_naturally() {
        let mut v = vec![
            "6.10.0-1-amd64",
            "6.9.0-3-amd64",
            "6.1.0-57-amd64",
            "6.1.0-9-amd64",
        ];
        v.sort_by(|a, b| version_cmp(a, b));
        assert_eq!(
            v,
            [
                "6.1.0-9-amd64",
                "6.1.0-57-amd64",
                "6.9.0-3-amd64",
                "6.10.0-1-amd64"
            ]
        );
    }

    /// Against the host's real module tree: the test-bed module set resolves, with the RDMA core
    /// before rdma_rxe, virtio before virtio_net, and e1000e before virtio_net (an e1000e RDMA
    /// NIC is then `eth0`).
    #[test]
    fn real_test_bed_modules_resolve_in_load_order() {
        let kernel = Kernel::find(Path::new("/boot"), Path::new("/lib/modules"), None)
            .expect("a Debian kernel is installed (linux-image-amd64)");
        let deps = ModuleDeps::load(&kernel.modules_dir).unwrap();
        let order = deps.resolve(crate::DEFAULT_MODULES).unwrap();
        let pos = |name: &str| {
            order
                .iter()
                .position(|p| module_name(p) == name)
                .unwrap_or_else(|| panic!("{name} not in {order:?}"))
        };
        assert!(pos("ib_core") < pos("rdma_rxe"));
        assert!(pos("ib_uverbs") < pos("rdma_ucm"));
        assert!(pos("virtio") < pos("virtio_net"));
        assert!(pos("e1000e") < pos("virtio_net"));
        assert!(pos("crc32_generic") < order.len());
        let unique: HashSet<_> = order.iter().collect();
        assert_eq!(unique.len(), order.len());
    }
}
