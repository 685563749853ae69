//! The connections of one process communicator: a full mesh of TCP streams, one reader thread
//! per peer that files every incoming frame in a mailbox, and deadline-bound writes.
//!
//! Readers never stop draining their sockets (frames for collectives this rank has not reached
//! yet wait in the mailbox), so a write only blocks while a peer's process is stopped; sends
//! are therefore buffered as in the local backend, and no order of sends and receives can
//! deadlock. A reader that sees its socket close without a BYE frame marks the peer lost and
//! fails the communicator: every waiting operation wakes at once with an error naming the rank.
//!
//! **Backpressure.** A reader holds at most `cap` bytes of a peer's data and point-to-point
//! payloads that nobody has consumed yet (plus the one frame it admits while under the cap):
//! past it, it stops reading that socket until an op consumes some, so a peer that floods sends
//! is slowed by TCP flow control (its writes block, and fail with a timeout naming this rank if
//! nothing is consumed within its op timeout) instead of growing this process's memory. Control
//! frames (HELLO, FAIL, BYE, AGREE) are small (fixed caps per frame, `frame.rs`) and never
//! counted, so their number is not bounded per peer (peers are authenticated); no body's
//! buffer is allocated from its declared length alone (it grows as bytes arrive), and a frame
//! over its kind's cap or malformed closes that connection. Once the communicator has failed,
//! frames its ops can no longer use are read and dropped, so a failed communicator never stalls
//! its peers' agreements.
//!
//! **Closing.** A rank that closes sends its failure notice (if it owes one) and BYE to every
//! peer, then waits, up to two seconds, until those bytes have left this host (`linger`),
//! with its readers still draining. A process that exits with unread bytes makes its kernel
//! reset the connection and drop what it still queues for sending; without the wait, a BYE
//! queued behind data a busy peer had not made room for was lost, and that peer blamed this
//! rank for a failure it had only reported.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::frame::{
    read_frame, Frame, Header, Payload, ReadEnd, AGREE, BYE, DATA, FAIL, HEADER, HELLO,
    MAX_NOTICE_WORDS, P2P,
};
use super::Rendezvous;
use candle_dtensor_comm_core::kit::agree::Heard;
use candle_dtensor_comm_core::kit::desc::{words_to_bytes, Failure, OpDesc};
use candle_dtensor_comm_core::store::FrameError;
use candle_dtensor_comm_core::OpCtx;
use candle_dtensor_comm_core::{CommError, Result};

/// How often blocked reads and writes look at the clock and the closing flag.
const TICK: Duration = Duration::from_millis(100);
/// Payloads up to this size are written with their header in one `write`.
const COALESCE: usize = 64 * 1024;
/// How long closing and failure notices may take per peer.
const NOTICE_LIMIT: Duration = Duration::from_secs(2);

/// Why a peer is gone.
#[derive(Debug, Clone)]
enum Gone {
    /// It sent BYE: it closed the communicator on purpose.
    Left,
    /// Its connection broke.
    Lost(String),
}

#[derive(Default)]
struct Mail {
    failure: Option<Failure>,
    /// (collective, source) -> the source's descriptor.
    hellos: HashMap<(u64, usize), OpDesc>,
    /// (collective, step, source) -> payload.
    data: HashMap<(u64, u32, usize), Payload>,
    /// Point-to-point payloads per source, in send order.
    p2p: Vec<VecDeque<Payload>>,
    gone: Vec<Option<Gone>>,
    /// (agreement, round, source) -> message.
    agree: HashMap<(u64, u32, usize), Payload>,
    /// Bytes of DATA and P2P payloads held per source.
    buffered: Vec<usize>,
    /// The most bytes held for one source at any time (tests).
    peak_buffered: usize,
}

impl Mail {
    fn take_data(&mut self, key: (u64, u32, usize)) -> Option<Payload> {
        let p = self.data.remove(&key)?;
        self.buffered[key.2] = self.buffered[key.2].saturating_sub(p.len());
        Some(p)
    }

    fn take_p2p(&mut self, src: usize) -> Option<Payload> {
        let p = self.p2p.get_mut(src)?.pop_front()?;
        self.buffered[src] = self.buffered[src].saturating_sub(p.len());
        Some(p)
    }

    fn hold(&mut self, src: usize, len: usize) {
        self.buffered[src] += len;
        self.peak_buffered = self.peak_buffered.max(self.buffered[src]);
    }
}

/// State shared by the transport and its reader threads.
pub(crate) struct Shared {
    rank: usize,
    mail: Mutex<Mail>,
    cv: Condvar,
    closing: AtomicBool,
    /// Bytes of unconsumed DATA and P2P payloads held per peer before its reader waits.
    cap: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Mail> {
        self.mail.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Writer {
    stream: TcpStream,
    /// A frame was abandoned half-written: nothing more may go on this stream.
    poisoned: bool,
    /// This rank's failure notice went out on this stream.
    notified: bool,
}

/// One rank's end of a process communicator.
pub(crate) struct Transport {
    pub rank: usize,
    pub size: usize,
    /// The communicator's name (for thread names and messages).
    pub name: String,
    /// The store namespace this communicator was created under (parent of its splits').
    pub key: String,
    /// How this communicator's splits rendezvous.
    pub rdv: Rendezvous,
    shared: Arc<Shared>,
    writers: Vec<Option<Arc<Mutex<Writer>>>>,
    /// The failure notice this rank owes its peers (its own finding), as a FAIL payload.
    notice: Arc<Mutex<Option<Arc<Vec<u8>>>>>,
    /// How many collectives (a prefix of the indices) completed successfully on this rank.
    completed: std::sync::atomic::AtomicU64,
    /// Agreements and shrinks started on this communicator (their numbers).
    ft_seq: std::sync::atomic::AtomicU64,
}

/// A frame to send: kind, collective index, step and payload pieces.
pub(crate) struct Out<'a> {
    pub kind: u8,
    pub tag: u64,
    pub step: u32,
    pub parts: &'a [&'a [u8]],
}

/// What an op body runs with.
pub(crate) struct Exec<'a> {
    pub t: &'a Transport,
    pub ctx: &'a OpCtx,
    /// The collective index (`u64::MAX` for point-to-point ops).
    pub coll: u64,
    pub deadline: Instant,
    /// This rank's descriptor of the collective, once announced.
    pub desc: Option<OpDesc>,
    /// The encoded HELLO frame of this collective, sent to each peer with the first DATA frame
    /// for it (one write instead of two) or before this rank first waits.
    pub greeting: Vec<u8>,
    /// Which peers have had the HELLO.
    pub greeted: Vec<AtomicBool>,
}

impl Transport {
    /// Takes over the mesh `streams` (indexed by peer rank, `None` at `rank` and at the `lost`
    /// peers, which a shrink could not reach: the communicator is then born failed, naming
    /// them) and starts one reader thread per peer, each holding at most `cap` bytes.
    pub(crate) fn start(
        rank: usize,
        (streams, lost): super::bootstrap::Mesh,
        name: &str,
        key: String,
        rdv: Rendezvous,
        cap: usize,
    ) -> Result<Arc<Transport>> {
        let size = streams.len();
        let mut gone = vec![None; size];
        for (p, why) in &lost {
            gone[*p] = Some(Gone::Lost(why.clone()));
        }
        let shared = Arc::new(Shared {
            rank,
            mail: Mutex::new(Mail {
                p2p: (0..size).map(|_| VecDeque::new()).collect(),
                gone,
                buffered: vec![0; size],
                failure: lost.first().map(|(p, why)| Failure::PeerLost {
                    rank: *p,
                    reason: why.clone(),
                }),
                ..Mail::default()
            }),
            cv: Condvar::new(),
            closing: AtomicBool::new(false),
            cap,
        });
        let boot_err = |reason: String| CommError::Bootstrap {
            comm: name.to_string(),
            reason,
        };
        let mut writers = Vec::with_capacity(size);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                writers.push(None);
                continue;
            };
            let setup = || -> std::io::Result<TcpStream> {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(TICK))?;
                s.set_write_timeout(Some(TICK))?;
                s.try_clone()
            };
            let reader = setup().map_err(|e| boot_err(format!("socket to rank {peer}: {e}")))?;
            let sh = shared.clone();
            std::thread::Builder::new()
                .name(format!("cdt-{name}-r{rank}p{peer}"))
                .spawn(move || read_loop(sh, peer, reader))
                .map_err(|e| boot_err(format!("cannot start a reader thread: {e}")))?;
            writers.push(Some(Arc::new(Mutex::new(Writer {
                stream: s,
                poisoned: false,
                notified: false,
            }))));
        }
        let t = Arc::new(Transport {
            rank,
            size,
            name: name.to_string(),
            key,
            rdv,
            shared,
            writers,
            notice: Arc::new(Mutex::new(None)),
            completed: std::sync::atomic::AtomicU64::new(0),
            ft_seq: std::sync::atomic::AtomicU64::new(0),
        });
        #[cfg(test)]
        super::tests::LIVE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&t));
        Ok(t)
    }

    /// Closes every socket at once without a goodbye (what a killed process looks like).
    #[cfg(test)]
    pub(crate) fn sever(&self) {
        self.shared.closing.store(true, Ordering::Relaxed);
        for w in self.writers.iter().flatten() {
            let g = w.lock().unwrap_or_else(|e| e.into_inner());
            let _ = g.stream.shutdown(Shutdown::Both);
        }
    }

    /// Another handle on this rank's socket to `peer` (tests fill it).
    #[cfg(test)]
    pub(crate) fn stream_to(&self, peer: usize) -> TcpStream {
        let w = self.writers[peer].as_ref().expect("a connected peer");
        let g = w.lock().unwrap_or_else(|e| e.into_inner());
        g.stream.try_clone().expect("clone a socket")
    }

    /// The current failure, if any.
    pub(crate) fn failure(&self) -> Option<Failure> {
        self.shared.lock().failure.clone()
    }

    /// Records `f` as the communicator's failure unless one is recorded already; when it is
    /// this rank's own finding, tells every peer (in the background: never blocks). Returns the
    /// failure in force.
    pub(crate) fn fail(&self, f: Failure, notify_peers: bool) -> Failure {
        let mut st = self.shared.lock();
        if let Some(existing) = &st.failure {
            return existing.clone();
        }
        st.failure = Some(f.clone());
        // The notice is recorded before anyone can see the failure, so a `close` racing with
        // the notice thread still sends it before its goodbye.
        let payload =
            notify_peers.then(|| Arc::new(words_to_bytes(&f.encode_words(MAX_NOTICE_WORDS))));
        if let Some(p) = &payload {
            *self.notice.lock().unwrap_or_else(|e| e.into_inner()) = Some(p.clone());
        }
        drop(st);
        self.shared.cv.notify_all();
        tracing::debug!(comm = %self.name, rank = self.rank, failure = %f, "process comm failed");
        if let Some(p) = payload {
            self.notify_peers(p);
        }
        f
    }

    fn notify_peers(&self, payload: Arc<Vec<u8>>) {
        let writers: Vec<(usize, Arc<Mutex<Writer>>)> = self
            .writers
            .iter()
            .enumerate()
            .filter_map(|(p, w)| w.clone().map(|w| (p, w)))
            .collect();
        let rank = self.rank;
        let spawned = std::thread::Builder::new()
            .name(format!("cdt-fail-r{rank}"))
            .spawn(move || {
                for (peer, w) in writers {
                    if let Err(e) = send_notice(&w, &payload) {
                        tracing::debug!(rank, peer, error = %e, "could not send a failure notice");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the failure-notice thread");
        }
    }

    /// Says goodbye to every peer and stops the reader threads (the communicator was dropped
    /// and its queue drained).
    pub(crate) fn close(&self) {
        let h = Header {
            kind: BYE,
            step: 0,
            tag: 0,
            len: 0,
        };
        let notice = self
            .notice
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut said = Vec::new();
        for (peer, w) in self.writers.iter().enumerate() {
            let Some(w) = w else { continue };
            // A failure notice still on its way goes out before the goodbye.
            if let Some(n) = &notice {
                let _ = send_notice(w, n);
            }
            let deadline = Instant::now() + NOTICE_LIMIT;
            let bye = write_frame(w, &h, &[], deadline);
            let g = w.lock().unwrap_or_else(|e| e.into_inner());
            let _ = g.stream.shutdown(Shutdown::Write);
            if bye.is_ok() {
                said.push((peer, g.stream.try_clone()));
            }
        }
        // The readers keep draining while this waits, so a peer's window stays open.
        let streams: Vec<(usize, TcpStream)> = said
            .into_iter()
            .filter_map(|(p, s)| s.ok().map(|s| (p, s)))
            .collect();
        let gone = |p: usize| self.shared.lock().gone.get(p).is_some_and(Option::is_some);
        let held = linger(&streams, gone, Instant::now() + NOTICE_LIMIT);
        if !held.is_empty() {
            tracing::debug!(comm = %self.name, rank = self.rank, peers = ?held, "closing with a goodbye not yet sent: those peers stopped reading");
        }
        self.shared.closing.store(true, Ordering::Relaxed);
    }

    /// Sends `frame` to `peer`, preceded by the already encoded frame(s) `prefix` (written in
    /// one go with it when small), bounded by `deadline`.
    pub(crate) fn send(
        &self,
        ctx: &OpCtx,
        peer: usize,
        frame: Out,
        prefix: &[u8],
        deadline: Instant,
    ) -> Result<()> {
        let Out {
            kind,
            tag,
            step,
            parts,
        } = frame;
        let Some(w) = self.writers.get(peer).and_then(|w| w.as_ref()) else {
            return Err(CommError::invalid(
                ctx,
                format!("no connection to rank {peer}"),
            ));
        };
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let h = Header {
            kind,
            step,
            tag,
            len: len as u64,
        };
        let mut g = w.lock().unwrap_or_else(|e| e.into_inner());
        let r = write_locked(&mut g, prefix, &h, parts, deadline);
        drop(g);
        self.write_result(ctx, peer, tag, r)
    }

    /// Maps the outcome of a write to `peer` during collective `tag`.
    fn write_result(
        &self,
        ctx: &OpCtx,
        peer: usize,
        tag: u64,
        r: std::result::Result<(), WriteError>,
    ) -> Result<()> {
        match r {
            Ok(()) => Ok(()),
            Err(WriteError::Timeout) => {
                let f = self.fail(
                    Failure::Timeout {
                        collective: tag,
                        op: ctx.op,
                        missing: vec![peer],
                    },
                    true,
                );
                Err(f.to_error(ctx, Some(tag)))
            }
            Err(WriteError::Poisoned) => Err(self.failure_error(ctx, None, peer)),
            Err(WriteError::Io(e)) => {
                let f = self.fail(
                    Failure::PeerLost {
                        rank: peer,
                        reason: format!("sending to it failed: {e}"),
                    },
                    false,
                );
                Err(f.to_error(ctx, None))
            }
        }
    }

    /// Sends an already encoded frame (a HELLO) of collective `tag` to `peer`.
    fn send_raw(
        &self,
        ctx: &OpCtx,
        peer: usize,
        bytes: &[u8],
        tag: u64,
        deadline: Instant,
    ) -> Result<()> {
        let Some(w) = self.writers.get(peer).and_then(|w| w.as_ref()) else {
            return Err(CommError::invalid(
                ctx,
                format!("no connection to rank {peer}"),
            ));
        };
        let mut g = w.lock().unwrap_or_else(|e| e.into_inner());
        let r = if g.poisoned {
            Err(WriteError::Poisoned)
        } else {
            let r = write_all(&mut g.stream, bytes, deadline);
            if r.is_err() {
                g.poisoned = true;
            }
            r
        };
        drop(g);
        self.write_result(ctx, peer, tag, r)
    }

    /// The error for an op that cannot go on: the recorded failure, or a generic one.
    fn failure_error(&self, ctx: &OpCtx, coll: Option<u64>, peer: usize) -> CommError {
        match self.failure() {
            Some(f) => f.to_error(ctx, coll),
            None => CommError::Aborted {
                ctx: ctx.clone(),
                reason: format!("the connection to rank {peer} is unusable"),
            },
        }
    }

    /// Errors out if the communicator has failed (in a way that stops collective `coll`).
    pub(crate) fn check(&self, ctx: &OpCtx, coll: Option<u64>) -> Result<()> {
        match self.failure() {
            Some(f) if f.blocks(coll) => Err(f.to_error(ctx, coll)),
            _ => Ok(()),
        }
    }

    /// The number of collectives completed on this rank (what an abort notice carries).
    pub(crate) fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    /// Forgets what is left of collective `coll` (hellos, unconsumed data); `ok` records it as
    /// completed.
    pub(crate) fn finish(&self, coll: u64, ok: bool) {
        if ok {
            self.completed.fetch_max(coll + 1, Ordering::AcqRel);
        }
        let mut st = self.shared.lock();
        for p in 0..self.size {
            st.hellos.remove(&(coll, p));
        }
        if !st.data.is_empty() {
            let stale: Vec<(u64, u32, usize)> =
                st.data.keys().filter(|k| k.0 == coll).copied().collect();
            for k in stale {
                st.take_data(k);
            }
            drop(st);
            self.shared.cv.notify_all();
        }
    }

    /// The number of the next agreement (or shrink) on this communicator.
    pub(crate) fn next_agreement(&self) -> u64 {
        self.ft_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends message `round` of agreement `instance` to `peer`; a peer that cannot be reached
    /// misses it (its absence is what the agreement accounts for).
    pub(crate) fn agree_send(&self, peer: usize, instance: u64, round: u32, bytes: &[u8]) {
        let Some(w) = self.writers.get(peer).and_then(|w| w.as_ref()) else {
            return;
        };
        let h = Header {
            kind: AGREE,
            step: round,
            tag: instance,
            len: bytes.len() as u64,
        };
        if let Err(e) = write_frame(w, &h, &[bytes], Instant::now() + NOTICE_LIMIT) {
            tracing::debug!(comm = %self.name, rank = self.rank, peer, error = %e, "agreement message not sent");
        }
    }

    /// Waits for `peer`'s message `round` of agreement `instance` until `deadline`. A peer whose
    /// connection broke or who closed the communicator is gone; the communicator's own failure
    /// does not matter.
    pub(crate) fn agree_recv(
        &self,
        peer: usize,
        instance: u64,
        round: u32,
        deadline: Instant,
    ) -> Heard {
        let mut st = self.shared.lock();
        loop {
            if let Some(m) = st.agree.remove(&(instance, round, peer)) {
                return Heard::Msg(m.bytes().to_vec());
            }
            match st.gone.get(peer) {
                Some(Some(Gone::Lost(why))) => return Heard::Gone(why.clone()),
                Some(Some(Gone::Left)) => return Heard::Gone("it closed the communicator".into()),
                _ => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Heard::Silent;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Why `peer` is gone (its connection broke, or it closed the communicator), if it is.
    pub(crate) fn gone_reason(&self, peer: usize) -> Option<String> {
        match self.shared.lock().gone.get(peer) {
            Some(Some(Gone::Lost(why))) => Some(why.clone()),
            Some(Some(Gone::Left)) => Some("it closed the communicator".into()),
            _ => None,
        }
    }

    /// Forgets what is left of agreement `instance` (messages of rounds this rank skipped).
    pub(crate) fn agree_done(&self, instance: u64) {
        self.shared.lock().agree.retain(|k, _| k.0 != instance);
    }

    /// The most bytes of unconsumed payloads held for one peer so far.
    #[cfg(test)]
    pub(crate) fn peak_buffered(&self) -> usize {
        self.shared.lock().peak_buffered
    }

    /// Checks every descriptor peers sent for `x.coll` against ours; records a desync.
    fn check_hellos(&self, st: &mut Mail, x: &Exec) -> Option<Failure> {
        let mine = x.desc.as_ref()?;
        for p in 0..self.size {
            if p == self.rank {
                continue;
            }
            if let Some(theirs) = st.hellos.get(&(x.coll, p)) {
                if !mine.compatible(theirs) {
                    let (a, b) = ((p, theirs), (self.rank, mine));
                    let (a, b) = if p < self.rank { (a, b) } else { (b, a) };
                    return Some(Failure::desync(x.coll, a, b));
                }
            }
        }
        None
    }

    /// The ranks that have not announced collective `coll` yet.
    fn unannounced(&self, st: &Mail, coll: u64) -> Vec<usize> {
        (0..self.size)
            .filter(|&p| p != self.rank && !st.hellos.contains_key(&(coll, p)))
            .collect()
    }

    /// Waits, under the mailbox lock, until `ready` yields a value, checking desync, failure,
    /// departed peers and the deadline in between. `pending` names the peers the wait still
    /// needs something from (a departed one among them fails the wait); `timeout_missing`
    /// computes the missing ranks on timeout.
    fn wait_for<T>(
        &self,
        x: &Exec,
        pending: impl Fn(&Mail) -> Vec<usize>,
        mut ready: impl FnMut(&mut Mail) -> Option<T>,
        timeout_missing: impl Fn(&Mail) -> Vec<usize>,
    ) -> Result<T> {
        // Peers may be waiting for our HELLO: it must be out before we wait.
        x.greet_all()?;
        let coll = (x.coll != u64::MAX).then_some(x.coll);
        let mut st = self.shared.lock();
        loop {
            if coll.is_some() {
                if let Some(d) = self.check_hellos(&mut st, x) {
                    drop(st);
                    let f = self.fail(d, true);
                    return Err(f.to_error(x.ctx, coll));
                }
            }
            // Completion first: data that arrived before a failure is still good.
            if let Some(v) = ready(&mut st) {
                return Ok(v);
            }
            if let Some(f) = st.failure.as_ref().filter(|f| f.blocks(coll)) {
                return Err(f.to_error(x.ctx, coll));
            }
            // A lost peer (its process died) fails the wait at once. A peer that closed the
            // communicator on purpose will never arrive either, but that is the program's
            // choice, as a rank of the local backend that returns early: it is reported by the
            // timeout, naming it.
            if let Some((p, reason)) = pending(&st).into_iter().find_map(|p| match st.gone.get(p) {
                Some(Some(Gone::Lost(r))) => Some((p, r.clone())),
                _ => None,
            }) {
                drop(st);
                let f = self.fail(Failure::PeerLost { rank: p, reason }, false);
                return Err(f.to_error(x.ctx, coll));
            }
            let now = Instant::now();
            if now >= x.deadline {
                let mut missing = timeout_missing(&st);
                missing.sort_unstable();
                drop(st);
                let f = self.fail(
                    Failure::Timeout {
                        collective: x.coll,
                        op: x.ctx.op,
                        missing: missing.clone(),
                    },
                    true,
                );
                // If another failure won the race, report that one.
                // If another failure won the race and stops this op, report that one.
                let ours =
                    matches!(&f, Failure::Timeout { collective, .. } if *collective == x.coll);
                return Err(if !ours && f.blocks(coll) {
                    f.to_error(x.ctx, coll)
                } else {
                    CommError::Timeout {
                        ctx: x.ctx.clone(),
                        timeout: x.ctx.timeout,
                        missing,
                    }
                });
            }
            let (g, _) = self
                .shared
                .cv
                .wait_timeout(st, x.deadline - now)
                .unwrap_or_else(|e| e.into_inner());
            st = g;
        }
    }

    /// Receives DATA `step` of the current collective from `src`.
    pub(crate) fn recv(&self, x: &Exec, src: usize, step: u32) -> Result<Payload> {
        let coll = x.coll;
        let r = self.wait_for(
            x,
            |_| vec![src],
            |st| {
                // A peer's data follows its hello on the same stream, and hellos are checked
                // before this runs, so data present here belongs to a matching collective.
                st.take_data((coll, step, src))
            },
            |st| {
                let m = self.unannounced(st, coll);
                if m.is_empty() {
                    vec![src]
                } else {
                    m
                }
            },
        );
        // A reader may be waiting for room under the cap.
        self.shared.cv.notify_all();
        r
    }

    /// Waits until every peer announced the current collective with a matching descriptor
    /// (after this, every rank has reached it: the collective's completion barrier).
    pub(crate) fn wait_hellos(&self, x: &Exec) -> Result<()> {
        let coll = x.coll;
        let peers: Vec<usize> = (0..self.size).filter(|&p| p != self.rank).collect();
        self.wait_for(
            x,
            |st| self.unannounced(st, coll),
            |st| {
                peers
                    .iter()
                    .all(|&p| st.hellos.contains_key(&(coll, p)))
                    .then_some(())
            },
            |st| self.unannounced(st, coll),
        )
    }

    /// Takes the next point-to-point payload from `src`.
    pub(crate) fn recv_p2p(&self, x: &Exec, src: usize) -> Result<Payload> {
        let r = self.wait_for(x, |_| vec![src], |st| st.take_p2p(src), |_| vec![src]);
        self.shared.cv.notify_all();
        r
    }
}

impl Exec<'_> {
    /// Records this rank's descriptor of the collective; it goes to every peer as a HELLO
    /// frame, with the first DATA frame to that peer or before this rank first waits.
    pub(crate) fn hello(&mut self, desc: OpDesc) -> Result<()> {
        let mut words = Vec::new();
        desc.encode_words(&mut words);
        let payload = words_to_bytes(&words);
        self.desc = Some(desc);
        self.t.check(self.ctx, Some(self.coll))?;
        let h = Header {
            kind: HELLO,
            step: 0,
            tag: self.coll,
            len: payload.len() as u64,
        };
        self.greeting = h.encode().to_vec();
        self.greeting.extend_from_slice(&payload);
        self.greeted = (0..self.t.size)
            .map(|p| AtomicBool::new(p == self.t.rank))
            .collect();
        Ok(())
    }

    /// The HELLO frame still owed to `peer` (empty if sent already, or for p2p ops).
    fn greeting_for(&self, peer: usize) -> &[u8] {
        match self.greeted.get(peer) {
            Some(g) if !g.swap(true, Ordering::AcqRel) => &self.greeting,
            _ => &[],
        }
    }

    /// Sends the HELLO to every peer that has not had it (before any wait: peers may need it).
    pub(crate) fn greet_all(&self) -> Result<()> {
        for p in 0..self.greeted.len() {
            let pre = self.greeting_for(p);
            if !pre.is_empty() {
                self.t
                    .send_raw(self.ctx, p, pre, self.coll, self.deadline)?;
            }
        }
        Ok(())
    }

    /// Sends DATA `step` of this collective to `peer`.
    pub(crate) fn send(&self, peer: usize, step: u32, parts: &[&[u8]]) -> Result<()> {
        let frame = Out {
            kind: DATA,
            tag: self.coll,
            step,
            parts,
        };
        self.t.send(
            self.ctx,
            peer,
            frame,
            self.greeting_for(peer),
            self.deadline,
        )
    }

    /// Receives DATA `step` of this collective from `src`.
    pub(crate) fn recv(&self, src: usize, step: u32) -> Result<Payload> {
        self.t.recv(self, src, step)
    }

    /// Receives DATA `step` from `src` and checks it holds `bytes` bytes.
    pub(crate) fn recv_exact(&self, src: usize, step: u32, bytes: usize) -> Result<Payload> {
        let v = self.recv(src, step)?;
        if v.len() != bytes {
            return Err(CommError::invalid(
                self.ctx,
                format!(
                    "rank {src} sent {} bytes for step {step} of collective #{}, expected {bytes}",
                    v.len(),
                    self.coll
                ),
            ));
        }
        Ok(v)
    }

    /// Sends a point-to-point payload to `peer` (to itself: straight into its own mailbox).
    pub(crate) fn send_p2p(&self, peer: usize, parts: &[&[u8]]) -> Result<()> {
        if peer == self.t.rank {
            let mut p = Payload::zeroed(parts.iter().map(|p| p.len()).sum());
            let mut off = 0;
            for part in parts {
                p.bytes_mut()[off..off + part.len()].copy_from_slice(part);
                off += part.len();
            }
            self.t.shared.lock().p2p[peer].push_back(p);
            return Ok(());
        }
        let frame = Out {
            kind: P2P,
            tag: u64::MAX,
            step: 0,
            parts,
        };
        self.t.send(self.ctx, peer, frame, &[], self.deadline)
    }
}

#[derive(Debug)]
enum WriteError {
    Timeout,
    Poisoned,
    Io(std::io::Error),
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Timeout => f.write_str("write timed out"),
            WriteError::Poisoned => f.write_str("stream unusable after an abandoned frame"),
            WriteError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Sends this rank's failure notice on `w` unless it went out already.
fn send_notice(w: &Mutex<Writer>, payload: &[u8]) -> std::result::Result<(), WriteError> {
    let mut g = w.lock().unwrap_or_else(|e| e.into_inner());
    if g.notified {
        return Ok(());
    }
    g.notified = true;
    let h = Header {
        kind: FAIL,
        step: 0,
        tag: 0,
        len: payload.len() as u64,
    };
    write_locked(&mut g, &[], &h, &[payload], Instant::now() + NOTICE_LIMIT)
}

/// Writes one frame, bounded by `deadline`. A frame abandoned half-way poisons the stream.
fn write_frame(
    w: &Mutex<Writer>,
    h: &Header,
    parts: &[&[u8]],
    deadline: Instant,
) -> std::result::Result<(), WriteError> {
    let mut g = w.lock().unwrap_or_else(|e| e.into_inner());
    write_locked(&mut g, &[], h, parts, deadline)
}

/// Writes the encoded bytes `prefix`, then the frame `h` + `parts`; small writes go out as one.
fn write_locked(
    g: &mut Writer,
    prefix: &[u8],
    h: &Header,
    parts: &[&[u8]],
    deadline: Instant,
) -> std::result::Result<(), WriteError> {
    if g.poisoned {
        return Err(WriteError::Poisoned);
    }
    let head = h.encode();
    let total: usize = prefix.len() + HEADER + parts.iter().map(|p| p.len()).sum::<usize>();
    let r = if total <= COALESCE {
        let mut buf = Vec::with_capacity(total);
        buf.extend_from_slice(prefix);
        buf.extend_from_slice(&head);
        for p in parts {
            buf.extend_from_slice(p);
        }
        write_all(&mut g.stream, &buf, deadline)
    } else {
        [prefix, &head[..]]
            .into_iter()
            .chain(parts.iter().copied())
            .try_for_each(|p| write_all(&mut g.stream, p, deadline))
    };
    if r.is_err() {
        g.poisoned = true;
    }
    r
}

fn write_all(
    s: &mut TcpStream,
    mut buf: &[u8],
    deadline: Instant,
) -> std::result::Result<(), WriteError> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(WriteError::Io(ErrorKind::WriteZero.into())),
            Ok(k) => buf = &buf[k..],
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if Instant::now() >= deadline {
                    return Err(WriteError::Timeout);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(WriteError::Io(e)),
        }
    }
    Ok(())
}

/// Waits until every byte written to each of `streams` (peer rank, socket) has left this host,
/// checking every few milliseconds until `deadline`; returns the peers whose bytes are still
/// queued then. A peer for which `gone` holds is not waited for (it will read nothing more).
///
/// Why: a process that exits with unread bytes in a socket's receive queue makes its kernel
/// reset the connection, which drops whatever this end still queues for sending. A goodbye
/// (or failure notice) queued behind data that a busy peer has not made room for would be
/// lost, and the peer would take a clean close for a crash and blame this rank for a failure
/// it only reported. Bytes already sent survive the reset where the link delivers them ahead of
/// it (loopback and a link that loses nothing; a segment lost and not yet retransmitted is
/// still lost): the peer's kernel holds them and its reader reads them before it sees the
/// reset. Waiting for them to be sent, not
/// acknowledged, costs nothing on a healthy connection (acknowledgements may be delayed by
/// tens of milliseconds). Where the platform cannot say ([`unsent`] is `None`), nothing is
/// waited for.
pub(crate) fn linger(
    streams: &[(usize, TcpStream)],
    gone: impl Fn(usize) -> bool,
    deadline: Instant,
) -> Vec<usize> {
    let mut pause = Duration::from_micros(100);
    let mut held: Vec<&(usize, TcpStream)> = streams.iter().collect();
    loop {
        held.retain(|(p, s)| !gone(*p) && unsent(s).is_some_and(|n| n > 0));
        let now = Instant::now();
        if held.is_empty() || now >= deadline {
            return held.iter().map(|(p, _)| *p).collect();
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

/// Bytes written to `s` that this host has not sent yet (Linux's `SIOCOUTQNSD`), or `None`
/// where the socket or the platform cannot say.
#[cfg(target_os = "linux")]
pub(crate) fn unsent(s: &TcpStream) -> Option<usize> {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: the descriptor is `s`'s open socket, borrowed for the whole call, and
    // SIOCOUTQNSD writes exactly one `int` through the pointer, which points at `n`, a live,
    // aligned `c_int` this frame owns. The kernel validates the descriptor (a socket that was
    // shut down or reset answers or fails, it is never freed under the call).
    let r = unsafe {
        libc::ioctl(
            s.as_raw_fd(),
            libc::SIOCOUTQNSD as _,
            &mut n as *mut libc::c_int,
        )
    };
    if r != 0 {
        return None;
    }
    usize::try_from(n).ok()
}

/// Bytes written to `s` that this host has not sent yet: unknown on this platform.
#[cfg(not(target_os = "linux"))]
pub(crate) fn unsent(_s: &TcpStream) -> Option<usize> {
    None
}

/// A reader thread: files frames from `src` until the stream ends or the transport closes.
/// A frame it will not read (oversized for its kind, malformed, cut off) closes the
/// connection: the peer is lost with a [`FrameError`](candle_dtensor_comm_core::store::FrameError) naming it, the
/// frame kind and the sizes, and a warning is logged.
fn read_loop(sh: Arc<Shared>, src: usize, mut s: TcpStream) {
    let peer = match s.peer_addr() {
        Ok(a) => format!("rank {src} ({a})"),
        Err(_) => format!("rank {src}"),
    };
    // Set when a frame this rank will not read ends the connection (it is then closed).
    let mut refused = false;
    let outcome = (|| -> std::result::Result<(), String> {
        loop {
            let admit = |h: &Header| room_for(&sh, src, *h).map_err(|_| ReadEnd::Closing);
            let (h, frame) = match read_frame(&mut s, &peer, Some(&sh.closing), admit) {
                Ok(f) => f,
                Err(ReadEnd::Closing) => return Err("closing".into()),
                Err(ReadEnd::Closed(e)) => return Err(io_reason(e)),
                Err(ReadEnd::Frame(e)) => {
                    if e.is_closing() {
                        return Err("closing".into());
                    }
                    if !matches!(e, FrameError::Truncated { .. }) {
                        refused = true;
                        tracing::warn!(rank = sh.rank, %peer, error = %e, "connection closed: a frame this rank will not read");
                    }
                    return Err(e.to_string());
                }
            };
            let Some(frame) = frame else { continue };
            let mut st = sh.lock();
            match frame {
                Frame::Hello(d) => {
                    st.hellos.insert((h.tag, src), d);
                }
                Frame::Data(payload) => {
                    let len = payload.len();
                    if st.data.insert((h.tag, h.step, src), payload).is_some() {
                        let e = FrameError::Malformed {
                            peer: peer.clone(),
                            kind: "DATA".into(),
                            len: h.len,
                            reason: format!("a second step {} of collective #{}", h.step, h.tag),
                        };
                        refused = true;
                        tracing::warn!(rank = sh.rank, %peer, error = %e, "connection closed: a frame this rank will not read");
                        return Err(e.to_string());
                    }
                    st.hold(src, len);
                }
                Frame::P2p(payload) => {
                    st.hold(src, payload.len());
                    st.p2p[src].push_back(payload);
                }
                Frame::Agree(payload) => {
                    st.agree.insert((h.tag, h.step, src), payload);
                }
                Frame::Fail(f) => {
                    if st.failure.is_none() {
                        st.failure = Some(f);
                    }
                }
                Frame::Bye => st.gone[src] = Some(Gone::Left),
            }
            drop(st);
            sh.cv.notify_all();
        }
    })();
    let Err(reason) = outcome else { return };
    if refused {
        // Nothing more is read from this peer: close the connection, so it learns at once.
        let _ = s.shutdown(Shutdown::Both);
    }
    if sh.closing.load(Ordering::Relaxed) {
        return;
    }
    let mut st = sh.lock();
    if matches!(st.gone[src], Some(Gone::Left)) {
        return; // the goodbye came first: a clean close
    }
    tracing::debug!(rank = sh.rank, peer = src, %reason, "peer connection lost");
    st.gone[src] = Some(Gone::Lost(reason.clone()));
    if st.failure.is_none() {
        st.failure = Some(Failure::PeerLost { rank: src, reason });
    }
    drop(st);
    sh.cv.notify_all();
}

/// Waits until `src`'s held payloads are under the cap; `false` when the frame `h` should be
/// dropped instead (the communicator failed in a way that stops its use). `Err` when closing.
fn room_for(sh: &Shared, src: usize, h: Header) -> std::result::Result<bool, String> {
    let mut st = sh.lock();
    loop {
        let useless = st
            .failure
            .as_ref()
            .is_some_and(|f| f.blocks(if h.kind == DATA { Some(h.tag) } else { None }));
        if useless {
            return Ok(false);
        }
        if st.buffered[src] <= sh.cap {
            return Ok(true);
        }
        if sh.closing.load(Ordering::Relaxed) {
            return Err("closing".into());
        }
        st = sh
            .cv
            .wait_timeout(st, TICK)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn io_reason(e: std::io::Error) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof => {
            "its connection closed without a goodbye (the process exited or was killed)".into()
        }
        ErrorKind::Interrupted => "closing".into(),
        _ => format!("its connection failed: {e}"),
    }
}
