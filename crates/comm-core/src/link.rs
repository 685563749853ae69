//! A modeled network for the local backend: each collective takes at least
//! `alpha + wire_bytes / bandwidth`, the alpha-beta formula of the strategies' cost model with
//! the nccl-tests bus factors (`wire_bytes` per rank: all_reduce `2(n-1)/n S`, all_gather,
//! reduce_scatter and all_to_all `(n-1)/n S`, S the larger of input and output).
//!
//! CPU ranks of one process copy at memory speed, so communication is nearly free next to
//! their compute; a link model makes them behave like ranks on a given network. The progress
//! thread of the communicator runs the op, then sleeps (never spins) for what is left of the
//! modeled time, so ops queued behind it on the same communicator wait as they would behind a
//! busy link, while other communicators progress independently.
//!
//! One rank's link is shared: a communicator split (or shrunk) from a paced one, with no link
//! of its own in the hints, runs over its parent's [`Link`], and collectives in flight on both
//! at once share its bandwidth fairly (processor sharing: k transfers each get 1/k of it), as
//! two NCCL communicators over the same NIC do. FSDP's separate reduce-scatter communicator is
//! such a split: it can overlap gathers, but it does not get a second network for free. A
//! split whose name has its own hints (`link.dp_rs.gbps`) gets a separate link (another rail).
//!
//! Set through communicator hints (inherited by every communicator split from it):
//! `link.gbps` / `link.alpha_us` for every communicator, `link.<name>.gbps` /
//! `link.<name>.alpha_us` for the communicator named `<name>` (a `DeviceMesh` names each mesh
//! dim's communicator after the dim), which wins. [`parse_link_spec`] reads the
//! `dp=20us:0.2GBps,tp=2us:5GBps` form and [`link_hints`] turns it into hints.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::vocab::OpName;

/// One modeled link: a fixed latency per collective and a bandwidth per rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Latency per collective, in microseconds (alpha).
    pub alpha_us: f64,
    /// Bandwidth per rank, in GB/s (10^9 bytes per second); positive and finite.
    pub gbps: f64,
}

/// A link spec or hint that cannot be used; says which dim (or hint) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("link model for {dim:?}: {reason}")]
pub struct LinkError {
    /// The mesh dim (or communicator) the bad entry is for; empty when it names none.
    pub dim: String,
    /// What is wrong.
    pub reason: String,
}

fn err(dim: &str, reason: impl Into<String>) -> LinkError {
    LinkError {
        dim: dim.to_string(),
        reason: reason.into(),
    }
}

/// Named links (`dp=ib`): `(name, alpha_us, GB/s per rank, what it stands for)`. Round figures
/// of the class of hardware, not measurements: a GPU's NCCL bus bandwidth over the link, and a
/// typical per-collective latency.
pub const PRESETS: [(&str, f64, f64, &str); 4] = [
    (
        "nvlink",
        3.0,
        360.0,
        "NVLink 4 within an 8-GPU H100/H200 node (NCCL bus bandwidth about 360 GB/s)",
    ),
    (
        "ib",
        10.0,
        45.0,
        "InfiniBand NDR, one 400 Gb/s port per GPU (about 45 GB/s bus bandwidth)",
    ),
    (
        "roce",
        20.0,
        22.0,
        "RoCE / 200 Gb/s Ethernet per GPU (about 22 GB/s bus bandwidth)",
    ),
    (
        "ethernet",
        50.0,
        1.1,
        "10 Gb/s Ethernet shared by the node (about 1.1 GB/s)",
    ),
];

/// Peak dense BF16 tensor-core rate of one H100/H200 SXM GPU (NVIDIA's datasheet figure
/// without sparsity), the GPU [`link_scale_for`] compares this machine with.
pub const GPU_REFERENCE_FLOPS: f64 = 989e12;

/// The factor that makes this machine's compute : communication ratio that of a GPU cluster:
/// a GPU computes `GPU_REFERENCE_FLOPS / cpu_flops` times faster than this machine, so a link
/// scaled by that factor ([`LinkModel::scaled`]) stands to these ranks as the real link stands
/// to GPUs. `cpu_flops` is what one rank measured (e.g. a matmul's rate).
pub fn link_scale_for(cpu_flops: f64) -> Result<f64, LinkError> {
    if !(cpu_flops.is_finite() && cpu_flops > 0.0) {
        return Err(err(
            "",
            format!("link scale: the measured compute rate must be positive, got {cpu_flops}"),
        ));
    }
    Ok((GPU_REFERENCE_FLOPS / cpu_flops).max(1.0))
}

impl LinkModel {
    /// The preset named `name` ([`PRESETS`]), if there is one.
    pub fn preset(name: &str) -> Option<LinkModel> {
        PRESETS
            .iter()
            .find(|p| p.0 == name)
            .map(|&(_, alpha_us, gbps, _)| LinkModel { alpha_us, gbps })
    }

    /// This link slowed down `factor` times (latency times `factor`, bandwidth divided by it),
    /// so that ranks that compute `factor` times slower than the hardware it models see the
    /// same compute : communication ratio. `factor` must be positive and finite.
    pub fn scaled(&self, dim: &str, factor: f64) -> Result<LinkModel, LinkError> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(err(
                dim,
                format!("link scale must be positive, got {factor}"),
            ));
        }
        LinkModel::new(dim, self.alpha_us * factor, self.gbps / factor)
    }

    /// A link of `alpha_us` latency and `gbps` bandwidth; refuses a bandwidth that is not
    /// positive and finite or a latency that is negative or not finite (`dim` names it).
    pub fn new(dim: &str, alpha_us: f64, gbps: f64) -> Result<LinkModel, LinkError> {
        if !(gbps.is_finite() && gbps > 0.0) {
            return Err(err(
                dim,
                format!("bandwidth must be positive, got {gbps} GB/s"),
            ));
        }
        if !(alpha_us.is_finite() && alpha_us >= 0.0) {
            return Err(err(dim, format!("latency must be >= 0, got {alpha_us} us")));
        }
        Ok(LinkModel { alpha_us, gbps })
    }

    /// The modeled time of collective `op` over `n` ranks whose larger buffer (input or
    /// output) has `bytes` bytes, on an otherwise idle link; `None` for ops the model does not
    /// pace (point-to-point, barriers, setup) and for groups of one.
    pub fn time(&self, op: OpName, bytes: usize, n: usize) -> Option<Duration> {
        let wire = wire_bytes(op, bytes, n)?;
        let us = self.alpha_us + wire / (self.gbps * 1e3);
        Some(Duration::from_secs_f64(us / 1e6))
    }

    /// The bytes each rank puts on the wire for `op` (see the module docs), `None` where the
    /// model does not pace it.
    pub fn wire_bytes(&self, op: OpName, bytes: usize, n: usize) -> Option<f64> {
        wire_bytes(op, bytes, n)
    }

    /// The link of the communicator named `name` from `hints` (see the module docs), `None`
    /// when no bandwidth is set for it.
    pub fn from_hints(
        hints: &BTreeMap<String, String>,
        name: &str,
    ) -> Result<Option<LinkModel>, LinkError> {
        let get = |key: &str| -> Result<Option<f64>, LinkError> {
            let specific = format!("link.{name}.{key}");
            let general = format!("link.{key}");
            let (k, v) = match (hints.get(&specific), hints.get(&general)) {
                (Some(v), _) => (specific, v),
                (None, Some(v)) => (general, v),
                (None, None) => return Ok(None),
            };
            v.trim()
                .parse::<f64>()
                .map(Some)
                .map_err(|_| err(name, format!("hint {k}={v:?} is not a number")))
        };
        match (get("gbps")?, get("alpha_us")?) {
            (Some(gbps), alpha) => LinkModel::new(name, alpha.unwrap_or(0.0), gbps).map(Some),
            (None, Some(_)) => Err(err(name, "link.alpha_us is set but no link.gbps")),
            (None, None) => Ok(None),
        }
    }
}

/// One rank's end of a modeled link, shared by every communicator over it (see the module
/// docs). Transfers in flight share the bandwidth equally; each collective also pays the
/// latency once.
#[derive(Debug)]
pub struct Link {
    model: LinkModel,
    state: Mutex<LinkState>,
}

#[derive(Debug)]
struct LinkState {
    /// When `active` was last advanced.
    last: Instant,
    /// Transfers in flight: (id, wire bytes still to move).
    active: Vec<(u64, f64)>,
    /// Transfers whose bytes have all moved, and when they got through.
    finished: HashMap<u64, Instant>,
    next_id: u64,
}

/// A transfer started with [`Link::begin`]; [`Link::finish`] waits for it.
#[derive(Debug)]
#[must_use = "a transfer occupies the link until finished or cancelled"]
pub struct Transfer {
    id: u64,
}

impl LinkState {
    /// Moves the active transfers forward to `now` at `bytes_per_s` shared equally, recording
    /// when each one completes.
    fn advance(&mut self, now: Instant, bytes_per_s: f64) {
        let mut t = self.last;
        let mut budget = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        while budget > 0.0 && !self.active.is_empty() {
            let k = self.active.len() as f64;
            let least = self
                .active
                .iter()
                .map(|a| a.1)
                .fold(f64::INFINITY, f64::min);
            let until_first = least * k / bytes_per_s;
            if until_first <= budget {
                t += Duration::from_secs_f64(until_first);
                budget -= until_first;
                for a in &mut self.active {
                    a.1 -= least;
                }
                let finished = &mut self.finished;
                self.active.retain(|&(id, rem)| {
                    let done = rem <= 1e-9;
                    if done {
                        finished.insert(id, t);
                    }
                    !done
                });
            } else {
                let each = budget * bytes_per_s / k;
                for a in &mut self.active {
                    a.1 -= each;
                }
                budget = 0.0;
            }
        }
    }

    /// The earliest `id` can complete if nothing else starts: under equal sharing every
    /// transfer moves at the same rate, so `id` is done once each other transfer has moved
    /// the smaller of its own remainder and `id`'s.
    fn earliest_end(&self, id: u64, bytes_per_s: f64) -> Option<Duration> {
        let mine = self.active.iter().find(|a| a.0 == id)?.1;
        let ahead: f64 = self.active.iter().map(|a| a.1.min(mine)).sum();
        Some(Duration::from_secs_f64(ahead / bytes_per_s))
    }
}

impl Link {
    /// A link of `model`, idle.
    pub fn new(model: LinkModel) -> Arc<Link> {
        Arc::new(Link {
            model,
            state: Mutex::new(LinkState {
                last: Instant::now(),
                active: Vec::new(),
                finished: HashMap::new(),
                next_id: 0,
            }),
        })
    }

    /// The model this link paces to.
    pub fn model(&self) -> LinkModel {
        self.model
    }

    fn bytes_per_s(&self) -> f64 {
        self.model.gbps * 1e9
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts moving `wire` bytes now (the collective's data path runs meanwhile).
    pub fn begin(&self, wire: f64) -> Transfer {
        let now = Instant::now();
        let mut st = self.lock();
        st.advance(now, self.bytes_per_s());
        let id = st.next_id;
        st.next_id += 1;
        if wire > 0.0 {
            st.active.push((id, wire));
        } else {
            st.finished.insert(id, now);
        }
        Transfer { id }
    }

    /// Sleeps (never spins) until `t`'s bytes have got through the shared link and the
    /// latency has passed since: an idle link makes that `alpha + wire / bandwidth` after
    /// [`Link::begin`]. Wakes once per transfer that starts meanwhile, at most.
    pub fn finish(&self, t: Transfer) {
        let alpha = Duration::from_secs_f64(self.model.alpha_us / 1e6);
        loop {
            let now = Instant::now();
            let wait = {
                let mut st = self.lock();
                st.advance(now, self.bytes_per_s());
                match st.finished.remove(&t.id) {
                    Some(done) => {
                        drop(st);
                        let end = done + alpha;
                        std::thread::sleep(end.saturating_duration_since(Instant::now()));
                        return;
                    }
                    None => st
                        .earliest_end(t.id, self.bytes_per_s())
                        .unwrap_or(Duration::ZERO),
                }
            };
            // Transfers that start meanwhile only push the end later: wake at the earliest
            // end, then look again. A floor keeps float residue from waking in a loop.
            std::thread::sleep(wait.max(Duration::from_micros(20)));
        }
    }

    /// Drops `t` from the link at once (its collective failed).
    pub fn cancel(&self, t: Transfer) {
        let mut st = self.lock();
        st.advance(Instant::now(), self.bytes_per_s());
        st.active.retain(|a| a.0 != t.id);
        st.finished.remove(&t.id);
    }
}

/// Bytes each rank puts on the wire (nccl-tests bus factors; `bytes` is S), `None` for ops the
/// model does not pace and groups of one.
fn wire_bytes(op: OpName, bytes: usize, n: usize) -> Option<f64> {
    if n <= 1 {
        return None;
    }
    let frac = (n - 1) as f64 / n as f64;
    let s = bytes as f64;
    match op {
        OpName::AllReduce => Some(2.0 * frac * s),
        OpName::AllGatherSingle
        | OpName::ReduceScatterSingle
        | OpName::AllToAllSingle
        | OpName::AllToAllVSingle
        | OpName::Broadcast
        | OpName::Reduce
        | OpName::Gather
        | OpName::Scatter => Some(frac * s),
        _ => None,
    }
}

/// Parses `dim=ALPHA:BANDWIDTH[,dim=...]`, e.g. `dp=20us:0.2GBps,tp=2us:5GBps`. ALPHA takes
/// `ns`, `us` or `ms`; BANDWIDTH `GBps` (10^9 bytes/s) or `MBps`. Instead of ALPHA:BANDWIDTH a
/// dim may name a preset of [`PRESETS`] (`dp=ib,tp=nvlink`). A dim may appear once.
pub fn parse_link_spec(spec: &str) -> Result<Vec<(String, LinkModel)>, LinkError> {
    let mut out: Vec<(String, LinkModel)> = Vec::new();
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (dim, value) = entry
            .split_once('=')
            .ok_or_else(|| err("", format!("{entry:?} is not dim=ALPHA:BANDWIDTH")))?;
        let dim = dim.trim();
        if dim.is_empty() {
            return Err(err("", format!("{entry:?} names no dim")));
        }
        if out.iter().any(|(d, _)| d == dim) {
            return Err(err(dim, "given twice"));
        }
        if let Some(preset) = LinkModel::preset(value.trim()) {
            out.push((dim.to_string(), preset));
            continue;
        }
        let (alpha, bw) = value.split_once(':').ok_or_else(|| {
            err(
                dim,
                format!(
                    "{value:?} is not ALPHA:BANDWIDTH (e.g. 20us:0.2GBps) or a preset ({})",
                    PRESETS.map(|p| p.0).join(", ")
                ),
            )
        })?;
        let alpha_us = parse_unit(
            dim,
            alpha,
            &[("ns", 1e-3), ("us", 1.0), ("ms", 1e3)],
            "latency",
        )?;
        let gbps = parse_unit(dim, bw, &[("GBps", 1.0), ("MBps", 1e-3)], "bandwidth")?;
        out.push((dim.to_string(), LinkModel::new(dim, alpha_us, gbps)?));
    }
    if out.is_empty() {
        return Err(err("", "empty link spec"));
    }
    Ok(out)
}

fn parse_unit(dim: &str, text: &str, units: &[(&str, f64)], what: &str) -> Result<f64, LinkError> {
    let text = text.trim();
    for (unit, scale) in units {
        if let Some(num) = text.strip_suffix(unit) {
            return num
                .trim()
                .parse::<f64>()
                .map(|v| v * scale)
                .map_err(|_| err(dim, format!("{what} {text:?} is not a number with a unit")));
        }
    }
    let names: Vec<&str> = units.iter().map(|(u, _)| *u).collect();
    Err(err(
        dim,
        format!("{what} {text:?} needs a unit ({})", names.join(", ")),
    ))
}

/// The communicator hints that give each named dim its link (`link.<dim>.alpha_us`,
/// `link.<dim>.gbps`).
pub fn link_hints(links: &[(String, LinkModel)]) -> Vec<(String, String)> {
    links
        .iter()
        .flat_map(|(dim, l)| {
            [
                (format!("link.{dim}.alpha_us"), l.alpha_us.to_string()),
                (format!("link.{dim}.gbps"), l.gbps.to_string()),
            ]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parses_and_bad_input_names_the_dim() {
        let l = parse_link_spec("dp=20us:0.2GBps, tp=2us:5GBps").unwrap();
        assert_eq!(
            l[0],
            (
                "dp".to_string(),
                LinkModel {
                    alpha_us: 20.0,
                    gbps: 0.2
                }
            )
        );
        assert_eq!(
            l[1],
            (
                "tp".to_string(),
                LinkModel {
                    alpha_us: 2.0,
                    gbps: 5.0
                }
            )
        );
        let ms = parse_link_spec("x=1ms:500MBps").unwrap();
        assert_eq!(
            ms[0].1,
            LinkModel {
                alpha_us: 1000.0,
                gbps: 0.5
            }
        );
        for (bad, dim, needle) in [
            ("dp=20us:0GBps", "dp", "positive"),
            ("tp=20us:-1GBps", "tp", "positive"),
            ("dp=20us", "dp", "ALPHA:BANDWIDTH"),
            ("dp=20:1GBps", "dp", "unit"),
            ("dp=xus:1GBps", "dp", "not a number"),
            ("dp=-3us:1GBps", "dp", ">= 0"),
            ("dp=1us:1GBps,dp=2us:1GBps", "dp", "twice"),
            ("20us:1GBps", "", "dim=ALPHA"),
            ("dp=infiniband", "dp", "preset"),
            ("dp=ib,dp=nvlink", "dp", "twice"),
            ("", "", "empty"),
        ] {
            let e = parse_link_spec(bad).unwrap_err();
            assert_eq!(e.dim, dim, "{bad}: {e}");
            assert!(e.to_string().contains(needle), "{bad}: {e}");
        }
    }

    /// The sharing arithmetic on a made-up clock: two equal transfers started together end
    /// together at twice the time of one; a small one started during a big one ends after
    /// twice its own bytes' time, and the big one is delayed by exactly the small one's bytes.
    #[test]
    fn equal_sharing_is_work_conserving() {
        let bw = 1e6; // bytes per second
        let t0 = Instant::now();
        let mut st = LinkState {
            last: t0,
            active: vec![(0, 1e6), (1, 1e6)],
            finished: HashMap::new(),
            next_id: 2,
        };
        assert_eq!(st.earliest_end(0, bw), Some(Duration::from_secs(2)));
        st.advance(t0 + Duration::from_millis(1999), bw);
        assert!(st.finished.is_empty());
        st.advance(t0 + Duration::from_secs(3), bw);
        for id in [0, 1] {
            let end = st.finished[&id].duration_since(t0).as_secs_f64();
            assert!((end - 2.0).abs() < 1e-6, "{end}");
        }
        // A big transfer of 4 s alone; a 1 s one joins at 1 s: it gets half the link, ends at
        // 3 s; the big one ends at 5 s (4 s of its bytes plus 1 s of the small one's).
        let mut st = LinkState {
            last: t0,
            active: vec![(0, 4e6)],
            finished: HashMap::new(),
            next_id: 1,
        };
        st.advance(t0 + Duration::from_secs(1), bw);
        st.active.push((1, 1e6));
        assert_eq!(st.earliest_end(1, bw), Some(Duration::from_secs(2)));
        st.advance(t0 + Duration::from_secs(10), bw);
        let end = |id| st.finished[&id].duration_since(t0).as_secs_f64();
        assert!((end(1) - 3.0).abs() < 1e-6, "{}", end(1));
        assert!((end(0) - 5.0).abs() < 1e-6, "{}", end(0));
    }

    /// On the real clock: an idle link takes at least alpha + bytes/bandwidth; two transfers
    /// at once on one link take at least twice the bandwidth time.
    #[test]
    fn shared_link_sleeps_for_the_shared_time() {
        let link = Link::new(LinkModel::new("x", 1000.0, 0.001).unwrap()); // 1 MB/s, 1 ms
        let t0 = Instant::now();
        link.finish(link.begin(20_000.0)); // 20 ms + 1 ms
        assert!(t0.elapsed() >= Duration::from_millis(21));
        let t0 = Instant::now();
        let (a, b) = (link.begin(20_000.0), link.begin(20_000.0));
        std::thread::scope(|s| {
            s.spawn(|| link.finish(a));
            s.spawn(|| link.finish(b));
        });
        assert!(
            t0.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t0.elapsed()
        );
        let t = link.begin(1e9);
        link.cancel(t);
        assert!(link.lock().active.is_empty());
    }

    #[test]
    fn presets_and_scaling() {
        let l = parse_link_spec("dp=ib,tp=nvlink,pp=1us:2GBps").unwrap();
        assert_eq!(l[0].1, LinkModel::preset("ib").unwrap());
        assert_eq!(l[1].1.gbps, 360.0);
        assert_eq!(l[2].1.gbps, 2.0);
        for (name, alpha, gbps, what) in PRESETS {
            let p = LinkModel::preset(name).unwrap();
            assert_eq!((p.alpha_us, p.gbps), (alpha, gbps));
            assert!(!what.is_empty());
        }
        let s = l[0].1.scaled("dp", 1000.0).unwrap();
        assert_eq!((s.alpha_us, s.gbps), (10_000.0, 0.045));
        // Scaling keeps the modeled time proportional: 1000x slower link, 1000x the time.
        let a = l[0].1.time(OpName::AllGatherSingle, 1 << 20, 4).unwrap();
        let b = s.time(OpName::AllGatherSingle, 1 << 20, 4).unwrap();
        assert!((b.as_secs_f64() / a.as_secs_f64() / 1000.0 - 1.0).abs() < 1e-4);
        for bad in [0.0, -2.0, f64::NAN, f64::INFINITY] {
            let e = l[0].1.scaled("dp", bad).unwrap_err();
            assert_eq!(e.dim, "dp");
        }
        let f = link_scale_for(1e11).unwrap();
        assert!((f - 9890.0).abs() < 1e-6);
        assert_eq!(link_scale_for(1e15).unwrap(), 1.0);
        assert!(link_scale_for(0.0).is_err());
    }

    #[test]
    fn hints_round_trip_and_time_follows_the_bus_factors() {
        let links = parse_link_spec("dp=20us:0.2GBps").unwrap();
        let hints: BTreeMap<String, String> = link_hints(&links).into_iter().collect();
        let dp = LinkModel::from_hints(&hints, "dp").unwrap().unwrap();
        assert_eq!(dp, links[0].1);
        assert_eq!(LinkModel::from_hints(&hints, "tp").unwrap(), None);
        // 1 MB all_gather on 4 ranks: 20 us + 0.75 MB / 0.2 GB/s = 3770 us.
        let t = dp.time(OpName::AllGatherSingle, 1_000_000, 4).unwrap();
        assert!((t.as_secs_f64() * 1e6 - 3770.0).abs() < 1e-6);
        let t = dp.time(OpName::AllReduce, 1_000_000, 4).unwrap();
        assert!((t.as_secs_f64() * 1e6 - 7520.0).abs() < 1e-6);
        assert_eq!(dp.time(OpName::AllReduce, 1_000_000, 1), None);
        assert_eq!(dp.time(OpName::Barrier, 0, 4), None);
        // General hints apply to every communicator; specific ones win; bad values name it.
        let mut h = BTreeMap::new();
        h.insert("link.gbps".to_string(), "1".to_string());
        h.insert("link.tp.gbps".to_string(), "4".to_string());
        assert_eq!(LinkModel::from_hints(&h, "dp").unwrap().unwrap().gbps, 1.0);
        assert_eq!(LinkModel::from_hints(&h, "tp").unwrap().unwrap().gbps, 4.0);
        h.insert("link.tp.gbps".to_string(), "fast".to_string());
        let e = LinkModel::from_hints(&h, "tp").unwrap_err();
        assert_eq!(e.dim, "tp");
        h.insert("link.tp.gbps".to_string(), "0".to_string());
        assert!(LinkModel::from_hints(&h, "tp").is_err());
    }
}
