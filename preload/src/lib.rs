//! `librdmamig_preload.so`: what an unmodified libibverbs program gets instead of the
//! provider's verbs objects when it runs under `rdmamig-run` (LD_PRELOAD).
//!
//! A move replaces the VM's RDMA device: every QP, CQ, MR and PD on it is gone, and the new
//! ones have other numbers and keys. A program that keeps pointers, lkeys, rkeys and QP
//! numbers (and has sent some of them to its peer out of band) can only carry on if what it
//! holds never changes. So the program never holds the provider's objects: it holds virtual
//! ones, made here, that stay while the real ones behind them are rebuilt.
//!
//! How the calls reach this library:
//! - **Exported verbs** (ibv_open_device, ibv_alloc_pd, ibv_reg_mr, ibv_create_cq,
//!   ibv_create_qp, ibv_modify_qp, ...) are interposed by symbol: this library defines them,
//!   LD_PRELOAD puts it first, and each definition calls libibverbs' own ([`next`]) with the
//!   real objects ([`exports`]).
//! - **The data path** (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq) is
//!   inline in verbs.h: the program calls through `context->ops` of the object it holds, so
//!   no symbol is looked up. The virtual context carries this library's own ops table
//!   ([`ops`]), which finds the real object behind the virtual one with a pointer cast (the
//!   public struct is the first field of the virtual one) and calls the provider's op.
//! - **Extended verbs** (ibv_create_cq_ex, ibv_wr_*, ibv_start_poll, ...) are inline too,
//!   and find their ops in the `verbs_context` that precedes an extended context. The
//!   virtual context is not extended, so verbs.h's own inlines fail them with EOPNOTSUPP;
//!   exported verbs this library does not support fail the same way ([`unsupported`]).
//!   Either way the program gets an error at the call, never an object this library does
//!   not know.
//!
//! Objects created on a context this library did not make (one a library below the program
//! opened before the preload, say) pass through untouched ([`objects::Registry`]).
//!
//! How a move carries the program: the library registers with the guest agent ([`link`]),
//! which asks it to quiesce and resume; [`relocate`] pauses every QP with its other end
//! ([`peer`], through that end's agent), releases the device, and rebuilds every object on
//! the new one from what was recorded ([`record`]), with the program's keys translated to
//! the new ones from then on ([`keys`]); a program sleeping on completion events wakes
//! across it ([`events`]). An rdma_cm program's QPs move the same way; the kernel's
//! rdma_cm ids cannot, so the events a move causes are held back and a disconnect after one
//! is this library's ([`cm`]). docs/preload.md lists what is supported.

pub mod cm;
pub mod events;
pub mod exports;
pub mod keys;
pub mod link;
pub mod next;
pub mod objects;
pub mod ops;
pub mod peer;
pub mod record;
pub mod relocate;
pub mod run;
pub mod unsupported;
pub mod wr;
