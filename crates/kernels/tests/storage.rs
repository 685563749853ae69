//! The storage seam's invariants, attacked: a released tensor can reach no kernel (every candle
//! op family refuses it with an error, none panics or reads freed memory), refills only install
//! storages of exactly the owner's size, and the row copies check their bounds.
use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_dtensor_kernels::storage;

fn owner(dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::arange(0f32, n as f32, &Device::Cpu)
        .unwrap()
        .reshape(dims)
        .unwrap()
        .contiguous()
        .unwrap()
}

/// Every op must return an error, not panic and not succeed.
fn refused(what: &str, f: impl FnOnce() -> candle_core::Result<Tensor>) {
    let r = catch_unwind(AssertUnwindSafe(f));
    match r {
        Ok(Err(_)) => {}
        Ok(Ok(t)) => panic!(
            "{what}: an op on a released tensor succeeded ({:?})",
            t.dims()
        ),
        Err(_) => panic!("{what}: an op on a released tensor panicked"),
    }
}

#[test]
fn every_op_family_refuses_a_released_tensor() {
    let w = owner(&[16, 8]);
    let wt = w.t().unwrap(); // a view kept before the release, as modules keep them
    let freed = storage::release(&w, "w").unwrap();
    assert_eq!(freed, 16 * 8 * 4);
    assert!(storage::is_released(&w) && storage::is_released(&wt));
    assert_eq!(storage::held_bytes(&w), 0);
    assert_eq!(storage::released_name(&wt).as_deref(), Some("w"));
    let x = Tensor::ones((4, 16), DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[0u32, 3, 15], &Device::Cpu).unwrap();
    refused("matmul", || x.matmul(&w));
    refused("matmul of the view", || x.i((.., ..8))?.matmul(&wt));
    refused("broadcast_matmul", || x.unsqueeze(0)?.broadcast_matmul(&w));
    refused("candle_nn::Linear", || {
        candle_nn::Linear::new(wt.clone(), None).forward(&x.i((.., ..8))?)
    });
    refused("add", || w.add(&owner(&[16, 8])));
    refused("add (released right)", || owner(&[16, 8]).add(&w));
    refused("broadcast_add", || x.broadcast_add(&w.i(0)?.repeat(2)?));
    refused("repeat", || w.i(0)?.repeat(2));
    refused("unary", || w.exp());
    refused("affine", || w.affine(2.0, 1.0));
    refused("sqr", || w.sqr());
    refused("powf", || w.powf(2.0));
    refused("sum", || w.sum_all());
    refused("max", || w.max(D::Minus1));
    refused("to_dtype", || w.to_dtype(DType::F16));
    refused("contiguous of a view", || wt.contiguous());
    refused("copy", || w.copy().and_then(|c| c.exp()));
    refused("cat", || Tensor::cat(&[&w, &owner(&[16, 8])], 0));
    refused("index_select (embedding)", || w.index_select(&ids, 0));
    refused("candle_nn::Embedding", || {
        candle_nn::Embedding::new(w.clone(), 8).forward(&ids)
    });
    refused("gather", || {
        w.gather(
            &Tensor::zeros((16, 1), DType::U32, &Device::Cpu).unwrap(),
            1,
        )
    });
    refused("where_cond", || {
        Tensor::ones((16, 8), DType::U8, &Device::Cpu)
            .unwrap()
            .where_cond(&w, &owner(&[16, 8]))
    });
    refused("cmp", || w.ge(&owner(&[16, 8])));
    refused("to_vec", || w.to_vec2::<f32>().map(|_| w.clone()));
    refused("Var::from_tensor", || {
        candle_core::Var::from_tensor(&w).map(|v| v.as_tensor().clone())
    });
    refused("conv1d", || {
        Tensor::ones((1, 8, 8), DType::F32, &Device::Cpu)?.conv1d(&w.unsqueeze(2)?, 0, 1, 1, 1)
    });
    refused("softmax", || candle_nn::ops::softmax(&w, D::Minus1));
    refused("rms_norm", || {
        candle_nn::ops::rms_norm(&x.i((.., ..8))?, &w.i(0)?, 1e-5)
    });
    refused("the seam's own slice view", || {
        storage::with_slice::<f32, _>(&w, |_| ()).map(|_| w.clone())
    });
    refused("host staging", || {
        storage::host_bytes(&w).map(|_| w.clone())
    });
    refused("a graph node output", || {
        storage::output_of::<candle_core::CpuStorage>(&w).map(|_| w.clone())
    });
    // Shape-only ops are fine and keep the placeholder.
    assert!(storage::is_released(&w.reshape((8, 16)).unwrap()));
    // A refill brings every view back.
    storage::refill(&w, &owner(&[16, 8])).unwrap();
    assert!(!storage::is_released(&wt));
    assert_eq!(storage::released_name(&wt), None);
    assert_eq!(
        wt.to_vec2::<f32>().unwrap(),
        owner(&[16, 8]).t().unwrap().to_vec2::<f32>().unwrap()
    );
    assert_eq!(x.matmul(&w).unwrap().dims(), &[4, 8]);
}

#[test]
fn refill_installs_only_a_storage_of_the_owners_size() {
    let w = owner(&[4, 3]);
    storage::release(&w, "w").unwrap();
    // Wrong element count, dtype, layout or device: refused, and the tensor stays released.
    assert!(storage::refill(&w, &owner(&[4, 2])).is_err());
    assert!(storage::refill(&w, &owner(&[4, 3]).to_dtype(DType::F64).unwrap()).is_err());
    assert!(storage::refill_from_segments(&w, &owner(&[12]), &[(0, 6), (7, 6)]).is_err());
    assert!(storage::refill_from_segments(&w, &owner(&[12]), &[(0, 6)]).is_err());
    assert!(storage::is_released(&w));
    // Views cannot own a storage: their elements are not the whole buffer.
    let big = owner(&[8, 3]);
    let view = big.narrow(0, 2, 4).unwrap();
    assert!(storage::release(&view, "view").is_err());
    assert!(storage::refill(&big.t().unwrap(), &owner(&[3, 8])).is_err());
    // A released source refills nothing.
    let other = owner(&[4, 3]);
    storage::release(&other, "other").unwrap();
    assert!(storage::refill(&w, &other).is_err());
    // Segments of a gathered buffer, reassembled in order.
    let flat = owner(&[20]);
    storage::refill_from_segments(&w, &flat, &[(10, 6), (0, 6)]).unwrap();
    let got: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
    let want: Vec<f32> = (10..16).chain(0..6).map(|v| v as f32).collect();
    assert_eq!(got, want);
    // Releasing twice frees nothing the second time; an empty owner has nothing to free.
    assert_eq!(storage::release(&w, "w").unwrap(), 12 * 4);
    assert_eq!(storage::release(&w, "w").unwrap(), 0);
    assert_eq!(storage::release(&owner(&[0, 3]), "e").unwrap(), 0);
}

#[test]
fn copy_rows_checks_bounds_and_aliasing() {
    let src = owner(&[2, 5, 3]);
    let dst = Tensor::zeros((2, 7, 3), DType::F32, &Device::Cpu).unwrap();
    // Rows 1..4 of each of the 2 blocks to rows 3..6.
    storage::copy_rows(&src, 5, 1, &dst, 7, 3, 2, 3, 3).unwrap();
    let want = Tensor::zeros((2, 3, 3), DType::F32, &Device::Cpu)
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    assert_eq!(dst.narrow(1, 0, 3).unwrap().to_vec3::<f32>().unwrap(), want);
    assert_eq!(
        dst.narrow(1, 3, 3).unwrap().to_vec3::<f32>().unwrap(),
        src.narrow(1, 1, 3).unwrap().to_vec3::<f32>().unwrap()
    );
    // Out of bounds on either side, a dtype mismatch, a shared storage: errors.
    assert!(storage::copy_rows(&src, 5, 3, &dst, 7, 0, 2, 3, 3).is_err());
    assert!(storage::copy_rows(&src, 5, 0, &dst, 7, 5, 2, 3, 3).is_err());
    assert!(storage::copy_rows(&src, 5, 0, &dst, 7, 0, 3, 1, 3).is_err());
    let f64dst = Tensor::zeros((2, 7, 3), DType::F64, &Device::Cpu).unwrap();
    assert!(storage::copy_rows(&src, 5, 0, &f64dst, 7, 0, 2, 1, 3).is_err());
    assert!(storage::copy_rows(&dst, 7, 0, &dst, 7, 1, 2, 1, 3).is_err());
    // Padding and filling through the same kernel.
    let padded = storage::pad_dim(&src, 1, 7).unwrap();
    assert_eq!(padded.dims(), &[2, 7, 3]);
    assert_eq!(
        padded.narrow(1, 0, 5).unwrap().to_vec3::<f32>().unwrap(),
        src.to_vec3::<f32>().unwrap()
    );
    assert!(storage::pad_dim(&src, 1, 4).is_err());
    let dest = Tensor::zeros((3, 10), DType::F32, &Device::Cpu).unwrap();
    storage::fill_from(&dest, &src.t().unwrap()).unwrap();
    assert_eq!(
        dest.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        src.t()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    );
}

#[test]
fn host_staging_round_trips_every_dtype() {
    for dtype in [
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
        DType::U8,
        DType::U32,
        DType::I64,
    ] {
        let t = owner(&[3, 4]).to_dtype(dtype).unwrap();
        let bytes = storage::host_bytes(&t.t().unwrap()).unwrap();
        assert_eq!(bytes.len(), 12 * dtype.size_in_bytes());
        let back = Tensor::zeros((4, 3), dtype, &Device::Cpu).unwrap();
        storage::set_from_bytes(&back, &bytes).unwrap();
        assert_eq!(
            back.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap(),
            t.t()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec2::<f64>()
                .unwrap(),
            "{dtype:?}"
        );
        assert!(storage::set_from_bytes(&back, &bytes[1..]).is_err());
    }
}

/// Only a CUDA device has a memory pool to keep freed memory in; the CPU is left alone.
#[test]
fn retaining_freed_memory_is_a_no_op_on_the_cpu() {
    assert!(!candle_dtensor_kernels::storage::retain_freed_memory(&Device::Cpu).unwrap());
}

/// cudarc's per-buffer events exist only on CUDA devices: nothing to skip on the CPU.
#[test]
fn skipping_buffer_events_is_a_no_op_on_the_cpu() {
    // SAFETY: a CPU device has no cudarc context: nothing is changed.
    assert!(!unsafe { candle_dtensor_kernels::storage::skip_unused_buffer_events(&Device::Cpu) });
}

/// What a [`Probe`]'s backward saw: the gradient it received and the one it returned, kept
/// alive so that their storages can be compared (a freed storage's address can come back).
#[derive(Default)]
struct Seen {
    received: std::sync::Mutex<Option<Tensor>>,
    returned: std::sync::Mutex<Option<Tensor>>,
}

/// The forward of the identity nodes below: a copy of the input, which is an owner.
fn owner_copy(
    s: &candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
    assert!(
        l.is_contiguous() && l.start_offset() == 0,
        "the test's input is an owner"
    );
    Ok((s.clone(), l.shape().clone()))
}

/// An identity node whose backward doubles the gradient and records it in [`Seen`].
struct Probe(std::sync::Arc<Seen>);

impl candle_core::CustomOp1 for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        owner_copy(s, l)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        *self.0.received.lock().unwrap() = Some(g.clone());
        let out = g.affine(2., 0.)?;
        *self.0.returned.lock().unwrap() = Some(out.clone());
        Ok(Some(out))
    }
}

/// The workspace builds candle-core with vendor/candle-core.patch (vendor/README.md): the first
/// gradient reaching an intermediate tensor is stored as it is, not added into a fresh
/// `zeros_like`, while each variable's gradient stays a storage of its own (the optimizers and
/// gradient reductions rely on it). Here the gradient `b` returns for the reshape reaches `a`
/// in the same storage (the reshape's backward is a view); without the patch it arrives in the
/// zero-filled sum's new buffer. Fails if the `[patch.crates-io]` entry is dropped, or if
/// variables lose their own storages.
#[test]
fn backward_stores_first_gradients_and_keeps_variables_apart() {
    use candle_core::Var;
    let x = Var::new(&[1f32, 2., 3., 4.], &Device::Cpu).unwrap();
    let y = Var::new(&[5f32, 6., 7., 8.], &Device::Cpu).unwrap();
    let (a, b) = (
        std::sync::Arc::new(Seen::default()),
        std::sync::Arc::new(Seen::default()),
    );
    // Both variables receive the add's gradient.
    let s = (x.as_tensor() + y.as_tensor()).unwrap();
    let pa = s.apply_op1(Probe(a.clone())).unwrap();
    let r = pa.reshape((2, 2)).unwrap();
    let loss = r.apply_op1(Probe(b.clone())).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let returned_by_b = b
        .returned
        .lock()
        .unwrap()
        .clone()
        .expect("b's backward ran");
    let received_by_a = a
        .received
        .lock()
        .unwrap()
        .clone()
        .expect("a's backward ran");
    assert!(
        storage::same_storage(&received_by_a, &returned_by_b),
        "the reshape's gradient is stored as the view it is"
    );
    let (gx, gy) = (
        grads.get(x.as_tensor()).unwrap(),
        grads.get(y.as_tensor()).unwrap(),
    );
    assert!(
        !storage::same_storage(gx, gy),
        "each variable's gradient is its own storage"
    );
    // d/dx of sum(b(reshape(a(x + y)))) with both probes doubling: 4 everywhere.
    assert_eq!(gx.to_vec1::<f32>().unwrap(), [4f32; 4]);
    assert_eq!(gy.to_vec1::<f32>().unwrap(), [4f32; 4]);
}

/// `a` forward; backward hands back a tensor of the forward as the gradient of `a`: `a`
/// itself (`own`), or `b` (a rule such as `d/dx (x y) = y`, with no multiply left).
struct Echo {
    own: bool,
}

impl candle_core::CustomOp2 for Echo {
    fn name(&self) -> &'static str {
        "echo"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
        _s2: &candle_core::CpuStorage,
        _l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        owner_copy(s, l)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        _g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(if self.own { a.clone() } else { b.clone() }), None))
    }
}

/// The gradients of `sum(probe(x))` and the gradient the probe's backward returned (kept
/// alive, so that storages can be compared).
fn through_probe(x: &Tensor) -> (candle_core::backprop::GradStore, Tensor) {
    let seen = std::sync::Arc::new(Seen::default());
    let loss = x.apply_op1(Probe(seen.clone())).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let returned = seen
        .returned
        .lock()
        .unwrap()
        .clone()
        .expect("the backward ran");
    (grads, returned)
}

/// Variables' first gradients are stored as they come too (vendor/README.md), with no zero
/// fill and add, and then separated: a gradient two variables would share, or one that is a
/// variable's own value, is replaced by a copy, so each variable's gradient is a storage of its
/// own that no variable's value shares (AdamW refuses a gradient sharing a parameter's
/// storage; reductions and accumulators take each gradient as its own). Fails if variables keep the zero-and-add path (the first
/// assertion) or if the separation is dropped (the others).
#[test]
fn variables_take_their_first_gradient_as_it_comes_but_never_share_it() {
    use candle_core::Var;
    let dev = Device::Cpu;
    // One variable, one consumer: the probe's returned gradient is the variable's.
    let w = Var::new(&[1f32, -2., 3.], &dev).unwrap();
    let (grads, returned) = through_probe(w.as_tensor());
    let gw = grads.get(w.as_tensor()).unwrap();
    assert!(
        storage::same_storage(gw, &returned),
        "a variable's whole first gradient is stored without a copy"
    );
    assert_eq!(gw.to_vec1::<f32>().unwrap(), [2f32; 3]);

    // Two variables fed by one add: the first in the backward's order keeps the tensor, the
    // other gets a copy; both have the value.
    let x = Var::new(&[1f32, 2.], &dev).unwrap();
    let y = Var::new(&[3f32, 4.], &dev).unwrap();
    let (grads, returned) = through_probe(&(x.as_tensor() + y.as_tensor()).unwrap());
    let (gx, gy) = (
        grads.get(x.as_tensor()).unwrap(),
        grads.get(y.as_tensor()).unwrap(),
    );
    assert!(!storage::same_storage(gx, gy), "x and y share a gradient");
    assert!(
        storage::same_storage(gx, &returned) || storage::same_storage(gy, &returned),
        "one of them keeps the add's gradient as it came"
    );
    assert_eq!(gx.to_vec1::<f32>().unwrap(), [2f32; 2]);
    assert_eq!(gy.to_vec1::<f32>().unwrap(), [2f32; 2]);

    // A rule handing a variable's value back as a gradient, its own (u) or another's (v's
    // value as w's gradient): each gradient is a copy, with the value.
    let u = Var::new(&[5f32, 6.], &dev).unwrap();
    let v = Var::new(&[7f32, 8.], &dev).unwrap();
    let w = Var::new(&[9f32, 10.], &dev).unwrap();
    let own = u
        .as_tensor()
        .apply_op2(v.as_tensor(), Echo { own: true })
        .unwrap();
    let other = w
        .as_tensor()
        .apply_op2(v.as_tensor(), Echo { own: false })
        .unwrap();
    let loss = (own.sum_all().unwrap() + other.sum_all().unwrap()).unwrap();
    let grads = loss.backward().unwrap();
    let (gu, gw) = (
        grads.get(u.as_tensor()).unwrap(),
        grads.get(w.as_tensor()).unwrap(),
    );
    for (name, g) in [("u", gu), ("w", gw)] {
        for (value_name, value) in [("u", &u), ("v", &v), ("w", &w)] {
            assert!(
                !storage::same_storage(g, value.as_tensor()),
                "{name}'s gradient shares {value_name}'s value"
            );
        }
    }
    assert_eq!(gu.to_vec1::<f32>().unwrap(), [5f32, 6.]);
    assert_eq!(gw.to_vec1::<f32>().unwrap(), [7f32, 8.]);
}

/// `ids_as` on the CPU, where every integer dtype casts: i16 and i32 ids become the asked
/// dtype with their values, and ids already in it are returned as they are (same storage).
/// (The CUDA refusal of i16 / i32 is checked on a GPU: `cuda_fused.rs`.)
#[test]
fn ids_cast_on_the_cpu_and_pass_through_in_their_dtype() {
    let dev = Device::Cpu;
    for t in [
        Tensor::new(&[3i32, 0, 7], &dev).unwrap(),
        Tensor::new(&[3i16, 0, 7], &dev).unwrap(),
        Tensor::new(&[3u8, 0, 7], &dev).unwrap(),
    ] {
        let u = storage::ids_as("test", &t, DType::U32).unwrap();
        assert_eq!(u.dtype(), DType::U32);
        assert_eq!(u.to_vec1::<u32>().unwrap(), [3, 0, 7], "{:?}", t.dtype());
    }
    let t = Tensor::new(&[1i64, 2], &dev).unwrap();
    let same = storage::ids_as("test", &t, DType::I64).unwrap();
    assert!(storage::same_storage(&t, &same));
}
