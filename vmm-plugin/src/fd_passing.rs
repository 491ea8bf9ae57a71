//! A UNIX stream whose first write carries file descriptors (SCM_RIGHTS).
//!
//! Cloud Hypervisor takes file descriptors with some API requests (`vm.receive-migration`'s
//! `vfio_fds` and `iommufd_fd`, on its main branch after v53): they travel as ancillary data
//! beside the request's bytes on the API socket, and it gives them, in the order sent, to
//! the descriptor numbers the body names. hyper writes the request; this wrapper puts the
//! descriptors on its first write, which the kernel delivers with those bytes (the receiver
//! duplicates them: the sender keeps its own).

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixStream;

/// A connected API socket with descriptors still to send.
#[derive(Debug)]
pub struct FdPassingStream {
    stream: UnixStream,
    /// Sent with the next write, then cleared.
    fds: Vec<Arc<OwnedFd>>,
}

impl FdPassingStream {
    /// Wraps `stream`; `fds` go with the first write (none: a plain stream).
    pub fn new(stream: UnixStream, fds: Vec<Arc<OwnedFd>>) -> FdPassingStream {
        FdPassingStream { stream, fds }
    }
}

impl AsyncRead for FdPassingStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for FdPassingStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.fds.is_empty() || buf.is_empty() {
            return Pin::new(&mut this.stream).poll_write(cx, buf);
        }
        let socket = this.stream.as_raw_fd();
        let fds: Vec<RawFd> = this.fds.iter().map(|fd| fd.as_raw_fd()).collect();
        loop {
            ready!(this.stream.poll_write_ready(cx))?;
            let sent = this.stream.try_io(Interest::WRITABLE, || {
                sendmsg::<()>(
                    socket,
                    &[IoSlice::new(buf)],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(io::Error::from)
            });
            match sent {
                Ok(written) => {
                    this.fds.clear();
                    return Poll::Ready(Ok(written));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{recvmsg, ControlMessageOwned};
    use std::io::IoSliceMut;
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::MetadataExt;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn the_descriptors_arrive_with_the_first_bytes_and_only_once() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(dir.path().join("device")).unwrap();
        let inode = file.metadata().unwrap().ino();
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut stream = FdPassingStream::new(
            UnixStream::from_std(ours).unwrap(),
            vec![Arc::new(OwnedFd::from(file))],
        );
        stream.write_all(b"PUT /").await.unwrap();
        stream.write_all(b"api").await.unwrap();
        drop(stream);

        let mut received = Vec::new();
        let mut bytes = Vec::new();
        loop {
            let mut buf = [0u8; 64];
            let mut space = nix::cmsg_space!([RawFd; 4]);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let message = recvmsg::<()>(
                theirs.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::empty(),
            )
            .unwrap();
            let n = message.bytes;
            for cmsg in message.cmsgs().unwrap() {
                if let ControlMessageOwned::ScmRights(fds) = cmsg {
                    received.extend(fds);
                }
            }
            if n == 0 {
                break;
            }
            bytes.extend_from_slice(&buf[..n]);
        }
        assert_eq!(bytes, b"PUT /api");
        assert_eq!(received.len(), 1, "sent once, with the first write");
        // SAFETY: the descriptor was just received by this test and is owned by nothing else.
        let arrived = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(received[0]) });
        assert_eq!(arrived.metadata().unwrap().ino(), inode, "the same file");
    }
}
