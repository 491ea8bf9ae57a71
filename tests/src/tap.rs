//! A recording tap on a UNIX socket, to keep what really crossed a channel during a test-bed
//! move: the fuzz targets' seeds come from it ([`crate::corpus`]).
//!
//! [`Tap::insert`] moves a listening socket's file aside and listens at its path in its
//! place, so that a client that connects later (the migrator, the `rdmamig` command) goes
//! through the tap without being told. Each connection is forwarded to the moved-aside
//! socket, both ways, byte for byte, and every message (a frame of rdmamig's protocol, or a
//! line of QMP) is recorded once. Dropping the tap puts the socket back.

use std::collections::BTreeSet;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rdmamig_proto::{frame, FrameError};

/// How a channel's bytes divide into messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// rdmamig's frames (the agent channel, the daemon's API).
    Frames,
    /// Newline-ended lines (QMP).
    Lines,
}

/// The messages a tap saw, each once, in byte order.
type Recorded = Arc<Mutex<BTreeSet<Vec<u8>>>>;

/// A tap in place of one listening socket.
pub struct Tap {
    path: PathBuf,
    aside: PathBuf,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    recorded: Recorded,
}

impl Tap {
    /// Puts a tap in place of the socket at `path` (renamed to `<path>.tapped`).
    pub fn insert(path: &Path, split: Split) -> std::io::Result<Tap> {
        let aside = path.with_extension("tapped");
        std::fs::rename(path, &aside)?;
        let listener = match UnixListener::bind(path) {
            Ok(listener) => listener,
            Err(e) => {
                let _ = std::fs::rename(&aside, path);
                return Err(e);
            }
        };
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let recorded = Recorded::default();
        let acceptor = {
            let (stop, recorded, aside) = (stop.clone(), recorded.clone(), aside.clone());
            std::thread::spawn(move || accept(&listener, &aside, split, &stop, &recorded))
        };
        Ok(Tap {
            path: path.to_owned(),
            aside,
            stop,
            acceptor: Some(acceptor),
            recorded,
        })
    }

    /// Every message seen so far, each once.
    pub fn messages(&self) -> Vec<Vec<u8>> {
        self.recorded.lock().unwrap().iter().cloned().collect()
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::rename(&self.aside, &self.path);
    }
}

/// Accepts clients until `stop`, each forwarded to `server` on two threads of its own.
fn accept(
    listener: &UnixListener,
    server: &Path,
    split: Split,
    stop: &AtomicBool,
    recorded: &Recorded,
) {
    while !stop.load(Ordering::Acquire) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(_) => return,
        };
        let Ok(upstream) = UnixStream::connect(server) else {
            continue;
        };
        let _ = client.set_nonblocking(false);
        for (from, to) in [(&client, &upstream), (&upstream, &client)] {
            let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) else {
                continue;
            };
            let recorded = recorded.clone();
            std::thread::spawn(move || forward(from, to, split, &recorded));
        }
    }
}

/// Copies `from` to `to` until either ends, recording each whole message.
fn forward(mut from: UnixStream, mut to: UnixStream, split: Split, recorded: &Recorded) {
    let mut pending = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&chunk[..n]).is_err() {
            break;
        }
        pending.extend_from_slice(&chunk[..n]);
        let used = take_messages(&pending, split, &mut |m| {
            recorded.lock().unwrap().insert(m.to_vec());
        });
        pending.drain(..used);
    }
    if !pending.is_empty() {
        recorded.lock().unwrap().insert(pending);
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Hands each whole message at the start of `buf` to `record`; returns the bytes they took.
/// Bytes that cannot be a frame are kept whole as one message, to the end of `buf`.
fn take_messages(buf: &[u8], split: Split, record: &mut impl FnMut(&[u8])) -> usize {
    let mut used = 0;
    while used < buf.len() {
        let rest = &buf[used..];
        let len = match split {
            Split::Lines => match rest.iter().position(|b| *b == b'\n') {
                Some(end) => end + 1,
                None => break,
            },
            Split::Frames => match frame::check(rest) {
                Ok(len) => len,
                Err(FrameError::Incomplete { .. }) => break,
                Err(_) => rest.len(),
            },
        };
        record(&rest[..len]);
        used += len;
    }
    used
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmamig_proto::Frame;

    fn messages(buf: &[u8], split: Split) -> (Vec<Vec<u8>>, usize) {
        let mut out = Vec::new();
        let used = take_messages(buf, split, &mut |m| out.push(m.to_vec()));
        (out, used)
    }

    #[test]
    fn frames_and_lines_are_cut_where_they_end() {
        let one = Frame::encode(&"one");
        let two = Frame::encode(&"two");
        let mut stream = [one.clone(), two.clone()].concat();
        stream.extend_from_slice(&two[..5]);
        assert_eq!(
            messages(&stream, Split::Frames),
            (vec![one.clone(), two], one.len() * 2)
        );
        assert_eq!(
            messages(b"{\"a\":1}\r\n{\"b\"", Split::Lines),
            (vec![b"{\"a\":1}\r\n".to_vec()], 9)
        );
        assert_eq!(messages(b"not a frame", Split::Frames).1, 11);
    }

    #[test]
    fn a_tap_forwards_both_ways_and_records_each_message_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.sock");
        let server = UnixListener::bind(&path).unwrap();
        let echo = std::thread::spawn(move || {
            let (mut s, _) = server.accept().unwrap();
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).unwrap();
            s.write_all(&buf[..n]).unwrap();
        });
        let tap = Tap::insert(&path, Split::Lines).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        client.write_all(b"hello\n").unwrap();
        let mut back = [0u8; 6];
        client.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"hello\n");
        echo.join().unwrap();
        drop(client);
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while tap.messages().is_empty() && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(tap.messages(), vec![b"hello\n".to_vec()]);
        drop(tap);
        assert!(UnixStream::connect(&path).is_err(), "the server is gone");
        assert!(path.exists(), "the socket was not put back");
    }
}
