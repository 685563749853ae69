#!/usr/bin/env python3
"""Compares two loss CSVs in train_gpt's format (`step,loss,eval_loss`): ours (train_gpt) and a
twin's (scripts/peers/train_gpt_torch.py). Writes a JSON summary and one SVG with both held-out
curves and both training curves, prints a Markdown table of the evaluations, and exits 1 when a
held-out loss differs from the twin's by more than --tol (relative, |ours - twin| / |twin|) at
any evaluation, when the evaluations are not at the same steps, or when a value is not finite.
Standard library only.

Usage:
  compare_curves.py --ours ours.csv --twin twin.csv [--tol 0.02] [--json out.json] [--svg out.svg]
                    [--title TEXT] [--meta meta.json] [--early 20]

--meta: a JSON object merged into the summary (commands, wall times, machine).
"""

import argparse
import json
import math
import sys


def read_csv(path):
    """(losses by step, [(steps done, eval loss)]) of a train_gpt loss CSV."""
    losses, evals = {}, []
    with open(path) as f:
        header = f.readline().strip()
        if header != "step,loss,eval_loss":
            sys.exit(f"{path}: header {header!r}, expected 'step,loss,eval_loss'")
        for n, line in enumerate(f, start=2):
            line = line.strip()
            if not line:
                continue
            parts = line.split(",")
            if len(parts) != 3:
                sys.exit(f"{path}: line {n}: {line!r} is not step,loss,eval_loss")
            step = int(parts[0])
            losses[step] = float(parts[1])
            if parts[2]:
                evals.append((step + 1, float(parts[2])))
    return losses, evals


def rel(a, b):
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b != 0 else (0.0 if a == 0 else math.inf)


def svg(path, title, ours, twin, ours_ev, twin_ev, tol):
    """Two panels: losses (train thin, held-out thick with markers) and the held-out relative
    difference against the tolerance."""
    w, h1, h2, ml, mr, mt = 930, 380, 150, 70, 260, 40
    pw = w - ml - mr
    steps = sorted(set(ours) | set(twin))
    smax = max(steps[-1] + 1, 1)
    vals = [v for v in list(ours.values()) + list(twin.values()) + [e for _, e in ours_ev + twin_ev]
            if math.isfinite(v)]
    lo, hi = min(vals), max(vals)
    lo, hi = max(0.0, lo - 0.05 * (hi - lo)), hi + 0.05 * (hi - lo)
    x = lambda s: ml + pw * s / smax
    y = lambda v: mt + h1 * (1 - (v - lo) / (hi - lo if hi > lo else 1))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{mt + h1 + 60 + h2 + 50}" '
           f'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{ml}" y="22" font-size="14">{esc(title)}</text>']
    # Axes and grid of the loss panel.
    for i in range(6):
        v = lo + (hi - lo) * i / 5
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ml - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i in range(6):
        s = smax * i / 5
        out.append(f'<text x="{x(s):.1f}" y="{mt + h1 + 16}" text-anchor="middle">{int(s)}</text>')
    out.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{h1}" fill="none" stroke="#444"/>')
    out.append(f'<text x="{ml + pw / 2}" y="{mt + h1 + 32}" text-anchor="middle">step</text>')
    out.append(f'<text x="16" y="{mt + h1 / 2}" transform="rotate(-90 16 {mt + h1 / 2})" '
               f'text-anchor="middle">loss (nats/byte)</text>')

    def poly(points, color, width, dash=""):
        pts = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points if math.isfinite(v))
        d = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{d} points="{pts}"/>'

    ours_c, twin_c = "#1f5fbf", "#d9541e"
    out.append(poly([(s + 1, v) for s, v in sorted(ours.items())], "#9bb7e6", 0.8))
    out.append(poly([(s + 1, v) for s, v in sorted(twin.items())], "#f0b79c", 0.8, "3,2"))
    out.append(poly(ours_ev, ours_c, 2.2))
    out.append(poly(twin_ev, twin_c, 2.2, "6,3"))
    for s, v in ours_ev:
        out.append(f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3.5" fill="{ours_c}"/>')
    for s, v in twin_ev:
        out.append(f'<rect x="{x(s) - 3:.1f}" y="{y(v) - 3:.1f}" width="6" height="6" fill="none" '
                   f'stroke="{twin_c}" stroke-width="1.5"/>')
    legend = [(ours_c, 2.2, "", "train_gpt held-out"), (twin_c, 2.2, "6,3", "PyTorch twin held-out"),
              ("#9bb7e6", 1.5, "", "train_gpt train (per step)"),
              ("#f0b79c", 1.5, "3,2", "PyTorch twin train (per step)")]
    for i, (c, wd, dash, label) in enumerate(legend):
        ly = mt + 14 + 18 * i
        d = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{ml + pw + 12}" x2="{ml + pw + 40}" y1="{ly}" y2="{ly}" stroke="{c}" '
                   f'stroke-width="{wd}"{d}/>')
        out.append(f'<text x="{ml + pw + 46}" y="{ly + 4}">{esc(label)}</text>')
    # The relative difference panel (log scale: agreement spans many decades).
    t2 = mt + h1 + 60
    twin_map = dict(twin_ev)
    diffs = [(s, rel(v, twin_map[s])) for s, v in ours_ev if s in twin_map]
    finite = [d for _, d in diffs if math.isfinite(d) and d > 0]
    top = math.ceil(math.log10(max([tol * 2] + finite)))
    bottom = min(math.floor(math.log10(min(finite))) if finite else top - 4, top - 2)
    floor_d = 10.0 ** bottom
    y2 = lambda d: t2 + h2 * (1 - (math.log10(min(max(d, floor_d), 10.0 ** top)) - bottom) / (top - bottom))
    out.append(f'<rect x="{ml}" y="{t2}" width="{pw}" height="{h2}" fill="none" stroke="#444"/>')
    out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y2(tol):.1f}" y2="{y2(tol):.1f}" stroke="#c00" '
               f'stroke-dasharray="4,3"/>')
    out.append(f'<text x="{ml + pw + 6}" y="{y2(tol) + 4:.1f}" fill="#c00">tolerance {tol:g}</text>')
    step_e = max(1, (top - bottom + 4) // 5)
    for e in range(bottom, top + 1, step_e):
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y2(10.0 ** e):.1f}" y2="{y2(10.0 ** e):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{ml - 6}" y="{y2(10.0 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    out.append(f'<text x="16" y="{t2 + h2 / 2}" transform="rotate(-90 16 {t2 + h2 / 2})" '
               f'text-anchor="middle">held-out rel. diff</text>')
    out.append(f'<text x="{ml + pw + 6}" y="{t2 + h2 - 2}" fill="#555">(equal: drawn at 1e{bottom})</text>')
    pts = " ".join(f"{x(s):.1f},{y2(d):.1f}" for s, d in diffs if math.isfinite(d))
    out.append(f'<polyline fill="none" stroke="#333" stroke-width="1.5" points="{pts}"/>')
    for s, d in diffs:
        out.append(f'<circle cx="{x(s):.1f}" cy="{y2(d):.1f}" r="3" fill="#333"/>')
    for i in range(6):
        s = smax * i / 5
        out.append(f'<text x="{x(s):.1f}" y="{t2 + h2 + 16}" text-anchor="middle">{int(s)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main(argv=None):
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--ours", required=True)
    a.add_argument("--twin", required=True)
    a.add_argument("--tol", type=float, default=0.02)
    a.add_argument("--early", type=int, default=20, help="steps of the early-agreement report")
    a.add_argument("--json")
    a.add_argument("--svg")
    a.add_argument("--title", default="train_gpt vs PyTorch twin")
    a.add_argument("--meta", help="JSON object merged into the summary")
    args = a.parse_args(argv)

    ours, ours_ev = read_csv(args.ours)
    twin, twin_ev = read_csv(args.twin)
    errors = []
    if sorted(ours) != sorted(twin):
        errors.append(f"steps differ: ours {len(ours)} rows, twin {len(twin)} rows")
    if [s for s, _ in ours_ev] != [s for s, _ in twin_ev]:
        errors.append(f"evaluations at different steps: ours {[s for s, _ in ours_ev]}, "
                      f"twin {[s for s, _ in twin_ev]}")
    if not ours_ev:
        errors.append("no held-out evaluations (run with --eval-every)")
    common = sorted(set(ours) & set(twin))
    step_rel = [rel(ours[s], twin[s]) for s in common]
    twin_map = dict(twin_ev)
    evals = []
    for s, v in ours_ev:
        if s not in twin_map:
            continue
        r = rel(v, twin_map[s])
        evals.append({"step": s, "ours": v, "twin": twin_map[s], "rel_diff": r, "within_tol": r <= args.tol})
        if not r <= args.tol:
            errors.append(f"held-out loss after {s} steps: ours {v}, twin {twin_map[s]}, "
                          f"relative difference {r:.3g} > {args.tol:g}")
    early = step_rel[: args.early]
    summary = {
        "ours_csv": args.ours,
        "twin_csv": args.twin,
        "tol": args.tol,
        "steps": len(common),
        "first_step": {"ours": ours.get(0), "twin": twin.get(0),
                       "rel_diff": step_rel[0] if step_rel else None},
        f"max_rel_diff_first_{args.early}_steps": max(early) if early else None,
        "max_rel_diff_train_all_steps": max(step_rel) if step_rel else None,
        "mean_rel_diff_train_all_steps": sum(step_rel) / len(step_rel) if step_rel else None,
        "evals": evals,
        "max_rel_diff_eval": max((e["rel_diff"] for e in evals), default=None),
        "passed": not errors,
        "errors": errors,
    }
    if args.meta:
        with open(args.meta) as f:
            summary.update(json.load(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=lambda o: None)
    if args.svg:
        svg(args.svg, args.title, ours, twin, ours_ev, twin_ev, args.tol)

    fs = summary["first_step"]
    if step_rel:
        print(f"first step: ours {fs['ours']}, twin {fs['twin']}, relative difference {fs['rel_diff']:.3g}")
        print(f"first {len(early)} steps: max relative difference {max(early):.3g}; all {len(step_rel)} "
              f"steps: max {max(step_rel):.3g}, mean {summary['mean_rel_diff_train_all_steps']:.3g}")
    print()
    print("| after step | train_gpt held-out | PyTorch twin held-out | relative difference |")
    print("|---:|---:|---:|---:|")
    for e in evals:
        print(f"| {e['step']} | {e['ours']:.4f} | {e['twin']:.4f} | {100 * e['rel_diff']:.3f}% |")
    print()
    if errors:
        for e in errors:
            print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print(f"held-out loss within {100 * args.tol:g}% of the twin's at all {len(evals)} evaluations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
