//! Descriptors of verbs objects: the promise tokio's reactor needs of what it watches
//! ([`OwnsFd`], [`watch`]), and the non-blocking and poll helpers the cm and ib wrappers share.

use std::io;
use std::os::fd::AsRawFd;

use tokio::io::unix::AsyncFd;

use crate::error::VerbsError;

/// A value that owns its descriptor: what tokio's reactor needs of what it watches.
///
/// # Safety
///
/// `as_raw_fd` must return the same open descriptor, referring to the same open file
/// description, for the value's whole lifetime.
pub unsafe trait OwnsFd: AsRawFd {}

/// Watches `inner`'s descriptor with the current runtime's reactor (called within a runtime
/// with IO enabled). The watch ends, and the descriptor is deregistered, before `inner` is
/// dropped with the returned [`AsyncFd`].
pub fn watch<T: OwnsFd>(inner: T) -> io::Result<AsyncFd<T>> {
    // SAFETY: `OwnsFd` promises what `register` requires: the descriptor stays open and the
    // same while the AsyncFd owns `inner`.
    unsafe { AsyncFd::register(inner) }.map_err(|e| e.into_parts().1)
}

/// Sets O_NONBLOCK on a descriptor owned by a verbs object.
pub(crate) fn set_nonblocking(
    fd: std::os::fd::BorrowedFd<'_>,
    what: &'static str,
) -> Result<(), VerbsError> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let map = |e: nix::Error| VerbsError::SetNonBlocking {
        what,
        source: io::Error::from_raw_os_error(e as i32),
    };
    let flags = fcntl(fd.as_raw_fd(), FcntlArg::F_GETFL).map_err(map)?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(flags)).map_err(map)?;
    Ok(())
}

/// Waits until `fd` is readable or `timeout` passes. Returns whether it is readable.
pub(crate) fn wait_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match poll(
        &mut fds,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(0) => Ok(false),
        Ok(_) => Ok(true),
        Err(nix::Error::EINTR) => Ok(false),
        Err(e) => Err(io::Error::from_raw_os_error(e as i32)),
    }
}
