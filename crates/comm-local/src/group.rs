//! The shared state of the local backend: the world (all rank threads of one
//! [`LocalWorld`](super::LocalWorld) launch) and groups (one per communicator, shared by its
//! members).
//!
//! A collective is a *slot* keyed by the communicator's collective index. Each rank arrives
//! with a descriptor (checked against the first arrival: that is the desync detection) and a
//! [`Post`] (its input tensor, or an eager copy of it); once every rank has arrived, each reads
//! its peers' posts directly (shared memory, no serialization, no funnel through one thread).
//! Collectives whose peers read a rank's *own* buffers end with a departure barrier, so no rank
//! returns (and lets its caller mutate its input) while a peer still reads it. Buffers are
//! reference-counted, so even a rank that gives up on a timeout never frees memory a peer is
//! reading. One mutex and condvar per group coordinate it all; waiting ranks sleep.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Instant;

use candle_core::Tensor;

use candle_dtensor_comm_core::kit::desc::{check_split_sizes, Failure, OpDesc};
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::{CommError, Result};

/// A rank's contribution to a collective, readable by its peers.
#[derive(Clone, Default)]
pub(crate) struct Post {
    /// The input (the caller's tensor, or an eager copy).
    pub input: Option<Tensor>,
    /// Scatter inputs (root only).
    pub inputs: Vec<Tensor>,
    /// The rank's output buffer, when peers read from it (large all_reduce).
    pub out: Option<Arc<candle_dtensor_comm_core::kit::cpu::kernels::OutBuf>>,
    /// all_to_all_v split sizes: (output, input).
    pub splits: Option<(Vec<usize>, Vec<usize>)>,
    /// all_to_all_v_rows: the rows of `input` sent, in send order (`None`: all, in order).
    pub rows: Option<Arc<Vec<u32>>>,
    /// split: the caller's new group.
    pub ranks: Option<Vec<usize>>,
    /// CUDA: the event after which this post's tensors may be read (recorded by the issuing
    /// thread), or, in the second exchange, after which this rank's reads of its peers' posts
    /// are done (`cuda.rs`).
    #[cfg(feature = "cuda")]
    pub ready: Option<Arc<candle_core::cuda_backend::cudarc::driver::CudaEvent>>,
}

/// Per-rank progress inside one slot.
const ARRIVED: u8 = 1;
/// Posted a second time (`Group::arrive_late`).
#[cfg(feature = "cuda")]
const LATE: u8 = 2;
/// Departed (finished reading peers' buffers).
pub(crate) const DONE: u8 = u8::MAX;

struct Slot {
    desc: Option<(usize, OpDesc)>,
    posts: Vec<Option<Post>>,
    /// The second exchange's posts (`Group::arrive_late`).
    #[cfg(feature = "cuda")]
    late: Vec<Option<Post>>,
    stage: Vec<u8>,
}

/// A queued point-to-point message.
pub(crate) struct Message {
    pub tensor: Tensor,
    /// CUDA: the event after which `tensor` may be read (`cuda.rs`).
    #[cfg(feature = "cuda")]
    pub ready: Option<Arc<candle_core::cuda_backend::cudarc::driver::CudaEvent>>,
}

impl Message {
    /// A message of `tensor`, readable at once.
    pub(crate) fn new(tensor: Tensor) -> Self {
        Message {
            tensor,
            #[cfg(feature = "cuda")]
            ready: None,
        }
    }
}

pub(crate) struct GroupState {
    failure: Option<Failure>,
    slots: HashMap<u64, Slot>,
    /// (src, dst) -> messages in send order.
    mail: HashMap<(usize, usize), VecDeque<Message>>,
    /// window id -> signal counts [dst * n + src] and consumed counts.
    pub(crate) signals: HashMap<u64, (Vec<u64>, Vec<u64>)>,
    pub(crate) windows: HashMap<u64, Weak<super::window::WindowShared>>,
    /// Messages of fault-tolerant agreements: (instance, round, src, dst) -> bytes.
    agree: HashMap<(u64, u32, usize, usize), Vec<u8>>,
}

/// One communicator's shared state.
pub(crate) struct Group {
    pub id: u64,
    pub world: Arc<World>,
    /// World ranks, indexed by communicator rank.
    pub members: Vec<usize>,
    state: Mutex<GroupState>,
    cv: Condvar,
}

/// Keys under which ranks find the same new group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum GroupKey {
    Split {
        parent: u64,
        coll: u64,
        color: usize,
    },
    NewComm {
        name: String,
        index: u64,
    },
    /// The communicator `parent`'s shrink number `instance` to `members` (world ranks).
    Shrink {
        parent: u64,
        instance: u64,
        members: Vec<usize>,
    },
}

/// All rank threads of one local launch.
pub(crate) struct World {
    pub size: usize,
    groups: Mutex<Vec<Weak<Group>>>,
    rendezvous: Mutex<HashMap<GroupKey, Weak<Group>>>,
    failure: Mutex<Option<Failure>>,
    /// The first rank whose closure failed, and why (the root cause).
    pub(crate) first_failure: Mutex<Option<(usize, String)>>,
    next_id: AtomicU64,
    /// Elastic: a failed rank fails only the communicators it belongs to.
    elastic: bool,
    /// Per world rank: why it is gone (its closure failed or returned), if it is.
    gone: Mutex<Vec<Option<String>>>,
}

impl World {
    pub(crate) fn new(size: usize, elastic: bool) -> Arc<World> {
        Arc::new(World {
            size,
            groups: Mutex::new(Vec::new()),
            rendezvous: Mutex::new(HashMap::new()),
            failure: Mutex::new(None),
            first_failure: Mutex::new(None),
            next_id: AtomicU64::new(0),
            elastic,
            gone: Mutex::new(vec![None; size]),
        })
    }

    /// Why world rank `r` is gone (its closure failed or returned), if it is.
    pub(crate) fn gone(&self, r: usize) -> Option<String> {
        Self::lock(&self.gone).get(r).cloned().flatten()
    }

    /// Records that world rank `r`'s closure returned successfully.
    pub(crate) fn returned(&self, r: usize) {
        if let Some(g) = Self::lock(&self.gone).get_mut(r) {
            g.get_or_insert_with(|| "its rank closure returned".into());
        }
        self.wake_all();
    }

    fn live_groups(&self) -> Vec<Arc<Group>> {
        Self::lock(&self.groups)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Wakes every waiter of every group (a rank's state changed).
    fn wake_all(&self) {
        for g in self.live_groups() {
            g.notify();
        }
    }

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates a group over `members` (world ranks). It is born failed when the world has
    /// failed (elastic: when one of its members has).
    pub(crate) fn new_group(self: &Arc<Self>, members: Vec<usize>) -> Arc<Group> {
        let failure = if self.elastic {
            let gone = Self::lock(&self.gone);
            members.iter().find_map(|&m| {
                let reason = gone.get(m).cloned().flatten()?;
                Some(Failure::RankFailed {
                    world_rank: m,
                    reason,
                })
            })
        } else {
            Self::lock(&self.failure).clone()
        };
        let g = Arc::new(Group {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            world: self.clone(),
            members,
            state: Mutex::new(GroupState {
                failure,
                slots: HashMap::new(),
                mail: HashMap::new(),
                signals: HashMap::new(),
                windows: HashMap::new(),
                agree: HashMap::new(),
            }),
            cv: Condvar::new(),
        });
        let mut groups = Self::lock(&self.groups);
        groups.retain(|w| w.strong_count() > 0);
        groups.push(Arc::downgrade(&g));
        g
    }

    /// The group registered under `key`, created with `members` by the first rank to ask.
    pub(crate) fn rendezvous(
        self: &Arc<Self>,
        key: GroupKey,
        members: impl FnOnce() -> Vec<usize>,
    ) -> Arc<Group> {
        let mut reg = Self::lock(&self.rendezvous);
        reg.retain(|_, w| w.strong_count() > 0);
        if let Some(g) = reg.get(&key).and_then(Weak::upgrade) {
            return g;
        }
        let g = self.new_group(members());
        reg.insert(key, Arc::downgrade(&g));
        g
    }

    /// Fails every group of the world (a rank failed; elastic: every group it belongs to).
    /// The first call records the root cause.
    pub(crate) fn fail(&self, world_rank: usize, reason: String) {
        {
            let mut first = Self::lock(&self.first_failure);
            if first.is_none() {
                *first = Some((world_rank, reason.clone()));
            }
        }
        if let Some(g) = Self::lock(&self.gone).get_mut(world_rank) {
            *g = Some(reason.clone());
        }
        let failure = Failure::RankFailed { world_rank, reason };
        if !self.elastic {
            let mut f = Self::lock(&self.failure);
            if f.is_none() {
                *f = Some(failure.clone());
            }
        }
        for g in self.live_groups() {
            if !self.elastic || g.members.contains(&world_rank) {
                g.fail(failure.clone());
            } else {
                g.notify();
            }
        }
    }
}

impl Group {
    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn notify(&self) {
        self.cv.notify_all();
    }

    /// Marks the group failed (first failure wins) and wakes every waiter.
    pub(crate) fn fail(&self, failure: Failure) {
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some(failure);
        }
        drop(st);
        self.cv.notify_all();
    }

    pub(crate) fn failure_locked(&self, st: &GroupState) -> Option<Failure> {
        st.failure.clone()
    }

    pub(crate) fn failure(&self) -> Option<Failure> {
        self.lock().failure.clone()
    }

    /// Waits on the condvar until `deadline`; returns the guard and whether time ran out.
    pub(crate) fn wait<'a>(
        &self,
        guard: MutexGuard<'a, GroupState>,
        deadline: Instant,
    ) -> (MutexGuard<'a, GroupState>, bool) {
        let now = Instant::now();
        if now >= deadline {
            return (guard, true);
        }
        let (g, _) = self
            .cv
            .wait_timeout(guard, deadline - now)
            .unwrap_or_else(|e| e.into_inner());
        (g, false)
    }

    /// Arrives at collective `coll` with `desc` and `post`; waits until every rank has arrived
    /// and returns all posts in rank order.
    pub(crate) fn arrive(
        &self,
        ctx: &OpCtx,
        coll: u64,
        rank: usize,
        desc: OpDesc,
        post: Post,
        deadline: Instant,
    ) -> Result<Vec<Post>> {
        let n = self.size();
        let mut st = self.lock();
        if let Some(f) = &st.failure {
            return Err(f.to_error(ctx, Some(coll)));
        }
        let slot = st.slots.entry(coll).or_insert_with(|| Slot {
            desc: None,
            posts: vec![None; n],
            #[cfg(feature = "cuda")]
            late: vec![None; n],
            stage: vec![0; n],
        });
        match &slot.desc {
            Some((r0, d0)) if !d0.compatible(&desc) => {
                let failure = Failure::desync(coll, (*r0, d0), (rank, &desc));
                st.failure = Some(failure.clone());
                drop(st);
                self.cv.notify_all();
                return Err(failure.to_error(ctx, Some(coll)));
            }
            Some(_) => {}
            None => slot.desc = Some((rank, desc)),
        }
        slot.posts[rank] = Some(post);
        slot.stage[rank] = ARRIVED;
        self.cv.notify_all();
        let mut st = self.wait_stage(st, ctx, coll, ARRIVED, deadline)?;
        let slot = st
            .slots
            .get_mut(&coll)
            .ok_or_else(|| CommError::invalid(ctx, "collective slot vanished"))?;
        Ok(slot
            .posts
            .iter()
            .map(|p| p.clone().unwrap_or_default())
            .collect())
    }

    /// A second exchange inside collective `coll`, after [`Group::arrive`]: posts `post` and
    /// waits for every rank's (the CUDA path's events saying each rank's reads are done).
    #[cfg(feature = "cuda")]
    pub(crate) fn arrive_late(
        &self,
        ctx: &OpCtx,
        coll: u64,
        rank: usize,
        post: Post,
        deadline: Instant,
    ) -> Result<Vec<Post>> {
        let mut st = self.lock();
        let slot = st.slots.get_mut(&coll).ok_or_else(|| {
            CommError::invalid(ctx, "collective slot vanished before its second exchange")
        })?;
        slot.late[rank] = Some(post);
        slot.stage[rank] = LATE;
        self.cv.notify_all();
        let mut st = self.wait_stage(st, ctx, coll, LATE, deadline)?;
        let slot = st
            .slots
            .get_mut(&coll)
            .ok_or_else(|| CommError::invalid(ctx, "collective slot vanished"))?;
        Ok(slot
            .late
            .iter()
            .map(|p| p.clone().unwrap_or_default())
            .collect())
    }

    /// Marks this rank at `stage` of collective `coll` and waits until every rank reached it.
    pub(crate) fn sync(
        &self,
        ctx: &OpCtx,
        coll: u64,
        rank: usize,
        stage: u8,
        deadline: Instant,
    ) -> Result<()> {
        let mut st = self.lock();
        if let Some(slot) = st.slots.get_mut(&coll) {
            slot.stage[rank] = stage;
        }
        self.cv.notify_all();
        self.wait_stage(st, ctx, coll, stage, deadline).map(|_| ())
    }

    /// Leaves collective `coll`. With `wait_all`, waits until every rank has left (so buffers
    /// this rank lent to peers are no longer read). The last rank to leave frees the slot.
    pub(crate) fn depart(
        &self,
        ctx: &OpCtx,
        coll: u64,
        rank: usize,
        wait_all: bool,
        deadline: Instant,
    ) -> Result<()> {
        let mut st = self.lock();
        let all_done = match st.slots.get_mut(&coll) {
            Some(slot) => {
                // Posts stay until the slot is freed: a slower peer may not have read them yet.
                slot.stage[rank] = DONE;
                slot.stage.iter().all(|&s| s == DONE)
            }
            None => true,
        };
        if all_done {
            st.slots.remove(&coll);
            drop(st);
            self.cv.notify_all();
            return Ok(());
        }
        self.cv.notify_all();
        if wait_all {
            drop(self.wait_stage(st, ctx, coll, DONE, deadline)?);
        }
        Ok(())
    }

    /// Waits until every rank of slot `coll` is at `stage` or beyond (a missing slot means every
    /// rank already left). On timeout, records the failure naming the ranks still behind.
    fn wait_stage<'a>(
        &'a self,
        mut st: MutexGuard<'a, GroupState>,
        ctx: &OpCtx,
        coll: u64,
        stage: u8,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, GroupState>> {
        loop {
            let behind: Vec<usize> = match st.slots.get(&coll) {
                Some(slot) => (0..slot.stage.len())
                    .filter(|&r| slot.stage[r] < stage)
                    .collect(),
                None => Vec::new(),
            };
            // Completion first: a failure recorded by peers that already moved on to a later
            // collective must not fail this one, which every rank has reached.
            if behind.is_empty() {
                return Ok(st);
            }
            if let Some(f) = &st.failure {
                return Err(f.to_error(ctx, Some(coll)));
            }
            let (g, timed_out) = self.wait(st, deadline);
            st = g;
            if timed_out {
                let failure = Failure::Timeout {
                    collective: coll,
                    op: ctx.op,
                    missing: behind,
                };
                if st.failure.is_none() {
                    st.failure = Some(failure.clone());
                }
                drop(st);
                self.cv.notify_all();
                return Err(failure.to_error(ctx, Some(coll)));
            }
        }
    }

    /// The all_to_all_v check on every rank's posted split sizes: every (sender, receiver) pair,
    /// not only this rank's receives, so all ranks reach the same verdict before anyone reads a
    /// peer's buffer (a rank whose own counts agree must not return data while another rank
    /// fails the collective). A mismatch fails the group.
    pub(crate) fn check_split_sizes(&self, ctx: &OpCtx, coll: u64, posts: &[Post]) -> Result<()> {
        let count = |r: usize, out: bool, peer: usize| {
            posts[r]
                .splits
                .as_ref()
                .map(|s| if out { s.0[peer] } else { s.1[peer] })
                .unwrap_or(0)
        };
        check_split_sizes(
            posts.len(),
            |i, j| count(i, false, j),
            |j, i| count(j, true, i),
        )
        .map_err(|reason| {
            self.fail(Failure::Mismatch {
                collective: coll,
                reason: reason.clone(),
            });
            CommError::invalid(ctx, reason)
        })
    }

    /// Queues a message from `src` to `dst`.
    pub(crate) fn post_message(&self, src: usize, dst: usize, msg: Message) {
        let mut st = self.lock();
        st.mail.entry((src, dst)).or_default().push_back(msg);
        drop(st);
        self.cv.notify_all();
    }

    /// Takes the next message from `src` to `dst`, waiting until `deadline`.
    pub(crate) fn take_message(
        &self,
        ctx: &OpCtx,
        src: usize,
        dst: usize,
        deadline: Instant,
    ) -> Result<Message> {
        let mut st = self.lock();
        loop {
            if let Some(m) = st.mail.get_mut(&(src, dst)).and_then(VecDeque::pop_front) {
                return Ok(m);
            }
            if let Some(f) = &st.failure {
                return Err(f.to_error(ctx, None));
            }
            let (g, timed_out) = self.wait(st, deadline);
            st = g;
            if timed_out {
                // A peer that never sends breaks the communicator like a missed collective.
                let failure = Failure::Timeout {
                    collective: u64::MAX,
                    op: ctx.op,
                    missing: vec![src],
                };
                if st.failure.is_none() {
                    st.failure = Some(failure);
                }
                drop(st);
                self.cv.notify_all();
                return Err(CommError::Timeout {
                    ctx: ctx.clone(),
                    timeout: ctx.timeout,
                    missing: vec![src],
                });
            }
        }
    }

    /// Posts message `round` of agreement `instance` from `src` to `dst`.
    pub(crate) fn agree_post(&self, instance: u64, round: u32, src: usize, dst: usize, m: &[u8]) {
        self.lock()
            .agree
            .insert((instance, round, src, dst), m.to_vec());
        self.cv.notify_all();
    }

    /// Takes `src`'s message `round` of agreement `instance` to `dst`, waiting until `deadline`;
    /// a rank whose closure failed or returned is gone (the group's own failure is ignored).
    pub(crate) fn agree_take(
        &self,
        instance: u64,
        round: u32,
        src: usize,
        dst: usize,
        deadline: Instant,
    ) -> candle_dtensor_comm_core::kit::agree::Heard {
        use candle_dtensor_comm_core::kit::agree::Heard;
        let mut st = self.lock();
        loop {
            if let Some(m) = st.agree.remove(&(instance, round, src, dst)) {
                return Heard::Msg(m);
            }
            if let Some(why) = self.world.gone(self.members[src]) {
                return Heard::Gone(format!("rank {src}: {why}"));
            }
            let (g, timed_out) = self.wait(st, deadline);
            st = g;
            if timed_out {
                return Heard::Silent;
            }
        }
    }

    /// Forgets what is left of agreement `instance` (messages to ranks that gave up on it).
    pub(crate) fn agree_done(&self, instance: u64, dst: usize) {
        self.lock()
            .agree
            .retain(|k, _| !(k.0 == instance && k.3 == dst));
    }
}
