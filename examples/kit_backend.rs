//! A backend written outside the comm crates, against the public kit only
//! (`candle_dtensor::comm::kit`): the proof that the seam between the `Comm` front and a
//! transport is a crate boundary.
//!
//! ```text
//! cargo run --example kit_backend
//! ```
//!
//! The `mailbox` backend runs the ranks of a world as threads of one process that exchange
//! byte buffers ([`Bytes`]) through a shared mailbox (a `Mutex<HashMap>` and a `Condvar`),
//! reduce them with the kit's CPU kernels ([`cpu::reduced`]), run their operations in issue
//! order on the kit's per-communicator queue ([`Queue`]), and check `split` lists with the
//! kit's rule ([`check_split_lists`]). It registers itself with `register_backend`, creates
//! world communicators with `new_comm("mailbox", ..)`, and runs the conformance suite's basic
//! cases (all-reduce, all-gather, reduce-scatter, broadcast, barrier) on worlds of 1, 2 and 3
//! ranks; the exit status is non-zero when any case fails on any rank. `tests/kit_backend.rs`
//! runs the same check under `cargo test`.
//!
//! Every wait is bounded: a receive waits at most the op's timeout and then fails with
//! [`CommError::Timeout`] naming the silent ranks; `abort` wakes every waiter.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Shape, Tensor};
use candle_dtensor::comm::conformance::{run, Selection};
use candle_dtensor::comm::kit::cpu::{self, bytes::Bytes, kernels::read_view, queue::Queue};
use candle_dtensor::comm::kit::desc::check_split_lists;
use candle_dtensor::comm::kit::dtype_names;
use candle_dtensor::comm::{
    new_comm, register_backend, Backend, BackendFactory, Capabilities, Collective,
    CollectiveOutput, CommError, CommOptions, OpCtx, Result, Work, SUPPORTED_DTYPES,
};

/// The name the backend registers under.
pub const NAME: &str = "mailbox";

/// The conformance cases this backend must pass (it implements what they need: the dense
/// collectives, broadcast, barrier, and the split every case runs on).
pub const CASES: &[&str] = &[
    "collectives::all_reduce",
    "collectives::all_gather_single",
    "collectives::all_gather_single_of_a_scalar",
    "collectives::reduce_scatter_single",
    "collectives::broadcast",
    "collectives::barrier_holds_every_rank",
];

/// A message's address: (communicator id, collective index, from, to), ranks in the world.
type Key = (Arc<str>, u64, usize, usize);

/// What the rank threads of one world share.
#[derive(Default)]
struct Mailbox {
    slots: Mutex<HashMap<Key, Bytes>>,
    arrived: Condvar,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, HashMap<Key, Bytes>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's side of one communicator, shared with the ops its queue runs.
struct Inner {
    mailbox: Arc<Mailbox>,
    /// The same on every member; unique among the world's communicators.
    id: Arc<str>,
    /// World rank of each communicator rank.
    members: Vec<usize>,
    rank: usize,
    device: Device,
    aborted: Mutex<Option<String>>,
}

impl Inner {
    fn size(&self) -> usize {
        self.members.len()
    }

    fn aborted(&self) -> Option<String> {
        self.aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn key(&self, coll: u64, from: usize, to: usize) -> Key {
        (self.id.clone(), coll, self.members[from], self.members[to])
    }

    /// Sends `mine[r]` to every rank r and returns what every rank sent to this one, in rank
    /// order (this rank's own piece included), waiting at most `ctx.timeout`.
    fn exchange(&self, ctx: &OpCtx, coll: u64, mine: Vec<Bytes>) -> Result<Vec<Bytes>> {
        let me = self.rank;
        let mut own = None;
        {
            let mut slots = self.mailbox.lock();
            for (to, b) in mine.into_iter().enumerate() {
                if to == me {
                    own = Some(b);
                } else {
                    slots.insert(self.key(coll, me, to), b);
                }
            }
        }
        self.mailbox.arrived.notify_all();
        let mut got = Vec::with_capacity(self.size());
        for from in 0..self.size() {
            got.push(if from == me {
                own.take().unwrap_or_else(|| Bytes::zeroed(0))
            } else {
                self.recv(ctx, coll, from)?
            });
        }
        Ok(got)
    }

    /// Waits for the message of `from` at collective `coll`, until `ctx.timeout` passes or
    /// the communicator is aborted.
    fn recv(&self, ctx: &OpCtx, coll: u64, from: usize) -> Result<Bytes> {
        let key = self.key(coll, from, self.rank);
        let deadline = Instant::now() + ctx.timeout;
        let mut slots = self.mailbox.lock();
        loop {
            if let Some(b) = slots.remove(&key) {
                return Ok(b);
            }
            if let Some(reason) = self.aborted() {
                return Err(CommError::Aborted {
                    ctx: ctx.clone(),
                    reason,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                // Every peer whose message has not arrived either.
                let missing = (0..self.size())
                    .filter(|&r| {
                        r != self.rank && !slots.contains_key(&self.key(coll, r, self.rank))
                    })
                    .collect();
                return Err(CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: ctx.timeout,
                    missing,
                });
            }
            slots = self
                .mailbox
                .arrived
                .wait_timeout(slots, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Runs one collective on this rank (on the queue's progress thread).
    fn run(&self, ctx: &OpCtx, coll: u64, op: Collective) -> Result<CollectiveOutput> {
        let n = self.size();
        let copies = |b: &[u8]| (0..n).map(|_| Bytes::copy_of(b)).collect::<Vec<_>>();
        match op {
            Collective::AllReduce { input, op, output } => {
                let all = self.exchange(ctx, coll, copies(&bytes_of(ctx, &input)?))?;
                let srcs: Vec<&[u8]> = all.iter().map(Bytes::bytes).collect();
                let buf = cpu::reduced(ctx, input.dtype(), op, &srcs, input.elem_count())?;
                // SAFETY: `reduced` wrote every element of `buf`.
                let t = unsafe { cpu::deliver(ctx, buf, input.shape().clone(), output) }?;
                Ok(t.into())
            }
            Collective::AllGather { input, output } => {
                let all = self.exchange(ctx, coll, copies(&bytes_of(ctx, &input)?))?;
                let mut dims = input.dims().to_vec();
                match dims.first_mut() {
                    Some(d0) => *d0 *= n,
                    None => dims.push(n),
                }
                Ok(concat(ctx, &all, input.dtype(), dims.into(), output)?.into())
            }
            Collective::ReduceScatter { input, op, output } => {
                let bytes = bytes_of(ctx, &input)?;
                let chunk = bytes.len() / n;
                let mine = (0..n)
                    .map(|r| Bytes::copy_of(&bytes[r * chunk..(r + 1) * chunk]))
                    .collect();
                let all = self.exchange(ctx, coll, mine)?;
                let srcs: Vec<&[u8]> = all.iter().map(Bytes::bytes).collect();
                let mut dims = input.dims().to_vec();
                if let Some(d0) = dims.first_mut() {
                    *d0 /= n;
                }
                let shape = Shape::from(dims);
                let buf = cpu::reduced(ctx, input.dtype(), op, &srcs, shape.elem_count())?;
                // SAFETY: `reduced` wrote every element of `buf`.
                let t = unsafe { cpu::deliver(ctx, buf, shape, output) }?;
                Ok(t.into())
            }
            Collective::Broadcast { tensor, root } => {
                // Only the root sends; the others receive its bytes.
                let data = if self.rank == root {
                    let bytes = bytes_of(ctx, &tensor)?;
                    let mut slots = self.mailbox.lock();
                    for to in (0..n).filter(|&r| r != root) {
                        slots.insert(self.key(coll, root, to), Bytes::copy_of(&bytes));
                    }
                    drop(slots);
                    self.mailbox.arrived.notify_all();
                    Bytes::copy_of(&bytes)
                } else {
                    self.recv(ctx, coll, root)?
                };
                let shape = tensor.shape().clone();
                Ok(concat(ctx, &[data], tensor.dtype(), shape, None)?.into())
            }
            Collective::Barrier => {
                self.exchange(ctx, coll, (0..n).map(|_| Bytes::zeroed(0)).collect())?;
                Ok(().into())
            }
            _ => Err(CommError::Unsupported {
                backend: NAME.into(),
                op: ctx.op.to_string(),
            }),
        }
    }

    /// The split at collective `coll`: every rank's list, checked with the kit's rule, then
    /// this rank's new communicator (none for an empty list).
    fn split(
        &self,
        ctx: &OpCtx,
        coll: u64,
        ranks: &[usize],
        name: &str,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let n = self.size();
        let encoded: Vec<u8> = ranks
            .iter()
            .flat_map(|&r| (r as u64).to_le_bytes())
            .collect();
        let all = self.exchange(
            ctx,
            coll,
            (0..n).map(|_| Bytes::copy_of(&encoded)).collect(),
        )?;
        let lists: Vec<Vec<usize>> = all
            .iter()
            .map(|b| {
                b.bytes()
                    .chunks_exact(8)
                    .map(|w| {
                        let mut a = [0u8; 8];
                        a.copy_from_slice(w);
                        u64::from_le_bytes(a) as usize
                    })
                    .collect()
            })
            .collect();
        check_split_lists(&lists).map_err(|e| CommError::invalid(ctx, e))?;
        let Some(rank) = ranks.iter().position(|&r| r == self.rank) else {
            return Ok(None);
        };
        let members: Vec<usize> = ranks.iter().map(|&r| self.members[r]).collect();
        let id = format!("{}/{name}#{coll}@{}", self.id, members[0]);
        let child = MailboxBackend::start(
            self.mailbox.clone(),
            Arc::from(id),
            members,
            rank,
            self.device.clone(),
        )?;
        Ok(Some(child))
    }
}

/// A copy of a contiguous CPU tensor's bytes (the front hands backends contiguous inputs).
fn bytes_of(ctx: &OpCtx, t: &Tensor) -> Result<Vec<u8>> {
    Ok(read_view(t).map_err(cpu::view_err(ctx))?.bytes().to_vec())
}

/// The pieces back to back as a tensor of `shape` (or written into `output`).
fn concat(
    ctx: &OpCtx,
    pieces: &[Bytes],
    dtype: DType,
    shape: Shape,
    output: Option<Tensor>,
) -> Result<Tensor> {
    let total: usize = pieces.iter().map(Bytes::len).sum();
    if total != shape.elem_count() * dtype.size_in_bytes() {
        return Err(CommError::invalid(
            ctx,
            format!("received {total} bytes for a {dtype:?} result of shape {shape:?}"),
        ));
    }
    cpu::produce(ctx, output, dtype, shape, |dst| {
        let mut at = 0;
        for p in pieces {
            // SAFETY: `produce` gives a destination of `total` bytes (checked above), private
            // to this thread, and the pieces are our own buffers.
            unsafe { cpu::put_bytes(dst, at, p.bytes()) };
            at += p.len();
        }
        Ok(())
    })
}

/// The backend object `new_comm` and `split` hand the front.
struct MailboxBackend {
    inner: Arc<Inner>,
    queue: Arc<Queue>,
}

impl MailboxBackend {
    fn start(
        mailbox: Arc<Mailbox>,
        id: Arc<str>,
        members: Vec<usize>,
        rank: usize,
        device: Device,
    ) -> Result<Arc<dyn Backend>> {
        let queue = Queue::new();
        queue.spawn(&id, rank, || {})?;
        let inner = Arc::new(Inner {
            mailbox,
            id,
            members,
            rank,
            device,
            aborted: Mutex::new(None),
        });
        Ok(Arc::new(MailboxBackend { inner, queue }))
    }

    fn on_panic(inner: &Arc<Inner>) -> impl FnOnce(&OpCtx, u64, String) -> CommError + Send {
        let inner = inner.clone();
        move |ctx, _, msg| {
            let reason = format!("an op panicked: {msg}");
            *inner.aborted.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.clone());
            CommError::Aborted {
                ctx: ctx.clone(),
                reason,
            }
        }
    }
}

impl Drop for MailboxBackend {
    fn drop(&mut self) {
        // The progress thread drains what is queued and exits.
        self.queue.shutdown();
    }
}

impl Backend for MailboxBackend {
    fn backend_name(&self) -> &'static str {
        NAME
    }

    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn device(&self) -> &Device {
        &self.inner.device
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            abort: true,
            dtypes: dtype_names(&SUPPORTED_DTYPES),
            ..Capabilities::default()
        }
    }

    fn collective(&self, ctx: OpCtx, op: Collective) -> Result<Work<CollectiveOutput>> {
        let inner = self.inner.clone();
        self.queue.submit(
            ctx,
            true,
            move |ctx, coll| inner.run(ctx, coll, op),
            Self::on_panic(&self.inner),
        )
    }

    fn split(
        &self,
        ctx: OpCtx,
        ranks: &[usize],
        name: &str,
        _options: &CommOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let inner = self.inner.clone();
        let (ranks, name) = (ranks.to_vec(), name.to_string());
        self.queue
            .submit(
                ctx,
                true,
                move |ctx, coll| inner.split(ctx, coll, &ranks, &name),
                Self::on_panic(&self.inner),
            )?
            .wait()
    }

    fn abort(&self, reason: &str) {
        *self.inner.aborted.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.to_string());
        // Under the mailbox lock, so no receiver misses the wake-up between its check and its
        // wait.
        let _slots = self.inner.mailbox.lock();
        self.inner.mailbox.arrived.notify_all();
    }

    fn is_aborted(&self) -> bool {
        self.inner.aborted().is_some()
    }

    fn pending(&self) -> usize {
        self.queue.pending()
    }
}

thread_local! {
    /// The world and rank of a rank thread started by [`run_world`].
    static RANK: RefCell<Option<(Arc<Mailbox>, usize, usize)>> = const { RefCell::new(None) };
}

/// Creates world communicators for the rank threads of [`run_world`].
struct MailboxFactory;

impl BackendFactory for MailboxFactory {
    fn create(
        &self,
        device: &Device,
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        cpu::require_cpu(device, NAME, name)?;
        let (mailbox, rank, size) =
            RANK.with(|r| r.borrow().clone())
                .ok_or_else(|| CommError::Bootstrap {
                    comm: name.to_string(),
                    reason:
                        "the mailbox backend runs on the rank threads of kit_backend's run_world"
                            .into(),
                })?;
        let backend = MailboxBackend::start(
            mailbox,
            Arc::from(name),
            (0..size).collect(),
            rank,
            device.clone(),
        )?;
        // Every rank must arrive within the bootstrap timeout.
        let ctx = OpCtx::bootstrap(name, rank, options.bootstrap_timeout);
        backend.collective(ctx, Collective::Barrier)?.wait()?;
        Ok(backend)
    }
}

/// Registers the backend (idempotent: a second registration replaces the first with the same).
pub fn register() {
    register_backend(NAME, Arc::new(MailboxFactory));
}

/// Runs [`CASES`] on a world of `n` rank threads. `Ok`: the number of cases every rank
/// passed; `Err`: what failed, per rank.
pub fn run_world(n: usize) -> std::result::Result<usize, String> {
    register();
    let mailbox = Arc::new(Mailbox::default());
    let options = CommOptions::default()
        .with_timeout(Duration::from_secs(30))
        .with_bootstrap_timeout(Duration::from_secs(30));
    let selection = Selection::only(CASES);
    let outcomes: Vec<std::result::Result<usize, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (mailbox, options, selection) = (mailbox.clone(), options.clone(), &selection);
                s.spawn(move || {
                    RANK.with(|r| *r.borrow_mut() = Some((mailbox, rank, n)));
                    let comm = new_comm(NAME, &Device::Cpu, "world", options)
                        .map_err(|e| format!("rank {rank}: new_comm: {e}"))?;
                    let report = run(&comm, selection).map_err(|e| format!("rank {rank}: {e}"))?;
                    if report.passed() != CASES.len() {
                        return Err(format!(
                            "rank {rank}: {} of {} cases passed ({} skipped)",
                            report.passed(),
                            CASES.len(),
                            report.skipped()
                        ));
                    }
                    Ok(report.passed())
                })
            })
            .collect();
        // Every rank's ops are bounded by the timeouts above, so each thread ends.
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(format!("rank {rank}: the rank thread panicked")))
            })
            .collect()
    });
    let errors: Vec<String> = outcomes.iter().filter_map(|o| o.clone().err()).collect();
    if errors.is_empty() {
        Ok(CASES.len())
    } else {
        Err(errors.join("; "))
    }
}

/// Runs the basic conformance cases on worlds of 1, 2 and 3 ranks.
pub fn check() -> std::result::Result<(), String> {
    for n in [1, 2, 3] {
        let passed = run_world(n).map_err(|e| format!("world of {n}: {e}"))?;
        println!("kit_backend: world of {n}: {passed} conformance cases passed on every rank");
    }
    Ok(())
}

#[allow(dead_code)] // `tests/kit_backend.rs` includes this file and calls `check` itself.
fn main() -> std::process::ExitCode {
    match check() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kit_backend: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
