//! The rdmamig host migrator: moves a VM whose RDMA NIC is a passthrough device to another
//! VMM process while its RDMA connections survive.
//!
//! Layers, from the inside out:
//! - [`machine`]: the move as one state machine (phases and the one transition function);
//! - [`timeline`]: start/end timestamps and durations of every phase;
//! - [`plan`]: what a move is asked to do (endpoints, devices, strategy, deadlines);
//! - [`durable`]: writes that are whole or absent after a crash;
//! - [`journal`]: the crash-safe, fsynced record of every move's steps;
//! - [`config`]: the daemon's config file (`[pool]`, `[peer]`, `[moves]`);
//! - [`pool`]: the host's passthrough functions (their states persist);
//! - [`sriov`]: the VFs the pool config asks for, created and bound to vfio-pci at start;
//! - [`vf_mac`]: a VF's MAC, set through its PF (rtnetlink) before the VF is plugged;
//! - [`vfio`]: SR-IOV preparation through sysfs and the VFIO device (open, reset, DMA,
//!   migration support);
//! - [`strategy`]: which strategy a move runs (`auto` from the source VMM's migration
//!   blockers, the function's driver in sysfs and the destination's device; `hot` refused
//!   for a device that cannot move with the VM);
//! - [`agent`]: the host side of the guest-agent protocol, checking untrusted answers;
//! - [`unmanaged`]: the guest's RDMA programs without the library, and what a move did to
//!   them;
//! - [`destination`]: the destination end of a move behind one trait (this host, or another
//!   migrator through [`peer`]);
//! - [`report`], [`step`], [`backends`]: the vocabulary the phases share (the report and
//!   events, the step error, how VMMs and agents are reached);
//! - [`moving`]: runs a plan phase by phase (one module per phase) against the VMMs
//!   (rdmamig-vmm) and the agent, takes the forced paths, rolls back, and recovers a move
//!   from its journal;
//! - [`channel`]: framed messages over a byte stream (the API's and the peers');
//! - [`api`]: the messages between the `rdmamig` CLI and the daemon;
//! - [`daemon`]: the daemon that runs moves for local clients;
//! - [`retention`]: pruning the journals and reports of finished moves;
//! - [`peer`]: the destination's duties between migrators, over mutual TLS (both sides);
//! - [`metrics`]: the daemon's Prometheus metrics;
//! - [`cli`]: how the CLI shows progress and the final timeline;
//! - [`ch_remote`]: ch-remote's `key=value` migration syntax, which `rdmamig-vmm` takes;
//! - [`svg`]: the per-move SVG timeline.

pub mod agent;
pub mod api;
pub mod backends;
pub mod ch_remote;
pub mod channel;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod destination;
pub mod durable;
#[cfg(test)]
mod fakes;
pub mod flags;
pub mod journal;
pub mod listen;
pub mod machine;
pub mod metrics;
pub mod moving;
pub mod peer;
pub mod plan;
pub mod pool;
pub mod report;
pub mod retention;
pub mod sriov;
pub mod step;
pub mod strategy;
pub mod svg;
pub mod timeline;
pub mod unmanaged;
pub mod vf_mac;
pub mod vfio;
