#!/usr/bin/env python3
"""Checks of the GPU benchmark's report (gpu_bench_report.py) on a synthetic JSON, and of its
driver (gpu_bench.py) against a fake train_gpt that succeeds, runs out of memory or hangs.

Usage: python3 scripts/peers/test_gpu_bench.py   (standard library only: the driver's twin runs
are left out here; scripts/gpu_bench.sh --device cpu --quick runs them for real)
"""

import json
import math
import os
import stat
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as drv  # noqa: E402
import gpu_bench_report as rep  # noqa: E402
import train_gpt_torch as twin  # noqa: E402


def n_params(preset):
    return sum(math.prod(s) for _, s, _ in twin.param_shapes(twin.PRESETS[preset]))


def run(preset, precision, side, ms, status="ok", batch=8, error=None):
    cfg = twin.PRESETS[preset]
    params = n_params(preset)
    r = {"id": f"{preset}.{precision}.{side}", "preset": preset, "precision": precision, "side": side,
         "batch": batch, "seq_len": cfg["seq_len"], "layers": cfg["layers"], "width": cfg["width"],
         "params": params, "status": status, "error": error, "peak_mem_bytes": 3 * 2**30}
    if status == "ok":
        r["step_ms_measured"] = ms
    return r


def doc(runs, gemm_tflops=500.0, real=None):
    d = {"date": "2026-12-06T00:00:00Z", "gpu": "NVIDIA H200", "device": "cuda", "commit": "abc1234",
         "torch": "2.11.0", "steps": 30, "warmup": 5, "runs": runs,
         "gemm": {"size": 8192, "status": "ok", "tflops": {"bf16": gemm_tflops, "tf32": 300.0, "f32": 50.0}}}
    if real is not None:
        d["real_text"] = real
    return d


def verdicts(d):
    return {name: v for name, v, _ in rep.targets(d)}


class Report(unittest.TestCase):
    def test_step_stats_nearest_rank_as_train_gpt_and_the_twin(self):
        ms = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
        self.assertEqual(rep.step_stats(ms), {"median": 6.0, "p10": 2.0, "p90": 10.0, "n": 10})
        self.assertEqual(rep.step_stats(ms), twin.step_stats(ms))
        self.assertEqual(rep.step_stats([]), {"median": None, "p10": None, "p90": None, "n": 0})

    def test_gpt2_parameters_and_flops(self):
        # V D + T D + L (12 D^2 + 13 D) + 2 D with a tied head: GPT-2 small padded to 50304.
        v, t, d, layers = 50304, 1024, 768, 12
        n = v * d + t * d + layers * (12 * d * d + 13 * d) + 2 * d
        self.assertEqual(n, 124_475_904)
        self.assertEqual(n_params("gpt2"), n)
        self.assertEqual(rep.flops_per_token(n, layers, t, d), 6 * n + 12 * layers * t * d)

    def test_ratios_mfu_and_targets(self):
        runs = [run("gpt2", "bf16", "ours", [100.0] * 30), run("gpt2", "bf16", "eager", [80.0] * 30),
                run("gpt2", "bf16", "compile", [50.0] * 30)]
        d = doc(runs)
        row = rep.table(d)[("gpt2", "bf16")]
        ours = row["ours"][1]
        self.assertAlmostEqual(ours["tokens_per_s"], 8 * 1024 / 0.1)
        fpt = rep.flops_per_token(124_475_904, 12, 1024, 768)
        self.assertAlmostEqual(ours["mfu"], 8 * 1024 / 0.1 * fpt / 500e12)
        md = rep.markdown(d)
        self.assertIn("| gpt2 | bf16 | 8 x 1024 | 100.0 (100.0-100.0) | 80.0 (80.0-80.0) | 50.0 (50.0-50.0) "
                      "| 0.80x | 0.50x |", md)
        mfu = [f"{100 * 8 * 1024 / (ms / 1e3) * fpt / 500e12:.1f}%" for ms in (100, 80, 50)]
        self.assertIn(f"| gpt2 | bf16 | 81,920 | 102,400 | 163,840 | {' | '.join(mfu)} | 3.00 | 3.00 | 3.00 |", md)
        v = verdicts(d)
        self.assertEqual(v["gpt2 bf16: tokens/s >= PyTorch eager"], "not met")
        self.assertEqual(v["gpt2 bf16: tokens/s >= 0.8x torch.compile"], "not met")
        self.assertEqual(v["gpt2-medium bf16: MFU >= 40%"], "not measured")
        self.assertEqual(v["real run: held-out loss within 2% of the twin's"], "not measured")
        # Faster than both: met (0.8x compile exactly is met).
        runs[0]["step_ms_measured"] = [62.5] * 30
        v = verdicts(doc(runs))
        self.assertEqual(v["gpt2 bf16: tokens/s >= PyTorch eager"], "met")
        self.assertEqual(v["gpt2 bf16: tokens/s >= 0.8x torch.compile"], "met")

    def test_medium_mfu_and_small_step_ratio(self):
        # gpt2-medium: 8 x 1024 tokens in 100 ms against a 400 TFLOP/s GEMM rate.
        n = n_params("gpt2-medium")
        mfu = 81920 * rep.flops_per_token(n, 24, 1024, 1024) / 400e12
        d = doc([run("gpt2-medium", "bf16", "ours", [100.0] * 5),
                 run("small", "f32", "ours", [30.0] * 5), run("small", "f32", "eager", [20.0] * 5),
                 run("small", "bf16", "ours", [31.0] * 5), run("small", "bf16", "eager", [20.0] * 5)],
                gemm_tflops=400.0)
        v = verdicts(d)
        self.assertEqual(v["gpt2-medium bf16: MFU >= 40%"], "met" if mfu >= 0.4 else "not met")
        self.assertIn(f"MFU {100 * mfu:.1f}%", dict((k, f) for k, _, f in rep.targets(d))["gpt2-medium bf16: MFU >= 40%"])
        self.assertEqual(v["small f32: step time <= 1.5x PyTorch eager"], "met")
        self.assertEqual(v["small bf16: step time <= 1.5x PyTorch eager"], "not met")

    def test_failed_runs_and_missing_gemm(self):
        runs = [run("gpt2", "bf16", "ours", None, status="oom", error="CUDA_ERROR_OUT_OF_MEMORY"),
                run("gpt2", "bf16", "eager", [80.0] * 3), run("gpt2", "bf16", "compile", None, status="timeout")]
        d = doc(runs)
        d["gemm"] = {"size": 8192, "status": "failed", "error": "exit 1: boom"}
        md = rep.markdown(d)
        self.assertIn("| gpt2 | bf16 | 8 x 1024 | oom | 80.0 (80.0-80.0) | timeout |", md)
        self.assertIn("- gpt2 bf16 ours: oom: CUDA_ERROR_OUT_OF_MEMORY", md)
        self.assertIn("not measured (exit 1: boom)", md)
        self.assertEqual(rep.table(d)[("gpt2", "bf16")]["eager"][1]["mfu"], None)
        self.assertEqual(verdicts(d)["gpt2 bf16: tokens/s >= PyTorch eager"], "not measured")

    def test_gpu_time_kernels_and_host_reads(self):
        ours = run("small", "bf16", "ours", [10.0] * 5)
        ours.update(gpu_step_ms_median=8.5, host_reads_per_step=1,
                    kernels={"kernels_per_step": 412, "kernel_ms_per_step": 7.25})
        eager = run("small", "bf16", "eager", [9.0] * 5)
        eager.update(gpu_step_ms_median=8.0, kernels={"error": "--count-kernels needs CUDA"})
        md = rep.markdown(doc([ours, eager]))
        row = next(l for l in md.splitlines() if l.startswith("| small | bf16 | 8.5 |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        # preset, precision, GPU ms x3, kernels x3, kernel ms x3, host reads.
        self.assertEqual(cells[2:5], ["8.5", "8.0", "not run"])
        self.assertEqual(cells[5], "412")
        self.assertTrue(cells[6].startswith("error: --count-kernels needs CUDA"), cells[6])
        self.assertEqual(cells[8], "7.2")
        self.assertEqual(cells[11], "1")

    def test_top_kernels_side_by_side(self):
        long = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
        ours = run("gpt2", "bf16", "ours", [30.0] * 5)
        ours["kernels"] = {"kernels_per_step": 900, "kernel_ms_per_step": 28.0,
                           "top": [{"name": long, "count": 96, "ms": 12.5},
                                   {"name": "cdt_fa_bwd_dkv_tc_bf16_d64", "count": 12, "ms": 3.25}]}
        eager = run("gpt2", "bf16", "eager", [25.0] * 5)
        eager["kernels"] = {"kernels_per_step": 1500, "kernel_ms_per_step": 24.0,
                            "top": [{"name": "ampere_bf16_s16816gemm|x", "count": 97, "ms": 11.0}]}
        small = run("small", "f32", "ours", [5.0] * 5)
        small["kernels"] = {"kernels_per_step": 400, "kernel_ms_per_step": 3.0}
        md = rep.markdown(doc([ours, eager, small]))
        self.assertIn("Where the GPU time of a gpt2 bf16 step goes", md)
        self.assertNotIn("of a small f32 step goes", md, "no names, no table")
        lines = md.splitlines()
        i = lines.index("| # | ours | x | ms | eager | x | ms |")
        first = [c.strip() for c in lines[i + 2].strip("|").split("|")]
        self.assertEqual(first[0], "1")
        self.assertTrue(first[1].startswith("`sm90_xmma_gemm") and first[1].endswith("...`"), first[1])
        self.assertEqual(first[2:4], ["96", "12.500"])
        self.assertEqual(first[4:7], ["`ampere_bf16_s16816gemm/x`", "97", "11.000"])
        second = [c.strip() for c in lines[i + 3].strip("|").split("|")]
        self.assertEqual(second[1:4], ["`cdt_fa_bwd_dkv_tc_bf16_d64`", "12", "3.250"])
        self.assertEqual(second[4:7], ["", "", ""])
        self.assertFalse(lines[i + 4].startswith("| 3 |"), "as many rows as the longer list")

    def test_twin_kernel_names_ranked_by_time(self):
        class Dev:
            CUDA, CPU = "cuda", "cpu"

        class Ev:
            def __init__(self, name, us, dev=Dev.CUDA):
                self.name, self.device_type = name, dev
                self.time_range = type("R", (), {"elapsed_us": lambda _s, us=us: us})()

        class Prof:
            def events(self):
                return [Ev("gemm", 10.0), Ev("softmax", 4.0), Ev("gemm", 5.0), Ev("Memcpy HtoD", 99.0),
                        Ev("aten::mm", 50.0, Dev.CPU), Ev("x" * 130, 4.0)]

        torch = type("T", (), {"autograd": type("A", (), {"DeviceType": Dev})})
        k = twin.count_kernels(Prof(), torch, top=2)
        self.assertEqual(k["kernels_per_step"], 4)
        self.assertAlmostEqual(k["kernel_ms_per_step"], 0.023)
        self.assertEqual([(t["name"], t["count"]) for t in k["top"]], [("gemm", 2), ("softmax", 1)])
        self.assertAlmostEqual(k["top"][0]["ms"], 0.015)
        names = [t["name"] for t in twin.count_kernels(Prof(), torch)["top"]]
        self.assertIn("x" * 120 + "...", names)

    def test_real_text(self):
        real = {"status": "ok", "steps": 500, "batch": 64, "seq_len": 256, "precision": "f32",
                "text_bytes": 5057198, "wall_s": {"ours": 60.0, "twin": 30.0}, "max_rel_diff_eval": 0.01,
                "evals": [{"step": 100, "ours": 2.5, "twin": 2.48, "rel_diff": 0.0081}]}
        d = doc([], real=real)
        self.assertEqual(verdicts(d)["real run: held-out loss within 2% of the twin's"], "met")
        self.assertIn("| 100 | 2.5 | 2.48 | 0.0081 |", rep.markdown(d))
        real["max_rel_diff_eval"] = 0.03
        self.assertEqual(verdicts(d)["real run: held-out loss within 2% of the twin's"], "not met")
        real["max_rel_diff_eval"] = float("nan")
        self.assertEqual(verdicts(d)["real run: held-out loss within 2% of the twin's"], "not met")
        real["max_rel_diff_eval"] = 0.0
        self.assertEqual(verdicts(d)["real run: held-out loss within 2% of the twin's"], "met")

    def test_ours_with_and_without_cublaslt(self):
        d = doc([run("gpt2", "bf16", "ours", [20.0] * 5), run("gpt2", "bf16", "ours-nolt", [25.0] * 5),
                 run("gpt2", "bf16", "eager", [22.0] * 5)])
        md = rep.markdown(d)
        # tokens/s with over without: 25 / 20.
        self.assertIn("| gpt2 | bf16 | 20.0 (20.0-20.0) | 25.0 (25.0-25.0) | 1.25x |", md)
        # The main tables keep their three sides.
        self.assertIn("| gpt2 | bf16 | 8 x 1024 | 20.0 (20.0-20.0) | 22.0 (22.0-22.0) | not run | 1.10x | - |", md)
        self.assertNotIn("CDT_CUBLASLT=0`), ours both times", rep.markdown(doc([run("gpt2", "bf16", "ours", [20.0])])))

    def test_ours_events_runs_for_small_after_every_target_and_nolt(self):
        order = drv.priority(["small", "gpt2"], ["f32", "bf16"],
                             ["ours", "eager", "compile", "ours-nolt", "ours-events"])
        ev = [r for r in order if r not in ("REAL", "ATTN") and r[2] == "ours-events"]
        self.assertEqual(ev, [("small", "f32", "ours-events"), ("small", "bf16", "ours-events")])
        self.assertEqual(order[order.index(("small", "f32", "ours-events")) - 1], ("gpt2", "f32", "ours-nolt"))
        self.assertNotIn(("small", "f32", "ours-events"), drv.priority(["small"], ["f32"], ["ours", "eager"]))

    def test_ours_with_and_without_buffer_events(self):
        d = doc([run("small", "f32", "ours", [8.0] * 5), run("small", "f32", "ours-events", [10.0] * 5)])
        md = rep.markdown(d)
        self.assertIn("| preset | precision | step ms: skipped | kept | kept / skipped |", md)
        # tokens/s skipped over kept: 10 / 8.
        self.assertIn("| small | f32 | 8.0 (8.0-8.0) | 10.0 (10.0-10.0) | 1.25x |", md)
        self.assertNotIn("CDT_CUDA_BUFFER_EVENTS=1", rep.markdown(doc([run("small", "f32", "ours", [8.0])])))

    def test_ours_nolt_runs_for_gpt2_bf16_and_f32_only(self):
        order = drv.priority(["small", "gpt2"], ["f32", "bf16"], ["ours", "eager", "compile", "ours-nolt"])
        nolt = [r for r in order if r not in ("REAL", "ATTN") and r[2] == "ours-nolt"]
        self.assertEqual(nolt, [("gpt2", "bf16", "ours-nolt"), ("gpt2", "f32", "ours-nolt")])
        # After every target's runs.
        i = order.index(("gpt2", "bf16", "ours-nolt"))
        self.assertEqual(order[i - 1], ("small", "bf16", "eager"))
        self.assertNotIn(("gpt2", "bf16", "ours-nolt"), drv.priority(["gpt2"], ["bf16"], ["ours", "eager"]))

    def test_cheap_target_runs_come_before_compile_the_real_run_and_attention(self):
        order = drv.priority(["small", "gpt2", "gpt2-medium"], ["f32", "tf32", "bf16"],
                             ["ours", "eager", "compile", "ours-nolt", "ours-events"])
        # Every target that needs only ours and eager (gpt2-medium's MFU only ours), in order.
        self.assertEqual(order[:9], [
            ("gpt2", "bf16", "ours"), ("gpt2", "bf16", "eager"),
            ("small", "f32", "ours"), ("small", "f32", "eager"),
            ("gpt2", "f32", "ours"), ("gpt2", "f32", "eager"),
            ("gpt2", "tf32", "ours"), ("gpt2", "tf32", "eager"),
            ("gpt2-medium", "bf16", "ours")])
        # Then the real run, the one target under torch.compile, and the attention diagnostic.
        self.assertEqual(order[9:12], ["REAL", ("gpt2", "bf16", "compile"), "ATTN"])
        # No compile run before the last target's, and every run of the matrix once.
        runs = [r for r in order if r not in ("REAL", "ATTN")]
        self.assertEqual(len(runs), len(set(runs)))
        self.assertEqual(len([r for r in runs if r[2] in ("ours", "eager", "compile")]), 27)
        first_compile = min(i for i, r in enumerate(order) if r not in ("REAL", "ATTN") and r[2] == "compile")
        self.assertEqual(order[first_compile], ("gpt2", "bf16", "compile"))

    def test_main_writes_the_markdown(self):
        with tempfile.TemporaryDirectory() as t:
            p = os.path.join(t, "b.json")
            with open(p, "w") as f:
                json.dump(doc([run("small", "f32", "ours", [5.0, 6.0, 7.0])]), f)
            out = os.path.join(t, "b.md")
            with open(os.devnull, "w") as null:
                saved, sys.stdout = sys.stdout, null
                try:
                    rep.main([p, "--out", out])
                finally:
                    sys.stdout = saved
            with open(out) as f:
                self.assertIn("| small | f32 | 8 x 128 | 6.0 (5.0-7.0) | not run | not run |", f.read())


FAKE = r"""#!/usr/bin/env bash
# A fake train_gpt: --help lists --precision; --preset small runs out of memory; tiny in bf16
# hangs; anything else writes a JSON summary with step_ms 10 + step (and a metrics file of the
# same times when asked for one).
if [[ "$1" == --help ]]; then echo "  --preset <PRESET>"; echo "  --precision <PRECISION>"; exit 0; fi
preset="" prec="" steps=0 metrics=""
while (($#)); do
  case "$1" in
    --preset) preset="$2"; shift ;; --precision) prec="$2"; shift ;;
    --steps) steps="$2"; shift ;; --metrics) metrics="$2"; shift ;;
  esac; shift
done
echo "$preset $prec cublaslt=${CDT_CUBLASLT:-on} events=${CDT_CUDA_BUFFER_EVENTS:-skipped}" >> "$(dirname "$0")/calls"
if [[ "$preset" == small ]]; then
  echo "Error: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")" >&2; exit 2
fi
if [[ "$prec" == bf16 ]]; then sleep 60; exit 0; fi
if [[ -n "$metrics" ]]; then
  : > "$metrics"
  for ((i = 0; i < steps; i++)); do echo "{\"step\":$i,\"step_ms\":$((10 + i)),\"loss\":6.0}" >> "$metrics"; done
fi
# The summary's per-step list (FAKE_NO_STEP_LIST: a train_gpt from before it had one).
list=""
if [[ -z "${FAKE_NO_STEP_LIST:-}" ]]; then
  list=",\"step_ms\":[$(seq -s, 10 $((9 + steps)))]"
fi
echo "{\"params\":PARAMS,\"losses\":[6.2,6.0],\"step_ms_median\":12.0$list}"
"""


class Driver(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        t = self.tmp.name
        self.bin = os.path.join(t, "train_gpt")
        n = n_params("tiny")
        with open(self.bin, "w") as f:
            f.write(FAKE.replace("PARAMS", str(n)))
        os.chmod(self.bin, os.stat(self.bin).st_mode | stat.S_IXUSR)
        self.out = os.path.join(t, "out")

    def tearDown(self):
        self.tmp.cleanup()

    def drive(self, *extra, attention=False):
        args = ["--train-gpt", self.bin, "--device", "cpu", "--out", self.out, "--sides", "ours",
                "--presets", "tiny,small", "--precisions", "f32,bf16", "--no-gemm", "--steps", "4",
                "--warmup", "2", "--min-run-s", "0", *extra]
        if not attention:
            args.append("--no-attention")
        with open(os.devnull, "w") as null:
            saved = sys.stdout, sys.stderr
            sys.stdout = sys.stderr = null
            try:
                self.assertEqual(drv.main(args), 0)
            finally:
                sys.stdout, sys.stderr = saved
        with open(os.path.join(self.out, "gpu_bench.json")) as f:
            return json.load(f)

    def test_failures_are_recorded_and_the_rest_goes_on(self):
        # tiny: 60 s x 0.05 = a 3 s timeout for the hanging bf16 run.
        d = self.drive("--timeout-scale", "0.05")
        by = {r["id"]: r for r in d["runs"]}
        self.assertEqual(sorted(by), ["small_bf16_ours", "small_f32_ours", "tiny_bf16_ours", "tiny_f32_ours"])
        ok = by["tiny_f32_ours"]
        self.assertEqual(ok["status"], "ok", ok.get("error"))
        self.assertEqual(ok["step_ms_measured"], [12, 13, 14, 15])  # warm-up steps 0, 1 left out
        self.assertEqual(ok["figures"]["step_ms"], {"median": 14, "p10": 12, "p90": 15, "n": 4})
        self.assertAlmostEqual(ok["figures"]["tokens_per_s"], 8 * 128 / 0.014)
        self.assertIsNone(ok["figures"]["mfu"])  # --no-gemm
        self.assertIsNone(by["small_f32_ours"]["figures"])
        self.assertIn("--precision", ok["command"])
        self.assertEqual(by["small_f32_ours"]["status"], "oom")
        self.assertIn("CUDA_ERROR_OUT_OF_MEMORY", by["small_f32_ours"]["error"])
        self.assertEqual(by["tiny_bf16_ours"]["status"], "timeout")
        self.assertLess(by["tiny_bf16_ours"]["seconds"], 10)  # SIGTERM, not the SIGKILL 10 s later
        with open(os.path.join(self.out, "table.md")) as f:
            md = f.read()
        self.assertIn("| tiny | f32 | 8 x 128 | 14.0 (12.0-15.0) |", md)
        self.assertIn("- tiny bf16 ours: timeout", md)

    def test_ours_nolt_runs_ours_with_cublaslt_off(self):
        d = self.drive("--presets", "gpt2", "--precisions", "f32", "--sides", "ours,ours-nolt",
                       "--timeout-scale", "0.05")
        by = {r["side"]: r for r in d["runs"]}
        self.assertEqual(sorted(by), ["ours", "ours-nolt"])
        for side in by:
            self.assertEqual(by[side]["status"], "ok", by[side].get("error"))
        with open(os.path.join(self.tmp.name, "calls")) as f:
            calls = f.read().split("\n")
        self.assertIn("gpt2 f32 cublaslt=on events=skipped", calls)
        self.assertIn("gpt2 f32 cublaslt=0 events=skipped", calls)

    def test_ours_events_runs_ours_with_the_buffer_events_kept(self):
        d = self.drive("--presets", "tiny", "--precisions", "f32", "--sides", "ours,ours-events",
                       "--timeout-scale", "0.05")
        # ours-events runs for small only: tiny gets ours alone.
        self.assertEqual([r["side"] for r in d["runs"]], ["ours"])
        d = self.drive("--presets", "gpt2", "--precisions", "f32", "--sides", "ours,ours-events",
                       "--timeout-scale", "0.05")
        self.assertEqual([r["side"] for r in d["runs"]], ["ours"])
        order = drv.priority(["small"], ["f32"], ["ours", "ours-events"])
        self.assertEqual(order, [("small", "f32", "ours"), "REAL", "ATTN", ("small", "f32", "ours-events")])
        self.assertEqual(drv.OURS_SIDES, ("ours", "ours-nolt", "ours-events"))

    def test_ours_runs_without_metrics_by_default_and_times_steps_from_the_summary(self):
        d = self.drive("--presets", "tiny", "--precisions", "f32")
        (r,) = d["runs"]
        self.assertEqual(r["status"], "ok", r.get("error"))
        self.assertNotIn("--metrics", r["command"])
        self.assertEqual(r["command"][r["command"].index("--log-every") + 1], "0")
        self.assertEqual(r["timing_source"], "summary step_ms list (--log-every 0)")
        self.assertEqual(r["step_ms_measured"], [12, 13, 14, 15])
        # Its files are named by its id, which has no dot for train_gpt to take as an extension.
        self.assertEqual(r["id"], "tiny_f32_ours")

    def test_metrics_file_timing_with_ours_log_every(self):
        d = self.drive("--presets", "tiny", "--precisions", "f32", "--ours-log-every", "1")
        (r,) = d["runs"]
        self.assertEqual(r["status"], "ok", r.get("error"))
        self.assertIn("--metrics", r["command"])
        self.assertIn("metrics.jsonl", r["timing_source"])
        self.assertEqual(r["step_ms_measured"], [12, 13, 14, 15])

    def test_summary_median_is_marked_when_the_warmup_is_in_it(self):
        os.environ["FAKE_NO_STEP_LIST"] = "1"
        try:
            d = self.drive("--presets", "tiny", "--precisions", "f32", "--ours-log-every", "0")
        finally:
            del os.environ["FAKE_NO_STEP_LIST"]
        (r,) = d["runs"]
        self.assertEqual(r["status"], "ok", r.get("error"))
        self.assertNotIn("--metrics", r["command"])
        self.assertEqual(r["step_ms_measured"], [12.0])
        with open(os.path.join(self.out, "table.md")) as f:
            self.assertIn("| 12.0 (median of all steps, warm-up included) |", f.read())

    def test_a_python_that_does_not_exist_fails_its_runs_only(self):
        d = self.drive("--presets", "tiny", "--precisions", "f32", "--sides", "ours,eager",
                       "--python", os.path.join(self.tmp.name, "no-such-python"))
        by = {r["side"]: r for r in d["runs"]}
        self.assertEqual(by["ours"]["status"], "ok", by["ours"].get("error"))
        self.assertEqual(by["eager"]["status"], "failed")
        self.assertIn("cannot start", by["eager"]["error"])

    def test_budget_skips_runs(self):
        d = self.drive("--budget", "0", "--min-run-s", "1")
        self.assertEqual({r["status"] for r in d["runs"]}, {"skipped"})
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "calls")))

    def script(self, name, text):
        path = os.path.join(self.tmp.name, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        return path

    def test_attention_side_by_side(self):
        case = '{"b":1,"h":2,"t":64,"d":64,"forward_ms":{"median":%s},"forward_backward_ms":{"median":%s},' \
               '"forward_backward_tflops":%s,"packed_forward_ms":{"median":%s},' \
               '"packed_forward_backward_ms":{"median":%s}}'
        # attn_bench beside train_gpt (found there by default) and a "python" that answers as the
        # torch snippet would, whatever it is asked.
        self.script("attn_bench", "#!/usr/bin/env bash\necho '{\"kernels\":\"tensor cores\",\"cases\":[%s]}'\n"
                    % (case % (2.0, 6.0, 1.5, 2.5, 7.0)))
        py = self.script("python", "#!/usr/bin/env bash\necho '{\"torch\":\"2.11\",\"cases\":[%s]}'\n"
                         % (case % (1.0, 3.0, 3.0, 2.0, 4.0)))
        d = self.drive("--presets", "tiny", "--precisions", "f32", "--python", py,
                       "--attn-shapes", "1,2,64,64", attention=True)
        att = d["attention"]
        self.assertEqual(att["ours"]["status"], "ok", att["ours"].get("error"))
        self.assertEqual(att["torch"]["status"], "ok", att["torch"].get("error"))
        self.assertIn("1,2,64,64", att["ours"]["command"])
        with open(os.path.join(self.out, "table.md")) as f:
            md = f.read()
        self.assertIn("ours: tensor cores", md)
        self.assertIn("| 1, 2, 64, 64 | 2.000 | 1.000 | 2.00x | 6.000 | 3.000 | 2.00x | 1.5 | 3 |", md)
        # The packed form, its own table.
        self.assertIn("Packed, as a GPT layer runs it", md)
        self.assertIn("| 1, 2, 64, 64 | 2.500 | 2.000 | 1.25x | 7.000 | 4.000 | 1.75x |", md)

    def test_attention_without_the_binary_fails_its_side_only(self):
        py = self.script("python", "#!/usr/bin/env bash\necho '{\"cases\":[]}'\n")
        d = self.drive("--presets", "tiny", "--precisions", "f32", "--python", py, attention=True)
        self.assertEqual(d["attention"]["ours"]["status"], "failed")
        self.assertIn("no attn_bench binary", d["attention"]["ours"]["error"])
        self.assertEqual(d["attention"]["torch"]["status"], "ok")
        self.assertEqual(d["runs"][0]["status"], "ok", d["runs"][0].get("error"))
        with open(os.path.join(self.out, "table.md")) as f:
            self.assertIn("- ours: failed: no attn_bench binary", f.read())

    def test_has_flag(self):
        h = "      --mixed-precision <MIXED_PRECISION>\n          as with --precision bf16\n"
        self.assertFalse(drv.has_flag(h, "--precision"))
        self.assertTrue(drv.has_flag(h + "      --precision <PRECISION>\n", "--precision"))

    def test_error_line_prefers_out_of_memory(self):
        p = os.path.join(self.tmp.name, "log")
        with open(p, "w") as f:
            f.write("step 1\nRuntimeError: CUDA out of memory. Tried to allocate 2 GiB\nerror: exiting\n")
        self.assertIn("out of memory", drv.error_line(p))


if __name__ == "__main__":
    unittest.main()
