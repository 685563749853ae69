//! The `process` backend: CPU ranks as separate processes, talking over TCP.
//!
//! # Overview
//!
//! - Start the processes with `dtrun --nproc N -- prog args` (or torchrun, or mpirun with
//!   `MASTER_ADDR`/`MASTER_PORT` exported); each calls
//!   `new_comm("process", &Device::Cpu, "world", CommOptions)` and gets the world communicator.
//!   Rank and size come from the environment ([`candle_dtensor_comm_core::env::LaunchEnv`]); rank 0 hosts the
//!   rendezvous [`store`](candle_dtensor_comm_core::store) on `MASTER_ADDR:MASTER_PORT` for the life of the
//!   process, every rank connects to it.
//! - Each communicator owns a full mesh of TCP connections, bootstrapped through the store
//!   under a namespace of its own (`cdt/new_comm/<name>/<k>` for the k-th `new_comm` of that
//!   name, `<parent>/split<i>/c<color>` for a split: Gloo's scheme), one reader thread per peer
//!   and one progress thread that runs its ops in issue order (the local backend's design:
//!   ops on different communicators overlap).
//! - Collectives are the classic CPU algorithms (ring all-gather, pairwise reduce-scatter and
//!   all-to-all, reduce-scatter + ring all-gather all-reduce, binomial broadcast) with
//!   reductions in rank order, so results are bitwise equal to the local backend's. See
//!   `ops.rs` for the list and `frame.rs` for the frame format.
//! - Failures: the op timeout names the ranks that never reached the collective; ranks that
//!   issue different collectives get a desync error naming both; a peer whose connection
//!   closes without a goodbye (its process died) fails every pending and later op at once,
//!   naming it; `abort()` and timeouts are told to every peer, so the whole communicator fails
//!   with the same cause. RMA windows are not supported ([`Capabilities`] says so).
//!
//! [`connect`] builds a communicator from an explicit store, rank and size (ranks may then also
//! be threads of one process, which is how the unit tests run).

mod bootstrap;
mod ops;
#[cfg(test)]
mod tests;
// The store's test support (a warnings recorder, an allocation counter), shared with
// candle-dtensor-comm-core's store tests.
mod frame;
#[cfg(test)]
#[path = "../../comm-core/src/store/test_support.rs"]
mod test_support;
mod transport;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;

use bootstrap::MeshSpec;
use candle_dtensor_comm_core::auth::Token;
use candle_dtensor_comm_core::env::LaunchEnv;
use candle_dtensor_comm_core::kit::agree::{self, Agreement, Heard, Net};
use candle_dtensor_comm_core::kit::cpu::queue::Queue;
use candle_dtensor_comm_core::kit::desc::Failure;
use candle_dtensor_comm_core::store::{world_store, PrefixStore, Store};
use candle_dtensor_comm_core::Comm;
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::Work;
use candle_dtensor_comm_core::{
    Backend, BackendFactory, Capabilities, Collective, CollectiveOutput, CommOptions,
};
use candle_dtensor_comm_core::{CommError, Result};
use transport::{Exec, Transport};

/// The hint that sets the address peers dial to reach this rank (default: the address this
/// host uses to reach the store, i.e. 127.0.0.1 for a loopback store).
pub const HINT_IP: &str = "ip";

/// The hint that caps the bytes of unconsumed data a rank holds per peer (default
/// [`DEFAULT_MAX_BUFFERED`]); past it, the peer's further frames wait in the network (TCP flow
/// control slows its writes).
pub const HINT_MAX_BUFFERED: &str = "process.max_buffered_bytes";

/// Default of [`HINT_MAX_BUFFERED`]: 256 MiB per peer.
pub const DEFAULT_MAX_BUFFERED: usize = 256 << 20;

/// How a communicator's members find each other: a store (the root of every namespace), the
/// address this rank listens on, and the job's token every connection must prove.
#[derive(Clone)]
pub(crate) struct Rendezvous {
    store: Arc<dyn Store>,
    ip: IpAddr,
    token: Token,
}

/// How the members of a new communicator learn each other's addresses.
enum Peers<'a> {
    /// Through the store, under the communicator's namespace (`new_comm`, [`connect`]).
    Store,
    /// Already exchanged over the parent (split, shrink): this rank's listener and every
    /// member's address. `tolerate` (shrink): the peers the parent knows dead, and no error for
    /// a member that cannot be reached (the new communicator is then born failed, naming it).
    Known {
        listener: TcpListener,
        addrs: Vec<SocketAddr>,
        tolerate: Option<&'a (dyn Fn(usize) -> Option<String> + Sync)>,
    },
}

fn buffer_cap(options: &CommOptions, name: &str) -> Result<usize> {
    match options.hints.get(HINT_MAX_BUFFERED) {
        None => Ok(DEFAULT_MAX_BUFFERED),
        Some(v) => v.parse().map_err(|e| CommError::Bootstrap {
            comm: name.to_string(),
            reason: format!("hint {HINT_MAX_BUFFERED}={v:?} is not a byte count: {e}"),
        }),
    }
}

/// The factory behind `new_comm("process", ...)`.
pub(crate) struct ProcessFactory;

/// The name this backend is registered under.
pub const NAME: &str = "process";

/// The factory behind `new_comm("process", ...)`: what
/// `candle_dtensor_comm::register_builtin_backends` registers as [`NAME`].
pub fn factory() -> Arc<dyn BackendFactory> {
    Arc::new(ProcessFactory)
}

impl BackendFactory for ProcessFactory {
    fn create(
        &self,
        device: &Device,
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        candle_dtensor_comm_core::kit::cpu::require_cpu(device, "process", name)?;
        let env = LaunchEnv::from_env().map_err(|e| CommError::Bootstrap {
            comm: name.to_string(),
            reason: e.to_string(),
        })?;
        let (client, index) = world_store(&env, options.bootstrap_timeout, "process", name)?;
        let ip = match options.hints.get(HINT_IP) {
            Some(ip) => parse_ip(ip, name)?,
            None => client.local_ip().map_err(|e| CommError::Bootstrap {
                comm: name.to_string(),
                reason: e.to_string(),
            })?,
        };
        let rdv = Rendezvous {
            store: client,
            ip,
            token: Token::from_env(),
        };
        let ns = format!("cdt/new_comm/{name}/{index}");
        let b = ProcessBackend::bootstrap(
            rdv,
            ns,
            env.rank,
            env.world_size,
            name,
            options,
            None,
            Peers::Store,
        )?;
        Ok(b)
    }
}

fn parse_ip(s: &str, name: &str) -> Result<IpAddr> {
    s.parse().map_err(|e| CommError::Bootstrap {
        comm: name.to_string(),
        reason: format!("hint {HINT_IP}={s:?} is not an IP address: {e}"),
    })
}

/// Creates rank `rank` of a `size`-rank process communicator named `name` whose members
/// rendezvous through `store` (which must be namespaced for this communicator alone: a
/// [`PrefixStore`] with a fresh prefix per creation). Collective: every rank calls it.
///
/// Ranks may be processes or threads; the address peers dial is the `"ip"` hint (default
/// 127.0.0.1); connections prove the token of [`candle_dtensor_comm_core::auth::TOKEN_ENV`].
///
/// # Errors
///
/// [`CommError::Timeout`] naming the ranks that did not show up within
/// `options.bootstrap_timeout`; [`CommError::Bootstrap`] for store or socket failures.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use candle_core::{Device, Tensor};
/// use candle_dtensor::comm::store::{PrefixStore, Store, TcpStore, TcpStoreServer};
/// use candle_dtensor::comm::{process, CommOptions, ReduceOp};
///
/// let server = TcpStoreServer::bind("127.0.0.1:0")?;
/// let addr = server.local_addr().to_string();
/// let sums = std::thread::scope(|s| {
///     let handles: Vec<_> = (0..2).map(|rank| {
///         let addr = addr.clone();
///         s.spawn(move || -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
///             let store: Arc<dyn Store> = Arc::new(TcpStore::connect(&addr, Duration::from_secs(10))?);
///             let ns = Arc::new(PrefixStore::new("doc", store));
///             let comm = process::connect(ns, rank, 2, "world", CommOptions::default())?;
///             let x = Tensor::full(rank as f32 + 1.0, 3, &Device::Cpu)?;
///             Ok(comm.all_reduce(&x, ReduceOp::Sum)?.wait()?.to_vec1::<f32>()?)
///         })
///     }).collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect::<Result<Vec<_>, _>>()
/// }).map_err(|e| e.to_string())?;
/// assert_eq!(sums[1], vec![3.0; 3]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn connect(
    store: Arc<dyn Store>,
    rank: usize,
    size: usize,
    name: &str,
    options: CommOptions,
) -> Result<Comm> {
    if size == 0 || rank >= size {
        return Err(CommError::Bootstrap {
            comm: name.to_string(),
            reason: format!("rank {rank} out of range for a communicator of size {size}"),
        });
    }
    let ip = match options.hints.get(HINT_IP) {
        Some(ip) => parse_ip(ip, name)?,
        None => IpAddr::V4(Ipv4Addr::LOCALHOST),
    };
    let rdv = Rendezvous {
        store,
        ip,
        token: Token::from_env(),
    };
    let b = ProcessBackend::bootstrap(
        rdv,
        String::new(),
        rank,
        size,
        name,
        &options,
        None,
        Peers::Store,
    )?;
    Ok(Comm::from_backend(b, name, options))
}

struct Core {
    t: Arc<Transport>,
    queue: Arc<Queue>,
    device: Device,
    /// Set by the progress thread once it has said goodbye.
    closed: Mutex<bool>,
    closed_cv: Condvar,
}

/// One rank of a process communicator.
pub(crate) struct ProcessBackend {
    core: Arc<Core>,
}

/// How long dropping a communicator waits for its queue to drain and its goodbyes to go out.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

impl Drop for ProcessBackend {
    /// The progress thread drains what is queued (peers may need it), says goodbye to every
    /// peer and exits.
    ///
    /// # Blocking
    ///
    /// Waits for that, up to 5 s, unless an op of this communicator is running right now (the
    /// drop may then happen on that very op's thread). Without the wait, a process that returns
    /// from `main` right after its last collective could exit before its goodbye, and a peer
    /// still finishing that collective would take it for a crash.
    fn drop(&mut self) {
        if self.core.queue.shutdown() {
            return;
        }
        let deadline = Instant::now() + CLOSE_WAIT;
        let mut closed = self.core.closed.lock().unwrap_or_else(|e| e.into_inner());
        while !*closed {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(comm = %self.core.t.name, rank = self.core.t.rank, "communicator still closing after {CLOSE_WAIT:?}");
                return;
            }
            closed = self
                .core
                .closed_cv
                .wait_timeout(closed, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl ProcessBackend {
    /// Connects the mesh under namespace `ns` (of `rdv.store` when the addresses come from the
    /// store; the empty namespace: the store itself) and starts the threads. `parent` is the
    /// split or shrink creating it, if any, with the map from new ranks to the ranks errors
    /// should name.
    #[allow(clippy::too_many_arguments)]
    fn bootstrap(
        rdv: Rendezvous,
        ns: String,
        rank: usize,
        size: usize,
        name: &str,
        options: &CommOptions,
        parent: Option<(&OpCtx, &[usize])>,
        peers: Peers,
    ) -> Result<Arc<ProcessBackend>> {
        let own_ctx;
        let (ctx, names): (&OpCtx, Option<&[usize]>) = match parent {
            Some((c, names)) => (c, Some(names)),
            None => {
                own_ctx = OpCtx::bootstrap(name, rank, options.bootstrap_timeout);
                (&own_ctx, None)
            }
        };
        let cap = buffer_cap(options, name)?;
        let name_rank = |r: usize| names.and_then(|n| n.get(r).copied()).unwrap_or(r);
        let mut spec = MeshSpec {
            ns: &ns,
            rank,
            size,
            token: &rdv.token,
            ctx,
            deadline: Instant::now() + options.bootstrap_timeout,
            name_rank: &name_rank,
            tolerate: None,
        };
        let mesh = match peers {
            // A world of one talks to nobody.
            Peers::Store if size == 1 => (vec![None], Vec::new()),
            Peers::Store => {
                let scoped: Arc<dyn Store> = if ns.is_empty() {
                    rdv.store.clone()
                } else {
                    Arc::new(PrefixStore::new(ns.clone(), rdv.store.clone()))
                };
                let (listener, mine) = bootstrap::bind(rdv.ip, name)?;
                let addrs = bootstrap::addresses_from_store(&spec, &*scoped, mine)?;
                bootstrap::connect(&spec, &listener, &addrs)?
            }
            Peers::Known {
                listener,
                addrs,
                tolerate,
            } => {
                spec.tolerate = tolerate;
                bootstrap::connect(&spec, &listener, &addrs)?
            }
        };
        let t = Transport::start(rank, mesh, name, ns, rdv, cap)?;
        let queue = Queue::new();
        let core = Arc::new(Core {
            t: t.clone(),
            queue: queue.clone(),
            device: Device::Cpu,
            closed: Mutex::new(false),
            closed_cv: Condvar::new(),
        });
        // The thread holds the core weakly: the backend (and its `Drop`) owns it.
        let weak = Arc::downgrade(&core);
        queue.spawn(name, rank, move || {
            t.close();
            if let Some(core) = weak.upgrade() {
                *core.closed.lock().unwrap_or_else(|e| e.into_inner()) = true;
                core.closed_cv.notify_all();
            }
        })?;
        Ok(Arc::new(ProcessBackend { core }))
    }
}

/// One agreement's messages as AGREE frames on the communicator's sockets.
struct ProcessNet<'a> {
    t: &'a Transport,
    instance: u64,
}

impl Net for ProcessNet<'_> {
    fn rank(&self) -> usize {
        self.t.rank
    }

    fn size(&self) -> usize {
        self.t.size
    }

    fn send(&self, peer: usize, round: u32, bytes: &[u8]) {
        self.t.agree_send(peer, self.instance, round, bytes);
    }

    fn recv(&self, peer: usize, round: u32, deadline: Instant) -> Heard {
        self.t.agree_recv(peer, self.instance, round, deadline)
    }

    fn done(&self) {
        self.t.agree_done(self.instance);
    }
}

impl Core {
    /// Queues `body` as the next op; collectives take the next collective index.
    fn submit<T: Send + 'static>(
        &self,
        ctx: OpCtx,
        collective: bool,
        body: impl FnOnce(&mut Exec) -> Result<T> + Send + 'static,
    ) -> Result<Work<T>> {
        let (t, t_panic) = (self.t.clone(), self.t.clone());
        self.queue.submit(
            ctx,
            collective,
            move |ctx, coll| {
                let mut exec = Exec {
                    t: &t,
                    ctx,
                    coll,
                    deadline: Instant::now() + ctx.timeout,
                    desc: None,
                    greeting: Vec::new(),
                    greeted: Vec::new(),
                };
                let r = body(&mut exec);
                if collective {
                    t.finish(coll, r.is_ok());
                }
                r
            },
            move |ctx, coll, reason| {
                let t = t_panic;
                let f = t.fail(
                    Failure::Aborted {
                        by: t.rank,
                        reason,
                        after: Some(t.completed()),
                    },
                    true,
                );
                if collective {
                    t.finish(coll, false);
                }
                f.to_error(ctx, None)
            },
        )
    }
}

impl Backend for ProcessBackend {
    fn backend_name(&self) -> &'static str {
        "process"
    }

    fn rank(&self) -> usize {
        self.core.t.rank
    }

    fn size(&self) -> usize {
        self.core.t.size
    }

    fn device(&self) -> &Device {
        &self.core.device
    }

    fn capabilities(&self) -> Capabilities {
        candle_dtensor_comm_core::kit::cpu::capabilities(false)
    }

    fn collective(&self, ctx: OpCtx, op: Collective) -> Result<Work<CollectiveOutput>> {
        let op = op.gather_rows(&ctx)?;
        let collective = !matches!(op, Collective::BatchP2p { .. });
        self.core.submit(ctx, collective, move |x| ops::run(x, op))
    }

    fn split(
        &self,
        ctx: OpCtx,
        ranks: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        let ranks = ranks.to_vec();
        let name = name.to_string();
        let options = options.clone();
        let work = self.core.submit(ctx, true, move |x| {
            let listener = match ranks.is_empty() {
                true => None,
                false => Some(bootstrap::bind(x.t.rdv.ip, &name)?),
            };
            let addrs = ops::exchange_split_lists(x, &ranks, listener.as_ref().map(|l| l.1))?;
            let Some((listener, _)) = listener else {
                return Ok(None);
            };
            let color = ranks.iter().copied().min().unwrap_or(0);
            let my = ranks.iter().position(|&r| r == x.t.rank).unwrap_or(0);
            // Gloo's scheme: the parent's namespace, the split's collective index, the color.
            let ns = if x.t.key.is_empty() {
                format!("split{}/c{color}", x.coll)
            } else {
                format!("{}/split{}/c{color}", x.t.key, x.coll)
            };
            let opts = CommOptions {
                bootstrap_timeout: x.deadline.saturating_duration_since(Instant::now()),
                ..options
            };
            let b = ProcessBackend::bootstrap(
                x.t.rdv.clone(),
                ns,
                my,
                ranks.len(),
                &name,
                &opts,
                Some((x.ctx, &ranks)),
                Peers::Known {
                    listener,
                    addrs,
                    tolerate: None,
                },
            )?;
            Ok(Some(b as Arc<dyn Backend>))
        })?;
        work.wait()
    }

    fn shrink(
        &self,
        ctx: OpCtx,
        excluded: &[usize],
        name: &str,
        options: &CommOptions,
    ) -> Result<Arc<dyn Backend>> {
        let t = &self.core.t;
        let instance = t.next_agreement();
        // Listen first: the address travels with this rank's proposal.
        let (listener, mine) = bootstrap::bind(t.rdv.ip, name)?;
        let net = ProcessNet { t, instance };
        let survivors = agree::shrink_agreement(&net, &ctx, excluded, Some(mine.to_string()))?;
        let parents: Vec<usize> = survivors.iter().map(|(r, _)| *r).collect();
        let addrs = survivors
            .iter()
            .map(|(r, i)| {
                i.addr
                    .as_deref()
                    .and_then(|a| bootstrap::parse_addr(a.as_bytes()))
                    .ok_or_else(|| CommError::invalid(&ctx, format!("rank {r} sent no address")))
            })
            .collect::<Result<Vec<_>>>()?;
        let my = parents
            .iter()
            .position(|&r| r == t.rank)
            .ok_or_else(|| CommError::invalid(&ctx, "this rank is not a survivor"))?;
        let ns = format!("{}/shrink{instance}", t.key);
        // A member the parent has lost since the agreement is not waited for: the new
        // communicator is born failed, naming it (every survivor's is: it is gone for all).
        let tolerate = |r: usize| parents.get(r).and_then(|&p| t.gone_reason(p));
        let b = ProcessBackend::bootstrap(
            t.rdv.clone(),
            ns,
            my,
            parents.len(),
            name,
            options,
            Some((&ctx, &parents)),
            Peers::Known {
                listener,
                addrs,
                tolerate: Some(&tolerate),
            },
        )?;
        Ok(b as Arc<dyn Backend>)
    }

    fn shrink_agrees_on_lists(&self) -> bool {
        true
    }

    fn agree(&self, ctx: OpCtx, ok: bool) -> Result<Agreement> {
        let instance = self.core.t.next_agreement();
        let net = ProcessNet {
            t: &self.core.t,
            instance,
        };
        Ok(agree::agree_ok(&net, ok, ctx.timeout))
    }

    fn abort(&self, reason: &str) {
        self.core.t.fail(
            Failure::Aborted {
                by: self.core.t.rank,
                reason: reason.to_string(),
                after: Some(self.core.t.completed()),
            },
            true,
        );
    }

    fn is_aborted(&self) -> bool {
        self.core.t.failure().is_some()
    }

    fn pending(&self) -> usize {
        self.core.queue.pending()
    }
}
