//! Safe owning wrappers over librdmacm and libibverbs (rdma-sys).
//!
//! This is the only module of the crate with `unsafe` code. Every object that owns a verbs
//! or rdma_cm resource releases it in `Drop`, and dependencies are held by ownership so the
//! release order is always right:
//! - a [`CmId`] holds its [`EventChannel`] alive; the QP created on it
//!   ([`CmId::create_qp`]) holds its [`ProtectionDomain`] and [`CompletionQueue`] alive, and
//!   is destroyed before the id;
//! - a [`CompletionQueue`] holds its [`CompletionChannel`];
//! - a [`MemoryRegion`] owns its buffer and holds its [`ProtectionDomain`], so the PD is
//!   freed only after its last MR is deregistered.
//!
//! An explicit teardown (quiesce) drops, in this order: QP (via [`CmId::destroy_qp`]), CQ,
//! MRs, PD, cm id, channels. [`refresh_device_list`] then lets librdmacm close the device
//! context it caches for a device that is going away (see docs/architecture.md); the
//! `devices` watcher calls it whenever the kernel announces a device change.
//!
//! The modules form a tree with no import cycle: `error` ([`VerbsError`]) and `fd` are leaves;
//! `inner` holds the raw channel and id handles that both `cm` and `ib` use, `context` the
//! device-context cache and `devices` (on `context`) the thread that refreshes it; `ib`
//! starts that thread with the first PD; `cm` builds on `ib` (a QP needs a PD and a CQ),
//! never the reverse.
//! This root only declares the modules and re-exports their public types.

mod cm;
mod context;
mod devices;
mod error;
mod fd;
mod ib;
mod inner;

pub use cm::{CmEvent, CmEventKind, CmId, EventChannel, IdKey};
pub use cm::{RdmaOp, SendWr};
pub use context::refresh_device_list;
pub use error::VerbsError;
pub use fd::{watch, OwnsFd};
pub use ib::{
    CompletionChannel, CompletionQueue, ExposedMemory, ExposedRegion, MemoryRegion,
    ProtectionDomain, QpCaps, RemoteAccess, WcOpcode, WorkCompletion,
};
