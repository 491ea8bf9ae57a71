//! The guest's serial console as a command channel.
//!
//! The image's /init (see `rdmamig_images::init`) runs a loop on /dev/ttyS0 that reads one line
//! at a time and evals it in a subshell; the tty is raw and does not echo. The harness sends
//! each command as one line that brackets the command's output with markers carrying a token
//! unique to the command:
//!
//! ```text
//! echo '@@BEGIN <token>'; ( eval '<command>' ) 2>&1; printf '\n@@DONE <token> %s\n' "$?"
//! ```
//!
//! The output is exactly what lies between the `@@BEGIN <token>` line and the newline printed
//! before `@@DONE`; the status follows `@@DONE <token>`. The inner `eval` of a quoted string
//! means a command with a syntax error still yields its markers (status 2), and anything the
//! console carried before the `@@BEGIN` line (kernel messages, output of background jobs,
//! leftovers of a command that timed out) is skipped. Background jobs should redirect their
//! output, or it may appear inside a later command's output.
//!
//! A reader thread appends everything QEMU sends to a buffer and wakes waiters through a
//! condition variable, so waits are event-driven. QEMU's own `logfile=` keeps the full console
//! for failure dumps; the buffer only holds what is not yet consumed.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Errors of the console channel.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// The console socket did not accept a connection in time.
    #[error("connecting to console socket {socket} (gave up after {waited:?})")]
    Connect {
        /// The console socket.
        socket: PathBuf,
        /// How long connecting was retried.
        waited: Duration,
        /// The last connection error.
        #[source]
        source: std::io::Error,
    },
    /// Writing to or setting up the socket failed.
    #[error("console I/O on {socket}")]
    Io {
        /// The console socket.
        socket: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The command contains a line break; the protocol carries one command per line.
    #[error("console command {command:?} contains a line break")]
    Multiline {
        /// The command.
        command: String,
    },
    /// QEMU closed the console (the guest is gone).
    #[error("console {socket} closed while waiting for {what}")]
    Closed {
        /// The console socket.
        socket: PathBuf,
        /// What was awaited.
        what: String,
    },
    /// The guest did not even start the command: no `@@BEGIN` marker came back in time
    /// (the shell never read it, or the connection does not reach the guest).
    #[error(
        "the guest did not start {command:?} within {waited:?} (no @@BEGIN on console {socket})"
    )]
    NotStarted {
        /// The console socket.
        socket: PathBuf,
        /// The command.
        command: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The awaited output did not arrive in time.
    #[error("timed out after {waited:?} waiting for {what} on console {socket}")]
    Timeout {
        /// The console socket.
        socket: PathBuf,
        /// What was awaited.
        what: String,
        /// How long it waited.
        waited: Duration,
    },
}

/// The result of a console command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutput {
    /// The command's exit status.
    pub status: i32,
    /// stdout and stderr, interleaved as the guest wrote them.
    pub output: String,
}

/// Console bytes received and not yet consumed, and whether the stream ended.
#[derive(Debug, Default)]
struct Received {
    data: Vec<u8>,
    closed: bool,
}

#[derive(Debug, Default)]
struct Shared {
    received: Mutex<Received>,
    arrived: Condvar,
}

/// A connection to a guest's console socket.
#[derive(Debug)]
pub struct Console {
    socket: PathBuf,
    writer: Stream,
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
    /// Serialises commands, so that one command's markers never interleave with another's.
    command: Mutex<()>,
}

/// Makes tokens unique within the process; the pid makes them unique across harnesses.
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

impl Console {
    /// Connects to `socket`, retrying until `timeout` while QEMU has not created it yet.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Console, ConsoleError> {
        let stream = retry(socket, timeout, || UnixStream::connect(socket))?;
        Console::over(Stream::Unix(stream), socket)
    }

    /// Connects to a console QEMU serves on TCP (`-chardev socket,host=..,port=..`) at
    /// `address` inside network namespace `netns`: a nested VM's, inside a host
    /// ([`crate::nested`]), retrying until `timeout`.
    pub fn connect_tcp(
        netns: &str,
        address: std::net::SocketAddr,
        timeout: Duration,
    ) -> Result<Console, ConsoleError> {
        let name = PathBuf::from(format!("tcp:{address}"));
        let stream = retry(&name, timeout, || {
            crate::netns::connect_tcp(netns, address, Duration::from_secs(2))
        })?;
        Console::over(Stream::Tcp(stream), &name)
    }

    fn over(stream: Stream, socket: &Path) -> Result<Console, ConsoleError> {
        let io_error = |source| ConsoleError::Io {
            socket: socket.to_owned(),
            source,
        };
        let mut reading = stream.try_clone().map_err(io_error)?;
        let shared = Arc::new(Shared::default());
        let feed = Arc::clone(&shared);
        let reader = std::thread::Builder::new()
            .name("console-reader".into())
            .spawn(move || {
                let mut chunk = [0u8; 4096];
                loop {
                    match reading.read(&mut chunk) {
                        Ok(0) => break,
                        Ok(n) => {
                            feed.lock().data.extend_from_slice(&chunk[..n]);
                            feed.arrived.notify_all();
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                feed.lock().closed = true;
                feed.arrived.notify_all();
            })
            .map_err(io_error)?;
        Ok(Console {
            socket: socket.to_owned(),
            writer: stream,
            shared,
            reader: Some(reader),
            command: Mutex::new(()),
        })
    }

    /// Waits until a line containing one of `markers` arrives (firmware and the kernel may
    /// leave terminal escapes before it on the same line), consumes the console up to the end
    /// of that line and returns which marker matched and the line from the marker on.
    pub fn wait_for_marker(
        &self,
        markers: &[&str],
        timeout: Duration,
    ) -> Result<(usize, String), ConsoleError> {
        let what = format!("a line with {}", markers.join(" or "));
        self.wait_until(&what, timeout, |data| {
            let text = String::from_utf8_lossy(data);
            let mut offset = 0;
            for line in text.split_inclusive('\n') {
                offset += line.len();
                if !line.ends_with('\n') {
                    break;
                }
                let trimmed = line.trim_end_matches(['\r', '\n']);
                for (i, marker) in markers.iter().enumerate() {
                    if let Some(at) = trimmed.find(marker) {
                        return Some((offset, (i, trimmed[at..].to_owned())));
                    }
                }
            }
            None
        })
    }

    /// Runs one shell command in the guest and waits at most `timeout` for it to finish. On
    /// timeout the command keeps running in the guest; later commands queue behind it.
    pub fn run(&self, command: &str, timeout: Duration) -> Result<CommandOutput, ConsoleError> {
        if command.contains(['\n', '\r']) {
            return Err(ConsoleError::Multiline {
                command: command.to_owned(),
            });
        }
        let _serial = self.command.lock().unwrap_or_else(|p| p.into_inner());
        let token = format!(
            "{}-{}",
            std::process::id(),
            NEXT_TOKEN.fetch_add(1, Ordering::Relaxed)
        );
        let quoted = format!("'{}'", command.replace('\'', r"'\''"));
        let line = format!(
            "echo '@@BEGIN {token}'; ( eval {quoted} ) 2>&1; printf '\\n@@DONE {token} %s\\n' \"$?\"\n"
        );
        (&self.writer)
            .write_all(line.as_bytes())
            .map_err(|source| ConsoleError::Io {
                socket: self.socket.clone(),
                source,
            })?;
        let begin = format!("@@BEGIN {token}\n");
        let done = format!("\n@@DONE {token} ");
        let what = format!("command {command:?}");
        let result = self.wait_until(&what, timeout, |data| {
            let start = find(data, begin.as_bytes(), 0)? + begin.len();
            let end = find(data, done.as_bytes(), start)?;
            let status_start = end + done.len();
            let status_end =
                status_start + data[status_start..].iter().position(|&b| b == b'\n')?;
            let status = std::str::from_utf8(&data[status_start..status_end])
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(-1);
            let output = String::from_utf8_lossy(&data[start..end]).into_owned();
            Some((status_end + 1, CommandOutput { status, output }))
        });
        match result {
            Err(ConsoleError::Timeout { waited, .. })
                if find(&self.shared.lock().data, begin.as_bytes(), 0).is_none() =>
            {
                Err(ConsoleError::NotStarted {
                    socket: self.socket.clone(),
                    command: command.to_owned(),
                    waited,
                })
            }
            other => other,
        }
    }

    /// Waits until `parse` finds what it looks for in the unconsumed console bytes; it returns
    /// how many bytes to consume and the result.
    fn wait_until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut parse: impl FnMut(&[u8]) -> Option<(usize, T)>,
    ) -> Result<T, ConsoleError> {
        let deadline = Instant::now() + timeout;
        let mut received = self.shared.lock();
        loop {
            if let Some((consumed, result)) = parse(&received.data) {
                received.data.drain(..consumed);
                return Ok(result);
            }
            if received.closed {
                return Err(ConsoleError::Closed {
                    socket: self.socket.clone(),
                    what: what.to_owned(),
                });
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(ConsoleError::Timeout {
                    socket: self.socket.clone(),
                    what: what.to_owned(),
                    waited: timeout,
                });
            }
            received = self
                .shared
                .arrived
                .wait_timeout(received, remaining)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Received> {
        self.received.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        // Ends the reader thread's blocking read.
        let _ = self.writer.shutdown(Shutdown::Both);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// Retries `connect` until it succeeds or `timeout` has passed (QEMU creates its console
/// shortly after it starts).
fn retry<T>(
    socket: &Path,
    timeout: Duration,
    mut connect: impl FnMut() -> std::io::Result<T>,
) -> Result<T, ConsoleError> {
    let started = Instant::now();
    loop {
        match connect() {
            Ok(stream) => return Ok(stream),
            Err(source) if started.elapsed() >= timeout => {
                return Err(ConsoleError::Connect {
                    socket: socket.to_owned(),
                    waited: started.elapsed(),
                    source,
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The byte stream a console runs over.
#[derive(Debug)]
enum Stream {
    /// QEMU's console socket on this machine.
    Unix(UnixStream),
    /// A nested VM's console, served on TCP inside a host.
    Tcp(std::net::TcpStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => (&*s).flush(),
            Stream::Tcp(s) => (&*s).flush(),
        }
    }
}

/// The position of `needle` in `haystack` at or after `from`.
fn find(haystack: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    haystack
        .get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixListener;

    /// A stand-in guest: busybox sh running the image's own console loop, its stdin and stdout
    /// on a socket, so the protocol is checked against the real shell and the real loop.
    fn shell_console() -> (Console, std::process::Child, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("con.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let console = Console::connect(&path, Duration::from_secs(5)).unwrap();
        let (guest_side, _) = listener.accept().unwrap();
        let child = std::process::Command::new("busybox")
            .args(["sh", "-c", &rdmamig_images::init::console_script()])
            .stdin(OwnedFd::from(guest_side.try_clone().unwrap()))
            .stdout(OwnedFd::from(guest_side.try_clone().unwrap()))
            .stderr(OwnedFd::from(guest_side))
            .spawn()
            .unwrap();
        (console, child, dir)
    }

    /// A command nothing reads is reported as never started (what `Guest::run` sends again),
    /// while a started one that runs past its deadline stays a time-out.
    #[test]
    fn a_command_the_guest_never_reads_is_not_started_one_that_runs_long_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let console = Console::connect(&path, Duration::from_secs(5)).unwrap();
        let (_silent_guest, _) = listener.accept().unwrap();
        assert!(matches!(
            console.run("echo hi", Duration::from_millis(300)),
            Err(ConsoleError::NotStarted { .. })
        ));
        let (console, mut child, _dir) = shell_console();
        assert!(matches!(
            console.run("sleep 5", Duration::from_millis(500)),
            Err(ConsoleError::Timeout { .. })
        ));
        drop(console);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn commands_yield_exact_output_and_status() {
        let (console, mut child, _dir) = shell_console();
        let t = Duration::from_secs(10);
        let out = console.run("echo hello; echo err >&2", t).unwrap();
        assert_eq!(
            out,
            CommandOutput {
                status: 0,
                output: "hello\nerr\n".into()
            }
        );
        let out = console.run("printf 'no newline'; exit 3", t).unwrap();
        assert_eq!(
            out,
            CommandOutput {
                status: 3,
                output: "no newline".into()
            }
        );
        let out = console.run("echo 'single' \"double\" $((1+2))", t).unwrap();
        assert_eq!(out.output, "single double 3\n");
        // A syntax error stays inside the command; the loop goes on.
        let out = console.run("if then", t).unwrap();
        assert_eq!(out.status, 2);
        // A background job that keeps the console open does not disturb the next command.
        console.run("sleep 30 >/dev/null 2>&1 &", t).unwrap();
        assert_eq!(console.run("echo next", t).unwrap().output, "next\n");
        // A command cannot read the lines that follow it.
        assert_eq!(console.run("cat", t).unwrap().output, "");
        assert_eq!(console.run("echo still", t).unwrap().output, "still\n");
        drop(console);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn multiline_commands_are_refused() {
        let (console, mut child, _dir) = shell_console();
        assert!(matches!(
            console.run("echo a\necho b", Duration::from_secs(1)),
            Err(ConsoleError::Multiline { .. })
        ));
        drop(console);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn markers_are_found_in_later_output_and_timeouts_reported() {
        let (console, mut child, _dir) = shell_console();
        let t = Duration::from_secs(10);
        console
            .run("(sleep 0.2; echo noise; echo MARK-B detail) &", t)
            .unwrap();
        let (which, line) = console.wait_for_marker(&["MARK-A", "MARK-B"], t).unwrap();
        assert_eq!((which, line.as_str()), (1, "MARK-B detail"));
        assert!(matches!(
            console.wait_for_marker(&["MARK-"], Duration::from_millis(200)),
            Err(ConsoleError::Timeout { .. })
        ));
        drop(console);
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
