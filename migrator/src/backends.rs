//! How a move reaches the VMMs and the guest agent: the [`Backends`] seam (the real
//! [`VmmBackends`], or the fakes of unit tests), and [`open_agent`], which gets a session
//! with an agent that answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdmamig_proto::clock::millis;
use rdmamig_vmm::{ChConfig, ChVmm, QemuConfig, QemuVmm, Vmm, VmmError};

use crate::agent::{AgentClient, AgentError, GuestAgent};
use crate::plan::Endpoint;
use crate::step::StepError;

/// One attempt to reach a freshly connected agent; attempts repeat within the budget.
const PING_ATTEMPT: Duration = Duration::from_millis(1000);

/// How the mover reaches VMMs and guest agents.
#[async_trait]
pub trait Backends: Send + Sync {
    /// Connects to the VMM of one end of the move.
    async fn connect(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError>;

    /// Opens a session with the guest agent through `vmm`'s agent channel.
    async fn agent(&self, vmm: &dyn Vmm) -> Result<Box<dyn GuestAgent>, VmmError>;
}

/// The VMM each endpoint names (QEMU over QMP, Cloud Hypervisor over its REST API), the
/// agent through that VMM's channel (virtio-serial, hybrid vsock).
#[derive(Debug, Default)]
pub struct VmmBackends;

#[async_trait]
impl Backends for VmmBackends {
    async fn connect(&self, endpoint: &Endpoint) -> Result<Arc<dyn Vmm>, VmmError> {
        Ok(match endpoint {
            Endpoint::Qemu { qmp, agent } => {
                let mut config = QemuConfig::new(qmp);
                config.agent.clone_from(agent);
                Arc::new(QemuVmm::connect(config).await?)
            }
            Endpoint::CloudHypervisor {
                api_socket,
                event_monitor,
                vsock,
                agent_port,
                log_file,
                tls_dir,
            } => {
                let mut config = ChConfig::new(api_socket);
                config.tls_dir.clone_from(tls_dir);
                config.event_monitor.clone_from(event_monitor);
                config.log_file.clone_from(log_file);
                config.vsock.clone_from(vsock);
                config.agent_port = *agent_port;
                Arc::new(ChVmm::connect(config).await?)
            }
        })
    }

    async fn agent(&self, vmm: &dyn Vmm) -> Result<Box<dyn GuestAgent>, VmmError> {
        Ok(Box::new(AgentClient::new(vmm.open_agent_channel().await?)))
    }
}

/// How long to wait before opening the agent's channel again after the guest closed it.
const REOPEN_PAUSE: Duration = Duration::from_millis(100);

/// Opens a session with `vmm`'s agent and pings it until it answers or `budget` is spent;
/// returns the session and the agent's version. A guest may not be reading its port at the
/// very moment the host connects (the ping times out: asked again), and right after a
/// migration it may drop the host's first connection (the channel closes: opened again).
pub async fn open_agent(
    backends: &dyn Backends,
    vmm: &dyn Vmm,
    budget: Duration,
) -> Result<(Box<dyn GuestAgent>, String), StepError> {
    let end = Instant::now() + budget;
    loop {
        let mut agent = backends.agent(vmm).await?;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match agent.ping(PING_ATTEMPT.min(left)).await {
                Ok(version) => return Ok((agent, version)),
                Err(e) if e.is_timeout() && Instant::now() < end => {
                    tracing::debug!("agent ping timed out; retrying");
                }
                Err(e) if e.is_timeout() => {
                    return Err(AgentError::TimedOut {
                        request: "ping",
                        deadline_ms: millis(budget),
                    }
                    .into())
                }
                Err(AgentError::Closed { .. }) if Instant::now() + REOPEN_PAUSE < end => {
                    tracing::debug!("the guest closed the agent channel; opening it again");
                    tokio::time::sleep(REOPEN_PAUSE).await;
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}
