//! A QMP client: QEMU's JSON monitor protocol over a UNIX socket.
//!
//! One task reads the socket and routes every line: answers go to the caller waiting on that
//! command id, events go to every subscriber. A caller that needs an event caused by its own
//! command (DEVICE_DELETED after device_del) subscribes *before* sending the command, so an
//! event that QEMU emits before the answer (a USB unplug completes at once) is not lost.
//!
//! Lines are bounded ([`MAX_LINE`]): a peer that sends an endless line is cut off rather than
//! buffered. A malformed line, an over-long one or EOF ends the session; every waiter then
//! gets [`QmpError::Closed`] with the reason.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdmamig_proto::clock::millis;
use serde_json::{json, Value};
use thiserror::Error;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;

/// Longest line accepted from QEMU. The largest answers rdmamig asks for (query-pci on a
/// busy machine) are tens of KiB.
pub const MAX_LINE: usize = 1024 * 1024;

/// Events buffered per subscriber before the slowest one starts losing them.
const EVENT_BUFFER: usize = 1024;

/// Why a QMP exchange failed.
#[derive(Debug, Error)]
pub enum QmpError {
    /// Could not connect to the monitor socket.
    #[error("cannot connect to QMP socket {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// No greeting arrived in time: another client may hold the monitor (QEMU serves one
    /// client per monitor socket at a time).
    #[error(
        "no QMP greeting on {path} within {timeout_ms} ms (another client may hold the monitor)"
    )]
    NoGreeting {
        /// The socket.
        path: PathBuf,
        /// The wait.
        timeout_ms: u64,
    },
    /// The first line was not a QMP greeting.
    #[error("{path} did not greet like QMP: {line}")]
    BadGreeting {
        /// The socket.
        path: PathBuf,
        /// What it sent (cut to 200 bytes).
        line: String,
    },
    /// QEMU answered a command with an error.
    #[error("QMP {command} failed: {desc} ({class})")]
    Command {
        /// The command.
        command: String,
        /// QEMU's error class (`DeviceNotFound`, `CommandNotFound`, `GenericError`, ...).
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// QEMU did not answer a command in time.
    #[error("QMP {command} got no answer within {timeout_ms} ms")]
    NoAnswer {
        /// The command.
        command: String,
        /// The wait.
        timeout_ms: u64,
    },
    /// Writing a command failed.
    #[error("cannot send QMP {command}")]
    Send {
        /// The command.
        command: String,
        /// What write said.
        #[source]
        source: std::io::Error,
    },
    /// The session ended: QEMU closed the socket, or sent something that ended it.
    #[error("QMP session on {path} closed: {reason}")]
    Closed {
        /// The socket.
        path: PathBuf,
        /// Why the session ended.
        reason: String,
    },
}

/// One asynchronous QMP event.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    /// The event name (`DEVICE_DELETED`, `MIGRATION`, `STOP`, ...).
    pub name: String,
    /// Its data (`null` when it has none).
    pub data: Value,
    /// When QEMU emitted it (its `timestamp`, the host's wall clock); `None` when the event
    /// carries no time QEMU could read.
    pub timestamp: Option<SystemTime>,
}

/// What subscribers receive: events, then one `Closed` when the session ends.
#[derive(Debug, Clone)]
enum Item {
    Event(QmpEvent),
    Closed(String),
}

type Waiter = oneshot::Sender<Result<Value, QmpError>>;

/// State shared between callers and the reader task.
#[derive(Debug)]
struct Shared {
    path: PathBuf,
    /// Callers waiting for an answer, by command id. `Err` once the session closed, with why.
    pending: Mutex<Result<HashMap<u64, Waiter>, String>>,
}

impl Shared {
    fn closed(&self, reason: String) -> QmpError {
        QmpError::Closed {
            path: self.path.clone(),
            reason,
        }
    }
}

/// A connected, negotiated QMP session.
#[derive(Debug)]
pub struct QmpClient {
    shared: Arc<Shared>,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    events: broadcast::Sender<Item>,
    next_id: AtomicU64,
    answer_timeout: Duration,
    version: Value,
    reader: JoinHandle<()>,
}

impl QmpClient {
    /// Connects to `path`, reads the greeting (within `timeout`) and enters command mode.
    ///
    /// Each command then waits at most `answer_timeout` for its answer.
    pub async fn connect(
        path: &Path,
        timeout: Duration,
        answer_timeout: Duration,
    ) -> Result<QmpClient, QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| QmpError::Connect {
                path: path.into(),
                source,
            })?;
        let (read, writer) = stream.into_split();
        let mut read = BufReader::new(read);
        let no_greeting = || QmpError::NoGreeting {
            path: path.into(),
            timeout_ms: millis(timeout),
        };
        let line = tokio::time::timeout(timeout, read_line(&mut read))
            .await
            .map_err(|_| no_greeting())?
            .map_err(|reason| QmpError::Closed {
                path: path.into(),
                reason,
            })?
            .ok_or_else(no_greeting)?;
        let version = serde_json::from_slice::<Value>(&line)
            .ok()
            .and_then(|greeting| greeting.get("QMP")?.get("version").cloned())
            .ok_or_else(|| QmpError::BadGreeting {
                path: path.into(),
                line: String::from_utf8_lossy(&line[..line.len().min(200)]).into(),
            })?;

        let shared = Arc::new(Shared {
            path: path.into(),
            pending: Mutex::new(Ok(HashMap::new())),
        });
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let reader = tokio::spawn(read_loop(read, shared.clone(), events.clone()));
        let client = QmpClient {
            shared,
            writer: tokio::sync::Mutex::new(writer),
            events,
            next_id: AtomicU64::new(1),
            answer_timeout,
            version,
            reader,
        };
        client.execute("qmp_capabilities", None).await?;
        Ok(client)
    }

    /// QEMU's version, as its greeting gave it (`{"qemu": {"major": 7, ...}, "package": ...}`).
    pub fn version(&self) -> &Value {
        &self.version
    }

    /// The monitor socket.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Starts receiving events. Only events that arrive after this call are delivered.
    pub fn subscribe(&self) -> EventStream {
        let receiver = self.events.subscribe();
        let closed = lock(&self.shared.pending).as_ref().err().cloned();
        EventStream {
            receiver,
            closed,
            path: self.shared.path.clone(),
        }
    }

    /// Runs `command` with `arguments` and returns QEMU's `return` value.
    pub async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match &mut *lock(&self.shared.pending) {
            Ok(pending) => {
                pending.insert(id, tx);
            }
            Err(reason) => return Err(self.shared.closed(reason.clone())),
        }
        let _forget = ForgetOnDrop {
            shared: &self.shared,
            id,
        };
        let mut message = json!({"execute": command, "id": id});
        if let Some(arguments) = arguments {
            message["arguments"] = arguments;
        }
        let mut line = message.to_string().into_bytes();
        line.push(b'\n');
        tracing::debug!(path = %self.shared.path.display(), %command, id, "qmp send");
        {
            let mut writer = self.writer.lock().await;
            if let Err(source) = writer.write_all(&line).await {
                return Err(if is_disconnect(&source) {
                    self.shared.closed(format!("writing {command}: {source}"))
                } else {
                    QmpError::Send {
                        command: command.into(),
                        source,
                    }
                });
            }
        }
        let answer = tokio::time::timeout(self.answer_timeout, rx)
            .await
            .map_err(|_| QmpError::NoAnswer {
                command: command.into(),
                timeout_ms: millis(self.answer_timeout),
            })?
            .unwrap_or_else(|_| Err(self.shared.closed("reader stopped".into())))?;
        parse_answer(command, answer)
    }

    /// Waits (at most `timeout`) until the session has closed: after `quit`, QEMU closes the
    /// socket as it exits. Returns whether it did.
    pub async fn wait_closed(&self, timeout: Duration) -> bool {
        matches!(
            self.subscribe().wait_for(timeout, |_| false).await,
            Err(QmpError::Closed { .. })
        )
    }
}

impl Drop for QmpClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Events of one session, from the moment of [`QmpClient::subscribe`].
#[derive(Debug)]
pub struct EventStream {
    receiver: broadcast::Receiver<Item>,
    /// Set when the session had already ended at subscription.
    closed: Option<String>,
    path: PathBuf,
}

impl EventStream {
    /// Waits for the first event for which `matches` holds. `Ok(None)` when `timeout` passed;
    /// [`QmpError::Closed`] when the session ends first.
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        mut matches: impl FnMut(&QmpEvent) -> bool,
    ) -> Result<Option<QmpEvent>, QmpError> {
        let closed = |reason: String| QmpError::Closed {
            path: self.path.clone(),
            reason,
        };
        if let Some(reason) = &self.closed {
            return Err(closed(reason.clone()));
        }
        let wait = async {
            loop {
                match self.receiver.recv().await {
                    Ok(Item::Event(event)) if matches(&event) => return Ok(event),
                    Ok(Item::Event(_)) => {}
                    Ok(Item::Closed(reason)) => return Err(reason),
                    Err(broadcast::error::RecvError::Lagged(lost)) => {
                        tracing::warn!(path = %self.path.display(), lost, "qmp events lost");
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        return Err("the reader stopped".to_string())
                    }
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(event)) => Ok(Some(event)),
            Ok(Err(reason)) => {
                self.closed = Some(reason.clone());
                Err(closed(reason))
            }
            Err(_) => Ok(None),
        }
    }
}

/// Removes a command's waiter when its caller stops waiting (answered, timed out, dropped).
struct ForgetOnDrop<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        if let Ok(pending) = &mut *lock(&self.shared.pending) {
            pending.remove(&self.id);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn is_disconnect(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::NotConnected
    )
}

/// Turns one answer object into the command's result.
fn parse_answer(command: &str, answer: Value) -> Result<Value, QmpError> {
    if let Some(error) = answer.get("error") {
        let text = |key: &str| {
            error
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or("(none given)")
                .to_string()
        };
        return Err(QmpError::Command {
            command: command.into(),
            class: text("class"),
            desc: text("desc"),
        });
    }
    Ok(answer.get("return").cloned().unwrap_or(Value::Null))
}

/// What one line from QEMU is.
#[derive(Debug, PartialEq)]
pub enum Incoming {
    /// An answer to a command.
    Answer {
        /// The command's `id`.
        id: u64,
        /// The whole answer (`return` or `error`).
        answer: Value,
    },
    /// An event.
    Event(QmpEvent),
    /// Something else (an answer without our id): logged and dropped.
    Stray(Value),
}

/// Classifies one line. `Err` means the line is not JSON (the session cannot go on).
pub fn classify(line: &[u8]) -> Result<Incoming, String> {
    let value: Value =
        serde_json::from_slice(line).map_err(|e| format!("malformed QMP line: {e}"))?;
    if let Some(name) = value.get("event").and_then(Value::as_str) {
        return Ok(Incoming::Event(QmpEvent {
            name: name.into(),
            data: value.get("data").cloned().unwrap_or(Value::Null),
            timestamp: value.get("timestamp").and_then(event_time),
        }));
    }
    let is_answer = value.get("return").is_some() || value.get("error").is_some();
    match value.get("id").and_then(Value::as_u64) {
        Some(id) if is_answer => Ok(Incoming::Answer { id, answer: value }),
        _ => Ok(Incoming::Stray(value)),
    }
}

/// Reads an event's `timestamp` (`{"seconds": S, "microseconds": US}` since the epoch).
/// QEMU writes -1 for both when it could not read the clock: that, like anything out of
/// range, is no time.
fn event_time(timestamp: &Value) -> Option<SystemTime> {
    let seconds = timestamp.get("seconds")?.as_u64()?;
    let micros = timestamp
        .get("microseconds")?
        .as_u64()
        .filter(|us| *us < 1_000_000)?;
    UNIX_EPOCH.checked_add(Duration::from_secs(seconds).checked_add(Duration::from_micros(micros))?)
}

/// Reads one `\n`-terminated line (without it), at most [`MAX_LINE`] bytes.
///
/// `Ok(None)` at a clean EOF; `Err` with the reason for an I/O error, an over-long line or
/// EOF in the middle of a line.
async fn read_line<R: AsyncBufRead + Unpin>(reader: &mut R) -> Result<Option<Vec<u8>>, String> {
    let mut line = Vec::new();
    loop {
        let buf = reader
            .fill_buf()
            .await
            .map_err(|e| format!("read error: {e}"))?;
        if buf.is_empty() {
            return if line.is_empty() {
                Ok(None)
            } else {
                Err("EOF in the middle of a line".into())
            };
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(end) => (&buf[..end], Some(end + 1)),
            None => (buf, None),
        };
        if line.len() + chunk.len() > MAX_LINE {
            return Err(format!("a line longer than {MAX_LINE} bytes"));
        }
        line.extend_from_slice(chunk);
        let used = done.unwrap_or(chunk.len());
        reader.consume(used);
        if done.is_some() {
            return Ok(Some(line));
        }
    }
}

async fn read_loop(
    mut reader: BufReader<OwnedReadHalf>,
    shared: Arc<Shared>,
    events: broadcast::Sender<Item>,
) {
    let reason = loop {
        let line = match read_line(&mut reader).await {
            Ok(Some(line)) => line,
            Ok(None) => break "QEMU closed the socket".to_string(),
            Err(reason) => break reason,
        };
        match classify(&line) {
            Ok(Incoming::Answer { id, answer }) => {
                let waiter = match &mut *lock(&shared.pending) {
                    Ok(pending) => pending.remove(&id),
                    Err(_) => None,
                };
                match waiter {
                    Some(waiter) => drop(waiter.send(Ok(answer))),
                    None => tracing::debug!(id, "qmp answer nobody waits for"),
                }
            }
            Ok(Incoming::Event(event)) => {
                tracing::debug!(path = %shared.path.display(), event = %event.name, "qmp event");
                // No subscriber is not an error: nobody asked for this event.
                let _ = events.send(Item::Event(event));
            }
            Ok(Incoming::Stray(value)) => tracing::warn!(%value, "stray qmp line"),
            Err(reason) => break reason,
        }
    };
    tracing::debug!(path = %shared.path.display(), %reason, "qmp session ended");
    let pending = std::mem::replace(&mut *lock(&shared.pending), Err(reason.clone()));
    if let Ok(pending) = pending {
        for (_, waiter) in pending {
            let _ = waiter.send(Err(shared.closed(reason.clone())));
        }
    }
    // Subscribers see this after every event that came before it.
    let _ = events.send(Item::Closed(reason));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_answers_events_and_strays() {
        assert_eq!(
            classify(br#"{"return": {}, "id": 4}"#).unwrap(),
            Incoming::Answer {
                id: 4,
                answer: json!({"return": {}, "id": 4})
            }
        );
        let error =
            br#"{"id": 5, "error": {"class": "DeviceNotFound", "desc": "Device 'x' not found"}}"#;
        assert!(matches!(
            classify(error).unwrap(),
            Incoming::Answer { id: 5, .. }
        ));
        assert_eq!(
            classify(br#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "DEVICE_DELETED", "data": {"device": "nic0", "path": "/machine/peripheral/nic0"}}"#).unwrap(),
            Incoming::Event(QmpEvent {
                name: "DEVICE_DELETED".into(),
                data: json!({"device": "nic0", "path": "/machine/peripheral/nic0"}),
                timestamp: Some(UNIX_EPOCH + Duration::from_micros(1_000_002)),
            })
        );
        assert_eq!(
            classify(br#"{"event": "STOP"}"#).unwrap(),
            Incoming::Event(QmpEvent {
                name: "STOP".into(),
                data: Value::Null,
                timestamp: None,
            })
        );
        assert!(matches!(
            classify(br#"{"return": {}}"#).unwrap(),
            Incoming::Stray(_)
        ));
        assert!(matches!(
            classify(br#"{"id": 1}"#).unwrap(),
            Incoming::Stray(_)
        ));
        assert!(classify(b"not json").is_err());
    }

    #[test]
    fn event_timestamps_are_read_or_refused() {
        // As QEMU 7.2 stamped a STOP on the test bed.
        let stamp = json!({"seconds": 1764448995, "microseconds": 123456});
        assert_eq!(
            event_time(&stamp),
            Some(UNIX_EPOCH + Duration::new(1764448995, 123_456_000))
        );
        // QEMU's "could not read the clock", and what no clock says.
        for bad in [
            json!({"seconds": -1, "microseconds": -1}),
            json!({"seconds": 1, "microseconds": 1_000_000}),
            json!({"seconds": 1}),
            json!({"seconds": "1", "microseconds": 0}),
            json!({"seconds": u64::MAX, "microseconds": 999_999}),
            json!(17),
        ] {
            assert_eq!(event_time(&bad), None, "{bad}");
        }
    }

    #[test]
    fn answers_become_results() {
        assert_eq!(
            parse_answer("query-status", json!({"return": {"running": true}})).unwrap(),
            json!({"running": true})
        );
        let err = parse_answer(
            "bogus",
            json!({"error": {"class": "CommandNotFound", "desc": "The command bogus has not been found"}}),
        )
        .unwrap_err();
        assert!(
            matches!(&err, QmpError::Command { class, .. } if class == "CommandNotFound"),
            "{err}"
        );
        let err = parse_answer("x", json!({"error": 3})).unwrap_err();
        assert!(matches!(&err, QmpError::Command { class, .. } if class == "(none given)"));
    }

    #[tokio::test]
    async fn lines_are_bounded_and_split_reads_join() {
        let mut input: &[u8] = b"{\"a\":1}\n{\"b\":\n";
        let mut reader = BufReader::with_capacity(3, &mut input);
        assert_eq!(read_line(&mut reader).await.unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(read_line(&mut reader).await.unwrap().unwrap(), b"{\"b\":");
        assert_eq!(read_line(&mut reader).await.unwrap(), None);

        let mut partial: &[u8] = b"{\"a\"";
        assert!(read_line(&mut BufReader::new(&mut partial)).await.is_err());

        let long = vec![b'x'; MAX_LINE + 1];
        let mut long: &[u8] = &long;
        let err = read_line(&mut BufReader::new(&mut long)).await.unwrap_err();
        assert!(err.contains("longer than"), "{err}");
    }
}
