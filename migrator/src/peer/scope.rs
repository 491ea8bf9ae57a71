//! What an authenticated peer may make this host do.
//!
//! Its certificate says who a peer is; this says what it may touch. A peer acts only on VMM
//! endpoints whose every path lies under one of this host's `[peer] vmm_paths`, and only
//! within moves it opened here: the first request naming a move id (its reservation or its
//! prepare-receive) gives that move to the peer, and every later request naming it must come
//! from the same peer, for the same VM. A move's endpoint is the one its prepare-receive
//! readied; attach, resume, confirm and discard act on that one only, and while a move holds
//! an endpoint no other peer's move may ready it. Without a function from this host's pool,
//! a peer may plug only a device that names no host hardware.
//!
//! The record is in memory and bounded per peer ([`MAX_MOVES_PER_PEER`], that peer's least
//! recently used move forgotten first, so that no peer can push out another's moves): a
//! destination daemon restarted during a move refuses that move's later requests, and the
//! source rolls back.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdmamig_vmm::DeviceSpec;
use thiserror::Error;

use super::PeerCall;
use crate::destination::MoveRef;
use crate::plan::Endpoint;

/// How many moves the record keeps for one peer.
pub const MAX_MOVES_PER_PEER: usize = 256;

/// How long a move's hold on an endpoint outlives its last request: far beyond any move's
/// deadlines, so that only an abandoned move (its source gone) loses it to another peer.
pub const HOLD: Duration = Duration::from_secs(60 * 60);

/// Device properties that name host hardware (QEMU `host=`/`sysfsdev=`, Cloud Hypervisor
/// `path=`).
const HOST_PROPERTIES: [&str; 3] = ["host", "sysfsdev", "path"];

/// Why a peer's request is outside its scope.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ScopeError {
    /// A path of the endpoint is not one this host allows.
    #[error(
        "the VMM endpoint path {path} is not under any of this host's [peer] vmm_paths \
         ({allowed})"
    )]
    EndpointNotAllowed {
        /// The path.
        path: PathBuf,
        /// What the config allows, for the message.
        allowed: String,
    },
    /// The move belongs to another peer.
    #[error("move {move_id} was opened here by peer {owner}")]
    NotYourMove {
        /// The move.
        move_id: String,
        /// The peer that opened it.
        owner: String,
    },
    /// The request names the move with another VM.
    #[error("move {move_id} is of VM {vm}, not {asked}")]
    OtherVm {
        /// The move.
        move_id: String,
        /// Its VM.
        vm: String,
        /// The VM the request named.
        asked: String,
    },
    /// The move was never opened here.
    #[error("move {move_id} was not opened here (by a reservation or a prepare-receive)")]
    UnknownMove {
        /// The move.
        move_id: String,
    },
    /// The request names an endpoint that this move did not ready.
    #[error("this host did not start receiving move {move_id} at that VMM endpoint")]
    NotReceiving {
        /// The move.
        move_id: String,
    },
    /// Another peer's move holds the endpoint.
    #[error("that VMM endpoint is receiving move {move_id} for peer {peer}")]
    EndpointHeld {
        /// The move holding it.
        move_id: String,
        /// Its peer.
        peer: String,
    },
    /// A device naming host hardware, without a pool function.
    #[error(
        "without a function from this host's pool, a peer may not plug a device that names \
         host hardware ({property})"
    )]
    HostDevice {
        /// The property (or driver) that names it.
        property: String,
    },
}

/// One move a peer opened here.
struct Opened {
    peer: String,
    vm: String,
    /// The endpoint its prepare-receive readied.
    receiving: Option<Endpoint>,
    last: Instant,
}

/// The scope of every peer: the allowed endpoint paths and the moves opened here.
pub struct Scope {
    vmm_paths: Vec<PathBuf>,
    /// [`HOLD`] (shorter in tests).
    hold: Duration,
    moves: Mutex<HashMap<String, Opened>>,
}

impl Scope {
    /// Peers may name endpoints under `vmm_paths` (files or directories).
    pub fn new(vmm_paths: Vec<PathBuf>) -> Scope {
        Scope {
            vmm_paths,
            hold: HOLD,
            moves: Mutex::new(HashMap::new()),
        }
    }

    /// Admits `call` from `peer`, or says why it is outside the peer's scope. An admitted
    /// reservation or prepare-receive opens the move for the peer (and the latter holds its
    /// endpoint); nothing else changes.
    pub fn admit(&self, peer: &str, call: &PeerCall) -> Result<(), ScopeError> {
        if let Some(endpoint) = call.endpoint() {
            self.check_paths(endpoint)?;
        }
        if let PeerCall::Attach {
            function: None,
            device,
            ..
        } = call
        {
            check_no_host_hardware(device)?;
        }
        let of = call.of();
        let mut moves = self.moves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(opened) = moves.get(&of.move_id) {
            if opened.peer != peer {
                return Err(ScopeError::NotYourMove {
                    move_id: of.move_id.clone(),
                    owner: opened.peer.clone(),
                });
            }
            if opened.vm != of.vm {
                return Err(ScopeError::OtherVm {
                    move_id: of.move_id.clone(),
                    vm: opened.vm.clone(),
                    asked: of.vm.clone(),
                });
            }
        }
        match call {
            PeerCall::Reserve { .. } => {
                open(&mut moves, peer, of);
            }
            PeerCall::PrepareReceive { endpoint, .. } => {
                let now = Instant::now();
                let held = moves.iter().find(|(id, m)| {
                    **id != of.move_id
                        && m.peer != peer
                        && m.receiving.as_ref() == Some(endpoint)
                        && now.duration_since(m.last) < self.hold
                });
                if let Some((id, m)) = held {
                    return Err(ScopeError::EndpointHeld {
                        move_id: id.clone(),
                        peer: m.peer.clone(),
                    });
                }
                // The peer's own older move, or an abandoned one, gives the endpoint up.
                for m in moves.values_mut() {
                    if m.receiving.as_ref() == Some(endpoint) {
                        m.receiving = None;
                    }
                }
                open(&mut moves, peer, of).receiving = Some(endpoint.clone());
            }
            _ => {
                let opened = moves
                    .get_mut(&of.move_id)
                    .ok_or_else(|| ScopeError::UnknownMove {
                        move_id: of.move_id.clone(),
                    })?;
                if let Some(endpoint) = call.endpoint() {
                    if opened.receiving.as_ref() != Some(endpoint) {
                        return Err(ScopeError::NotReceiving {
                            move_id: of.move_id.clone(),
                        });
                    }
                }
                opened.last = Instant::now();
            }
        }
        Ok(())
    }

    /// The move's endpoint was discarded: the move holds it no more.
    pub fn discarded(&self, of: &MoveRef) {
        let mut moves = self.moves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(opened) = moves.get_mut(&of.move_id) {
            opened.receiving = None;
        }
    }

    fn check_paths(&self, endpoint: &Endpoint) -> Result<(), ScopeError> {
        for path in endpoint_paths(endpoint) {
            let plain = path.is_absolute()
                && path
                    .components()
                    .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
            if !plain || !self.vmm_paths.iter().any(|a| path.starts_with(a)) {
                return Err(ScopeError::EndpointNotAllowed {
                    path: path.into(),
                    allowed: if self.vmm_paths.is_empty() {
                        "none configured".into()
                    } else {
                        self.vmm_paths
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                });
            }
        }
        Ok(())
    }
}

/// Records `of` as opened by `peer` (refreshing it), forgetting the peer's least recently
/// used move past [`MAX_MOVES_PER_PEER`].
fn open<'a>(moves: &'a mut HashMap<String, Opened>, peer: &str, of: &MoveRef) -> &'a mut Opened {
    if !moves.contains_key(&of.move_id) {
        let (count, oldest) = moves.iter().filter(|(_, m)| m.peer == peer).fold(
            (0, None::<(&String, Instant)>),
            |(n, oldest), (id, m)| {
                let older = oldest.is_none_or(|(_, at)| m.last < at);
                (n + 1, if older { Some((id, m.last)) } else { oldest })
            },
        );
        if count >= MAX_MOVES_PER_PEER {
            if let Some(id) = oldest.map(|(id, _)| id.clone()) {
                moves.remove(&id);
            }
        }
    }
    let opened = moves.entry(of.move_id.clone()).or_insert_with(|| Opened {
        peer: peer.into(),
        vm: of.vm.clone(),
        receiving: None,
        last: Instant::now(),
    });
    opened.last = Instant::now();
    opened
}

/// Every socket or file an endpoint names.
fn endpoint_paths(endpoint: &Endpoint) -> Vec<&Path> {
    match endpoint {
        Endpoint::Qemu { qmp, agent } => std::iter::once(qmp.as_path())
            .chain(agent.as_deref())
            .collect(),
        Endpoint::CloudHypervisor {
            api_socket,
            event_monitor,
            vsock,
            log_file,
            tls_dir,
            ..
        } => std::iter::once(api_socket.as_path())
            .chain(event_monitor.as_deref())
            .chain(vsock.as_deref())
            .chain(log_file.as_deref())
            .chain(tls_dir.as_deref())
            .collect(),
    }
}

fn check_no_host_hardware(device: &DeviceSpec) -> Result<(), ScopeError> {
    if device.driver() == "vfio-pci" {
        return Err(ScopeError::HostDevice {
            property: "driver=vfio-pci".into(),
        });
    }
    let properties = device.properties();
    match HOST_PROPERTIES
        .iter()
        .find(|p| properties.contains_key(**p))
    {
        Some(p) => Err(ScopeError::HostDevice {
            property: format!("{p}="),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(id: &str) -> MoveRef {
        MoveRef {
            move_id: id.into(),
            vm: "vm1".into(),
        }
    }

    fn qemu(qmp: &str) -> Endpoint {
        Endpoint::Qemu {
            qmp: qmp.into(),
            agent: None,
        }
    }

    fn prepare(id: &str, qmp: &str) -> PeerCall {
        PeerCall::PrepareReceive {
            endpoint: qemu(qmp),
            of: of(id),
            via: "tcp:0:4444".into(),
            hand_over: None,
        }
    }

    fn discard(id: &str, qmp: &str) -> PeerCall {
        PeerCall::Discard {
            endpoint: qemu(qmp),
            of: of(id),
        }
    }

    fn scope() -> Scope {
        Scope::new(vec!["/run/vmms".into(), "/srv/one.qmp".into()])
    }

    #[test]
    fn only_plain_paths_under_the_allowed_ones_pass() {
        let scope = scope();
        for ok in ["/run/vmms/a.qmp", "/run/vmms/x/y.qmp", "/srv/one.qmp"] {
            assert_eq!(scope.admit("src", &prepare(ok, ok)), Ok(()), "{ok}");
        }
        for bad in [
            "/run/vmms/../etc/x",
            "/run/vmmsx/a.qmp",
            "run/vmms/a.qmp",
            "/srv/one.qmp.2",
            "/run/vmms/x/../../../etc/passwd",
        ] {
            assert!(
                matches!(
                    scope.admit("src", &prepare("m", bad)),
                    Err(ScopeError::EndpointNotAllowed { .. })
                ),
                "{bad}"
            );
        }
        // A second path of the endpoint counts as much as the first.
        let agent_outside = PeerCall::PrepareReceive {
            endpoint: Endpoint::Qemu {
                qmp: "/run/vmms/a.qmp".into(),
                agent: Some("/tmp/agent".into()),
            },
            of: of("m"),
            via: String::new(),
            hand_over: None,
        };
        assert!(scope.admit("src", &agent_outside).is_err());
        // So does a Cloud Hypervisor endpoint's TLS folder, which its VMM would read.
        let tls = |dir: &str| PeerCall::PrepareReceive {
            endpoint: Endpoint::CloudHypervisor {
                api_socket: "/run/vmms/a.api".into(),
                event_monitor: None,
                vsock: Some("/run/vmms/a.vsock".into()),
                agent_port: 7077,
                log_file: None,
                tls_dir: Some(dir.into()),
            },
            of: of("m"),
            via: String::new(),
            hand_over: None,
        };
        assert_eq!(scope.admit("src", &tls("/run/vmms/tls")), Ok(()));
        assert!(matches!(
            scope.admit("src", &tls("/root/.ssh")),
            Err(ScopeError::EndpointNotAllowed { .. })
        ));
        let none = Scope::new(Vec::new());
        let err = none.admit("src", &prepare("m", "/run/vmms/a")).unwrap_err();
        assert!(err.to_string().contains("none configured"), "{err}");
    }

    #[test]
    fn a_move_belongs_to_the_peer_that_opened_it_for_its_vm() {
        let scope = scope();
        let at = "/run/vmms/d.qmp";
        assert_eq!(
            scope.admit("src", &discard("m1", at)),
            Err(ScopeError::UnknownMove {
                move_id: "m1".into()
            })
        );
        scope.admit("src", &prepare("m1", at)).unwrap();
        assert_eq!(
            scope.admit("other", &discard("m1", at)),
            Err(ScopeError::NotYourMove {
                move_id: "m1".into(),
                owner: "src".into()
            })
        );
        let mut other_vm = of("m1");
        other_vm.vm = "vm9".into();
        let release = PeerCall::Release {
            function: "vf0".into(),
            of: other_vm,
        };
        assert!(matches!(
            scope.admit("src", &release),
            Err(ScopeError::OtherVm { .. })
        ));
        // Only the endpoint the move readied.
        assert_eq!(
            scope.admit("src", &discard("m1", "/run/vmms/other.qmp")),
            Err(ScopeError::NotReceiving {
                move_id: "m1".into()
            })
        );
        assert_eq!(scope.admit("src", &discard("m1", at)), Ok(()));
        scope.discarded(&of("m1"));
        assert_eq!(
            scope.admit("src", &discard("m1", at)),
            Err(ScopeError::NotReceiving {
                move_id: "m1".into()
            })
        );
    }

    #[test]
    fn an_endpoint_is_held_against_other_peers_but_not_against_its_own_next_move() {
        let scope = scope();
        let at = "/run/vmms/d.qmp";
        scope.admit("src", &prepare("m1", at)).unwrap();
        assert_eq!(
            scope.admit("other", &prepare("m2", at)),
            Err(ScopeError::EndpointHeld {
                move_id: "m1".into(),
                peer: "src".into()
            })
        );
        // The same peer's next move takes the endpoint over; the old move loses it.
        scope.admit("src", &prepare("m3", at)).unwrap();
        assert!(scope.admit("src", &discard("m1", at)).is_err());
        assert_eq!(scope.admit("src", &discard("m3", at)), Ok(()));
        // An abandoned move's hold lapses.
        let scope = Scope {
            hold: Duration::ZERO,
            ..scope
        };
        assert_eq!(scope.admit("other", &prepare("m2", at)), Ok(()));
    }

    #[test]
    fn without_a_pool_function_no_host_device_is_plugged() {
        let scope = scope();
        let at = "/run/vmms/d.qmp";
        scope.admit("src", &prepare("m1", at)).unwrap();
        let attach = |device: &str, function: Option<&str>| PeerCall::Attach {
            endpoint: qemu(at),
            of: of("m1"),
            function: function.map(str::to_string),
            device: DeviceSpec::parse(device).unwrap(),
            check_first: false,
        };
        for bad in [
            "driver=vfio-pci,id=x",
            "driver=pci-assign,id=x,host=0000:00:1f.0",
            "driver=x,id=x,sysfsdev=/sys/bus/pci/devices/0000:00:1f.0",
            "driver=x,id=x,path=/sys/bus/pci/devices/0000:00:1f.0",
        ] {
            assert!(
                matches!(
                    scope.admit("src", &attach(bad, None)),
                    Err(ScopeError::HostDevice { .. })
                ),
                "{bad}"
            );
        }
        assert_eq!(
            scope.admit("src", &attach("driver=virtio-net-pci,id=nic1", None)),
            Ok(())
        );
        // A pool function is checked by the pool (reserved for this move).
        assert_eq!(
            scope.admit("src", &attach("driver=vfio-pci,id=x", Some("vf0"))),
            Ok(())
        );
    }

    #[test]
    fn the_record_is_bounded_per_peer_and_a_flood_forgets_only_the_flooders_moves() {
        let scope = scope();
        scope
            .admit("src", &prepare("mine", "/run/vmms/d.qmp"))
            .unwrap();
        for i in 0..MAX_MOVES_PER_PEER + 10 {
            let reserve = PeerCall::Reserve {
                of: of(&format!("m{i}")),
            };
            scope.admit("flooder", &reserve).unwrap();
        }
        {
            let moves = scope.moves.lock().unwrap();
            assert_eq!(moves.len(), MAX_MOVES_PER_PEER + 1);
            assert!(moves.contains_key(&format!("m{}", MAX_MOVES_PER_PEER + 9)));
            assert!(!moves.contains_key("m0"), "the flooder's oldest move stays");
        }
        assert_eq!(
            scope.admit("src", &discard("mine", "/run/vmms/d.qmp")),
            Ok(())
        );
    }
}
