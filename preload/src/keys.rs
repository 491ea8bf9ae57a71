//! The program's memory keys and the real ones behind them.
//!
//! Until the first move every key the program holds is the provider's, and nothing is
//! translated. A move registers every MR again on the new device, with new keys; from then
//! on each lkey in a work request is translated on its way to the provider, and the rkeys
//! go to the peer's library ([`rdmamig_proto::preload::PeerRequest::Reconnect`]), which
//! translates them in its program's RDMA requests.
//!
//! An MR registered after a move keeps its real keys as the program's, unless one of them
//! is already the program's key of another live MR: then the program gets a key no live
//! MR has.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

/// The program's keys to the real ones, where they differ.
#[derive(Default)]
pub struct Keys {
    lkeys: HashMap<u32, u32>,
    rkeys: HashMap<u32, u32>,
    /// The program's keys of every live MR, once translating (both lkeys and rkeys).
    live: std::collections::HashSet<u32>,
    /// The next key handed out on a collision, counting down.
    spare: u32,
}

static KEYS: RwLock<Option<Keys>> = RwLock::new(None);
static TRANSLATING: AtomicBool = AtomicBool::new(false);

/// Whether a move has changed any key: only then does the data path translate.
pub fn translating() -> bool {
    TRANSLATING.load(Ordering::Acquire)
}

fn read<T>(f: impl FnOnce(&Keys) -> T) -> T {
    let guard = KEYS.read().unwrap_or_else(|e| e.into_inner());
    f(guard.as_ref().unwrap_or(&Keys::default()))
}

fn write<T>(f: impl FnOnce(&mut Keys) -> T) -> T {
    let mut guard = KEYS.write().unwrap_or_else(|e| e.into_inner());
    f(guard.get_or_insert_with(|| Keys {
        spare: u32::MAX,
        ..Keys::default()
    }))
}

/// The real lkey behind the program's `lkey`.
pub fn lkey(lkey: u32) -> u32 {
    read(|k| k.lkeys.get(&lkey).copied().unwrap_or(lkey))
}

/// The program's rkeys of every live MR, with the real ones behind them.
pub fn rkeys() -> Vec<(u32, u32)> {
    read(|k| k.rkeys.iter().map(|(v, r)| (*v, *r)).collect())
}

/// A move registered the MR the program knows by `program` (lkey, rkey) again, with the
/// `real` keys: translate from now on.
pub fn moved(program: (u32, u32), real: (u32, u32)) {
    write(|k| {
        k.live.extend([program.0, program.1]);
        k.lkeys.insert(program.0, real.0);
        k.rkeys.insert(program.1, real.1);
    });
    TRANSLATING.store(true, Ordering::Release);
}

/// The keys the program gets for an MR just registered with the `real` ones.
pub fn assign(real: (u32, u32)) -> (u32, u32) {
    if !translating() {
        return real;
    }
    write(|k| {
        let pick = |real: u32, k: &mut Keys| {
            let mut key = real;
            while k.live.contains(&key) {
                key = k.spare;
                k.spare -= 1;
            }
            k.live.insert(key);
            key
        };
        let lkey = pick(real.0, k);
        let rkey = if real.1 == real.0 {
            lkey
        } else {
            pick(real.1, k)
        };
        k.lkeys.insert(lkey, real.0);
        k.rkeys.insert(rkey, real.1);
        (lkey, rkey)
    })
}

/// The MR the program knows by `program` (lkey, rkey) is gone.
pub fn forget(program: (u32, u32)) {
    if translating() {
        write(|k| {
            k.live.remove(&program.0);
            k.live.remove(&program.1);
            k.lkeys.remove(&program.0);
            k.rkeys.remove(&program.1);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test: the keys are the process's.
    #[test]
    fn keys_are_translated_after_a_move_and_new_ones_never_collide() {
        assert!(!translating());
        assert_eq!(assign((5, 5)), (5, 5), "before a move: the real keys");
        assert_eq!(lkey(5), 5);

        moved((5, 5), (9, 9));
        moved((7, 8), (5, 6));
        assert!(translating());
        assert_eq!(lkey(5), 9);
        assert_eq!(lkey(7), 5);
        assert_eq!(lkey(1234), 1234, "an unknown key is left alone");

        // A new MR whose real key is the program's key of a live one gets another.
        let (l, r) = assign((5, 5));
        assert_ne!(l, 5);
        assert_eq!(l, r);
        assert_eq!(lkey(l), 5);
        assert_eq!(lkey(5), 9, "the old MR's translation stands");
        let (l2, _) = assign((11, 12));
        assert_eq!(l2, 11, "no collision: its own key");

        forget((5, 5));
        assert_eq!(lkey(5), 5);
        let rkeys = rkeys();
        assert!(rkeys.contains(&(8, 6)), "{rkeys:?}");
        assert!(!rkeys.iter().any(|(v, _)| *v == 5), "forgotten: {rkeys:?}");
    }
}
