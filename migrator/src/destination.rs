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
use rdmamig_vmm::{DeviceSpec, VmPhase, Vmm, VmmError};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::agent::Outcomes;
use crate::backends::{open_agent, Backends};
use crate::plan::Endpoint;
use crate::pool::{device_for, Attachment, Pool};
use crate::step::{StepError, GRACE};

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
    /// `via`.
    async fn prepare_receive(
        &self,
        endpoint: &Endpoint,
        of: &MoveRef,
        via: &str,
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
        _of: &MoveRef,
        via: &str,
        deadline: Duration,
    ) -> Result<(), StepError> {
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
            Ok(vmm.prepare_incoming(via).await?)
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
                    crate::vf_mac::set(&crate::vfio::Sysfs::default(), pci, mac)?;
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
