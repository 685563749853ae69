#!/usr/bin/env python3
"""A PyTorch twin of this project's GPT and of `train_gpt`'s training loop.

Same model (crates/models/src/gpt.rs, crates/models/src/layers.rs; presets tiny, small, gpt2, gpt2-medium and
the shape flags), same parameter names and layouts, same data (byte-level tokens of --data, or
train_gpt's synthetic corpus without it), held-out split and batch sampling
(crates/train/src/data.rs, crates/train/src/trainer.rs; splitmix64 on 64-bit-masked ints),
same AdamW (candle-nn's math, crates/train/src/optim.rs), learning-rate schedule and weight-decay
policy (crates/train/src/schedule.rs), and the same loss CSV as `train_gpt --out PREFIX`
(`step,loss,eval_loss`), so that

    train_gpt_torch.py --data text.txt --steps 200 --eval-every 50 --save-init init.safetensors --out twin
    train_gpt --mesh tp=1 --no-fsdp --data text.txt --steps 200 --eval-every 50 \\
        --init-from init.safetensors --check-against twin.csv --check-tol 0.02

trains the same model from the same parameters on the same batches and compares every step.
The flags mirror train_gpt's (same names, same defaults); the twin's own are --save-init,
--init-only, --summary, --device, --threads, --attention, --precision, --compile,
--timing-warmup, --fingerprint. Only f32 with manual attention on the CPU has been compared with
train_gpt (scripts/real_text.sh, BENCHMARKS.md); --device cuda, sdpa, tf32, bf16 and --compile
are there for the GPU comparison of issue 33 (scripts/gpu_bench.sh) and are unchecked against
train_gpt so far.

Precision, the standard PyTorch recipes: f32 (no TF32 anywhere); tf32 (float32 matmuls on TF32
tensor cores: allow_tf32 and set_float32_matmul_precision("high")); bf16 (torch.autocast to
bfloat16 around forward and loss: GEMMs and attention in bf16, LayerNorm, softmax and the
cross-entropy in f32 by autocast's policy, f32 parameters, gradients and AdamW state).

Timing (the JSON summary): every step's wall time from taking its batch to reading its loss back
(which synchronizes the device) in step_ms_all; median / p10 / p90 over the steps after
--timing-warmup in step_ms; on CUDA the same span by CUDA events in gpu_step_ms, and
torch.cuda.max_memory_allocated / max_memory_reserved in peak_memory.

The model, per train_gpt:
  x = tok_emb[ids] + pos_emb[:T]
  per block: x = x + proj(attn(ln1(x))); x = x + fc2(gelu_tanh(fc1(ln2(x))))
  logits = lm_head(ln_f(x))       (tied: x @ tok_emb^T)
  loss = mean cross-entropy over all B*T tokens
Linear weights are [out, in] (y = x W^T + b, as torch.nn.Linear). The fused qkv projection's
3*D output features are ordered (head, {q, k, v}, head dim). Attention is causal with scale
1/sqrt(head dim). LayerNorm has a weight and a bias, eps 1e-5, biased variance.
Initialisation: normal(0, 0.02) for embeddings and linear weights, normal(0, 0.02/sqrt(2L))
for attn.proj and mlp.fc2 weights, zeros for biases, ones for norm weights; drawn on the CPU
from torch.Generator(seed), so every device starts from the same values. (The values differ
from train_gpt's own seeded init; the two are compared from the same --save-init file.)

Needs torch only (safetensors files are written and read by hand; numpy is used when present).
"""

import argparse
import json
import math
import os
import struct
import sys
import time

M64 = (1 << 64) - 1
EVAL_SEED = 0xE7A1  # crates/train/src/trainer.rs


def splitmix64(z):
    """crates/train/src/data.rs `splitmix64`, on Python ints masked to 64 bits."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


# The reference value of splitmix64's first output from state 0 (Vigna's generator).
assert splitmix64(0) == 0xE220A8397B1DCDAF


def rust_round(x):
    """f64::round: half away from zero (Python's round() is half to even)."""
    return math.floor(x + 0.5) if x >= 0 else -math.floor(-x + 0.5)


# ----------------------------------------------------------------------------------------------
# Data: Corpus::bytes, Corpus::split, Corpus::batch, Corpus::fingerprint.


def load_tokens(path):
    raw = open(path, "rb").read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        sys.exit(f"--data {path}: not UTF-8 text (invalid byte at offset {e.start})")
    if not raw:
        sys.exit(f"--data {path}: corpus: no tokens")
    return raw  # bytes: each byte is a token (vocabulary 256)


def split(tokens, eval_fraction, min_tokens):
    if not (0.0 < eval_fraction < 1.0):
        sys.exit(f"corpus: the held-out fraction {eval_fraction} is not in (0, 1)")
    n = len(tokens)
    at = n - min(max(rust_round(n * eval_fraction), 0), n)
    train, ev = tokens[:at], tokens[at:]
    if len(train) < min_tokens or len(ev) < min_tokens:
        sys.exit(f"corpus: {n} tokens split {len(train)} / {len(ev)}; each part needs at least {min_tokens}")
    return train, ev


def batch_offsets(n_tokens, step, batch, seq, seed):
    span = max(n_tokens - (seq + 1), 1) if n_tokens > seq + 1 else 1
    return [
        splitmix64(seed ^ splitmix64(((step * 1_000_003) & M64) + b)) % span for b in range(batch)
    ]


def batch_ids(tokens, step, batch, seq, seed):
    """(x, y) as flat lists of batch*seq ids, row-major, exactly as Corpus::batch."""
    xs, ys = [], []
    n = len(tokens)
    for off in batch_offsets(n, step, batch, seq, seed):
        w = tokens[off : min(off + seq + 1, n)]
        xs.extend(w[: min(seq, max(len(w) - 1, 0))])
        ys.extend(w[1 : min(seq + 1, len(w))])
    return xs, ys


PROBS = (0.55, 0.25, 0.12, 0.08)
CORPUS_TOKENS = 1 << 18  # TrainConfig::new's corpus_tokens


def synthetic(vocab, length, seed):
    """Corpus::synthetic: a sparse random Markov chain (f64 arithmetic, as in Rust)."""
    vocab = max(vocab, 2)

    def succ(a, j):
        return splitmix64(seed ^ ((((a << 8) | j) * 0xA24BAED4963EE407) & M64)) % vocab

    tokens = []
    cur = splitmix64(seed) % vocab
    state = seed ^ 0x5851F42D4C957F2D
    for _ in range(length):
        tokens.append(cur)
        state = splitmix64(state)
        u = (state >> 11) / float(1 << 53)
        acc, j = 0.0, len(PROBS) - 1
        for k, p in enumerate(PROBS):
            acc += p
            if u < acc:
                j = k
                break
        cur = succ(cur, j)
    return tokens


def fingerprint(tokens, vocab):
    h = splitmix64(vocab)
    for t in tokens:
        h = splitmix64(h ^ t)
    return h


# ----------------------------------------------------------------------------------------------
# Schedule and weight decay: crates/train/src/schedule.rs.


def lr_at(step, lr, warmup, decay, steps, min_lr):
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(max(steps - 1, 0) - warmup, 0)
    if decay == "none" or span == 0:
        return lr
    t = min((step - warmup) / span, 1.0)
    coeff = 0.5 * (1.0 + math.cos(math.pi * t)) if decay == "cosine" else 1.0 - t
    return min_lr + coeff * (lr - min_lr)


def is_embedding(name):
    module = name.rsplit(".", 1)[0] if "." in name else name
    last = module.rsplit(".", 1)[-1]
    return (
        last == "emb"
        or last.endswith("_emb")
        or last.endswith("embed")
        or "embed_" in last
        or "embedding" in last
        or last in ("wte", "wpe")
    )


def decays(policy, name, shape):
    if policy == "all":
        return True
    return len(shape) >= 2 and (policy == "matrices+embeddings" or not is_embedding(name))


# ----------------------------------------------------------------------------------------------
# safetensors, by hand (the format: u64 LE header length, JSON header, raw little-endian data).


def save_safetensors(path, tensors):
    import torch

    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = _f32_bytes(t)
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt", "written_by": "scripts/peers/train_gpt_torch.py"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def _f32_bytes(t):
    """Little-endian f32 bytes of a tensor (numpy when there is one, struct otherwise)."""
    import torch

    t = t.detach().to("cpu", torch.float32).contiguous().view(-1)
    try:
        return t.numpy().astype("<f4").tobytes()
    except Exception:  # torch without numpy: exact, f32 values are exact doubles
        return struct.pack(f"<{t.numel()}f", *t.tolist())


def load_safetensors(path):
    import torch

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            sys.exit(f"{path}: tensor {name} is {info['dtype']}, expected F32")
        a, b = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32)
        out[name] = t.reshape(info["shape"]).clone()
    return out


# ----------------------------------------------------------------------------------------------
# The model.

PRESETS = {
    # GptConfig::tiny / small (crates/models/src/gpt.rs).
    "tiny": dict(vocab=512, width=256, heads=4, layers=1, seq_len=128, mlp_ratio=4, tied=False),
    "small": dict(vocab=1024, width=384, heads=8, layers=4, seq_len=128, mlp_ratio=4, tied=False),
    "gpt2": dict(vocab=50304, width=768, heads=12, layers=12, seq_len=1024, mlp_ratio=4, tied=True),
    "gpt2-medium": dict(vocab=50304, width=1024, heads=16, layers=24, seq_len=1024, mlp_ratio=4, tied=True),
}
EPS = 1e-5


def param_shapes(cfg):
    """(name, shape, init) in the order Gpt::build creates them."""
    v, d, L, t, h = cfg["vocab"], cfg["width"], cfg["layers"], cfg["seq_len"], cfg["mlp_ratio"] * cfg["width"]
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * max(L, 1))
    out = [("tok_emb.weight", [v, d], std), ("pos_emb.weight", [t, d], std)]
    for i in range(L):
        p = f"blocks.{i}"
        out += [
            (f"{p}.ln1.weight", [d], "ones"),
            (f"{p}.ln1.bias", [d], "zeros"),
            (f"{p}.attn.qkv.weight", [3 * d, d], std),
            (f"{p}.attn.qkv.bias", [3 * d], "zeros"),
            (f"{p}.attn.proj.weight", [d, d], proj_std),
            (f"{p}.attn.proj.bias", [d], "zeros"),
            (f"{p}.ln2.weight", [d], "ones"),
            (f"{p}.ln2.bias", [d], "zeros"),
            (f"{p}.mlp.fc1.weight", [h, d], std),
            (f"{p}.mlp.fc1.bias", [h], "zeros"),
            (f"{p}.mlp.fc2.weight", [d, h], proj_std),
            (f"{p}.mlp.fc2.bias", [d], "zeros"),
        ]
    out += [("ln_f.weight", [d], "ones"), ("ln_f.bias", [d], "zeros")]
    if not cfg["tied"]:
        out.append(("lm_head.weight", [v, d], std))
    return out


def init_params(cfg, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape, init in param_shapes(cfg):
        if init == "ones":
            t = torch.ones(shape)
        elif init == "zeros":
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float32) * init
        params[name] = t
    return params


def forward_loss(p, cfg, ids, targets, attention):
    import torch
    import torch.nn.functional as F

    b, t = ids.shape
    d, nh = cfg["width"], cfg["heads"]
    hd = d // nh
    x = F.embedding(ids, p["tok_emb.weight"]) + p["pos_emb.weight"][:t]
    for i in range(cfg["layers"]):
        q = f"blocks.{i}"
        h = F.layer_norm(x, (d,), p[f"{q}.ln1.weight"], p[f"{q}.ln1.bias"], EPS)
        qkv = F.linear(h, p[f"{q}.attn.qkv.weight"], p[f"{q}.attn.qkv.bias"])
        # Output features (head, {q, k, v}, head dim): [B, T, H, 3, hd] -> 3 x [B, H, T, hd].
        qkv = qkv.view(b, t, nh, 3, hd).permute(3, 0, 2, 1, 4)
        qq, kk, vv = qkv[0], qkv[1], qkv[2]
        if attention == "sdpa":
            y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        else:
            att = (qq @ kk.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = att @ vv
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + F.linear(y, p[f"{q}.attn.proj.weight"], p[f"{q}.attn.proj.bias"])
        h = F.layer_norm(x, (d,), p[f"{q}.ln2.weight"], p[f"{q}.ln2.bias"], EPS)
        h = F.gelu(F.linear(h, p[f"{q}.mlp.fc1.weight"], p[f"{q}.mlp.fc1.bias"]), approximate="tanh")
        x = x + F.linear(h, p[f"{q}.mlp.fc2.weight"], p[f"{q}.mlp.fc2.bias"])
    x = F.layer_norm(x, (d,), p["ln_f.weight"], p["ln_f.bias"], EPS)
    head = p["tok_emb.weight"] if cfg["tied"] else p["lm_head.weight"]
    logits = F.linear(x, head)
    return F.cross_entropy(logits.reshape(b * t, -1).float(), targets.reshape(b * t))


# ----------------------------------------------------------------------------------------------


def f32_str(x):
    """The shortest decimal that reads back as the same f32 (as Rust's `{}` of an f32)."""
    if not math.isfinite(x):
        return {math.inf: "inf", -math.inf: "-inf"}.get(x, "NaN")
    f = struct.unpack("<f", struct.pack("<f", x))[0]
    for p in range(1, 12):
        s = "%.*g" % (p, f)
        if struct.unpack("<f", struct.pack("<f", float(s)))[0] == f:
            return s
    return repr(f)


def step_stats(ms):
    """Median, p10 and p90 of step times (nearest rank: the value at index floor(q * n) of the
    sorted list; the median of an even count is the upper middle one), and the count."""
    if not ms:
        return {"median": None, "p10": None, "p90": None, "n": 0}
    s = sorted(ms)

    def pct(q):
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"median": pct(0.5), "p10": pct(0.1), "p90": pct(0.9), "n": len(s)}


def peak_rss_bytes():
    """This process's peak resident set (Linux reports ru_maxrss in KiB); None elsewhere."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if sys.platform.startswith("linux") else None
    except Exception:
        return None


def parse_args(argv=None):
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # train_gpt's flags (same names and defaults).
    a.add_argument("--data", help="UTF-8 text file (byte-level tokens); default: train_gpt's synthetic corpus")
    a.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    a.add_argument("--layers", type=int)
    a.add_argument("--heads", type=int)
    a.add_argument("--width", type=int)
    a.add_argument("--mlp-ratio", type=int)
    a.add_argument("--vocab", type=int, help="default: the data's vocabulary (256)")
    a.add_argument("--seq-len", type=int)
    tied = a.add_mutually_exclusive_group()
    tied.add_argument("--tied", dest="tied", action="store_true", default=None)
    tied.add_argument("--untied", dest="tied", action="store_false")
    a.add_argument("--steps", type=int, default=150)
    a.add_argument("--batch", type=int, default=8)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--lr", type=float, default=1e-3)
    a.add_argument("--warmup", type=int, default=0)
    a.add_argument("--lr-decay", default="none", choices=["none", "constant", "cosine", "linear"])
    a.add_argument("--min-lr", type=float, default=0.0)
    a.add_argument("--weight-decay", type=float, default=0.01)
    a.add_argument("--decay-params", default="matrices", choices=["all", "matrices", "matrices+embeddings"],
                   help="train_gpt's default is matrices (an older train_gpt without the flag: all)")
    a.add_argument("--beta1", type=float, default=0.9)
    a.add_argument("--beta2", type=float, default=0.999)
    a.add_argument("--eps", type=float, default=1e-8)
    a.add_argument("--clip", type=float)
    a.add_argument("--eval-every", type=int, default=0)
    a.add_argument("--eval-fraction", type=float, default=0.1)
    a.add_argument("--eval-batches", type=int, default=4)
    a.add_argument("--init-from", help="start from this safetensors file (train_gpt's names)")
    a.add_argument("--out", default="train_gpt_torch_loss", help="writes OUT.csv (train_gpt's format)")
    # The twin's own.
    a.add_argument("--save-init", help="write the initial parameters here (safetensors, train_gpt's names)")
    a.add_argument("--init-only", action="store_true", help="only write --save-init, do not train")
    a.add_argument("--summary", help="write a JSON summary here (default OUT.json)")
    a.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a.add_argument("--attention", default="manual", choices=["manual", "sdpa"],
                   help="manual: softmax(QK^T/sqrt(d)) V as train_gpt; sdpa: torch's fused kernel")
    a.add_argument("--precision", default="f32", choices=["f32", "tf32", "bf16"],
                   help="f32; tf32 matmuls (CUDA); bf16 autocast (f32 master weights, loss in f32)")
    a.add_argument("--compile", action="store_true",
                   help="torch.compile the model's forward and loss (the step's backward follows the compiled graph)")
    a.add_argument("--timing-warmup", type=int, default=0,
                   help="the first N steps are left out of the step-time statistics (compilation, "
                        "allocator and cuBLAS warm-up); every step's time is still in step_ms_all")
    a.add_argument("--fingerprint", action="store_true",
                   help="also report Corpus::fingerprint of the training tokens (slow in Python)")
    a.add_argument("--count-kernels", action="store_true",
                   help="count the GPU kernels of the last step (torch.profiler, CUPTI underneath; "
                        "needs --steps >= 2 and CUDA), as train_gpt --count-kernels does")
    a.add_argument("--quiet", action="store_true")
    return a.parse_args(argv)


def model_config(args):
    cfg = dict(PRESETS[args.preset])
    for key in ("layers", "heads", "width", "mlp_ratio", "seq_len", "tied"):
        v = getattr(args, key)
        if v is not None:
            cfg[key] = v
    # train_gpt: with --data the data's vocabulary (256 byte tokens, rounded up to the TP
    # size, 1 here); a given --vocab must hold it. Without --data the preset's (or --vocab).
    if args.vocab is not None:
        cfg["vocab"] = args.vocab
    elif args.data:
        cfg["vocab"] = 256
    if args.data and cfg["vocab"] < 256:
        sys.exit(f"--vocab {cfg['vocab']} is smaller than the byte vocabulary 256")
    if cfg["heads"] <= 0 or cfg["width"] % cfg["heads"]:
        sys.exit(f"width {cfg['width']} is not divisible by {cfg['heads']} heads")
    return cfg


def count_kernels(prof, torch, top=30):
    """The GPU kernels in a finished torch.profiler run (its CUDA-device events less the
    memory copies and sets), their summed time and the `top` names by time (names cut to 120
    characters), as train_gpt --count-kernels reports them."""
    n, busy_us = 0, 0.0
    by_name = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset")):
            continue
        us = e.time_range.elapsed_us()
        n += 1
        busy_us += us
        name = e.name if len(e.name) <= 120 else e.name[:120] + "..."
        count, total = by_name.get(name, (0, 0.0))
        by_name[name] = (count + 1, total + us)
    ranked = sorted(by_name.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]
    return {"kernels_per_step": n, "kernel_ms_per_step": busy_us / 1e3, "source": "torch.profiler",
            "top": [{"name": k, "count": c, "ms": us / 1e3} for k, (c, us) in ranked]}


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    # tf32: float32 matmuls on TF32 tensor cores (10-bit mantissa inputs, f32 accumulation);
    # f32 and bf16 keep full f32 for the f32 matmuls (under bf16 autocast the GEMMs are bf16).
    tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if args.timing_warmup < 0 or args.timing_warmup >= max(args.steps, 1):
        sys.exit(f"--timing-warmup {args.timing_warmup}: must be >= 0 and less than --steps {args.steps}")
    if args.warmup > args.steps:
        sys.exit(f"lr schedule: warmup of {args.warmup} steps exceeds the {args.steps} steps of the run")
    cfg = model_config(args)
    log = (lambda *m: None) if args.quiet else (lambda *m: print(*m, file=sys.stderr, flush=True))

    if args.data:
        tokens, data_vocab = load_tokens(args.data), 256
    else:
        tokens, data_vocab = synthetic(cfg["vocab"], CORPUS_TOKENS, (args.seed ^ 0xC0FFEE) & M64), cfg["vocab"]
    if args.eval_every > 0:
        train, held = split(tokens, args.eval_fraction, cfg["seq_len"] + 1)
    else:
        train, held = tokens, None

    params = load_safetensors(args.init_from) if args.init_from else init_params(cfg, args.seed)
    want = {n: s for n, s, _ in param_shapes(cfg)}
    if set(params) != set(want):
        sys.exit(f"parameters {sorted(set(params) ^ set(want))} differ from the model's")
    for n, s in want.items():
        if list(params[n].shape) != s:
            sys.exit(f"parameter {n} is {list(params[n].shape)}, the model's is {s}")
    if args.save_init:
        save_safetensors(args.save_init, params)
        log(f"wrote {args.save_init} ({len(params)} tensors)")
        if args.init_only:
            return 0
    n_params = sum(t.numel() for t in params.values())
    p = {n: t.to(dev).requires_grad_(True) for n, t in params.items()}
    shapes = {n: list(t.shape) for n, t in p.items()}
    groups = [
        {"params": [p[n] for n in p if decays(args.decay_params, n, shapes[n])], "weight_decay": args.weight_decay},
        {"params": [p[n] for n in p if not decays(args.decay_params, n, shapes[n])], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)

    def loss_fn(ids, tgt):
        if args.precision == "bf16":
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                return forward_loss(p, cfg, ids, tgt, args.attention)
        return forward_loss(p, cfg, ids, tgt, args.attention)

    step_loss = torch.compile(loss_fn) if args.compile else loss_fn
    seq, bsz = cfg["seq_len"], args.batch

    def to_dev(xs, ys):
        x = torch.tensor(xs, dtype=torch.long).view(bsz, seq).to(dev)
        y = torch.tensor(ys, dtype=torch.long).view(bsz, seq).to(dev)
        return x, y

    def evaluate():
        total = 0.0
        n = max(args.eval_batches, 1)
        with torch.no_grad():
            for k in range(n):
                x, y = to_dev(*batch_ids(held, k, bsz, seq, EVAL_SEED))
                total += float(step_loss(x, y).item())
        return struct.unpack("<f", struct.pack("<f", total / n))[0]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    losses, lrs, evals, step_ms, eval_ms = [], [], [], [], []
    cuda = dev.type == "cuda"
    events = []  # (start, end) CUDA events per step: the device's time of each step
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    kernels = None
    if args.count_kernels and not cuda:
        kernels = {"error": "--count-kernels needs CUDA: the CPU runs no GPU kernels"}
    elif args.count_kernels and args.steps < 2:
        kernels = {"error": "--count-kernels counts the last step after at least one other: --steps >= 2"}
    prof = None
    sync()
    t_start = time.perf_counter()
    for step in range(args.steps):
        if kernels is None and args.count_kernels and step == args.steps - 1:
            # Only the last step runs under the profiler, after everything before finished.
            sync()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        if cuda:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        x, y = to_dev(*batch_ids(train, step, bsz, seq, args.seed))
        loss = step_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip is not None:
            with torch.no_grad():
                norm = math.sqrt(sum(float(q.grad.double().pow(2).sum()) for q in p.values() if q.grad is not None))
                if norm > args.clip:
                    scale = args.clip / (norm + 1e-6)
                    for q in p.values():
                        if q.grad is not None:
                            q.grad.mul_(scale)
        lr = lr_at(step, args.lr, args.warmup, args.lr_decay, args.steps, args.min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        if cuda:
            events[-1][1].record()
        value = float(loss.item())  # synchronizes
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            sync()
            prof.__exit__(None, None, None)
            kernels = count_kernels(prof, torch)
            prof = None
        losses.append(value)
        lrs.append(lr)
        done = step + 1
        if held is not None and ((args.eval_every > 0 and done % args.eval_every == 0) or done == args.steps):
            te = time.perf_counter()
            evals.append((done, evaluate()))
            eval_ms.append((time.perf_counter() - te) * 1e3)
            log(f"step {done}: loss {value:.4f} held-out {evals[-1][1]:.4f} ({step_ms[-1]:.0f} ms/step)")
        elif not math.isfinite(value):
            log(f"step {done}: loss {value}")
    sync()
    wall_s = time.perf_counter() - t_start

    ev = dict(evals)
    with open(f"{args.out}.csv", "w") as f:
        f.write("step,loss,eval_loss\n")
        for i, l in enumerate(losses):
            e = ev.get(i + 1)
            f.write(f"{i},{f32_str(l)},{'' if e is None else f32_str(e)}\n")
    timed = step_ms[args.timing_warmup :]
    gpu_ms = [a.elapsed_time(b) for a, b in events]
    stats = step_stats(timed)
    peak = None
    if cuda:
        peak = {
            "allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "reserved_bytes": torch.cuda.max_memory_reserved(dev),
        }

    summary = {
        "twin": "scripts/peers/train_gpt_torch.py",
        "torch": torch.__version__,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "attention": args.attention,
        "compile": args.compile,
        "model": cfg,
        "params": n_params,
        "steps": args.steps,
        "batch": bsz,
        "tokens_per_step": bsz * seq,
        "train_tokens": len(train),
        "eval_tokens": 0 if held is None else len(held),
        "losses": losses,
        "lrs": lrs,
        "eval_losses": [[d, l] for d, l in evals],
        "final_loss": losses[-1] if losses else None,
        "wall_s": wall_s,
        "eval_ms_total": sum(eval_ms),
        # Wall time per step (from taking the batch to the loss read back, which synchronizes);
        # statistics over the steps after --timing-warmup.
        "timing_warmup": args.timing_warmup,
        "step_ms": stats,
        "step_ms_all": step_ms,
        # CUDA events around the same span (null on the CPU).
        "gpu_step_ms": step_stats(gpu_ms[args.timing_warmup :]) if cuda else None,
        "tokens_per_s": (bsz * seq) / (stats["median"] / 1e3) if stats["median"] else None,
        "peak_memory": peak,
        "peak_rss_bytes": peak_rss_bytes(),
        # --count-kernels: the last step's GPU kernels (null without the flag).
        "kernels": kernels,
    }
    if args.fingerprint:
        summary["train_fingerprint"] = str(fingerprint(train, data_vocab))
    with open(args.summary or f"{args.out}.json", "w") as f:
        json.dump(summary, f, indent=1)
    log(f"wrote {args.out}.csv; {args.steps} steps in {wall_s:.1f} s, final loss {losses[-1] if losses else None}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
