//! `NcclBackend`: the [`Backend`] of one rank of one NCCL communicator, on candle CUDA tensors.
//! The engine (`engine.rs`) does the issuing and tracking; this file turns tensors into device
//! addresses and call plans (`calls.rs`), and creates communicators (from the launcher
//! environment, from an explicit store, or by split).

use std::sync::Arc;

use candle_core::{CudaDevice, DType, Device, Shape, Tensor};

use super::api::{Call, DataType, DevPtr, NcclApi, RawComm, RedOp};
use super::bootstrap::{exchange_unique_id, mark_joined, missing_ranks};
use super::calls;
use super::config::ConfigSpec;
use super::driver::{cuda_device, dev_ptr, CudaStreams, CudarcApi};
use super::engine::{init_comm, Core, Delivery, Ident, InitArgs};
use super::version::{Gates, NcclVersion};
use super::window::NcclWindow;
use candle_dtensor_comm_core::env::LaunchEnv;
use candle_dtensor_comm_core::kit::desc::{
    dtype_code, OpDesc, WireError, DESC_HEADER_WORDS, NONE_WORD,
};
use candle_dtensor_comm_core::kit::dtype_names;
use candle_dtensor_comm_core::store::Store;
use candle_dtensor_comm_core::Comm;
use candle_dtensor_comm_core::WindowBackend;
use candle_dtensor_comm_core::Work;
use candle_dtensor_comm_core::{Backend, Capabilities, Collective, CollectiveOutput, CommOptions};
use candle_dtensor_comm_core::{CommError, Result};
use candle_dtensor_comm_core::{OpCtx, P2POp, ReduceOp, SUPPORTED_DTYPES};

/// Dims carried by the shape exchanges of `gather` and `scatter`.
const MAX_DIMS: usize = 8;
/// One rank's entry in those exchanges: the tensor's op descriptor in the shared wire form of
/// `desc.rs` (as the process and mpi backends send it), padded to `MAX_DIMS` dims.
const META: usize = DESC_HEADER_WORDS + MAX_DIMS;

/// Keeps the communicator alive while the backend or any of its windows is: dropping the last
/// owner asks the watchdog to drain the work and tear the communicator down.
pub(crate) struct Owner(pub Arc<Core>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.request_shutdown();
    }
}

/// One rank of an NCCL communicator; see the module docs of `nccl`.
pub(crate) struct NcclBackend {
    owner: Arc<Owner>,
    device: Device,
    cuda: CudaDevice,
    streams: Arc<CudaStreams>,
}

/// The version of the NCCL library this process loaded (`ncclGetVersion`).
///
/// # Errors
///
/// [`CommError::Bootstrap`] when the library cannot say.
pub fn library_version() -> Result<NcclVersion> {
    let api = CudarcApi::get();
    let code = api.version().map_err(|c| CommError::Bootstrap {
        comm: "nccl".into(),
        reason: format!("ncclGetVersion failed: {c}"),
    })?;
    NcclVersion::from_code(code).ok_or_else(|| CommError::Bootstrap {
        comm: "nccl".into(),
        reason: format!("ncclGetVersion reported an invalid version {code}"),
    })
}

fn boot(name: &str, rank: usize, reason: impl std::fmt::Display) -> CommError {
    CommError::Bootstrap {
        comm: name.to_string(),
        reason: format!("rank {rank}: {reason}"),
    }
}

/// `new_comm("nccl", device, name, options)`: rank and size from the launcher environment, the
/// unique id through the world store (none for a world of one).
pub(crate) fn create_from_env(
    device: &Device,
    name: &str,
    options: &CommOptions,
) -> Result<Arc<dyn Backend>> {
    let env = LaunchEnv::from_env().map_err(|e| CommError::Bootstrap {
        comm: name.to_string(),
        reason: e.to_string(),
    })?;
    let store = if env.world_size > 1 {
        let (client, index) = candle_dtensor_comm_core::store::world_store(
            &env,
            options.bootstrap_timeout,
            "nccl",
            name,
        )?;
        Some((client as Arc<dyn Store>, format!("cdt/nccl/{name}/{index}")))
    } else {
        None
    };
    let b = NcclBackend::bootstrap(device, env.rank, env.world_size, store, name, options)?;
    Ok(b)
}

/// Creates rank `rank` of a `size`-rank NCCL communicator named `name` on `device` (a CUDA
/// device). The ranks rendezvous through `store`, which must be namespaced for this
/// communicator alone (a [`PrefixStore`](candle_dtensor_comm_core::store::PrefixStore) with a fresh prefix per
/// creation); a world of one
/// needs none. Collective: every rank calls it.
///
/// # Errors
///
/// [`CommError::Bootstrap`] (not a CUDA device, NCCL too old, a bad hint, an NCCL or store
/// failure, naming the rank); [`CommError::Timeout`] naming the ranks that did not arrive
/// within `options.bootstrap_timeout`.
pub fn connect(
    device: &Device,
    rank: usize,
    size: usize,
    store: Option<Arc<dyn Store>>,
    name: &str,
    options: CommOptions,
) -> Result<Comm> {
    let store = store.map(|s| (s, format!("nccl/{name}")));
    let b = NcclBackend::bootstrap(device, rank, size, store, name, &options)?;
    Ok(Comm::from_backend(b, name, options))
}

impl NcclBackend {
    fn bootstrap(
        device: &Device,
        rank: usize,
        size: usize,
        store: Option<(Arc<dyn Store>, String)>,
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<NcclBackend>> {
        let cuda = cuda_device(device).ok_or_else(|| {
            boot(
                name,
                rank,
                format!(
                    "the nccl backend runs on a CUDA device; got {:?}",
                    device.location()
                ),
            )
        })?;
        if size == 0 || rank >= size {
            return Err(boot(
                name,
                rank,
                format!("rank {rank} out of range for a communicator of size {size}"),
            ));
        }
        if size > i32::MAX as usize {
            return Err(boot(name, rank, format!("{size} ranks exceed NCCL's int")));
        }
        let api: Arc<dyn NcclApi> = CudarcApi::get();
        let gates = Gates::probe(&*api).map_err(|e| boot(name, rank, e))?;
        let spec = ConfigSpec::from_hints(name, &options.hints, gates.comm_name)
            .map_err(|e| boot(name, rank, e))?;
        let streams =
            Arc::new(CudaStreams::new(cuda).map_err(|e| boot(name, rank, format!("CUDA: {e}")))?);
        let ctx = OpCtx::bootstrap(name, rank, options.bootstrap_timeout);
        let id = match &store {
            Some((s, ns)) => {
                mark_joined(&**s, ns, &ctx)?;
                exchange_unique_id(&**s, ns, &*api, &ctx)?
            }
            None if size == 1 => api
                .unique_id()
                .map_err(|c| boot(name, rank, format!("ncclGetUniqueId failed: {c}")))?,
            None => {
                return Err(boot(
                    name,
                    rank,
                    format!(
                    "a communicator of {size} ranks needs a store to exchange the NCCL unique id"
                ),
                ))
            }
        };
        let missing = || match &store {
            Some((s, ns)) => missing_ranks(&**s, ns, size),
            None => Vec::new(),
        };
        let args = InitArgs {
            id: &id,
            rank,
            size,
            spec: &spec,
            ctx: &ctx,
        };
        let raw = init_comm(&*api, &*streams, &args, &missing)?;
        tracing::debug!(comm = name, rank, size, nccl = %gates.version, "NCCL communicator ready");
        Self::wrap(
            api, streams, cuda, device, gates, raw, name, rank, size, options,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn wrap(
        api: Arc<dyn NcclApi>,
        streams: Arc<CudaStreams>,
        cuda: &CudaDevice,
        device: &Device,
        gates: Gates,
        raw: RawComm,
        name: &str,
        rank: usize,
        size: usize,
        options: &CommOptions,
    ) -> Result<Arc<NcclBackend>> {
        let core = Core::new(
            api,
            streams.clone(),
            gates,
            raw,
            Ident {
                name: Arc::from(name),
                rank,
                size,
                bootstrap_timeout: options.bootstrap_timeout,
            },
        );
        let shrinkable = options
            .hints
            .get("nccl.shrinkable")
            .is_some_and(|v| v.trim() == "1");
        if shrinkable && !core.set_shrinkable(true) {
            tracing::warn!(comm = name, rank, version = %gates.version, "hint nccl.shrinkable needs NCCL >= 2.28.7 (ncclCommRevoke and ncclCommShrink): a failed communicator is aborted at once and cannot be shrunk");
        }
        if let Err(e) = core.spawn_watchdog() {
            core.abort("the watchdog could not start");
            let mut st = core.lock();
            core.teardown_locked(&mut st, false);
            return Err(e);
        }
        Ok(Arc::new(NcclBackend {
            owner: Arc::new(Owner(core)),
            device: device.clone(),
            cuda: cuda.clone(),
            streams,
        }))
    }

    /// A communicator of this one's NCCL library and device from a freshly split or shrunk
    /// `raw` handle: its own streams and watchdog (`rank` of `size` in the child). On failure
    /// the raw handle is aborted, so nothing leaks.
    fn child(
        &self,
        raw: RawComm,
        name: &str,
        rank: usize,
        size: usize,
        options: &CommOptions,
    ) -> Result<Arc<NcclBackend>> {
        let core = self.core();
        let streams = match CudaStreams::new(&self.cuda) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                core.api.abort(raw);
                return Err(boot(name, rank, format!("CUDA: {e}")));
            }
        };
        Self::wrap(
            core.api.clone(),
            streams,
            &self.cuda,
            &self.device,
            core.gates,
            raw,
            name,
            rank,
            size,
            options,
        )
    }

    fn core(&self) -> &Arc<Core> {
        &self.owner.0
    }

    fn dt(ctx: &OpCtx, dtype: DType) -> Result<DataType> {
        calls::data_type(dtype).ok_or_else(|| CommError::UnsupportedDType {
            ctx: ctx.clone(),
            dtype,
            reason: "the nccl backend takes f32, f64, bf16, f16, i64, u32 or u8".into(),
        })
    }

    fn red_op(ctx: &OpCtx, op: ReduceOp, dtype: DType) -> Result<RedOp> {
        calls::red_op(op, dtype).map_err(|reason| CommError::UnsupportedDType {
            ctx: ctx.clone(),
            dtype,
            reason,
        })
    }

    fn ptr(&self, ctx: &OpCtx, t: &Tensor) -> Result<DevPtr> {
        dev_ptr(t, &self.streams.comm).map_err(|e| CommError::invalid(ctx, e))
    }

    /// A fresh output of `shape` (uninitialised; zero-element outputs are views that allocate
    /// nothing).
    fn output(&self, ctx: &OpCtx, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let t = if shape.elem_count() == 0 {
            Tensor::zeros(1, dtype, &self.device)
                .and_then(|t| t.narrow(0, 0, 0))
                .and_then(|t| t.reshape(shape.clone()))
        } else {
            super::driver::empty(shape, dtype, &self.device)
        };
        t.map_err(|e| CommError::candle(ctx, e))
    }

    /// Checks a caller-provided output (the front checked dtype and size already).
    fn given_output(
        &self,
        ctx: &OpCtx,
        output: Option<Tensor>,
        shape: &Shape,
        dtype: DType,
    ) -> Result<Tensor> {
        match output {
            Some(t) => {
                candle_dtensor_comm_core::kit::check_output(ctx, &t, dtype, shape)?;
                Ok(t)
            }
            None => self.output(ctx, shape, dtype),
        }
    }

    /// Device addresses of `input` and `output`, refusing overlapping buffers (the ops that
    /// call this are not in-place).
    fn disjoint(&self, ctx: &OpCtx, input: &Tensor, output: &Tensor) -> Result<(DevPtr, DevPtr)> {
        let (a, b) = (self.ptr(ctx, input)?, self.ptr(ctx, output)?);
        let es = input.dtype().size_in_bytes() as u64;
        let (a_end, b_end) = (
            a + input.elem_count() as u64 * es,
            b + output.elem_count() as u64 * es,
        );
        if a < b_end && b < a_end {
            return Err(CommError::invalid(ctx, "the output overlaps the input"));
        }
        Ok((a, b))
    }

    fn issue<T: Send + 'static>(
        &self,
        ctx: OpCtx,
        calls: Vec<Call>,
        delivery: Delivery<T>,
        keep: Vec<Tensor>,
    ) -> Result<Work<T>> {
        self.core().issue(ctx, calls, delivery, Box::new(keep))
    }

    /// [`Self::issue`] of an op that reads `input` and writes `out`, which the work returns.
    fn issue_into(
        &self,
        ctx: OpCtx,
        calls: Vec<Call>,
        input: Tensor,
        out: Tensor,
    ) -> Result<Work<Tensor>> {
        self.issue(
            ctx,
            calls,
            Delivery::Published(out.clone()),
            vec![input, out],
        )
    }

    /// All-gathers a few integers and reads them on the host (split lists, shapes).
    ///
    /// # Blocking
    ///
    /// Until every rank contributed, bounded by `ctx.timeout` (the watchdog).
    fn all_gather_host(&self, ctx: &OpCtx, mine: &[i64]) -> Result<Vec<i64>> {
        let n = self.core().size;
        let t = Tensor::new(mine, &self.device).map_err(|e| CommError::candle(ctx, e))?;
        let out = self.output(ctx, &Shape::from(n * mine.len()), DType::I64)?;
        let calls = vec![Call::AllGather {
            send: self.ptr(ctx, &t)?,
            recv: self.ptr(ctx, &out)?,
            count: mine.len(),
            dt: DataType::Int64,
        }];
        let out = self
            .issue(
                ctx.clone(),
                calls,
                Delivery::Blocking(out.clone()),
                vec![t, out],
            )?
            .wait()?;
        out.to_vec1::<i64>().map_err(|e| CommError::candle(ctx, e))
    }

    /// Broadcasts a few integers from `root` and reads them on the host.
    ///
    /// # Blocking
    ///
    /// As [`NcclBackend::all_gather_host`].
    fn broadcast_host(&self, ctx: &OpCtx, data: &[i64], root: usize) -> Result<Vec<i64>> {
        let t = Tensor::new(data, &self.device).map_err(|e| CommError::candle(ctx, e))?;
        let p = self.ptr(ctx, &t)?;
        let calls = vec![Call::Broadcast {
            send: p,
            recv: p,
            count: data.len(),
            dt: DataType::Int64,
            root: root as i32,
        }];
        let t = self
            .issue(ctx.clone(), calls, Delivery::Blocking(t.clone()), vec![t])?
            .wait()?;
        t.to_vec1::<i64>().map_err(|e| CommError::candle(ctx, e))
    }
}

/// The descriptor words of `t` (op, dtype, dims, padded to [`META`]) for the shape exchanges,
/// as `i64`s (NCCL moves them as int64; the bit patterns are the words').
fn meta_of(ctx: &OpCtx, t: &Tensor) -> Result<Vec<i64>> {
    if dtype_code(t.dtype()) == NONE_WORD {
        return Err(CommError::invalid(
            ctx,
            format!("dtype {:?} is not supported", t.dtype()),
        ));
    }
    // More than MAX_DIMS dims: the true count is sent anyway, so every rank reports the same
    // error when it decodes the entry.
    Ok(OpDesc::tensor(ctx.op, t)
        .encode_words_padded(MAX_DIMS)
        .into_iter()
        .map(|w| w as i64)
        .collect())
}

/// Decodes one rank's shape-exchange entry.
fn decode_meta(ctx: &OpCtx, rank: usize, m: &[i64]) -> Result<(DType, Shape)> {
    let words: Vec<u64> = m.iter().map(|&w| w as u64).collect();
    let (desc, _) = OpDesc::decode_words(&words, MAX_DIMS).map_err(|e| match e {
        WireError::TooMany { n, .. } => CommError::invalid(
            ctx,
            format!(
                "rank {rank} passed a tensor of {n} dims; gather and scatter take up to {MAX_DIMS}"
            ),
        ),
        e => CommError::invalid(ctx, format!("rank {rank} sent a bad shape entry: {e}")),
    })?;
    let dtype = desc.dtype.ok_or_else(|| {
        CommError::invalid(
            ctx,
            format!("rank {rank} sent a shape entry without a dtype"),
        )
    })?;
    Ok((dtype, Shape::from_dims(&desc.dims)))
}

/// The ops [`Backend::collective`] dispatches to, one NCCL group each.
impl NcclBackend {
    fn all_reduce(
        &self,
        ctx: OpCtx,
        input: Tensor,
        op: ReduceOp,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>> {
        let dt = Self::dt(&ctx, input.dtype())?;
        let rop = Self::red_op(&ctx, op, input.dtype())?;
        let out = self.given_output(&ctx, output, input.shape(), input.dtype())?;
        let count = input.elem_count();
        let calls = if count == 0 {
            Vec::new()
        } else {
            vec![Call::AllReduce {
                send: self.ptr(&ctx, &input)?,
                recv: self.ptr(&ctx, &out)?,
                count,
                dt,
                op: rop,
            }]
        };
        self.issue_into(ctx, calls, input, out)
    }

    fn all_gather_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>> {
        let dt = Self::dt(&ctx, input.dtype())?;
        let n = self.size();
        let mut dims = input.dims().to_vec();
        match dims.first_mut() {
            Some(d0) => *d0 *= n,
            None => dims.push(n),
        }
        let out = self.given_output(&ctx, output, &Shape::from_dims(&dims), input.dtype())?;
        let count = input.elem_count();
        let calls = if count == 0 {
            Vec::new()
        } else {
            let (send, recv) = self.disjoint(&ctx, &input, &out)?;
            vec![Call::AllGather {
                send,
                recv,
                count,
                dt,
            }]
        };
        self.issue_into(ctx, calls, input, out)
    }

    fn reduce_scatter_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        op: ReduceOp,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>> {
        let dt = Self::dt(&ctx, input.dtype())?;
        let rop = Self::red_op(&ctx, op, input.dtype())?;
        let n = self.size();
        let mut dims = input.dims().to_vec();
        if let Some(d0) = dims.first_mut() {
            *d0 /= n;
        }
        let out = self.given_output(&ctx, output, &Shape::from_dims(&dims), input.dtype())?;
        let count = input.elem_count() / n;
        let calls = if count == 0 {
            Vec::new()
        } else {
            let (send, recv) = self.disjoint(&ctx, &input, &out)?;
            vec![Call::ReduceScatter {
                send,
                recv,
                count,
                dt,
                op: rop,
            }]
        };
        self.issue_into(ctx, calls, input, out)
    }

    fn all_to_all_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        output: Option<Tensor>,
    ) -> Result<Work<Tensor>> {
        let dt = Self::dt(&ctx, input.dtype())?;
        let n = self.size();
        let out = self.given_output(&ctx, output, input.shape(), input.dtype())?;
        let chunk = input.elem_count() / n;
        let calls = if chunk == 0 {
            Vec::new()
        } else {
            let (send, recv) = self.disjoint(&ctx, &input, &out)?;
            calls::all_to_all(&self.core().gates, send, recv, chunk, dt, n)
        };
        self.issue_into(ctx, calls, input, out)
    }

    fn all_to_all_v_single(
        &self,
        ctx: OpCtx,
        input: Tensor,
        output_split_sizes: Vec<usize>,
        input_split_sizes: Vec<usize>,
    ) -> Result<Work<Tensor>> {
        let dt = Self::dt(&ctx, input.dtype())?;
        let rows: Vec<usize> = input.dims().iter().skip(1).copied().collect();
        let row: usize = rows.iter().product();
        let total: usize = output_split_sizes.iter().sum();
        let mut dims = vec![total];
        dims.extend(rows);
        let out = self.output(&ctx, &Shape::from_dims(&dims), input.dtype())?;
        let (send, recv) = if input.elem_count() > 0 || total * row > 0 {
            (
                if input.elem_count() > 0 {
                    self.ptr(&ctx, &input)?
                } else {
                    0
                },
                if total * row > 0 {
                    self.ptr(&ctx, &out)?
                } else {
                    0
                },
            )
        } else {
            (0, 0)
        };
        let calls =
            calls::all_to_all_v(send, recv, &input_split_sizes, &output_split_sizes, row, dt);
        self.issue_into(ctx, calls, input, out)
    }

    fn broadcast(&self, ctx: OpCtx, tensor: Tensor, root: usize) -> Result<Work<Tensor>> {
        let dt = Self::dt(&ctx, tensor.dtype())?;
        let count = tensor.elem_count();
        let out = if self.rank() == root {
            tensor.clone()
        } else {
            self.output(&ctx, tensor.shape(), tensor.dtype())?
        };
        let calls = if count == 0 {
            Vec::new()
        } else {
            let p = self.ptr(&ctx, &out)?;
            vec![Call::Broadcast {
                send: p,
                recv: p,
                count,
                dt,
                root: root as i32,
            }]
        };
        self.issue(ctx, calls, Delivery::Published(out.clone()), vec![out])
    }

    fn reduce(
        &self,
        ctx: OpCtx,
        input: Tensor,
        root: usize,
        op: ReduceOp,
    ) -> Result<Work<Option<Tensor>>> {
        let dt = Self::dt(&ctx, input.dtype())?;
        let rop = Self::red_op(&ctx, op, input.dtype())?;
        let is_root = self.rank() == root;
        let out = if is_root {
            Some(self.output(&ctx, input.shape(), input.dtype())?)
        } else {
            None
        };
        let count = input.elem_count();
        let calls = if count == 0 {
            Vec::new()
        } else {
            let send = self.ptr(&ctx, &input)?;
            let recv = match &out {
                Some(o) => self.ptr(&ctx, o)?,
                None => send,
            };
            vec![Call::Reduce {
                send,
                recv,
                count,
                dt,
                op: rop,
                root: root as i32,
            }]
        };
        let mut keep = vec![input];
        keep.extend(out.clone());
        self.issue(ctx, calls, Delivery::Published(out), keep)
    }

    fn gather(&self, ctx: OpCtx, input: Tensor, root: usize) -> Result<Work<Option<Vec<Tensor>>>> {
        let dt = Self::dt(&ctx, input.dtype())?;
        let (n, me) = (self.size(), self.rank());
        // Shapes may differ across ranks: every rank learns all of them first.
        let all = self.all_gather_host(&ctx, &meta_of(&ctx, &input)?)?;
        let metas = (0..n)
            .map(|r| decode_meta(&ctx, r, &all[r * META..(r + 1) * META]))
            .collect::<Result<Vec<_>>>()?;
        if let Some((r, (d, _))) = metas
            .iter()
            .enumerate()
            .find(|(_, (d, _))| *d != input.dtype())
        {
            return Err(CommError::invalid(
                &ctx,
                format!(
                    "gather inputs must share one dtype; rank {me} has {:?} but rank {r} has {d:?}",
                    input.dtype()
                ),
            ));
        }
        let counts: Vec<usize> = metas.iter().map(|(_, s)| s.elem_count()).collect();
        let total: usize = counts.iter().sum();
        let buf = if me == root {
            Some(self.output(&ctx, &Shape::from(total), input.dtype())?)
        } else {
            None
        };
        let send = if counts[me] > 0 {
            self.ptr(&ctx, &input)?
        } else {
            0
        };
        let recv = match &buf {
            Some(b) if total > 0 => self.ptr(&ctx, b)?,
            _ => send,
        };
        let equal = counts.iter().all(|&c| c == counts[0]);
        let calls = if total == 0 {
            Vec::new()
        } else if equal {
            calls::gather(
                &self.core().gates,
                calls::Rooted::new(send, recv, counts[0], dt, root, me, n),
            )
        } else {
            calls::gather_v(send, recv, &counts, dt, root, me)
        };
        // The root's pieces are views of one buffer, one per rank in its own shape.
        let pieces = match &buf {
            Some(b) => {
                let mut off = 0;
                let mut v = Vec::with_capacity(n);
                for (c, (_, shape)) in counts.iter().zip(&metas) {
                    let piece = b
                        .narrow(0, off, *c)
                        .and_then(|p| p.reshape(shape.clone()))
                        .map_err(|e| CommError::candle(&ctx, e))?;
                    v.push(piece);
                    off += c;
                }
                Some(v)
            }
            None => None,
        };
        let mut keep = vec![input];
        keep.extend(buf);
        self.issue(ctx, calls, Delivery::Published(pieces), keep)
    }

    fn scatter(&self, ctx: OpCtx, inputs: Vec<Tensor>, root: usize) -> Result<Work<Tensor>> {
        let (n, me) = (self.size(), self.rank());
        // The root tells every rank the dtype and shape of its piece.
        let mut meta = vec![0i64; n * META];
        if me == root {
            for (r, t) in inputs.iter().enumerate().take(n) {
                meta[r * META..(r + 1) * META].copy_from_slice(&meta_of(&ctx, t)?);
            }
        }
        let meta = self.broadcast_host(&ctx, &meta, root)?;
        let metas = (0..n)
            .map(|r| decode_meta(&ctx, root, &meta[r * META..(r + 1) * META]))
            .collect::<Result<Vec<_>>>()?;
        let (dtype, shape) = metas[me].clone();
        let dt = Self::dt(&ctx, dtype)?;
        let out = self.output(&ctx, &shape, dtype)?;
        let counts: Vec<usize> = metas.iter().map(|(_, s)| s.elem_count()).collect();
        let mut keep = vec![out.clone()];
        let recv = if counts[me] > 0 {
            self.ptr(&ctx, &out)?
        } else {
            0
        };
        let equal = counts.iter().all(|&c| c == counts[0]);
        let calls = if counts.iter().all(|&c| c == 0) {
            Vec::new()
        } else if equal {
            // One contiguous buffer on the root (native ncclScatter, or send/recv from it).
            let send = if me == root {
                let flat = inputs
                    .iter()
                    .map(|t| t.flatten_all())
                    .collect::<candle_core::Result<Vec<_>>>()
                    .and_then(|v| Tensor::cat(&v, 0))
                    .map_err(|e| CommError::candle(&ctx, e))?;
                let p = self.ptr(&ctx, &flat)?;
                keep.push(flat);
                p
            } else {
                recv
            };
            calls::scatter(
                &self.core().gates,
                calls::Rooted::new(send, recv, counts[0], dt, root, me, n),
            )
        } else {
            let mut calls = Vec::new();
            if me == root {
                for (p, t) in inputs.iter().enumerate() {
                    if counts[p] > 0 {
                        calls.push(Call::send(self.ptr(&ctx, t)?, counts[p], dt, p));
                    }
                }
                keep.extend(inputs.iter().cloned());
            }
            if counts[me] > 0 {
                calls.push(Call::recv(recv, counts[me], dt, root));
            }
            calls
        };
        self.issue(ctx, calls, Delivery::Published(out), keep)
    }

    fn barrier(&self, ctx: OpCtx) -> Result<Work<()>> {
        let t =
            Tensor::zeros(1, DType::F32, &self.device).map_err(|e| CommError::candle(&ctx, e))?;
        let p = self.ptr(&ctx, &t)?;
        let calls = vec![Call::AllReduce {
            send: p,
            recv: p,
            count: 1,
            dt: DataType::Float32,
            op: super::api::RedOp::Sum,
        }];
        self.issue(ctx, calls, Delivery::Blocking(()), vec![t])
    }

    fn batch_p2p(&self, ctx: OpCtx, ops: Vec<P2POp>) -> Result<Work<Vec<Tensor>>> {
        let mut calls = Vec::new();
        let mut received = Vec::new();
        let mut keep = Vec::new();
        for op in ops {
            match op {
                P2POp::Send { tensor, peer } => {
                    let dt = Self::dt(&ctx, tensor.dtype())?;
                    if tensor.elem_count() > 0 {
                        let buf = self.ptr(&ctx, &tensor)?;
                        calls.push(Call::send(buf, tensor.elem_count(), dt, peer));
                    }
                    keep.push(tensor);
                }
                P2POp::Recv { peer, shape, dtype } => {
                    let dt = Self::dt(&ctx, dtype)?;
                    let out = self.output(&ctx, &shape, dtype)?;
                    if out.elem_count() > 0 {
                        calls.push(Call::recv(
                            self.ptr(&ctx, &out)?,
                            out.elem_count(),
                            dt,
                            peer,
                        ));
                    }
                    keep.push(out.clone());
                    received.push(out);
                }
            }
        }
        self.issue(ctx, calls, Delivery::Published(received), keep)
    }
}

impl Backend for NcclBackend {
    fn backend_name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.core().rank
    }

    fn size(&self) -> usize {
        self.core().size
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn capabilities(&self) -> Capabilities {
        let windows = self.core().gates.windows;
        Capabilities {
            rma_put: windows,
            rma_get: false,
            rma_signal: windows,
            abort: true,
            shrink: self.core().gates.shrink,
            dtypes: dtype_names(&SUPPORTED_DTYPES),
        }
    }

    fn collective(&self, ctx: OpCtx, op: Collective) -> Result<Work<CollectiveOutput>> {
        match op {
            Collective::AllReduce { input, op, output } => {
                self.all_reduce(ctx, input, op, output).map(Work::outcome)
            }
            Collective::AllGather { input, output } => self
                .all_gather_single(ctx, input, output)
                .map(Work::outcome),
            Collective::ReduceScatter { input, op, output } => self
                .reduce_scatter_single(ctx, input, op, output)
                .map(Work::outcome),
            Collective::AllToAll { input, output } => self
                .all_to_all_single(ctx, input, output)
                .map(Work::outcome),
            Collective::AllToAllV {
                input,
                output_split_sizes,
                input_split_sizes,
            } => self
                .all_to_all_v_single(ctx, input, output_split_sizes, input_split_sizes)
                .map(Work::outcome),
            rows @ Collective::AllToAllVRows { .. } => {
                let op = rows.gather_rows(&ctx)?;
                self.collective(ctx, op)
            }
            Collective::Broadcast { tensor, root } => {
                self.broadcast(ctx, tensor, root).map(Work::outcome)
            }
            Collective::Reduce { input, root, op } => {
                self.reduce(ctx, input, root, op).map(Work::outcome)
            }
            Collective::Gather { input, root } => self.gather(ctx, input, root).map(Work::outcome),
            Collective::Scatter { inputs, root } => {
                self.scatter(ctx, inputs, root).map(Work::outcome)
            }
            Collective::Barrier => self.barrier(ctx).map(Work::outcome),
            Collective::BatchP2p { ops } => self.batch_p2p(ctx, ops).map(Work::outcome),
        }
    }

    fn split(
        &self,
        ctx: OpCtx,
        ranks: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let (n, me) = (self.size(), self.rank());
        // Every rank sees every list and reaches the same verdict (the local backend's rule).
        let mine: Vec<i64> = calls::encode_split_list(ranks, n)
            .into_iter()
            .map(i64::from)
            .collect();
        let all: Vec<u32> = self
            .all_gather_host(&ctx, &mine)?
            .into_iter()
            .map(|v| v as u32)
            .collect();
        let lists = calls::decode_split_lists(&all, n).map_err(|e| CommError::invalid(&ctx, e))?;
        candle_dtensor_comm_core::kit::desc::check_split_lists(&lists)
            .map_err(|e| CommError::invalid(&ctx, e))?;
        let (color, key) =
            calls::split_color_key(ranks, me).map_err(|e| CommError::invalid(&ctx, e))?;
        let core = self.core();
        let spec = ConfigSpec::from_hints(name, &options.hints, core.gates.comm_name)
            .map_err(|e| boot(name, me, e))?;
        let Some(raw) = core.split(&ctx, color, key, ranks.len(), &spec)? else {
            return Ok(None);
        };
        let b = self.child(raw, name, key as usize, ranks.len(), options)?;
        Ok(Some(b as Arc<dyn Backend>))
    }

    fn shrink(
        &self,
        ctx: OpCtx,
        excluded: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        // NCCL keeps the survivors' order and renumbers them from 0.
        let me = self.rank();
        let rank = me - excluded.iter().filter(|&&r| r < me).count();
        let size = self.size() - excluded.len();
        let core = self.core();
        let spec = ConfigSpec::from_hints(name, &options.hints, core.gates.comm_name)
            .map_err(|e| boot(name, me, e))?;
        let raw = core.shrink(&ctx, excluded, rank, size, &spec)?;
        let b = self.child(raw, name, rank, size, options)?;
        Ok(b as Arc<dyn Backend>)
    }

    fn new_window(&self, ctx: OpCtx, bytes: usize) -> Result<Arc<dyn WindowBackend>> {
        let w = NcclWindow::new(
            self.owner.clone(),
            self.streams.clone(),
            self.device.clone(),
            &ctx,
            bytes,
        )?;
        Ok(Arc::new(w))
    }

    fn abort(&self, reason: &str) {
        self.core().abort(reason);
    }

    fn is_aborted(&self) -> bool {
        self.core().failure().is_some()
    }

    fn pending(&self) -> usize {
        self.core().pending()
    }
}
