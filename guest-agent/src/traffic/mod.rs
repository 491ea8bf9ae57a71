//! The traffic tool's logic: numbered, timestamped messages both ways at a fixed rate, and
//! the receiving side's accounting: loss (gaps in the peer's numbering), duplicates,
//! reordering, and the largest gap between consecutive deliveries (the blackout).
//!
//! A run may carry several connections (one flow each: a sender and a receiver thread, its
//! own numbering and accounting); the report sums the flows and keeps the largest gap, so
//! one process can stand for an application with many connections.
//!
//! In one-sided mode ([`regions`]) each side also exposes a buffer and fills the peer's,
//! region by region, with RDMA WRITE; every numbered message then follows a completed write
//! and names the region, which its owner verifies on receipt.

pub mod regions;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use thiserror::Error;

use rdmamig_conn::plain::{PlainEndpoint, PlainError, PlainOptions};
use rdmamig_conn::{
    registry, Access, ConnError, ConnectOptions, Connection, Exposed, Listener, RemoteBuffer,
};
use rdmamig_proto::agent::ConnectionState;
use regions::{Notice, Verdict, NOTICE_LEN};

/// First bytes of every traffic message.
pub const MAGIC: [u8; 4] = *b"RMTF";
/// Smallest message: magic, counter, timestamp.
pub const MIN_SIZE: usize = 20;
/// First bytes of a migratable flow's last message, which carries how many messages its
/// sender sent. A side closes only once the peer's end has arrived: with its own outbox
/// acknowledged, it could otherwise close while the peer's messages are still being
/// replayed to it over a rebuilt link, and they would be lost with the connection.
const END_MAGIC: [u8; 4] = *b"RMTE";

/// Which connection kind to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// rdmamig's migratable connection (quiesce, resume, replay).
    Migratable,
    /// A plain rdma_cm connection that reconnects on its own and loses what was in flight.
    Plain,
}

/// Which side this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Listen on the address.
    Serve(SocketAddr),
    /// Connect to the address.
    Connect(SocketAddr),
}

/// Settings of one traffic run.
#[derive(Debug, Clone)]
pub struct TrafficConfig {
    /// Serve or connect.
    pub side: Side,
    /// Connection kind.
    pub mode: Mode,
    /// Connections (flows) of this process.
    pub connections: u32,
    /// Messages per second sent on each connection.
    pub rate: u32,
    /// Bytes per message (at least [`MIN_SIZE`]).
    pub size: usize,
    /// Stop after this long (else at the stop flag).
    pub duration: Option<Duration>,
    /// Receive for this long after sending stopped (and, migratable, after the flush).
    pub linger: Duration,
    /// Migratable: the end of the run waits for the peer to acknowledge everything sent
    /// and for the peer's end of the flow for as long as either progresses, and gives up
    /// after this long without progress. A link that broke just before the stop is rebuilt
    /// first (its replay then delivers the rest), which on a loaded guest takes far longer
    /// than the 3 s default.
    pub flush_timeout: Duration,
    /// How long the receiver takes no message after the connection is up (a slow reader).
    pub stall_reading: Duration,
    /// Written once connected.
    pub ready_file: Option<PathBuf>,
    /// Options of migratable connections.
    pub conn: ConnectOptions,
    /// Options of a plain connection.
    pub plain: PlainOptions,
    /// One-sided mode: RDMA WRITE into the peer's exposed buffer before every message.
    pub one_sided: Option<OneSidedConfig>,
    /// Rewritten a few times a second with the run's counters so far ([`Progress`]).
    pub progress_file: Option<PathBuf>,
}

/// The buffer of one-sided mode.
#[derive(Debug, Clone, Copy)]
pub struct OneSidedConfig {
    /// Regions in the buffer each side exposes (written in turn).
    pub regions: u32,
    /// Bytes per region (at least the stamp).
    pub region_size: usize,
}

/// The handle each side exposes its buffer under in one-sided mode.
pub const BUFFER_HANDLE: u64 = 1;
/// Bound on waiting for writes to complete (and reads to return) in one-sided mode: longer
/// than any move's blackout.
const ONE_SIDED_WAIT: Duration = Duration::from_secs(30);

/// A run's counters so far, for a test that checks progress between moves.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct Progress {
    /// Messages received.
    pub received: u64,
    /// Regions this side verified in its own buffer.
    pub regions_verified: u64,
    /// Regions found missing, stale or corrupt.
    pub regions_bad: u64,
    /// Regions this side wrote into the peer's buffer (writes completed).
    pub regions_written: u64,
    /// READs of the peer's buffer that returned what was written.
    pub reads_verified: u64,
    /// When this was written (UNIX ms).
    pub unix_ms: u64,
}

/// Errors that end a traffic run before it starts.
#[derive(Debug, Error)]
pub enum TrafficError {
    /// Setting up the migratable connection failed.
    #[error("setting up the migratable connection failed")]
    Connect(#[source] ConnError),
    /// A connect attempt panicked (a bug; its message is on stderr).
    #[error("a connect attempt panicked")]
    ConnectPanicked,
    /// Setting up the plain endpoint failed.
    #[error("setting up the plain connection failed")]
    Plain(#[source] PlainError),
    /// Stopped before any connection came.
    #[error("stopped before a connection was established")]
    NeverConnected,
    /// Plain mode carries one connection per process.
    #[error("plain mode supports one connection per process")]
    PlainIsSingle,
    /// One-sided mode needs the migratable connection.
    #[error("one-sided mode needs --mode migratable")]
    OneSidedNeedsMigratable,
    /// Exposing this side's buffer or finding the peer's failed.
    #[error("setting up one-sided mode")]
    OneSided(#[source] ConnError),
    /// Writing the ready file failed.
    #[error("writing the ready file {path}")]
    ReadyFile {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What went wrong with one region of one-sided mode (counted, and reported as one of the
/// flow's errors with its chain; the traffic goes on).
#[derive(Debug, Error)]
enum RegionError {
    /// The connection refused or failed a WRITE, READ or flush.
    #[error(transparent)]
    Conn(#[from] ConnError),
    /// The region read back is not what was written.
    #[error("read back region {region} round {round}: it differs from what was written")]
    ReadBackDiffers {
        /// The region.
        region: u32,
        /// The round.
        round: u64,
    },
    /// The peer's notice names a region outside this side's buffer.
    #[error("notice for region {region}")]
    Notice {
        /// The region named.
        region: u32,
        /// The cause.
        #[source]
        source: ConnError,
    },
    /// The region holds something else than the notice says.
    #[error("{0}")]
    Bad(String),
}

/// Encodes message `counter`, sent at `sent_us` (UNIX microseconds), padded to `size` bytes.
pub fn encode_message(counter: u64, sent_us: u64, size: usize) -> Vec<u8> {
    let mut m = vec![0u8; size.max(MIN_SIZE)];
    m[..4].copy_from_slice(&MAGIC);
    m[4..12].copy_from_slice(&counter.to_be_bytes());
    m[12..20].copy_from_slice(&sent_us.to_be_bytes());
    m
}

/// The end of a flow: `sent` messages were sent before it.
fn encode_end(sent: u64) -> Vec<u8> {
    let mut m = END_MAGIC.to_vec();
    m.extend_from_slice(&sent.to_be_bytes());
    m
}

/// Decodes the end of a flow into the number of messages sent before it.
fn decode_end(m: &[u8]) -> Option<u64> {
    match m {
        [a, b, c, d, rest @ ..] if [*a, *b, *c, *d] == END_MAGIC => {
            Some(u64::from_be_bytes(rest.try_into().ok()?))
        }
        _ => None,
    }
}

/// Decodes a message into (counter, sent_us); None if it is not a traffic message.
pub fn decode_message(m: &[u8]) -> Option<(u64, u64)> {
    if m.len() < MIN_SIZE || m[..4] != MAGIC {
        return None;
    }
    let counter = u64::from_be_bytes(m[4..12].try_into().ok()?);
    let sent = u64::from_be_bytes(m[12..20].try_into().ok()?);
    Some((counter, sent))
}

/// Milliseconds since the UNIX epoch.
pub use rdmamig_proto::clock::unix_ms;

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// UTC time of day, `HH:MM:SS.mmm`, of a UNIX-ms timestamp.
pub fn time_of_day(ms: u64) -> String {
    let day_ms = ms % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        day_ms / 3_600_000,
        day_ms / 60_000 % 60,
        day_ms / 1000 % 60,
        day_ms % 1000
    )
}

/// Missing counters a report lists by number.
pub const HOLES_SHOWN: usize = 16;

/// Receive-side accounting of the peer's numbered messages (counters start at 0).
#[derive(Debug, Default)]
pub struct Tracker {
    next: u64,
    holes: BTreeSet<u64>,
    received: u64,
    duplicated: u64,
    reordered: u64,
    last: Option<(Instant, u64)>,
    max_gap: Option<(Duration, u64, u64)>,
    first_ms: Option<u64>,
    /// What the peer's end of the flow said it sent, once it arrived.
    peer_end: Option<u64>,
}

impl Tracker {
    /// Records the arrival of the peer's end of the flow (`sent`: what it says it sent).
    pub fn on_end(&mut self, sent: u64) {
        self.peer_end = Some(sent);
    }

    /// Records the delivery of message `counter` at `now` (`now_ms`: UNIX ms).
    pub fn on_message(&mut self, counter: u64, now: Instant, now_ms: u64) {
        self.received += 1;
        self.first_ms.get_or_insert(now_ms);
        if let Some((at, at_ms)) = self.last {
            let gap = now.duration_since(at);
            if self.max_gap.is_none_or(|(g, _, _)| gap > g) {
                self.max_gap = Some((gap, at_ms, now_ms));
            }
        }
        self.last = Some((now, now_ms));
        if counter == self.next {
            self.next += 1;
        } else if counter > self.next {
            // Everything skipped is missing (for now); cap the set so a wild counter cannot
            // exhaust memory.
            if counter - self.next <= 10_000_000 {
                self.holes.extend(self.next..counter);
            }
            self.next = counter + 1;
        } else if self.holes.remove(&counter) {
            self.reordered += 1;
        } else {
            self.duplicated += 1;
        }
    }

    /// Messages missing from the peer's numbering (up to the highest received).
    pub fn lost(&self) -> u64 {
        self.holes.len() as u64
    }
}

/// The JSON report of one run.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Report {
    /// "serve" or "connect".
    pub role: String,
    /// Connection kind.
    pub mode: Mode,
    /// The address served or connected to.
    pub address: String,
    /// Connections (flows) the report sums.
    #[serde(default = "one")]
    pub connections: u32,
    /// Messages per second (per connection).
    pub rate: u32,
    /// Message size.
    pub size: usize,
    /// Messages this side sent (counter values used; includes sends that failed).
    pub sent: u64,
    /// Sends that returned an error.
    pub send_failures: u64,
    /// Messages received from the peer.
    pub received: u64,
    /// Gaps in the peer's numbering.
    pub lost: u64,
    /// The first of those missing counters (at most [`HOLES_SHOWN`]), to place a loss in
    /// the run.
    #[serde(default)]
    pub first_holes: Vec<u64>,
    /// Messages received more than once.
    pub duplicated: u64,
    /// Messages that arrived after a later one.
    pub reordered: u64,
    /// Highest peer counter received, plus one (= the peer's messages accounted for).
    pub next_expected: u64,
    /// Largest gap between consecutive deliveries, ms.
    pub max_gap_ms: f64,
    /// When that gap began (UNIX ms) and its time of day (UTC).
    pub max_gap_start_unix_ms: u64,
    /// When that gap ended (UNIX ms).
    pub max_gap_end_unix_ms: u64,
    /// `HH:MM:SS.mmm` UTC of the gap's end.
    pub max_gap_end_time: String,
    /// When the last message was delivered (UNIX ms; 0 if none was): shows whether traffic
    /// went on after a move.
    pub last_delivery_unix_ms: u64,
    /// Errors the application saw (deduplicated, with counts).
    pub errors: Vec<String>,
    /// Link events the migratable connection recovered from by itself.
    pub link_events: Vec<String>,
    /// The most messages that waited at once for this side to take them (migratable).
    #[serde(default)]
    pub inbox_high: u64,
    /// Connections (re)established.
    pub connections_established: u64,
    /// The number of each QP that carried the connections, in order (migratable).
    #[serde(default)]
    pub qps: Vec<u32>,
    /// Messages re-sent after a reconnect (migratable).
    pub replayed: u64,
    /// Messages sent over the TCP bridge (strategy `bridge`).
    #[serde(default)]
    pub bridged: u64,
    /// One-sided mode: regions written into the peer's buffer (writes completed).
    #[serde(default)]
    pub regions_written: u64,
    /// One-sided mode: regions of this side's buffer verified after the peer's notice.
    #[serde(default)]
    pub regions_verified: u64,
    /// One-sided mode: regions already written again when their notice arrived.
    #[serde(default)]
    pub regions_overtaken: u64,
    /// One-sided mode: regions found missing, stale or corrupt (each also in `errors`).
    #[serde(default)]
    pub regions_bad: u64,
    /// One-sided mode: READs of the peer's buffer that returned what was written.
    #[serde(default)]
    pub reads_verified: u64,
    /// One-sided operations posted again after a reconnect.
    #[serde(default)]
    pub onesided_replayed: u64,
    /// Start and end of the run (UNIX ms).
    pub started_unix_ms: u64,
    /// End of the run (UNIX ms).
    pub ended_unix_ms: u64,
}

fn one() -> u32 {
    1
}

impl Report {
    /// Sums the reports of several flows of one process: counts add up, the largest gap
    /// wins, errors and link events are joined.
    pub fn merge(mut flows: Vec<Report>) -> Option<Report> {
        let mut total = flows.pop()?;
        for r in flows {
            total.connections += r.connections;
            total.sent += r.sent;
            total.send_failures += r.send_failures;
            total.received += r.received;
            total.lost += r.lost;
            total.first_holes.extend(r.first_holes);
            total.first_holes.truncate(HOLES_SHOWN);
            total.duplicated += r.duplicated;
            total.reordered += r.reordered;
            total.next_expected += r.next_expected;
            if r.max_gap_ms > total.max_gap_ms {
                total.max_gap_ms = r.max_gap_ms;
                total.max_gap_start_unix_ms = r.max_gap_start_unix_ms;
                total.max_gap_end_unix_ms = r.max_gap_end_unix_ms;
                total.max_gap_end_time = r.max_gap_end_time;
            }
            total.last_delivery_unix_ms = total.last_delivery_unix_ms.max(r.last_delivery_unix_ms);
            for e in r.errors {
                if !total.errors.contains(&e) {
                    total.errors.push(e);
                }
            }
            total.link_events.extend(r.link_events);
            total.connections_established += r.connections_established;
            total.qps.extend(&r.qps);
            total.replayed += r.replayed;
            total.bridged += r.bridged;
            total.regions_written += r.regions_written;
            total.regions_verified += r.regions_verified;
            total.regions_overtaken += r.regions_overtaken;
            total.regions_bad += r.regions_bad;
            total.reads_verified += r.reads_verified;
            total.onesided_replayed += r.onesided_replayed;
            total.started_unix_ms = total.started_unix_ms.min(r.started_unix_ms);
            total.ended_unix_ms = total.ended_unix_ms.max(r.ended_unix_ms);
        }
        Some(total)
    }
}

enum Endpoint {
    /// The connection, and the listener it came from (kept alive to route RESUMEs).
    Migratable(Connection, #[allow(dead_code)] Option<Arc<Listener>>),
    Plain(PlainEndpoint),
}

/// An error of the connection, as the report shows it, and whether the connection is done
/// for (a migratable connection that failed or was closed never recovers; a plain one
/// reconnects on its own).
struct EndpointError {
    text: String,
    fatal: bool,
    peer_closed: bool,
}

impl From<ConnError> for EndpointError {
    fn from(e: ConnError) -> Self {
        let peer_closed = matches!(e, ConnError::PeerClosed { .. });
        let fatal =
            matches!(e, ConnError::Failed { .. } | ConnError::InvalidState { .. }) || peer_closed;
        EndpointError {
            text: rdmamig_conn::error_chain(&e),
            fatal,
            peer_closed,
        }
    }
}

impl Endpoint {
    fn send(&self, m: &[u8]) -> Result<(), EndpointError> {
        match self {
            Endpoint::Migratable(c, _) => c.send(m).map_err(EndpointError::from),
            Endpoint::Plain(p) => p.send(m).map_err(|e| EndpointError {
                text: e.to_string(),
                fatal: false,
                peer_closed: false,
            }),
        }
    }

    fn migratable(&self) -> Option<&Connection> {
        match self {
            Endpoint::Migratable(c, _) => Some(c),
            Endpoint::Plain(_) => None,
        }
    }

    fn recv(&self, timeout: Duration) -> Result<Option<Vec<u8>>, EndpointError> {
        match self {
            Endpoint::Migratable(c, _) => c.recv(timeout).map_err(EndpointError::from),
            Endpoint::Plain(p) => Ok(p.recv(timeout)),
        }
    }
}

#[derive(Default)]
struct Errors(Mutex<BTreeMap<String, u64>>);

impl Errors {
    fn add(&self, e: String) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(e)
            .or_default() += 1;
    }

    fn list(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(e, n)| {
                if *n > 1 {
                    format!("{e} (x{n})")
                } else {
                    e.clone()
                }
            })
            .collect()
    }
}

fn establish(cfg: &TrafficConfig, stop: &AtomicBool) -> Result<Vec<Endpoint>, TrafficError> {
    let n = cfg.connections.max(1) as usize;
    match (cfg.mode, cfg.side) {
        // Several connects at once ([`registry::MAX_PARALLEL`]), as the library resumes: each
        // mostly waits for the peer's CM, and one after another 64 took 72-87 s on a loaded
        // guest.
        (Mode::Migratable, Side::Connect(peer)) => {
            let slots = vec![(); n];
            registry::bounded_parallel(&slots, registry::MAX_PARALLEL, |()| {
                Connection::connect(peer, &cfg.conn)
            })
            .into_iter()
            .map(|connected| match connected {
                Some(Ok(c)) => Ok(Endpoint::Migratable(c, None)),
                Some(Err(e)) => Err(TrafficError::Connect(e)),
                None => Err(TrafficError::ConnectPanicked),
            })
            .collect()
        }
        (Mode::Migratable, Side::Serve(addr)) => {
            let l = Arc::new(Listener::bind(addr, &cfg.conn).map_err(TrafficError::Connect)?);
            let mut eps = Vec::with_capacity(n);
            while eps.len() < n {
                match l.accept(Duration::from_millis(200)) {
                    Ok(c) => eps.push(Endpoint::Migratable(c, Some(l.clone()))),
                    Err(ConnError::AcceptTimedOut { .. }) if !stop.load(Ordering::Relaxed) => {}
                    Err(ConnError::AcceptTimedOut { .. }) => {
                        return Err(TrafficError::NeverConnected)
                    }
                    Err(e) => return Err(TrafficError::Connect(e)),
                }
            }
            Ok(eps)
        }
        (Mode::Plain, _) if n > 1 => Err(TrafficError::PlainIsSingle),
        (Mode::Plain, side) => {
            let p = match side {
                Side::Connect(peer) => PlainEndpoint::connect(peer, cfg.plain),
                Side::Serve(addr) => PlainEndpoint::serve(addr, cfg.plain),
            }
            .map_err(TrafficError::Plain)?;
            while !p.is_connected() {
                if stop.load(Ordering::Relaxed) {
                    return Err(TrafficError::NeverConnected);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(vec![Endpoint::Plain(p)])
        }
    }
}

/// How often the progress file is rewritten.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(250);

/// The longest a traffic thread sleeps before it looks whether it must stop (or write the
/// progress file). Each wake-up costs a nested test-bed VM milliseconds of its one CPU:
/// looking every 20-100 ms, the threads of a quiet flow kept such a VM far from idle while
/// its new VF came up, which that slowed in turn (docs/testbed.md).
const STOP_CHECK: Duration = Duration::from_millis(250);

/// Writes the counters of all flows to `path` (through a rename, so readers never see half).
fn write_progress(path: &std::path::Path, flows: &[Flow]) {
    let mut p = Progress {
        unix_ms: unix_ms(),
        ..Progress::default()
    };
    for f in flows {
        p.received += f.tracker.lock().unwrap_or_else(|e| e.into_inner()).received;
        p.regions_verified += f.counters.verified.load(Ordering::Relaxed);
        p.regions_bad += f.counters.bad.load(Ordering::Relaxed);
        p.regions_written += f.counters.written.load(Ordering::Relaxed);
        p.reads_verified += f.counters.reads.load(Ordering::Relaxed);
    }
    let tmp = path.with_extension("tmp");
    if let Ok(json) = serde_json::to_string(&p) {
        if std::fs::write(&tmp, json).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

/// Flows flushed or closed at the same time at the end of a run.
const SHUTDOWN_PARALLEL: usize = 16;

/// One flow's one-sided buffers: its own, which the peer fills, and the peer's.
struct Buffers {
    local: Exposed,
    remote: RemoteBuffer,
    cfg: OneSidedConfig,
}

/// Counters of one-sided mode.
#[derive(Default)]
struct RegionCounters {
    written: AtomicU64,
    verified: AtomicU64,
    overtaken: AtomicU64,
    bad: AtomicU64,
    reads: AtomicU64,
}

impl Buffers {
    /// Exposes this side's buffer and waits for the peer's (both under [`BUFFER_HANDLE`]).
    fn set_up(conn: &Connection, cfg: OneSidedConfig) -> Result<Buffers, ConnError> {
        let size = cfg.regions.max(1) as usize * cfg.region_size;
        let local = conn.expose(Some(BUFFER_HANDLE), size, Access::ReadWrite)?;
        let remote = conn.remote(BUFFER_HANDLE, Duration::from_secs(10))?;
        Ok(Buffers { local, remote, cfg })
    }

    /// Writes region `n % regions` (round `n / regions`) of the peer's buffer, waits until
    /// the data is there, and once per round reads it back; returns the notice that tells
    /// the peer what to find.
    fn write_region(
        &self,
        conn: &Connection,
        n: u64,
        c: &RegionCounters,
    ) -> Result<Notice, RegionError> {
        let regions = self.cfg.regions.max(1) as u64;
        let region = (n % regions) as u32;
        let round = n / regions;
        let (data, checksum) = regions::fill(round, region, self.cfg.region_size);
        let offset = region as u64 * self.cfg.region_size as u64;
        conn.write(&self.remote, offset, &data)?;
        conn.flush_writes(ONE_SIDED_WAIT)?;
        c.written.fetch_add(1, Ordering::Relaxed);
        if region == 0 {
            let back = conn.read(&self.remote, offset, data.len(), ONE_SIDED_WAIT)?;
            if back != data {
                return Err(RegionError::ReadBackDiffers { region, round });
            }
            c.reads.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Notice {
            region,
            round,
            checksum,
        })
    }

    /// Verifies this side's region named by `notice`.
    fn check(&self, notice: &Notice, c: &RegionCounters) -> Result<(), RegionError> {
        let size = self.cfg.region_size;
        let mut found = vec![0u8; size];
        self.local
            .read(notice.region as usize * size, &mut found)
            .map_err(|source| RegionError::Notice {
                region: notice.region,
                source,
            })?;
        match regions::verify(&found, notice) {
            Verdict::Good => c.verified.fetch_add(1, Ordering::Relaxed),
            Verdict::Overtaken => c.overtaken.fetch_add(1, Ordering::Relaxed),
            Verdict::Bad(why) => {
                c.bad.fetch_add(1, Ordering::Relaxed);
                return Err(RegionError::Bad(why));
            }
        };
        Ok(())
    }
}

/// One connection's traffic: a sender and a receiver thread and their accounting.
struct Flow {
    buffers: Option<Arc<Buffers>>,
    counters: Arc<RegionCounters>,
    ep: Arc<Endpoint>,
    errors: Arc<Errors>,
    stop_send: Arc<AtomicBool>,
    stop_recv: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    send_failures: Arc<AtomicU64>,
    tracker: Arc<Mutex<Tracker>>,
    sender: Option<std::thread::JoinHandle<()>>,
    receiver: Option<std::thread::JoinHandle<()>>,
}

impl Flow {
    fn start(ep: Endpoint, buffers: Option<Buffers>, cfg: &TrafficConfig) -> Flow {
        let mut flow = Flow {
            buffers: buffers.map(Arc::new),
            counters: Arc::default(),
            ep: Arc::new(ep),
            errors: Arc::new(Errors::default()),
            stop_send: Arc::new(AtomicBool::new(false)),
            stop_recv: Arc::new(AtomicBool::new(false)),
            sent: Arc::new(AtomicU64::new(0)),
            send_failures: Arc::new(AtomicU64::new(0)),
            tracker: Arc::new(Mutex::new(Tracker::default())),
            sender: None,
            receiver: None,
        };
        let (ep, errors, stop_send, sent, fails) = (
            flow.ep.clone(),
            flow.errors.clone(),
            flow.stop_send.clone(),
            flow.sent.clone(),
            flow.send_failures.clone(),
        );
        let (buffers, counters) = (flow.buffers.clone(), flow.counters.clone());
        let interval = Duration::from_secs_f64(1.0 / cfg.rate.max(1) as f64);
        // Messages of one-sided mode carry a notice after the counter and timestamp.
        let size = match flow.buffers {
            Some(_) => cfg.size.max(MIN_SIZE + NOTICE_LEN),
            None => cfg.size,
        };
        flow.sender = Some(std::thread::spawn(move || {
            let start = Instant::now();
            let mut n: u64 = 0;
            while !stop_send.load(Ordering::Relaxed) {
                let due = start + interval.mul_f64(n as f64);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep((due - now).min(STOP_CHECK));
                    continue;
                }
                let mut m = encode_message(n, unix_us(), size);
                if let (Some(b), Some(conn)) = (&buffers, ep.migratable()) {
                    match b.write_region(conn, n, &counters) {
                        Ok(notice) => notice.encode(&mut m[MIN_SIZE..]),
                        Err(e) => {
                            errors.add(format!("one-sided: {}", rdmamig_conn::error_chain(&e)))
                        }
                    }
                }
                n += 1;
                sent.store(n, Ordering::Relaxed);
                if let Err(e) = ep.send(&m) {
                    fails.fetch_add(1, Ordering::Relaxed);
                    errors.add(format!("send: {}", e.text));
                    if e.fatal {
                        break;
                    }
                }
            }
        }));
        let (ep, errors, stop_recv, tracker) = (
            flow.ep.clone(),
            flow.errors.clone(),
            flow.stop_recv.clone(),
            flow.tracker.clone(),
        );
        let (buffers, counters) = (flow.buffers.clone(), flow.counters.clone());
        let stall = cfg.stall_reading;
        flow.receiver = Some(std::thread::spawn(move || {
            std::thread::sleep(stall);
            while !stop_recv.load(Ordering::Relaxed) {
                match ep.recv(STOP_CHECK) {
                    Ok(Some(m)) => match decode_message(&m) {
                        Some((counter, _)) => {
                            tracker
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .on_message(counter, Instant::now(), unix_ms());
                            let notice = Notice::decode(&m[MIN_SIZE..]);
                            if let (Some(b), Some(notice)) = (&buffers, notice) {
                                if let Err(e) = b.check(&notice, &counters) {
                                    errors.add(format!(
                                        "one-sided: {}",
                                        rdmamig_conn::error_chain(&e)
                                    ));
                                }
                            }
                        }
                        None => match decode_end(&m) {
                            Some(sent) => tracker
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .on_end(sent),
                            None => errors
                                .add("received a message that is not a traffic message".into()),
                        },
                    },
                    Ok(None) => {}
                    // A clean close by the peer (after its flush): the stream simply ends.
                    Err(e) if e.peer_closed => {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(e) => {
                        errors.add(format!("recv: {}", e.text));
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        }));
        flow
    }

    /// Stops sending and waits (bounded) for the peer to acknowledge what was sent.
    fn stop_sending(&mut self) {
        self.stop_send.store(true, Ordering::Relaxed);
        if let Some(h) = self.sender.take() {
            let _ = h.join();
        }
    }

    /// Migratable: sends the end of the flow, then waits, within `timeout` in all, for
    /// the peer to acknowledge everything sent and for the peer's own end to arrive. A
    /// connection that failed has reported why already and is not waited for.
    /// Ends a migratable flow: sends the end message, then waits for the peer to
    /// acknowledge everything and for the peer's own end. Each wait lasts while it makes
    /// progress (acknowledgements, deliveries) and gives up after `stall` without any, so a
    /// slow reader still drains and a gone peer is reported within `stall`.
    fn end_stream(&self, stall: Duration) {
        let Endpoint::Migratable(c, _) = &*self.ep else {
            return;
        };
        if c.info().state == ConnectionState::Failed {
            return;
        }
        if let Err(e) = c.send(&encode_end(self.sent.load(Ordering::Relaxed))) {
            self.errors
                .add(format!("end of flow: {}", rdmamig_conn::error_chain(&e)));
            return;
        }
        let acked = wait_while_progressing(stall, || {
            let info = c.info();
            match info.state {
                ConnectionState::Failed => Wait::Over,
                _ if info.unacked == 0 => Wait::Over,
                _ => Wait::Pending(info.unacked),
            }
        });
        if !acked {
            let info = c.info();
            self.errors.add(format!(
                "flush: {} messages still unacknowledged, none acknowledged for {} s (connection {:?})",
                info.unacked,
                stall.as_secs_f64(),
                info.state
            ));
            return;
        }
        let ended = wait_while_progressing(stall, || {
            if self.peer_ended() {
                return Wait::Over;
            }
            match c.info().state {
                ConnectionState::Failed => Wait::Over,
                ConnectionState::Closed => Wait::Abandoned,
                _ => Wait::Pending(
                    self.tracker
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .received,
                ),
            }
        });
        if !ended {
            self.errors.add(format!(
                "end of flow: the peer's end did not arrive, nothing delivered for {} s (connection {:?})",
                stall.as_secs_f64(),
                c.info().state
            ));
        }
    }

    fn peer_ended(&self) -> bool {
        self.tracker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .peer_end
            .is_some()
    }

    fn stop_receiving(&mut self) {
        self.stop_recv.store(true, Ordering::Relaxed);
        if let Some(h) = self.receiver.take() {
            let _ = h.join();
        }
    }

    fn close(&self) {
        if let Endpoint::Migratable(c, _) = &*self.ep {
            if let Err(e) = c.close() {
                self.errors
                    .add(format!("close: {}", rdmamig_conn::error_chain(&e)));
            }
        }
    }

    fn finish(self, cfg: &TrafficConfig, started_unix_ms: u64) -> Report {
        let errors = &self.errors;
        let (established, link_events, replayed, bridged, onesided_replayed, inbox_high, qps) =
            match &*self.ep {
                Endpoint::Migratable(c, _) => {
                    let s = c.stats();
                    (
                        s.established,
                        s.link_events,
                        s.replayed,
                        s.bridged,
                        s.onesided_replayed,
                        s.inbox_high,
                        s.qps,
                    )
                }
                Endpoint::Plain(p) => {
                    let s = p.stats();
                    for e in s.errors {
                        errors.add(format!("connection: {e}"));
                    }
                    (s.established, Vec::new(), 0, 0, 0, 0, Vec::new())
                }
            };
        let t = self.tracker.lock().unwrap_or_else(|p| p.into_inner());
        let (gap, gap_start, gap_end) = t.max_gap.unwrap_or((Duration::ZERO, 0, 0));
        let (role, address) = match cfg.side {
            Side::Serve(a) => ("serve", a),
            Side::Connect(a) => ("connect", a),
        };
        Report {
            role: role.into(),
            mode: cfg.mode,
            address: address.to_string(),
            connections: 1,
            rate: cfg.rate,
            size: cfg.size,
            sent: self.sent.load(Ordering::Relaxed),
            send_failures: self.send_failures.load(Ordering::Relaxed),
            received: t.received,
            lost: t.lost(),
            first_holes: t.holes.iter().take(HOLES_SHOWN).copied().collect(),
            duplicated: t.duplicated,
            reordered: t.reordered,
            next_expected: t.next,
            max_gap_ms: gap.as_secs_f64() * 1000.0,
            max_gap_start_unix_ms: gap_start,
            max_gap_end_unix_ms: gap_end,
            max_gap_end_time: time_of_day(gap_end),
            last_delivery_unix_ms: t.last.map_or(0, |(_, ms)| ms),
            errors: errors.list(),
            link_events,
            inbox_high,
            connections_established: established,
            qps,
            replayed,
            bridged,
            regions_written: self.counters.written.load(Ordering::Relaxed),
            regions_verified: self.counters.verified.load(Ordering::Relaxed),
            regions_overtaken: self.counters.overtaken.load(Ordering::Relaxed),
            regions_bad: self.counters.bad.load(Ordering::Relaxed),
            reads_verified: self.counters.reads.load(Ordering::Relaxed),
            onesided_replayed,
            started_unix_ms,
            ended_unix_ms: unix_ms(),
        }
    }
}

/// One look at a wait in [`wait_while_progressing`].
enum Wait {
    /// Nothing more to wait for.
    Over,
    /// Still waiting; the value changes whenever the wait makes progress.
    Pending(u64),
    /// It can no longer end well.
    Abandoned,
}

/// Polls `look` until it says `Over` (true) or `Abandoned` (false), or until `stall`
/// passes with its progress value unchanged (false).
fn wait_while_progressing(stall: Duration, mut look: impl FnMut() -> Wait) -> bool {
    let mut last: Option<(u64, Instant)> = None;
    loop {
        match look() {
            Wait::Over => return true,
            Wait::Abandoned => return false,
            Wait::Pending(p) => match last {
                Some((q, since)) if q == p => {
                    if since.elapsed() >= stall {
                        return false;
                    }
                }
                _ => last = Some((p, Instant::now())),
            },
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs traffic until `stop` is set (or the configured duration passes); returns the report
/// (summed over the connections).
pub fn run(cfg: &TrafficConfig, stop: &AtomicBool) -> Result<Report, TrafficError> {
    let started_unix_ms = unix_ms();
    let endpoints = establish(cfg, stop)?;
    let buffers = endpoints
        .iter()
        .map(|ep| match (cfg.one_sided, ep.migratable()) {
            (None, _) => Ok(None),
            (Some(_), None) => Err(TrafficError::OneSidedNeedsMigratable),
            (Some(os), Some(conn)) => Buffers::set_up(conn, os)
                .map(Some)
                .map_err(TrafficError::OneSided),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = &cfg.ready_file {
        std::fs::write(path, format!("{}\n", unix_ms())).map_err(|source| {
            TrafficError::ReadyFile {
                path: path.clone(),
                source,
            }
        })?;
    }
    let mut flows: Vec<Flow> = endpoints
        .into_iter()
        .zip(buffers)
        .map(|(ep, b)| Flow::start(ep, b, cfg))
        .collect();
    let begin = Instant::now();
    let mut last_progress = begin;
    while !stop.load(Ordering::Relaxed) && cfg.duration.is_none_or(|d| begin.elapsed() < d) {
        let left = cfg
            .duration
            .map_or(STOP_CHECK, |d| d.saturating_sub(begin.elapsed()));
        std::thread::sleep(left.min(STOP_CHECK));
        if let Some(path) = &cfg.progress_file {
            if last_progress.elapsed() >= PROGRESS_INTERVAL {
                last_progress = Instant::now();
                write_progress(path, &flows);
            }
        }
    }
    // Flushes and closes run on all flows at once (bounded), so that shutting down many
    // connections takes about as long as one.
    for f in &mut flows {
        f.stop_sending();
    }
    rdmamig_conn::registry::bounded_parallel(&flows, SHUTDOWN_PARALLEL, |f| {
        f.end_stream(cfg.flush_timeout)
    });
    std::thread::sleep(cfg.linger);
    for f in &mut flows {
        f.stop_receiving();
    }
    rdmamig_conn::registry::bounded_parallel(&flows, SHUTDOWN_PARALLEL, Flow::close);
    let reports = flows
        .into_iter()
        .map(|f| f.finish(cfg, started_unix_ms))
        .collect();
    Ok(Report::merge(reports).expect("establish returns at least one endpoint"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let m = encode_message(42, 7, 256);
        assert_eq!(m.len(), 256);
        assert_eq!(decode_message(&m), Some((42, 7)));
        assert_eq!(decode_message(&m[..10]), None);
        assert_eq!(decode_message(b"xxxxxxxxxxxxxxxxxxxxxxxx"), None);
    }

    #[test]
    fn the_end_of_a_flow_is_not_a_traffic_message() {
        let end = encode_end(36_101);
        assert_eq!(decode_end(&end), Some(36_101));
        assert_eq!(decode_message(&end), None);
        assert_eq!(decode_end(&encode_message(36_101, 7, 256)), None);
        assert_eq!(decode_end(&end[..11]), None);
    }

    #[test]
    fn a_wait_lasts_while_it_progresses_and_gives_up_on_a_stall() {
        let stall = Duration::from_millis(100);
        // Progress every 40 ms for 400 ms: longer than the stall, but never stalled.
        let start = Instant::now();
        let slow = wait_while_progressing(stall, || {
            let step = start.elapsed().as_millis() as u64 / 40;
            if step >= 10 {
                Wait::Over
            } else {
                Wait::Pending(step)
            }
        });
        assert!(slow, "a slow but steady wait must finish");
        assert!(start.elapsed() >= Duration::from_millis(400));
        // No progress at all: given up after about the stall.
        let start = Instant::now();
        assert!(!wait_while_progressing(stall, || Wait::Pending(7)));
        let waited = start.elapsed();
        assert!(waited >= stall && waited < stall * 5, "{waited:?}");
        assert!(!wait_while_progressing(stall, || Wait::Abandoned));
    }

    #[test]
    fn tracker_counts_loss_duplicates_reordering_and_gaps() {
        let mut t = Tracker::default();
        let t0 = Instant::now();
        for (i, c) in [0u64, 1, 2, 5, 3, 3, 6].iter().enumerate() {
            let ms = if i == 3 { 900 } else { i as u64 * 10 };
            t.on_message(*c, t0 + Duration::from_millis(ms), 1000 + ms);
        }
        assert_eq!(t.received, 7);
        assert_eq!(t.lost(), 1); // 4
        assert_eq!(t.reordered, 1); // 3
        assert_eq!(t.duplicated, 1); // second 3
        let (gap, start, end) = t.max_gap.unwrap();
        assert_eq!(gap, Duration::from_millis(880));
        assert_eq!((start, end), (1020, 1900));
    }

    #[test]
    fn time_of_day_formats() {
        assert_eq!(time_of_day(3_723_004), "01:02:03.004");
    }
}
