//! Fault-tolerant agreement among the live ranks of a communicator that may have failed: what
//! [`crate::Comm::agree`] and [`crate::Comm::shrink`] decide with, written once over a tiny
//! message interface ([`Net`]) that the `local` (shared memory) and `process` (frames on the
//! parent's sockets) backends implement.
//!
//! # The protocol
//!
//! Every participant has an [`Input`] and a set of ranks it does not wait for (`skip`: the ranks
//! a shrink excludes). Round 0: it sends its input to every peer and waits for the input of
//! every peer not skipped; a peer whose connection breaks (a killed process, a failed rank
//! thread) is recorded as lost, one silent until the deadline as silent. That is its *view*.
//! Then the rotating-coordinator rounds of consensus with a failure detector (Chandra and
//! Toueg): in round `c + 1`, rank `c` sends its current view to every peer, and every other
//! participant waits for it (unless `c` is skipped or already known gone) and adopts it. After
//! the last round every participant decides its view.
//!
//! **Agreement.** Let `c` be the first coordinator that neither dies nor is suspected during its
//! round: every participant adopts its view in that round, and later coordinators send that very
//! view, so every participant that decides, decides the same view (uniform: also one that dies
//! right after deciding). A second failure at any point (before, during or after a broadcast)
//! only changes *which* view is decided, never that all survivors decide one. This assumes
//! the failure detector is accurate: a closed connection is (a killed process's sockets close
//! at once), a deadline is not (a rank that stalls past it is suspected although alive, as in
//! every timeout-based system). `tests` drives every crash point of a 4-rank agreement.
//!
//! **Cost.** `n` rounds of one broadcast each after the all-to-all: `n + 1` message latencies on
//! a healthy communicator, microseconds on the local backend, about a millisecond for 4 processes
//! over loopback. A hung rank costs one deadline (each wait is bounded by `timeout` from its
//! start, so ranks that entered the agreement up to a timeout apart still meet).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::CommError;
use crate::vocab::OpCtx;

/// What a participant heard from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    /// The message.
    Msg(Vec<u8>),
    /// The peer is gone (its connection broke, its thread failed, it closed the communicator).
    Gone(String),
    /// Nothing before the deadline.
    Silent,
}

/// The messages of one agreement instance, as a backend moves them.
pub trait Net {
    /// This rank.
    fn rank(&self) -> usize;
    /// The number of ranks of the communicator.
    fn size(&self) -> usize;
    /// Sends message `round` of this instance to `peer`. Never fails: a message to a dead peer
    /// is lost, which the peer's absence already accounts for.
    fn send(&self, peer: usize, round: u32, bytes: &[u8]);
    /// Waits for `peer`'s message `round` of this instance until `deadline`.
    fn recv(&self, peer: usize, round: u32, deadline: Instant) -> Heard;
    /// This rank decided: the instance's messages to it can be forgotten.
    fn done(&self) {}
}

/// [`crate::Comm::agree`] on a backend's [`Net`]: every participant's `ok`, nobody skipped.
pub fn agree_ok(net: &dyn Net, ok: bool, timeout: Duration) -> Agreement {
    let input = Input {
        ok,
        excluded: None,
        addr: None,
    };
    let view = agree(net, input, &BTreeSet::new(), timeout);
    net.done();
    Agreement::from(&view)
}

/// The agreement of [`crate::Comm::shrink`] on a backend's [`Net`]: this rank proposes
/// `excluded` (and, on the process backend, the address it listens on for the new
/// communicator), does not wait for the ranks it excludes, and returns the verdict of the
/// agreed view ([`shrink_verdict`]): the same on every participant.
pub fn shrink_agreement(
    net: &dyn Net,
    ctx: &OpCtx,
    excluded: &[usize],
    addr: Option<String>,
) -> Result<Vec<(usize, Input)>, CommError> {
    let input = Input {
        ok: true,
        excluded: Some(excluded.to_vec()),
        addr,
    };
    let me = net.rank();
    // A bad list still takes part (so every peer hears of it); its own rank and ranks out of
    // range are not waited for anyway.
    let skip = excluded.iter().copied().filter(|&r| r != me).collect();
    let view = agree(net, input, &skip, ctx.timeout);
    net.done();
    shrink_verdict(ctx, &view, me, net.size())
}

/// Why `excluded`, rank `by`'s proposal for a communicator of `n` ranks, is not a valid
/// shrink list (`None`: it is).
fn invalid_list(by: usize, excluded: &[usize], n: usize) -> Option<String> {
    if let Some(r) = excluded.iter().find(|&&r| r >= n) {
        return Some(format!(
            "rank {r} out of range for a communicator of size {n}"
        ));
    }
    let distinct: BTreeSet<usize> = excluded.iter().copied().collect();
    if distinct.len() != excluded.len() {
        let mut seen = BTreeSet::new();
        let twice = excluded
            .iter()
            .find(|r| !seen.insert(**r))
            .copied()
            .unwrap_or(0);
        return Some(format!("rank {twice} appears twice"));
    }
    if distinct.is_empty() || distinct.len() >= n {
        return Some(format!(
            "shrink must exclude at least one rank and keep at least one of {n}"
        ));
    }
    if distinct.contains(&by) {
        return Some(format!(
            "rank {by} excludes itself (excluded ranks do not call shrink)"
        ));
    }
    None
}

/// One participant's contribution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Input {
    /// Whether the participant's own work (a training step) succeeded.
    pub ok: bool,
    /// Shrink: the ranks it excludes (sorted).
    pub excluded: Option<Vec<usize>>,
    /// Shrink on the process backend: where it listens for the new communicator's connections.
    pub addr: Option<String>,
}

/// A participant's round-0 view: the inputs it received and the peers it did not hear from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    /// Whose view it is.
    pub by: usize,
    /// Rank -> input.
    pub inputs: BTreeMap<usize, Input>,
    /// Ranks waited for in vain -> why (gone, or silent until the deadline).
    pub missing: BTreeMap<usize, String>,
}

/// Runs one agreement as rank `net.rank()` with `mine`, not waiting for `skip`; every wait is
/// bounded by `timeout` from its start. Returns the decided view (the same on every
/// participant that decides, see the module docs).
pub fn agree(net: &dyn Net, mine: Input, skip: &BTreeSet<usize>, timeout: Duration) -> View {
    let (me, n) = (net.rank(), net.size());
    let encoded = serde_json::to_vec(&mine).unwrap_or_default();
    for p in (0..n).filter(|&p| p != me) {
        net.send(p, 0, &encoded);
    }
    let mut view = View {
        by: me,
        inputs: BTreeMap::from([(me, mine)]),
        missing: BTreeMap::new(),
    };
    // Peers known gone or suspected: not waited for as coordinators either.
    let mut gone: BTreeSet<usize> = BTreeSet::new();
    for p in (0..n).filter(|&p| p != me && !skip.contains(&p)) {
        match net.recv(p, 0, Instant::now() + timeout) {
            Heard::Msg(b) => match serde_json::from_slice::<Input>(&b) {
                Ok(i) => {
                    view.inputs.insert(p, i);
                }
                Err(e) => {
                    gone.insert(p);
                    view.missing.insert(p, format!("sent a garbled input: {e}"));
                }
            },
            Heard::Gone(why) => {
                gone.insert(p);
                view.missing.insert(p, why);
            }
            Heard::Silent => {
                gone.insert(p);
                view.missing.insert(p, format!("silent for {timeout:?}"));
            }
        }
    }
    let mut est = view;
    for c in 0..n {
        let round = c as u32 + 1;
        if c == me {
            let encoded = serde_json::to_vec(&est).unwrap_or_default();
            for p in (0..n).filter(|&p| p != me) {
                net.send(p, round, &encoded);
            }
            continue;
        }
        if skip.contains(&c) || gone.contains(&c) {
            continue;
        }
        match net.recv(c, round, Instant::now() + timeout) {
            Heard::Msg(b) => match serde_json::from_slice::<View>(&b) {
                Ok(v) => est = v,
                Err(_) => {
                    gone.insert(c);
                }
            },
            Heard::Gone(_) | Heard::Silent => {
                gone.insert(c);
            }
        }
    }
    est
}

/// What [`crate::Comm::agree`] returns: the same value on every survivor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Agreement {
    /// Every input in the agreed view was `ok` and no rank was missing from it.
    pub ok: bool,
    /// The ranks missing from the agreed view (gone or silent), sorted.
    pub failed: Vec<usize>,
}

impl From<&View> for Agreement {
    fn from(v: &View) -> Self {
        Agreement {
            ok: v.missing.is_empty() && v.inputs.values().all(|i| i.ok),
            failed: v.missing.keys().copied().collect(),
        }
    }
}

/// The verdict of a shrink on the agreed view `v`, for rank `me` of `n`: the surviving ranks
/// (of the parent, in order) and their inputs, or the error every participant reports.
pub fn shrink_verdict(
    ctx: &OpCtx,
    v: &View,
    me: usize,
    n: usize,
) -> Result<Vec<(usize, Input)>, CommError> {
    let proposals: Vec<(usize, Vec<usize>)> = v
        .inputs
        .iter()
        .map(|(&r, i)| (r, i.excluded.clone().unwrap_or_default()))
        .collect();
    let bad: Vec<String> = proposals
        .iter()
        .filter_map(|(r, ex)| {
            invalid_list(*r, ex, n).map(|why| format!("rank {r} excludes {ex:?}: {why}"))
        })
        .collect();
    if !bad.is_empty() {
        return Err(CommError::invalid(
            ctx,
            format!("invalid shrink lists: {}", bad.join("; ")),
        ));
    }
    let excluded = proposals.first().map(|p| p.1.clone()).unwrap_or_default();
    let disagree = proposals.iter().any(|p| p.1 != excluded);
    if disagree || excluded.contains(&me) {
        return Err(CommError::ShrinkDisagree {
            ctx: ctx.clone(),
            proposals,
        });
    }
    let lost: Vec<usize> = v
        .missing
        .keys()
        .copied()
        .filter(|r| !excluded.contains(r))
        .collect();
    if !lost.is_empty() {
        return Err(CommError::RanksLost {
            ctx: ctx.clone(),
            lost,
        });
    }
    (0..n)
        .filter(|r| !excluded.contains(r))
        .map(|r| {
            v.inputs.get(&r).cloned().map(|i| (r, i)).ok_or_else(|| {
                CommError::invalid(ctx, format!("the agreed view has no input of rank {r}"))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, Condvar, Mutex};

    /// A simulated network: messages per (src, dst, round), FIFO per pair (a message sent
    /// before a crash is delivered), ranks that crash after a given number of sends.
    #[derive(Default)]
    struct State {
        msgs: HashMap<(usize, usize, u32), Vec<u8>>,
        dead: Vec<bool>,
        sends: Vec<usize>,
    }

    struct Sim {
        st: Mutex<State>,
        cv: Condvar,
        /// rank -> crash after this many sends
        crash_after: Vec<Option<usize>>,
    }

    struct Port {
        sim: Arc<Sim>,
        rank: usize,
        n: usize,
    }

    impl Net for Port {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.n
        }
        fn send(&self, peer: usize, round: u32, bytes: &[u8]) {
            let mut st = self.sim.st.lock().unwrap();
            if st.dead[self.rank] {
                return;
            }
            if self.sim.crash_after[self.rank] == Some(st.sends[self.rank]) {
                st.dead[self.rank] = true;
                drop(st);
                self.sim.cv.notify_all();
                return;
            }
            st.sends[self.rank] += 1;
            st.msgs.insert((self.rank, peer, round), bytes.to_vec());
            drop(st);
            self.sim.cv.notify_all();
        }
        fn recv(&self, peer: usize, round: u32, deadline: Instant) -> Heard {
            let mut st = self.sim.st.lock().unwrap();
            loop {
                if st.dead[self.rank] {
                    return Heard::Gone("crashed itself".into());
                }
                if let Some(m) = st.msgs.get(&(peer, self.rank, round)) {
                    return Heard::Msg(m.clone());
                }
                if st.dead[peer] {
                    return Heard::Gone("crashed".into());
                }
                let now = Instant::now();
                if now >= deadline {
                    return Heard::Silent;
                }
                st = self.sim.cv.wait_timeout(st, deadline - now).unwrap().0;
            }
        }
    }

    /// Runs an agreement of `n` ranks (inputs from `input(r)`, skips from `skip(r)`), with
    /// crashes; returns each rank's decision (None for ranks that crashed).
    fn run(
        n: usize,
        crash_after: Vec<Option<usize>>,
        input: impl Fn(usize) -> Input + Sync,
        skip: impl Fn(usize) -> BTreeSet<usize> + Sync,
    ) -> Vec<Option<View>> {
        let sim = Arc::new(Sim {
            st: Mutex::new(State {
                dead: vec![false; n],
                sends: vec![0; n],
                ..State::default()
            }),
            cv: Condvar::new(),
            crash_after,
        });
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let (sim, input, skip) = (sim.clone(), &input, &skip);
                    s.spawn(move || {
                        let port = Port { sim, rank: r, n };
                        let v = agree(&port, input(r), &skip(r), Duration::from_secs(5));
                        let dead = port.sim.st.lock().unwrap().dead[r];
                        (!dead).then_some(v)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn ok(_: usize) -> Input {
        Input {
            ok: true,
            excluded: None,
            addr: None,
        }
    }

    fn none(_: usize) -> BTreeSet<usize> {
        BTreeSet::new()
    }

    fn ctx() -> OpCtx {
        OpCtx::bootstrap("t", 0, Duration::from_secs(1))
    }

    #[test]
    fn healthy_ranks_agree_on_everyone() {
        let d = run(4, vec![None; 4], ok, none);
        let first = d[0].clone().expect("decided");
        assert!(d.iter().all(|v| v.as_ref() == Some(&first)));
        assert_eq!(
            Agreement::from(&first),
            Agreement {
                ok: true,
                failed: vec![]
            }
        );
    }

    #[test]
    fn a_failed_step_anywhere_fails_the_agreement_everywhere() {
        let d = run(
            3,
            vec![None; 3],
            |r| Input {
                ok: r != 1,
                ..ok(r)
            },
            none,
        );
        for v in d.iter().flatten() {
            assert_eq!(
                Agreement::from(v),
                Agreement {
                    ok: false,
                    failed: vec![]
                }
            );
        }
    }

    /// Every crash point of one rank (before its first send, after each of its sends, which
    /// spans round 0 and its own coordinator round half-way): the survivors decide the same
    /// view every time. With a second rank crashing too, likewise.
    #[test]
    fn survivors_decide_the_same_view_at_every_crash_point() {
        let n = 4;
        // A rank sends n-1 inputs and, as coordinator, n-1 views.
        let sends = 2 * (n - 1);
        let mut cases = 0;
        for victim in 0..n {
            for k in 0..=sends {
                let mut crash = vec![None; n];
                crash[victim] = Some(k);
                let d = run(n, crash.clone(), ok, none);
                assert_uniform(&d, &format!("rank {victim} after {k} sends"));
                cases += 1;
                // A second failure during the same agreement.
                let second = (victim + 1) % n;
                for k2 in [0, 1, n - 1, sends] {
                    let mut crash = crash.clone();
                    crash[second] = Some(k2);
                    let d = run(n, crash, ok, none);
                    assert_uniform(
                        &d,
                        &format!("rank {victim} after {k} sends, rank {second} after {k2}"),
                    );
                    cases += 1;
                }
            }
        }
        assert!(cases > 100);
    }

    fn assert_uniform(d: &[Option<View>], what: &str) {
        let decided: Vec<&View> = d.iter().flatten().collect();
        assert!(!decided.is_empty(), "{what}: nobody decided");
        for v in &decided {
            assert_eq!(*v, decided[0], "{what}: survivors decided different views");
        }
        // A crashed rank is either in the view (it sent its input first) or missing from it.
        for (r, o) in d.iter().enumerate() {
            if o.is_none() {
                let v = decided[0];
                assert!(
                    v.inputs.contains_key(&r) || v.missing.contains_key(&r),
                    "{what}"
                );
            }
        }
    }

    #[test]
    fn shrink_verdicts_name_disagreements_and_losses() {
        let input = |ex: &[usize]| Input {
            ok: true,
            excluded: Some(ex.to_vec()),
            addr: None,
        };
        let view = |inputs: Vec<(usize, Input)>, missing: Vec<usize>| View {
            by: 0,
            inputs: inputs.into_iter().collect(),
            missing: missing
                .into_iter()
                .map(|r| (r, "gone".to_string()))
                .collect(),
        };
        let good = view(vec![(0, input(&[2])), (1, input(&[2]))], vec![2]);
        let members = shrink_verdict(&ctx(), &good, 0, 3).expect("agreed");
        assert_eq!(members.iter().map(|m| m.0).collect::<Vec<_>>(), vec![0, 1]);
        let split = view(vec![(0, input(&[2])), (1, input(&[0, 2]))], vec![]);
        let e = shrink_verdict(&ctx(), &split, 0, 3).expect_err("disagree");
        assert!(
            e.to_string()
                .contains("rank 0 excludes [2], rank 1 excludes [0, 2]"),
            "{e}"
        );
        // A bad list anywhere in the agreed view is an error on every rank, naming it.
        let bad = view(vec![(0, input(&[2])), (1, input(&[1, 2]))], vec![]);
        for me in [0, 1] {
            match shrink_verdict(&ctx(), &bad, me, 3) {
                Err(CommError::InvalidArgument { reason, .. }) => assert!(
                    reason.contains("rank 1 excludes [1, 2]: rank 1 excludes itself"),
                    "{reason}"
                ),
                other => panic!("{other:?}"),
            }
        }
        let lost = view(vec![(0, input(&[3])), (1, input(&[3]))], vec![2, 3]);
        match shrink_verdict(&ctx(), &lost, 1, 4) {
            Err(CommError::RanksLost { lost, .. }) => assert_eq!(lost, vec![2]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_shrink_with_mismatched_skips_reaches_one_verdict() {
        // Ranks 0 and 1 exclude 3; rank 2 excludes 1 and 3 (skips rank 1). Everyone hears a
        // view holding both proposals, so everyone reports the disagreement.
        let ex = |r: usize| if r == 2 { vec![1, 3] } else { vec![3] };
        let d = run(
            4,
            vec![None, None, None, Some(0)],
            |r| Input {
                ok: true,
                excluded: Some(ex(r)),
                addr: None,
            },
            |r| ex(r).into_iter().collect(),
        );
        for (r, v) in d.iter().enumerate().take(3) {
            let v = v.as_ref().expect("decided");
            assert!(
                matches!(
                    shrink_verdict(&ctx(), v, r, 4),
                    Err(CommError::ShrinkDisagree { .. })
                ),
                "rank {r}"
            );
        }
    }
}
