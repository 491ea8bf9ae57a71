//! rdmamig inside the VM.
//!
//! - [`verbs`]: the only module with unsafe code: owning wrappers over libibverbs and
//!   librdmacm (rdma-sys) whose `Drop` releases resources in dependency order.
//! - [`conn`]: the migratable connection: a reliable, ordered, exactly-once message stream
//!   over an RC QP that survives a quiesce, a device swap and a resume.
//! - [`plain`]: a plain rdma_cm connection with no quiesce or replay, as applications use
//!   today; the baseline the benchmarks compare against.
//! - [`registry`]: the library's side of the agent socket: registers the process and runs
//!   the agent's quiesce/resume requests on its connections.
//! - [`agent`]: the agent daemon: serves the host over virtio-serial and drives the
//!   registered processes.
//! - [`traffic`]: the traffic tool's logic: numbered messages, delivery gaps, loss and
//!   duplicate accounting.

pub mod agent;
pub mod conn;
pub mod plain;
pub mod registry;
pub mod traffic;
pub mod verbs;
