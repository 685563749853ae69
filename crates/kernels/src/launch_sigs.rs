// The parameters of every kernel `cuda.rs` launches, declared once for two readers:
//
// - `cuda.rs` (feature `cuda`) expands each line into a typed launcher, `launch::NAME`, the
//   only way that module pushes kernel arguments: a call site with an argument of the wrong
//   kind, element type or width, or a missing or extra one, does not compile.
// - `crates/kernels-emu/build.rs` expands each line, for every instantiation its domains list,
//   into a C++ `static_assert` that the kernel (compiled from `crates/kernels/cuda` as nvcc
//   compiles it, in the emulator's build of every `cargo test`) has exactly these parameter
//   types: a declaration that disagrees with its kernel does not build.
//
// Together, no launch can hand a kernel arguments of another layout than its C signature
// (cudarc's builder is untyped: a mismatch there would read garbage or write out of bounds on
// the GPU, the one place these launches run).
//
// Grammar, one line per kernel family:
//
//   launcher<Generics>[values] = MODULE "c_name_{Generic}_{value}" [Placeholder: instances..]..
//       (param: Kind, ..);
//
// - Generics are element types (`KernelElem` in cuda.rs: f32 bf16 u32 i64 u64), values
//   `usize` arguments of the launcher; each `{X}` of the name is replaced by the generic's
//   suffix or the value. Every placeholder lists its instances: the launcher refuses others (a
//   typed error, before any launch), and the C++ check covers every combination, each of
//   which the sources must define.
// - Kinds: `In<E>` (`const E*`, a device buffer read), `Out<E>` (`E*`, written), `Opt<E>`
//   (`const E*` or null), `Addr<E>` (`const E*` given as a raw device address, 0 for null),
//   `i64` (`long long`), `i32` (`int`), `f32` (`float`), `AdamWConsts` and `FaRows` (the structs, by value).
cuda_kernels! {
    gelu_fwd<T> = GELU "cdt_gelu_fwd_{T}" [T: f32 bf16]
        (x: In<T>, y: Out<T>, len: i64);
    gelu_bwd<T> = GELU "cdt_gelu_bwd_{T}" [T: f32 bf16]
        (x: In<T>, g: In<T>, dx: Out<T>, len: i64);

    softmax_fwd<T> = SOFTMAX "cdt_softmax_fwd_{T}" [T: f32 bf16]
        (x: In<T>, y: Out<T>, rows: i64, n: i32, t: i64, scale: f32, causal: i32, log_out: i32);
    softmax_bwd<T> = SOFTMAX "cdt_softmax_bwd_{T}" [T: f32 bf16]
        (y: In<T>, g: In<T>, dx: Out<T>, rows: i64, n: i32, scale: f32, log_out: i32);
    xent_fwd<T, I> = SOFTMAX "cdt_xent_fwd_{T}_{I}" [T: f32 bf16] [I: u32 i64]
        (x: In<T>, tgt: In<I>, out: Out<f32>, rows: i64, n: i32, ignore: i64, has_ignore: i32);
    xent_bwd<T, I> = SOFTMAX "cdt_xent_bwd_{T}_{I}" [T: f32 bf16] [I: u32 i64]
        (x: In<T>, tgt: In<I>, lg: In<f32>, dx: Out<T>, rows: i64, n: i32, ignore: i64,
         has_ignore: i32);

    norm_fwd<T> = NORM "cdt_norm_fwd_{T}" [T: f32 bf16]
        (x: In<T>, w: In<T>, b: Opt<T>, y: Out<T>, rows: i64, n: i32, eps: f32, center: i32);
    norm_bwd_dx<T> = NORM "cdt_norm_bwd_dx_{T}" [T: f32 bf16]
        (x: In<T>, w: In<T>, g: In<T>, dx: Out<T>, stats: Out<f32>, rows: i64, n: i32, eps: f32,
         center: i32);
    norm_bwd_partial<T> = NORM "cdt_norm_bwd_partial_{T}" [T: f32 bf16]
        (x: In<T>, g: In<T>, stats: In<f32>, part: Out<f32>, rows: i64, n: i32, per_chunk: i64);
    norm_bwd_final<T> = NORM "cdt_norm_bwd_final_{T}" [T: f32 bf16]
        (part: Opt<f32>, wb: Out<T>, chunks: i32, n: i32);

    norm_finish<> = MULTI_TENSOR "cdt_norm_finish"
        (partial: Opt<f32>, blocks: i32, max_norm: f32, out: Out<f32>);
    sumsq_partial<T> = MULTI_TENSOR "cdt_sumsq_partial_{T}" [T: f32 bf16]
        (ptrs: In<u64>, starts: In<i64>, k: i32, chunk: i64, partial: Out<f32>);
    adamw<> = MULTI_TENSOR "cdt_adamw_f32"
        (ps: In<u64>, gs: In<u64>, ms: In<u64>, vs: In<u64>, starts: In<i64>, k: i32, chunk: i64,
         coef: Addr<f32>, c: AdamWConsts);

    embedding_bwd<T> = EMBEDDING "cdt_embedding_bwd_{T}" [T: f32 bf16]
        (ids: In<u32>, n: i32, g: In<T>, dtable: Out<T>, d: i32, vocab: i32);

    col_sum_partial<T> = REDUCE "cdt_col_sum_partial_{T}" [T: f32 bf16]
        (x: In<T>, part: Out<f32>, rows: i64, n: i32);
    col_sum_final<T> = REDUCE "cdt_col_sum_final_{T}" [T: f32 bf16]
        (part: In<f32>, out: Out<T>, chunks: i32, n: i32);

    cast_add_rows<> = CAST "cdt_cast_add_rows_bf16_f32"
        (y: In<bf16>, b: Opt<f32>, out: Out<f32>, len: i64, n: i32);
    add_rows<T, B> = CAST "cdt_add_rows_{T}_{B}" [T: f32 bf16] [B: f32 bf16]
        (y: Out<T>, b: In<B>, len: i64, n: i32);

    fa_fwd<T>[d] = FLASH_ATTN "cdt_fa_fwd_{T}_d{d}" [T: f32 bf16] [d: 32 48 64 96 128]
        (q: In<T>, k: In<T>, v: In<T>, o: Out<T>, lse: Out<f32>, lq: FaRows, lk: FaRows,
         lv: FaRows, lo: FaRows, tq: i32, tk: i32, scale: f32, causal: i32);
    fa_fwd_tc<T>[d] = FLASH_ATTN "cdt_fa_fwd_tc_{T}_d{d}" [T: bf16] [d: 32 48 64 96 128]
        (q: In<T>, k: In<T>, v: In<T>, o: Out<T>, lse: Out<f32>, lq: FaRows, lk: FaRows,
         lv: FaRows, lo: FaRows, tq: i32, tk: i32, scale: f32, causal: i32);
    fa_bwd_delta<T>[d] = FLASH_ATTN "cdt_fa_bwd_delta_{T}_d{d}" [T: f32 bf16]
        [d: 32 48 64 96 128]
        (o: In<T>, d_o: In<T>, delta: Out<f32>, lo: FaRows, ldo: FaRows, rows: i64, tq: i32);
    fa_bwd_dkv<T>[d] = FLASH_ATTN "cdt_fa_bwd_dkv_{T}_d{d}" [T: f32 bf16] [d: 32 48 64 96 128]
        (q: In<T>, k: In<T>, v: In<T>, d_o: In<T>, lse: In<f32>, delta: In<f32>, dkv: Out<T>,
         lq: FaRows, lk: FaRows, lv: FaRows, ldo: FaRows, ldk: FaRows, ldv: FaRows, tq: i32,
         tk: i32, scale: f32, causal: i32);
    fa_bwd_dkv_tc<T>[d] = FLASH_ATTN "cdt_fa_bwd_dkv_tc_{T}_d{d}" [T: bf16] [d: 32 48 64 96 128]
        (q: In<T>, k: In<T>, v: In<T>, d_o: In<T>, lse: In<f32>, delta: In<f32>, dkv: Out<T>,
         lq: FaRows, lk: FaRows, lv: FaRows, ldo: FaRows, ldk: FaRows, ldv: FaRows, tq: i32,
         tk: i32, scale: f32, causal: i32);
    fa_bwd_dq<T>[d] = FLASH_ATTN "cdt_fa_bwd_dq_{T}_d{d}" [T: f32 bf16] [d: 32 48 64 96 128]
        (q: In<T>, k: In<T>, v: In<T>, d_o: In<T>, lse: In<f32>, delta: In<f32>, dq: Out<T>,
         lq: FaRows, lk: FaRows, lv: FaRows, ldo: FaRows, ldq: FaRows, tq: i32, tk: i32,
         scale: f32, causal: i32);
    fa_bwd_dq_tc<T>[d] = FLASH_ATTN "cdt_fa_bwd_dq_tc_{T}_d{d}" [T: bf16] [d: 32 48 64 96 128]
        (q: In<T>, k: In<T>, v: In<T>, d_o: In<T>, lse: In<f32>, delta: In<f32>, dq: Out<T>,
         lq: FaRows, lk: FaRows, lv: FaRows, ldo: FaRows, ldq: FaRows, tq: i32, tk: i32,
         scale: f32, causal: i32);
}
