//! The host's pool of passthrough functions, configured in TOML, with persistent states.
//!
//! A destination needs a function to plug into the arriving VM; two moves must never get the
//! same one, and a function whose reset failed must never be handed out. Each function is
//! therefore in exactly one state: free, reserved (for a named move, until an expiry, so a
//! move that dies without a word does not hold it forever), attached (to a named VM), or
//! quarantined (with the reason; only an operator frees it). Every change is written to
//! `<state-dir>/pool.json` through a temporary file and an fsync before it is acted on, so a
//! reservation survives a restart of the migrator.
//!
//! How a function is plugged is the config's business: a real SR-IOV VF is given by PCI
//! address and plugged as `driver=vfio-pci,host=<address>`; a test-bed function is an
//! emulated NIC on a tap (`device = "driver=virtio-net-pci,netdev=nd1"`). The move adds its
//! own properties (id, bus, MAC) from its `--attach`.
//!
//! ```toml
//! [pool]
//! reservation_s = 300
//!
//! [[pool.function]]
//! name = "vf0"
//! pci = "0000:3b:00.2"
//!
//! [[pool.function]]
//! name = "tap1"
//! device = "driver=virtio-net-pci,netdev=nd1"
//!
//! # The daemon creates these VFs at start and lists them as vf0, vf1 ([`crate::sriov`]).
//! [[pool.sriov]]
//! pf = "0000:3b:00.0"
//! vfs = 2
//! prefix = "vf"
//! ```
//!
//! The rest of the config file is [`crate::config`]'s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rdmamig_vmm::{DeviceSpec, DeviceSpecError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;

use crate::vfio::{Sysfs, VfioFunction};
use rdmamig_proto::clock::unix_ms;

/// How long a reservation holds when the config does not say.
const DEFAULT_RESERVATION_S: u64 = 300;

/// The longest reservation the config may ask for (a week): a move's deadlines are minutes.
const MAX_RESERVATION_S: u64 = 7 * 24 * 3600;

/// The `[pool]` table of the daemon's config file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// How long a reservation holds before the function is free again, s.
    #[serde(default)]
    pub reservation_s: Option<u64>,
    /// The functions.
    #[serde(default, rename = "function")]
    pub functions: Vec<FunctionConfig>,
    /// PFs whose VFs the daemon creates and lists as functions ([`crate::sriov`]).
    #[serde(default)]
    pub sriov: Vec<SriovConfig>,
}

/// A PF whose VFs the pool holds.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SriovConfig {
    /// The PF's PCI address.
    pub pf: String,
    /// How many VFs it gets.
    pub vfs: u32,
    /// The VFs' names in the pool: `<prefix><index>`.
    #[serde(default = "default_vf_prefix")]
    pub prefix: String,
}

fn default_vf_prefix() -> String {
    "vf".into()
}

/// One function as configured.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionConfig {
    /// Its name in the pool.
    pub name: String,
    /// A real VF's PCI address (`0000:3b:00.2`), plugged through VFIO.
    #[serde(default)]
    pub pci: Option<String>,
    /// An emulated device's `device_add` properties (without id).
    #[serde(default)]
    pub device: Option<String>,
}

/// How a function is plugged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Attachment {
    /// A real VF through VFIO.
    Vfio {
        /// Its PCI address.
        pci: String,
    },
    /// An emulated device.
    Emulated {
        /// Its properties.
        properties: Map<String, Value>,
    },
}

impl Attachment {
    /// The host device this plugs, which two functions must never share: a VF's PCI
    /// address, or the `host=` of a device given by its properties (a vfio-pci line).
    /// `None` for an emulated device: its backend (a `netdev` id) belongs to whichever VMM
    /// it is plugged into, so two functions may name the same one.
    fn identity(&self) -> Option<String> {
        match self {
            Attachment::Vfio { pci } => Some(pci.to_ascii_lowercase()),
            Attachment::Emulated { properties } => properties
                .get("host")
                .and_then(Value::as_str)
                .map(str::to_ascii_lowercase),
        }
    }
}

/// Where a function stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum FunctionState {
    /// Anyone may reserve it.
    Free,
    /// Held for a move until the expiry.
    Reserved {
        /// The move.
        move_id: String,
        /// When the hold ends, ms since the epoch.
        expires_unix_ms: u64,
    },
    /// Plugged into a VM.
    Attached {
        /// The VM.
        vm: String,
    },
    /// Not to be handed out (its reset failed); an operator must look at it.
    Quarantined {
        /// Why.
        reason: String,
    },
}

/// One function and its state, as `rdmamig pool` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionStatus {
    /// Its name.
    pub name: String,
    /// How it is plugged.
    pub attachment: Attachment,
    /// Its state.
    pub state: FunctionState,
}

/// Why a pool operation failed.
#[derive(Debug, Error)]
pub enum PoolError {
    /// A function's entry is not usable.
    #[error("pool function {name:?}: {reason}")]
    BadFunction {
        /// The function.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// `reservation_s` is out of range.
    #[error(
        "pool reservation_s = {seconds}: a reservation must hold between 1 s and \
         {MAX_RESERVATION_S} s"
    )]
    BadReservation {
        /// The value given.
        seconds: u64,
    },
    /// A function's device description does not parse.
    #[error("pool function {name:?}: bad device description")]
    BadDevice {
        /// The function.
        name: String,
        /// What the parser said.
        #[source]
        source: DeviceSpecError,
    },
    /// The saved states cannot be read or written.
    #[error("cannot {action} the pool state {path}")]
    State {
        /// `read` or `write`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Every function is taken.
    #[error("no free function in the pool ({summary})")]
    NoFreeFunction {
        /// How many are in each state.
        summary: String,
    },
    /// The function is not in the pool.
    #[error("no function {name:?} in the pool")]
    Unknown {
        /// The name.
        name: String,
    },
    /// The function is not in the state the operation needs.
    #[error("pool function {name} is {state}, {expected}")]
    WrongState {
        /// The function.
        name: String,
        /// Its state, in words.
        state: String,
        /// What the operation needed.
        expected: &'static str,
    },
    /// A quarantined function failed the check that must pass before it is handed out
    /// again; it stays quarantined.
    #[error("pool function {name} stays quarantined: its check failed: {reason}")]
    CheckFailed {
        /// The function.
        name: String,
        /// What the check said.
        reason: String,
    },
}

fn describe(state: &FunctionState) -> String {
    match state {
        FunctionState::Free => "free".into(),
        FunctionState::Reserved { move_id, .. } => format!("reserved for move {move_id}"),
        FunctionState::Attached { vm } => format!("attached to VM {vm}"),
        FunctionState::Quarantined { reason } => format!("quarantined ({reason})"),
    }
}

/// The pool: configured functions, their states, the file that keeps them.
#[derive(Debug)]
pub struct Pool {
    functions: BTreeMap<String, Attachment>,
    states: Mutex<BTreeMap<String, FunctionState>>,
    reservation_ms: u64,
    path: PathBuf,
    /// Where the functions are on this host: its sysfs, and its /dev (their VFIO nodes).
    sysfs: Sysfs,
    dev: PathBuf,
}

impl Pool {
    /// Builds the pool from its config, taking the saved states from `state_file` (a
    /// function new to the config is free; a saved state of a function no longer configured
    /// is dropped).
    pub fn open(config: &PoolConfig, state_file: &Path) -> Result<Pool, PoolError> {
        let reservation_s = config.reservation_s.unwrap_or(DEFAULT_RESERVATION_S);
        if !(1..=MAX_RESERVATION_S).contains(&reservation_s) {
            return Err(PoolError::BadReservation {
                seconds: reservation_s,
            });
        }
        let mut functions = BTreeMap::new();
        // What each function plugs (its PCI address, or its emulated device's backend):
        // two names for one device would let two moves have it at once.
        let mut devices: BTreeMap<String, String> = BTreeMap::new();
        for f in &config.functions {
            let bad = |reason: &str| PoolError::BadFunction {
                name: f.name.clone(),
                reason: reason.into(),
            };
            if f.name.is_empty() {
                return Err(bad("the name is empty"));
            }
            let attachment = match (&f.pci, &f.device) {
                (Some(pci), None) => {
                    if !is_pci_address(pci) {
                        return Err(bad("pci must be a PCI address like 0000:3b:00.2"));
                    }
                    Attachment::Vfio { pci: pci.clone() }
                }
                (None, Some(device)) => {
                    // Parse with a placeholder id: the move gives the real one.
                    let spec =
                        DeviceSpec::parse(&format!("{device},id=pool")).map_err(|source| {
                            PoolError::BadDevice {
                                name: f.name.clone(),
                                source,
                            }
                        })?;
                    let mut properties = spec.properties().clone();
                    properties.remove("id");
                    Attachment::Emulated { properties }
                }
                _ => return Err(bad("give exactly one of pci and device")),
            };
            if functions.contains_key(&f.name) {
                return Err(bad("the name appears twice"));
            }
            if let Some(device) = attachment.identity() {
                if let Some(other) = devices.insert(device.clone(), f.name.clone()) {
                    return Err(bad(&format!(
                        "{device} is already function {other:?}: one device, one function"
                    )));
                }
            }
            functions.insert(f.name.clone(), attachment);
        }
        let saved: BTreeMap<String, FunctionState> = match std::fs::read(state_file) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| PoolError::State {
                action: "read",
                path: state_file.into(),
                source: std::io::Error::other(e),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(source) => {
                return Err(PoolError::State {
                    action: "read",
                    path: state_file.into(),
                    source,
                })
            }
        };
        let states = functions
            .keys()
            .map(|name| {
                let state = saved.get(name).cloned().unwrap_or(FunctionState::Free);
                (name.clone(), state)
            })
            .collect();
        Ok(Pool {
            functions,
            states: Mutex::new(states),
            reservation_ms: reservation_s * 1000,
            path: state_file.into(),
            sysfs: Sysfs::default(),
            dev: PathBuf::from("/dev"),
        })
    }

    /// The same pool, with this host's sysfs and /dev elsewhere (tests: fake trees).
    pub fn with_host_roots(mut self, sysfs: Sysfs, dev: impl Into<PathBuf>) -> Pool {
        self.sysfs = sysfs;
        self.dev = dev.into();
        self
    }

    /// This host's sysfs, where the functions are.
    pub fn sysfs(&self) -> &Sysfs {
        &self.sysfs
    }

    /// This host's /dev, where the functions' VFIO nodes are.
    pub fn dev(&self) -> &Path {
        &self.dev
    }

    /// Every function with its state (expired reservations shown free).
    pub fn list(&self) -> Vec<FunctionStatus> {
        let now = unix_ms();
        let states = self.lock();
        self.functions
            .iter()
            .map(|(name, attachment)| FunctionStatus {
                name: name.clone(),
                attachment: attachment.clone(),
                state: effective(&states[name], now),
            })
            .collect()
    }

    /// Reserves a free function for `move_id`; returns its name and how it is plugged.
    pub fn reserve(&self, move_id: &str) -> Result<(String, Attachment), PoolError> {
        let now = unix_ms();
        let mut states = self.lock();
        let name = states
            .iter()
            .find(|(_, state)| effective(state, now) == FunctionState::Free)
            .map(|(name, _)| name.clone())
            .ok_or_else(|| PoolError::NoFreeFunction {
                summary: summary(&states, now),
            })?;
        let mut next = states.clone();
        next.insert(
            name.clone(),
            FunctionState::Reserved {
                move_id: move_id.into(),
                expires_unix_ms: now + self.reservation_ms,
            },
        );
        self.save(&next)?;
        *states = next;
        Ok((name.clone(), self.functions[&name].clone()))
    }

    /// Whether function `name` is reserved for `move_id` now.
    pub fn reserved_for(&self, name: &str, move_id: &str) -> bool {
        let now = unix_ms();
        self.lock().get(name).is_some_and(|state| {
            matches!(state, FunctionState::Reserved { move_id: m, .. } if m == move_id)
                && effective(state, now) != FunctionState::Free
        })
    }

    /// Marks a function reserved for `move_id` as attached to `vm`.
    pub fn attach(&self, name: &str, move_id: &str, vm: &str) -> Result<(), PoolError> {
        let allowed = |state: &FunctionState| match state {
            FunctionState::Reserved { move_id: m, .. } if m == move_id => Ok(()),
            // A restarted migrator repeats the step.
            FunctionState::Attached { vm: v } if v == vm => Ok(()),
            _ => Err("not reserved for this move"),
        };
        self.change(name, allowed, FunctionState::Attached { vm: vm.into() })
    }

    /// Marks a free function as attached to `vm`, a VM started outside any move with it.
    pub fn assign(&self, name: &str, vm: &str) -> Result<(), PoolError> {
        let allowed = |state: &FunctionState| match state {
            FunctionState::Free => Ok(()),
            FunctionState::Attached { vm: v } if v == vm => Ok(()),
            _ => Err("only a free function can be assigned to a VM"),
        };
        self.change(name, allowed, FunctionState::Attached { vm: vm.into() })
    }

    /// Frees a function reserved for `move_id` (or attached to `vm`: a move that failed
    /// back after the attach).
    pub fn release(&self, name: &str, move_id: &str, vm: &str) -> Result<(), PoolError> {
        let allowed = |state: &FunctionState| match state {
            FunctionState::Reserved { move_id: m, .. } if m == move_id => Ok(()),
            FunctionState::Attached { vm: v } if v == vm => Ok(()),
            FunctionState::Free => Ok(()),
            _ => Err("not held by this move"),
        };
        self.change(name, allowed, FunctionState::Free)
    }

    /// How a function is plugged.
    pub fn attachment(&self, name: &str) -> Option<Attachment> {
        self.functions.get(name).cloned()
    }

    /// Takes a function out of use (its reset failed); only an operator frees it.
    pub fn quarantine(&self, name: &str, reason: &str) -> Result<(), PoolError> {
        let to = FunctionState::Quarantined {
            reason: reason.into(),
        };
        self.change(name, |_| Ok(()), to)
    }

    /// Puts a quarantined function back into use after an operator fixed it: `check`
    /// (normally [`reset`]) must pass first. Anything but a quarantined function is refused,
    /// and a failed check leaves it quarantined; neither changes any state. Returns what
    /// the check said.
    pub fn return_to_pool(
        &self,
        name: &str,
        check: impl FnOnce(&Attachment) -> Result<String, String>,
    ) -> Result<String, PoolError> {
        let mut states = self.lock();
        let state = states
            .get(name)
            .ok_or_else(|| PoolError::Unknown { name: name.into() })?;
        if !matches!(state, FunctionState::Quarantined { .. }) {
            return Err(PoolError::WrongState {
                name: name.into(),
                state: describe(state),
                expected: "only a quarantined function is returned to the pool",
            });
        }
        // Under the lock: no move may take the function while it is being checked.
        let checked = check(&self.functions[name]).map_err(|reason| PoolError::CheckFailed {
            name: name.into(),
            reason,
        })?;
        let mut next = states.clone();
        next.insert(name.into(), FunctionState::Free);
        self.save(&next)?;
        *states = next;
        Ok(checked)
    }

    /// The state of one function, as saved (an expired reservation still shows).
    pub fn state(&self, name: &str) -> Option<FunctionState> {
        self.lock().get(name).cloned()
    }

    fn change(
        &self,
        name: &str,
        allowed: impl FnOnce(&FunctionState) -> Result<(), &'static str>,
        to: FunctionState,
    ) -> Result<(), PoolError> {
        let mut states = self.lock();
        let state = states
            .get(name)
            .ok_or_else(|| PoolError::Unknown { name: name.into() })?;
        allowed(state).map_err(|expected| PoolError::WrongState {
            name: name.into(),
            state: describe(state),
            expected,
        })?;
        let mut next = states.clone();
        next.insert(name.into(), to);
        self.save(&next)?;
        *states = next;
        Ok(())
    }

    fn save(&self, states: &BTreeMap<String, FunctionState>) -> Result<(), PoolError> {
        let bytes = serde_json::to_vec_pretty(states).unwrap_or_default();
        crate::durable::write(&self.path, &bytes).map_err(|source| PoolError::State {
            action: "write",
            path: self.path.clone(),
            source,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, FunctionState>> {
        self.states
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A reservation past its expiry is free.
fn effective(state: &FunctionState, now: u64) -> FunctionState {
    match state {
        FunctionState::Reserved {
            expires_unix_ms, ..
        } if *expires_unix_ms <= now => FunctionState::Free,
        other => other.clone(),
    }
}

fn summary(states: &BTreeMap<String, FunctionState>, now: u64) -> String {
    if states.is_empty() {
        return "the pool has no functions; configure [[pool.function]] entries".into();
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for state in states.values() {
        let key = match effective(state, now) {
            FunctionState::Free => "free",
            FunctionState::Reserved { .. } => "reserved",
            FunctionState::Attached { .. } => "attached",
            FunctionState::Quarantined { .. } => "quarantined",
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `text` is a full PCI address (`0000:3b:00.2`).
pub(crate) fn is_pci_address(text: &str) -> bool {
    let b = text.as_bytes();
    let hex = |range: std::ops::Range<usize>| b[range].iter().all(u8::is_ascii_hexdigit);
    b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11])
}

/// Resets a function so that it stops processing anything still posted to it: a VF through
/// VFIO (open checks that it is bound to vfio-pci and its IOMMU group is viable; a device
/// without reset is an error), an emulated function has nothing to reset. Returns what was
/// done, or why it failed.
pub fn reset(attachment: &Attachment) -> Result<String, String> {
    match attachment {
        Attachment::Vfio { pci } => VfioFunction::open(&Sysfs::default(), pci)
            .and_then(|f| f.reset())
            .map(|()| format!("{pci} reset"))
            .map_err(|e| rdmamig_proto::text::error_chain(&e)),
        Attachment::Emulated { .. } => Ok("emulated: nothing to reset".into()),
    }
}

/// The device a move plugs: the function's own properties over the move's `--attach`
/// (which gives the id, bus and MAC).
pub fn device_for(attachment: &Attachment, attach: &DeviceSpec) -> DeviceSpec {
    let mut properties = attach.properties().clone();
    match attachment {
        Attachment::Vfio { pci } => {
            properties.insert("driver".into(), "vfio-pci".into());
            properties.insert("host".into(), pci.clone().into());
            properties.remove("netdev");
            properties.remove("mac");
        }
        Attachment::Emulated { properties: own } => {
            for (key, value) in own {
                properties.insert(key.clone(), value.clone());
            }
        }
    }
    DeviceSpec::from_properties(properties).unwrap_or_else(|_| attach.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const CONFIG: &str = r#"
        [pool]
        reservation_s = 60

        [[pool.function]]
        name = "vf0"
        pci = "0000:3b:00.2"

        [[pool.function]]
        name = "tap1"
        device = "driver=virtio-net-pci,netdev=nd1"
    "#;

    fn config() -> PoolConfig {
        toml::from_str::<Config>(CONFIG).unwrap().pool
    }

    #[test]
    fn states_move_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pool.json");
        let pool = Pool::open(&config(), &file).unwrap();
        assert!(pool.list().iter().all(|f| f.state == FunctionState::Free));
        let (first, attachment) = pool.reserve("m1").unwrap();
        assert_eq!(first, "tap1");
        let (second, _) = pool.reserve("m2").unwrap();
        assert_eq!(second, "vf0");
        let err = pool.reserve("m3").unwrap_err();
        assert_eq!(err.to_string(), "no free function in the pool (2 reserved)");
        assert!(matches!(attachment, Attachment::Emulated { .. }));
        pool.attach("tap1", "m1", "vm1").unwrap();
        assert!(matches!(
            pool.attach("vf0", "m1", "vm1"),
            Err(PoolError::WrongState { .. })
        ));
        drop(pool);

        let pool = Pool::open(&config(), &file).unwrap();
        assert_eq!(
            pool.state("tap1"),
            Some(FunctionState::Attached { vm: "vm1".into() })
        );
        assert!(matches!(
            pool.state("vf0"),
            Some(FunctionState::Reserved { move_id, .. }) if move_id == "m2"
        ));
        pool.release("vf0", "m2", "vm2").unwrap();
        assert_eq!(pool.state("vf0"), Some(FunctionState::Free));
        assert!(matches!(
            pool.release("tap1", "m9", "vm9"),
            Err(PoolError::WrongState { .. })
        ));
        assert!(matches!(
            pool.release("nope", "m", "v"),
            Err(PoolError::Unknown { .. })
        ));
    }

    #[test]
    fn a_function_assigned_to_a_vm_is_not_handed_out_and_its_move_gives_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool::open(&config(), &dir.path().join("pool.json")).unwrap();
        pool.assign("vf0", "vm1").unwrap();
        // Again for the same VM: a no-op; for another VM: refused, nothing changed.
        pool.assign("vf0", "vm1").unwrap();
        let err = pool.assign("vf0", "vm2").unwrap_err();
        assert_eq!(
            err.to_string(),
            "pool function vf0 is attached to VM vm1, only a free function can be assigned to a VM"
        );
        let (reserved, _) = pool.reserve("m1").unwrap();
        assert_eq!(reserved, "tap1");
        assert!(matches!(
            pool.assign("tap1", "vm3"),
            Err(PoolError::WrongState { .. })
        ));
        // The move of vm1 (its source function vf0) frees it.
        pool.release("vf0", "m2", "vm1").unwrap();
        assert_eq!(pool.state("vf0"), Some(FunctionState::Free));
    }

    #[test]
    fn an_expired_reservation_is_free_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = config();
        config.reservation_s = Some(1);
        config.functions.truncate(1);
        let pool = Pool::open(&config, &dir.path().join("pool.json")).unwrap();
        pool.reserve("m1").unwrap();
        assert!(pool.reserve("m2").is_err());
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert_eq!(pool.list()[0].state, FunctionState::Free);
        pool.reserve("m2").unwrap();
    }

    #[test]
    fn bad_configs_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pool.json");
        for (text, expected) in [
            ("[[pool.function]]\nname = \"a\"\n", "give exactly one of pci and device"),
            ("[[pool.function]]\nname = \"a\"\npci = \"3b:00.2\"\n", "pci must be a PCI address"),
            (
                "[[pool.function]]\nname = \"a\"\ndevice = \"netdev\"\n",
                "bad device description",
            ),
            (
                "[[pool.function]]\nname = \"a\"\ndevice = \"driver=e1000e\"\n[[pool.function]]\nname = \"a\"\ndevice = \"driver=e1000e\"\n",
                "appears twice",
            ),
            (
                "[[pool.function]]\nname = \"a\"\npci = \"0000:3b:00.2\"\n[[pool.function]]\nname = \"b\"\npci = \"0000:3B:00.2\"\n",
                "0000:3b:00.2 is already function \"a\"",
            ),
            (
                "[[pool.function]]\nname = \"a\"\npci = \"0000:3b:00.2\"\n[[pool.function]]\nname = \"b\"\ndevice = \"driver=vfio-pci,host=0000:3b:00.2\"\n",
                "0000:3b:00.2 is already function \"a\"",
            ),
            ("[pool]\nreservation_s = 0\n", "between 1 s and"),
            ("[pool]\nreservation_s = 18446744073709551\n", "between 1 s and"),
        ] {
            let config = toml::from_str::<Config>(text).unwrap().pool;
            let err = Pool::open(&config, &file).unwrap_err();
            assert!(err.to_string().contains(expected), "{text}: {err}");
        }
        assert!(toml::from_str::<Config>("[pool]\nsize = 3\n").is_err());
        let empty = Pool::open(&PoolConfig::default(), &file).unwrap();
        assert!(empty
            .reserve("m")
            .unwrap_err()
            .to_string()
            .contains("the pool has no functions"));
    }

    #[test]
    fn only_a_quarantined_function_that_passes_its_check_returns_to_the_pool() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pool.json");
        let pool = Pool::open(&config(), &file).unwrap();
        let never = |_: &Attachment| -> Result<String, String> { panic!("checked") };
        let err = pool.return_to_pool("tap1", never).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pool function tap1 is free, only a quarantined function is returned to the pool"
        );
        assert!(matches!(
            pool.return_to_pool("nope", never),
            Err(PoolError::Unknown { .. })
        ));
        pool.quarantine("vf0", "reset failed").unwrap();
        let err = pool
            .return_to_pool("vf0", |_| Err("no reset".into()))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "pool function vf0 stays quarantined: its check failed: no reset"
        );
        let quarantined = Some(FunctionState::Quarantined {
            reason: "reset failed".into(),
        });
        assert_eq!(pool.state("vf0"), quarantined);
        drop(pool);
        // Nothing was written by the refusals: the quarantine survives a restart as it was.
        let pool = Pool::open(&config(), &file).unwrap();
        assert_eq!(pool.state("vf0"), quarantined);
        let said = pool
            .return_to_pool("vf0", |a| match a {
                Attachment::Vfio { pci } => Ok(format!("{pci} reset")),
                other => panic!("{other:?}"),
            })
            .unwrap();
        assert_eq!(said, "0000:3b:00.2 reset");
        drop(pool);
        let pool = Pool::open(&config(), &file).unwrap();
        assert_eq!(pool.state("vf0"), Some(FunctionState::Free));
        assert_eq!(pool.reserve("m").unwrap().0, "tap1");
        assert_eq!(pool.reserve("m2").unwrap().0, "vf0");
    }

    #[test]
    fn a_function_that_is_not_a_usable_vf_fails_its_reset() {
        let missing = Attachment::Vfio {
            pci: "0000:7f:1f.7".into(),
        };
        assert!(reset(&missing).is_err());
        let emulated = Attachment::Emulated {
            properties: Map::new(),
        };
        assert_eq!(reset(&emulated).unwrap(), "emulated: nothing to reset");
    }

    #[test]
    fn the_device_combines_the_function_and_the_move() {
        let attach = DeviceSpec::parse(
            "driver=virtio-net-pci,id=nic1,netdev=nd0,bus=rp1,mac=52:54:00:77:00:11",
        )
        .unwrap();
        let vfio = device_for(
            &Attachment::Vfio {
                pci: "0000:3b:00.2".into(),
            },
            &attach,
        );
        assert_eq!(
            vfio.to_string(),
            "bus=rp1,driver=vfio-pci,host=0000:3b:00.2,id=nic1"
        );
        let mut own = Map::new();
        own.insert("netdev".into(), "nd1".into());
        let emulated = device_for(&Attachment::Emulated { properties: own }, &attach);
        assert_eq!(emulated.properties()["netdev"], "nd1");
        assert_eq!(emulated.id(), "nic1");
    }
}
