//! Test doubles: [`MockApi`] (a scripted NCCL) and [`FakeStreams`] / [`FakeEvent`] (a device
//! whose events the test completes by hand). torchcomms' `NcclMock` plays the same role.

use std::any::Any;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::api::{
    Call, DevPtr, NcclApi, NcclCode, Optional, RawComm, RawStream, RawWindow, UniqueId,
};
use super::config::RawConfig;
use super::engine::{Event, Streams};

/// What the mock saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Logged {
    Init {
        nranks: i32,
        rank: i32,
        blocking: i32,
    },
    Split {
        comm: RawComm,
        color: i32,
        key: i32,
    },
    Abort(RawComm),
    Finalize(RawComm),
    Destroy(RawComm),
    Revoke(RawComm),
    Shrink {
        comm: RawComm,
        excluded: Vec<i32>,
        flags: i32,
    },
    GroupStart,
    GroupEnd,
    Enqueue(Call),
    MemAlloc(usize),
    MemFree(DevPtr),
    WindowRegister(RawComm, usize),
    WindowDeregister(RawComm, RawWindow),
    /// `Streams::release_cached_memory` of a [`FakeStreams`] logging to this api.
    ReleaseCachedMemory,
}

#[derive(Default)]
struct State {
    version: i32,
    missing: HashSet<Optional>,
    log: Vec<Logged>,
    /// Per-communicator scripted `ncclCommGetAsyncError` answers; then `steady`.
    script: HashMap<usize, VecDeque<NcclCode>>,
    steady: HashMap<usize, NcclCode>,
    /// What the next init / split call returns.
    init_code: Option<NcclCode>,
    split_code: Option<NcclCode>,
    /// Handles are written only after this many async-error polls (NVIDIA/nccl#1472).
    handle_delay: usize,
    /// (handle, address of the engine's out-parameter, polls left).
    delayed: Vec<(usize, usize, usize)>,
    /// (rank, size) NCCL reports for a communicator.
    shape: HashMap<usize, (i32, i32)>,
    /// The (rank, size) of the next handle, instead of the one asked for.
    next_shape: Option<(i32, i32)>,
    group_end: VecDeque<NcclCode>,
    fail_call: Option<(&'static str, NcclCode)>,
    next: usize,
}

/// A scripted NCCL; see the module docs.
pub struct MockApi {
    st: Mutex<State>,
}

impl MockApi {
    /// A healthy NCCL 2.29.3 with every function.
    pub fn new() -> Self {
        MockApi {
            st: Mutex::new(State {
                version: 22903,
                next: 0x1000,
                ..State::default()
            }),
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_version(&self, code: i32) {
        self.st().version = code;
    }

    pub fn remove(&self, f: Optional) {
        self.st().missing.insert(f);
    }

    /// The next `ncclCommGetAsyncError` answers for `comm`.
    pub fn script(&self, comm: RawComm, codes: &[NcclCode]) {
        self.st()
            .script
            .entry(comm.0)
            .or_default()
            .extend(codes.iter().copied());
    }

    /// The answer once the script is exhausted (default success).
    pub fn set_state(&self, comm: RawComm, code: NcclCode) {
        self.st().steady.insert(comm.0, code);
    }

    pub fn set_init_code(&self, code: NcclCode) {
        self.st().init_code = Some(code);
    }

    pub fn set_split_code(&self, code: NcclCode) {
        self.st().split_code = Some(code);
    }

    pub fn set_handle_delay(&self, polls: usize) {
        self.st().handle_delay = polls;
    }

    /// Makes the next communicator report (rank, size) whatever was asked.
    pub fn set_next_shape(&self, rank: i32, size: i32) {
        self.st().next_shape = Some((rank, size));
    }

    /// The next `ncclGroupEnd` answers (then success).
    pub fn script_group_end(&self, codes: &[NcclCode]) {
        self.st().group_end.extend(codes.iter().copied());
    }

    /// Makes every enqueue of `name` fail with `code`.
    pub fn fail_call(&self, name: &'static str, code: NcclCode) {
        self.st().fail_call = Some((name, code));
    }

    /// Logs a [`FakeStreams`] release (see [`FakeStreams::log_to`]).
    pub fn log_release(&self) {
        self.st().log.push(Logged::ReleaseCachedMemory);
    }

    pub fn log(&self) -> Vec<Logged> {
        self.st().log.clone()
    }

    /// The enqueued calls, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.log()
            .into_iter()
            .filter_map(|l| match l {
                Logged::Enqueue(c) => Some(c),
                _ => None,
            })
            .collect()
    }

    pub fn count(&self, pred: impl Fn(&Logged) -> bool) -> usize {
        self.log().iter().filter(|l| pred(l)).count()
    }

    fn new_handle(&self, st: &mut State, out: &AtomicUsize, rank: i32, size: i32) -> usize {
        let h = st.next;
        st.next += 0x10;
        let shape = st.next_shape.take().unwrap_or((rank, size));
        st.shape.insert(h, shape);
        if st.handle_delay == 0 {
            out.store(h, Ordering::Release);
        } else {
            // Written later, from `async_error` (as NCCL's background thread does); the engine
            // keeps (or leaks) the out-parameter until the handle appears.
            let addr = out as *const AtomicUsize as usize;
            let delay = st.handle_delay;
            st.delayed.push((h, addr, delay));
        }
        h
    }
}

impl NcclApi for MockApi {
    fn version(&self) -> Result<i32, NcclCode> {
        Ok(self.st().version)
    }

    fn has(&self, f: Optional) -> bool {
        !self.st().missing.contains(&f)
    }

    fn unique_id(&self) -> Result<UniqueId, NcclCode> {
        let mut id = [0u8; 128];
        for (i, b) in id.iter_mut().enumerate() {
            *b = i as u8 ^ 0x5a;
        }
        Ok(UniqueId(id))
    }

    fn init_rank(
        &self,
        out: &AtomicUsize,
        nranks: i32,
        _id: &UniqueId,
        rank: i32,
        config: &RawConfig,
    ) -> NcclCode {
        let mut st = self.st();
        st.log.push(Logged::Init {
            nranks,
            rank,
            blocking: config.blocking,
        });
        let code = st.init_code.take().unwrap_or(NcclCode::IN_PROGRESS);
        if code.is_success() || code == NcclCode::IN_PROGRESS {
            self.new_handle(&mut st, out, rank, nranks);
        }
        code
    }

    fn split(
        &self,
        comm: RawComm,
        color: i32,
        key: i32,
        out: &AtomicUsize,
        _config: &RawConfig,
    ) -> NcclCode {
        let mut st = self.st();
        st.log.push(Logged::Split { comm, color, key });
        let code = st.split_code.take().unwrap_or(NcclCode::IN_PROGRESS);
        if color >= 0 && (code.is_success() || code == NcclCode::IN_PROGRESS) {
            // Reported as rank `key` of size -1 unless the test set the shape.
            self.new_handle(&mut st, out, key, -1);
        }
        code
    }

    fn shrink(
        &self,
        comm: RawComm,
        excluded: &[i32],
        out: &AtomicUsize,
        _config: &RawConfig,
        flags: i32,
    ) -> NcclCode {
        let mut st = self.st();
        if st.missing.contains(&Optional::Shrink) {
            return NcclCode::UNAVAILABLE;
        }
        st.log.push(Logged::Shrink {
            comm,
            excluded: excluded.to_vec(),
            flags,
        });
        let code = st.split_code.take().unwrap_or(NcclCode::IN_PROGRESS);
        if code.is_success() || code == NcclCode::IN_PROGRESS {
            // Reported as rank -1 of -1 unless the test set the shape.
            self.new_handle(&mut st, out, -1, -1);
        }
        code
    }

    fn async_error(&self, comm: RawComm) -> NcclCode {
        let mut st = self.st();
        // Delayed handles appear after `handle_delay` polls of any communicator.
        let mut ready = Vec::new();
        st.delayed.retain_mut(|(h, addr, left)| {
            *left -= 1;
            if *left == 0 {
                ready.push((*h, *addr));
                false
            } else {
                true
            }
        });
        for (h, ptr) in ready {
            // SAFETY: `ptr` is the address of the `AtomicUsize` the engine passed to
            // `init_rank`/`split`; the engine keeps it alive while it waits for the handle,
            // and tests only delay handles on paths that wait for them.
            unsafe { &*(ptr as *const AtomicUsize) }.store(h, Ordering::Release);
        }
        if let Some(c) = st.script.get_mut(&comm.0).and_then(VecDeque::pop_front) {
            return c;
        }
        st.steady.get(&comm.0).copied().unwrap_or(NcclCode::SUCCESS)
    }

    fn abort(&self, comm: RawComm) -> NcclCode {
        self.st().log.push(Logged::Abort(comm));
        NcclCode::SUCCESS
    }

    fn finalize(&self, comm: RawComm) -> NcclCode {
        let mut st = self.st();
        st.log.push(Logged::Finalize(comm));
        NcclCode::IN_PROGRESS
    }

    fn destroy(&self, comm: RawComm) -> NcclCode {
        self.st().log.push(Logged::Destroy(comm));
        NcclCode::SUCCESS
    }

    fn revoke(&self, comm: RawComm) -> NcclCode {
        let mut st = self.st();
        if st.missing.contains(&Optional::Revoke) {
            return NcclCode::UNAVAILABLE;
        }
        st.log.push(Logged::Revoke(comm));
        NcclCode::SUCCESS
    }

    fn count(&self, comm: RawComm) -> Result<i32, NcclCode> {
        self.st()
            .shape
            .get(&comm.0)
            .map(|s| s.1)
            .ok_or(NcclCode::INVALID_ARGUMENT)
    }

    fn user_rank(&self, comm: RawComm) -> Result<i32, NcclCode> {
        self.st()
            .shape
            .get(&comm.0)
            .map(|s| s.0)
            .ok_or(NcclCode::INVALID_ARGUMENT)
    }

    fn last_error(&self, _comm: RawComm) -> String {
        "mock: last error".into()
    }

    fn group_start(&self) -> NcclCode {
        self.st().log.push(Logged::GroupStart);
        NcclCode::SUCCESS
    }

    fn group_end(&self) -> NcclCode {
        let mut st = self.st();
        st.log.push(Logged::GroupEnd);
        st.group_end.pop_front().unwrap_or(NcclCode::SUCCESS)
    }

    fn enqueue(&self, call: &Call, _comm: RawComm, _stream: RawStream) -> NcclCode {
        let mut st = self.st();
        st.log.push(Logged::Enqueue(call.clone()));
        if call.requires().is_some_and(|f| st.missing.contains(&f)) {
            return NcclCode::UNAVAILABLE;
        }
        match st.fail_call {
            Some((name, code)) if name == call.name() => code,
            _ => NcclCode::SUCCESS,
        }
    }

    fn mem_alloc(&self, bytes: usize) -> Result<DevPtr, NcclCode> {
        let mut st = self.st();
        st.log.push(Logged::MemAlloc(bytes));
        let p = st.next as DevPtr * 0x1_0000;
        st.next += 0x10;
        Ok(p)
    }

    fn mem_free(&self, ptr: DevPtr) -> NcclCode {
        self.st().log.push(Logged::MemFree(ptr));
        NcclCode::SUCCESS
    }

    fn window_register(
        &self,
        comm: RawComm,
        _ptr: DevPtr,
        bytes: usize,
        out: &AtomicUsize,
    ) -> NcclCode {
        let mut st = self.st();
        if st.missing.contains(&Optional::Window) {
            return NcclCode::UNAVAILABLE;
        }
        st.log.push(Logged::WindowRegister(comm, bytes));
        out.store(0xa110, Ordering::Release);
        NcclCode::SUCCESS
    }

    fn window_deregister(&self, comm: RawComm, win: RawWindow) -> NcclCode {
        self.st().log.push(Logged::WindowDeregister(comm, win));
        NcclCode::SUCCESS
    }
}

const PENDING: u8 = 0;
const DONE: u8 = 1;
const BROKEN: u8 = 2;

/// An event the test completes (or breaks) by hand.
#[derive(Default)]
pub struct FakeEvent {
    state: AtomicU8,
}

impl FakeEvent {
    pub fn complete(&self) {
        self.state.store(DONE, Ordering::Release);
    }

    pub fn break_it(&self) {
        self.state.store(BROKEN, Ordering::Release);
    }
}

impl Event for FakeEvent {
    fn query(&self) -> Result<bool, String> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Ok(false),
            DONE => Ok(true),
            _ => Err("CUDA_ERROR_ILLEGAL_ADDRESS (fake)".into()),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A device whose recorded events are kept for the test: [`FakeStreams::events`] returns them
/// in record order (each operation records a start and an end event).
#[derive(Default)]
pub struct FakeStreams {
    events: Mutex<Vec<Arc<FakeEvent>>>,
    pub caller_waits: AtomicUsize,
    pub comm_waits: AtomicUsize,
    /// Calls of `release_cached_memory`.
    pub releases: AtomicUsize,
    /// `release_cached_memory` fails (after counting).
    pub fail_release: std::sync::atomic::AtomicBool,
    /// Where releases are also logged, in order with the NCCL calls.
    log: Mutex<Option<Arc<MockApi>>>,
}

impl FakeStreams {
    pub fn events(&self) -> Vec<Arc<FakeEvent>> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Logs each `release_cached_memory` into `api`'s log too.
    pub fn log_to(&self, api: Arc<MockApi>) {
        *self.log.lock().unwrap_or_else(|e| e.into_inner()) = Some(api);
    }

    /// Completes every event recorded so far.
    pub fn complete_all(&self) {
        for e in self.events() {
            e.complete();
        }
    }
}

impl Streams for FakeStreams {
    fn bind(&self) -> Result<(), String> {
        Ok(())
    }

    fn comm_stream(&self) -> RawStream {
        RawStream(0x57)
    }

    fn comm_after_caller(&self) -> Result<(), String> {
        self.comm_waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn record(&self) -> Result<Arc<dyn Event>, String> {
        let e = Arc::new(FakeEvent::default());
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(e.clone());
        Ok(e)
    }

    fn caller_after(&self, event: &dyn Event) -> Result<(), String> {
        if event.as_any().downcast_ref::<FakeEvent>().is_none() {
            return Err("not a fake event".into());
        }
        self.caller_waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn release_cached_memory(&self) -> Result<(), String> {
        self.releases.fetch_add(1, Ordering::Relaxed);
        if let Some(api) = &*self.log.lock().unwrap_or_else(|e| e.into_inner()) {
            api.log_release();
        }
        if self.fail_release.load(Ordering::Relaxed) {
            return Err("the fake pool refused to trim".into());
        }
        Ok(())
    }
}
