//! The progress engine: one thread per process that makes every MPI call.
//!
//! User threads never call MPI. They copy their inputs, wrap an operation in an [`Op`] and
//! queue it as a command; the progress thread (`cdt-mpi`) initializes MPI (asking for
//! `MPI_THREAD_MULTIPLE`, working with whatever it gets: it is the only thread that calls
//! MPI, so `MPI_THREAD_FUNNELED` suffices), then loops:
//!
//! 1. take new commands (ops, aborts, dropped communicators, finalize);
//! 2. per communicator: read failure notices from peers, start the next queued op when none
//!    runs (ops of one communicator run one at a time, in issue order), poll the running op
//!    (it tests its own nonblocking requests and posts the next ones), and turn an op past its
//!    deadline into a `Timeout` that fails the communicator and tells its peers;
//! 3. test detached sends (sends complete for the caller at once: they are buffered) and
//!    zombies (ops that failed while MPI still owned their buffers);
//! 4. when nothing completed: keep polling while a collective's data moves (every peer has
//!    joined, each test advances the transfer; bounded to 1 s without a completion), else
//!    yield for a while and then back off up to 250 us (peers are late), and block on a
//!    condvar when idle (new commands wake it; notices are looked for every 20 ms).
//!
//! No MPI call made here blocks on a peer, except `MPI_Comm_split`, made after every member
//! joined the split's descriptor exchange, so it only waits for peers already on their way
//! (and MPI keeps progressing other communicators' requests meanwhile). Two communicators
//! therefore never wait on each other.

use std::any::Any;
use std::collections::{BTreeMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::framing::{self, Desc};
use super::raw::{self, MpiError, RawComm, RawRequest};
use candle_dtensor_comm_core::kit::desc::Failure;
use candle_dtensor_comm_core::CommError;
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::WorkCompleter;

/// Tag of descriptor messages (one per peer and collective).
pub(crate) const TAG_DESC: c_int = 7101;
/// Tags of point-to-point headers and payloads.
pub(crate) const TAG_P2P_HDR: c_int = 7102;
pub(crate) const TAG_P2P_DATA: c_int = 7103;
/// Tags of scatter headers and payloads.
pub(crate) const TAG_SCATTER_HDR: c_int = 7104;
pub(crate) const TAG_SCATTER_DATA: c_int = 7105;
/// Tag of failure notices (abort, timeout).
const TAG_NOTICE: c_int = 7106;
/// Words of a failure notice (4 KiB).
const NOTICE_WORDS: usize = 512;

/// How long `atexit` waits for MPI to finalize (peers finalize together; one still busy
/// holds the others up). Overridable with `CDT_MPI_FINALIZE_TIMEOUT_S`.
const FINALIZE_WAIT: Duration = Duration::from_secs(60);

/// What the process's MPI library gave us.
#[derive(Debug, Clone)]
pub struct MpiInfo {
    /// This process's rank in `MPI_COMM_WORLD`.
    pub rank: usize,
    /// The number of processes in `MPI_COMM_WORLD`.
    pub size: usize,
    /// The thread support level provided (`MPI_THREAD_MULTIPLE`, ...).
    pub thread_level: &'static str,
    /// The library and its version (`Open MPI v4.1.4`).
    pub library: String,
    /// Whether this backend initialized MPI (and finalizes it at exit).
    pub initialized_here: bool,
}

/// The state of one communicator that user threads share with the progress thread.
pub(crate) struct CommShared {
    pub(crate) id: u64,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    failure: Mutex<Option<Failure>>,
    pending: AtomicUsize,
    /// Set when the failure was raised on this rank and peers must hear of it.
    tell_peers: AtomicBool,
}

impl CommShared {
    fn lock(&self) -> MutexGuard<'_, Option<Failure>> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn failure(&self) -> Option<Failure> {
        self.lock().clone()
    }

    /// Records `f` unless a failure is already recorded; returns whether it was recorded.
    pub(crate) fn fail(&self, f: Failure, tell_peers: bool) -> bool {
        let mut g = self.lock();
        if g.is_some() {
            return false;
        }
        *g = Some(f);
        if tell_peers {
            self.tell_peers.store(true, Ordering::Release);
        }
        true
    }

    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }
}

/// A failure of one operation: its own (the communicator stays usable) or the communicator's.
pub(crate) enum Fail {
    /// This op fails with the error; later ops run.
    Op(CommError),
    /// The communicator fails; this op reports `failure.to_error` for its collective index.
    Comm(Failure),
}

impl From<MpiError> for Fail {
    fn from(e: MpiError) -> Self {
        Fail::Comm(Failure::Mpi {
            what: e.to_string(),
        })
    }
}

/// Requests of an operation, each tagged with the peer a receive waits for (for timeouts).
#[derive(Default)]
pub(crate) struct Reqs {
    v: Vec<(RawRequest, Option<usize>)>,
}

impl Reqs {
    pub(crate) fn push(&mut self, r: RawRequest) {
        self.v.push((r, None));
    }

    /// A receive from `peer` (a timeout names it while it is pending).
    pub(crate) fn push_recv(&mut self, r: RawRequest, peer: usize) {
        self.v.push((r, Some(peer)));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.v.is_empty()
    }

    /// Tests every request; true once all completed (they are then dropped).
    pub(crate) fn test_all(&mut self) -> Result<bool, MpiError> {
        for (r, _) in &mut self.v {
            if !r.is_null() {
                raw::test(r)?;
            }
        }
        if self.v.iter().all(|(r, _)| r.is_null()) {
            self.v.clear();
            return Ok(true);
        }
        Ok(false)
    }

    /// Peers of pending receives.
    pub(crate) fn waiting_for(&self) -> Vec<usize> {
        let mut p: Vec<usize> = self
            .v
            .iter()
            .filter(|(r, _)| !r.is_null())
            .filter_map(|(_, p)| *p)
            .collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    /// Cancels pending receives (they can never match now); true while requests are live
    /// (they are tested until complete, their buffers kept until then).
    pub(crate) fn cancel_receives(&mut self) -> bool {
        for (r, p) in &mut self.v {
            if p.is_some() {
                raw::cancel(r);
            }
        }
        !self.test_all().unwrap_or(true)
    }
}

/// Sends that completed for their caller but not yet in MPI, with what they read from.
pub(crate) struct Detached {
    pub(crate) reqs: Vec<RawRequest>,
    /// What the sends read; dropped once they complete.
    pub(crate) _keep: Box<dyn Any + Send>,
}

/// What an operation sees of its communicator and the engine while it runs.
pub(crate) struct Cx<'a> {
    pub(crate) comm: RawComm,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) uid: u64,
    /// The op's collective index (`u64::MAX` for point-to-point ops).
    pub(crate) coll: u64,
    pub(crate) ctx: &'a OpCtx,
    pub(crate) detached: &'a mut Vec<Detached>,
    /// Communicators created by the op (split, new_comm), registered after the poll.
    pub(crate) created: &'a mut Vec<CommState>,
    pub(crate) engine: &'a Arc<Engine>,
}

impl Cx<'_> {
    /// Registers a new communicator over `raw` (this rank `rank` of `size`).
    pub(crate) fn register(
        &mut self,
        raw: RawComm,
        uid: u64,
        rank: usize,
        size: usize,
    ) -> Result<Arc<CommShared>, MpiError> {
        raw::set_errors_return(raw)?;
        let state = CommState::new(self.engine.next_id(), raw, uid, rank, size)?;
        let shared = state.shared.clone();
        self.created.push(state);
        Ok(shared)
    }

    /// Keeps `keep` alive until `reqs` complete.
    pub(crate) fn detach(&mut self, reqs: Vec<RawRequest>, keep: Box<dyn Any + Send>) {
        if !reqs.iter().all(RawRequest::is_null) {
            self.detached.push(Detached { reqs, _keep: keep });
        }
    }
}

/// One operation as the engine drives it.
pub(crate) trait Op: Send {
    fn ctx(&self) -> &OpCtx;
    /// Whether it takes a collective index (and runs the descriptor exchange).
    fn collective(&self) -> bool;
    /// Marks the work started and posts the first requests.
    fn start(&mut self, cx: &mut Cx) -> Result<(), Fail>;
    /// Advances; true once finished (the work is then complete).
    fn poll(&mut self, cx: &mut Cx) -> Result<bool, Fail>;
    /// Completes the work with `err` (no-op if already complete).
    fn fail(&mut self, err: CommError);
    /// The peers it is still waiting for (for a timeout).
    fn missing(&self) -> Vec<usize>;
    /// Gives up: cancels receives; true while MPI still owns some of its buffers.
    fn abandon(&mut self) -> bool;
    /// Tests what is left after `abandon`; true once nothing is.
    fn drained(&mut self) -> bool;
    /// Whether data is moving: every peer joined (the exchange is done) and requests are in
    /// flight. The engine then polls without sleeping (each test advances the transfer);
    /// while peers are still missing it backs off instead.
    fn hot(&self) -> bool;
}

/// An op body: the part that differs per operation (see [`Job`]).
/// What one [`Body::step`] returns: the output once done, `None` while requests are pending.
pub(crate) type Step<T> = Result<Option<T>, Fail>;

pub(crate) trait Body: Send + 'static {
    type Out: Send + 'static;
    /// The descriptor this rank contributes (collectives), from which the peers learn sizes
    /// and check agreement; `None` for point-to-point ops (no exchange).
    fn desc(&self, uid: u64, coll: u64) -> Option<Desc>;
    /// Called after the exchange (with every rank's descriptor in rank order; empty for
    /// point-to-point ops) and again whenever every request in `reqs` completed. Posts more
    /// requests and returns `None`, or returns the output. Returning `None` with no requests
    /// posted means "poll me again" (waiting on something outside MPI).
    fn step(&mut self, cx: &mut Cx, descs: &[Desc], reqs: &mut Reqs) -> Step<Self::Out>;
}

/// The descriptor exchange: every rank sends its descriptor to every peer and receives
/// theirs, point to point, so a timeout knows exactly which peers never arrived.
struct Exchange {
    send: Box<[u64]>,
    recv: Vec<Box<[u64]>>,
    reqs: Vec<RawRequest>,
    sends: Vec<RawRequest>,
    descs: Vec<Option<Desc>>,
}

impl Exchange {
    fn post(cx: &mut Cx, mine: Desc) -> Result<Exchange, Fail> {
        let n = cx.size;
        let words = framing::HEADER_WORDS + 2 * n + 8;
        let send = mine.encode().into_boxed_slice();
        let u64t = raw::element_type(8);
        let mut x = Exchange {
            recv: (0..n)
                .map(|_| vec![0u64; words].into_boxed_slice())
                .collect(),
            reqs: (0..n).map(|_| RawRequest::null()).collect(),
            sends: Vec::with_capacity(n.saturating_sub(1)),
            descs: vec![None; n],
            send,
        };
        x.descs[cx.rank] = Some(mine);
        for p in (0..n).filter(|&p| p != cx.rank) {
            x.repost(cx, p)?;
            // SAFETY: `send` is a boxed slice owned by the exchange, which stays alive (as part
            // of its op, a zombie, or a detached entry) until this request completes.
            x.sends.push(unsafe {
                raw::isend(
                    x.send.as_ptr().cast(),
                    x.send.len() as c_int,
                    u64t,
                    p,
                    TAG_DESC,
                    cx.comm,
                )
            }?);
        }
        Ok(x)
    }

    fn repost(&mut self, cx: &Cx, p: usize) -> Result<(), MpiError> {
        let buf = &mut self.recv[p];
        // SAFETY: the boxed slice is owned by the exchange and outlives the request (see
        // `post`); nothing else touches it until the request completes.
        self.reqs[p] = unsafe {
            raw::irecv(
                buf.as_mut_ptr().cast::<c_void>(),
                buf.len() as c_int,
                raw::element_type(8),
                p as c_int,
                TAG_DESC,
                cx.comm,
            )
        }?;
        Ok(())
    }

    /// Every rank's descriptor once all arrived.
    fn poll(&mut self, cx: &mut Cx) -> Result<Option<Vec<Desc>>, Fail> {
        let u64t = raw::element_type(8);
        for p in 0..cx.size {
            if self.descs[p].is_some() {
                continue;
            }
            let Some(status) = raw::test(&mut self.reqs[p])? else {
                continue;
            };
            let len = raw::received_count(&status, u64t);
            match Desc::decode(&self.recv[p][..len.min(self.recv[p].len())]) {
                Some(d) if d.uid == cx.uid => self.descs[p] = Some(d),
                // A message of another communicator that reused this one's MPI context:
                // drop it and wait for the real one.
                Some(_) => self.repost(cx, p)?,
                None => {
                    return Err(Fail::Comm(Failure::Mpi {
                        what: format!("rank {p} sent an unreadable descriptor ({len} words)"),
                    }))
                }
            }
        }
        for s in &mut self.sends {
            raw::test(s)?;
        }
        if self.descs.iter().all(Option::is_some) {
            return Ok(Some(self.descs.iter().flatten().cloned().collect()));
        }
        Ok(None)
    }

    fn missing(&self) -> Vec<usize> {
        (0..self.descs.len())
            .filter(|&p| self.descs[p].is_none())
            .collect()
    }

    /// Cancels pending receives; true while requests are live.
    fn abandon(&mut self) -> bool {
        for r in &mut self.reqs {
            raw::cancel(r);
        }
        self.live()
    }

    /// Whether any request (send, or a cancelled receive) is still live.
    fn live(&mut self) -> bool {
        for r in self.sends.iter_mut().chain(self.reqs.iter_mut()) {
            if !r.is_null() && raw::test(r).is_err() {
                *r = RawRequest::null();
            }
        }
        self.sends.iter().chain(&self.reqs).any(|r| !r.is_null())
    }

    fn sends_live(&mut self) -> bool {
        for s in &mut self.sends {
            let _ = raw::test(s);
        }
        self.sends.iter().any(|s| !s.is_null())
    }
}

enum Phase {
    NotStarted,
    Exchange(Exchange),
    Body,
    Done,
}

/// An operation: the descriptor exchange (collectives), then its [`Body`], completing a
/// typed work.
pub(crate) struct Job<B: Body> {
    ctx: OpCtx,
    collective: bool,
    body: B,
    completer: Option<WorkCompleter<B::Out>>,
    phase: Phase,
    descs: Vec<Desc>,
    reqs: Reqs,
    /// A finished exchange whose sends may still be in flight.
    spent: Option<Exchange>,
}

impl<B: Body> Job<B> {
    pub(crate) fn new(
        ctx: OpCtx,
        collective: bool,
        body: B,
        completer: WorkCompleter<B::Out>,
    ) -> Self {
        Job {
            ctx,
            collective,
            body,
            completer: Some(completer),
            phase: Phase::NotStarted,
            descs: Vec::new(),
            reqs: Reqs::default(),
            spent: None,
        }
    }

    fn finish(&mut self, r: candle_dtensor_comm_core::Result<B::Out>) {
        self.phase = Phase::Done;
        if let Some(c) = self.completer.take() {
            c.complete(r);
        }
    }
}

/// The desync check: every descriptor against rank 0's (all ranks reach the same verdict).
fn check_agreement(descs: &[Desc]) -> Result<(), Fail> {
    let Some(first) = descs.first() else {
        return Ok(());
    };
    if let Some((r, d)) = descs.iter().enumerate().find(|(_, d)| !first.compatible(d)) {
        return Err(Fail::Comm(Failure::desync(
            first.coll,
            (0, &first.what),
            (r, &d.what),
        )));
    }
    Ok(())
}

impl<B: Body> Op for Job<B> {
    fn ctx(&self) -> &OpCtx {
        &self.ctx
    }

    fn collective(&self) -> bool {
        self.collective
    }

    fn start(&mut self, cx: &mut Cx) -> Result<(), Fail> {
        if let Some(c) = &self.completer {
            c.start();
        }
        self.phase = match self.body.desc(cx.uid, cx.coll) {
            Some(d) if self.collective => Phase::Exchange(Exchange::post(cx, d)?),
            _ => Phase::Body,
        };
        Ok(())
    }

    fn poll(&mut self, cx: &mut Cx) -> Result<bool, Fail> {
        if let Some(x) = &mut self.spent {
            if !x.sends_live() {
                self.spent = None;
            }
        }
        loop {
            match &mut self.phase {
                Phase::NotStarted => return Ok(false),
                Phase::Done => return Ok(true),
                Phase::Exchange(x) => match x.poll(cx)? {
                    None => return Ok(false),
                    Some(descs) => {
                        check_agreement(&descs)?;
                        self.descs = descs;
                        if let Phase::Exchange(x) = std::mem::replace(&mut self.phase, Phase::Body)
                        {
                            self.spent = Some(x);
                        }
                    }
                },
                Phase::Body => {
                    if !self.reqs.test_all()? {
                        return Ok(false);
                    }
                    match self.body.step(cx, &self.descs, &mut self.reqs)? {
                        Some(out) => {
                            self.finish(Ok(out));
                            if let Some(x) = self.spent.take() {
                                // Keep the exchange's buffer until its sends complete.
                                let mut x = x;
                                if x.sends_live() {
                                    let reqs = std::mem::take(&mut x.sends);
                                    cx.detach(reqs, Box::new(x.send));
                                }
                            }
                            return Ok(true);
                        }
                        None if self.reqs.is_empty() => return Ok(false),
                        None => {}
                    }
                }
            }
        }
    }

    fn fail(&mut self, err: CommError) {
        self.finish(Err(err));
    }

    fn missing(&self) -> Vec<usize> {
        match &self.phase {
            Phase::Exchange(x) => x.missing(),
            _ => self.reqs.waiting_for(),
        }
    }

    fn abandon(&mut self) -> bool {
        let mut live = self.reqs.cancel_receives();
        if let Phase::Exchange(x) = &mut self.phase {
            live |= x.abandon();
        }
        if let Some(x) = &mut self.spent {
            live |= x.sends_live();
        }
        live
    }

    fn hot(&self) -> bool {
        matches!(self.phase, Phase::Body) && !self.reqs.is_empty()
    }

    fn drained(&mut self) -> bool {
        let reqs_done = self.reqs.test_all().unwrap_or(true);
        let x_done = match &mut self.phase {
            Phase::Exchange(x) => !x.live(),
            _ => true,
        };
        let spent_done = self.spent.as_mut().is_none_or(|x| !x.sends_live());
        reqs_done && x_done && spent_done
    }
}

struct Running {
    op: Box<dyn Op>,
    coll: u64,
    deadline: Instant,
}

/// One communicator, as the progress thread holds it.
pub(crate) struct CommState {
    pub(crate) shared: Arc<CommShared>,
    raw: RawComm,
    uid: u64,
    queue: VecDeque<Box<dyn Op>>,
    running: Option<Running>,
    next_coll: u64,
    notice: Box<[u64]>,
    notice_req: RawRequest,
    /// The backend handle is gone: free the communicator once idle.
    dropped: bool,
    /// The failure has been handled here (queue failed, peers told).
    failure_seen: bool,
}

impl CommState {
    fn new(id: u64, raw: RawComm, uid: u64, rank: usize, size: usize) -> Result<Self, MpiError> {
        let mut s = CommState {
            shared: Arc::new(CommShared {
                id,
                rank,
                size,
                failure: Mutex::new(None),
                pending: AtomicUsize::new(0),
                tell_peers: AtomicBool::new(false),
            }),
            raw,
            uid,
            queue: VecDeque::new(),
            running: None,
            next_coll: 0,
            notice: vec![0u64; NOTICE_WORDS].into_boxed_slice(),
            notice_req: RawRequest::null(),
            dropped: false,
            failure_seen: false,
        };
        if size > 1 {
            s.post_notice_recv()?;
        }
        Ok(s)
    }

    fn post_notice_recv(&mut self) -> Result<(), MpiError> {
        // SAFETY: `notice` is a boxed slice owned by this state, which is never dropped while
        // the request is live (it is cancelled and freed first, see `release`).
        self.notice_req = unsafe {
            raw::irecv(
                self.notice.as_mut_ptr().cast(),
                self.notice.len() as c_int,
                raw::element_type(8),
                raw::any_source(),
                TAG_NOTICE,
                self.raw,
            )
        }?;
        Ok(())
    }

    fn idle(&self) -> bool {
        self.running.is_none() && self.queue.is_empty()
    }

    /// Reads a failure notice from a peer, if one arrived.
    fn poll_notice(&mut self) -> Result<bool, MpiError> {
        if self.notice_req.is_null() {
            return Ok(false);
        }
        let Some(status) = raw::test(&mut self.notice_req)? else {
            return Ok(false);
        };
        let len = raw::received_count(&status, raw::element_type(8));
        match framing::decode_notice(&self.notice[..len.min(NOTICE_WORDS)], self.uid) {
            Some(f) => {
                self.shared.fail(f, false);
            }
            // Not ours (a reused MPI context): listen again.
            None => self.post_notice_recv()?,
        }
        Ok(true)
    }

    /// Reads failure notices (an MPI error reading them fails the communicator too); true if
    /// one arrived.
    fn read_notices(&mut self) -> bool {
        match self.poll_notice() {
            Ok(m) => m,
            Err(e) => {
                let what = e.to_string();
                self.shared.fail(Failure::Mpi { what }, false);
                true
            }
        }
    }

    /// Tells every peer about a failure raised here.
    fn tell_peers(&mut self, f: &Failure, detached: &mut Vec<Detached>) {
        let Some(words) = framing::encode_notice(f, self.uid, NOTICE_WORDS) else {
            return;
        };
        let buf = words.into_boxed_slice();
        let mut reqs = Vec::new();
        for p in (0..self.shared.size).filter(|&p| p != self.shared.rank) {
            // SAFETY: `buf` moves into the detached list below with these requests and stays
            // there until they complete.
            match unsafe {
                raw::isend(
                    buf.as_ptr().cast(),
                    buf.len() as c_int,
                    raw::element_type(8),
                    p,
                    TAG_NOTICE,
                    self.raw,
                )
            } {
                Ok(r) => reqs.push(r),
                Err(e) => {
                    tracing::warn!(error = %e, peer = p, "mpi: could not tell a peer about a failure")
                }
            }
        }
        detached.push(Detached {
            reqs,
            _keep: Box::new(buf),
        });
    }

    /// Stops listening for notices (the buffer goes to `detached` until the cancel completes).
    ///
    /// The MPI communicator itself is never freed: MPI would reuse its context id, and a
    /// message still in flight to it (a descriptor from a peer that went on while this rank
    /// gave up, a late notice) would then be matched against, or with Open MPI 4.1 crash, the
    /// communicator that reuses it. A communicator costs MPI a few kilobytes; programs create
    /// a handful.
    fn release(mut self, detached: &mut Vec<Detached>) {
        raw::cancel(&mut self.notice_req);
        let req = std::mem::replace(&mut self.notice_req, RawRequest::null());
        let buf = std::mem::take(&mut self.notice);
        detached.push(Detached {
            reqs: vec![req],
            _keep: Box::new(buf),
        });
    }
}

enum Cmd {
    Submit {
        comm: u64,
        op: Box<dyn Op>,
    },
    /// A communicator failed on a user thread: wake up and handle it.
    Failed,
    Dropped {
        comm: u64,
    },
    Finalize,
}

struct Inbox {
    cmds: VecDeque<Cmd>,
    finalized: bool,
}

/// The process-wide MPI engine (see the module docs).
pub(crate) struct Engine {
    inbox: Mutex<Inbox>,
    cv: Condvar,
    has_cmds: AtomicBool,
    next_id: AtomicU64,
    pub(crate) info: MpiInfo,
    /// The communicator `new_comm` runs its exchange on (a dup of `MPI_COMM_WORLD`).
    pub(crate) bootstrap: Arc<CommShared>,
    finalize_done: (Mutex<bool>, Condvar),
}

static ENGINE: OnceLock<Result<Arc<Engine>, String>> = OnceLock::new();

impl Engine {
    /// The engine, started (and MPI initialized) on first use, waiting at most `timeout`.
    pub(crate) fn get(timeout: Duration) -> Result<Arc<Engine>, String> {
        ENGINE.get_or_init(|| Engine::start(timeout)).clone()
    }

    /// The engine if it was started.
    pub(crate) fn running() -> Option<Arc<Engine>> {
        ENGINE.get().and_then(|r| r.as_ref().ok()).cloned()
    }

    fn start(timeout: Duration) -> Result<Arc<Engine>, String> {
        let (tx, rx) = std::sync::mpsc::channel::<Result<Arc<Engine>, String>>();
        std::thread::Builder::new()
            .name("cdt-mpi".into())
            .spawn(move || progress_main(tx))
            .map_err(|e| format!("could not start the MPI progress thread: {e}"))?;
        let engine = rx
            .recv_timeout(timeout)
            .map_err(|_| format!("MPI initialization did not finish within {timeout:?}"))??;
        // SAFETY: `finalize_at_exit` is an `extern "C" fn()` that never unwinds across the C
        // boundary (it catches panics) and touches only this module's statics.
        let rc = unsafe { atexit(finalize_at_exit) };
        if rc != 0 {
            tracing::warn!("mpi: atexit registration failed; MPI will not be finalized at exit");
        }
        Ok(engine)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn push(&self, cmd: Cmd) -> bool {
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if inbox.finalized {
            return false;
        }
        inbox.cmds.push_back(cmd);
        self.has_cmds.store(true, Ordering::Release);
        drop(inbox);
        self.cv.notify_one();
        true
    }

    /// Queues `op` on communicator `comm`.
    ///
    /// On a failed communicator the op's work fails at once (as the local backend's would, on
    /// its first wait), without reaching the progress thread.
    pub(crate) fn submit(&self, comm: &CommShared, mut op: Box<dyn Op>) {
        if let Some(f) = comm.failure() {
            op.fail(f.to_error(op.ctx(), None));
            return;
        }
        comm.pending.fetch_add(1, Ordering::AcqRel);
        let id = comm.id;
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if inbox.finalized {
            drop(inbox);
            comm.pending.fetch_sub(1, Ordering::AcqRel);
            op.fail(Failure::Finalized.to_error(op.ctx(), None));
            return;
        }
        inbox.cmds.push_back(Cmd::Submit { comm: id, op });
        self.has_cmds.store(true, Ordering::Release);
        drop(inbox);
        self.cv.notify_one();
    }

    /// Fails communicator `comm` with `f` (raised here: peers are told). Never blocks.
    pub(crate) fn fail(&self, comm: &CommShared, f: Failure) {
        comm.fail(f, true);
        self.push(Cmd::Failed);
    }

    /// The backend handle of `comm` is gone.
    pub(crate) fn dropped(&self, comm: &CommShared) {
        self.push(Cmd::Dropped { comm: comm.id });
    }

    /// Asks the progress thread to finalize MPI and waits (bounded) for it.
    fn finalize(&self, wait: Duration) {
        if !self.push(Cmd::Finalize) {
            return;
        }
        let (m, cv) = &self.finalize_done;
        let deadline = Instant::now() + wait;
        let mut done = m.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!("mpi: finalize did not finish within {wait:?}; exiting without it");
                return;
            }
            done = cv
                .wait_timeout(done, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

extern "C" {
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// Finalizes MPI when the process exits normally (`main` returns or `std::process::exit`).
extern "C" fn finalize_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(e) = Engine::running() {
            let wait = std::env::var("CDT_MPI_FINALIZE_TIMEOUT_S")
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .map_or(FINALIZE_WAIT, Duration::from_secs);
            e.finalize(wait);
        }
    });
}

/// The progress thread's own state.
struct Progress {
    engine: Arc<Engine>,
    comms: BTreeMap<u64, CommState>,
    detached: Vec<Detached>,
    zombies: Vec<Box<dyn Op>>,
    universe: Option<mpi::environment::Universe>,
    abort_process: bool,
}

/// Initializes MPI on this thread, reports the engine, then runs the loop.
fn progress_main(tx: std::sync::mpsc::Sender<Result<Arc<Engine>, String>>) {
    let (universe, provided) = match mpi::initialize_with_threading(mpi::Threading::Multiple) {
        Some((u, t)) => (Some(u), t),
        None => (None, mpi::environment::threading_support()),
    };
    let level = match provided {
        mpi::Threading::Single => 0,
        mpi::Threading::Funneled => 1,
        mpi::Threading::Serialized => 2,
        mpi::Threading::Multiple => 3,
    };
    if universe.is_none() && level < 3 {
        let _ = tx.send(Err(format!(
            "MPI was initialized elsewhere with {}; the mpi backend calls MPI from its own \
             thread and then needs MPI_THREAD_MULTIPLE",
            raw::THREAD_LEVELS[level]
        )));
        return;
    }
    let setup = || -> Result<(RawComm, usize, usize), MpiError> {
        let world = raw::comm_world();
        let (rank, size) = raw::rank_size(world)?;
        // The bootstrap communicator: a private dup of the world, so our traffic never meets
        // the application's. Every process creates it when it first uses the backend.
        let mut boot = Box::new(raw::comm_null());
        let mut req = raw::comm_idup(world, &mut boot)?;
        while raw::test(&mut req)?.is_none() {
            std::thread::sleep(Duration::from_micros(200));
        }
        raw::set_errors_return(*boot)?;
        Ok((*boot, rank, size))
    };
    let (boot, rank, size) = match setup() {
        Ok(v) => v,
        Err(e) => {
            let _ = tx.send(Err(e.to_string()));
            return;
        }
    };
    let boot_uid = framing::hash_str("cdt-mpi-bootstrap");
    let boot_state = match CommState::new(0, boot, boot_uid, rank, size) {
        Ok(s) => s,
        Err(e) => {
            let _ = tx.send(Err(e.to_string()));
            return;
        }
    };
    let info = MpiInfo {
        rank,
        size,
        thread_level: raw::THREAD_LEVELS[level],
        library: raw::library_version(),
        initialized_here: universe.is_some(),
    };
    tracing::debug!(?info, "mpi: initialized");
    let engine = Arc::new(Engine {
        inbox: Mutex::new(Inbox {
            cmds: VecDeque::new(),
            finalized: false,
        }),
        cv: Condvar::new(),
        has_cmds: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
        info,
        bootstrap: boot_state.shared.clone(),
        finalize_done: (Mutex::new(false), Condvar::new()),
    });
    let mut p = Progress {
        engine: engine.clone(),
        comms: BTreeMap::new(),
        detached: Vec::new(),
        zombies: Vec::new(),
        universe,
        abort_process: false,
    };
    p.comms.insert(0, boot_state);
    if tx.send(Ok(engine)).is_err() {
        return;
    }
    p.run();
}

/// Busy-polling rounds (with `yield`) before the loop starts sleeping.
const SPIN_ROUNDS: u32 = 2000;
/// The longest sleep while operations wait for peers.
const MAX_BACKOFF: Duration = Duration::from_micros(250);
/// How long the loop polls without sleeping while data moves and nothing completes.
const HOT_SPIN: Duration = Duration::from_secs(1);
/// How often an idle loop still looks for failure notices.
const IDLE_POLL: Duration = Duration::from_millis(20);

impl Progress {
    fn run(&mut self) {
        let mut quiet_rounds: u32 = 0;
        let mut last_move = Instant::now();
        loop {
            let (moved, finalize) = self.take_commands();
            if finalize {
                self.finalize();
                return;
            }
            let mut moved = moved;
            let ids: Vec<u64> = self.comms.keys().copied().collect();
            for id in ids {
                moved |= self.poll_comm(id);
            }
            moved |= self.poll_background();
            self.release_dropped();
            if self.abort_process {
                tracing::error!("mpi: aborting every process (hint mpi.abort_process)");
                raw::abort_world(1);
            }
            if moved {
                quiet_rounds = 0;
                last_move = Instant::now();
                continue;
            }
            quiet_rounds = quiet_rounds.saturating_add(1);
            let busy = self.comms.values().any(|c| !c.idle())
                || !self.detached.is_empty()
                || !self.zombies.is_empty();
            // Spinning is bounded: a transfer stuck for HOT_SPIN (a peer died mid-collective)
            // falls back to the backoff until its timeout.
            let hot = last_move.elapsed() < HOT_SPIN
                && self
                    .comms
                    .values()
                    .any(|c| c.running.as_ref().is_some_and(|r| r.op.hot()));
            let wait = if !busy {
                IDLE_POLL
            } else if hot {
                continue;
            } else if quiet_rounds < SPIN_ROUNDS {
                std::thread::yield_now();
                continue;
            } else {
                let k = (quiet_rounds - SPIN_ROUNDS).min(10);
                (Duration::from_micros(10) * (1 << k)).min(MAX_BACKOFF)
            };
            let inbox = self.engine.inbox.lock().unwrap_or_else(|e| e.into_inner());
            if inbox.cmds.is_empty() {
                let _ = self.engine.cv.wait_timeout(inbox, wait);
            }
        }
    }

    /// Applies queued commands; returns (anything happened, finalize requested).
    fn take_commands(&mut self) -> (bool, bool) {
        if !self.engine.has_cmds.swap(false, Ordering::AcqRel) {
            return (false, false);
        }
        let cmds: Vec<Cmd> = {
            let mut inbox = self.engine.inbox.lock().unwrap_or_else(|e| e.into_inner());
            inbox.cmds.drain(..).collect()
        };
        let mut finalize = false;
        let any = !cmds.is_empty();
        for cmd in cmds {
            match cmd {
                Cmd::Submit { comm, mut op } => match self.comms.get_mut(&comm) {
                    Some(c) => c.queue.push_back(op),
                    None => op.fail(CommError::Aborted {
                        ctx: op.ctx().clone(),
                        reason: "the communicator was released".into(),
                    }),
                },
                Cmd::Failed => {} // handled by the next poll of that comm
                Cmd::Dropped { comm } => {
                    if let Some(c) = self.comms.get_mut(&comm) {
                        c.dropped = true;
                    }
                }
                Cmd::Finalize => finalize = true,
            }
        }
        (any, finalize)
    }

    /// Advances communicator `id`; true if anything happened.
    fn poll_comm(&mut self, id: u64) -> bool {
        let mut created = Vec::new();
        let mut moved = false;
        let Some(c) = self.comms.get_mut(&id) else {
            return false;
        };
        // Notices are read after the running op was polled: an op whose messages all arrived
        // before a peer's abort notice completes, as it would on the local backend.
        let mut notices_read = false;
        loop {
            if c.running.is_none() && !notices_read {
                notices_read = true;
                moved |= c.read_notices();
            }
            if let Some(f) = c.shared.failure() {
                if !c.failure_seen {
                    c.failure_seen = true;
                    moved = true;
                    fail_everything(c, &f, &mut self.zombies);
                    if c.shared.tell_peers.swap(false, Ordering::AcqRel) {
                        c.tell_peers(&f, &mut self.detached);
                        if self.engine.abort_on_failure() {
                            self.abort_process = true;
                        }
                    }
                }
                // Ops queued after the failure fail at once.
                while let Some(mut op) = c.queue.pop_front() {
                    op.fail(f.to_error(op.ctx(), None));
                    c.shared.pending.fetch_sub(1, Ordering::AcqRel);
                    moved = true;
                }
                break;
            }
            if c.running.is_none() {
                let Some(mut op) = c.queue.pop_front() else {
                    break;
                };
                let coll = if op.collective() {
                    c.next_coll += 1;
                    c.next_coll - 1
                } else {
                    u64::MAX
                };
                let deadline = Instant::now() + op.ctx().timeout;
                let ctx = op.ctx().clone();
                let mut cx = Cx {
                    comm: c.raw,
                    rank: c.shared.rank,
                    size: c.shared.size,
                    uid: c.uid,
                    coll,
                    ctx: &ctx,
                    detached: &mut self.detached,
                    created: &mut created,
                    engine: &self.engine,
                };
                let started = op.start(&mut cx);
                moved = true;
                c.running = Some(Running { op, coll, deadline });
                if let Err(f) = started {
                    settle(c, f, &mut self.zombies);
                    continue;
                }
            }
            let Some(run) = c.running.as_mut() else {
                break;
            };
            let ctx = run.op.ctx().clone();
            let mut cx = Cx {
                comm: c.raw,
                rank: c.shared.rank,
                size: c.shared.size,
                uid: c.uid,
                coll: run.coll,
                ctx: &ctx,
                detached: &mut self.detached,
                created: &mut created,
                engine: &self.engine,
            };
            match run.op.poll(&mut cx) {
                Ok(true) => {
                    c.running = None;
                    c.shared.pending.fetch_sub(1, Ordering::AcqRel);
                    moved = true;
                    continue; // start the next one at once
                }
                Ok(false) => {
                    let (deadline, coll) = (run.deadline, run.coll);
                    if !notices_read {
                        notices_read = true;
                        if c.read_notices() {
                            moved = true;
                            continue;
                        }
                    }
                    if Instant::now() >= deadline {
                        let missing = c.running.as_ref().map(|r| r.op.missing());
                        let f = Failure::Timeout {
                            collective: coll,
                            op: ctx.op,
                            missing: missing.unwrap_or_default(),
                        };
                        tracing::warn!(%ctx, failure = %f, "mpi: operation timed out");
                        c.shared.fail(f, true);
                        moved = true;
                        continue; // the failure branch above completes it
                    }
                    break;
                }
                Err(f) => {
                    settle(c, f, &mut self.zombies);
                    moved = true;
                }
            }
        }
        for s in created {
            self.comms.insert(s.shared.id, s);
        }
        moved
    }

    /// Tests detached sends and zombies; true if any finished.
    fn poll_background(&mut self) -> bool {
        let before = self.detached.len() + self.zombies.len();
        self.detached.retain_mut(|d| {
            for r in &mut d.reqs {
                if let Err(e) = raw::test(r) {
                    tracing::warn!(error = %e, "mpi: a detached send failed");
                    *r = RawRequest::null();
                }
            }
            d.reqs.iter().any(|r| !r.is_null())
        });
        self.zombies.retain_mut(|z| !z.drained());
        self.detached.len() + self.zombies.len() != before
    }

    /// Frees communicators whose handles are gone and that have nothing left to do.
    fn release_dropped(&mut self) {
        let done: Vec<u64> = self
            .comms
            .iter()
            .filter(|(_, c)| c.dropped && c.idle())
            .map(|(&id, _)| id)
            .collect();
        for id in done {
            if let Some(c) = self.comms.remove(&id) {
                c.release(&mut self.detached);
            }
        }
    }

    fn finalize(&mut self) {
        let f = Failure::Finalized;
        for c in self.comms.values_mut() {
            c.shared.fail(f.clone(), false);
            fail_everything(c, &f, &mut self.zombies);
            while let Some(mut op) = c.queue.pop_front() {
                op.fail(f.to_error(op.ctx(), None));
            }
        }
        // Give buffered sends a moment to reach their receivers.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !self.detached.is_empty() && Instant::now() < deadline {
            self.poll_background();
            std::thread::sleep(Duration::from_micros(200));
        }
        let clean = self.zombies.is_empty();
        for (_, mut c) in std::mem::take(&mut self.comms) {
            raw::cancel(&mut c.notice_req);
            let mut spins = 0;
            while !c.notice_req.is_null() && spins < 1000 {
                if raw::test(&mut c.notice_req).is_err() {
                    break;
                }
                spins += 1;
            }
            if !c.notice_req.is_null() {
                // Never completed: leave the request and its buffer to the process's end.
                std::mem::forget(c);
            }
        }
        {
            let mut inbox = self.engine.inbox.lock().unwrap_or_else(|e| e.into_inner());
            inbox.finalized = true;
            for cmd in inbox.cmds.drain(..) {
                if let Cmd::Submit { mut op, .. } = cmd {
                    op.fail(f.to_error(op.ctx(), None));
                }
            }
        }
        if clean {
            // Dropping the universe calls MPI_Finalize.
            drop(self.universe.take());
        } else {
            tracing::warn!(
                zombies = self.zombies.len(),
                "mpi: operations still in flight at exit; not finalizing MPI"
            );
            std::mem::forget(self.universe.take());
        }
        let (m, cv) = &self.engine.finalize_done;
        *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

impl Engine {
    /// Whether a failure raised here ends the whole job (`mpi.abort_process` hint, read from
    /// the environment variable `CDT_MPI_ABORT_PROCESS` too).
    fn abort_on_failure(&self) -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| {
            std::env::var("CDT_MPI_ABORT_PROCESS")
                .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
                .unwrap_or(false)
        }) || ABORT_PROCESS_HINT.load(Ordering::Relaxed)
    }
}

/// Set by a communicator created with the hint `mpi.abort_process=true`.
pub(crate) static ABORT_PROCESS_HINT: AtomicBool = AtomicBool::new(false);

/// Fails the running op of `c` with `f` (a zombie if MPI still owns its buffers).
fn fail_everything(c: &mut CommState, f: &Failure, zombies: &mut Vec<Box<dyn Op>>) {
    if let Some(mut run) = c.running.take() {
        run.op.fail(f.to_error(run.op.ctx(), Some(run.coll)));
        c.shared.pending.fetch_sub(1, Ordering::AcqRel);
        if run.op.abandon() {
            zombies.push(run.op);
        }
    }
}

/// Ends the running op of `c` after it failed with `fail`.
fn settle(c: &mut CommState, fail: Fail, zombies: &mut Vec<Box<dyn Op>>) {
    match fail {
        Fail::Op(e) => {
            if let Some(mut run) = c.running.take() {
                run.op.fail(e);
                c.shared.pending.fetch_sub(1, Ordering::AcqRel);
                if run.op.abandon() {
                    zombies.push(run.op);
                }
            }
        }
        Fail::Comm(f) => {
            // Every rank detects a desync or mismatch by itself; other failures are told.
            let tell = !matches!(f, Failure::Desync { .. } | Failure::Mismatch { .. });
            c.shared.fail(f, tell);
        }
    }
}
