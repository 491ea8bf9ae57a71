//! A worker's answer to one request (connect, quiesce, resume, close): a tokio oneshot.
//! Async callers await it; blocking callers (the blocking API, the agent's threads) wait for
//! it here, parked until the worker answers or their deadline passes. Either way the wait is
//! bounded and nothing polls.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::control::ControlError;

/// The worker's side of a request: `Ok` or what went wrong.
pub(crate) type Reply = oneshot::Sender<Result<(), ControlError>>;

/// How a wait for an answer ended without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoAnswer {
    /// The worker dropped the request unanswered (it ended first).
    Dropped,
    /// The deadline passed.
    TimedOut,
}

/// Waits for `rx` on this thread until `deadline` (outside any runtime: the worker may run
/// on another thread's runtime, or on the caller's, which must then not be this thread).
pub(crate) fn wait<T>(mut rx: oneshot::Receiver<T>, deadline: Instant) -> Result<T, NoAnswer> {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(answer) = Pin::new(&mut rx).poll(&mut cx) {
            return answer.map_err(|_| NoAnswer::Dropped);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NoAnswer::TimedOut);
        }
        // Woken by the sender (or spuriously: the receiver is polled again).
        std::thread::park_timeout(left);
    }
}

/// Awaits `rx` until `deadline`.
pub(crate) async fn wait_async<T>(
    rx: oneshot::Receiver<T>,
    deadline: Instant,
) -> Result<T, NoAnswer> {
    match tokio::time::timeout_at(deadline.into(), rx).await {
        Ok(answer) => answer.map_err(|_| NoAnswer::Dropped),
        Err(_) => Err(NoAnswer::TimedOut),
    }
}

/// Wakes a thread parked in [`wait`].
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_blocking_wait_gets_an_answer_sent_from_another_thread() {
        let (tx, rx) = oneshot::channel();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            tx.send(7u32).unwrap();
        });
        assert_eq!(wait(rx, Instant::now() + Duration::from_secs(10)), Ok(7));
        sender.join().unwrap();
    }

    #[test]
    fn a_blocking_wait_ends_when_the_request_is_dropped_or_late() {
        let (tx, rx) = oneshot::channel::<()>();
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(tx);
        });
        let started = Instant::now();
        assert_eq!(
            wait(rx, started + Duration::from_secs(10)),
            Err(NoAnswer::Dropped)
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        dropper.join().unwrap();

        let (_tx, rx) = oneshot::channel::<()>();
        let started = Instant::now();
        assert_eq!(
            wait(rx, started + Duration::from_millis(100)),
            Err(NoAnswer::TimedOut)
        );
        assert!(started.elapsed() >= Duration::from_millis(100));
    }

    #[tokio::test]
    async fn an_async_wait_gets_the_answer_or_times_out() {
        let (tx, rx) = oneshot::channel();
        tx.send(3u8).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        assert_eq!(wait_async(rx, deadline).await, Ok(3));
        let (_tx, rx) = oneshot::channel::<u8>();
        let soon = Instant::now() + Duration::from_millis(50);
        assert_eq!(wait_async(rx, soon).await, Err(NoAnswer::TimedOut));
    }
}
