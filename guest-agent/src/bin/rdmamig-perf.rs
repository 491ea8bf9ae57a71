//! rdmamig-perf: the connection library's message rate and latency, measured the way perftest
//! measures raw verbs (ib_send_bw, ib_send_lat), so a benchmark can put the two side by side
//! on the same guests, through either of the library's APIs (blocking or async); and its
//! one-sided WRITE and READ, checked region by region by the buffer's owner.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use rdmamig_conn::{
    error_chain, Access, AsyncConnection, AsyncListener, ConnError, ConnectOptions, Connection,
    Exposed, Listener, RemoteBuffer,
};
use rdmamig_guest::traffic::regions::{self, Notice, Verdict, NOTICE_LEN, STAMP_LEN};
use serde::Serialize;

/// Measure rdmamig's migratable connection like perftest measures raw verbs.
///
/// Start `serve` on one machine, then `lat` or `bw` on the other; each run serves one test
/// and prints one JSON line. Every data message carries its number and the server checks
/// that they arrive exactly once and in order, so a run across a move also proves that.
///
///   lat: ping-pong of --size byte messages; like ib_send_lat, the latency is half the
///        round trip (`median_us` is its t_typical; `mean_us` is ibv_rc_pingpong's
///        usec/iter halved).
///   bw:  messages back to back (--count of them, or for --seconds), then a final message
///        the server answers once it has received them all; `msg_rate` is messages per
///        second over that span (ib_send_bw's MsgRate).
///   write: the server exposes a buffer of --regions regions of --size bytes; the client
///        takes its handle, then region after region RDMA WRITEs a pattern, waits for the
///        WRITE to complete, sends a notice with the region's checksum, waits for the server
///        to verify it in its buffer, and READs the region back; `region_rate` is regions
///        per second through that whole round.
///   pair: `serve` and `lat` against it in this one process, at once, on its one runtime
///        thread (async API only): with the async API the connections' workers are tasks
///        on that thread too, so this runs only if none of them ever blocks it.
///
/// Example:
///   rdmamig-perf serve --listen 10.77.0.11:7480
///   rdmamig-perf lat --to 10.77.0.11:7480 --size 256 --iters 2000 --api async
#[derive(Parser, Debug)]
#[command(name = "rdmamig-perf", version, verbatim_doc_comment)]
struct Cli {
    /// Which of the library's APIs to measure.
    #[arg(long, value_enum, default_value_t = Api::Blocking, global = true)]
    api: Api,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Api {
    /// `Connection`: calls that block the calling thread.
    Blocking,
    /// `AsyncConnection` on a tokio runtime.
    Async,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Accept one connection and serve its test: echo `lat` messages, check and count `bw`
    /// messages, expose a buffer for `write` and verify each region written into it.
    Serve {
        /// Address to listen on (an address of the RDMA device).
        #[arg(long)]
        listen: SocketAddr,
        /// How long to wait for the client, in seconds.
        #[arg(long, default_value_t = 60)]
        accept_timeout_s: u64,
    },
    /// Latency: ping-pong, one message in flight.
    Lat {
        #[command(flatten)]
        client: Client,
        /// Measured round trips (after 100 uncounted warm-up ones).
        #[arg(long, default_value_t = 1000)]
        iters: u32,
    },
    /// Message rate: messages back to back.
    Bw {
        #[command(flatten)]
        client: Client,
        /// Messages sent.
        #[arg(long, default_value_t = 20_000, conflicts_with = "seconds")]
        count: u64,
        /// Send for this many seconds instead of a count.
        #[arg(long)]
        seconds: Option<f64>,
    },
    /// One-sided: RDMA WRITE regions of the server's buffer, each verified by the server,
    /// and READ them back.
    Write {
        #[command(flatten)]
        client: Client,
        /// Regions of the server's buffer, written in turn.
        #[arg(long, default_value_t = 16)]
        regions: u32,
        /// Regions written.
        #[arg(long, default_value_t = 2_000, conflicts_with = "seconds")]
        count: u64,
        /// Write for this many seconds instead of a count.
        #[arg(long)]
        seconds: Option<f64>,
    },
    /// Both ends in this process on its one runtime thread: a server and a latency client
    /// connected to it (async API only).
    Pair {
        /// Address to listen on and connect to (an address of the RDMA device).
        #[arg(long)]
        listen: SocketAddr,
        /// Measured round trips (after 100 uncounted warm-up ones).
        #[arg(long, default_value_t = 200)]
        iters: u32,
    },
}

#[derive(clap::Args, Debug)]
struct Client {
    /// The server's address.
    #[arg(long)]
    to: SocketAddr,
    /// Bytes per message (at least 9: kind and number), or per region for `write`.
    #[arg(long, default_value_t = 256)]
    size: usize,
    /// Create this file once connected.
    #[arg(long)]
    ready_file: Option<PathBuf>,
}

/// First byte of every message: what the server does with it.
const ECHO: u8 = b'E';
const DATA: u8 = b'D';
const FINISH: u8 = b'F';
/// `write`: expose the buffer (region size and count follow), and a region's notice.
const EXPOSE: u8 = b'X';
const NOTICE: u8 = b'N';
/// The handle of the buffer the server exposes for `write`.
const BUFFER: u64 = 1;
/// The largest buffer the server exposes.
const MAX_BUFFER: u64 = 64 << 20;
/// Kind byte and message number.
const HEADER: usize = 9;
/// Round trips of the latency test not counted (connection and cache warm-up).
const WARMUP: u32 = 100;
/// How long one message may take before the run is declared failed (a move's blackout
/// included).
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Serialize)]
#[serde(tag = "test", rename_all = "snake_case")]
enum Report {
    Lat {
        size: usize,
        iters: u32,
        median_us: f64,
        mean_us: f64,
        p99_us: f64,
        min_us: f64,
    },
    Bw {
        size: usize,
        count: u64,
        seconds: f64,
        msg_rate: f64,
        mbit_s: f64,
    },
    Write {
        size: usize,
        regions: u32,
        count: u64,
        reads: u64,
        seconds: f64,
        region_rate: f64,
        /// QPs the connection had: more than one if it moved meanwhile.
        established: u64,
    },
    Serve {
        received: u64,
        echoed: u64,
        verified: u64,
    },
    Pair {
        /// Messages the server echoed.
        echoed: u64,
        /// The client's report.
        lat: Box<Report>,
    },
}

/// What failed in a test run (printed with its chain, one line).
#[derive(Debug, thiserror::Error)]
enum PerfError {
    /// The connection, its listener or a one-sided call failed.
    #[error(transparent)]
    Conn(#[from] ConnError),
    /// The step's message did not arrive in time.
    #[error("no message within {STEP_TIMEOUT:?}")]
    NoMessage,
    /// `pair` runs both ends on one thread.
    #[error("pair needs --api async (a blocking accept would hold the thread)")]
    PairNeedsAsync,
    /// `pair`'s server end failed.
    #[error("the server")]
    Server(#[source] Box<PerfError>),
    /// `pair`'s client end failed.
    #[error("the client")]
    Client(#[source] Box<PerfError>),
    /// `pair`'s server end reported something else than a serve report.
    #[error("the server reported {0:?}")]
    ServerReported(Box<Report>),
    /// --size below a message's header.
    #[error("--size must be at least {HEADER}")]
    SizeTooSmall,
    /// Writing the ready file failed.
    #[error("writing {}", path.display())]
    ReadyFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A message too short to carry its number.
    #[error("a {len}-byte message has no number")]
    NoNumber {
        /// Its length.
        len: usize,
    },
    /// A data message out of order: the library lost, duplicated or reordered one.
    #[error("data message {number} arrived after {received}: lost, duplicated or reordered")]
    OutOfOrder {
        /// The message's number.
        number: u64,
        /// The last number received in order.
        received: u64,
    },
    /// A NOTICE came before the EXPOSE.
    #[error("a notice before the buffer")]
    NoticeBeforeBuffer,
    /// A NOTICE that does not decode.
    #[error("a malformed notice")]
    MalformedNotice,
    /// The region named by a notice does not hold what it says.
    #[error("region check failed: {0:?}")]
    RegionCheck(Verdict),
    /// A message of no known kind.
    #[error("unexpected message kind {0:?}")]
    UnexpectedKind(Option<u8>),
    /// An EXPOSE with a zero or too large size.
    #[error(
        "a bad expose request {msg:?}: regions and size must be non-zero, the buffer at most \
         {MAX_BUFFER} bytes"
    )]
    BadExpose {
        /// The message.
        msg: Vec<u8>,
    },
    /// `write` with no region or regions below a stamp.
    #[error("--regions must be at least 1 and --size at least {STAMP_LEN}")]
    BadWriteArgs,
    /// The server's count of verified regions is not the count written.
    #[error("region {region} round {round}: the server verified {verified} regions, {count} were written")]
    VerifiedMismatch {
        /// The region.
        region: u32,
        /// The round.
        round: u64,
        /// What the server verified.
        verified: u64,
        /// What was written.
        count: u64,
    },
    /// A READ returned other bytes than the WRITE put there.
    #[error("region {region} round {round}: the READ returned other bytes than were written")]
    ReadMismatch {
        /// The region.
        region: u32,
        /// The round.
        round: u64,
    },
    /// An answer that is not an 8-byte count.
    #[error("{what} answered with {len} bytes, not 8")]
    BadCount {
        /// What was answered.
        what: &'static str,
        /// The answer's length.
        len: usize,
    },
    /// The server received another count of messages than were sent.
    #[error("the server received {received} messages, {sent} were sent")]
    ReceivedMismatch {
        /// What the server received in order.
        received: u64,
        /// What was sent.
        sent: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The async API's connection workers run on this runtime too: IO and time enabled.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("rdmamig-perf: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(report) => {
            println!("{}", serde_json::json!(report));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rdmamig-perf: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<Report, PerfError> {
    match cli.cmd {
        Cmd::Serve {
            listen,
            accept_timeout_s,
        } => {
            let conn = accept(cli.api, listen, Duration::from_secs(accept_timeout_s)).await?;
            serve(&conn).await
        }
        Cmd::Lat { client, iters } => {
            let conn = connect(cli.api, &client).await?;
            latency(&conn, client.size, iters).await
        }
        Cmd::Bw {
            client,
            count,
            seconds,
        } => {
            let conn = connect(cli.api, &client).await?;
            rate(&conn, client.size, Limit::new(count, seconds)).await
        }
        Cmd::Write {
            client,
            regions,
            count,
            seconds,
        } => {
            let conn = connect(cli.api, &client).await?;
            one_sided(&conn, client.size, regions, Limit::new(count, seconds)).await
        }
        Cmd::Pair { listen, iters } => pair(cli.api, listen, iters).await,
    }
}

/// `serve` and `lat` against it, joined on this task: both ends' waits (and, with the
/// async API, both workers) share the one runtime thread.
async fn pair(api: Api, listen: SocketAddr, iters: u32) -> Result<Report, PerfError> {
    if !matches!(api, Api::Async) {
        return Err(PerfError::PairNeedsAsync);
    }
    let client = Client {
        to: listen,
        size: 256,
        ready_file: None,
    };
    let server = async {
        let conn = accept(api, listen, Duration::from_secs(60)).await?;
        serve(&conn).await
    };
    let client = async {
        let conn = connect(api, &client).await?;
        latency(&conn, client.size, iters).await
    };
    match tokio::join!(server, client) {
        (Ok(Report::Serve { echoed, .. }), Ok(lat)) => Ok(Report::Pair {
            echoed,
            lat: Box::new(lat),
        }),
        (Err(e), _) => Err(PerfError::Server(Box::new(e))),
        (_, Err(e)) => Err(PerfError::Client(Box::new(e))),
        (Ok(other), _) => Err(PerfError::ServerReported(Box::new(other))),
    }
}

/// One connection through either API, so each test is written once. The blocking calls
/// run on the current-thread runtime's only thread, which has nothing else to do.
enum Conn {
    Blocking(Connection),
    Async(AsyncConnection),
}

impl Conn {
    async fn send(&self, msg: &[u8]) -> Result<(), PerfError> {
        match self {
            Conn::Blocking(c) => c.send(msg),
            Conn::Async(c) => c.send(msg).await,
        }
        .map_err(PerfError::from)
    }

    /// The next message; running out of time is an error here.
    async fn recv(&self) -> Result<Vec<u8>, PerfError> {
        match self {
            Conn::Blocking(c) => c.recv(STEP_TIMEOUT),
            Conn::Async(c) => c.recv(STEP_TIMEOUT).await,
        }
        .map_err(PerfError::from)?
        .ok_or(PerfError::NoMessage)
    }

    fn expose(&self, len: usize) -> Result<Exposed, PerfError> {
        match self {
            Conn::Blocking(c) => c.expose(Some(BUFFER), len, Access::ReadWrite),
            Conn::Async(c) => c.expose(Some(BUFFER), len, Access::ReadWrite),
        }
        .map_err(PerfError::from)
    }

    async fn remote(&self, handle: u64) -> Result<RemoteBuffer, PerfError> {
        match self {
            Conn::Blocking(c) => c.remote(handle, STEP_TIMEOUT),
            Conn::Async(c) => c.remote(handle, STEP_TIMEOUT).await,
        }
        .map_err(PerfError::from)
    }

    async fn write(&self, to: &RemoteBuffer, offset: u64, data: &[u8]) -> Result<(), PerfError> {
        match self {
            Conn::Blocking(c) => c.write(to, offset, data),
            Conn::Async(c) => c.write(to, offset, data).await,
        }
        .map_err(PerfError::from)
    }

    async fn flush_writes(&self) -> Result<(), PerfError> {
        match self {
            Conn::Blocking(c) => c.flush_writes(STEP_TIMEOUT),
            Conn::Async(c) => c.flush_writes(STEP_TIMEOUT).await,
        }
        .map_err(PerfError::from)
    }

    async fn read(
        &self,
        from: &RemoteBuffer,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, PerfError> {
        match self {
            Conn::Blocking(c) => c.read(from, offset, len, STEP_TIMEOUT),
            Conn::Async(c) => c.read(from, offset, len, STEP_TIMEOUT).await,
        }
        .map_err(PerfError::from)
    }

    /// Times a QP was established (1 + reconnects).
    fn established(&self) -> u64 {
        match self {
            Conn::Blocking(c) => c.stats(),
            Conn::Async(c) => c.stats(),
        }
        .established
    }

    async fn close(&self) -> Result<(), ConnError> {
        match self {
            Conn::Blocking(c) => c.close(),
            Conn::Async(c) => c.close().await,
        }
    }
}

/// Options sized for `size`-byte messages; the defaults otherwise (what applications get).
fn options(size: usize) -> ConnectOptions {
    let defaults = ConnectOptions::default();
    ConnectOptions {
        max_message: defaults.max_message.max(size),
        ..defaults
    }
}

async fn accept(api: Api, listen: SocketAddr, timeout: Duration) -> Result<Conn, PerfError> {
    let opts = options(1 << 16);
    let conn = match api {
        Api::Blocking => Listener::bind(listen, &opts)
            .and_then(|l| l.accept(timeout))
            .map(Conn::Blocking),
        Api::Async => match AsyncListener::bind(listen, &opts) {
            Ok(l) => l.accept(timeout).await.map(Conn::Async),
            Err(e) => Err(e),
        },
    };
    conn.map_err(PerfError::from)
}

async fn connect(api: Api, client: &Client) -> Result<Conn, PerfError> {
    if client.size < HEADER {
        return Err(PerfError::SizeTooSmall);
    }
    let opts = options(client.size);
    let conn = match api {
        Api::Blocking => Connection::connect(client.to, &opts).map(Conn::Blocking),
        Api::Async => AsyncConnection::connect(client.to, &opts)
            .await
            .map(Conn::Async),
    }
    .map_err(PerfError::from)?;
    if let Some(path) = &client.ready_file {
        std::fs::write(path, b"").map_err(|source| PerfError::ReadyFile {
            path: path.clone(),
            source,
        })?;
    }
    Ok(conn)
}

/// A message of `size` bytes: `kind`, then `number` (little endian), then zeros.
fn message(kind: u8, number: u64, size: usize) -> Vec<u8> {
    let mut msg = vec![0u8; size.max(HEADER)];
    msg[0] = kind;
    msg[1..HEADER].copy_from_slice(&number.to_le_bytes());
    msg
}

fn number_of(msg: &[u8]) -> Result<u64, PerfError> {
    msg.get(1..HEADER)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .ok_or(PerfError::NoNumber { len: msg.len() })
}

async fn serve(conn: &Conn) -> Result<Report, PerfError> {
    let (mut received, mut echoed, mut verified) = (0u64, 0u64, 0u64);
    // `write`'s buffer and its region size, once the client asked for it.
    let mut buffer: Option<(Exposed, usize)> = None;
    loop {
        let msg = conn.recv().await?;
        match msg.first() {
            Some(&ECHO) => {
                conn.send(&msg).await?;
                echoed += 1;
            }
            Some(&DATA) => {
                let number = number_of(&msg)?;
                if number != received + 1 {
                    return Err(PerfError::OutOfOrder { number, received });
                }
                received = number;
            }
            Some(&EXPOSE) => {
                let (size, regions) = expose_request(&msg)?;
                buffer = Some((conn.expose(size * regions)?, size));
            }
            Some(&NOTICE) => {
                let (exposed, size) = buffer.as_ref().ok_or(PerfError::NoticeBeforeBuffer)?;
                let notice = Notice::decode(&msg[1..]).ok_or(PerfError::MalformedNotice)?;
                let mut found = vec![0u8; *size];
                exposed
                    .read(notice.region as usize * size, &mut found)
                    .map_err(PerfError::from)?;
                // The client waits for each answer: its next write cannot overtake this one.
                match regions::verify(&found, &notice) {
                    Verdict::Good => verified += 1,
                    other => return Err(PerfError::RegionCheck(other)),
                }
                conn.send(&verified.to_le_bytes()).await?;
            }
            Some(&FINISH) => {
                conn.send(&received.to_le_bytes()).await?;
                break;
            }
            other => return Err(PerfError::UnexpectedKind(other.copied())),
        }
    }
    // The client closes once it has the answer; wait for that (its close ends the recv) so
    // the answer is delivered before this side's connection goes away.
    let _ = conn.recv().await;
    Ok(Report::Serve {
        received,
        echoed,
        verified,
    })
}

async fn latency(conn: &Conn, size: usize, iters: u32) -> Result<Report, PerfError> {
    let mut samples = Vec::with_capacity(iters as usize);
    for i in 0..WARMUP + iters {
        let started = Instant::now();
        conn.send(&message(ECHO, u64::from(i), size)).await?;
        conn.recv().await?;
        if i >= WARMUP {
            samples.push(started.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    finish(conn, 0).await?;
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Ok(Report::Lat {
        size,
        iters,
        median_us: at(0.5),
        mean_us: samples.iter().sum::<f64>() / samples.len() as f64,
        p99_us: at(0.99),
        min_us: at(0.0),
    })
}

/// When a message-rate or write run stops.
enum Limit {
    Count(u64),
    Seconds(Duration),
}

impl Limit {
    fn new(count: u64, seconds: Option<f64>) -> Limit {
        match seconds {
            Some(s) => Limit::Seconds(Duration::from_secs_f64(s)),
            None => Limit::Count(count),
        }
    }

    /// Whether a run that started at `started` and did `done` goes on.
    fn more(&self, done: u64, started: Instant) -> bool {
        match self {
            Limit::Count(n) => done < *n,
            Limit::Seconds(d) => started.elapsed() < *d,
        }
    }
}

async fn rate(conn: &Conn, size: usize, limit: Limit) -> Result<Report, PerfError> {
    let started = Instant::now();
    let mut sent = 0u64;
    while limit.more(sent, started) {
        sent += 1;
        conn.send(&message(DATA, sent, size)).await?;
    }
    finish(conn, sent).await?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(Report::Bw {
        size,
        count: sent,
        seconds,
        msg_rate: sent as f64 / seconds,
        mbit_s: sent as f64 * size as f64 * 8.0 / seconds / 1e6,
    })
}

/// `write`'s first message: expose `regions` regions of `size` bytes.
fn expose_message(size: usize, regions: u32) -> Vec<u8> {
    let mut msg = vec![EXPOSE];
    msg.extend_from_slice(&(size as u64).to_le_bytes());
    msg.extend_from_slice(&regions.to_le_bytes());
    msg
}

/// The region size and count of an expose message, checked against [`MAX_BUFFER`].
fn expose_request(msg: &[u8]) -> Result<(usize, usize), PerfError> {
    let size = msg
        .get(1..9)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes);
    let regions = msg
        .get(9..13)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes);
    match (size, regions) {
        (Some(size), Some(regions))
            if size > 0
                && regions > 0
                && size
                    .checked_mul(u64::from(regions))
                    .is_some_and(|n| n <= MAX_BUFFER) =>
        {
            Ok((size as usize, regions as usize))
        }
        _ => Err(PerfError::BadExpose { msg: msg.to_vec() }),
    }
}

/// Writes region after region of the server's buffer through its handle: each WRITE is
/// completed before its notice is sent (so the notice arrives after the data), the server's
/// answer says it verified the region in its own memory, and a READ must return the same.
async fn one_sided(
    conn: &Conn,
    size: usize,
    regions: u32,
    limit: Limit,
) -> Result<Report, PerfError> {
    if regions == 0 || size < STAMP_LEN {
        return Err(PerfError::BadWriteArgs);
    }
    conn.send(&expose_message(size, regions)).await?;
    let buffer = conn.remote(BUFFER).await?;
    let started = Instant::now();
    let (mut count, mut reads) = (0u64, 0u64);
    while limit.more(count, started) {
        let region = (count % u64::from(regions)) as u32;
        let round = count / u64::from(regions);
        let (data, checksum) = regions::fill(round, region, size);
        let at = u64::from(region) * size as u64;
        conn.write(&buffer, at, &data).await?;
        conn.flush_writes().await?;
        let mut notice = vec![0u8; 1 + NOTICE_LEN];
        notice[0] = NOTICE;
        Notice {
            region,
            round,
            checksum,
        }
        .encode(&mut notice[1..]);
        conn.send(&notice).await?;
        count += 1;
        let verified = count_in(&conn.recv().await?, "a notice")?;
        if verified != count {
            return Err(PerfError::VerifiedMismatch {
                region,
                round,
                verified,
                count,
            });
        }
        if conn.read(&buffer, at, size).await? != data {
            return Err(PerfError::ReadMismatch { region, round });
        }
        reads += 1;
    }
    finish(conn, 0).await?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(Report::Write {
        size,
        regions,
        count,
        reads,
        seconds,
        region_rate: count as f64 / seconds,
        established: conn.established(),
    })
}

/// The count the server answers `what` with.
fn count_in(answer: &[u8], what: &'static str) -> Result<u64, PerfError> {
    <[u8; 8]>::try_from(answer)
        .map(u64::from_le_bytes)
        .map_err(|_| PerfError::BadCount {
            what,
            len: answer.len(),
        })
}

/// Ends the test: the server answers with how many data messages it received in order, which
/// must be what was sent (the library promises exactly-once, in-order delivery).
async fn finish(conn: &Conn, sent: u64) -> Result<(), PerfError> {
    conn.send(&[FINISH]).await?;
    let answer = conn.recv().await?;
    let received = count_in(&answer, "FINISH")?;
    if received != sent {
        return Err(PerfError::ReceivedMismatch { received, sent });
    }
    conn.close().await.map_err(PerfError::from)
}
