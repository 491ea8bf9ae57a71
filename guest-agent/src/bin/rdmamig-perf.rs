//! rdmamig-perf: the connection library's message rate and latency, measured the way perftest
//! measures raw verbs (ib_send_bw, ib_send_lat), so a benchmark can put the two side by side
//! on the same guests, through either of the library's APIs (blocking or async).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use rdmamig_guest::conn::{
    error_chain, AsyncConnection, AsyncListener, ConnError, ConnectOptions, Connection, Listener,
};
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
    /// messages.
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
}

#[derive(clap::Args, Debug)]
struct Client {
    /// The server's address.
    #[arg(long)]
    to: SocketAddr,
    /// Bytes per message (at least 9: kind and number).
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
    Serve {
        received: u64,
        echoed: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
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
            eprintln!("rdmamig-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<Report, String> {
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
            let limit = match seconds {
                Some(s) => Limit::Seconds(Duration::from_secs_f64(s)),
                None => Limit::Count(count),
            };
            rate(&conn, client.size, limit).await
        }
    }
}

/// One connection through either API, so each test is written once. The blocking calls
/// run on the current-thread runtime's only thread, which has nothing else to do.
enum Conn {
    Blocking(Connection),
    Async(AsyncConnection),
}

impl Conn {
    async fn send(&self, msg: &[u8]) -> Result<(), String> {
        match self {
            Conn::Blocking(c) => c.send(msg),
            Conn::Async(c) => c.send(msg).await,
        }
        .map_err(|e| error_chain(&e))
    }

    /// The next message; running out of time is an error here.
    async fn recv(&self) -> Result<Vec<u8>, String> {
        match self {
            Conn::Blocking(c) => c.recv(STEP_TIMEOUT),
            Conn::Async(c) => c.recv(STEP_TIMEOUT).await,
        }
        .map_err(|e| error_chain(&e))?
        .ok_or_else(|| format!("no message within {STEP_TIMEOUT:?}"))
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

async fn accept(api: Api, listen: SocketAddr, timeout: Duration) -> Result<Conn, String> {
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
    conn.map_err(|e| error_chain(&e))
}

async fn connect(api: Api, client: &Client) -> Result<Conn, String> {
    if client.size < HEADER {
        return Err(format!("--size must be at least {HEADER}"));
    }
    let opts = options(client.size);
    let conn = match api {
        Api::Blocking => Connection::connect(client.to, &opts).map(Conn::Blocking),
        Api::Async => AsyncConnection::connect(client.to, &opts)
            .await
            .map(Conn::Async),
    }
    .map_err(|e| error_chain(&e))?;
    if let Some(path) = &client.ready_file {
        std::fs::write(path, b"").map_err(|e| format!("writing {}: {e}", path.display()))?;
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

fn number_of(msg: &[u8]) -> Result<u64, String> {
    msg.get(1..HEADER)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| format!("a {}-byte message has no number", msg.len()))
}

async fn serve(conn: &Conn) -> Result<Report, String> {
    let (mut received, mut echoed) = (0u64, 0u64);
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
                    return Err(format!(
                        "data message {number} arrived after {received}: lost, duplicated or \
                         reordered"
                    ));
                }
                received = number;
            }
            Some(&FINISH) => {
                conn.send(&received.to_le_bytes()).await?;
                break;
            }
            other => return Err(format!("unexpected message kind {other:?}")),
        }
    }
    // The client closes once it has the answer; wait for that (its close ends the recv) so
    // the answer is delivered before this side's connection goes away.
    let _ = conn.recv().await;
    Ok(Report::Serve { received, echoed })
}

async fn latency(conn: &Conn, size: usize, iters: u32) -> Result<Report, String> {
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

/// When a message-rate run stops sending.
enum Limit {
    Count(u64),
    Seconds(Duration),
}

async fn rate(conn: &Conn, size: usize, limit: Limit) -> Result<Report, String> {
    let started = Instant::now();
    let mut sent = 0u64;
    while match limit {
        Limit::Count(n) => sent < n,
        Limit::Seconds(d) => started.elapsed() < d,
    } {
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

/// Ends the test: the server answers with how many data messages it received in order, which
/// must be what was sent (the library promises exactly-once, in-order delivery).
async fn finish(conn: &Conn, sent: u64) -> Result<(), String> {
    conn.send(&[FINISH]).await?;
    let answer = conn.recv().await?;
    let received = <[u8; 8]>::try_from(answer.as_slice())
        .map(u64::from_le_bytes)
        .map_err(|_| format!("FINISH answered with {} bytes, not 8", answer.len()))?;
    if received != sent {
        return Err(format!(
            "the server received {received} messages, {sent} were sent"
        ));
    }
    conn.close().await.map_err(|e| error_chain(&e))
}
