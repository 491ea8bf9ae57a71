//! The guest agent: the host's representative inside the VM.
//!
//! It serves the host migrator over a virtio-serial port ([`host`]) or AF_VSOCK
//! ([`vsock`], for Cloud Hypervisor's hybrid vsock), and drives the
//! processes that use the connection library ([`apps`]): on a quiesce every connection of
//! every process releases the RDMA device; on a resume the agent waits for the new device
//! ([`device`]) and every connection reconnects. Each answer lists per-connection results.
//! Programs that hold an RDMA device without the library are listed, and released when
//! the move's policy says so ([`release`]). Programs under `rdmamig-run` in other VMs
//! reach the programs here through a TCP port ([`peers`]).
//!
//! Everything is bounded by the deadline the host gives; nothing here waits forever.
//!
//! A `hot` quiesce pauses connections with their QPs kept, and the VM then moves with its
//! device. When the host's channel ends while they are paused (the vsock transport reset a
//! migration brings, or a migrator that went away), the agent confirms them itself
//! ([`Agent::host_left`]): they do not depend on a resume that may never come. (On the test
//! bed the destination's migrator usually connects before the guest notices its port
//! closed, and its resume does the confirming.)

pub mod apps;
pub mod device;
pub mod host;
pub mod peers;
pub mod release;
pub mod vsock;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmamig_proto::agent::{AgentCommand, AgentResult};
use rdmamig_proto::app::AgentToApp;
use tracing::info;

use apps::Apps;

/// Part of each deadline kept back so the answer reaches the host before the host's own
/// deadline passes.
const ANSWER_MARGIN: Duration = Duration::from_millis(200);

/// The longest deadline the host may give a step (a day, as the migrator's own bound):
/// larger values are clamped, so no number from the host can overflow the agent's clock.
pub const MAX_HOST_DEADLINE_MS: u64 = 24 * 3600 * 1000;
/// Longest time spent asking processes to describe their connections. A process that has
/// not answered by then is left out of the list (or described as it last was), so this is
/// generous: on a loaded single-vCPU guest with hundreds of threads (`many`'s 64
/// connections), 1 s was missed now and then, and the move's quiesce then named a
/// connection the host had never been shown. It fits in the prepare phase's 5 s default.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The deadline of the confirmation the agent runs by itself when the host's channel ends
/// while connections are paused with their QPs kept.
const SELF_CONFIRM_MS: u64 = 10_000;

/// The longest pause between two looks for an ACTIVE port at resume: what the blackout may
/// gain on top of the port's own bring-up, which takes seconds on hardware. Each look costs
/// a nested test-bed VM milliseconds, and its port takes minutes to come up.
const PORT_POLL_LONGEST: Duration = Duration::from_millis(200);

/// The agent's state: the registered processes and where to look for RDMA devices and
/// processes.
pub struct Agent {
    apps: Apps,
    sysfs_infiniband: PathBuf,
    proc_root: PathBuf,
    /// A `hot` quiesce paused connections and no resume has come since.
    hot_paused: AtomicBool,
}

impl Agent {
    /// An agent driving `apps`, looking for RDMA ports under `sysfs_infiniband`.
    pub fn new(apps: Apps, sysfs_infiniband: PathBuf) -> Self {
        Self {
            apps,
            sysfs_infiniband,
            proc_root: PathBuf::from(release::PROC),
            hot_paused: AtomicBool::new(false),
        }
    }

    /// The host's channel ended. After a `hot` quiesce that is the VM running again on the
    /// destination (or a migrator that gave up): the paused connections are confirmed on
    /// their QPs now, as a resume would.
    pub fn host_left(&self) {
        if !self.hot_paused.swap(false, Ordering::AcqRel) {
            return;
        }
        info!("the host's channel ended with connections paused on their QPs: confirming them");
        let result = self.handle(AgentCommand::Resume {
            deadline_ms: SELF_CONFIRM_MS,
        });
        info!(?result, "confirmed without the host");
    }

    /// Runs one host command to completion.
    pub fn handle(&self, command: AgentCommand) -> AgentResult {
        let started = Instant::now();
        match command {
            AgentCommand::Ping => AgentResult::Pong {
                version: env!("CARGO_PKG_VERSION").to_string(),
            },
            AgentCommand::ListConnections { deadline_ms } => AgentResult::Connections {
                // A slow guest (nested, loaded) may need more than the default: the host's
                // deadline says how much it can give.
                connections: self.apps.describe(listing_timeout(deadline_ms)),
            },
            AgentCommand::ListUnmanaged => AgentResult::Unmanaged {
                programs: release::unmanaged(&self.apps, &self.proc_root),
            },
            AgentCommand::Quiesce {
                deadline_ms,
                bridge,
                hot,
            } => {
                let deadline = deadline_from(started, deadline_ms);
                // Refresh what each process owns, so a process that then stops answering
                // is still reported connection by connection.
                let connections = self
                    .apps
                    .describe(DESCRIBE_TIMEOUT.min(Duration::from_millis(deadline_ms / 4)));
                info!(
                    connections = connections.len(),
                    deadline_ms, bridge, hot, "quiescing"
                );
                let outcomes = self.apps.drive(
                    |request| AgentToApp::Quiesce {
                        request,
                        deadline_ms: remaining_ms(deadline),
                        bridge,
                        hot,
                    },
                    deadline,
                );
                if hot && outcomes.iter().any(|o| o.ok) {
                    self.hot_paused.store(true, Ordering::Release);
                }
                outcomes_since(started, outcomes)
            }
            AgentCommand::ReleaseDevice {
                grace_ms,
                deadline_ms,
                scope,
            } => {
                let deadline = deadline_from(started, deadline_ms);
                let holders = release::release(
                    &self.apps,
                    &self.proc_root,
                    scope,
                    Duration::from_millis(grace_ms.min(MAX_HOST_DEADLINE_MS)),
                    deadline,
                );
                info!(?holders, "forced release of the RDMA device");
                AgentResult::Released { holders }
            }
            AgentCommand::Resume { deadline_ms } => {
                self.hot_paused.store(false, Ordering::Release);
                let deadline = deadline_from(started, deadline_ms);
                let Some(ports) = device::wait_for_active_port(
                    &self.sysfs_infiniband,
                    deadline.saturating_duration_since(Instant::now()),
                    PORT_POLL_LONGEST,
                ) else {
                    return AgentResult::Error {
                        message: format!(
                            "no RDMA port became ACTIVE within {deadline_ms} ms: is the new \
                             function attached and its link up?"
                        ),
                    };
                };
                info!(device = %ports[0].device, "RDMA port active; resuming");
                let outcomes = self.apps.drive(
                    |request| AgentToApp::Resume {
                        request,
                        deadline_ms: remaining_ms(deadline),
                    },
                    deadline,
                );
                outcomes_since(started, outcomes)
            }
        }
    }
}

fn deadline_from(start: Instant, deadline_ms: u64) -> Instant {
    // The host's number is not trusted to fit: past the bound it is the bound.
    let asked = Duration::from_millis(deadline_ms.min(MAX_HOST_DEADLINE_MS));
    start + asked.saturating_sub(ANSWER_MARGIN)
}

/// How long a listing waits for the processes' descriptions: half the host's deadline, and
/// at least [`DESCRIBE_TIMEOUT`] when the deadline leaves that much. A slow guest (nested,
/// loaded) needs more than the default; the host's deadline says how much it can give.
fn listing_timeout(deadline_ms: Option<u64>) -> Duration {
    let Some(ms) = deadline_ms else {
        return DESCRIBE_TIMEOUT;
    };
    let allowed = Duration::from_millis(ms.min(MAX_HOST_DEADLINE_MS)).saturating_sub(ANSWER_MARGIN);
    (allowed / 2).max(DESCRIBE_TIMEOUT.min(allowed))
}

fn remaining_ms(deadline: Instant) -> u64 {
    deadline
        .saturating_duration_since(Instant::now())
        .as_millis() as u64
}

fn outcomes_since(
    started: Instant,
    outcomes: Vec<rdmamig_proto::agent::ConnectionOutcome>,
) -> AgentResult {
    AgentResult::Outcomes {
        outcomes,
        elapsed_ms: started.elapsed().as_millis() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmamig_proto::agent::{AgentRequest, AgentResponse};
    use rdmamig_proto::{Frame, FrameBuffer};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    fn agent() -> (Agent, tempfile::TempDir) {
        let sysfs = tempfile::tempdir().unwrap();
        (Agent::new(Apps::new(), sysfs.path().to_path_buf()), sysfs)
    }

    fn read_response(stream: &mut UnixStream, fb: &mut FrameBuffer) -> AgentResponse {
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(frame) = fb.pop() {
                return frame.decode().unwrap();
            }
            let n = stream.read(&mut buf).unwrap();
            assert!(n > 0, "agent closed the channel");
            fb.push(&buf[..n]);
        }
    }

    #[test]
    fn garbage_and_oversized_frames_get_errors_and_the_agent_keeps_serving() {
        let (agent, _sysfs) = agent();
        let (mut host, mut guest) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || host::serve(&mut guest, &agent, host::OnEof::Stop));
        let mut fb = FrameBuffer::new();

        host.write_all(b"hello agent, please run rm -rf /").unwrap();
        let refused = read_response(&mut host, &mut fb);
        assert_eq!(refused.id, 0);
        assert!(matches!(refused.result, AgentResult::Error { .. }));

        let mut oversized = b"RMG\x01".to_vec();
        oversized.extend_from_slice(&u32::MAX.to_be_bytes());
        host.write_all(&oversized).unwrap();
        let refused = read_response(&mut host, &mut fb);
        match refused.result {
            AgentResult::Error { message } => assert!(message.contains("exceeds"), "{message}"),
            other => panic!("expected an error, got {other:?}"),
        }

        host.write_all(&Frame::encode(&AgentRequest {
            id: 9,
            command: AgentCommand::Ping,
        }))
        .unwrap();
        let pong = read_response(&mut host, &mut fb);
        assert_eq!(pong.id, 9);
        assert!(matches!(pong.result, AgentResult::Pong { .. }));
        drop(host);
        server.join().unwrap();
    }

    #[test]
    fn resume_without_an_active_port_fails_within_its_deadline() {
        let (agent, _sysfs) = agent();
        let start = Instant::now();
        let result = agent.handle(AgentCommand::Resume { deadline_ms: 400 });
        assert!(start.elapsed() < Duration::from_secs(2));
        match result {
            AgentResult::Error { message } => assert!(message.contains("ACTIVE")),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn quiesce_with_no_applications_succeeds_with_no_outcomes() {
        let (agent, _sysfs) = agent();
        match agent.handle(AgentCommand::Quiesce {
            deadline_ms: 1000,
            bridge: false,
            hot: false,
        }) {
            AgentResult::Outcomes { outcomes, .. } => assert!(outcomes.is_empty()),
            other => panic!("expected outcomes, got {other:?}"),
        }
    }

    #[test]
    fn a_listing_waits_half_the_hosts_deadline_and_never_past_it() {
        assert_eq!(listing_timeout(None), DESCRIBE_TIMEOUT);
        // The prepare phase's 5 s default: the old bound, which fits.
        assert_eq!(listing_timeout(Some(5000)), DESCRIBE_TIMEOUT);
        assert_eq!(listing_timeout(Some(60_200)), Duration::from_secs(30));
        assert_eq!(listing_timeout(Some(1200)), Duration::from_secs(1));
        assert_eq!(listing_timeout(Some(0)), Duration::ZERO);
        assert_eq!(
            listing_timeout(Some(u64::MAX)),
            Duration::from_millis(MAX_HOST_DEADLINE_MS).saturating_sub(ANSWER_MARGIN) / 2
        );
    }

    #[test]
    fn numbers_from_the_host_past_any_bound_are_clamped_not_a_panic() {
        let (agent, _sysfs) = agent();
        // (A release is not run here: this agent's /proc is the test machine's.)
        let result = agent.handle(AgentCommand::Quiesce {
            deadline_ms: u64::MAX,
            bridge: false,
            hot: false,
        });
        assert!(matches!(result, AgentResult::Outcomes { .. }), "{result:?}");
        let start = Instant::now();
        assert_eq!(
            deadline_from(start, u64::MAX),
            deadline_from(start, MAX_HOST_DEADLINE_MS)
        );
    }

    #[test]
    fn a_host_that_leaves_after_a_hot_pause_gets_its_connections_confirmed() {
        use rdmamig_proto::agent::ConnectionOutcome;
        use rdmamig_proto::app::{AppReply, AppToAgent};
        use std::sync::atomic::AtomicUsize;
        static RESUMES: AtomicUsize = AtomicUsize::new(0);
        fn ok(request: u64) -> Option<AppToAgent> {
            Some(AppToAgent::Reply {
                request,
                body: AppReply::Outcomes {
                    outcomes: vec![ConnectionOutcome {
                        id: 1,
                        ok: true,
                        elapsed_ms: 1,
                        error: None,
                        fell_back: None,
                    }],
                },
            })
        }
        let (apps, _dir) = apps::tests::registry_with(|req| match req {
            AgentToApp::Describe { request } => Some(AppToAgent::Reply {
                request,
                body: AppReply::Connections {
                    connections: Vec::new(),
                },
            }),
            AgentToApp::Quiesce { request, .. } => ok(request),
            AgentToApp::Resume { request, .. } => {
                RESUMES.fetch_add(1, Ordering::SeqCst);
                ok(request)
            }
            AgentToApp::Peer { .. } | AgentToApp::Refused { .. } => None,
        });
        let sysfs = tempfile::tempdir().unwrap();
        let port = sysfs.path().join("rxe0/ports/1");
        std::fs::create_dir_all(&port).unwrap();
        std::fs::write(port.join("state"), "4: ACTIVE\n").unwrap();
        let agent = Agent::new(apps, sysfs.path().to_path_buf());
        // Nothing paused: a host leaving is only a host leaving.
        agent.host_left();
        let quiesce = |hot| AgentCommand::Quiesce {
            deadline_ms: 5000,
            bridge: false,
            hot,
        };
        agent.handle(quiesce(false));
        agent.host_left();
        assert_eq!(RESUMES.load(Ordering::SeqCst), 0);
        // Paused with the QPs kept: the host's channel ending confirms them, once.
        agent.handle(quiesce(true));
        agent.host_left();
        assert_eq!(RESUMES.load(Ordering::SeqCst), 1);
        agent.host_left();
        assert_eq!(RESUMES.load(Ordering::SeqCst), 1);
        // A resume from the host clears the pause as well.
        agent.handle(quiesce(true));
        agent.handle(AgentCommand::Resume { deadline_ms: 5000 });
        agent.host_left();
        assert_eq!(RESUMES.load(Ordering::SeqCst), 2);
    }
}
