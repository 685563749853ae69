#!/usr/bin/env python3
"""The driver of scripts/gpu_bench.sh (run that; it finds the binaries, the libraries and the
python): train_gpt ("ours") side by side with its PyTorch twin (train_gpt_torch.py) in eager
mode and under torch.compile, for presets x precisions, plus a bf16/tf32/f32 GEMM rate measured
in the same run, attention alone (examples/attn_bench.rs beside torch's
scaled_dot_product_attention, bf16, causal, forward and forward + backward) and, with --real-text, the nanoGPT-shaped byte model on real text, ours vs the
twin. For gpt2 in bf16 and f32, ours also runs with CDT_CUBLASLT=0 (side "ours-nolt": the
linears on candle's GEMM and separate bias, cast and column-sum passes), after every target's
runs, so the run measures what the cuBLASLt epilogues gain when the budget allows; then small
in f32 and bf16 with CDT_CUDA_BUFFER_EVENTS=1 (side "ours-events": every buffer with cudarc's two
events, which train_gpt skips), what skipping them gains in the launch-bound regime. Writes
OUT/gpu_bench.json (everything) and OUT/table.md (gpu_bench_report.py's Markdown).

Every run is a separate process under its own timeout; a run that fails, runs out of memory or
times out is recorded with its status and error, and the others go on. Runs go in priority
order (the issue-33 targets first) and a run starts only while the --budget lasts (its timeout
is cut to what is left), so the whole command ends within --budget plus one kill grace.

Same work on both sides: the same preset (crates/models/src/gpt.rs), batch, sequence length,
synthetic corpus (train_gpt's, seed 0), AdamW settings (train_gpt's defaults) and steps; the
twin uses SDPA attention (is_causal) in eager mode and under torch.compile. Step times: the
wall time of each step with the loss read back (both sides read the loss every step), the
first --warmup steps left out. Ours' per-step times come from its summary's `step_ms` list
(--ours-log-every 0, the default: no gradient norm in its steps, as in the twin's; a train_gpt
without the list gives `step_ms_median` over all steps, warm-up included, recorded as such);
--ours-log-every 1 reads them from its metrics file instead, at the cost of a gradient norm
every step. Peak memory: on CUDA the device's memory.used sampled by
nvidia-smi every --mem-interval seconds above its idle value before the run (the same for both
sides; it includes the CUDA context and caching pools), plus the twin's own
torch.cuda.max_memory_allocated; on the CPU the peak resident set of the process. Kernel
launches: both sides count the GPU kernels of their last step under CUPTI (train_gpt
--count-kernels; the twin's torch.profiler), so only that one of the measured steps carries
CUPTI's cost. GPU time: ours from CUDA events around its phases, the twin's around its step.
"""

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_bench_report as report  # noqa: E402
import train_gpt_torch as twin  # noqa: E402

# Per-run timeouts in seconds (ours and eager; compile), generous guesses for one H100/H200.
TIMEOUTS = {
    "tiny": (60, 240),
    "small": (60, 180),
    "gpt2": (120, 240),
    "gpt2-medium": (180, 330),
}
BATCH = {"tiny": 8, "small": 8, "gpt2": 8, "gpt2-medium": 8}
# The sides that run train_gpt: ours, and ours again under an environment switch.
OURS_SIDES = ("ours", "ours-nolt", "ours-events")
# The real-text model: nanoGPT's shakespeare_char shape on bytes.
REAL = dict(layers=6, heads=6, width=384, seq_len=256, batch=64)


def priority(presets, precisions, sides):
    """Runs in the order of the issue's targets, cheapest first, then the rest of the matrix.

    The budget of one prepared GPU session (gpu_session.sh: 260 s) cannot hold the whole
    matrix, and a torch.compile run costs a minute or more of compiling where an uncompiled
    run takes seconds (guesses, never measured). So every target that needs only ours and
    eager runs first (gpt2 bf16, small f32, gpt2 f32 and tf32, gpt2-medium bf16's MFU, which
    needs ours alone), then the real run ("REAL", with --real-text), then gpt2 bf16 under
    torch.compile (the last target), then the attention comparison ("ATTN", a diagnostic) and
    the rest."""
    first = [
        ("gpt2", "bf16", "ours"), ("gpt2", "bf16", "eager"),
        ("small", "f32", "ours"), ("small", "f32", "eager"),
        ("gpt2", "f32", "ours"), ("gpt2", "f32", "eager"),
        ("gpt2", "tf32", "ours"), ("gpt2", "tf32", "eager"),
        ("gpt2-medium", "bf16", "ours"),
        "REAL",
        ("gpt2", "bf16", "compile"),
        "ATTN",
        ("gpt2-medium", "bf16", "eager"),
        ("small", "bf16", "ours"), ("small", "bf16", "eager"),
        ("gpt2-medium", "bf16", "compile"),
        # After every target's runs: ours without the cuBLASLt epilogues, what they gain.
        ("gpt2", "bf16", "ours-nolt"), ("gpt2", "f32", "ours-nolt"),
        # Then ours with cudarc's per-buffer events kept, what skipping them gains where the
        # host's cost per op shows (the launch-bound preset).
        ("small", "f32", "ours-events"), ("small", "bf16", "ours-events"),
    ]
    # The rest of the matrix: the three sides of the table (the extra sides only where listed
    # above).
    rest = [(p, q, s) for s in ("ours", "eager", "compile") for p in presets for q in precisions]
    # Within the rest: uncompiled runs first (cheap), then compile; small before large.
    rest.sort(key=lambda r: (r[2] == "compile", list(presets).index(r[0]), list(precisions).index(r[1])))
    out, seen = [], set()
    for r in first + rest:
        if r in ("REAL", "ATTN"):
            out.append(r)
            continue
        if r in seen or r[0] not in presets or r[1] not in precisions or r[2] not in sides:
            continue
        seen.add(r)
        out.append(r)
    return out


class GpuMem:
    """Device memory in use, by nvidia-smi (None figures without a usable nvidia-smi)."""

    def __init__(self, index):
        self.index = index

    def used_bytes(self):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(self.index)],
                capture_output=True, text=True, timeout=10,
            )
            return int(float(out.stdout.strip().splitlines()[0])) * 2**20 if out.returncode == 0 else None
        except Exception:
            return None


def run_cmd(cmd, stdout_path, stderr_path, timeout, env=None, gpu=None, mem_interval=1.0):
    """Runs cmd in its own process group with a timeout (SIGTERM to the group, SIGKILL 10 s
    later). Returns rc (None when killed for the timeout), seconds, the peak resident set of
    the process (ru_maxrss) and, with gpu, the peak device memory above the value before."""
    base = gpu.used_bytes() if gpu else None
    peak_dev = None
    t0 = time.monotonic()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        except OSError as e:  # not found, not executable: a failed run like any other
            err.write(f"error: cannot start {cmd[0]}: {e}\n".encode())
            return {"rc": 127, "seconds": 0.0, "peak_rss_bytes": None, "peak_device_bytes": None}
        status = rusage = None
        timed_out = False
        next_sample = t0
        term_at = None
        while True:
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                status, rusage = st, ru
                break
            now = time.monotonic()
            if gpu and now >= next_sample:
                u = gpu.used_bytes()
                if u is not None and base is not None:
                    peak_dev = max(peak_dev or 0, u - base)
                next_sample = now + mem_interval
            if term_at is None and now - t0 > timeout:
                timed_out = True
                term_at = now
                _signal_group(proc.pid, signal.SIGTERM)
            elif term_at is not None and now - term_at > 10:
                _signal_group(proc.pid, signal.SIGKILL)
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: keep Popen quiet
    rc = None if timed_out else proc.returncode
    return {
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 2),
        "peak_rss_bytes": rusage.ru_maxrss * 1024 if rusage else None,
        "peak_device_bytes": peak_dev,
    }


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def has_flag(help_text, flag):
    """Whether a --help output lists the flag (at the start of a line, as clap prints it)."""
    return re.search(rf"^\s*{re.escape(flag)}\b", help_text, re.M) is not None


def read_text(path):
    with open(path, errors="replace") as f:
        return f.read()


OOM = re.compile(r"out of memory|OutOfMemory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|alloc.*fail", re.I)
ERR = re.compile(r"error|panicked|Traceback|exception|failed|unrecognized|unexpected argument", re.I)


def error_line(path):
    """The most telling line of a log: an out-of-memory line, else the last error-looking
    line, else the last line."""
    try:
        lines = [ln.strip() for ln in read_text(path).splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if OOM.search(ln):
            return ln[:300]
    for ln in reversed(lines):
        if ERR.search(ln) and not ln.startswith("File "):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def status_of(res, stderr_path):
    if res["rc"] is None:
        return "timeout", f"killed after the {res.get('timeout')} s timeout"
    if res["rc"] != 0:
        line = error_line(stderr_path)
        return ("oom" if OOM.search(line) else "failed"), f"exit {res['rc']}: {line}"
    return "ok", None


def parse_summary(path):
    """train_gpt's --json summary on stdout: the whole file, else its last line starting with {."""
    try:
        text = read_text(path)
    except OSError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        for ln in reversed(text.splitlines()):
            if ln.startswith("{"):
                try:
                    return json.loads(ln)
                except ValueError:
                    pass
    return None


def read_metrics(path):
    """step -> record of a train_gpt metrics file (JSON lines)."""
    out = {}
    try:
        for ln in read_text(path).splitlines():
            ln = ln.strip()
            if ln:
                r = json.loads(ln)
                out[r["step"]] = r
    except (OSError, ValueError, KeyError):
        pass
    return out


class Bench:
    def __init__(self, a):
        self.a = a
        self.t_start = time.monotonic()
        self.logs = os.path.join(a.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.gpu = GpuMem(a.gpu_index) if a.device.startswith("cuda") else None
        self.ours_env = dict(os.environ)
        if a.ours_ld_library_path:
            self.ours_env["LD_LIBRARY_PATH"] = a.ours_ld_library_path
        try:
            self.ours_help = subprocess.run([a.train_gpt, "--help"], capture_output=True, text=True,
                                            timeout=60, env=self.ours_env).stdout
        except Exception as e:  # a missing or unloadable binary: every ours run fails by name
            self.ours_help = None
            self.ours_help_error = str(e)

    def left(self):
        return self.a.budget - (time.monotonic() - self.t_start)

    def say(self, msg):
        print(f"gpu_bench: {msg}", file=sys.stderr, flush=True)

    def shape(self, preset):
        cfg = dict(twin.PRESETS[preset])
        if self.a.seq_len:
            cfg["seq_len"] = self.a.seq_len
        params = sum(math.prod(s) for _, s, _ in twin.param_shapes(cfg))
        return cfg, params

    def run_one(self, preset, prec, side):
        a = self.a
        cfg, params = self.shape(preset)
        batch = a.batch.get(preset, BATCH.get(preset, 8))
        # The run's id, also its files' stem: no dots, since train_gpt names its csv, svg and
        # job files by replacing the last extension of --out (`gpt2.bf16.ours` and
        # `gpt2.bf16.ours-nolt` would both write gpt2.bf16.csv).
        rid = f"{preset}_{prec}_{side}"
        rec = {
            "id": rid, "preset": preset, "precision": prec, "side": side, "batch": batch,
            "seq_len": cfg["seq_len"], "layers": cfg["layers"], "width": cfg["width"], "heads": cfg["heads"],
            "vocab": cfg["vocab"], "params": params, "warmup": a.warmup, "steps_measured": a.steps,
        }
        limit = TIMEOUTS.get(preset, (120, 300))[side == "compile"] * a.timeout_scale
        left = self.left()
        if left < a.min_run_s:
            rec.update(status="skipped", error=f"budget: {left:.0f} s left of --budget {a.budget:.0f}")
            return rec
        cut = left < limit
        limit = min(limit, left)
        total = a.warmup + a.steps
        out, err = os.path.join(self.logs, rid + ".out"), os.path.join(self.logs, rid + ".log")
        if side in OURS_SIDES:
            if self.ours_help is None:
                rec.update(status="failed", error=f"train_gpt not runnable: {self.ours_help_error}")
                return rec
            cmd = [a.train_gpt, "--mesh", "tp=1", "--no-fsdp", "--device", a.device, "--preset", preset,
                   "--batch", str(batch), "--seq-len", str(cfg["seq_len"]), "--steps", str(total),
                   "--json", "--out", os.path.join(self.logs, rid),
                   "--log-every", str(a.ours_log_every)]
            if has_flag(self.ours_help, "--precision"):
                cmd += ["--precision", prec]
            elif prec != "f32":
                rec.update(status="failed", error="this train_gpt has no --precision flag")
                return rec
            if a.ours_log_every > 0:
                cmd += ["--metrics", os.path.join(self.logs, rid + ".metrics.jsonl")]
            if a.count_kernels and has_flag(self.ours_help, "--count-kernels"):
                cmd.append("--count-kernels")
            env = self.ours_env
            if side == "ours-nolt":
                # The linears on candle's GEMM and separate passes (kernels/src/cublaslt.rs).
                env = dict(env, CDT_CUBLASLT="0")
            elif side == "ours-events":
                # Every buffer with cudarc's two events (kernels/src/storage.rs,
                # skip_unused_buffer_events), as before they were skipped.
                env = dict(env, CDT_CUDA_BUFFER_EVENTS="1")
        else:
            cmd = [a.python, os.path.join(HERE, "train_gpt_torch.py"), "--preset", preset, "--batch", str(batch),
                   "--seq-len", str(cfg["seq_len"]), "--steps", str(total), "--timing-warmup", str(a.warmup),
                   "--device", a.device, "--precision", prec, "--attention", "sdpa",
                   "--out", os.path.join(self.logs, rid), "--summary", os.path.join(self.logs, rid + ".json"),
                   "--quiet"]
            if side == "compile":
                cmd.append("--compile")
            if a.count_kernels:
                cmd.append("--count-kernels")
            env = None
        rec["command"] = cmd
        rec["log"] = os.path.relpath(err, a.out)
        self.say(f"{rid}: timeout {limit:.0f} s: {' '.join(cmd)}")
        res = run_cmd(cmd, out, err, limit, env=env, gpu=self.gpu, mem_interval=a.mem_interval)
        res["timeout"] = round(limit)
        status, error = status_of(res, err)
        if status == "timeout" and cut:
            error += " (its own timeout cut to the --budget left)"
        rec.update(status=status, error=error, seconds=res["seconds"])
        rec["peak_mem_bytes"] = res["peak_device_bytes"] if self.gpu else res["peak_rss_bytes"]
        rec["peak_mem_source"] = ("nvidia-smi memory.used above idle" if self.gpu else "peak RSS (ru_maxrss)")
        if status != "ok":
            return rec
        if side in OURS_SIDES:
            self.figures_ours(rec, out, params)
        else:
            self.figures_twin(rec, os.path.join(self.logs, rid + ".json"), params)
        if rec["status"] == "ok" and len(rec.get("step_ms_measured") or []) == 0:
            rec.update(status="failed", error="no step times after the warm-up")
        return rec

    def figures_ours(self, rec, out, params):
        a = self.a
        s = parse_summary(out)
        if s is None:
            rec.update(status="failed", error="exit 0 but no JSON summary on stdout")
            return
        losses = s.get("losses") or []
        rec["first_loss"], rec["last_loss"] = (losses[0], losses[-1]) if losses else (None, None)
        rec["reported_params"] = s.get("params")
        if s.get("params") not in (None, params):
            rec["warning"] = f"train_gpt reports {s.get('params')} parameters, the preset's count is {params}"
        # The whole summary (its phase split, precision and whatever counters this train_gpt
        # reports, e.g. host syncs and kernel launches per step), long per-step lists left out.
        rec["ours_summary"] = {k: v for k, v in s.items() if not (isinstance(v, list) and len(v) > 64)}
        # Kernels of the last step (--count-kernels, CUPTI), GPU time per step (CUDA events
        # around the phases, median), host reads per step (median).
        rec["kernels"] = s.get("kernels")
        rec["gpu_step_ms_median"] = (s.get("gpu_phases") or {}).get("gpu_step_ms_median")
        reads = s.get("host_reads_per_step")
        if isinstance(reads, list) and reads:
            rec["host_reads_per_step"] = sorted(reads)[len(reads) // 2]
        steps = a.warmup + a.steps
        if a.ours_log_every > 0:
            m = read_metrics(os.path.join(self.logs, rec["id"] + ".metrics.jsonl"))
            all_ms = [m[i]["step_ms"] for i in range(steps) if i in m and report.finite(m[i].get("step_ms"))]
            if len(all_ms) != steps:
                rec.update(status="failed", error=f"metrics file has {len(all_ms)} step times of {steps}")
                return
            rec["timing_source"] = "metrics.jsonl step_ms (--log-every 1: gradient norm every step)"
            rec["step_ms_all"] = all_ms
            rec["step_ms_measured"] = all_ms[a.warmup:]
        elif isinstance(s.get("step_ms"), list) and len(s["step_ms"]) == steps:
            rec["timing_source"] = "summary step_ms list (--log-every 0)"
            rec["step_ms_all"] = s["step_ms"]
            rec["step_ms_measured"] = s["step_ms"][a.warmup:]
        elif report.finite(s.get("step_ms_median")):
            rec["timing_source"] = "summary step_ms_median over all steps, WARM-UP INCLUDED (--log-every 0)"
            rec["step_ms_measured"] = [s["step_ms_median"]]
        else:
            rec.update(status="failed", error="no step_ms_median in the summary")

    def figures_twin(self, rec, path, params):
        try:
            s = json.loads(read_text(path))
        except (OSError, ValueError) as e:
            rec.update(status="failed", error=f"no twin summary: {e}")
            return
        losses = s.get("losses") or []
        rec["first_loss"], rec["last_loss"] = (losses[0], losses[-1]) if losses else (None, None)
        rec["reported_params"] = s.get("params")
        if s.get("params") != params:
            rec["warning"] = f"the twin reports {s.get('params')} parameters, the preset's count is {params}"
        rec["timing_source"] = "twin step_ms_all (wall, loss read back)"
        rec["step_ms_all"] = s.get("step_ms_all")
        rec["step_ms_measured"] = (s.get("step_ms_all") or [])[self.a.warmup:]
        rec["gpu_step_ms"] = s.get("gpu_step_ms")
        rec["gpu_step_ms_median"] = (s.get("gpu_step_ms") or {}).get("median")
        rec["kernels"] = s.get("kernels")
        rec["torch_peak_memory"] = s.get("peak_memory")
        rec["torch"] = s.get("torch")
        if rec["side"] == "compile" and rec["step_ms_all"]:
            rec["first_step_ms"] = rec["step_ms_all"][0]  # includes the compilation

    def gemm(self):
        a = self.a
        rec = {"size": a.gemm_size}
        if self.left() < a.min_run_s:
            rec.update(status="skipped", error="budget")
            return rec
        code = GEMM_CODE
        out, err = os.path.join(self.logs, "gemm.out"), os.path.join(self.logs, "gemm.log")
        cmd = [a.python, "-c", code, a.device, str(a.gemm_size), str(a.gemm_iters)]
        self.say(f"gemm: {a.gemm_size}^3 x {a.gemm_iters} per dtype")
        res = run_cmd(cmd, out, err, min(120 * a.timeout_scale, self.left()))
        res["timeout"] = 120
        status, error = status_of(res, err)
        rec.update(status=status, error=error, seconds=res["seconds"])
        if status == "ok":
            try:
                rec.update(json.loads(read_text(out).strip().splitlines()[-1]))
            except (ValueError, IndexError) as e:
                rec.update(status="failed", error=f"unreadable GEMM output: {e}")
        return rec

    def attention(self):
        """Attention alone (examples/attn_bench.rs) beside torch's scaled_dot_product_attention
        on the same shapes, bf16, causal: forward and forward + backward per call."""
        a = self.a
        rec = {"shapes": a.attn_shapes, "dtype": "bf16", "causal": True}
        for side in ("ours", "torch"):
            if self.left() < a.min_run_s:
                rec[side] = {"status": "skipped", "error": "budget"}
                continue
            out, err = (os.path.join(self.logs, f"attention.{side}.out"),
                        os.path.join(self.logs, f"attention.{side}.log"))
            if side == "ours":
                if not os.access(a.attn_bench, os.X_OK):
                    rec[side] = {"status": "failed", "error": f"no attn_bench binary at {a.attn_bench}"}
                    continue
                cmd = [a.attn_bench, "--device", a.device, "--shapes", a.attn_shapes, "--dtype", "bf16",
                       "--iters", str(a.attn_iters), "--json"]
                env = self.ours_env
            else:
                cmd = [a.python, "-c", ATTN_CODE, a.device, a.attn_shapes, str(a.attn_iters)]
                env = None
            self.say(f"attention ({side}): {a.attn_shapes}")
            res = run_cmd(cmd, out, err, min(120 * a.timeout_scale, self.left()), env=env)
            status, error = status_of(res, err)
            r = {"status": status, "error": error, "seconds": res["seconds"], "command": cmd}
            if status == "ok":
                try:
                    r.update(json.loads(read_text(out).strip().splitlines()[-1]))
                except (ValueError, IndexError) as e:
                    r.update(status="failed", error=f"unreadable attention output: {e}")
            rec[side] = r
        return rec

    def real_text(self):
        a = self.a
        rec = {"status": "failed", "steps": a.real_steps, "eval_every": a.real_eval_every, "precision": a.real_precision,
               "batch": a.real_batch, "seq_len": REAL["seq_len"], "text": a.text}
        if not a.text or not os.path.isfile(a.text):
            rec["error"] = (f"no text at {a.text} (fetch it here with scripts/real_text.sh, which writes "
                            "target/real_text/shakespeare.txt, and carry that file)")
            return rec
        rec["text_bytes"] = os.path.getsize(a.text)
        want = a.text_sha256
        if want:
            import hashlib

            with open(a.text, "rb") as f:
                got = hashlib.sha256(f.read()).hexdigest()
            rec["text_sha256"] = got
            if got != want:
                rec["error"] = f"{a.text}: SHA-256 {got} is not scripts/real_text.sh's {want}"
                return rec
        if self.left() < a.min_run_s:
            rec.update(status="skipped", error="budget")
            return rec
        d = os.path.join(a.out, "real_text")
        os.makedirs(d, exist_ok=True)
        steps = a.real_steps
        model = ["--layers", str(REAL["layers"]), "--heads", str(REAL["heads"]), "--width", str(REAL["width"]),
                 "--seq-len", str(REAL["seq_len"]), "--warmup", str(max(steps // 10, 0)), "--lr-decay", "cosine",
                 "--min-lr", "1e-4", "--weight-decay", "0.01", "--decay-params", "matrices"]
        common = ["--data", a.text, "--steps", str(steps), "--batch", str(a.real_batch), "--lr", "1e-3",
                  "--seed", "0", "--eval-every", str(a.real_eval_every), "--eval-batches", str(a.real_eval_batches)] + model
        init = os.path.join(d, "init.safetensors")
        tw = [a.python, os.path.join(HERE, "train_gpt_torch.py")] + common + ["--device", a.device]
        prec = [] if a.real_precision == "f32" else ["--precision", a.real_precision]
        if prec and (self.ours_help is None or not has_flag(self.ours_help, "--precision")):
            rec["error"] = "this train_gpt has no --precision flag"
            return rec
        steps_run = [
            ("init", tw + ["--save-init", init, "--init-only", "--quiet"], None),
            ("twin", tw + prec + ["--init-from", init, "--out", os.path.join(d, "twin"), "--quiet"], None),
            ("ours", [a.train_gpt, "--mesh", "tp=1", "--no-fsdp"] + common + prec
             + ["--init-from", init, "--device", a.device, "--out", os.path.join(d, "ours"), "--json",
                "--log-every", "0"], self.ours_env),
        ]
        rec["commands"] = {}
        rec["wall_s"] = {}
        for name, cmd, env in steps_run:
            left = self.left()
            if left < a.min_run_s:
                rec.update(status="skipped", error=f"budget ran out before {name}")
                return rec
            rec["commands"][name] = cmd
            self.say(f"real text {name}: {' '.join(cmd)}")
            out, err = os.path.join(d, name + ".out"), os.path.join(d, name + ".log")
            res = run_cmd(cmd, out, err, min(a.real_timeout, left), env=env, gpu=self.gpu,
                          mem_interval=a.mem_interval)
            res["timeout"] = round(min(a.real_timeout, left))
            status, error = status_of(res, err)
            if name != "init":
                rec["wall_s"][name] = res["seconds"]
            if status != "ok":
                rec.update(status=status, error=f"{name}: {error}")
                return rec
        cmp = [a.python, os.path.join(HERE, "compare_curves.py"), "--ours", os.path.join(d, "ours.csv"),
               "--twin", os.path.join(d, "twin.csv"), "--tol", "0.02", "--json", os.path.join(d, "summary.json"),
               "--svg", os.path.join(d, "curves.svg"),
               "--title", f"real text (bytes), {steps} steps: train_gpt vs PyTorch twin, {a.device}"]
        res = run_cmd(cmp, os.path.join(d, "compare.out"), os.path.join(d, "compare.log"), 60)
        try:
            s = json.loads(read_text(os.path.join(d, "summary.json")))
        except (OSError, ValueError) as e:
            rec["error"] = f"compare_curves.py wrote no summary (exit {res['rc']}): {e}"
            return rec
        rec.update(status="ok", error=None, within_tol=res["rc"] == 0,
                   max_rel_diff_eval=s.get("max_rel_diff_eval"), evals=s.get("evals"),
                   max_rel_diff_train=s.get("max_rel_diff_train_all_steps"), svg=os.path.join(d, "curves.svg"))
        for side in ("ours", "twin"):
            try:
                j = json.loads(read_text(os.path.join(d, side + (".out" if side == "ours" else ".json"))))
                ms = j.get("step_ms_median") if side == "ours" else (j.get("step_ms") or {}).get("median")
                rec.setdefault("step_ms_median", {})[side] = ms
            except (OSError, ValueError):
                pass
        return rec


GEMM_CODE = r"""
import json, sys, time, torch
dev, n, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = torch.device(dev)
cuda = d.type == "cuda"
def sync():
    if cuda: torch.cuda.synchronize(d)
out = {"device_name": torch.cuda.get_device_name(d) if cuda else "cpu", "torch": torch.__version__,
       "iters": iters, "tflops": {}}
for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True), ("f32", torch.float32, False)):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    a = torch.randn(n, n, device=d, dtype=dtype)
    b = torch.randn(n, n, device=d, dtype=dtype)
    for _ in range(3):
        c = a @ b
    sync()
    k = iters if name == "bf16" else max(iters // 4, 2)
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(k):
            c = a @ b
        e1.record()
        sync()
        s = e0.elapsed_time(e1) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(k):
            c = a @ b
        s = time.perf_counter() - t0
    out["tflops"][name] = 2.0 * n ** 3 * k / s / 1e12
    del a, b, c
print(json.dumps(out))
"""


ATTN_CODE = r"""
import json, sys, time, torch
import torch.nn.functional as F
dev, shapes, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
cuda = dev.startswith("cuda")
d = torch.device(dev)
def sync():
    if cuda: torch.cuda.synchronize(d)
def stats(ms):
    v = sorted(ms)
    at = lambda q: v[min(round(q * (len(v) - 1)), len(v) - 1)]
    return {"median": at(0.5), "p10": at(0.1), "p90": at(0.9), "n": len(v)}
def timed(f, warmup=3):
    for _ in range(warmup):
        f()
    sync()
    ms = []
    for _ in range(iters):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); f(); e1.record(); sync()
            ms.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter(); f(); ms.append((time.perf_counter() - t0) * 1e3)
    return ms
cases = []
for s in shapes.split(";"):
    if not s.strip():
        continue
    b, h, t, hd = (int(x) for x in s.split(","))
    q, k, v = (torch.randn(b, h, t, hd, device=d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, t, hd, device=d, dtype=torch.bfloat16)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    def fb():
        q.grad = k.grad = v.grad = None  # no accumulation into earlier gradients
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(g)
    fwd_bwd = timed(fb)
    # Packed, as a GPT layer runs it (nanoGPT's views): the QKV projection [B, T, H, 3, D] split
    # and transposed into SDPA, the output transposed back to [B, T, H, D] and made contiguous
    # for the output projection.
    qkv = torch.randn(b, t, h, 3, hd, device=d, dtype=torch.bfloat16, requires_grad=True)
    gp = torch.randn(b, t, h, hd, device=d, dtype=torch.bfloat16)
    def packed():
        pq, pk, pv = (x.transpose(1, 2) for x in qkv.unbind(3))
        return F.scaled_dot_product_attention(pq, pk, pv, is_causal=True).transpose(1, 2).contiguous()
    pfwd = timed(packed)
    def pfb():
        qkv.grad = None
        packed().backward(gp)
    pfwd_bwd = timed(pfb)
    flops = 4.0 * b * h * t * t * hd / 2
    med = lambda ms: stats(ms)["median"]
    cases.append({"b": b, "h": h, "t": t, "d": hd, "forward_ms": stats(fwd), "forward_backward_ms": stats(fwd_bwd),
                  "forward_tflops": flops / (med(fwd) / 1e3) / 1e12,
                  "forward_backward_tflops": 3.5 * flops / (med(fwd_bwd) / 1e3) / 1e12,
                  "packed_forward_ms": stats(pfwd), "packed_forward_backward_ms": stats(pfwd_bwd)})
    del q, k, v, g, qkv, gp
print(json.dumps({"torch": torch.__version__, "kernels": "torch sdpa (its default backend choice)",
                  "timing": "CUDA events" if cuda else "wall", "cases": cases}))
"""


def parse_batch(text):
    out = {}
    for part in filter(None, (text or "").split(",")):
        k, _, v = part.partition("=")
        if k not in twin.PRESETS or not v.isdigit() or int(v) < 1:
            sys.exit(f"--batch {text!r}: expected PRESET=N,... with presets {sorted(twin.PRESETS)}")
        out[k] = int(v)
    return out


def parse_list(text, allowed, flag):
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        sys.exit(f"{flag} {text!r}: choose from {', '.join(allowed)}")
    return items


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-gpt", required=True, help="the train_gpt binary")
    p.add_argument("--python", default=sys.executable, help="python with torch for the twin")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-index", type=int, default=0, help="nvidia-smi's index of the GPU for memory sampling")
    p.add_argument("--out", default="target/gpu_bench")
    p.add_argument("--presets", default="small,gpt2,gpt2-medium")
    p.add_argument("--precisions", default="f32,tf32,bf16")
    p.add_argument("--sides", default="ours,eager,compile,ours-nolt,ours-events",
                   help="ours, eager, compile; ours-nolt: ours with CDT_CUBLASLT=0 (the linears "
                        "on candle's GEMM and separate passes), run for gpt2 bf16 and f32 only; "
                        "ours-events: ours with CDT_CUDA_BUFFER_EVENTS=1 (cudarc's per-buffer "
                        "events kept), run for small f32 and bf16 only"),
    p.add_argument("--steps", type=int, default=30, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps before the measured ones, left out")
    p.add_argument("--batch", type=parse_batch, default={}, help="PRESET=N,... (default 8 each)")
    p.add_argument("--seq-len", type=int, help="every preset's sequence length (default: the preset's)")
    p.add_argument("--budget", type=float, default=480, help="seconds for all runs together")
    p.add_argument("--min-run-s", type=float, default=20, help="a run starts only with this much budget left")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies the per-run timeouts")
    # 0: no gradient norm in ours' steps (the twin computes none); per-step times from the
    # summary's step_ms list.
    p.add_argument("--ours-log-every", type=int, default=0)
    p.add_argument("--ours-ld-library-path", default=os.environ.get("CDT_OURS_LD_LIBRARY_PATH", ""))
    p.add_argument("--mem-interval", type=float, default=1.0)
    p.add_argument("--no-count-kernels", dest="count_kernels", action="store_false",
                   help="do not count the last step's kernels (train_gpt --count-kernels, the twin's "
                        "torch.profiler): by default both sides count, under CUPTI, in their last step only; "
                        "never with --device cpu")
    p.add_argument("--gemm-size", type=int, help="N of the N^3 GEMMs (default 8192 on CUDA, 512 on the CPU)")
    p.add_argument("--gemm-iters", type=int, default=40)
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--no-matrix", action="store_true", help="only the GEMM rate, attention and --real-text")
    p.add_argument("--attn-bench", help="the attn_bench binary (default: beside --train-gpt)")
    p.add_argument("--attn-shapes", default="8,12,1024,64;8,16,1024,64;4,8,2048,128",
                   help="B,H,T,D;... shapes of the attention comparison (bf16, causal)")
    p.add_argument("--attn-iters", type=int, default=20)
    p.add_argument("--no-attention", action="store_true", help="leave out the attention comparison")
    p.add_argument("--real-text", action="store_true")
    p.add_argument("--text", default="target/real_text/shakespeare.txt")
    p.add_argument("--text-sha256", default="", help="the text's expected SHA-256 (gpu_bench.sh passes real_text.sh's)")
    p.add_argument("--real-steps", type=int, default=500)
    p.add_argument("--real-eval-every", type=int, default=100)
    p.add_argument("--real-eval-batches", type=int, default=8)
    p.add_argument("--real-batch", type=int, default=REAL["batch"], help="sequences per step of the real run")
    p.add_argument("--real-precision", default="f32", choices=["f32", "tf32", "bf16"])
    # Each of the real run's processes (init, twin, ours). It runs early in the budget
    # (priority), so a hang there must not take the rest of it: 500 steps of the 10.7M-parameter
    # model at batch 64 x 256 should take well under a minute a side on an H100 (a guess).
    p.add_argument("--real-timeout", type=float, default=150)
    p.add_argument("--gpu-name", default="")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--binaries", default="", help="the binaries' BUILD_INFO, one line")
    a = p.parse_args(argv)
    presets = parse_list(a.presets, list(twin.PRESETS), "--presets")
    precisions = parse_list(a.precisions, ["f32", "tf32", "bf16"], "--precisions")
    sides = parse_list(a.sides, list(report.SIDES) + list(report.EXTRA_SIDES), "--sides")
    if a.steps < 1 or a.warmup < 0:
        sys.exit("--steps must be >= 1 and --warmup >= 0")
    if a.gemm_size is None:
        a.gemm_size = 8192 if a.device.startswith("cuda") else 512
    if not a.device.startswith("cuda"):
        # Both sides count GPU kernels under CUPTI and refuse --count-kernels on the CPU: a dry
        # run there would fail every run of ours and leave the twins' kernel columns as errors.
        a.count_kernels = False
    if a.attn_bench is None:
        a.attn_bench = os.path.join(os.path.dirname(os.path.abspath(a.train_gpt)), "attn_bench")
    os.makedirs(a.out, exist_ok=True)

    b = Bench(a)
    doc = {
        "schema": 1,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": a.gpu_name or ("cpu" if not a.device.startswith("cuda") else "unknown"),
        "device": a.device,
        "commit": a.commit,
        "binaries": a.binaries,
        "train_gpt": a.train_gpt,
        "twin_python": a.python,
        "steps": a.steps,
        "warmup": a.warmup,
        "budget_s": a.budget,
        "ours_log_every": a.ours_log_every,
        "definitions": report.__doc__.split("Definitions")[1].split("A run that failed")[0].strip(),
        "runs": [],
    }
    path = os.path.join(a.out, "gpu_bench.json")

    def save():
        doc["seconds"] = round(time.monotonic() - b.t_start, 1)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)

    if not a.no_gemm:
        doc["gemm"] = b.gemm()
        g = doc["gemm"]
        doc["torch"] = g.get("torch")
        b.say(f"gemm: {g.get('status')} {g.get('tflops') or g.get('error')}")
        save()
    order = ["ATTN", "REAL"] if a.no_matrix else priority(presets, precisions, sides)
    for item in order:
        if item == "ATTN":
            if not a.no_attention:
                doc["attention"] = b.attention()
                for side in ("ours", "torch"):
                    r = doc["attention"].get(side) or {}
                    b.say(f"attention ({side}): {r.get('status')} {r.get('error') or ''}")
                save()
            continue
        if item == "REAL":
            if a.real_text:
                doc["real_text"] = b.real_text()
                b.say(f"real text: {doc['real_text'].get('status')} {doc['real_text'].get('error') or ''}")
                save()
            continue
        rec = b.run_one(*item)
        doc["runs"].append(rec)
        # The derived figures (gpu_bench_report.py's definitions), kept beside the raw ones.
        rec["figures"] = f = report.derive(rec, report.gemm_rate(doc))
        if f is not None:
            b.say(f"{rec['id']}: ok, {f['step_ms']['median']:.1f} ms/step, {f['tokens_per_s']:,.0f} tokens/s")
        else:
            b.say(f"{rec['id']}: {rec['status']}: {rec.get('error')}")
        save()
    if doc.get("torch") is None:
        doc["torch"] = next((r.get("torch") for r in doc["runs"] if r.get("torch")), None)
    save()
    md = report.markdown(doc)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(md)
    print(md)
    b.say(f"{path} and {os.path.join(a.out, 'table.md')} written in {doc['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
