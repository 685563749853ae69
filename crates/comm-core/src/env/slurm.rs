//! Slurm's view of a launched world: `srun prog` (no dtrun) sets `SLURM_PROCID`,
//! `SLURM_NTASKS` (`SLURM_STEP_NUM_TASKS` for the step), `SLURM_LOCALID`, `SLURM_NODEID`,
//! `SLURM_STEP_TASKS_PER_NODE` and the node list, from which the rendezvous store's address is
//! derived when `MASTER_ADDR` / `MASTER_PORT` are not set: the first host of
//! `SLURM_JOB_NODELIST` (Slurm's compressed form, e.g. `gpu[01-04,07],cpu5`) and a port from
//! the job id (`15000 + id % 10000`, so two jobs sharing a first node rarely collide; set
//! `MASTER_PORT` to choose).
//!
//! Only an srun step counts as launched (`SLURM_STEP_ID` set): a batch script's own shell has
//! `SLURM_PROCID=0` and the allocation's `SLURM_NTASKS`, and a program started there directly
//! would wait for ranks that never come.
//!
//! ```
//! use candle_dtensor::comm::env::slurm::{expand_nodelist, first_host};
//!
//! assert_eq!(first_host("gpu[01-04,07],cpu5")?, "gpu01");
//! assert_eq!(expand_nodelist("n[8-10]-ib,login", 16)?, ["n8-ib", "n9-ib", "n10-ib", "login"]);
//! # Ok::<(), String>(())
//! ```

/// The most hosts [`expand_nodelist`] returns when asked for all (a list like `n[0-99999999]`
/// is refused, not expanded).
pub const MAX_HOSTS: usize = 1 << 16;

/// One top-level item of a node list: `prefix[ranges]suffix` or a plain name.
struct Item<'a> {
    prefix: &'a str,
    ranges: Option<&'a str>,
    suffix: &'a str,
}

/// Splits `list` at the commas outside brackets.
fn items(list: &str) -> Result<Vec<Item<'_>>, String> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    let bytes = list.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'[' => {
                depth += 1;
                if depth > 1 {
                    return Err(format!("node list {list:?}: nested '[' at byte {i}"));
                }
            }
            b']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("node list {list:?}: ']' without '[' at byte {i}"))?;
            }
            b',' if depth == 0 => {
                out.push(item(list, &list[start..i])?);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("node list {list:?}: '[' never closed"));
    }
    out.push(item(list, &list[start..])?);
    Ok(out)
}

fn item<'a>(list: &str, s: &'a str) -> Result<Item<'a>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err(format!("node list {list:?}: an empty host name"));
    }
    match (s.find('['), s.find(']')) {
        (None, None) => Ok(Item {
            prefix: s,
            ranges: None,
            suffix: "",
        }),
        (Some(a), Some(b)) if a < b => {
            let suffix = &s[b + 1..];
            if suffix.contains('[') {
                return Err(format!(
                    "node list {list:?}: {s:?} has more than one bracket group (not supported)"
                ));
            }
            Ok(Item {
                prefix: &s[..a],
                ranges: Some(&s[a + 1..b]),
                suffix,
            })
        }
        _ => Err(format!("node list {list:?}: malformed brackets in {s:?}")),
    }
}

/// The numbers of one `a-b` or `a` range, each with the width of `a` (zero padding kept).
fn range(list: &str, r: &str) -> Result<(u64, u64, usize), String> {
    let bad = |why: &str| format!("node list {list:?}: range {r:?} {why}");
    let (lo, hi) = match r.split_once('-') {
        Some((lo, hi)) => (lo.trim(), hi.trim()),
        None => (r.trim(), r.trim()),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(lo) || !digits(hi) {
        return Err(bad("is not N or N-M with decimal N, M"));
    }
    let a: u64 = lo.parse().map_err(|_| bad("is too large"))?;
    let b: u64 = hi.parse().map_err(|_| bad("is too large"))?;
    if b < a {
        return Err(bad("runs backwards"));
    }
    Ok((a, b, lo.len()))
}

/// Every host of a Slurm node list, in order; at most `limit` (and [`MAX_HOSTS`]) of them.
///
/// # Errors
///
/// A malformed list (unbalanced or nested brackets, a range that is not `N` or `N-M`, an empty
/// name), or one of more hosts than the limit, each naming the list.
pub fn expand_nodelist(list: &str, limit: usize) -> Result<Vec<String>, String> {
    let limit = limit.min(MAX_HOSTS);
    let mut out = Vec::new();
    for it in items(list)? {
        let Some(ranges) = it.ranges else {
            out.push(it.prefix.to_string());
            if out.len() > limit {
                return Err(format!("node list {list:?} names more than {limit} hosts"));
            }
            continue;
        };
        for r in ranges.split(',') {
            let (a, b, width) = range(list, r)?;
            if (b - a) as u128 + out.len() as u128 >= limit as u128 {
                return Err(format!("node list {list:?} names more than {limit} hosts"));
            }
            for n in a..=b {
                out.push(format!("{}{n:0width$}{}", it.prefix, it.suffix));
            }
        }
    }
    Ok(out)
}

/// The first host of a Slurm node list (where rank 0 runs, so where the store is), without
/// expanding the rest.
///
/// # Errors
///
/// As [`expand_nodelist`], for the list's first item.
pub fn first_host(list: &str) -> Result<String, String> {
    let first = items(list)?
        .into_iter()
        .next()
        .ok_or_else(|| format!("node list {list:?} is empty"))?;
    match first.ranges {
        None => Ok(first.prefix.to_string()),
        Some(ranges) => {
            let r = ranges.split(',').next().unwrap_or_default();
            let (a, _, width) = range(list, r)?;
            Ok(format!("{}{a:0width$}{}", first.prefix, first.suffix))
        }
    }
}

/// The task count of node `node` in Slurm's `SLURM_STEP_TASKS_PER_NODE` form (`2(x3),1`: three
/// nodes of 2 tasks, then one of 1).
///
/// # Errors
///
/// A malformed list, or `node` beyond it, naming both.
pub fn tasks_on_node(tasks_per_node: &str, node: usize) -> Result<usize, String> {
    let bad = |why: String| format!("tasks per node {tasks_per_node:?}: {why}");
    let mut seen = 0usize;
    for part in tasks_per_node.split(',') {
        let part = part.trim();
        let (count, times) = match part.split_once("(x") {
            Some((c, rest)) => {
                let t = rest
                    .strip_suffix(')')
                    .ok_or_else(|| bad(format!("{part:?} lacks ')'")))?;
                (c, t)
            }
            None => (part, "1"),
        };
        let count: usize = count
            .parse()
            .map_err(|_| bad(format!("{part:?} is not N or N(xK)")))?;
        let times: usize = times
            .parse()
            .map_err(|_| bad(format!("{part:?} is not N or N(xK)")))?;
        if node < seen.saturating_add(times) {
            return Ok(count);
        }
        seen = seen.saturating_add(times);
    }
    Err(bad(format!("node {node} is beyond its {seen} nodes")))
}

/// The store port of Slurm job `job_id` when `MASTER_PORT` is not set: `15000 + id % 10000`.
pub fn port_of_job(job_id: u64) -> u16 {
    // 15000..=24999 fits u16.
    15000 + (job_id % 10000) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_expand_as_slurm_writes_them() {
        assert_eq!(expand_nodelist("a", 8).unwrap(), ["a"]);
        assert_eq!(
            expand_nodelist("gpu[01-04,07]", 8).unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
        );
        assert_eq!(
            expand_nodelist("gpu[8-11],cpu[005-006],login", 16).unwrap(),
            ["gpu8", "gpu9", "gpu10", "gpu11", "cpu005", "cpu006", "login"]
        );
        assert_eq!(expand_nodelist("n[1-2]-ib", 4).unwrap(), ["n1-ib", "n2-ib"]);
        assert_eq!(first_host("gpu[01-04,07],cpu5").unwrap(), "gpu01");
        assert_eq!(first_host("node17").unwrap(), "node17");
        assert_eq!(
            first_host("x[0-99999999999]").unwrap(),
            "x0",
            "not expanded"
        );
        for bad in [
            "", "a,,b", "a[1-2", "a]1", "a[[1]]", "a[2-1]", "a[x]", "a[1-]", "a[1]b[2]", "a[-3]",
        ] {
            assert!(expand_nodelist(bad, 8).is_err(), "{bad:?}");
        }
        assert!(first_host("a[").is_err());
        let e = expand_nodelist("n[0-99999999]", usize::MAX).unwrap_err();
        assert!(e.contains("more than 65536 hosts"), "{e}");
        assert!(expand_nodelist("a,b,c", 2).is_err());
    }

    #[test]
    fn tasks_per_node_and_ports() {
        assert_eq!(tasks_on_node("4", 0).unwrap(), 4);
        assert_eq!(tasks_on_node("2(x3),1", 2).unwrap(), 2);
        assert_eq!(tasks_on_node("2(x3),1", 3).unwrap(), 1);
        assert!(tasks_on_node("2(x3),1", 4).is_err());
        assert!(tasks_on_node("2(x3", 0).is_err());
        assert!(tasks_on_node("two", 0).is_err());
        assert_eq!(port_of_job(123_456), 18456);
        assert_eq!(port_of_job(u64::MAX), 15000 + (u64::MAX % 10000) as u16);
    }
}
