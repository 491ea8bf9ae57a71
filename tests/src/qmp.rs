//! A minimal synchronous QMP client for the harness's own checks (hot-plug, readiness of an
//! incoming QEMU).
//!
//! The project's QEMU backend lives in `rdmamig-vmm`; this one exists so that the test bed can
//! exercise QEMU without depending on the code under test. QEMU's QMP socket serves one client
//! at a time, so the harness never keeps a connection open: a test connects, acts and drops
//! the client, leaving the socket free for the migrator.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long [`Qmp::execute`] waits for a command's reply.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors of the QMP client.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket did not accept a connection before the deadline.
    #[error("connecting to QMP socket {socket} (gave up after {waited:?})")]
    Connect {
        /// The QMP socket.
        socket: PathBuf,
        /// How long connecting was retried.
        waited: Duration,
        /// The last connection error.
        #[source]
        source: std::io::Error,
    },
    /// Reading from or writing to the socket failed.
    #[error("QMP I/O on {socket} during {operation}")]
    Io {
        /// The QMP socket.
        socket: PathBuf,
        /// The command or event being handled.
        operation: String,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// QEMU closed the connection.
    #[error("QMP socket {socket} closed during {operation}")]
    Closed {
        /// The QMP socket.
        socket: PathBuf,
        /// The command or event being handled.
        operation: String,
    },
    /// A message was not valid JSON.
    #[error("QMP on {socket} sent invalid JSON: {line}")]
    Json {
        /// The QMP socket.
        socket: PathBuf,
        /// The offending line.
        line: String,
    },
    /// QEMU answered a command with an error.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QMP's error class.
        class: String,
        /// QMP's error description.
        desc: String,
    },
    /// No reply or event arrived in time.
    #[error("timed out after {waited:?} waiting for {operation} on {socket}")]
    Timeout {
        /// The QMP socket.
        socket: PathBuf,
        /// The command or event awaited.
        operation: String,
        /// How long it waited.
        waited: Duration,
    },
}

/// A connected QMP session, in command mode.
#[derive(Debug)]
pub struct Qmp {
    socket: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Bytes of a line cut short by a read timeout, kept for the next read.
    partial: Vec<u8>,
    /// Events that arrived while waiting for something else.
    events: VecDeque<Value>,
}

impl Qmp {
    /// Connects to `socket`, retrying until `timeout` while QEMU has not created it yet, and
    /// negotiates capabilities.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let started = Instant::now();
        let stream = loop {
            match UnixStream::connect(socket) {
                Ok(stream) => break stream,
                Err(source) if started.elapsed() >= timeout => {
                    return Err(QmpError::Connect {
                        socket: socket.to_owned(),
                        waited: started.elapsed(),
                        source,
                    })
                }
                // QEMU creates the socket shortly after it starts.
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let io_error = |source| QmpError::Io {
            socket: socket.to_owned(),
            operation: "connect".into(),
            source,
        };
        let writer = stream.try_clone().map_err(io_error)?;
        let mut qmp = Qmp {
            socket: socket.to_owned(),
            reader: BufReader::new(stream),
            writer,
            partial: Vec::new(),
            events: VecDeque::new(),
        };
        let deadline = started + timeout.max(Duration::from_secs(5));
        let greeting = qmp.read_message("greeting", deadline, timeout)?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Json {
                socket: socket.to_owned(),
                line: greeting.to_string(),
            });
        }
        qmp.execute("qmp_capabilities", Value::Null)?;
        Ok(qmp)
    }

    /// Runs `command` with `arguments` (`Value::Null` for none) and returns its `return` value.
    /// Events arriving meanwhile are kept for [`Qmp::wait_event`].
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let mut request = json!({ "execute": command });
        if !arguments.is_null() {
            request["arguments"] = arguments;
        }
        let mut line = request.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .map_err(|source| QmpError::Io {
                socket: self.socket.clone(),
                operation: command.to_owned(),
                source,
            })?;
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        loop {
            let mut message = self.read_message(command, deadline, COMMAND_TIMEOUT)?;
            if let Some(ret) = message.get_mut("return") {
                return Ok(ret.take());
            }
            if let Some(err) = message.get("error") {
                let field = |name: &str| err[name].as_str().unwrap_or_default().to_owned();
                return Err(QmpError::Command {
                    command: command.to_owned(),
                    class: field("class"),
                    desc: field("desc"),
                });
            }
            self.events.push_back(message);
        }
    }

    /// Waits for the event named `name` (e.g. `DEVICE_DELETED`) whose `data` satisfies
    /// `matches`, and returns the whole event. Earlier events that do not match are dropped.
    pub fn wait_event(
        &mut self,
        name: &str,
        matches: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        let is_match = |e: &Value| e["event"] == name && matches(&e["data"]);
        while let Some(event) = self.events.pop_front() {
            if is_match(&event) {
                return Ok(event);
            }
        }
        let deadline = Instant::now() + timeout;
        loop {
            let event = self.read_message(name, deadline, timeout)?;
            if is_match(&event) {
                return Ok(event);
            }
        }
    }

    /// Reads one JSON message, waiting at most until `deadline` (`timeout` is the whole wait,
    /// for the error message).
    fn read_message(
        &mut self,
        operation: &str,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(QmpError::Timeout {
                    socket: self.socket.clone(),
                    operation: operation.to_owned(),
                    waited: timeout,
                });
            }
            let io_error = |source| QmpError::Io {
                socket: self.socket.clone(),
                operation: operation.to_owned(),
                source,
            };
            self.reader
                .get_ref()
                .set_read_timeout(Some(remaining))
                .map_err(io_error)?;
            match self.reader.read_until(b'\n', &mut self.partial) {
                Ok(0) => {
                    return Err(QmpError::Closed {
                        socket: self.socket.clone(),
                        operation: operation.to_owned(),
                    })
                }
                Ok(_) if self.partial.ends_with(b"\n") => {
                    let line = std::mem::take(&mut self.partial);
                    return serde_json::from_slice(&line).map_err(|_| QmpError::Json {
                        socket: self.socket.clone(),
                        line: String::from_utf8_lossy(&line).into_owned(),
                    });
                }
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(QmpError::Io {
                        socket: self.socket.clone(),
                        operation: operation.to_owned(),
                        source,
                    })
                }
            }
        }
    }
}
