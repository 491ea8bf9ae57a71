//! rdmamig inside the VM, beside the connection library (`rdmamig-conn`) that applications
//! link:
//!
//! - [`agent`]: the agent daemon: serves the host over virtio-serial or vsock and drives the
//!   processes that registered through the library;
//! - [`traffic`]: the traffic tool's logic: numbered messages, delivery gaps, loss and
//!   duplicate accounting.

pub mod agent;
pub mod traffic;
