//! The backend-neutral conformance suite: what every [`Backend`](candle_dtensor_comm_core::Backend) must do behind
//! a [`Comm`], checked from inside one rank (cargo feature `conformance`).
//!
//! Every rank of a communicator calls [`run`] with the same [`Selection`]; each selected case
//! runs on a fresh communicator split from the one given (so a case that breaks its
//! communicator on purpose, a timeout or an abort, leaves the next case a clean one), every rank
//! checks its own results against a reference computed in place, and the ranks agree on the
//! verdict of each case with one all-gather on the given communicator. The same code therefore
//! tests the `local` backend (ranks as threads, `crates/comm/tests/conformance.rs`), the `mpi` backend
//! (ranks as processes under `mpirun`, `examples/mpi_conformance.rs`) and any other.
//!
//! Areas (see [`cases`] for the list):
//!
//! - `collectives`: every op and its `*_into` variant x dtypes x size classes (zero-length, one
//!   element, uneven, small, large) x reduce ops, plus issue order, barrier and typed errors;
//! - `split`: rows, columns, nested and permuted groups, non-members, bad lists;
//! - `shrink`: dropping ranks that do not take part, bad lists, disagreeing members (the
//!   cases with dead ranks need a launcher that can kill one: the backends' own tests);
//! - `overlap`: one communicator progresses while another waits;
//! - `faults`: missing ranks (timeouts naming them), desync, abort, dropped work;
//! - `hooks`: pre/post/abort hooks and the flight recorder;
//! - `rma`: windows (skipped when the backend has none);
//! - `bad_input`: typed errors carrying the op context, nothing hangs.
//!
//! Checks are `assert!`s inside the cases: a failed check (or an error) fails that case on that
//! rank with a message naming the case, the rank and, for data, the first differing element.
//! The binary must unwind on panic (the default profile does).
//!
//! ```
//! use candle_dtensor_comm_conformance::{run, Selection};
//! use candle_dtensor::comm::LocalWorld;
//!
//! let reports = LocalWorld::run(2, |comm| run(&comm, &Selection::only(&["collectives::broadcast"])))?;
//! assert_eq!(reports[0].passed(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod bad_input;
mod collectives;
mod faults;
mod hooks;
mod overlap;
mod rma;
mod shrink;
mod split;

use std::error::Error;
use std::fmt::{self, Debug};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use candle_dtensor_comm_core::Capabilities;
use candle_dtensor_comm_core::Comm;
use candle_dtensor_comm_core::CommError;
use candle_dtensor_comm_core::{ReduceOp, SUPPORTED_DTYPES};

/// Set (to anything) to run the full sweep (every size class at every world size), as
/// torchcomms' `is_full_sweep()` does; [`Selection::default`] reads it.
pub const FULL_SWEEP_ENV: &str = "CDT_FULL_SWEEP";

/// Which cases [`run`] runs, and how. Every rank must pass an equal selection.
#[derive(Debug, Clone)]
pub struct Selection {
    /// Run the cases these patterns name (all cases when empty). A pattern is a case name
    /// (`"collectives::all_reduce"`) or an area (`"split"`).
    pub include: Vec<String>,
    /// Skip the cases these patterns name (reported as skipped).
    pub exclude: Vec<String>,
    /// Sweep every size class for every (dtype, op) pair instead of a rotating sample.
    pub full_sweep: bool,
    /// The op timeout of the fault cases (ops that must time out wait this long).
    pub fault_timeout: Duration,
}

impl Default for Selection {
    /// Every case; the full sweep when [`FULL_SWEEP_ENV`] is set; 400 ms fault timeout.
    fn default() -> Self {
        Selection {
            include: Vec::new(),
            exclude: Vec::new(),
            full_sweep: std::env::var_os(FULL_SWEEP_ENV).is_some(),
            fault_timeout: Duration::from_millis(400),
        }
    }
}

impl Selection {
    /// Every case.
    pub fn all() -> Self {
        Selection::default()
    }

    /// Only the cases `patterns` name: case names (`"collectives::all_reduce"`) or areas
    /// (`"split"`).
    pub fn only(patterns: &[&str]) -> Self {
        Selection {
            include: patterns.iter().map(|s| s.to_string()).collect(),
            ..Selection::default()
        }
    }

    /// Also skips the cases `patterns` name.
    pub fn excluding(mut self, patterns: &[&str]) -> Self {
        self.exclude.extend(patterns.iter().map(|s| s.to_string()));
        self
    }

    /// Sets the op timeout of the fault cases.
    pub fn with_fault_timeout(mut self, timeout: Duration) -> Self {
        self.fault_timeout = timeout;
        self
    }

    fn included(&self, name: &str) -> bool {
        self.include.is_empty() || self.include.iter().any(|p| pattern_matches(p, name))
    }

    fn excluded(&self, name: &str) -> bool {
        self.exclude.iter().any(|p| pattern_matches(p, name))
    }
}

/// A pattern names one case (`"split::nested_splits"`) or a whole area (`"split"` or
/// `"split::"`).
fn pattern_matches(pattern: &str, name: &str) -> bool {
    let area = pattern.trim_end_matches("::");
    name == pattern
        || name
            .strip_prefix(area)
            .is_some_and(|rest| rest.starts_with("::"))
}

/// A case of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaseInfo {
    /// `area::name`, e.g. `collectives::all_reduce`.
    pub name: &'static str,
    /// The fewest ranks the case needs (it is skipped on smaller communicators).
    pub min_ranks: usize,
    /// What the backend must support for the case to run.
    pub needs: Needs,
}

/// Optional backend features a case needs (from [`Capabilities`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Nothing optional.
    Nothing,
    /// RMA windows with put, get and signals.
    Rma,
    /// Only window creation and fences (a backend with windows but no `get` still runs it).
    RmaPut,
    /// [`Comm::shrink`].
    Shrink,
}

impl Needs {
    fn missing(self, caps: &Capabilities) -> Option<&'static str> {
        match self {
            Needs::Nothing => None,
            Needs::Rma if !(caps.rma_put && caps.rma_get && caps.rma_signal) => {
                Some("the backend has no RMA put/get/signal")
            }
            Needs::RmaPut if !caps.rma_put => Some("the backend has no RMA put"),
            Needs::Shrink if !caps.shrink => Some("the backend cannot shrink"),
            _ => None,
        }
    }
}

/// How a case ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank passed it.
    Passed,
    /// Not run, and why (fewer ranks than it needs, a capability the backend lacks, excluded).
    Skipped(String),
    /// Failed on `ranks`; `detail` is this rank's failure message (`None` if this rank passed).
    Failed {
        /// The ranks (of the communicator given to [`run`]) on which it failed.
        ranks: Vec<usize>,
        /// This rank's message, when this rank is one of them.
        detail: Option<String>,
    },
}

/// One case's result on this rank.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// The case name.
    pub name: &'static str,
    /// How it ended (the same verdict on every rank; only `detail` differs).
    pub outcome: Outcome,
    /// Wall time on this rank.
    pub elapsed: Duration,
}

/// What [`run`] found on this rank.
#[derive(Debug, Clone)]
pub struct Report {
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The backend's registry name.
    pub backend: &'static str,
    /// Every matching case, in suite order.
    pub cases: Vec<CaseReport>,
    /// Total wall time on this rank.
    pub elapsed: Duration,
}

impl Report {
    fn count(&self, f: impl Fn(&Outcome) -> bool) -> usize {
        self.cases.iter().filter(|c| f(&c.outcome)).count()
    }

    /// Cases every rank passed.
    pub fn passed(&self) -> usize {
        self.count(|o| *o == Outcome::Passed)
    }

    /// Cases not run.
    pub fn skipped(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Skipped(_)))
    }

    /// Cases that failed on some rank.
    pub fn failed(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Failed { .. }))
    }

    /// The failed cases, in suite order.
    pub fn failures(&self) -> impl Iterator<Item = &CaseReport> {
        self.cases
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Failed { .. }))
    }
}

impl fmt::Display for Report {
    /// One line: `conformance backend "mpi", 4 ranks: 61 passed, 2 skipped, 0 failed in 12.3 s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "conformance backend \"{}\", {} ranks: {} passed, {} skipped, {} failed in {:.1} s",
            self.backend,
            self.size,
            self.passed(),
            self.skipped(),
            self.failed(),
            self.elapsed.as_secs_f64()
        )
    }
}

/// Why [`run`] did not pass.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    /// Some case failed on some rank. `report` holds every case's outcome.
    #[error("conformance (backend \"{backend}\", rank {rank} of {size}): case {case} failed on ranks {ranks:?}: {detail}", backend = report.backend, size = report.size)]
    Failed {
        /// The first failed case.
        case: &'static str,
        /// This rank.
        rank: usize,
        /// The ranks it failed on.
        ranks: Vec<usize>,
        /// This rank's message, or a pointer to the ranks that have one.
        detail: String,
        /// The whole report.
        report: Box<Report>,
    },
    /// The harness itself could not go on: creating a case communicator or agreeing on a verdict
    /// failed on the communicator given to [`run`].
    #[error("conformance (rank {rank}): harness step `{step}` before/after case {case} failed: {source}")]
    Harness {
        /// This rank.
        rank: usize,
        /// The case being set up or concluded.
        case: &'static str,
        /// `split` or `verdict`.
        step: &'static str,
        /// The communicator error (boxed: it is large, and this error travels by value).
        #[source]
        source: Box<CommError>,
    },
}

/// Runs the selected cases on this rank; every rank of `comm` must call it with an equal
/// selection.
///
/// # Errors
///
/// [`ConformanceError::Failed`] when any case failed on any rank (every rank returns it),
/// [`ConformanceError::Harness`] when `comm` itself broke.
///
/// # Blocking
///
/// Runs every case to the end; each op is bounded by `comm`'s timeouts (or the selection's
/// fault timeout), so a broken backend makes this slow, never hung.
pub fn run(comm: &Comm, sel: &Selection) -> Result<Report, ConformanceError> {
    let t0 = Instant::now();
    let caps = comm.capabilities();
    let mut cases = Vec::new();
    for (info, body) in CASES {
        if !sel.included(info.name) {
            continue;
        }
        let skip = if sel.excluded(info.name) {
            Some("excluded by the selection".to_string())
        } else if comm.size() < info.min_ranks {
            Some(format!(
                "needs {} ranks, the communicator has {}",
                info.min_ranks,
                comm.size()
            ))
        } else {
            info.needs.missing(&caps).map(str::to_string)
        };
        if let Some(reason) = skip {
            cases.push(CaseReport {
                name: info.name,
                outcome: Outcome::Skipped(reason),
                elapsed: Duration::ZERO,
            });
            continue;
        }
        cases.push(run_case(comm, sel, info, *body)?);
    }
    let report = Report {
        rank: comm.rank(),
        size: comm.size(),
        backend: comm.backend_name(),
        cases,
        elapsed: t0.elapsed(),
    };
    let first = report
        .failures()
        .next()
        .map(|c| (c.name, c.outcome.clone()));
    match first {
        None => Ok(report),
        Some((case, Outcome::Failed { ranks, detail })) => Err(ConformanceError::Failed {
            case,
            rank: report.rank,
            detail: detail.unwrap_or_else(|| {
                format!("passed on this rank; see the reports of ranks {ranks:?}")
            }),
            ranks,
            report: Box::new(report),
        }),
        Some(_) => Ok(report),
    }
}

/// Runs one case on a fresh communicator and agrees on its verdict.
fn run_case(
    comm: &Comm,
    sel: &Selection,
    info: &CaseInfo,
    body: CaseFn,
) -> Result<CaseReport, ConformanceError> {
    let harness = |step, source| ConformanceError::Harness {
        rank: comm.rank(),
        case: info.name,
        step,
        source: Box::new(source),
    };
    let all: Vec<usize> = (0..comm.size()).collect();
    let t0 = Instant::now();
    let case_comm = comm
        .split(&all, "case")
        .map_err(|e| harness("split", e))?
        .ok_or_else(|| {
            harness(
                "split",
                CommError::Bootstrap {
                    comm: "case".into(),
                    reason: "a member of the case communicator got none".into(),
                },
            )
        })?;
    let cx = Cx {
        comm: case_comm,
        sel,
    };
    tracing::debug!(case = info.name, rank = comm.rank(), "conformance case");
    let result = match catch_unwind(AssertUnwindSafe(|| body(&cx))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("error: {e}")),
        Err(p) => Err(format!(
            "check failed: {}",
            candle_dtensor_comm_core::kit::cpu::queue::panic_message(&*p)
        )),
    };
    drop(cx);
    let elapsed = t0.elapsed();
    let candle_err = |e: candle_core::Error| CommError::Bootstrap {
        comm: comm.name().into(),
        reason: e.to_string(),
    };
    let flag = Tensor::new(&[u8::from(result.is_err())], &Device::Cpu)
        .map_err(|e| harness("verdict", candle_err(e)))?;
    let flags = comm
        .all_gather_single(&flag)
        .and_then(|w| w.wait())
        .map_err(|e| harness("verdict", e))?
        .to_vec1::<u8>()
        .map_err(|e| harness("verdict", candle_err(e)))?;
    let ranks: Vec<usize> = (0..flags.len()).filter(|&r| flags[r] != 0).collect();
    let outcome = if ranks.is_empty() {
        Outcome::Passed
    } else {
        Outcome::Failed {
            ranks,
            detail: result.err().map(|d| {
                format!(
                    "case {} on rank {} of {}: {d}",
                    info.name,
                    comm.rank(),
                    comm.size()
                )
            }),
        }
    };
    Ok(CaseReport {
        name: info.name,
        outcome,
        elapsed,
    })
}

/// The names and requirements of every case, in the order [`run`] runs them.
pub fn cases() -> Vec<CaseInfo> {
    CASES.iter().map(|(i, _)| *i).collect()
}

type R<T> = Result<T, Box<dyn Error + Send + Sync>>;
type CaseFn = fn(&Cx) -> R<()>;

const fn case(name: &'static str, min_ranks: usize) -> CaseInfo {
    CaseInfo {
        name,
        min_ranks,
        needs: Needs::Nothing,
    }
}

const fn shrink_case(name: &'static str, min_ranks: usize) -> CaseInfo {
    CaseInfo {
        name,
        min_ranks,
        needs: Needs::Shrink,
    }
}

const fn rma_case(name: &'static str, min_ranks: usize) -> CaseInfo {
    CaseInfo {
        name,
        min_ranks,
        needs: Needs::Rma,
    }
}

/// Every case, in run order.
static CASES: &[(CaseInfo, CaseFn)] = &[
    (case("collectives::all_reduce", 1), collectives::all_reduce),
    (
        case("collectives::all_reduce_in_place_large", 1),
        collectives::all_reduce_in_place_large,
    ),
    (
        case("collectives::reduce_scatter_single", 1),
        collectives::reduce_scatter_single,
    ),
    (
        case("collectives::all_gather_single", 1),
        collectives::all_gather_single,
    ),
    (
        case("collectives::all_gather_single_of_a_scalar", 1),
        collectives::all_gather_single_of_a_scalar,
    ),
    (
        case("collectives::all_to_all_single", 1),
        collectives::all_to_all_single,
    ),
    (
        case("collectives::all_to_all_v_single", 1),
        collectives::all_to_all_v_single,
    ),
    (
        case("collectives::all_to_all_v_rows", 1),
        collectives::all_to_all_v_rows,
    ),
    (case("collectives::broadcast", 1), collectives::broadcast),
    (case("collectives::reduce", 1), collectives::reduce),
    (case("collectives::gather", 1), collectives::gather),
    (case("collectives::scatter", 1), collectives::scatter),
    (
        case("collectives::send_recv_ring", 1),
        collectives::send_recv_ring,
    ),
    (
        case("collectives::batch_p2p_all_pairs", 1),
        collectives::batch_p2p_all_pairs,
    ),
    (
        case("collectives::barrier_holds_every_rank", 1),
        collectives::barrier_holds_every_rank,
    ),
    (
        case("collectives::many_ops_in_flight", 1),
        collectives::many_ops_in_flight,
    ),
    (
        case("collectives::avg_on_integers", 1),
        collectives::avg_on_integers,
    ),
    (case("split::rows_and_columns", 1), split::rows_and_columns),
    (
        case("split::list_order_defines_new_ranks", 1),
        split::list_order_defines_new_ranks,
    ),
    (
        case("split::non_members_get_none", 1),
        split::non_members_get_none,
    ),
    (case("split::nested_splits", 1), split::nested_splits),
    (
        case("split::same_name_splits_are_independent", 1),
        split::same_name_splits_are_independent,
    ),
    (case("split::invalid_lists", 1), split::invalid_lists),
    (
        case("split::members_that_disagree", 2),
        split::members_that_disagree,
    ),
    (
        case("split::rank_rejecting_its_list", 2),
        split::rank_rejecting_its_list,
    ),
    (
        shrink_case("shrink::without_the_last_rank", 2),
        shrink::without_the_last_rank,
    ),
    (
        shrink_case("shrink::invalid_lists", 2),
        shrink::invalid_lists,
    ),
    (
        shrink_case("shrink::members_that_disagree", 4),
        shrink::members_that_disagree,
    ),
    (
        case("overlap::comm_b_completes_while_comm_a_waits", 2),
        overlap::comm_b_completes_while_comm_a_waits,
    ),
    (
        case("overlap::all_gather_and_reduce_scatter", 1),
        overlap::all_gather_and_reduce_scatter,
    ),
    (
        case("faults::skipped_collective_times_out", 2),
        faults::skipped_collective_times_out,
    ),
    (
        case("faults::recv_without_send_times_out", 2),
        faults::recv_without_send_times_out,
    ),
    (case("faults::desync", 2), faults::desync),
    (
        case("faults::abort_from_another_thread", 2),
        faults::abort_from_another_thread,
    ),
    (
        case("faults::abort_of_an_idle_comm", 1),
        faults::abort_of_an_idle_comm,
    ),
    (case("faults::dropped_work", 1), faults::dropped_work),
    (
        case("hooks::pre_and_post_hooks", 1),
        hooks::pre_and_post_hooks,
    ),
    (
        case("hooks::abort_hooks_on_timeout", 2),
        hooks::abort_hooks_on_timeout,
    ),
    (
        case("hooks::abort_hooks_on_abort", 1),
        hooks::abort_hooks_on_abort,
    ),
    (
        case("hooks::failed_wait_returns_after_the_hooks", 2),
        hooks::failed_wait_returns_after_the_hooks,
    ),
    (
        case("hooks::concurrent_aborts_return_after_the_hooks", 1),
        hooks::concurrent_aborts_return_after_the_hooks,
    ),
    (case("hooks::flight_recorder", 2), hooks::flight_recorder),
    (
        rma_case("rma::ring_put_signal_get_fence", 1),
        rma::ring_put_signal_get_fence,
    ),
    (
        rma_case("rma::signals_count_and_time_out", 2),
        rma::signals_count_and_time_out,
    ),
    (
        rma_case("rma::out_of_range_accesses", 2),
        rma::out_of_range_accesses,
    ),
    (
        case("bad_input::ranks_out_of_range", 1),
        bad_input::ranks_out_of_range,
    ),
    (
        case("bad_input::dim_0_must_divide", 2),
        bad_input::dim_0_must_divide,
    ),
    (
        case("bad_input::all_to_all_v_bad_lists", 1),
        bad_input::all_to_all_v_bad_lists,
    ),
    (
        case("bad_input::all_to_all_v_inconsistent_lists", 2),
        bad_input::all_to_all_v_inconsistent_lists,
    ),
    (
        case("bad_input::recv_of_another_shape_or_dtype", 2),
        bad_input::recv_of_another_shape_or_dtype,
    ),
    (
        case("bad_input::unsupported_dtypes", 1),
        bad_input::unsupported_dtypes,
    ),
    (
        case("bad_input::bad_outputs_of_into_variants", 1),
        bad_input::bad_outputs_of_into_variants,
    ),
    (
        case("bad_input::bad_scatter_arguments", 2),
        bad_input::bad_scatter_arguments,
    ),
    (
        case("bad_input::non_contiguous_inputs", 1),
        bad_input::non_contiguous_inputs,
    ),
];

/// What a case runs with: a fresh communicator over every rank, and the selection.
struct Cx<'a> {
    comm: Comm,
    sel: &'a Selection,
}

impl Cx<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    /// A new communicator over every rank of the case's (for sub-cases that break theirs).
    fn fresh(&self, name: &str) -> R<Comm> {
        let all: Vec<usize> = (0..self.size()).collect();
        Ok(self
            .comm
            .split(&all, name)?
            .ok_or("a member got no communicator")?)
    }

    /// The case communicator with the fault timeout.
    fn short(&self) -> Comm {
        self.comm.with_timeout(self.sel.fault_timeout)
    }

    /// Whether the large size class runs for this (world, a, b) combination.
    fn sampled(&self, a: usize, b: usize, class: usize) -> bool {
        class != LARGE || (self.size() + a + b) % 3 == 0 || self.sel.full_sweep
    }
}

// ---------------------------------------------------------------------------------------------
// Shared helpers of the cases.
// ---------------------------------------------------------------------------------------------

/// A tensor as the cases compare it: its dims and its values widened to `f64`.
type Out = (Vec<usize>, Vec<f64>);

/// The dtypes and reduce ops the cases sweep: every one a backend must support.
const DTYPES: [DType; 7] = SUPPORTED_DTYPES;
const REDUCE_OPS: [ReduceOp; 5] = ReduceOp::ALL;

/// Size classes: zero-length, one element, uneven, small (< 64 KiB per rank: the eager path of
/// the local backend), large (> 64 KiB per rank for every dtype, u8 included).
const ZERO: usize = 0;
const LARGE: usize = 4;
const CLASSES: usize = 5;
const LARGE_ELEMS: usize = 70_000;

/// The shape of a size class for ops without a divisibility rule.
fn flat_shape(class: usize) -> Vec<usize> {
    match class {
        0 => vec![0],
        1 => vec![1],
        2 => vec![13],
        3 => vec![25, 40],
        _ => vec![LARGE_ELEMS],
    }
}

/// The shape of a size class for ops whose dim 0 must divide by the world size `n`.
fn div_shape(class: usize, n: usize) -> Vec<usize> {
    match class {
        0 => vec![0, 3],
        1 => vec![n],
        2 => vec![13 * n],
        3 => vec![4 * n, 50],
        _ => vec![n, LARGE_ELEMS.div_ceil(n)],
    }
}

fn is_signed(dt: DType) -> bool {
    !matches!(dt, DType::U32 | DType::U8)
}

/// Data for reductions: small integers, exact in every dtype and free of overflow for up to 8
/// ranks, so sums, products, maxima and minima must match the reference bit for bit.
fn red_vals(rank: usize, len: usize, dt: DType, op: ReduceOp, salt: usize) -> Vec<f64> {
    (0..len)
        .map(|i| {
            if op == ReduceOp::Product {
                let m = if (rank + i + salt) % 3 == 0 { 2.0 } else { 1.0 };
                if is_signed(dt) && (rank + 2 * i + salt) % 5 == 0 {
                    -m
                } else {
                    m
                }
            } else {
                let b = ((rank * 7 + i * 3 + salt) % 16) as f64;
                if is_signed(dt) {
                    b - 8.0
                } else {
                    b
                }
            }
        })
        .collect()
}

/// Data for copying ops: distinct per rank and index, exact in every dtype (< 256).
fn copy_vals(rank: usize, len: usize, salt: usize) -> Vec<f64> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7 + salt) % 251) as f64)
        .collect()
}

fn tensor(vals: &[f64], shape: &[usize], dt: DType) -> R<Tensor> {
    Ok(Tensor::from_vec(vals.to_vec(), shape, &Device::Cpu)?.to_dtype(dt)?)
}

fn out(t: &Tensor) -> R<Out> {
    Ok((
        t.dims().to_vec(),
        t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
    ))
}

/// The reduction of `ins` (one vector per rank) as the backends define it: in rank order, `Avg`
/// divides in the accumulator type (f64 for f64, f32 otherwise) and rounds once.
fn reduce_ref(op: ReduceOp, dt: DType, ins: &[Vec<f64>]) -> Vec<f64> {
    let n = ins.len();
    (0..ins[0].len())
        .map(|i| {
            let mut acc = ins[0][i];
            for x in &ins[1..] {
                let x = x[i];
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Product => acc * x,
                    ReduceOp::Max => acc.max(x),
                    ReduceOp::Min => acc.min(x),
                };
            }
            if op != ReduceOp::Avg {
                return acc;
            }
            let q = acc as f32 / n as f32;
            match dt {
                DType::F64 => acc / n as f64,
                DType::F32 => q as f64,
                DType::BF16 => half::bf16::from_f32(q).to_f64(),
                DType::F16 => half::f16::from_f32(q).to_f64(),
                _ => f64::NAN, // avg is rejected for integers before any data moves
            }
        })
        .collect()
}

/// Compares one rank's outputs for one case with the reference, naming the first difference.
fn check(n: usize, rank: usize, case: &dyn Debug, got: &[Out], want: &[Out]) {
    assert_eq!(
        got.len(),
        want.len(),
        "world {n}, rank {rank}, {case:?}: {} outputs, expected {}",
        got.len(),
        want.len()
    );
    for (k, ((gd, gv), (wd, wv))) in got.iter().zip(want).enumerate() {
        assert_eq!(gd, wd, "world {n}, rank {rank}, {case:?}, output {k}: dims");
        assert_eq!(
            gv.len(),
            wv.len(),
            "world {n}, rank {rank}, {case:?}, output {k}: element count"
        );
        if let Some(i) = (0..gv.len()).find(|&i| gv[i].to_bits() != wv[i].to_bits()) {
            panic!(
                "world {n}, rank {rank}, {case:?}, output {k}: element {i} is {} but the reference says {}",
                gv[i], wv[i]
            );
        }
    }
}

/// Runs `body` for every case on this rank and checks the outputs against
/// `reference(n, rank, case)`.
fn sweep<C: Debug>(
    cx: &Cx,
    cases: Vec<C>,
    body: impl Fn(&Comm, &C) -> R<Vec<Out>>,
    reference: impl Fn(usize, usize, &C) -> Vec<Out>,
) -> R<()> {
    let (n, rank) = (cx.size(), cx.rank());
    for c in &cases {
        let got = body(&cx.comm, c)?;
        check(n, rank, c, &got, &reference(n, rank, c));
    }
    Ok(())
}

/// The error of an op that must fail (issue or wait). (This and the next two helpers are
/// public for backend drivers' own tests.)
pub fn fails<T: Debug>(r: Result<T, CommError>, what: &str) -> CommError {
    match r {
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
        Err(e) => e,
    }
}

/// Asserts `e` carries the op context `op`, `comm`, `rank` and that its message leads with it.
pub fn assert_ctx(e: &CommError, op: &str, comm: &str, rank: usize) {
    let ctx = e
        .ctx()
        .unwrap_or_else(|| panic!("error without op context: {e}"));
    assert_eq!(ctx.op.as_str(), op, "{e}");
    assert_eq!(&*ctx.comm, comm, "{e}");
    assert_eq!(ctx.rank, rank, "{e}");
    let msg = e.to_string();
    let lead = format!("{op} (comm \"{comm}\", rank {rank}, seq ");
    assert!(
        msg.starts_with(&lead),
        "{msg:?} does not start with {lead:?}"
    );
}

/// Asserts that a step which must not wait out `timeout` (it fails fast, or completes on its
/// own) took less than three quarters of it. Waiting the timeout out takes all of it, so this
/// still catches that; the other quarter, not a fixed bound of a second or so, is what a slow
/// or loaded machine must exceed to fail it, and drivers give their communicators timeouts of
/// many seconds (what must time out uses [`Selection::fault_timeout`] or a short bootstrap).
#[track_caller]
fn assert_prompt(took: Duration, timeout: Duration, what: &dyn fmt::Display) {
    assert!(
        took < timeout * 3 / 4,
        "{what}: took {took:?}, 3/4 or more of the timeout of {timeout:?} it must not wait out"
    );
}

/// The shorter of `c`'s op and bootstrap timeouts: what a step that issues ops and splits or
/// shrinks could wait out.
fn shorter_timeout(c: &Comm) -> Duration {
    c.timeout().min(c.options().bootstrap_timeout)
}

/// Threads of this process whose name starts with `prefix` (0 where `/proc/self/task` cannot
/// be read): the largest count of three listings, because one listing can skip a live thread
/// when another thread exits while it is read (the kernel walks the thread list by position),
/// and a test binary's other tests start and end threads all the time. For leak checks, wait
/// for several zero counts in a row ([`no_threads_named`]).
pub fn threads_named(prefix: &str) -> usize {
    let listed = || {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                    .filter(|c| c.starts_with(prefix))
                    .count()
            })
            .unwrap_or(0)
    };
    (0..3).map(|_| listed()).max().unwrap_or(0)
}

/// Whether the threads named `prefix*` are gone within `limit`: five zero counts of
/// [`threads_named`] in a row, so that one count that missed a thread cannot pass.
pub fn no_threads_named(prefix: &str, limit: Duration) -> bool {
    let mut zeros = 0;
    eventually(limit, || {
        zeros = if threads_named(prefix) == 0 {
            zeros + 1
        } else {
            0
        };
        zeros >= 5
    })
}

/// Polls `f` until it holds or `limit` passes; returns whether it held.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
