//! Where the flash-attention kernels find each operand's rows: `FaRows` of
//! `cuda/flash_attn.cu`, field for field, and the checks that make a launch with them stay in
//! bounds and write every element at most once. One file, compiled into the CUDA launchers
//! (`cuda.rs`) and into the emulator's wrappers (`kernels-emu`, by path), so the two check the
//! same things.
//!
//! An operand holds `bh` heads of `t` rows of `d` contiguous elements. Head `bh = b heads + h`
//! starts at element `off + b sb + h sh` of its buffer, and its row `i` at that `+ i st`. A
//! contiguous `[BH, T, d]` is [`FaRows::contiguous`]; q, k and v as the three parts of a packed
//! projection `[B, T, H, 3, d]`, and an output written as `[B, T, H, d]`, are
//! [`FaRows::interleaved`]: no copy unpacks the projection or transposes the output.

/// The largest row stride, exclusive (`FA_TC_MAX_LD` of the kernels): offsets within a tile of
/// rows are 32-bit there.
pub const MAX_ROW_STRIDE: i64 = 1 << 24;

/// The rows of one operand (see the module docs). `#[repr(C)]`: passed to the kernels by value
/// (four `long long` and an `int`, 40 bytes with the tail padding C gives it too).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaRows {
    /// Element of head 0's row 0.
    pub off: i64,
    /// Elements from batch `b` to `b + 1`.
    pub sb: i64,
    /// Elements from head `h` to `h + 1` within a batch.
    pub sh: i64,
    /// Elements from row `i` to `i + 1`.
    pub st: i64,
    /// Heads a batch (`bh` is a multiple of it).
    pub heads: i32,
}

// The kernels' struct is 40 bytes (four 8-byte fields, an int, 4 bytes of tail padding);
// `flash_attn.cu` asserts the same of its own.
const _: () = assert!(std::mem::size_of::<FaRows>() == 40 && std::mem::align_of::<FaRows>() == 8);

impl FaRows {
    /// A contiguous `[bh, t, d]`.
    pub fn contiguous(t: usize, d: usize) -> Self {
        FaRows {
            off: 0,
            sb: (t * d) as i64,
            sh: 0,
            st: d as i64,
            heads: 1,
        }
    }

    /// Part `part` of `parts` interleaved per head and row: `[B, T, H, parts, d]` contiguous,
    /// seen as `B H` heads of `T` rows (`parts` 3: q, k, v of a packed projection; 1: an
    /// output `[B, T, H, d]`).
    pub fn interleaved(t: usize, heads: usize, parts: usize, part: usize, d: usize) -> Self {
        let sh = parts * d;
        FaRows {
            off: (part * d) as i64,
            sb: (t * heads * sh) as i64,
            sh: sh as i64,
            st: (heads * sh) as i64,
            heads: heads as i32,
        }
    }

    /// The same rows `by` elements further into the buffer (a storage offset).
    pub fn shifted(self, by: usize) -> Self {
        FaRows {
            off: self.off + by as i64,
            ..self
        }
    }

    /// Every row of `bh` heads of `t` rows of `d` lies in a buffer of `len` elements: the
    /// fields are non-negative, `heads` divides `bh`, and the last element of the farthest row
    /// is below `len` (no arithmetic overflows). Empty operands (`bh`, `t` or `d` 0) read
    /// nothing and pass.
    pub fn check_in(
        &self,
        what: &str,
        bh: usize,
        t: usize,
        d: usize,
        len: usize,
    ) -> Result<(), String> {
        if self.off < 0 || self.sb < 0 || self.sh < 0 || self.st < 0 || self.heads < 1 {
            return Err(format!(
                "{what}: rows {self:?} with a negative field or no heads"
            ));
        }
        if self.st >= MAX_ROW_STRIDE {
            return Err(format!(
                "{what}: a row stride of {} elements (the kernels take strides below {MAX_ROW_STRIDE})",
                self.st
            ));
        }
        let heads = self.heads as usize;
        if bh % heads != 0 {
            return Err(format!("{what}: {bh} heads are not batches of {heads}"));
        }
        if bh == 0 || t == 0 || d == 0 {
            return Ok(());
        }
        let last = (|| {
            let b = (bh / heads - 1) as i64;
            let h = (heads - 1) as i64;
            let i = (t - 1) as i64;
            self.off
                .checked_add(b.checked_mul(self.sb)?)?
                .checked_add(h.checked_mul(self.sh)?)?
                .checked_add(i.checked_mul(self.st)?)?
                .checked_add(d as i64 - 1)
        })();
        match last {
            Some(e) if (e as u64) < len as u64 => Ok(()),
            Some(e) => Err(format!(
                "{what}: rows {self:?} of {bh} heads x {t} x {d} reach element {e} of a buffer of {len}"
            )),
            None => Err(format!("{what}: rows {self:?} of {bh} heads x {t} x {d} overflow")),
        }
    }

    /// The spans `(stride, count)` of the batch, head and row steps that move (count > 1),
    /// smallest stride first.
    fn steps(&self, bh: usize, t: usize) -> Vec<(i64, usize)> {
        let heads = self.heads.max(1) as usize;
        let mut s: Vec<(i64, usize)> = [(self.sb, bh / heads), (self.sh, heads), (self.st, t)]
            .into_iter()
            .filter(|&(_, n)| n > 1)
            .collect();
        s.sort_unstable();
        s
    }

    /// The elements `[off, off + extent)` the rows span, when no two rows overlap (each step at
    /// least the span of the steps below it, the smallest at least `d`); `None` otherwise.
    fn extent(&self, bh: usize, t: usize, d: usize) -> Option<i64> {
        let mut span = d as i64;
        for (stride, n) in self.steps(bh, t) {
            if stride < span {
                return None;
            }
            span = stride.checked_mul(n as i64 - 1)?.checked_add(span)?;
        }
        Some(span)
    }
}

/// The rows `outs` a launch writes into ONE buffer (each already [`FaRows::check_in`]) are
/// written once each: no two rows of one operand overlap, and the operands are disjoint,
/// either as element ranges or as the interleaved parts of one layout (the same steps, all
/// multiples of the smallest, the offsets' residues in disjoint `d`-wide slots of it: q, k and
/// v of a packed gradient). A sufficient condition, not a necessary one: what it refuses, the
/// launchers never build.
pub fn check_disjoint(
    what: &str,
    outs: &[FaRows],
    bh: usize,
    t: usize,
    d: usize,
) -> Result<(), String> {
    if bh == 0 || t == 0 || d == 0 {
        return Ok(());
    }
    let mut extents = Vec::with_capacity(outs.len());
    for o in outs {
        let e = o
            .extent(bh, t, d)
            .ok_or_else(|| format!("{what}: rows {o:?} of {bh} heads x {t} x {d} overlap"))?;
        extents.push((o.off, o.off + e));
    }
    for (x, a) in outs.iter().enumerate() {
        for (y, b) in outs.iter().enumerate().skip(x + 1) {
            let (ra, rb) = (extents[x], extents[y]);
            if ra.1 <= rb.0 || rb.1 <= ra.0 {
                continue;
            }
            let same = a.sb == b.sb && a.sh == b.sh && a.st == b.st && a.heads == b.heads;
            let steps = a.steps(bh, t);
            let slots = match steps.first().map(|s| s.0) {
                Some(p) if same && p > 0 => {
                    let all = steps.iter().all(|&(s, _)| s % p == 0);
                    let (ca, cb) = (a.off.rem_euclid(p), b.off.rem_euclid(p));
                    let fits = ca + d as i64 <= p && cb + d as i64 <= p;
                    let apart = ca + d as i64 <= cb || cb + d as i64 <= ca;
                    all && fits && apart
                }
                _ => false,
            };
            if !slots {
                return Err(format!(
                    "{what}: written rows {a:?} and {b:?} of {bh} heads x {t} x {d} may overlap"
                ));
            }
        }
    }
    Ok(())
}

/// Where a forward launch reads q, k, v (`rows[0..3]`, from buffers of `lens[0..3]` elements)
/// and writes o (`rows[3]`, a buffer of `lens[3]`): every row inside its buffer, o's rows
/// apart.
pub fn check_fwd(
    rows: &[FaRows; 4],
    (bh, tq, tk, d): (usize, usize, usize, usize),
    lens: [usize; 4],
) -> Result<(), String> {
    for (i, what) in ["q", "k", "v", "o"].into_iter().enumerate() {
        let t = if i == 1 || i == 2 { tk } else { tq };
        rows[i].check_in(what, bh, t, d, lens[i])?;
    }
    check_disjoint("o", &rows[3..], bh, tq, d)
}

/// Where a backward launch reads and writes each operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaBwdRows {
    /// Queries.
    pub q: FaRows,
    /// Keys.
    pub k: FaRows,
    /// Values.
    pub v: FaRows,
    /// The forward's output.
    pub o: FaRows,
    /// The output's gradient.
    pub d_o: FaRows,
    /// dQ, in the dQ buffer.
    pub dq: FaRows,
    /// dK, in the dK/dV buffer (the dQ buffer when there is none).
    pub dk: FaRows,
    /// dV, likewise.
    pub dv: FaRows,
}

impl FaBwdRows {
    /// Every operand a contiguous `[bh, t, d]` of its own buffer, dV's rows after dK's
    /// (`bh tk d` elements further) in one dK/dV buffer.
    pub fn contiguous(bh: usize, tq: usize, tk: usize, d: usize) -> Self {
        let (q, k) = (FaRows::contiguous(tq, d), FaRows::contiguous(tk, d));
        FaBwdRows {
            q,
            k,
            v: k,
            o: q,
            d_o: q,
            dq: q,
            dk: k,
            dv: k.shifted(bh * tk * d),
        }
    }
}

/// Where a backward launch reads q, k, v, o, d_o (buffers of `lens[0..5]` elements) and writes
/// dQ (a buffer of `lens[5]`) and dK, dV (a buffer of `dkv_len`, or, `None`, dQ's buffer,
/// which then needs tq = tk): every row inside its buffer, the rows written into one buffer
/// apart.
pub fn check_bwd(
    rows: &FaBwdRows,
    (bh, tq, tk, d): (usize, usize, usize, usize),
    lens: [usize; 6],
    dkv_len: Option<usize>,
) -> Result<(), String> {
    let dkv = dkv_len.unwrap_or(lens[5]);
    for (what, r, t, len) in [
        ("q", &rows.q, tq, lens[0]),
        ("k", &rows.k, tk, lens[1]),
        ("v", &rows.v, tk, lens[2]),
        ("o", &rows.o, tq, lens[3]),
        ("d_o", &rows.d_o, tq, lens[4]),
        ("dq", &rows.dq, tq, lens[5]),
        ("dk", &rows.dk, tk, dkv),
        ("dv", &rows.dv, tk, dkv),
    ] {
        r.check_in(what, bh, t, d, len)?;
    }
    if dkv_len.is_some() {
        check_disjoint("dq", &[rows.dq], bh, tq, d)?;
        check_disjoint("dk, dv", &[rows.dk, rows.dv], bh, tk, d)
    } else if tq != tk {
        Err(format!(
            "dq, dk and dv in one buffer need tq = tk, not {tq} and {tk}"
        ))
    } else {
        check_disjoint("dq, dk, dv", &[rows.dq, rows.dk, rows.dv], bh, tq, d)
    }
}
