//! Cloud Hypervisor's REST API over its `--api-socket` UNIX socket.
//!
//! Every endpoint rdmamig uses is one [`Endpoint`] value that knows its method, its path
//! under `/api/v1`, the statuses Cloud Hypervisor's OpenAPI description lists for it, and the
//! ones a real Cloud Hypervisor answers beyond them (../shared/cloud-hypervisor/NOTES.md:
//! `vmm.shutdown` answers 200, refusals come as 500); every body it sends is one [`Request`]
//! value. Keeping them as data is what lets the contract tests (tests/ch_contract.rs) check
//! the backend against the spec and the notes: each recorded body against the schema of its
//! path and method, each status against [`Endpoint::statuses`].
//!
//! The spec is not the whole truth: a status list taken from it alone made a real server's
//! 200 from `vmm.shutdown` a protocol error, and its 500 refusals "unexpected answers".
//!
//! HTTP is hyper's (HTTP/1.1, one connection per request, as `ch-remote` does); file
//! descriptors a request hands over go beside its first bytes ([`crate::fd_passing`]). Answers are
//! bounded in size and time. Errors: Cloud Hypervisor answers a failure with a JSON array of
//! strings, the error chain outermost first; [`ApiError::Status`] carries it joined, and
//! [`ApiError::into_vmm`] turns it into the [`VmmError`] kind that status means.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;
use tokio::net::UnixStream;

use crate::fd_passing::FdPassingStream;
use crate::{TimeoutStrategy, VmmError};

/// Largest answer body read (a `vm.info` with many devices is a few tens of KiB).
pub const MAX_BODY: usize = 4 << 20;

/// The API's path prefix.
pub const PREFIX: &str = "/api/v1";

/// One endpoint of the API that rdmamig calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `GET /vmm.ping`: the VMM's version.
    VmmPing,
    /// `PUT /vmm.shutdown`: ends the VMM process.
    VmmShutdown,
    /// `GET /vm.info`: the VM's configuration and state.
    VmInfo,
    /// `PUT /vm.pause`.
    VmPause,
    /// `PUT /vm.resume`.
    VmResume,
    /// `PUT /vm.add-device`: a VFIO device by sysfs path.
    VmAddDevice,
    /// `PUT /vm.remove-device`.
    VmRemoveDevice,
    /// `PUT /vm.add-vsock`.
    VmAddVsock,
    /// `PUT /vm.send-migration`.
    VmSendMigration,
    /// `PUT /vm.receive-migration`.
    VmReceiveMigration,
    /// `PUT /vm.delete`: drops a VM that was created and never ran (what a failed receive
    /// leaves), so that the VMM can receive again.
    VmDelete,
}

impl Endpoint {
    /// Every endpoint the backend uses.
    pub const ALL: [Endpoint; 11] = [
        Endpoint::VmmPing,
        Endpoint::VmmShutdown,
        Endpoint::VmInfo,
        Endpoint::VmPause,
        Endpoint::VmResume,
        Endpoint::VmAddDevice,
        Endpoint::VmRemoveDevice,
        Endpoint::VmAddVsock,
        Endpoint::VmSendMigration,
        Endpoint::VmReceiveMigration,
        Endpoint::VmDelete,
    ];

    /// The path under [`PREFIX`].
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::VmmPing => "/vmm.ping",
            Endpoint::VmmShutdown => "/vmm.shutdown",
            Endpoint::VmInfo => "/vm.info",
            Endpoint::VmPause => "/vm.pause",
            Endpoint::VmResume => "/vm.resume",
            Endpoint::VmAddDevice => "/vm.add-device",
            Endpoint::VmRemoveDevice => "/vm.remove-device",
            Endpoint::VmAddVsock => "/vm.add-vsock",
            Endpoint::VmSendMigration => "/vm.send-migration",
            Endpoint::VmReceiveMigration => "/vm.receive-migration",
            Endpoint::VmDelete => "/vm.delete",
        }
    }

    /// The HTTP method.
    pub fn method(self) -> hyper::Method {
        match self {
            Endpoint::VmmPing | Endpoint::VmInfo => hyper::Method::GET,
            _ => hyper::Method::PUT,
        }
    }

    /// What the operation is called in errors.
    pub fn operation(self) -> &'static str {
        match self {
            Endpoint::VmmPing => "ping the VMM",
            Endpoint::VmmShutdown => "shut the VMM down",
            Endpoint::VmInfo => "query the VM",
            Endpoint::VmPause => "pause the VM",
            Endpoint::VmResume => "resume the VM",
            Endpoint::VmAddDevice => "add device",
            Endpoint::VmRemoveDevice => "remove device",
            Endpoint::VmAddVsock => "add vsock device",
            Endpoint::VmSendMigration => "send migration",
            Endpoint::VmReceiveMigration => "receive migration",
            Endpoint::VmDelete => "delete the VM",
        }
    }

    /// Every status the API description lists for this endpoint.
    pub fn spec_statuses(self) -> &'static [u16] {
        match self {
            Endpoint::VmmPing => &[200],
            Endpoint::VmmShutdown | Endpoint::VmDelete => &[204],
            Endpoint::VmInfo => &[200, 404],
            Endpoint::VmPause | Endpoint::VmResume => &[204, 404, 405],
            Endpoint::VmAddDevice => &[200, 204, 400, 404, 409],
            Endpoint::VmRemoveDevice => &[204, 404],
            Endpoint::VmAddVsock => &[200, 204, 400, 404, 409, 500],
            Endpoint::VmSendMigration | Endpoint::VmReceiveMigration => &[204, 500],
        }
    }

    /// The statuses a real Cloud Hypervisor answers that the spec does not list (NOTES.md):
    /// `vmm.shutdown`'s 200, and 500 with the error chain for any refusal (its API layer
    /// answers every error of the VMM that way: a pause of a paused VM, a resume of a
    /// running one, a call with no VM).
    pub fn observed_statuses(self) -> &'static [u16] {
        match self {
            Endpoint::VmmShutdown => &[200, 500],
            Endpoint::VmAddVsock | Endpoint::VmSendMigration | Endpoint::VmReceiveMigration => &[],
            _ => &[500],
        }
    }

    /// Every status [`classify`] gives a meaning for: the spec's and the observed ones; any
    /// other status is a protocol error.
    pub fn statuses(self) -> Vec<u16> {
        let mut all: Vec<u16> = self
            .spec_statuses()
            .iter()
            .chain(self.observed_statuses())
            .copied()
            .collect();
        all.sort_unstable();
        all
    }
}

/// A request body, one variant per endpoint that takes one. Field names and values are the
/// API's own (schemas `DeviceConfig`, `VmRemoveDevice`, `VsockConfig`, `SendMigrationData`,
/// `ReceiveMigrationData`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Request {
    /// `vm.add-device`.
    AddDevice {
        /// `/sys/bus/pci/devices/<BDF>`.
        path: String,
        /// The device id.
        id: String,
    },
    /// `vm.remove-device`.
    RemoveDevice {
        /// The device id.
        id: String,
    },
    /// `vm.add-vsock`.
    AddVsock {
        /// The guest's CID (3 or more).
        cid: u32,
        /// The host UNIX socket that proxies the guest's ports.
        socket: String,
        /// The device id.
        #[serde(skip_serializing_if = "Option::is_none")]
        id: Option<String>,
    },
    /// `vm.send-migration`.
    SendMigration {
        /// `unix:PATH` or `tcp:HOST:PORT`.
        destination_url: String,
        /// Local migration (memory shared through file descriptors, UNIX sockets only).
        local: bool,
        /// The longest stop-and-copy, in ms.
        #[serde(skip_serializing_if = "Option::is_none")]
        downtime_ms: Option<u64>,
        /// The longest migration, in s.
        #[serde(skip_serializing_if = "Option::is_none")]
        timeout_s: Option<u64>,
        /// What to do at the timeout (`Cancel`: keep the VM on the source).
        timeout_strategy: TimeoutStrategy,
        /// Parallel connections for the stream (after v53; tcp only).
        #[serde(skip_serializing_if = "Option::is_none")]
        connections: Option<u8>,
        /// Mutual TLS material: CA and client certificate (after v53; tcp only).
        #[serde(skip_serializing_if = "Option::is_none")]
        tls_dir: Option<String>,
    },
    /// `vm.receive-migration`.
    ReceiveMigration {
        /// `unix:PATH` or `tcp:HOST:PORT`.
        receiver_url: String,
        /// Mutual TLS material (tcp only).
        #[serde(skip_serializing_if = "Option::is_none")]
        tls_dir: Option<String>,
        /// VFIO devices handed to the receiver (main branch after v53; not in the spec at
        /// ae44c29): each device's id in the VM's config and the number of its cdev
        /// descriptor, which goes with the request ([`ApiClient::call_handing`]).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        vfio_fds: Vec<VfioFd>,
        /// The number of a fresh `/dev/iommu` descriptor that goes with the request.
        #[serde(skip_serializing_if = "Option::is_none")]
        iommufd_fd: Option<i32>,
    },
}

/// One VFIO device handed to a receiving VMM: its id in the VM's config, and the number of
/// its cdev descriptor in the sender (ch-remote's `vfio_fds=[id@fd]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VfioFd {
    /// The device's id in the VM's config.
    pub id: String,
    /// The descriptor's number.
    pub fd: i32,
}

impl Request {
    /// The endpoint this body is for.
    pub fn endpoint(&self) -> Endpoint {
        match self {
            Request::AddDevice { .. } => Endpoint::VmAddDevice,
            Request::RemoveDevice { .. } => Endpoint::VmRemoveDevice,
            Request::AddVsock { .. } => Endpoint::VmAddVsock,
            Request::SendMigration { .. } => Endpoint::VmSendMigration,
            Request::ReceiveMigration { .. } => Endpoint::VmReceiveMigration,
        }
    }
}

/// What a status means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Done (200 with a body, 204 without).
    Success,
    /// The object (the VM, a device) does not exist (404).
    NotFound,
    /// A device with that id or path exists (409).
    Conflict,
    /// The VMM refused: bad configuration (400), wrong VM state (405), or it failed (500).
    Refused,
}

/// The meaning of `status` for `endpoint`, whose error chain is `message`, or `None` when
/// neither the API description nor NOTES.md lists it (a protocol error).
///
/// A 500 is what a real Cloud Hypervisor answers for any refusal; one whose chain says there
/// is no VM (`VM is not created`, `VM is not running`) means the VM is not found, as a 404
/// would. A refused state transition (`InvalidStateTransition(Paused, Paused)`) and any
/// other 500 are refusals.
pub fn classify(endpoint: Endpoint, status: u16, message: &str) -> Option<Outcome> {
    if !endpoint.statuses().contains(&status) {
        return None;
    }
    Some(match status {
        200 | 204 => Outcome::Success,
        404 => Outcome::NotFound,
        409 => Outcome::Conflict,
        500 if names_missing_vm(message) => Outcome::NotFound,
        _ => Outcome::Refused,
    })
}

/// Whether an error chain says the VMM holds no VM to act on.
fn names_missing_vm(message: &str) -> bool {
    [
        "VM is not created",
        "VM is not running",
        "VmNotCreated",
        "VmNotRunning",
    ]
    .iter()
    .any(|words| message.contains(words))
}

/// Why an API call failed.
#[derive(Debug, Error)]
pub enum ApiError {
    /// The API socket cannot be reached.
    #[error("cannot connect to the Cloud Hypervisor API socket {socket}")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange broke (the VMM closed the connection mid-answer, ...).
    #[error("{operation}: HTTP exchange on {socket} failed")]
    Http {
        /// The operation.
        operation: &'static str,
        /// The socket.
        socket: PathBuf,
        /// hyper's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No answer in time.
    #[error("{operation}: no answer within {timeout_ms} ms")]
    NoAnswer {
        /// The operation.
        operation: &'static str,
        /// The wait.
        timeout_ms: u64,
    },
    /// A status the API description lists as a failure.
    #[error("{}: HTTP {status}: {message}", endpoint.operation())]
    Status {
        /// The endpoint.
        endpoint: Endpoint,
        /// The status.
        status: u16,
        /// What it means.
        outcome: Outcome,
        /// The error chain from the body, joined with ": ".
        message: String,
    },
    /// A status the API description does not list for this endpoint, or a body that does
    /// not parse.
    #[error("{operation}: unexpected answer: {reason}")]
    Unexpected {
        /// The operation.
        operation: &'static str,
        /// What was wrong.
        reason: String,
    },
}

impl ApiError {
    /// The [`VmmError`] kind this failure is, naming `object` (a device id, a URL).
    pub fn into_vmm(self, object: &str) -> VmmError {
        match self {
            ApiError::Connect { socket, source } => VmmError::Connect {
                path: socket.display().to_string(),
                source,
            },
            ApiError::NoAnswer {
                operation,
                timeout_ms,
            } => VmmError::TimedOut {
                operation,
                deadline_ms: timeout_ms,
            },
            ApiError::Status {
                endpoint,
                status,
                outcome,
                message,
            } => {
                let operation = endpoint.operation();
                match outcome {
                    Outcome::NotFound => VmmError::NotFound {
                        operation,
                        object: object.into(),
                        message,
                    },
                    Outcome::Conflict => VmmError::Conflict {
                        operation,
                        object: object.into(),
                        message,
                    },
                    Outcome::Refused | Outcome::Success => VmmError::Refused {
                        operation,
                        class: format!("HTTP {status}"),
                        message,
                    },
                }
            }
            ApiError::Unexpected { operation, reason } => VmmError::Protocol { operation, reason },
            ApiError::Http {
                operation, source, ..
            } => {
                if is_closed(&*source) {
                    VmmError::Gone { operation }
                } else {
                    VmmError::Transport { operation, source }
                }
            }
        }
    }
}

fn is_closed(error: &(dyn std::error::Error + 'static)) -> bool {
    error
        .downcast_ref::<hyper::Error>()
        .is_some_and(|e| e.is_incomplete_message() || e.is_closed())
}

/// The message of an error body: the JSON array of strings joined with ": ", else the text.
pub fn error_message(body: &[u8]) -> String {
    if let Ok(chain) = serde_json::from_slice::<Vec<String>>(body) {
        if !chain.is_empty() {
            return chain.join(": ");
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        "no message".into()
    } else {
        text.chars().take(1000).collect()
    }
}

/// `PciDeviceInfo`: what `vm.add-device` and `vm.add-vsock` answer with 200.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PciDeviceInfo {
    /// The device id.
    pub id: String,
    /// Its PCI address in the guest.
    pub bdf: String,
}

/// A client for one API socket.
#[derive(Debug, Clone)]
pub struct ApiClient {
    socket: PathBuf,
    timeout: Duration,
}

impl ApiClient {
    /// A client for `socket` whose calls wait at most `timeout` for an answer.
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> ApiClient {
        ApiClient {
            socket: socket.into(),
            timeout,
        }
    }

    /// The API socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Calls `endpoint` with `body` and the client's timeout; returns the body of a success.
    pub async fn call(
        &self,
        endpoint: Endpoint,
        body: Option<&Request>,
    ) -> Result<Bytes, ApiError> {
        self.call_within(endpoint, body, self.timeout).await
    }

    /// Calls `endpoint` with `body`, waiting at most `timeout` (`vm.receive-migration`
    /// answers only when the migration has ended).
    pub async fn call_within(
        &self,
        endpoint: Endpoint,
        body: Option<&Request>,
        timeout: Duration,
    ) -> Result<Bytes, ApiError> {
        self.call_with(endpoint, body, timeout, Vec::new()).await
    }

    async fn call_with(
        &self,
        endpoint: Endpoint,
        body: Option<&Request>,
        timeout: Duration,
        fds: Vec<Arc<OwnedFd>>,
    ) -> Result<Bytes, ApiError> {
        let operation = endpoint.operation();
        if let Some(body) = body {
            debug_assert_eq!(body.endpoint(), endpoint, "body sent to the wrong endpoint");
        }
        let exchange = self.exchange(endpoint, body, fds);
        let (status, bytes) = match tokio::time::timeout(timeout, exchange).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(ApiError::NoAnswer {
                    operation,
                    timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                })
            }
        };
        let message = || error_message(&bytes);
        match classify(endpoint, status, &message()) {
            Some(Outcome::Success) => Ok(bytes),
            Some(outcome) => Err(ApiError::Status {
                endpoint,
                status,
                outcome,
                message: message(),
            }),
            None => Err(ApiError::Unexpected {
                operation,
                reason: format!(
                    "HTTP {status}, which the API does not list for {} {}: {}",
                    endpoint.method(),
                    endpoint.path(),
                    error_message(&bytes)
                ),
            }),
        }
    }

    /// [`ApiClient::call_within`], with `fds` sent beside the request (SCM_RIGHTS), in
    /// order: what the body's descriptor numbers stand for on the VMM's side.
    pub async fn call_handing(
        &self,
        endpoint: Endpoint,
        body: &Request,
        timeout: Duration,
        fds: Vec<Arc<OwnedFd>>,
    ) -> Result<Bytes, ApiError> {
        self.call_with(endpoint, Some(body), timeout, fds).await
    }

    /// Calls an endpoint whose success carries a JSON body and parses it.
    pub async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        endpoint: Endpoint,
        body: Option<&Request>,
    ) -> Result<T, ApiError> {
        let bytes = self.call(endpoint, body).await?;
        serde_json::from_slice(&bytes).map_err(|e| ApiError::Unexpected {
            operation: endpoint.operation(),
            reason: format!("the answer does not parse: {e}"),
        })
    }

    async fn exchange(
        &self,
        endpoint: Endpoint,
        body: Option<&Request>,
        fds: Vec<Arc<OwnedFd>>,
    ) -> Result<(u16, Bytes), ApiError> {
        let operation = endpoint.operation();
        let http = |source: Box<dyn std::error::Error + Send + Sync>| ApiError::Http {
            operation,
            socket: self.socket.clone(),
            source,
        };
        let stream =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ApiError::Connect {
                    socket: self.socket.clone(),
                    source,
                })?;
        let stream = FdPassingStream::new(stream, fds);
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| http(Box::new(e)))?;
        let driver = tokio::spawn(connection);
        let payload = match body {
            Some(body) => Bytes::from(serde_json::to_vec(body).map_err(|e| http(Box::new(e)))?),
            None => Bytes::new(),
        };
        let mut request = hyper::Request::builder()
            .method(endpoint.method())
            .uri(format!("http://localhost{PREFIX}{}", endpoint.path()))
            .header(hyper::header::HOST, "localhost")
            .header(hyper::header::ACCEPT, "application/json");
        if body.is_some() {
            request = request.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(payload))
            .map_err(|e| http(Box::new(e)))?;
        let result = async {
            let answer = sender
                .send_request(request)
                .await
                .map_err(|e| http(Box::new(e)))?;
            let status = answer.status();
            let bytes = Limited::new(answer.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(http)?
                .to_bytes();
            Ok((status_code(status), bytes))
        }
        .await;
        driver.abort();
        result
    }
}

fn status_code(status: StatusCode) -> u16 {
    status.as_u16()
}

/// The VM's state as `vm.info` reports it (`VmInfo.state`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VmInfo {
    /// `Created`, `Running`, `Shutdown`, `Paused` or `BreakPoint`.
    pub state: String,
    /// The configuration, kept as the VMM sent it.
    pub config: Value,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_are_chains() {
        let body = br#"["Error from API","The device could not be removed from the VM","Failed to find device corresponding to the given identifier: nope"]"#;
        assert_eq!(
            error_message(body),
            "Error from API: The device could not be removed from the VM: \
             Failed to find device corresponding to the given identifier: nope"
        );
        assert_eq!(error_message(b""), "no message");
        assert_eq!(error_message(b"[]"), "[]");
        assert_eq!(error_message(b" plain words\n"), "plain words");
    }

    #[test]
    fn statuses_outside_the_spec_and_the_notes_mean_nothing() {
        let classify = |endpoint, status| classify(endpoint, status, "why");
        assert_eq!(
            classify(Endpoint::VmRemoveDevice, 404),
            Some(Outcome::NotFound)
        );
        assert_eq!(
            classify(Endpoint::VmAddDevice, 409),
            Some(Outcome::Conflict)
        );
        assert_eq!(classify(Endpoint::VmPause, 405), Some(Outcome::Refused));
        assert_eq!(classify(Endpoint::VmSendMigration, 200), None);
        assert_eq!(classify(Endpoint::VmRemoveDevice, 418), None);
        // What a real Cloud Hypervisor answers beyond the spec (NOTES.md).
        assert_eq!(classify(Endpoint::VmmShutdown, 200), Some(Outcome::Success));
        assert_eq!(
            classify(Endpoint::VmRemoveDevice, 500),
            Some(Outcome::Refused)
        );
    }

    #[test]
    fn a_500_is_a_refusal_or_a_missing_vm_by_its_chain() {
        let paused =
            "Error from API: The VM could not be paused: InvalidStateTransition(Paused, Paused)";
        assert_eq!(
            classify(Endpoint::VmPause, 500, paused),
            Some(Outcome::Refused)
        );
        let running = "Error from API: InvalidStateTransition(Running, Running)";
        assert_eq!(
            classify(Endpoint::VmResume, 500, running),
            Some(Outcome::Refused)
        );
        let none = "Error from API: The VM could not be paused: VM is not running";
        assert_eq!(
            classify(Endpoint::VmPause, 500, none),
            Some(Outcome::NotFound)
        );
        let created = "Error from API: The VM info is not available: VM is not created";
        assert_eq!(
            classify(Endpoint::VmSendMigration, 500, created),
            Some(Outcome::NotFound)
        );
    }

    #[test]
    fn status_errors_become_kinds() {
        let status = |endpoint, status| ApiError::Status {
            endpoint,
            status,
            outcome: classify(endpoint, status, "why").unwrap(),
            message: "why".into(),
        };
        assert!(matches!(
            status(Endpoint::VmRemoveDevice, 404).into_vmm("vf0"),
            VmmError::NotFound { object, message, .. } if object == "vf0" && message == "why"
        ));
        assert!(matches!(
            status(Endpoint::VmAddDevice, 409).into_vmm("vf0"),
            VmmError::Conflict { object, .. } if object == "vf0"
        ));
        assert!(matches!(
            status(Endpoint::VmSendMigration, 500).into_vmm("unix:/x"),
            VmmError::Refused { class, operation: "send migration", .. } if class == "HTTP 500"
        ));
        assert!(matches!(
            status(Endpoint::VmPause, 500).into_vmm("vm"),
            VmmError::Refused { class, operation: "pause the VM", .. } if class == "HTTP 500"
        ));
    }
}
