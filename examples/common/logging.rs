//! The examples' log output: one `tracing` subscriber, installed first thing in every example's
//! `main` (after `init_cpu_threads` / `init_gemm_threads`, which must run while the process
//! has one thread), so the library's warnings (a store or mesh without a job token, a refused
//! thread tuning, a peer that failed the token check) reach the terminal.
//!
//! - What: `RUST_LOG` if set (e.g. `RUST_LOG=debug`, `RUST_LOG=candle_dtensor_comm=debug`),
//!   else `warn`. As with env_logger, naming a target turns the others off:
//!   `RUST_LOG=warn,candle_dtensor_comm=debug` keeps everyone's warnings. Invalid directives
//!   are ignored with a note on stderr.
//! - Where: stderr, plain text (no colours: the subscriber is built without its `ansi`
//!   feature, so nothing but text reaches a pipe or a log file).
//! - How: `<time> rank=<r>  WARN <target>: <message> <fields>`; `rank=<r>` where the process
//!   knows its rank (`RANK`, as dtrun and torchrun set it, else the rank variable of Open MPI,
//!   MPICH or Slurm), so the lines of a multi-process job say whose they are.

use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::fmt::format::{DefaultFields, Format, Full, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt;

/// The variables a process's rank is read from, first set first: dtrun's and torchrun's, then
/// Open MPI's, MPICH's and Slurm's.
pub const RANK_VARS: [&str; 4] = ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"];

/// Installs the subscriber: `RUST_LOG` (default `warn`) to stderr, with this process's rank.
/// Does nothing when a subscriber is already installed (a test that includes an example).
pub fn init_logging() {
    let spec = std::env::var("RUST_LOG").unwrap_or_default();
    let _ = subscriber(&spec, rank_from_env().as_deref(), std::io::stderr).try_init();
}

/// This process's rank from the first of [`RANK_VARS`] that holds a number.
pub fn rank_from_env() -> Option<String> {
    RANK_VARS.iter().find_map(|v| {
        let r = std::env::var(v).ok()?;
        let r = r.trim();
        r.parse::<u64>().ok().map(|_| r.to_string())
    })
}

/// The subscriber [`init_logging`] installs: `spec` as `RUST_LOG` reads (empty: `warn`), the
/// `rank=` label (none: no label), lines to `writer`.
pub fn subscriber<W>(spec: &str, rank: Option<&str>, writer: W) -> Subscriber<W>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::WARN.into())
        .parse_lossy(spec);
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false)
        .with_target(true)
        .with_timer(Header {
            rank: rank.map(str::to_string),
        })
        .finish()
}

/// What [`subscriber`] returns.
pub type Subscriber<W> =
    tracing_subscriber::fmt::Subscriber<DefaultFields, Format<Full, Header>, EnvFilter, W>;

/// A line's header: the time, then `rank=<r>` when the rank is known.
pub struct Header {
    rank: Option<String>,
}

impl FormatTime for Header {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        SystemTime.format_time(w)?;
        match &self.rank {
            Some(r) => write!(w, " rank={r}"),
            None => Ok(()),
        }
    }
}
