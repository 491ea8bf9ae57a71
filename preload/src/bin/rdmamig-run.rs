//! `rdmamig-run -- <command> [args...]`: runs an unmodified RDMA program with
//! librdmamig_preload.so preloaded, so that the verbs objects it holds are rdmamig's
//! virtual ones (docs/preload.md).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use clap::Parser;
use rdmamig_preload::run::{find_library, preload_value, LIBRARY_ENV};

/// Runs an unmodified libibverbs program with rdmamig's preload library.
///
/// The program's verbs objects (context, PD, MRs, CQs, QPs, completion channels) become
/// rdmamig's virtual objects over the provider's. Verbs rdmamig cannot carry fail at the call
/// with EOPNOTSUPP, and stderr names them. Run it on both ends of each connection.
///
/// Example: rdmamig-run -- ibv_rc_pingpong -g 1 10.0.0.2
///
/// Exit status: the program's own; 2 if the library is not found; 127 if the program
/// cannot be started.
#[derive(Parser)]
#[command(name = "rdmamig-run", version)]
struct Args {
    /// The preload library (default: $RDMAMIG_PRELOAD, else librdmamig_preload.so beside
    /// this binary or in ../lib/rdmamig/ from it).
    #[arg(long)]
    library: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let exe = std::env::current_exe().unwrap_or_default();
    let library = match find_library(
        args.library.as_deref(),
        std::env::var_os(LIBRARY_ENV).as_deref(),
        &exe,
    ) {
        Ok(library) => library,
        Err(e) => {
            eprintln!("rdmamig-run: {e}");
            return ExitCode::from(2);
        }
    };
    let preload = preload_value(std::env::var_os("LD_PRELOAD").as_deref(), &library);
    let (program, rest) = args
        .command
        .split_first()
        .expect("clap requires the command");
    let error = Command::new(program)
        .args(rest)
        .env("LD_PRELOAD", preload)
        .exec();
    eprintln!(
        "rdmamig-run: cannot run {}: {error}",
        program.to_string_lossy()
    );
    ExitCode::from(127)
}
