//! A tiny N-d array over `Vec<f64>` (row-major) with the ops the reference executor needs.

use candle_dtensor_strategies::shard_size_and_offset;

#[derive(Clone, Debug, PartialEq)]
pub struct Arr {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Iterates all multi-indices of `shape` in row-major order.
pub fn for_each_index(shape: &[usize], mut f: impl FnMut(&[usize])) {
    if shape.contains(&0) {
        return;
    }
    let mut idx = vec![0; shape.len()];
    loop {
        f(&idx);
        let mut d = shape.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

impl Arr {
    pub fn new(shape: &[usize], data: Vec<f64>) -> Arr {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?}"
        );
        Arr {
            shape: shape.to_vec(),
            data,
        }
    }

    pub fn from_fn(shape: &[usize], mut f: impl FnMut(&[usize]) -> f64) -> Arr {
        let mut data = Vec::with_capacity(shape.iter().product());
        for_each_index(shape, |i| data.push(f(i)));
        Arr::new(shape, data)
    }

    pub fn at(&self, idx: &[usize]) -> f64 {
        let mut off = 0;
        for (d, &i) in idx.iter().enumerate() {
            off = off * self.shape[d] + i;
        }
        self.data[off]
    }

    /// `out[i0, i1, ..] = self[maps[0][i0], maps[1][i1], ..]`.
    pub fn gather_dims(&self, maps: &[Vec<usize>]) -> Arr {
        let shape: Vec<usize> = maps.iter().map(|m| m.len()).collect();
        let st = strides(&self.shape);
        let mut data = Vec::with_capacity(shape.iter().product());
        for_each_index(&shape, |i| {
            let off: usize = i.iter().enumerate().map(|(d, &k)| maps[d][k] * st[d]).sum();
            data.push(self.data[off]);
        });
        Arr::new(&shape, data)
    }

    pub fn map(&self, f: impl Fn(f64) -> f64) -> Arr {
        Arr::new(&self.shape, self.data.iter().map(|&x| f(x)).collect())
    }

    /// Elements at `indices` along `dim`, in that order.
    pub fn select(&self, dim: usize, indices: &[usize]) -> Arr {
        let maps: Vec<Vec<usize>> = (0..self.shape.len())
            .map(|d| {
                if d == dim {
                    indices.to_vec()
                } else {
                    (0..self.shape[d]).collect()
                }
            })
            .collect();
        self.gather_dims(&maps)
    }

    pub fn chunk(&self, dim: usize, n: usize, c: usize) -> Arr {
        let (size, off) = shard_size_and_offset(self.shape[dim], n, c);
        let idx: Vec<usize> = (off..off + size).collect();
        self.select(dim, &idx)
    }

    pub fn concat(parts: &[Arr], dim: usize) -> Arr {
        let mut shape = parts[0].shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        let mut owner = Vec::new();
        for (pi, p) in parts.iter().enumerate() {
            owner.extend((0..p.shape[dim]).map(|k| (pi, k)));
        }
        let mut j = vec![0; shape.len()];
        Arr::from_fn(&shape, |i| {
            let (pi, k) = owner[i[dim]];
            j.copy_from_slice(i);
            j[dim] = k;
            parts[pi].at(&j)
        })
    }

    /// Numpy-broadcasting binary op.
    pub fn broadcast_zip(&self, other: &Arr, f: impl Fn(f64, f64) -> f64) -> Arr {
        let nd = self.shape.len().max(other.shape.len());
        let pad = |s: &[usize]| -> Vec<usize> {
            let mut v = vec![1; nd - s.len()];
            v.extend_from_slice(s);
            v
        };
        let (a, b) = (pad(&self.shape), pad(&other.shape));
        let shape: Vec<usize> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| if x == 1 { y } else { x })
            .collect();
        let ea = Arr::new(&a, self.data.clone());
        let eb = Arr::new(&b, other.data.clone());
        let (mut ia, mut ib) = (vec![0; nd], vec![0; nd]);
        Arr::from_fn(&shape, |i| {
            for d in 0..nd {
                ia[d] = if a[d] == 1 { 0 } else { i[d] };
                ib[d] = if b[d] == 1 { 0 } else { i[d] };
            }
            f(ea.at(&ia), eb.at(&ib))
        })
    }

    pub fn reshape(&self, shape: &[usize]) -> Arr {
        Arr::new(shape, self.data.clone())
    }

    pub fn permute(&self, dims: &[usize]) -> Arr {
        let shape: Vec<usize> = dims.iter().map(|&d| self.shape[d]).collect();
        let mut j = vec![0; dims.len()];
        Arr::from_fn(&shape, |i| {
            for (k, &d) in dims.iter().enumerate() {
                j[d] = i[k];
            }
            self.at(&j)
        })
    }

    /// `reduce` over `dims` with `f` (identity `init`), keepdim optional; `mean` divides.
    pub fn reduce(&self, dims: &[usize], keepdim: bool, kind: &str) -> Arr {
        let mut kshape = self.shape.clone();
        for &d in dims {
            kshape[d] = 1;
        }
        let init = match kind {
            "max" => f64::NEG_INFINITY,
            "min" => f64::INFINITY,
            _ => 0.0,
        };
        let mut acc = Arr::new(&kshape, vec![init; kshape.iter().product()]);
        let kst = strides(&kshape);
        for_each_index(&self.shape, |i| {
            let pos: usize = i
                .iter()
                .enumerate()
                .map(|(d, &k)| if dims.contains(&d) { 0 } else { k * kst[d] })
                .sum();
            let v = self.at(i);
            let a = &mut acc.data[pos];
            *a = match kind {
                "max" => a.max(v),
                "min" => a.min(v),
                _ => *a + v,
            };
        });
        if kind == "mean" {
            let n: usize = dims.iter().map(|&d| self.shape[d]).product();
            acc = acc.map(|x| x / n as f64);
        }
        if keepdim {
            acc
        } else {
            let shape: Vec<usize> = self
                .shape
                .iter()
                .enumerate()
                .filter(|(d, _)| !dims.contains(d))
                .map(|(_, &s)| s)
                .collect();
            acc.reshape(&shape)
        }
    }

    pub fn softmax(&self, dim: usize) -> Arr {
        let mx = self.reduce(&[dim], true, "max");
        let e = self.broadcast_zip(&mx, |x, m| (x - m).exp());
        let s = e.reduce(&[dim], true, "sum");
        e.broadcast_zip(&s, |a, b| a / b)
    }

    /// Batched matmul with equal batch dims.
    pub fn matmul(&self, w: &Arr) -> Arr {
        let nd = self.shape.len();
        let (m, k, n) = (self.shape[nd - 2], self.shape[nd - 1], w.shape[nd - 1]);
        let mut shape = self.shape[..nd - 2].to_vec();
        shape.push(m);
        shape.push(n);
        let (mut xi, mut wi) = (vec![0; nd], vec![0; nd]);
        Arr::from_fn(&shape, |i| {
            let mut acc = 0.0;
            xi.copy_from_slice(i);
            wi.copy_from_slice(i);
            for kk in 0..k {
                xi[nd - 1] = kk;
                wi[nd - 2] = kk;
                acc += self.at(&xi) * w.at(&wi);
            }
            acc
        })
    }

    pub fn transpose_last2(&self) -> Arr {
        let nd = self.shape.len();
        let mut dims: Vec<usize> = (0..nd).collect();
        dims.swap(nd - 1, nd - 2);
        self.permute(&dims)
    }
}
