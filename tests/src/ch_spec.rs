//! Cloud Hypervisor's API description as a test oracle: the spec read at test time from
//! ../shared/cloud-hypervisor/openapi.yaml, a schema checker, and a recording stand-in for a
//! Cloud Hypervisor API socket whose requests are all checked against the spec.
//!
//! A real Cloud Hypervisor cannot run on these machines (no usable KVM), so the spec is the
//! oracle: the contract tests (vmm-plugin/tests/ch_contract.rs) and the whole-move test with
//! Cloud Hypervisor endpoints (tests/tests/ch_move.rs) share this one harness. The stand-in
//! answers with statuses and bodies the test chooses; the bodies are made from (and checked
//! against) the spec's schemas, so the stand-in cannot drift from what Cloud Hypervisor
//! sends. [`check_against_spec`] fails on any request to a path or method the spec lacks and
//! on any body its schema rejects (unknown properties included). The stand-in reads with
//! `recvmsg`, as Cloud Hypervisor's server does, and records the descriptors a request hands
//! over (SCM_RIGHTS) by what they open.
//!
//! The schema checker understands exactly the keywords the spec uses and fails on any other,
//! so nothing in a schema is silently ignored.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rdmamig_vmm::ch_api::{Endpoint, PREFIX};
use rdmamig_vmm::ChConfig;
use serde_json::{json, Map, Value};
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

// ---------------------------------------------------------------------------------------
// The spec

/// Where the spec is (read, never written).
pub const SPEC: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/cloud-hypervisor/openapi.yaml"
);

/// The spec as JSON, read once.
pub fn spec() -> &'static Value {
    static SPEC_VALUE: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    SPEC_VALUE.get_or_init(|| {
        let text = std::fs::read_to_string(SPEC)
            .unwrap_or_else(|e| panic!("the API description {SPEC} must be readable: {e}"));
        let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("openapi.yaml parses");
        to_json(yaml)
    })
}

/// YAML to JSON, with map keys (response codes are integers in YAML) as strings.
pub fn to_json(yaml: serde_yaml::Value) -> Value {
    match yaml {
        serde_yaml::Value::Null => Value::Null,
        serde_yaml::Value::Bool(b) => Value::Bool(b),
        serde_yaml::Value::Number(n) => {
            serde_json::to_value(&n).expect("a YAML number is a JSON number")
        }
        serde_yaml::Value::String(s) => Value::String(s),
        serde_yaml::Value::Sequence(items) => {
            Value::Array(items.into_iter().map(to_json).collect())
        }
        serde_yaml::Value::Mapping(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| {
                    let key = match k {
                        serde_yaml::Value::String(s) => s,
                        serde_yaml::Value::Number(n) => n.to_string(),
                        serde_yaml::Value::Bool(b) => b.to_string(),
                        other => panic!("unexpected YAML key {other:?}"),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
        serde_yaml::Value::Tagged(tagged) => to_json(tagged.value),
    }
}

/// The spec's operation for `method` on `path` (path without the server prefix).
pub fn operation(path: &str, method: &str) -> Option<&'static Value> {
    spec()["paths"].get(path)?.get(method.to_ascii_lowercase())
}

/// `schema` with its `$ref` followed.
pub fn resolve(schema: &Value) -> &Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(reference) => {
            let name = reference
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("unsupported $ref {reference}"));
            let target = spec()["components"]["schemas"]
                .get(name)
                .unwrap_or_else(|| panic!("$ref to a schema the spec lacks: {reference}"));
            resolve(target)
        }
        None => schema,
    }
}

/// The schema keywords the checker knows; any other fails the check.
const KEYWORDS: &[&str] = &[
    "$ref",
    "type",
    "properties",
    "required",
    "enum",
    "minimum",
    "maximum",
    "format",
    "items",
    "additionalProperties",
    "minLength",
    "default",
    "description",
    "deprecated",
];

/// Checks `value` against `schema`; the error names the JSON path and the rule.
pub fn validate(schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    let schema = resolve(schema);
    let rules = schema
        .as_object()
        .ok_or_else(|| format!("{at}: schema is not an object"))?;
    if let Some(unknown) = rules.keys().find(|k| !KEYWORDS.contains(&k.as_str())) {
        return Err(format!(
            "{at}: the checker does not know schema keyword {unknown:?}"
        ));
    }
    if let Some(allowed) = rules.get("enum").and_then(Value::as_array) {
        if !allowed.contains(value) {
            return Err(format!("{at}: {value} is not one of {allowed:?}"));
        }
    }
    match rules.get("type").and_then(Value::as_str) {
        None => {}
        Some("object") => {
            let object = value
                .as_object()
                .ok_or_else(|| format!("{at}: {value} is not an object"))?;
            for required in rules
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let name = required.as_str().unwrap_or_default();
                if !object.contains_key(name) {
                    return Err(format!("{at}: required property {name:?} is missing"));
                }
            }
            let properties = rules.get("properties").and_then(Value::as_object);
            for (name, item) in object {
                match (
                    properties.and_then(|p| p.get(name)),
                    rules.get("additionalProperties"),
                ) {
                    (Some(property), _) => validate(property, item, &format!("{at}.{name}"))?,
                    (None, Some(Value::Bool(true))) => {}
                    (None, Some(extra)) if extra.is_object() => {
                        validate(extra, item, &format!("{at}.{name}"))?
                    }
                    // Strict: a property the schema does not name is a misspelling.
                    (None, _)
                        if properties.is_some() || rules.get("additionalProperties").is_some() =>
                    {
                        return Err(format!("{at}: property {name:?} is not in the schema"))
                    }
                    // `type: object` with no properties at all: anything goes.
                    (None, _) => {}
                }
            }
        }
        Some("array") => {
            let items = value
                .as_array()
                .ok_or_else(|| format!("{at}: {value} is not an array"))?;
            if let Some(item_schema) = rules.get("items") {
                for (i, item) in items.iter().enumerate() {
                    validate(item_schema, item, &format!("{at}[{i}]"))?;
                }
            }
        }
        Some("string") => {
            let text = value
                .as_str()
                .ok_or_else(|| format!("{at}: {value} is not a string"))?;
            if let Some(min) = rules.get("minLength").and_then(Value::as_u64) {
                if (text.chars().count() as u64) < min {
                    return Err(format!("{at}: {text:?} is shorter than {min}"));
                }
            }
        }
        Some("integer") => {
            let n = value
                .as_i64()
                .map(i128::from)
                .or_else(|| value.as_u64().map(i128::from))
                .ok_or_else(|| format!("{at}: {value} is not an integer"))?;
            let (lo, hi): (i128, i128) = match rules.get("format").and_then(Value::as_str) {
                Some("int8") => (i8::MIN.into(), i8::MAX.into()),
                Some("uint8") => (0, u8::MAX.into()),
                Some("int16") => (i16::MIN.into(), i16::MAX.into()),
                Some("uint16") => (0, u16::MAX.into()),
                Some("int32") => (i32::MIN.into(), i32::MAX.into()),
                Some("uint32") => (0, u32::MAX.into()),
                Some("int64") => (i64::MIN.into(), i64::MAX.into()),
                Some("uint64") | None => (i64::MIN.into(), u64::MAX.into()),
                Some(other) => return Err(format!("{at}: unknown integer format {other}")),
            };
            if n < lo || n > hi {
                return Err(format!("{at}: {n} is outside its format's range"));
            }
            if let Some(min) = rules.get("minimum").and_then(Value::as_i64) {
                if n < min.into() {
                    return Err(format!("{at}: {n} is below the minimum {min}"));
                }
            }
            if let Some(max) = rules.get("maximum").and_then(Value::as_i64) {
                if n > max.into() {
                    return Err(format!("{at}: {n} is above the maximum {max}"));
                }
            }
        }
        Some("number") => {
            value
                .as_f64()
                .ok_or_else(|| format!("{at}: {value} is not a number"))?;
        }
        Some("boolean") => {
            value
                .as_bool()
                .ok_or_else(|| format!("{at}: {value} is not a boolean"))?;
        }
        Some(other) => return Err(format!("{at}: unknown type {other}")),
    }
    Ok(())
}

/// The smallest value the schema accepts: required properties only, the first enum value,
/// the minimum of an integer.
pub fn minimal(schema: &Value) -> Value {
    let schema = resolve(schema);
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return first.clone();
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let mut object = Map::new();
            for required in schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let name = required.as_str().unwrap();
                object.insert(name.into(), minimal(&schema["properties"][name]));
            }
            Value::Object(object)
        }
        Some("array") => json!([]),
        Some("string") => json!("x"),
        Some("integer") => json!(schema.get("minimum").and_then(Value::as_i64).unwrap_or(0)),
        Some("number") => json!(0.0),
        Some("boolean") => json!(false),
        _ => json!({}),
    }
}

/// The JSON schema of `status`'s body for `endpoint`, if the spec gives one.
pub fn response_schema(endpoint: Endpoint, status: u16) -> Option<&'static Value> {
    operation(endpoint.path(), endpoint.method().as_str())?["responses"]
        .get(status.to_string())?
        .get("content")?
        .get("application/json")?
        .get("schema")
}

/// The statuses the spec lists for `endpoint`.
pub fn spec_statuses(endpoint: Endpoint) -> BTreeSet<u16> {
    let op = operation(endpoint.path(), endpoint.method().as_str()).unwrap_or_else(|| {
        panic!(
            "the backend uses {} {}, which the spec does not define",
            endpoint.method(),
            endpoint.path()
        )
    });
    op["responses"]
        .as_object()
        .expect("responses")
        .keys()
        .map(|k| k.parse().expect("numeric status"))
        .collect()
}

// ---------------------------------------------------------------------------------------
// The recording server

/// One request the stand-in received.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The HTTP method.
    pub method: String,
    /// The path, with the /api/v1 prefix.
    pub path: String,
    /// The JSON body, if any.
    pub body: Option<Value>,
    /// The descriptors that came with the request (SCM_RIGHTS), as (device, inode) of what
    /// each one opens, in the order received.
    pub fds: Vec<(u64, u64)>,
}

/// An accepted API connection that reads with `recvmsg`, keeping the descriptors that come
/// with the bytes (as Cloud Hypervisor's server does for `vfio_fds` and `iommufd_fd`).
struct FdCollecting {
    stream: tokio::net::UnixStream,
    /// (device, inode) of each descriptor received and not yet given to a request.
    received: Arc<Mutex<Vec<(u64, u64)>>>,
}

impl tokio::io::AsyncRead for FdCollecting {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let this = self.get_mut();
        let socket = this.stream.as_raw_fd();
        loop {
            std::task::ready!(this.stream.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let read = this.stream.try_io(tokio::io::Interest::READABLE, || {
                let mut space = nix::cmsg_space!([std::os::fd::RawFd; 8]);
                let mut iov = [std::io::IoSliceMut::new(unfilled)];
                let message = recvmsg::<()>(
                    socket,
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )
                .map_err(std::io::Error::from)?;
                let mut fds = Vec::new();
                for cmsg in message.cmsgs().map_err(std::io::Error::from)? {
                    if let ControlMessageOwned::ScmRights(received) = cmsg {
                        fds.extend(received);
                    }
                }
                Ok((message.bytes, fds))
            });
            match read {
                Ok((n, fds)) => {
                    for fd in fds {
                        // SAFETY: the kernel just installed this descriptor for this
                        // process; nothing else owns it.
                        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
                        let meta = file.metadata()?;
                        use std::os::unix::fs::MetadataExt;
                        this.received.lock().unwrap().push((meta.dev(), meta.ino()));
                    }
                    buf.advance(n);
                    return std::task::Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return std::task::Poll::Ready(Err(e)),
            }
        }
    }
}

impl tokio::io::AsyncWrite for FdCollecting {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Answers a request: the path under /api/v1 and the body, to a status and a body.
pub type Responder = dyn Fn(&str, Option<&Value>) -> (u16, Vec<u8>) + Send + Sync;

/// A stand-in for one Cloud Hypervisor API socket, recording every request.
pub struct FakeCh {
    dir: tempfile::TempDir,
    recorded: Arc<Mutex<Vec<Recorded>>>,
    task: JoinHandle<()>,
}

impl FakeCh {
    /// Serves on a fresh socket; `respond` gets the path under /api/v1 and the body.
    pub fn start(
        respond: impl Fn(&str, Option<&Value>) -> (u16, Vec<u8>) + Send + Sync + 'static,
    ) -> FakeCh {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("api.sock")).unwrap();
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let respond: Arc<Responder> = Arc::new(respond);
        let log = recorded.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let log = log.clone();
                let respond = respond.clone();
                let received = Arc::new(Mutex::new(Vec::new()));
                let stream = FdCollecting {
                    stream,
                    received: received.clone(),
                };
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |request: hyper::Request<hyper::body::Incoming>| {
                            let log = log.clone();
                            let respond = respond.clone();
                            let received = received.clone();
                            async move {
                                let method = request.method().to_string();
                                let path = request.uri().path().to_string();
                                let bytes = request.into_body().collect().await?.to_bytes();
                                let body = (!bytes.is_empty()).then(|| {
                                    serde_json::from_slice::<Value>(&bytes).unwrap_or_else(|e| {
                                        panic!("the backend sent a body that is not JSON: {e}")
                                    })
                                });
                                let fds = std::mem::take(&mut *received.lock().unwrap());
                                log.lock().unwrap().push(Recorded {
                                    method,
                                    path: path.clone(),
                                    body: body.clone(),
                                    fds,
                                });
                                // On a blocking thread: a responder may wait (a receiver
                                // answers only once the migration has ended).
                                let (status, answer) = match path.strip_prefix(PREFIX) {
                                    Some(endpoint) => {
                                        let endpoint = endpoint.to_string();
                                        tokio::task::spawn_blocking(move || {
                                            respond(&endpoint, body.as_ref())
                                        })
                                        .await
                                        .expect("the responder panicked")
                                    }
                                    None => (404, b"[\"no such path\"]".to_vec()),
                                };
                                let mut response =
                                    hyper::Response::new(Full::new(Bytes::from(answer)));
                                *response.status_mut() =
                                    hyper::StatusCode::from_u16(status).unwrap();
                                Ok::<_, hyper::Error>(response)
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        FakeCh {
            dir,
            recorded,
            task,
        }
    }

    /// The API socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("api.sock")
    }

    /// A path in the stand-in's own directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A backend configuration for this socket, with short waits.
    pub fn config(&self) -> ChConfig {
        let mut config = ChConfig::new(self.socket());
        config.answer_timeout = Duration::from_secs(5);
        config.poll_interval = Duration::from_millis(10);
        config
    }

    /// Every request so far.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.recorded.lock().unwrap().clone()
    }
}

impl Drop for FakeCh {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The 500 a real Cloud Hypervisor answers for a refusal (NOTES.md), with its error chain:
/// `vm.pause` of a paused VM, `vm.resume` of a running one, a call with no VM.
pub fn refusal(chain: &[&str]) -> (u16, Vec<u8>) {
    (500, serde_json::to_vec(&chain).unwrap())
}

/// A body the spec allows for `status` of `endpoint`: a generated minimal instance of its
/// schema for a success with content, the error chain for a failure, nothing otherwise.
pub fn spec_body(endpoint: Endpoint, status: u16) -> Vec<u8> {
    match response_schema(endpoint, status) {
        Some(schema) => serde_json::to_vec(&minimal(schema)).unwrap(),
        None if status >= 400 => {
            serde_json::to_vec(&json!(["Error from API", format!("marker {status}")])).unwrap()
        }
        None => Vec::new(),
    }
}

/// The backend's endpoint for a path; a path it does not declare fails the test.
pub fn endpoint_of(path: &str) -> Endpoint {
    *Endpoint::ALL
        .iter()
        .find(|e| e.path() == path)
        .unwrap_or_else(|| panic!("the backend called {path}, which it does not declare"))
}

/// Answers every call as a real Cloud Hypervisor does when it succeeds: its spec's first
/// success status and a spec-made body, except where NOTES.md says the real server answers
/// otherwise (`vmm.shutdown`: 200, not the spec's 204).
pub fn successful(path: &str, _body: Option<&Value>) -> (u16, Vec<u8>) {
    let endpoint = endpoint_of(path);
    if endpoint == Endpoint::VmmShutdown {
        return (200, Vec::new());
    }
    let status = *spec_statuses(endpoint)
        .iter()
        .find(|s| (200..300).contains(*s))
        .unwrap();
    (status, spec_body(endpoint, status))
}

/// A `VmInfo` body with this state and these devices, checked against the spec.
pub fn vm_info(state: &str, devices: &[&str]) -> Vec<u8> {
    let mut info = minimal(response_schema(Endpoint::VmInfo, 200).unwrap());
    info["state"] = json!(state);
    let tree: Map<String, Value> = devices
        .iter()
        .map(|id| {
            (
                id.to_string(),
                json!({"id": id, "children": [], "pci_bdf": "0000:00:04.0"}),
            )
        })
        .collect();
    info["device_tree"] = Value::Object(tree);
    validate(
        response_schema(Endpoint::VmInfo, 200).unwrap(),
        &info,
        "VmInfo",
    )
    .expect("the fake vm.info is what the spec allows");
    serde_json::to_vec(&info).unwrap()
}

/// Every recorded request is on a spec path with a body its schema accepts.
pub fn check_against_spec(recorded: &[Recorded]) {
    assert!(!recorded.is_empty());
    for request in recorded {
        let path = request
            .path
            .strip_prefix(PREFIX)
            .unwrap_or_else(|| panic!("{} is not under {PREFIX}", request.path));
        let op = operation(path, &request.method).unwrap_or_else(|| {
            panic!(
                "the backend sent {} {}, which the spec does not define",
                request.method, request.path
            )
        });
        let schema = op
            .get("requestBody")
            .and_then(|b| b.get("content"))
            .and_then(|c| c.get("application/json"))
            .and_then(|j| j.get("schema"));
        match (&request.body, schema) {
            (Some(body), Some(schema)) => {
                if let Err(e) = validate(schema, body, "body") {
                    panic!("{} {} with {body}: {e}", request.method, request.path);
                }
            }
            (Some(body), None) => panic!(
                "{} {} takes no body, the backend sent {body}",
                request.method, request.path
            ),
            (None, Some(_)) => {
                let required = op["requestBody"]["required"].as_bool().unwrap_or(false);
                assert!(
                    !required,
                    "{} {} requires a body, the backend sent none",
                    request.method, request.path
                );
            }
            (None, None) => {}
        }
    }
}

/// Appends one event to `path` as Cloud Hypervisor's event monitor writes it
/// (pretty-printed JSON, one object after another).
pub fn append_event(path: &std::path::Path, event: &str) {
    let text = serde_json::to_string_pretty(&json!({
        "timestamp": {"secs": 1, "nanos": 0}, "source": "vm", "event": event, "properties": null
    }))
    .expect("an event serialises");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("the event monitor file opens");
    std::io::Write::write_all(&mut file, text.as_bytes()).expect("the event is written");
}
