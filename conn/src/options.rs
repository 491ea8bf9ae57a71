//! The settings of a connection and of the connections a listener accepts. A leaf: every
//! other module reads them, none of them is needed to state them.

use std::net::SocketAddr;
use std::time::Duration;

/// Settings of a connection (and of the connections a listener accepts).
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Largest message accepted by `send`, in bytes.
    pub max_message: usize,
    /// Receives pre-posted per QP (the credits the peer gets).
    pub recv_depth: u32,
    /// Messages kept for (re)transmission; `send` waits while this many are unacknowledged.
    pub max_outbox: usize,
    /// How long `send` waits for room in the outbox.
    pub send_timeout: Duration,
    /// How long `Connection::connect` keeps trying.
    pub connect_timeout: Duration,
    /// How long a connection waits for its peer to come back (after a PAUSE from a moving
    /// peer, a lost link, or its own quiesce without resume) before failing.
    pub peer_wait: Duration,
    /// QP ACK timeout exponent (4.096 us x 2^n): 14 = ~67 ms, 16 = ~268 ms.
    pub ack_timeout: u8,
    /// QP transport retries (below 7: Soft-RoCE treats 7 as infinite).
    pub retry_count: u8,
    /// RNR retries (below 7).
    pub rnr_retry: u8,
    /// Pause between reconnect attempts.
    pub reconnect_interval: Duration,
    /// How long `close` waits for the outbox to be acknowledged and the disconnect to
    /// complete before releasing everything anyway.
    pub close_timeout: Duration,
    /// Register with the agent (see [`crate::registry`]).
    pub register: bool,
    /// The TCP bridge (strategy `bridge`), over an address of a NIC that moves with the VM:
    /// a listener accepts bridges on it, a connecting side opens one to the peer's. Both
    /// ends need it; then a move with strategy `bridge` carries the messages over TCP
    /// while the RDMA path is rebuilt.
    pub bridge: Option<SocketAddr>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            max_message: 4096,
            recv_depth: 64,
            max_outbox: 4096,
            send_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            peer_wait: Duration::from_secs(60),
            ack_timeout: 16,
            retry_count: 6,
            rnr_retry: 6,
            reconnect_interval: Duration::from_millis(150),
            close_timeout: Duration::from_secs(5),
            register: true,
            bridge: None,
        }
    }
}
