//! The destination end of a move, as the mover sees it: this host, or another migrator.
//!
//! A move's destination duties (reserve a function, ready the VMM to receive, plug the
//! function after the migration, resume the connections through the arrived guest's agent,
//! discard a migrated copy, release the reservation) are one narrow trait, so that the mover
//! has a single path whether the destination VMM is on this host ([`LocalDestination`]) or
//! behind another migrator ([`crate::peer::RemoteDestination`], over mutual TLS). The peer
//! server runs each request it accepts through a [`LocalDestination`] on its own host, so
//! both ends do the same work in the same code.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use rdmamig_proto::ConnectionId;
use rdmamig_vmm::{DeviceSpec, VfioHandover, VmPhase, Vmm, VmmError};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::agent::Outcomes;
use crate::backends::{open_agent, Backends};
use crate::plan::Endpoint;
use crate::pool::{device_for, Attachment, Pool};
use crate::step::{StepError, GRACE};
use crate::vfio::open_handover;

/// What a move names when it asks the destination for something.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveRef {
    /// The move's id.
    pub move_id: String,
    /// The VM.
    pub vm: String,
}

/// The device a destination plugged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plugged {
    /// Its id.
    pub id: String,
    /// Its driver (`vfio-pci` for a VF).
    pub driver: String,
    /// It was there already (a restarted source asked again).
    pub already: bool,
    /// Its PCI address in the guest, when the VMM says.
    #[serde(default)]
    pub bdf: Option<String>,
}

/// A reserved function handed to the receiving VMM with its receive, as device `device` of
/// the VM: under `hot` on Cloud Hypervisor the device's state migrates into it (the VMM takes
/// it as open descriptors, [`rdmamig_vmm::VfioHandover`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandOver {
    /// The device's id in the VM's config.
    pub device: String,
    /// The destination's pool function, reserved for the move.
    pub function: String,
}

/// The destination's duties in a move. Every call is bounded by `deadline`.
#[async_trait]
pub trait DestinationHost: Send + Sync {
    /// Where the destination is, for reports and messages.
    fn describe(&self) -> String;

    /// Reserves a free function from the destination's pool for the move.
    async fn reserve(
        &self,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<(String, Attachment), StepError>;

    /// Checks that the destination VMM waits for a migration and readies it to receive at
    /// `via`, handing it `hand_over`'s function when given.
    async fn prepare_receive(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        via: &str,
        hand_over: Option<&HandOver>,
        deadline: Duration,
    ) -> Result<(), StepError>;

    /// Confirms on the destination that the whole VM arrived and runs there; returns when
    /// the guest started there, where it is known ([`Vmm::confirm_received`]).
    async fn confirm_received(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<Option<SystemTime>, StepError>;

    /// Plugs `device` into the arrived VM: as it is, or, with `function`, that reserved
    /// function with `device`'s id, bus and MAC. With `check_first`, a device already there
    /// is not plugged again.
    async fn attach(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        function: Option<&str>,
        device: &DeviceSpec,
        check_first: bool,
        deadline: Duration,
    ) -> Result<Plugged, StepError>;

    /// Has the arrived guest's agent resume `connections`.
    async fn resume(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        connections: &[ConnectionId],
        deadline: Duration,
    ) -> Result<Outcomes, StepError>;

    /// Stops the destination VMM, discarding a migrated copy (a rollback after the migration
    /// completed). A VMM already gone is fine.
    async fn discard(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<(), StepError>;

    /// Gives a reserved (or attached) function back to the destination's pool.
    async fn release(
        &self,
        function: &str,
        of: &MoveRef,
        deadline: Duration,
    ) -> Result<(), StepError>;
}

/// The destination is this host: its VMMs through [`Backends`], its pool.
pub struct LocalDestination {
    backends: Arc<dyn Backends>,
    pool: Arc<Pool>,
    /// The VMM connected last, reused while the endpoint stays the same (a VMM may keep
    /// state on its control connection, and QEMU serves one QMP client at a time).
    vmm: Mutex<Option<(Endpoint, Arc<dyn Vmm>)>>,
}

impl LocalDestination {
    /// A destination on this host.
    pub fn new(backends: Arc<dyn Backends>, pool: Arc<Pool>) -> LocalDestination {
        LocalDestination {
            backends,
            pool,
            vmm: Mutex::new(None),
        }
    }

    /// Opens `hand_over`'s function for the receiving VMM: it must be a VF reserved for this
    /// move.
    fn open_hand_over(
        &self,
        hand_over: &HandOver,
        of: &MoveRef,
    ) -> Result<VfioHandover, StepError> {
        let refused = |reason: String| StepError::NoHandOver {
            function: hand_over.function.clone(),
            reason,
        };
        if !self.pool.reserved_for(&hand_over.function, &of.move_id) {
            return Err(refused(format!("not reserved for move {}", of.move_id)));
        }
        match self.pool.attachment(&hand_over.function) {
            Some(Attachment::Vfio { pci }) => Ok(open_handover(
                self.pool.sysfs(),
                self.pool.dev(),
                &[(hand_over.device.clone(), pci)],
            )?),
            Some(Attachment::Emulated { .. }) => Err(refused(
                "an emulated function has no VFIO device to hand over".into(),
            )),
            None => Err(refused("not in this host's pool".into())),
        }
    }

    async fn vmm(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError> {
        let mut slot = self.vmm.lock().await;
        if let Some((connected, vmm)) = slot.as_ref() {
            if connected == endpoint {
                return Ok(vmm.clone());
            }
        }
        let vmm = self.backends.connect(endpoint).await?;
        *slot = Some((endpoint.clone(), vmm.clone()));
        Ok(vmm)
    }
}

/// Runs `step` under `deadline` (a VMM call that ignores its own deadline still ends).
async fn bounded<T>(
    deadline: Duration,
    step: impl std::future::Future<Output = Result<T, StepError>>,
) -> Result<T, StepError> {
    tokio::time::timeout(deadline, step)
        .await
        .unwrap_or(Err(StepError::Stalled))
}

#[async_trait]
impl DestinationHost for LocalDestination {
    fn describe(&self) -> String {
        "this host".into()
    }

    async fn reserve(
        &self,
        of: &MoveRef,
        _deadline: Duration,
    ) -> Result<(String, Attachment), StepError> {
        Ok(self.pool.reserve(&of.move_id)?)
    }

    async fn prepare_receive(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        via: &str,
        hand_over: Option<&HandOver>,
        deadline: Duration,
    ) -> Result<(), StepError> {
        let handover = match hand_over {
            Some(hand_over) => self.open_hand_over(hand_over, of)?,
            None => VfioHandover::default(),
        };
        bounded(deadline, async {
            let vmm = self.vmm(endpoint).await?;
            let status = vmm.status().await?;
            if !matches!(status.phase, VmPhase::Incoming | VmPhase::NoVm) {
                return Err(StepError::VmState {
                    side: "destination",
                    state: status.state,
                    expected: "not waiting for a migration (start QEMU with -incoming defer, \
                               Cloud Hypervisor without a VM)",
                });
            }
            Ok(vmm.prepare_incoming(via, handover).await?)
        })
        .await
    }

    async fn confirm_received(
        &self,
        endpoint: &Endpoint,
        _of: &MoveRef,
        deadline: Duration,
    ) -> Result<Option<SystemTime>, StepError> {
        bounded(deadline + GRACE, async {
            let vmm = self.vmm(endpoint).await?;
            Ok(vmm.confirm_received(deadline).await?)
        })
        .await
    }

    async fn attach(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        function: Option<&str>,
        device: &DeviceSpec,
        check_first: bool,
        deadline: Duration,
    ) -> Result<Plugged, StepError> {
        let spec = match function {
            Some(name) => {
                let attachment = self.pool.attachment(name).ok_or_else(|| {
                    StepError::Pool(crate::pool::PoolError::Unknown { name: name.into() })
                })?;
                // A VF gets the VM's MAC (`mac=` of --attach) through its PF first: the
                // guest's driver then finds it there (see vf_mac).
                if let (Attachment::Vfio { pci }, Some(mac)) = (
                    &attachment,
                    device.properties().get("mac").and_then(|m| m.as_str()),
                ) {
                    crate::vf_mac::set(self.pool.sysfs(), pci, mac)?;
                }
                device_for(&attachment, device)
            }
            None => device.clone(),
        };
        let id = spec.id().to_string();
        let (already, bdf) = bounded(deadline, async {
            let vmm = self.vmm(endpoint).await?;
            if check_first && vmm.has_device(&id).await? {
                return Ok((true, None));
            }
            Ok((false, vmm.add_device(&spec).await?.bdf))
        })
        .await?;
        if let Some(name) = function {
            self.pool.attach(name, &of.move_id, &of.vm)?;
        }
        Ok(Plugged {
            id,
            driver: spec.driver().into(),
            already,
            bdf,
        })
    }

    async fn resume(
        &self,
        endpoint: &Endpoint,
        _of: &MoveRef,
        connections: &[ConnectionId],
        deadline: Duration,
    ) -> Result<Outcomes, StepError> {
        let start = Instant::now();
        let vmm = self.vmm(endpoint).await?;
        let (mut agent, _) = open_agent(
            self.backends.as_ref(),
            vmm.as_ref(),
            deadline.saturating_sub(start.elapsed()),
        )
        .await?;
        Ok(agent
            .resume(connections, deadline.saturating_sub(start.elapsed()))
            .await?)
    }

    async fn discard(
        &self,
        endpoint: &Endpoint,
        _of: &MoveRef,
        deadline: Duration,
    ) -> Result<(), StepError> {
        bounded(deadline, async {
            let vmm = match self.vmm(endpoint).await {
                Ok(vmm) => vmm,
                // Gone already (an earlier rollback attempt stopped it).
                Err(VmmError::Connect { .. }) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            *self.vmm.lock().await = None;
            match vmm.quit().await {
                Ok(()) | Err(VmmError::Gone { .. }) => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    async fn release(
        &self,
        function: &str,
        of: &MoveRef,
        _deadline: Duration,
    ) -> Result<(), StepError> {
        Ok(self.pool.release(function, &of.move_id, &of.vm)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fakes::{FakeBackends, FakeHost};

    /// A host whose pool has VF `vf0` (with a VFIO cdev under fake sysfs and /dev trees) and
    /// emulated `tap0`, both reserved for move `m`; and a VF `vf9` left free.
    struct Host {
        fake: FakeHost,
        destination: LocalDestination,
        _trees: tempfile::TempDir,
    }

    fn host() -> Host {
        let trees = tempfile::tempdir().unwrap();
        let sys = trees.path().join("sys");
        let dev = trees.path().join("dev");
        std::fs::create_dir_all(sys.join("bus/pci/devices/0000:3b:02.1/vfio-dev/vfio3")).unwrap();
        std::fs::create_dir_all(dev.join("vfio/devices")).unwrap();
        std::fs::write(dev.join("vfio/devices/vfio3"), "").unwrap();
        std::fs::write(dev.join("iommu"), "").unwrap();
        let config: crate::config::Config = toml::from_str(
            "[[pool.function]]\nname = \"vf0\"\npci = \"0000:3b:02.1\"\n\
             [[pool.function]]\nname = \"tap0\"\ndevice = \"driver=e1000e,netdev=nd0\"\n\
             [[pool.function]]\nname = \"vf9\"\npci = \"0000:3b:02.7\"\n",
        )
        .unwrap();
        let pool = Arc::new(
            Pool::open(&config.pool, &trees.path().join("pool.json"))
                .unwrap()
                .with_host_roots(crate::vfio::Sysfs::new(&sys), &dev),
        );
        // Reservations go in name order; vf9 is freed again.
        for _ in 0..3 {
            pool.reserve("m").unwrap();
        }
        pool.release("vf9", "m", "vm1").unwrap();
        let fake = FakeHost::new();
        let destination = LocalDestination::new(Arc::new(FakeBackends(fake.clone())), pool);
        Host {
            fake,
            destination,
            _trees: trees,
        }
    }

    fn of() -> MoveRef {
        MoveRef {
            move_id: "m".into(),
            vm: "vm1".into(),
        }
    }

    fn hand(function: &str) -> HandOver {
        HandOver {
            device: "vf0".into(),
            function: function.into(),
        }
    }

    async fn prepare(host: &Host, hand_over: Option<&HandOver>) -> Result<(), StepError> {
        let endpoint = crate::plan::tests::plan().destination.unwrap();
        host.destination
            .prepare_receive(
                &endpoint,
                &of(),
                "tcp:0:6000",
                hand_over,
                Duration::from_secs(5),
            )
            .await
    }

    #[tokio::test]
    async fn a_reserved_vf_is_handed_to_the_receiving_vmm_under_the_vms_device_id() {
        let host = host();
        prepare(&host, Some(&hand("vf0"))).await.unwrap();
        assert_eq!(host.fake.state().handed, ["vf0"]);
    }

    #[tokio::test]
    async fn only_a_vf_reserved_for_the_move_is_handed_over() {
        let host = host();
        for (function, reason) in [
            (
                "vf9",
                "function vf9 cannot be handed to the receiving VMM: not reserved for move m",
            ),
            (
                "tap0",
                "function tap0 cannot be handed to the receiving VMM: an emulated function has \
                 no VFIO device to hand over",
            ),
        ] {
            let e = prepare(&host, Some(&hand(function))).await.unwrap_err();
            assert_eq!(e.to_string(), reason);
        }
        assert!(
            !host
                .fake
                .state()
                .calls
                .iter()
                .any(|c| c == "dst.prepare_incoming"),
            "the VMM was asked to receive"
        );
        prepare(&host, None).await.unwrap();
        assert!(host.fake.state().handed.is_empty());
    }
}
