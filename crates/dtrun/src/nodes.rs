//! dtrun across nodes: torchrun's static rendezvous, and one job that fails as one.
//!
//! # Who hosts what
//!
//! - Node 0's dtrun hosts a **control store** (comm's [`TcpStoreServer`], authenticated with
//!   the job token) on `0.0.0.0:<--master-port>`, so every node reaches it at
//!   `--master-addr:--master-port`. The dtruns of all nodes (node 0's included) are its
//!   clients; no rank talks to it.
//! - The ranks' rendezvous store is hosted, as on one node, by rank 0 (on node 0) at
//!   `MASTER_ADDR:MASTER_PORT`, with `MASTER_ADDR = --master-addr` (an address of node 0 the
//!   other nodes reach, which rank 0 can listen on) and `MASTER_PORT` a free port node 0's
//!   dtrun picks for each start and publishes in the control store (`gen/<g>/port`).
//!
//! # Rendezvous (once per dtrun)
//!
//! Every node connects to the control store (retrying until `--rdzv-timeout`; a store that
//! holds another token refuses at once: that node says its token differs from node 0's),
//! takes an arrival number (`join/count`) and publishes its settings under `join/<i>`
//! (`--node-rank`, `--nnodes`, `--nproc-per-node`, host name, address). Node 0 waits for as
//! many arrivals as its `--nnodes` (until `--rdzv-timeout`), checks them (node ranks in range
//! and distinct, every node's `--nnodes` and `--nproc-per-node` equal to its own) and writes
//! `verdict`: `ok`, or `error` with a message naming the node(s), the setting and the values
//! seen; every node waits for the verdict (bounded by `--rdzv-timeout`) and fails with it.
//!
//! # Each start (generation `g`, `TORCHELASTIC_RESTART_COUNT`)
//!
//! - While its ranks run, each dtrun's watcher thread bumps its heartbeat counter
//!   (`alive/<node>`, every [`HEARTBEAT`]) and waits on `gen/<g>/failed` in slices of
//!   [`POLL`]. When the key appears, the dtrun stops its ranks as after a local failure
//!   (SIGTERM, the grace period, SIGKILL).
//! - A dtrun whose rank failed (beyond `--allow-failures`, counted job-wide with
//!   `gen/<g>/nfailed`), that got a signal or hit `--timeout` writes its reason to
//!   `gen/<g>/report/<node>` and sets `gen/<g>/failed`.
//! - Node 0's watcher also watches the other nodes' heartbeats: one unchanged for
//!   [`NODE_LOST`] marks the job failed ("node k's dtrun stopped answering", and
//!   `gen/<g>/lost`, so that no node waits for that node's end). A non-zero node's watcher
//!   that cannot reach the control store for [`CTL_TIMEOUT`] (a request that fails retries
//!   its connection for as long again, so about twice that) stops its ranks and ends without
//!   waiting for anyone ("lost node 0's dtrun"). (A dtrun killed with SIGKILL takes its ranks
//!   with it, `PR_SET_PDEATHSIG`; the other nodes' ranks usually fail first, by their own
//!   op timeouts or closed connections.)
//! - When its ranks have ended, each dtrun writes `gen/<g>/done/<node>` (its exit code and
//!   whether its end allows a restart) and waits for every node's record, as long as the
//!   missing nodes' heartbeats move (a node silent for [`NODE_LOST`] is given up on). Every
//!   node then decides the same: the job's result, and the failure named first (a rank
//!   killed by a signal nobody sent beats the peers that exited because of it, then the first
//!   to report), printed on every node with the node and the rank.
//! - `--max-restarts`: when the job failed because ranks failed (not a signal to a dtrun or
//!   `--timeout`) and restarts are left, every node starts generation `g + 1` together.
//!
//! Every store call has a deadline ([`CTL_TIMEOUT`] per request; waits in slices), so no
//! dtrun waits forever for another. What a peer writes is read bounded ([`MAX_VALUE`]) and
//! parsed strictly; a malformed record is an error naming the key.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_dtensor_comm_core::store::{Store, StoreConfig, StoreError, TcpStore, TcpStoreServer};

/// Each request to the control store (once connected) must complete within this.
pub(crate) const CTL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a watcher waits on `failed` per request.
pub(crate) const POLL: Duration = Duration::from_millis(250);
/// How often a dtrun bumps its heartbeat.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(1);
/// A node whose heartbeat has not moved for this long is lost.
pub(crate) const NODE_LOST: Duration = Duration::from_secs(15);
/// The largest record a node reads from the control store.
const MAX_VALUE: usize = 4096;

/// What went wrong between the nodes.
#[derive(Debug)]
pub(crate) enum NodeError {
    /// Settings that cannot work (given on this node, or disagreeing between nodes).
    Config(String),
    /// The nodes did not meet in time, or the control store failed.
    Rendezvous(String),
}

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeError::Config(m) => write!(f, "{m}"),
            NodeError::Rendezvous(m) => write!(f, "rendezvous: {m}"),
        }
    }
}

impl std::error::Error for NodeError {}

fn store_err(what: &str, e: StoreError) -> NodeError {
    NodeError::Rendezvous(format!("{what}: {e}"))
}

/// One node's settings, as published at join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    pub node_rank: u32,
    pub nnodes: u32,
    pub nproc_per_node: u32,
    pub host: String,
    pub addr: String,
}

impl Settings {
    fn encode(&self) -> String {
        format!(
            "node_rank={}\nnnodes={}\nnproc_per_node={}\nhost={}\naddr={}\n",
            self.node_rank,
            self.nnodes,
            self.nproc_per_node,
            clean(&self.host),
            clean(&self.addr)
        )
    }

    fn decode(key: &str, v: &[u8]) -> Result<Settings, NodeError> {
        let bad = |why: String| NodeError::Rendezvous(format!("malformed record {key:?}: {why}"));
        let text = std::str::from_utf8(v).map_err(|e| bad(e.to_string()))?;
        let field = |name: &str| -> Result<&str, NodeError> {
            text.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
                .ok_or_else(|| bad(format!("no {name}")))
        };
        let num = |name: &str| -> Result<u32, NodeError> {
            field(name)?
                .parse()
                .map_err(|e| bad(format!("{name}: {e}")))
        };
        Ok(Settings {
            node_rank: num("node_rank")?,
            nnodes: num("nnodes")?,
            nproc_per_node: num("nproc_per_node")?,
            host: clean(field("host")?),
            addr: clean(field("addr")?),
        })
    }

    fn who(&self) -> String {
        format!("node {} ({}, {})", self.node_rank, self.host, self.addr)
    }
}

/// A string from a peer, fit for one line of a message: printable ASCII, at most 200 chars.
fn clean(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .take(200)
        .collect()
}

/// Reads `key` (waiting up to `timeout`), bounded and as UTF-8 text cleaned for messages.
fn read_text(store: &TcpStore, key: &str, timeout: Duration) -> Result<String, NodeError> {
    store
        .wait(&[key], timeout)
        .map_err(|e| store_err(&format!("waiting for {key:?}"), e))?;
    let v = store
        .get(key)
        .map_err(|e| store_err(&format!("reading {key:?}"), e))?;
    if v.len() > MAX_VALUE {
        return Err(NodeError::Rendezvous(format!(
            "record {key:?} holds {} bytes, more than the {MAX_VALUE} a node writes",
            v.len()
        )));
    }
    Ok(String::from_utf8_lossy(&v).into_owned())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| clean(s.trim()))
        .unwrap_or_else(|_| "unknown-host".into())
}

/// How one node's part of a start ended (`gen/<g>/done/<node>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeEnd {
    /// The node's exit code for this start (0: its ranks ended well).
    pub code: i32,
    /// Whether the failure (if any) is one `--max-restarts` restarts.
    pub restartable: bool,
}

/// Why a node stopped the job (`gen/<g>/report/<node>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    /// A rank was killed by a signal that no dtrun sent (the likely cause of the rest).
    pub killed: bool,
    /// The exit code it stands for.
    pub code: i32,
    /// What happened, naming the node and rank.
    pub what: String,
    /// The order in which the nodes reported (1: first); set by [`Cluster::post_failure`].
    pub seq: i64,
}

/// Every node's end of a start, and the reports (node, why) of the nodes that stopped it.
pub(crate) type JobEnd = (Vec<NodeEnd>, Vec<(u32, Report)>);

/// A dtrun's membership in a multi-node job.
pub(crate) struct Cluster {
    pub node_rank: u32,
    pub nnodes: u32,
    /// The control store (node 0 only).
    _server: Option<TcpStoreServer>,
    ctl: Arc<TcpStore>,
    ctl_addr: String,
}

impl Cluster {
    /// Joins (node 0: hosts, then joins) the control store and checks every node's settings.
    pub(crate) fn join(
        me: &Settings,
        master_addr: &str,
        master_port: u16,
        token: Option<&str>,
        insecure: bool,
        rdzv_timeout: Duration,
    ) -> Result<Cluster, NodeError> {
        let cfg = StoreConfig::default()
            .with_token(token.unwrap_or("").as_bytes())
            .insecure(insecure);
        let ctl_addr = format!("{master_addr}:{master_port}");
        let server = if me.node_rank == 0 {
            let bind = format!("0.0.0.0:{master_port}");
            let s = TcpStoreServer::bind_with(&bind, cfg.clone()).map_err(|e| {
                NodeError::Rendezvous(format!(
                    "node 0 cannot host the control store on {bind}: {e} (another job on \
                     --master-port {master_port}?)"
                ))
            })?;
            tracing::info!(addr = %bind, "node 0 hosts the control store");
            Some(s)
        } else {
            None
        };
        let deadline = Instant::now() + rdzv_timeout;
        let first = TcpStore::connect_with(&ctl_addr, rdzv_timeout, &cfg).map_err(|e| match e {
            StoreError::Denied { .. } => NodeError::Config(format!(
                "node {}: node 0's control store at {ctl_addr} refused this node's job token \
                 (the token of CDT_JOB_TOKEN / --token-file differs from node 0's): {e}",
                me.node_rank
            )),
            e => NodeError::Rendezvous(format!(
                "node {}: cannot reach node 0's dtrun at {ctl_addr} (--master-addr, \
                 --master-port) within {rdzv_timeout:?}: {e}",
                me.node_rank
            )),
        })?;
        let addr = first
            .local_ip()
            .map(|ip| ip.to_string())
            .unwrap_or_else(|_| "?".into());
        drop(first);
        let ctl = Arc::new(
            TcpStore::connect_with(&ctl_addr, CTL_TIMEOUT, &cfg)
                .map_err(|e| store_err("connecting to the control store", e))?,
        );
        let me = Settings { addr, ..me.clone() };
        let idx = ctl
            .add("join/count", 1)
            .map_err(|e| store_err("joining", e))?;
        ctl.set(&format!("join/{idx}"), me.encode().as_bytes())
            .map_err(|e| store_err("publishing this node's settings", e))?;
        tracing::info!(
            arrival = idx,
            node = me.node_rank,
            "joined the control store"
        );
        if me.node_rank == 0 {
            let verdict = check_nodes(&ctl, &me, deadline);
            if let Err(e) = &verdict {
                tracing::debug!(error = %e, "the nodes' settings are refused");
            }
            let text = match &verdict {
                Ok(()) => "ok\n".to_string(),
                Err(m) => format!("error\n{m}"),
            };
            ctl.set("verdict", text.as_bytes())
                .map_err(|e| store_err("publishing the verdict", e))?;
            if verdict.is_err() {
                // Keep the store up until every node that joined read the verdict (bounded).
                let until = Instant::now() + CTL_TIMEOUT;
                while Instant::now() < until {
                    let joined = ctl.add("join/count", 0).unwrap_or(0);
                    let read = ctl.add("verdict/read", 0).unwrap_or(0);
                    if read + 1 >= joined {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            verdict.map_err(NodeError::Config)?;
        } else {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = read_text(&ctl, "verdict", left.max(Duration::from_millis(500))).map_err(
                |e| {
                    NodeError::Rendezvous(format!(
                        "node {}: no verdict from node 0 within --rdzv-timeout {rdzv_timeout:?}: {e}",
                        me.node_rank
                    ))
                },
            )?;
            let _ = ctl.add("verdict/read", 1);
            match v.split_once('\n') {
                Some(("ok", _)) => {}
                Some(("error", m)) => return Err(NodeError::Config(m.to_string())),
                _ => {
                    return Err(NodeError::Rendezvous(format!(
                        "malformed verdict from node 0: {:?}",
                        clean(&v)
                    )))
                }
            }
            if idx > i64::from(me.nnodes) {
                return Err(NodeError::Config(format!(
                    "{}: arrived as node {idx} of a job of {} nodes: more nodes joined than \
                     --nnodes",
                    me.who(),
                    me.nnodes
                )));
            }
        }
        Ok(Cluster {
            node_rank: me.node_rank,
            nnodes: me.nnodes,
            _server: server,
            ctl,
            ctl_addr,
        })
    }

    /// The ranks' store port of start `gen`: node 0 picks it (`pick`) and publishes it, the
    /// others read it.
    pub(crate) fn world_port(
        &self,
        gen: u32,
        pick: impl FnOnce() -> Result<u16, String>,
        timeout: Duration,
    ) -> Result<u16, NodeError> {
        let key = format!("gen/{gen}/port");
        if self.node_rank == 0 {
            let p = pick().map_err(NodeError::Rendezvous)?;
            self.ctl
                .set(&key, p.to_string().as_bytes())
                .map_err(|e| store_err("publishing the ranks' store port", e))?;
            Ok(p)
        } else {
            let v = read_text(&self.ctl, &key, timeout)?;
            v.trim().parse().map_err(|e| {
                NodeError::Rendezvous(format!("malformed {key:?} from node 0: {v:?}: {e}"))
            })
        }
    }

    /// Counts one failed rank job-wide; returns how many failed in this start so far.
    pub(crate) fn count_failure(&self, gen: u32) -> Result<i64, NodeError> {
        self.ctl
            .add(&format!("gen/{gen}/nfailed"), 1)
            .map_err(|e| store_err("counting a failure", e))
    }

    /// Reports why this node stops the job, and tells every node to stop.
    pub(crate) fn post_failure(&self, gen: u32, r: &Report) {
        let seq = self.ctl.add(&format!("gen/{gen}/nstops"), 1).unwrap_or(1);
        let v = format!(
            "{}\n{}\n{seq}\n{}",
            u8::from(r.killed),
            r.code,
            clean(&r.what)
        );
        let key = format!("gen/{gen}/report/{}", self.node_rank);
        if let Err(e) = self.ctl.set(&key, v.as_bytes()) {
            tracing::warn!(error = %e, "cannot report the failure to the other nodes");
        }
        // The first stop's reason is the flag's value (what the others print at once).
        if seq == 1 {
            if let Err(e) = self
                .ctl
                .set(&format!("gen/{gen}/failed"), clean(&r.what).as_bytes())
            {
                tracing::warn!(error = %e, "cannot tell the other nodes to stop");
            }
        }
    }

    /// Starts the watcher of start `gen`: heartbeats, the `failed` flag, and (node 0) the
    /// other nodes' heartbeats. It sends `remote(msg)` when the job must stop because of
    /// another node, `lost(msg)` when node 0's control store stopped answering, and ends when
    /// the returned guard is dropped.
    pub(crate) fn watch<E: Send + 'static>(
        &self,
        gen: u32,
        tx: Sender<E>,
        remote: fn(String) -> E,
        lost: fn(String) -> E,
    ) -> Watcher {
        let stop = Arc::new(AtomicBool::new(false));
        let w = Watcher { stop: stop.clone() };
        let ctl = self.ctl.clone();
        let (me, nnodes) = (self.node_rank, self.nnodes);
        let ctl_addr = self.ctl_addr.clone();
        std::thread::spawn(move || {
            let failed = format!("gen/{gen}/failed");
            let mut beats = Heartbeats::new(nnodes, me);
            // The first heartbeat at once.
            let mut last_beat = Instant::now()
                .checked_sub(HEARTBEAT)
                .unwrap_or_else(Instant::now);
            let mut last_ok = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                if last_beat.elapsed() >= HEARTBEAT {
                    last_beat = Instant::now();
                    let _ = ctl.add(&format!("alive/{me}"), 1);
                    if me == 0 {
                        if let Some(gone) = beats.poll(&ctl) {
                            let msg = format!(
                                "node {gone}'s dtrun stopped answering (no heartbeat for {:?})",
                                NODE_LOST
                            );
                            // So that no node waits for its end again.
                            let _ =
                                ctl.set(&format!("gen/{gen}/lost"), gone.to_string().as_bytes());
                            if ctl.add(&format!("gen/{gen}/nstops"), 1).unwrap_or(1) == 1 {
                                let _ = ctl.set(&failed, msg.as_bytes());
                            }
                            let _ = tx.send(remote(msg));
                            return;
                        }
                    }
                }
                match ctl.wait(&[failed.as_str()], POLL) {
                    Ok(()) => {
                        let msg = read_text(&ctl, &failed, CTL_TIMEOUT)
                            .unwrap_or_else(|e| format!("(unreadable: {e})"));
                        let _ = tx.send(remote(msg));
                        return;
                    }
                    Err(StoreError::Timeout { .. }) => last_ok = Instant::now(),
                    Err(e) => {
                        if last_ok.elapsed() >= CTL_TIMEOUT {
                            let _ = tx.send(lost(format!(
                                "lost node 0's dtrun (its control store at {ctl_addr} has not \
                                 answered for {CTL_TIMEOUT:?}: {e})"
                            )));
                            return;
                        }
                        std::thread::sleep(POLL);
                    }
                }
            }
        });
        w
    }

    /// Records how this node's part of start `gen` ended and waits for every node's record
    /// (as long as the missing nodes' heartbeats move). Returns every node's end and the
    /// reports of the nodes that stopped the job.
    pub(crate) fn finish(
        &self,
        gen: u32,
        mine: &NodeEnd,
        job_deadline: Option<Instant>,
    ) -> Result<JobEnd, NodeError> {
        let key = |n: u32| format!("gen/{gen}/done/{n}");
        self.ctl
            .set(
                &key(self.node_rank),
                format!("{}\n{}", mine.code, u8::from(mine.restartable)).as_bytes(),
            )
            .map_err(|e| store_err("recording this node's end", e))?;
        let keys: Vec<String> = (0..self.nnodes).map(key).collect();
        let mut beats = Heartbeats::new(self.nnodes, self.node_rank);
        let mut last_beat = Instant::now();
        loop {
            let refs: Vec<&str> = keys.iter().map(|s| s.as_str()).collect();
            match self.ctl.wait(&refs, POLL) {
                Ok(()) => break,
                Err(StoreError::Timeout { missing, .. }) => {
                    let gone = format!("gen/{gen}/lost");
                    if self.ctl.check(&[gone.as_str()]).is_ok_and(|m| m.is_empty()) {
                        let n = read_text(&self.ctl, &gone, CTL_TIMEOUT).unwrap_or_default();
                        return Err(NodeError::Rendezvous(format!(
                            "node {}'s dtrun stopped answering (no heartbeat for {NODE_LOST:?}); \
                             still missing: {missing:?}",
                            clean(n.trim())
                        )));
                    }
                    if last_beat.elapsed() >= HEARTBEAT {
                        last_beat = Instant::now();
                        let _ = self.ctl.add(&format!("alive/{}", self.node_rank), 1);
                        if let Some(lost) = beats.poll(&self.ctl) {
                            return Err(NodeError::Rendezvous(format!(
                                "node {lost}'s dtrun stopped answering (no heartbeat for \
                                 {NODE_LOST:?}) before it recorded its end; still missing: \
                                 {missing:?}"
                            )));
                        }
                    }
                    if job_deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(NodeError::Rendezvous(format!(
                            "--timeout reached waiting for the other nodes to end: {missing:?}"
                        )));
                    }
                }
                Err(e) => return Err(store_err("waiting for the other nodes to end", e)),
            }
        }
        let mut ends = Vec::new();
        let mut reports = Vec::new();
        for n in 0..self.nnodes {
            let v = read_text(&self.ctl, &key(n), CTL_TIMEOUT)?;
            let mut l = v.lines();
            let code = l.next().and_then(|c| c.parse::<i32>().ok());
            let restartable = l.next().and_then(|c| c.parse::<u8>().ok());
            match (code, restartable) {
                (Some(code), Some(r)) if r <= 1 => ends.push(NodeEnd {
                    code,
                    restartable: r == 1,
                }),
                _ => {
                    return Err(NodeError::Rendezvous(format!(
                        "malformed record {:?}: {:?}",
                        key(n),
                        clean(&v)
                    )))
                }
            }
            let rkey = format!("gen/{gen}/report/{n}");
            if self
                .ctl
                .check(&[rkey.as_str()])
                .map_err(|e| store_err("reading the reports", e))?
                .is_empty()
            {
                let v = read_text(&self.ctl, &rkey, CTL_TIMEOUT)?;
                let mut l = v.splitn(4, '\n');
                let killed = l.next().map(|k| k == "1").unwrap_or(false);
                let code = l.next().and_then(|c| c.parse::<i32>().ok()).unwrap_or(1);
                let seq = l
                    .next()
                    .and_then(|c| c.parse::<i64>().ok())
                    .unwrap_or(i64::MAX);
                let what = clean(l.next().unwrap_or("(no reason given)"));
                reports.push((
                    n,
                    Report {
                        killed,
                        code,
                        what,
                        seq,
                    },
                ));
            }
        }
        // Node 0 keeps its store up until every node has read the records (bounded).
        let left = format!("gen/{gen}/read");
        let _ = self.ctl.add(&left, 1);
        if self.node_rank == 0 {
            let until = Instant::now() + CTL_TIMEOUT;
            while Instant::now() < until
                && self.ctl.add(&left, 0).unwrap_or(0) < i64::from(self.nnodes)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok((ends, reports))
    }
}

/// Stops the watcher thread when dropped.
pub(crate) struct Watcher {
    stop: Arc<AtomicBool>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The other nodes' heartbeat counters and when each last moved.
struct Heartbeats {
    seen: Vec<(u32, Option<Vec<u8>>, Instant)>,
}

impl Heartbeats {
    fn new(nnodes: u32, me: u32) -> Heartbeats {
        Heartbeats {
            seen: (0..nnodes)
                .filter(|&n| n != me)
                .map(|n| (n, None, Instant::now()))
                .collect(),
        }
    }

    /// Reads every other node's counter; returns a node whose counter has not moved for
    /// [`NODE_LOST`].
    fn poll(&mut self, ctl: &TcpStore) -> Option<u32> {
        for (n, last, since) in &mut self.seen {
            let key = format!("alive/{n}");
            let now = match ctl.check(&[key.as_str()]) {
                Ok(m) if m.is_empty() => ctl.get(&key).ok(),
                _ => None,
            };
            if now.is_some() && now != *last {
                *last = now;
                *since = Instant::now();
            } else if since.elapsed() >= NODE_LOST {
                return Some(*n);
            }
        }
        None
    }
}

/// Checks the settings of the first `me.nnodes` arrivals (node 0) as they arrive: the first
/// disagreement is an error at once; all of them in time, `Ok`; else an error at `deadline`
/// listing who came. The error names the node(s), the setting and the values seen.
fn check_nodes(ctl: &TcpStore, me: &Settings, deadline: Instant) -> Result<(), String> {
    let n = me.nnodes;
    let started = Instant::now();
    let mut all: Vec<Settings> = Vec::new();
    loop {
        let count = ctl
            .add("join/count", 0)
            .map_err(|e| format!("waiting for the nodes to join: {e}"))?;
        while (all.len() as i64) < count.min(i64::from(n)) {
            let k = format!("join/{}", all.len() + 1);
            let v = read_text(ctl, &k, CTL_TIMEOUT).map_err(|e| e.to_string())?;
            all.push(Settings::decode(&k, v.as_bytes()).map_err(|e| e.to_string())?);
        }
        let errors = disagreements(&all, me);
        if !errors.is_empty() {
            return Err(errors.join("; "));
        }
        if all.len() as u32 >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "only {} of {n} nodes (--nnodes {n} on node 0) joined within --rdzv-timeout \
                 {:?}: {}; a node whose job token differs is refused by the control store (see \
                 the warnings above), one with another --master-addr or --master-port never \
                 arrives",
                all.len(),
                deadline.saturating_duration_since(started),
                all.iter().map(|s| s.who()).collect::<Vec<_>>().join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What is wrong with the settings of the nodes that joined, against node 0's (`me`).
fn disagreements(all: &[Settings], me: &Settings) -> Vec<String> {
    let n = me.nnodes;
    let mut errors = Vec::new();
    for s in all {
        if s.node_rank >= n {
            errors.push(format!(
                "{}: --node-rank {} is out of range for --nnodes {n} (node ranks 0..{})",
                s.who(),
                s.node_rank,
                n - 1
            ));
        }
    }
    for r in 0..n {
        let same: Vec<String> = all
            .iter()
            .filter(|s| s.node_rank == r)
            .map(|s| s.who())
            .collect();
        if same.len() > 1 {
            errors.push(format!(
                "--node-rank {r} is given to {} nodes: {}",
                same.len(),
                same.join(", ")
            ));
        }
    }
    let setting = |name: &str, get: fn(&Settings) -> u32| -> Option<String> {
        (!all.iter().all(|s| get(s) == get(me))).then(|| {
            format!(
                "the nodes disagree on {name}: {}",
                all.iter()
                    .map(|s| format!("{} has {}", s.who(), get(s)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    };
    errors.extend(setting("--nnodes", |s| s.nnodes));
    errors.extend(setting("--nproc-per-node", |s| s.nproc_per_node));
    errors
}

/// The job token of a multi-node job: `--token-file` (its first line), else `CDT_JOB_TOKEN`.
pub(crate) fn shared_token(token_file: Option<&std::path::Path>) -> Result<String, NodeError> {
    let t = match token_file {
        Some(p) => {
            let meta = std::fs::metadata(p)
                .map_err(|e| NodeError::Config(format!("--token-file {}: {e}", p.display())))?;
            if meta.len() > MAX_VALUE as u64 {
                return Err(NodeError::Config(format!(
                    "--token-file {}: {} bytes, more than a token's {MAX_VALUE}",
                    p.display(),
                    meta.len()
                )));
            }
            let s = std::fs::read_to_string(p)
                .map_err(|e| NodeError::Config(format!("--token-file {}: {e}", p.display())))?;
            s.lines().next().unwrap_or("").trim().to_string()
        }
        None => std::env::var("CDT_JOB_TOKEN").unwrap_or_default(),
    };
    if t.is_empty() {
        return Err(NodeError::Config(
            "a multi-node job needs a job token shared by every node: set CDT_JOB_TOKEN or pass \
             --token-file PATH (the same on every node, e.g. from `openssl rand -hex 32`), or \
             run with --insecure"
                .into(),
        ));
    }
    if t.len() < 16 {
        return Err(NodeError::Config(format!(
            "the job token is {} characters long; use at least 16 (e.g. `openssl rand -hex 32`)",
            t.len()
        )));
    }
    Ok(t)
}

/// A new `Settings` for this node.
pub(crate) fn settings(node_rank: u32, nnodes: u32, nproc_per_node: u32) -> Settings {
    Settings {
        node_rank,
        nnodes,
        nproc_per_node,
        host: host_name(),
        addr: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_round_trip_and_reject_garbage() {
        let s = Settings {
            node_rank: 1,
            nnodes: 2,
            nproc_per_node: 4,
            host: "h\u{1b}[31m".into(),
            addr: "10.0.0.2".into(),
        };
        let d = Settings::decode("k", s.encode().as_bytes()).unwrap();
        assert_eq!(d.host, "h[31m");
        assert_eq!((d.node_rank, d.nnodes, d.nproc_per_node), (1, 2, 4));
        assert!(Settings::decode("k", b"node_rank=x\n").is_err());
        assert!(Settings::decode("k", &[0xff, 0xfe]).is_err());
    }
}
