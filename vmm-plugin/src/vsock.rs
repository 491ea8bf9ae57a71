//! The host end of a hybrid vsock: Cloud Hypervisor's `--vsock socket=PATH` (and
//! vhost-device-vsock's `--uds-path`) expose the guest's AF_VSOCK ports on one UNIX socket.
//!
//! The host connects to PATH, writes `CONNECT <port>\n` and reads one line back: `OK <host
//! port>\n` means the guest accepted and the byte stream starts right after the newline.
//! Anything else (the VMM closing the socket because nothing listens on that port, a line
//! that is not `OK <number>`, silence) is an error that says which, because the caller will
//! otherwise only see "the agent does not answer". The reply is read byte by byte so that no
//! byte of the stream that follows is swallowed into a buffer.

use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Longest reply line accepted (`OK 4294967295\n` is 14 bytes).
const MAX_REPLY: usize = 64;

/// Why a hybrid vsock connection could not be opened.
#[derive(Debug, Error)]
pub enum VsockError {
    /// The VMM's vsock socket cannot be reached.
    #[error("cannot connect to the vsock socket {socket}")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// Writing the CONNECT line or reading the reply failed.
    #[error("CONNECT {port} on {socket} failed")]
    Io {
        /// The socket.
        socket: PathBuf,
        /// The guest port.
        port: u32,
        /// What the read or write said.
        #[source]
        source: std::io::Error,
    },
    /// The VMM closed the connection without a reply: nothing in the guest listens on the
    /// port (or the guest has no vsock device).
    #[error(
        "CONNECT {port} on {socket}: refused (the VMM closed the connection; \
         nothing in the guest listens on port {port}?)"
    )]
    Refused {
        /// The socket.
        socket: PathBuf,
        /// The guest port.
        port: u32,
    },
    /// No complete reply line arrived in time.
    #[error("CONNECT {port} on {socket}: no reply within {deadline_ms} ms (got {got:?} so far)")]
    TimedOut {
        /// The socket.
        socket: PathBuf,
        /// The guest port.
        port: u32,
        /// The deadline.
        deadline_ms: u64,
        /// The bytes read before the deadline.
        got: String,
    },
    /// The reply was not `OK <port>`.
    #[error("CONNECT {port} on {socket}: unexpected reply {reply:?} (expected \"OK <port>\")")]
    BadReply {
        /// The socket.
        socket: PathBuf,
        /// The guest port.
        port: u32,
        /// What came back (lossy UTF-8, at most 64 bytes).
        reply: String,
    },
}

/// Connects to guest `port` through the hybrid vsock socket at `socket`; the whole handshake
/// (connect, CONNECT, reply) must finish within `deadline`. Returns the stream, positioned
/// at the first byte after the `OK` line, and the host-side port the VMM reported.
pub async fn connect(
    socket: &Path,
    port: u32,
    deadline: Duration,
) -> Result<(UnixStream, u32), VsockError> {
    let mut got = Vec::new();
    match tokio::time::timeout(deadline, handshake(socket, port, &mut got)).await {
        Ok(result) => result,
        Err(_) => Err(VsockError::TimedOut {
            socket: socket.into(),
            port,
            deadline_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
            got: String::from_utf8_lossy(&got).into_owned(),
        }),
    }
}

async fn handshake(
    socket: &Path,
    port: u32,
    got: &mut Vec<u8>,
) -> Result<(UnixStream, u32), VsockError> {
    let mut stream = UnixStream::connect(socket)
        .await
        .map_err(|source| VsockError::Connect {
            socket: socket.into(),
            source,
        })?;
    let io = |source| VsockError::Io {
        socket: socket.into(),
        port,
        source,
    };
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(io)?;
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte).await {
            Ok(0) if got.is_empty() => {
                return Err(VsockError::Refused {
                    socket: socket.into(),
                    port,
                })
            }
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => got.push(byte[0]),
            // The VMM may reset rather than close when nothing listens.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && got.is_empty() => {
                return Err(VsockError::Refused {
                    socket: socket.into(),
                    port,
                })
            }
            Err(e) => return Err(io(e)),
        }
        if got.len() > MAX_REPLY {
            break;
        }
    }
    match parse_reply(got) {
        Some(host_port) => Ok((stream, host_port)),
        None => Err(VsockError::BadReply {
            socket: socket.into(),
            port,
            reply: String::from_utf8_lossy(&got[..got.len().min(MAX_REPLY)]).into_owned(),
        }),
    }
}

/// Reads `OK <number>` (the line without its newline).
fn parse_reply(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line).ok()?;
    let number = text.strip_prefix("OK ")?;
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    number.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A hybrid vsock socket whose VMM reads the CONNECT line and then does `then`.
    async fn fake(
        then: &'static [u8],
        close: bool,
    ) -> (tempfile::TempDir, tokio::task::JoinHandle<Vec<u8>>) {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("v.sock")).unwrap();
        let task = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut line = Vec::new();
            let mut byte = [0u8; 1];
            while stream.read(&mut byte).await.unwrap() == 1 && byte[0] != b'\n' {
                line.push(byte[0]);
            }
            stream.write_all(then).await.unwrap();
            if !close {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            line
        });
        (dir, task)
    }

    #[tokio::test]
    async fn ok_then_the_stream_is_untouched() {
        let (dir, vmm) = fake(b"OK 1073741824\nhello", false).await;
        let (mut stream, host_port) =
            connect(&dir.path().join("v.sock"), 7077, Duration::from_secs(2))
                .await
                .unwrap();
        assert_eq!(host_port, 1_073_741_824);
        let mut hello = [0u8; 5];
        stream.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello, b"hello");
        vmm.abort();
    }

    #[tokio::test]
    async fn the_vmm_sees_the_connect_line() {
        let (dir, vmm) = fake(b"OK 5\n", true).await;
        connect(&dir.path().join("v.sock"), 52, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(vmm.await.unwrap(), b"CONNECT 52");
    }

    #[tokio::test]
    async fn a_silent_vmm_hits_the_deadline() {
        let (dir, vmm) = fake(b"OK 1", false).await;
        let start = std::time::Instant::now();
        let err = connect(&dir.path().join("v.sock"), 7077, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(
            matches!(&err, VsockError::TimedOut { deadline_ms: 300, got, .. } if got == "OK 1"),
            "{err}"
        );
        vmm.abort();
    }

    #[tokio::test]
    async fn garbage_is_a_bad_reply() {
        let (dir, _vmm) = fake(b"HTTP/1.1 400 Bad Request\r\n", true).await;
        let err = connect(&dir.path().join("v.sock"), 7077, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, VsockError::BadReply { reply, .. } if reply.starts_with("HTTP/1.1 400")),
            "{err}"
        );
        // An endless line is cut, not buffered.
        let (dir, _vmm) = fake(&[b'x'; 4096], false).await;
        let err = connect(&dir.path().join("v.sock"), 7077, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, VsockError::BadReply { reply, .. } if reply.len() == MAX_REPLY),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_close_without_reply_is_refused_and_no_socket_is_connect() {
        let (dir, _vmm) = fake(b"", true).await;
        let err = connect(&dir.path().join("v.sock"), 9, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(&err, VsockError::Refused { port: 9, .. }), "{err}");
        let err = connect(&dir.path().join("none.sock"), 9, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(&err, VsockError::Connect { .. }), "{err}");
    }

    #[test]
    fn replies() {
        assert_eq!(parse_reply(b"OK 1073741824"), Some(1_073_741_824));
        assert_eq!(parse_reply(b"OK 5"), Some(5));
        for bad in [
            &b"OK"[..],
            b"OK ",
            b"ok 5",
            b"OK 5 ",
            b"OK -5",
            b"OK +5",
            b"ERR 5",
            b"OK 99999999999",
            b"\xffOK 5",
        ] {
            assert_eq!(parse_reply(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
