//! rdmamig-perf: the connection library's message rate and latency, measured the way perftest
//! measures raw verbs (ib_send_bw, ib_send_lat), so a benchmark can put the two side by side
//! on the same guests and report the library's overhead as a ratio.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rdmamig_guest::conn::{error_chain, ConnectOptions, Connection, Listener};
use serde::Serialize;

/// Measure rdmamig's migratable connection like perftest measures raw verbs.
///
/// Start `serve` on one machine, then `lat` or `bw` on the other; each run serves one test
/// and prints one JSON line.
///
///   lat: ping-pong of --size byte messages; like ib_send_lat, the latency is half the
///        round trip (`median_us` is its t_typical; `mean_us` is ibv_rc_pingpong's
///        usec/iter halved).
///   bw:  --count messages sent back to back, then a final message the server answers once
///        it has received them all; `msg_rate` is messages per second over that span
///        (ib_send_bw's MsgRate).
///
/// Example:
///   rdmamig-perf serve --listen 10.77.0.11:7480
///   rdmamig-perf lat --to 10.77.0.11:7480 --size 256 --iters 2000
#[derive(Parser, Debug)]
#[command(name = "rdmamig-perf", version, verbatim_doc_comment)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Accept one connection and serve its test: echo `lat` messages, count `bw` messages.
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
        /// The server's address.
        #[arg(long)]
        to: SocketAddr,
        /// Bytes per message.
        #[arg(long, default_value_t = 256)]
        size: usize,
        /// Measured round trips (after as many warm-up ones as perftest does: none counted).
        #[arg(long, default_value_t = 1000)]
        iters: u32,
    },
    /// Message rate: messages back to back.
    Bw {
        /// The server's address.
        #[arg(long)]
        to: SocketAddr,
        /// Bytes per message.
        #[arg(long, default_value_t = 256)]
        size: usize,
        /// Messages sent.
        #[arg(long, default_value_t = 20_000)]
        count: u32,
    },
}

/// First byte of every message: what the server does with it.
const ECHO: u8 = b'E';
const DATA: u8 = b'D';
const FINISH: u8 = b'F';
/// Round trips of the latency test not counted (connection and cache warm-up).
const WARMUP: u32 = 100;
/// How long one message may take before the run is declared failed.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

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
        count: u32,
        seconds: f64,
        msg_rate: f64,
        mbit_s: f64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Serve {
            listen,
            accept_timeout_s,
        } => serve(listen, Duration::from_secs(accept_timeout_s)),
        Cmd::Lat { to, size, iters } => latency(to, size, iters).and_then(print),
        Cmd::Bw { to, size, count } => rate(to, size, count).and_then(print),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmamig-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print(report: Report) -> Result<(), String> {
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| e.to_string())?
    );
    Ok(())
}

/// Options sized for `size`-byte messages; the defaults otherwise (what applications get).
fn options(size: usize) -> ConnectOptions {
    let defaults = ConnectOptions::default();
    ConnectOptions {
        max_message: defaults.max_message.max(size),
        ..defaults
    }
}

fn serve(listen: SocketAddr, accept_timeout: Duration) -> Result<(), String> {
    let opts = options(1 << 16);
    let listener = Listener::bind(listen, &opts).map_err(|e| error_chain(&e))?;
    let conn = listener
        .accept(accept_timeout)
        .map_err(|e| error_chain(&e))?;
    let mut received: u64 = 0;
    loop {
        let msg = match conn.recv(STEP_TIMEOUT) {
            Ok(Some(msg)) => msg,
            Ok(None) => return Err(format!("no message for {STEP_TIMEOUT:?}")),
            Err(e) => return Err(error_chain(&e)),
        };
        match msg.first() {
            Some(&ECHO) => conn.send(&msg).map_err(|e| error_chain(&e))?,
            Some(&DATA) => received += 1,
            Some(&FINISH) => {
                conn.send(&received.to_le_bytes())
                    .map_err(|e| error_chain(&e))?;
                break;
            }
            other => return Err(format!("unexpected message kind {other:?}")),
        }
    }
    // The client closes once it has the answer; wait for that (its close ends the recv) so
    // the answer is delivered before this side's connection goes away.
    let _ = conn.recv(STEP_TIMEOUT);
    Ok(())
}

fn connect(to: SocketAddr, size: usize) -> Result<Connection, String> {
    if size == 0 {
        return Err("--size must be at least 1".into());
    }
    Connection::connect(to, &options(size)).map_err(|e| error_chain(&e))
}

fn latency(to: SocketAddr, size: usize, iters: u32) -> Result<Report, String> {
    let conn = connect(to, size)?;
    let mut msg = vec![0u8; size];
    msg[0] = ECHO;
    let mut samples = Vec::with_capacity(iters as usize);
    for i in 0..WARMUP + iters {
        let started = Instant::now();
        conn.send(&msg).map_err(|e| error_chain(&e))?;
        match conn.recv(STEP_TIMEOUT) {
            Ok(Some(_)) => {}
            Ok(None) => return Err(format!("no echo within {STEP_TIMEOUT:?}")),
            Err(e) => return Err(error_chain(&e)),
        }
        if i >= WARMUP {
            samples.push(started.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    finish(&conn, 0)?;
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

fn rate(to: SocketAddr, size: usize, count: u32) -> Result<Report, String> {
    let conn = connect(to, size)?;
    let mut msg = vec![0u8; size];
    msg[0] = DATA;
    let started = Instant::now();
    for _ in 0..count {
        conn.send(&msg).map_err(|e| error_chain(&e))?;
    }
    finish(&conn, u64::from(count))?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(Report::Bw {
        size,
        count,
        seconds,
        msg_rate: f64::from(count) / seconds,
        mbit_s: f64::from(count) * size as f64 * 8.0 / seconds / 1e6,
    })
}

/// Ends the test: the server answers with how many data messages it received, which must be
/// what was sent (the library promises exactly-once delivery).
fn finish(conn: &Connection, sent: u64) -> Result<(), String> {
    conn.send(&[FINISH]).map_err(|e| error_chain(&e))?;
    let answer = match conn.recv(STEP_TIMEOUT) {
        Ok(Some(answer)) => answer,
        Ok(None) => return Err(format!("no answer to FINISH within {STEP_TIMEOUT:?}")),
        Err(e) => return Err(error_chain(&e)),
    };
    let received = <[u8; 8]>::try_from(answer.as_slice())
        .map(u64::from_le_bytes)
        .map_err(|_| format!("FINISH answered with {} bytes, not 8", answer.len()))?;
    if received != sent {
        return Err(format!(
            "the server received {received} messages, {sent} were sent"
        ));
    }
    conn.close().map_err(|e| error_chain(&e))
}
