#!/usr/bin/env python3
"""Turns scripts/gpu_bench.sh's JSON (gpu_bench.json) into the Markdown of BENCHMARKS.md: the
header (date, GPU, commit, measured GEMM rates), one row per preset and precision with train_gpt
("ours") beside the PyTorch twin in eager mode and under torch.compile, the issue-33 targets
with a verdict each, and the real-text run. Standard library only.

Usage: gpu_bench_report.py gpu_bench.json [--out table.md]

Definitions (the same for every side; computed here from the raw figures the JSON keeps):
  step ms       median, p10 and p90 of the step wall times after the warm-up steps (nearest
                rank: the value at index floor(q * n) of the sorted times)
  tokens/s      batch x sequence length / median step time
  FLOPs/token   6 N + 12 L T D (N parameters, L layers, T sequence length, D width)
  MFU           tokens/s x FLOPs/token / the bf16 GEMM rate measured in the same run
  ours/eager    ours' tokens/s over eager's (above 1: ours is faster); likewise ours/compile
  peak GiB      on CUDA the device's memory.used (nvidia-smi, sampled every second) above its
                value before the run, CUDA context and caching pools included, the same for
                every side; on the CPU the process's peak resident set
A run that failed, timed out or was skipped shows its status instead of figures, and a target
that depends on it reads "not measured".
"""

import argparse
import json
import math
import sys

SIDES = ("ours", "eager", "compile")
# Ours again with the linears' GEMMs off cuBLASLt (CDT_CUBLASLT=0: candle's GEMM plus the bias,
# cast and column-sum passes): what the cuBLASLt epilogues gain, measured in the same run.
# Ours again with cudarc's two events on every buffer (CDT_CUDA_BUFFER_EVENTS=1), which
# train_gpt otherwise skips: what skipping them gains.
EXTRA_SIDES = ("ours-nolt", "ours-events")
PRESET_ORDER = ("tiny", "small", "gpt2", "gpt2-medium")
PRECISION_ORDER = ("f32", "tf32", "bf16")


def step_stats(ms):
    """Median, p10, p90 (nearest rank, as train_gpt's median: index floor(q * n) of the sorted
    list) and the count of a list of step times; None figures for an empty list."""
    if not ms:
        return {"median": None, "p10": None, "p90": None, "n": 0}
    s = sorted(ms)

    def pct(q):
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"median": pct(0.5), "p10": pct(0.1), "p90": pct(0.9), "n": len(s)}


def flops_per_token(params, layers, seq_len, width):
    """Training FLOPs per token: 6 N for the parameters' forward and backward matmuls plus
    12 L T D for attention's scores and weighted sum (PaLM's appendix B; train_gpt's)."""
    return 6.0 * params + 12.0 * layers * seq_len * width


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def derive(run, gemm_flops):
    """The figures of one run record: step stats, tokens/s and MFU (None where not measured)."""
    if run.get("status") != "ok":
        return None
    st = step_stats(run.get("step_ms_measured") or [])
    med = st["median"]
    if not finite(med):
        return None
    tps = run["batch"] * run["seq_len"] / (med / 1e3)
    fpt = flops_per_token(run["params"], run["layers"], run["seq_len"], run["width"])
    return {
        "step_ms": st,
        # Only the median of all steps, warm-up included (train_gpt run with --log-every 0
        # and no per-step list in its summary).
        "warmup_included": "WARM-UP INCLUDED" in (run.get("timing_source") or ""),
        "tokens_per_s": tps,
        "flops_per_token": fpt,
        "mfu": tps * fpt / gemm_flops if finite(gemm_flops) else None,
        "peak_mem_bytes": run.get("peak_mem_bytes"),
    }


def gemm_rate(doc, dtype="bf16"):
    """The measured GEMM rate in FLOP/s (None when the measurement failed)."""
    g = doc.get("gemm") or {}
    v = (g.get("tflops") or {}).get(dtype)
    return v * 1e12 if finite(v) else None


def table(doc):
    """{(preset, precision): {side: (run, figures or None)}} in a stable order."""
    gemm = gemm_rate(doc)
    rows = {}
    for run in doc.get("runs", []):
        key = (run["preset"], run["precision"])
        rows.setdefault(key, {})[run["side"]] = (run, derive(run, gemm))

    def order(k):
        p, q = k
        return (PRESET_ORDER.index(p) if p in PRESET_ORDER else 99, p,
                PRECISION_ORDER.index(q) if q in PRECISION_ORDER else 99, q)

    return {k: rows[k] for k in sorted(rows, key=order)}


def ratio(a, b):
    if a is None or b is None:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def fmt_ms(f):
    s = f["step_ms"]
    if f.get("warmup_included"):
        return f"{s['median']:.1f} (median of all steps, warm-up included)"
    return f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})"


def fmt_mem(b):
    return "-" if not finite(b) else f"{b / 2**30:.2f}"


def cell(side_entry, what):
    if side_entry is None:
        return "not run"
    run, f = side_entry
    if f is None:
        status = run.get("status", "?")
        return status if status != "ok" else "no step times"
    if what == "ms":
        return fmt_ms(f)
    if what == "tps":
        return f"{f['tokens_per_s']:,.0f}"
    if what == "mfu":
        return "-" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
    if what == "mem":
        return fmt_mem(f["peak_mem_bytes"])
    raise ValueError(what)


def device_cell(side_entry, what):
    """GPU time, kernel counts and host reads of a run (recorded by gpu_bench.py; "-" when the
    run has no such figure, with the counter's error when counting failed)."""
    if side_entry is None:
        return "not run"
    run, _ = side_entry
    if what == "gpu":
        v = run.get("gpu_step_ms_median")
        return f"{v:.1f}" if finite(v) else "-"
    if what == "reads":
        v = run.get("host_reads_per_step")
        return str(v) if v is not None else "-"
    k = run.get("kernels")
    if not isinstance(k, dict):
        return "-"
    if "error" in k:
        return "error: " + str(k["error"])[:60]
    v = k.get("kernels_per_step" if what == "kernels" else "kernel_ms_per_step")
    if not finite(v):
        return "-"
    return f"{v:.0f}" if what == "kernels" else f"{v:.1f}"


def shape_of(sides):
    run = next(iter(sides.values()))[0]
    return f"{run.get('batch')} x {run.get('seq_len')}"


def fmt_ratio(r):
    return "-" if r is None else f"{r:.2f}x"


def targets(doc):
    """The issue-33 targets this run measures: [(target, verdict, detail)], verdict one of
    'met', 'not met', 'not measured'."""
    t = table(doc)

    def fig(preset, prec, side):
        e = t.get((preset, prec), {}).get(side)
        return None if e is None else e[1]

    out = []

    def ratio_target(name, preset, prec, side, at_least):
        a, b = fig(preset, prec, "ours"), fig(preset, prec, side)
        r = ratio(a, b)
        if r is None:
            out.append((name, "not measured", f"{preset} {prec}: ours or {side} has no figure"))
        else:
            out.append((name, "met" if r >= at_least else "not met",
                        f"ours/{side} tokens/s = {r:.2f} (needs >= {at_least:g})"))

    ratio_target("gpt2 bf16: tokens/s >= PyTorch eager", "gpt2", "bf16", "eager", 1.0)
    ratio_target("gpt2 bf16: tokens/s >= 0.8x torch.compile", "gpt2", "bf16", "compile", 0.8)
    m = fig("gpt2-medium", "bf16", "ours")
    if m is None or m["mfu"] is None:
        out.append(("gpt2-medium bf16: MFU >= 40%", "not measured",
                    "no ours figure or no measured bf16 GEMM rate"))
    else:
        out.append(("gpt2-medium bf16: MFU >= 40%", "met" if m["mfu"] >= 0.40 else "not met",
                    f"MFU {100 * m['mfu']:.1f}%"))
    ratio_target("gpt2 f32: tokens/s >= PyTorch eager", "gpt2", "f32", "eager", 1.0)
    ratio_target("gpt2 tf32: tokens/s >= PyTorch eager", "gpt2", "tf32", "eager", 1.0)
    # small: step time within 1.5x of eager's, in every precision measured.
    found = False
    for prec in PRECISION_ORDER:
        a, b = fig("small", prec, "ours"), fig("small", prec, "eager")
        if a is None or b is None:
            continue
        found = True
        q = a["step_ms"]["median"] / b["step_ms"]["median"]
        out.append((f"small {prec}: step time <= 1.5x PyTorch eager", "met" if q <= 1.5 else "not met",
                    f"ours/eager step ms = {q:.2f}"))
    if not found:
        out.append(("small: step time <= 1.5x PyTorch eager", "not measured", "no small pair"))
    rt = doc.get("real_text")
    if not rt or rt.get("status") != "ok" or rt.get("max_rel_diff_eval") is None:
        out.append(("real run: held-out loss within 2% of the twin's", "not measured",
                    "no real-text run" if not rt else f"real-text run {rt.get('status')}: {rt.get('error', '')}"))
    else:
        d = rt["max_rel_diff_eval"]  # NaN compares false: not met
        out.append(("real run: held-out loss within 2% of the twin's",
                    "met" if d <= 0.02 else "not met", f"max relative difference {d:.3g}"))
    return out


def attention_lines(att):
    """The attention comparison (ours: examples/attn_bench.rs; torch's SDPA) as Markdown lines:
    one row per shape, medians in ms, ours over torch (above 1: ours slower), TFLOP/s."""
    if not att:
        return []
    lines = ["", f"Attention alone ({att.get('dtype', '?')}, {'causal' if att.get('causal') else 'not causal'}; ours: "
                 f"{(att.get('ours') or {}).get('kernels', '?')}; torch: scaled_dot_product_attention):"]
    sides = {k: att.get(k) or {} for k in ("ours", "torch")}
    for k, r in sides.items():
        if r.get("status") != "ok":
            lines.append(f"- {k}: {r.get('status', 'missing')}: {r.get('error', '')}")
    cases = {k: {(c["b"], c["h"], c["t"], c["d"]): c for c in r.get("cases", [])} for k, r in sides.items()
             if r.get("status") == "ok"}
    shapes = list(dict.fromkeys(list(cases.get("ours", {})) + list(cases.get("torch", {}))))
    if not shapes:
        return lines
    lines.append("")
    lines.append("| B, H, T, D | forward ms: ours | torch | ours/torch | forward + backward ms: ours | torch "
                 "| ours/torch | TFLOP/s fwd+bwd: ours | torch |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def med(side, shape, key):
        c = cases.get(side, {}).get(shape)
        return None if c is None else (c.get(key) or {}).get("median")

    def num(x, f="{:.3f}"):
        return "-" if not finite(x) else f.format(x)

    def ratio_cells(sh, keys):
        row = []
        for key in keys:
            o, t = med("ours", sh, key), med("torch", sh, key)
            row += [num(o), num(t), fmt_ratio(o / t if finite(o) and finite(t) and t > 0 else None)]
        return row

    for sh in shapes:
        row = [", ".join(str(x) for x in sh)] + ratio_cells(sh, ("forward_ms", "forward_backward_ms"))
        for side in ("ours", "torch"):
            c = cases.get(side, {}).get(sh) or {}
            row.append(num(c.get("forward_backward_tflops"), "{:.3g}"))
        lines.append("| " + " | ".join(row) + " |")
    packed = ("packed_forward_ms", "packed_forward_backward_ms")
    if any(med(side, sh, packed[0]) is not None for side in ("ours", "torch") for sh in shapes):
        lines.append("")
        lines.append("Packed, as a GPT layer runs it: the QKV projection [B, T, H, 3, D] in, [B, T, H, D] out "
                     "(ours: one node reading and writing them in place; torch: unbind, transposes, SDPA, "
                     "a contiguous copy of the output):")
        lines.append("")
        lines.append("| B, H, T, D | forward ms: ours | torch | ours/torch | forward + backward ms: ours | torch "
                     "| ours/torch |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        for sh in shapes:
            lines.append("| " + " | ".join([", ".join(str(x) for x in sh)] + ratio_cells(sh, packed)) + " |")
    return lines


TOP_ROWS = 12


def top_kernels_lines(rows, n=TOP_ROWS):
    """Where a step's GPU time goes: for each preset and precision whose run of ours names its
    kernels (train_gpt --count-kernels: CUPTI's records of the last step), ours and the eager
    twin's (torch.profiler) kernels by GPU time side by side, n rows, the names shortened to
    60 characters. Empty when no run has names."""
    out = []
    for (preset, prec), sides in rows.items():
        tops = {}
        for side in ("ours", "eager"):
            entry = sides.get(side)
            k = entry[0].get("kernels") if entry else None
            if isinstance(k, dict) and k.get("top"):
                tops[side] = k["top"]
        if "ours" not in tops:
            continue
        out.append("")
        out.append(f"Where the GPU time of a {preset} {prec} step goes (its last step; kernels by GPU "
                   f"time, count x, ms):")
        out.append("")
        out.append("| # | ours | x | ms | eager | x | ms |")
        out.append("|---:|---|---:|---:|---|---:|---:|")

        def part(side, i):
            t = tops.get(side, [])
            if i >= len(t):
                return "| | |"
            e = t[i]
            name = str(e.get("name", "?")).replace("|", "/")
            if len(name) > 60:
                name = name[:57] + "..."
            ms = e.get("ms")
            return f"`{name}` | {e.get('count', '?')} | {ms:.3f}" if finite(ms) else f"`{name}` | ? | ?"

        rows_n = min(n, max(len(t) for t in tops.values()))
        for i in range(rows_n):
            out.append(f"| {i + 1} | {part('ours', i)} | {part('eager', i)} |")
    return out


def extra_side_lines(rows, side, intro, ours_name, side_name):
    """Ours beside ours under a switch (an extra side), for each preset and precision where
    that side ran; empty when it ran nowhere."""
    pairs = [(k, s) for k, s in rows.items() if side in s]
    if not pairs:
        return []
    out = ["", intro, "",
           f"| preset | precision | step ms: {ours_name} | {side_name} | {side_name} / {ours_name} |",
           "|---|---|---|---|---:|"]
    for (preset, prec), sides in pairs:
        a, b = sides.get("ours"), sides.get(side)
        fa, fb = (None if a is None else a[1]), (None if b is None else b[1])
        # tokens/s with over without: above 1, ours as train_gpt runs it is faster.
        out.append(f"| {preset} | {prec} | {cell(a, 'ms')} | {cell(b, 'ms')} | {fmt_ratio(ratio(fa, fb))} |")
    return out


def markdown(doc):
    lines = []
    g = doc.get("gemm") or {}
    tf = g.get("tflops") or {}
    rates = ", ".join(f"{k} {v:.4g}" for k, v in tf.items() if finite(v)) or f"not measured ({g.get('error', 'no record')})"
    lines.append(f"GPU benchmark, {doc.get('date', '?')}: {doc.get('gpu', '?')} (device {doc.get('device', '?')}), "
                 f"commit {doc.get('commit', '?')}, torch {doc.get('torch', '?')}.")
    lines.append(f"Measured GEMM rate ({g.get('size', '?')}^3 matmuls), TFLOP/s: {rates}. "
                 f"Steps per run: {doc.get('warmup', '?')} warm-up + {doc.get('steps', '?')} measured.")
    lines.append("")
    rows = table(doc)
    # Two tables of the same rows: speed (step time and the ratios), then throughput, MFU, memory.
    lines.append("| preset | precision | batch x T | step ms median (p10-p90): ours | eager | compile "
                 "| ours/eager | ours/compile |")
    lines.append("|---|---|---|---|---|---|---:|---:|")
    for (preset, prec), sides in rows.items():
        e = [sides.get(s) for s in SIDES]
        f = [None if x is None else x[1] for x in e]
        lines.append(f"| {preset} | {prec} | {shape_of(sides)} | " + " | ".join(cell(x, "ms") for x in e)
                     + f" | {fmt_ratio(ratio(f[0], f[1]))} | {fmt_ratio(ratio(f[0], f[2]))} |")
    lines.append("")
    lines.append("| preset | precision | tokens/s: ours | eager | compile | MFU: ours | eager | compile "
                 "| peak GiB: ours | eager | compile |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (preset, prec), sides in rows.items():
        e = [sides.get(s) for s in SIDES]
        lines.append(f"| {preset} | {prec} | " + " | ".join(cell(x, w) for w in ("tps", "mfu", "mem") for x in e) + " |")
    lines.append("")
    lines.append("| preset | precision | GPU ms per step: ours | eager | compile | kernels in a step: ours "
                 "| eager | compile | kernel ms in a step: ours | eager | compile | host reads per step: ours |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (preset, prec), sides in rows.items():
        e = [sides.get(s) for s in SIDES]
        lines.append(f"| {preset} | {prec} | " + " | ".join(device_cell(x, w) for w in ("gpu", "kernels", "kernel_ms")
                                                         for x in e)
                     + f" | {device_cell(e[0], 'reads')} |")
    failed = [r for r in doc.get("runs", []) if r.get("status") != "ok"]
    if failed:
        lines.append("")
        lines.append("Runs without figures:")
        for r in failed:
            lines.append(f"- {r['preset']} {r['precision']} {r['side']}: {r.get('status')}"
                         f"{': ' + r['error'] if r.get('error') else ''}")
    lines += extra_side_lines(
        rows, "ours-nolt",
        "The linears on cuBLASLt (bias and bias-gradient epilogues, f32 written from bf16) against "
        "candle's GEMM and separate passes (`CDT_CUBLASLT=0`), ours both times:", "with", "without")
    lines += extra_side_lines(
        rows, "ours-events",
        "Buffers without cudarc's two per-buffer events (train_gpt's default) against with them "
        "(`CDT_CUDA_BUFFER_EVENTS=1`: `cuEventCreate` twice per allocation, `cuEventDestroy` twice "
        "per free), ours both times:", "skipped", "kept")
    lines += top_kernels_lines(rows)
    lines += attention_lines(doc.get("attention"))
    rt = doc.get("real_text")
    if rt:
        lines.append("")
        if rt.get("status") != "ok":
            lines.append(f"Real text: {rt.get('status')}: {rt.get('error', '')}")
        else:
            w = rt.get("wall_s", {})
            lines.append(f"Real text ({rt.get('text_bytes', '?')} bytes, {rt.get('steps')} steps, batch "
                         f"{rt.get('batch')} x {rt.get('seq_len')}, {rt.get('precision')}): wall time ours "
                         f"{w.get('ours', float('nan')):.1f} s, twin {w.get('twin', float('nan')):.1f} s; "
                         f"largest held-out relative difference {rt.get('max_rel_diff_eval'):.3g}.")
            lines.append("")
            lines.append("| after step | ours held-out loss | twin held-out loss | relative difference |")
            lines.append("|---:|---:|---:|---:|")
            for ev in rt.get("evals", []):
                lines.append(f"| {ev['step']} | {ev['ours']} | {ev['twin']} | {ev['rel_diff']:.2g} |")
    lines.append("")
    lines.append("| target (issue 33) | verdict | figure |")
    lines.append("|---|---|---|")
    for name, verdict, detail in targets(doc):
        lines.append(f"| {name} | {verdict} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("json")
    a.add_argument("--out", help="also write the Markdown here")
    args = a.parse_args(argv)
    with open(args.json) as f:
        doc = json.load(f)
    md = markdown(doc)
    sys.stdout.write(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
