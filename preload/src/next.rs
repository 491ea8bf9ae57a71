//! The next definition of each interposed symbol: libibverbs' or librdmacm's own, found
//! with `dlsym(RTLD_NEXT, ...)` the first time it is needed and kept.
//!
//! This library must never call an interposed function by its plain name: the dynamic
//! linker would bind the call to this library's own definition. Every call to libibverbs
//! and librdmacm goes through here.

use std::ffi::CStr;
use std::sync::OnceLock;

use std::os::raw::{c_int, c_uint, c_void};

use rdma_sys::{
    _compat_ibv_port_attr, ibv_ah, ibv_ah_attr, ibv_async_event, ibv_comp_channel, ibv_context,
    ibv_cq, ibv_device, ibv_device_attr, ibv_ece, ibv_gid, ibv_mr, ibv_pd, ibv_qp, ibv_qp_attr,
    ibv_qp_init_attr, ibv_srq, ibv_srq_init_attr, rdma_cm_event, rdma_cm_id, rdma_event_channel,
    rdma_port_space,
};

/// The address of the next definition of `name` (NUL-terminated), or a clear abort: a
/// libibverbs or librdmacm without a function the program was linked against is a broken
/// installation, and carrying on would call through a null pointer.
fn resolve(name: &'static CStr) -> usize {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT searches the objects loaded after this one.
    let address = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if address.is_null() {
        eprintln!(
            "rdmamig-preload: no library after this one defines {} (are libibverbs.so.1 and librdmacm.so.1 loaded?)",
            name.to_string_lossy()
        );
        std::process::abort();
    }
    address as usize
}

/// Declares `fn name() -> unsafe extern "C" fn(args) -> ret`, the next definition of the
/// verb `name` with the C signature verbs.h gives it.
macro_rules! next {
    ($(fn $name:ident($($arg:ty),*) -> $ret:ty;)*) => {$(
        #[doc = concat!("libibverbs' or librdmacm's own `", stringify!($name), "`.")]
        pub fn $name() -> unsafe extern "C" fn($($arg),*) -> $ret {
            static ADDRESS: OnceLock<usize> = OnceLock::new();
            let name = match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                Ok(name) => name,
                Err(_) => unreachable!("the name ends with its only NUL"),
            };
            let address = *ADDRESS.get_or_init(|| resolve(name));
            // SAFETY: `address` is libibverbs' definition of this very symbol, whose C
            // signature is the one declared here (verbs.h), and it stays loaded.
            unsafe {
                std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(address)
            }
        }
    )*};
}

next! {
    fn ibv_open_device(*mut ibv_device) -> *mut ibv_context;
    fn ibv_close_device(*mut ibv_context) -> c_int;
    fn ibv_query_device(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    fn ibv_query_port(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int;
    fn ibv_query_gid(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    fn ibv_query_pkey(*mut ibv_context, u8, c_int, *mut u16) -> c_int;
    fn ibv_create_comp_channel(*mut ibv_context) -> *mut ibv_comp_channel;
    fn ibv_destroy_comp_channel(*mut ibv_comp_channel) -> c_int;
    fn ibv_get_cq_event(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    fn ibv_ack_cq_events(*mut ibv_cq, c_uint) -> ();
    fn ibv_alloc_pd(*mut ibv_context) -> *mut ibv_pd;
    fn ibv_dealloc_pd(*mut ibv_pd) -> c_int;
    fn ibv_reg_mr(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    fn ibv_reg_mr_iova(*mut ibv_pd, *mut c_void, usize, u64, c_int) -> *mut ibv_mr;
    fn ibv_reg_mr_iova2(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr;
    fn ibv_dereg_mr(*mut ibv_mr) -> c_int;
    fn ibv_create_cq(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    fn ibv_destroy_cq(*mut ibv_cq) -> c_int;
    fn ibv_create_qp(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    fn ibv_modify_qp(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    fn ibv_query_qp(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    fn ibv_destroy_qp(*mut ibv_qp) -> c_int;
    fn ibv_query_ece(*mut ibv_qp, *mut ibv_ece) -> c_int;
    fn ibv_set_ece(*mut ibv_qp, *mut ibv_ece) -> c_int;
    fn ibv_get_async_event(*mut ibv_context, *mut ibv_async_event) -> c_int;
    fn ibv_ack_async_event(*mut ibv_async_event) -> ();
    fn ibv_create_srq(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq;
    fn ibv_create_ah(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah;
    fn ibv_rereg_mr(*mut ibv_mr, c_int, *mut ibv_pd, *mut c_void, usize, c_int) -> c_int;
    fn ibv_resize_cq(*mut ibv_cq, c_int) -> c_int;
    fn ibv_qp_to_qp_ex(*mut ibv_qp) -> *mut c_void;
    fn ibv_attach_mcast(*mut ibv_qp, *const ibv_gid, u16) -> c_int;
}

next! {
    fn rdma_create_event_channel() -> *mut rdma_event_channel;
    fn rdma_destroy_event_channel(*mut rdma_event_channel) -> ();
    fn rdma_create_id(*mut rdma_event_channel, *mut *mut rdma_cm_id, *mut c_void, rdma_port_space::Type) -> c_int;
    fn rdma_migrate_id(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int;
    fn rdma_destroy_id(*mut rdma_cm_id) -> c_int;
    fn rdma_listen(*mut rdma_cm_id, c_int) -> c_int;
    fn rdma_disconnect(*mut rdma_cm_id) -> c_int;
    fn rdma_get_cm_event(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int;
    fn rdma_ack_cm_event(*mut rdma_cm_event) -> c_int;
}
