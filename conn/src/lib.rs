//! The migratable connection: a reliable, ordered, exactly-once message stream over an RC
//! QP set up with rdma_cm, that survives a quiesce, a device swap and a resume.
//!
//! One worker per connection owns every verbs object of it: an async task that awaits its
//! descriptors through tokio (conn/src/worker/), on a runtime of its own thread for a
//! [`Connection`], on the application's runtime for an [`AsyncConnection`]. The
//! [`Connection`] handle (Send + Sync) talks to the worker through shared queues. The
//! protocol (wire header, credits, PAUSE/PAUSE_ACK, HELLO/RESUME private data, replay) is
//! described in docs/architecture.md.
//!
//! Beside the connection: [`registry`], the library's side of the agent socket (it
//! registers the process and runs the agent's quiesce and resume on its connections), and
//! [`plain`], a plain rdma_cm connection with no quiesce or replay, as applications use
//! today: the baseline the benchmarks compare against. The verbs themselves are
//! `rdmamig-verbs`'.
//!
//! ```no_run
//! use rdmamig_conn::{ConnectOptions, Connection, Listener};
//! use std::time::Duration;
//! let opts = ConnectOptions::default();
//! let listener = Listener::bind("10.77.0.1:7471".parse().unwrap(), &opts)?;
//! let conn = listener.accept(Duration::from_secs(30))?;
//! conn.send(b"hello")?;
//! let reply = conn.recv(Duration::from_secs(1))?;
//! # Ok::<(), rdmamig_conn::ConnError>(())
//! ```
//!
//! # One-sided RDMA WRITE and READ
//!
//! A side exposes a buffer under a handle ([`Connection::expose`]); the other takes it once
//! ([`Connection::remote`]) and writes into it or reads from it by handle and offset. The
//! [`RemoteBuffer`] stays valid across any number of moves of either side: the library
//! registers the buffer again on every new device and tells the peer the new address and
//! rkey before any operation is posted on the new QP. Operations are queued and posted in
//! order; those a link took without completing are posted again on the next QP (writing
//! the same bytes to the same place again changes nothing). A message sent after
//! [`Connection::flush_writes`] returned is delivered after the data is in place.
//!
//! The owner of the buffer (here the server) exposes it and reads what arrived once the
//! writer's message says so:
//!
//! ```no_run
//! use rdmamig_conn::{Access, ConnectOptions, Listener};
//! use std::time::Duration;
//! let listener = Listener::bind("10.77.0.1:7471".parse().unwrap(), &ConnectOptions::default())?;
//! let conn = listener.accept(Duration::from_secs(30))?;
//! let inbox = conn.expose(Some(7), 1 << 20, Access::ReadWrite)?;
//! if let Some(note) = conn.recv(Duration::from_secs(10))? {
//!     let len = u32::from_be_bytes(note[..4].try_into().unwrap()) as usize;
//!     let mut data = vec![0u8; len];
//!     inbox.read(0, &mut data)?;
//!     println!("peer wrote {} bytes", data.len());
//! }
//! # Ok::<(), rdmamig_conn::ConnError>(())
//! ```
//!
//! The writer takes the handle once, before any move, and keeps using it:
//!
//! ```no_run
//! use rdmamig_conn::{ConnectOptions, Connection};
//! use std::time::Duration;
//! let conn = Connection::connect("10.77.0.1:7471".parse().unwrap(), &ConnectOptions::default())?;
//! let inbox = conn.remote(7, Duration::from_secs(10))?; // waits for the peer's map
//! let data = vec![0xab; 64 * 1024];
//! conn.write(&inbox, 0, &data)?; // queued; split into max_message-sized WRITEs
//! conn.flush_writes(Duration::from_secs(30))?; // completed: the data is in place
//! conn.send(&(data.len() as u32).to_be_bytes())?; // delivered after the data
//! let back = conn.read(&inbox, 0, 4096, Duration::from_secs(30))?; // RDMA READ
//! assert_eq!(back, data[..4096]);
//! # Ok::<(), rdmamig_conn::ConnError>(())
//! ```
//!
//! Errors: [`ConnError::UnknownHandle`] (the peer exposed nothing under that handle within
//! the wait), [`ConnError::OutOfBounds`], [`ConnError::NotPermitted`] (the peer did not
//! allow that operation), [`ConnError::HandleInUse`], [`ConnError::OneSidedTimedOut`]
//! (naming `write`, `flush_writes` or `read`), and the connection's own errors. The same
//! operations have async forms on [`AsyncConnection`].

//!
//! # Layout
//!
//! The modules form a tree with no import cycle; this root only declares them and re-exports
//! the public API. The leaves: [`wire`] (the codecs), `options`, `error`, `control`, `failure`,
//! `credits`, `sendq`, `reply`, [`registry`]. `shared` is what a handle and its worker share;
//! `worker` runs the connection on it; `connection`, `listener` and `asynchronous` are the
//! application's handles; `probe` and [`plain`] stand beside them.

mod asynchronous;
mod bridge;
mod connection;
mod control;
mod credits;
mod error;
mod failure;
mod listener;
mod onesided;
mod options;
pub mod plain;
mod probe;
pub mod registry;
mod reply;
mod sendq;
mod shared;
pub mod wire;
pub(crate) mod worker;

/// Entry points for the fuzz targets (`fuzz/`) into decoders that are otherwise private;
/// only in fuzzing builds (cargo-fuzz passes `--cfg fuzzing`).
#[cfg(fuzzing)]
pub mod fuzzing {
    use crate::bridge::{take_frames, FrameError};
    use crate::wire::Header;

    /// Splits bytes received on a bridge into frames as a bridge does, handing each to
    /// `on_frame`; returns the bytes the whole frames took.
    pub fn bridge_frames(
        received: &[u8],
        max_payload: usize,
        mut on_frame: impl FnMut(Header, &[u8]) -> Result<(), FrameError>,
    ) -> Result<usize, FrameError> {
        take_frames(received, max_payload, &mut on_frame)
    }
}

pub use asynchronous::{AsyncConnection, AsyncListener};
pub use bridge::{BridgeError, FrameError};
pub use connection::Connection;
pub use control::ControlError;
pub use error::ConnError;
pub use failure::{Failure, LinkEvent};
pub use listener::Listener;
pub use onesided::{Access, Exposed, RemoteBuffer};
pub use options::ConnectOptions;
pub use probe::{probe_bridge, probe_resume, probe_slow_handshake, ProbeAnswer};
pub use shared::ConnStats;
pub use wire::RejectReason;

/// An error and its causes on one line (`a: b: c`), as tools print it.
pub use rdmamig_proto::text::error_chain;
