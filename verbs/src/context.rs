//! librdmacm's cache of open device contexts, and the device-list refresh that releases the
//! context of a device that has vanished.
//!
//! librdmacm keeps one context open per device, shared by every id of the process on it,
//! and an open context blocks the device's hot-unplug. The PDs allocated on a context are
//! counted here ([`context_in_use`], called by the `ib` wrappers) so that a
//! refresh never releases a context that still has objects on it.

use std::sync::Mutex;

use rdma_sys::*;

use crate::error::VerbsError;

/// The descriptors of one device context librdmacm opened (and caches).
#[derive(Debug, Clone, PartialEq, Eq)]
struct CachedContext {
    cmd_fd: i32,
    async_fd: i32,
    /// `uverbsN`: the character device behind `cmd_fd`.
    uverbs: String,
}

fn cached_contexts() -> &'static Mutex<Vec<CachedContext>> {
    static CONTEXTS: std::sync::OnceLock<Mutex<Vec<CachedContext>>> = std::sync::OnceLock::new();
    CONTEXTS.get_or_init(|| Mutex::new(Vec::new()))
}

/// PDs alive per context (keyed by its command descriptor). A context is shared by every id
/// of the process on the device, so one thread's refresh (a listener that lost its device)
/// must not release a context another thread's connection still has objects on: those
/// objects' destruction would then fail and leave the completion channel's descriptor open,
/// which holds the device and blocks its unplug.
fn live_pds() -> &'static Mutex<std::collections::HashMap<i32, usize>> {
    static LIVE: std::sync::OnceLock<Mutex<std::collections::HashMap<i32, usize>>> =
        std::sync::OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(std::collections::HashMap::new()))
}

/// Counts a PD allocated (`true`) or freed (`false`) on the context with `cmd_fd`.
pub(crate) fn context_in_use(cmd_fd: i32, allocated: bool) {
    let mut live = live_pds().lock().unwrap_or_else(|p| p.into_inner());
    let n = live.entry(cmd_fd).or_default();
    if allocated {
        *n += 1;
    } else {
        *n = n.saturating_sub(1);
        if *n == 0 {
            live.remove(&cmd_fd);
        }
    }
}

fn context_busy(cmd_fd: i32) -> bool {
    live_pds()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(&cmd_fd)
}

/// Remembers the descriptors of the device context `ctx` (librdmacm's, shared by all ids on
/// the device) so [`refresh_device_list`] can release them once the device has vanished;
/// returns its command descriptor.
pub(crate) fn remember_context(ctx: *mut ibv_context) -> i32 {
    if ctx.is_null() {
        return -1;
    }
    // SAFETY: `ctx` is a live context (the caller holds an id bound to it); its `device`
    // pointer and the NUL-terminated `dev_name` array inside stay valid while it is open.
    let entry = unsafe {
        let c = &*ctx;
        let dev = &*c.device;
        CachedContext {
            cmd_fd: c.cmd_fd,
            async_fd: c.async_fd,
            uverbs: std::ffi::CStr::from_ptr(dev.dev_name.as_ptr())
                .to_string_lossy()
                .into_owned(),
        }
    };
    let cmd_fd = entry.cmd_fd;
    let mut list = cached_contexts().lock().unwrap_or_else(|p| p.into_inner());
    if !list.contains(&entry) {
        list.push(entry);
    }
    cmd_fd
}

/// Whether the node of a device whose context is cached is gone: a refresh has a context
/// to release (or will have, once its owner released its objects).
pub(crate) fn eviction_pending() -> bool {
    cached_contexts()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|c| !uverbs_present(&c.uverbs))
}

fn uverbs_present(uverbs: &str) -> bool {
    std::path::Path::new("/sys/class/infiniband_verbs")
        .join(uverbs)
        .exists()
}

/// Refreshes librdmacm's device list (rdma_get_devices + rdma_free_devices) and releases the
/// cached context of every device that has vanished.
///
/// librdmacm keeps an open context per device even after its last id is destroyed, and an
/// open context blocks the device's hot-unplug (the kernel waits for every uverbs file to be
/// closed). librdmacm 44 drops a vanished device from its list during this refresh only if
/// at least one other device remains: with the last (often the only) device gone,
/// `sync_devices_list` returns early and the context stays open forever. So, once the
/// device's `uverbsN` node is gone from sysfs (the first step of its removal), the context's
/// command and async-event descriptors are replaced by /dev/null (dup2): the kernel's files
/// are released, the unplug completes, and librdmacm's later close of that context closes
/// the /dev/null duplicates. A context on which this process still has a PD (and so
/// possibly a QP, CQ or MRs) is left alone until a later refresh, after its owner released
/// them. Returns the number of devices present.
///
/// The process's device watcher (started with the first context) calls this whenever the
/// kernel announces a device change; a connection calls it after releasing its objects.
pub fn refresh_device_list() -> Result<usize, VerbsError> {
    let mut n: i32 = 0;
    // SAFETY: `n` is an out-parameter; the result is checked for NULL.
    let list = unsafe { rdma_get_devices(&mut n) };
    if !list.is_null() {
        // SAFETY: `list` came from rdma_get_devices and is freed exactly once.
        unsafe { rdma_free_devices(list) };
    }
    evict_vanished_contexts();
    Ok(n.max(0) as usize)
}

fn evict_vanished_contexts() {
    let mut list = cached_contexts().lock().unwrap_or_else(|p| p.into_inner());
    list.retain(|c| {
        if uverbs_present(&c.uverbs) || context_busy(c.cmd_fd) {
            return true;
        }
        let link = |fd: i32| std::fs::read_link(format!("/proc/self/fd/{fd}")).ok();
        // A removed device node reads as "/dev/infiniband/uverbsN (deleted)".
        let node = format!("/dev/infiniband/{}", c.uverbs);
        let cmd_ok = link(c.cmd_fd).is_some_and(|p| {
            let p = p.to_string_lossy();
            p == node || p == format!("{node} (deleted)")
        });
        let async_ok = link(c.async_fd).is_some_and(|p| p.to_string_lossy().starts_with("anon_inode:"));
        let Ok(null) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") else {
            return true;
        };
        use std::os::fd::AsRawFd;
        for (fd, ok) in [(c.cmd_fd, cmd_ok), (c.async_fd, async_ok)] {
            if ok {
                match nix::unistd::dup2(null.as_raw_fd(), fd) {
                    Ok(_) => tracing::info!(fd, uverbs = %c.uverbs, "released the cached context of a vanished RDMA device"),
                    Err(e) => tracing::warn!(fd, error = %e, "dup2 over a vanished device's descriptor failed"),
                }
            }
        }
        false
    });
}
