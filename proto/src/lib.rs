//! Message types and framing shared by every rdmamig component.
//!
//! Three channels carry these messages, all with the same framing ([`frame`]):
//! - host migrator <-> guest agent ([`agent`]), over virtio-serial or hybrid vsock;
//!   the guest is untrusted, so the host checks every answer against what it asked;
//! - guest agent <-> applications using the connection library ([`app`]), over a UNIX
//!   socket inside the guest;
//! - a preloaded program's library <-> its peer's, through the peer's agent ([`preload`]),
//!   over TCP between guests.
//!
//! The layering follows mini-redis: [`frame`] turns bytes into frames (check, then parse,
//! with an explicit "incomplete" outcome) and the typed messages ride inside a frame as JSON;
//! [`message`] carries a message larger than a frame (a move's per-connection lists) as a
//! run of frames.
//!
//! Beside the messages, the two helpers every part shares: [`text`] (error chains, guest
//! text made printable) and [`clock`] (milliseconds).

pub mod agent;
pub mod app;
pub mod clock;
pub mod frame;
pub mod message;
pub mod preload;
pub mod text;

pub use frame::{read_message, Frame, FrameBuffer, FrameError, ReadError, MAX_FRAME_LEN};

/// Version of the message schema. Carried in every frame header; a peer speaking another
/// version is refused with [`FrameError::UnsupportedVersion`].
pub const PROTOCOL_VERSION: u8 = 1;

/// Identifier of one migratable connection, unique within its two endpoints.
///
/// Chosen at random by the connecting side; printed as 16 hex digits.
pub type ConnectionId = u64;
