//! Accepting connections on the daemon's listeners (the API socket, the peer port, metrics)
//! without ever stopping.
//!
//! Each listener admits connections up to a limit of its own; past it, new ones wait in the
//! kernel's backlog until a connection ends, so a flood of idle connections costs the daemon
//! at most that many descriptors and never the listener itself. An accept error (out of
//! descriptors, a connection reset before it was taken) is logged and retried after a
//! pause: it never ends the listener, and never spins.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How many API connections the daemon serves at once.
pub const API_CONNECTIONS: usize = 256;
/// How many connections from peer migrators the daemon serves at once (a connection that
/// has not authenticated holds its place for at most the peer handshake timeout).
pub const PEER_CONNECTIONS: usize = 64;
/// How many metrics scrapes the daemon serves at once.
pub const METRICS_CONNECTIONS: usize = 16;

/// The pause after a failed accept.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// The admission of one listener: a bounded number of connections, accept errors survived.
pub struct Admission {
    listener: &'static str,
    slots: Arc<Semaphore>,
}

/// A connection's place among its listener's; it frees the place when dropped.
#[must_use = "the connection's place is freed when this is dropped"]
pub struct Slot {
    _place: OwnedSemaphorePermit,
}

impl Admission {
    /// Admits at most `limit` connections at once on the listener named `listener`.
    pub fn new(listener: &'static str, limit: usize) -> Admission {
        Admission {
            listener,
            slots: Arc::new(Semaphore::new(limit)),
        }
    }

    /// Waits for a free place, then for a connection from `accept`, retrying its errors.
    /// Cancel-safe when `accept` is (tokio's listeners are).
    pub async fn next<T, F, A>(&self, mut accept: F) -> (T, Slot)
    where
        F: FnMut() -> A,
        A: Future<Output = std::io::Result<T>>,
    {
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                tracing::warn!(
                    listener = self.listener,
                    "the connection limit is reached; new connections wait until one ends"
                );
                self.slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the semaphore is never closed")
            }
        };
        loop {
            match accept().await {
                Ok(connection) => return (connection, Slot { _place: permit }),
                Err(e) => {
                    tracing::warn!(listener = self.listener, "cannot accept a connection: {e}");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn accept_errors_are_retried_and_the_limit_holds() {
        let admission = Admission::new("test", 2);
        let calls = AtomicUsize::new(0);
        // Fails twice (out of descriptors), then accepts.
        let accept = || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 2 {
                    Err(std::io::Error::other("Too many open files"))
                } else {
                    Ok(n)
                }
            }
        };
        let (first, slot1) = admission.next(accept).await;
        assert_eq!(first, 2);
        let (_, slot2) = admission.next(|| async { Ok(()) }).await;
        // Two places taken: a third connection waits.
        let third = tokio::time::timeout(
            Duration::from_millis(300),
            admission.next(|| async { Ok(()) }),
        )
        .await;
        assert!(
            third.is_err(),
            "a third connection was admitted past the limit"
        );
        drop(slot1);
        let (_, _slot3) =
            tokio::time::timeout(Duration::from_secs(1), admission.next(|| async { Ok(()) }))
                .await
                .expect("a freed place was not given to the next connection");
        drop(slot2);
    }
}
