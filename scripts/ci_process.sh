#!/usr/bin/env bash
# Multi-process checks of the `process` backend beyond `cargo test --workspace` (which already
# runs crates/dtrun/tests/process_backend.rs: conformance on 2 and 4 processes, kill -9, bootstrap and
# store faults, dtrun): train_gpt on 4 processes under dtrun (dp=2 x tp=2, FSDP x TP) must print the
# same losses as the local backend (threads), bit for bit (both reduce in rank order), and a
# 4-process mp_allreduce run checks collectives and DTensor matmuls against one device; a
# `dtrun --max-restarts 1` run with a rank SIGKILLed mid-run (`--inject-fault`) resumes from its
# checkpoint and must end with the uninterrupted run's final loss (1e-4 relative). The same
# 4-process world formed from Slurm-style variables alone (what srun sets; no dtrun) must
# print the local losses too.
# A `dtrun --allow-failures 1` run of `train_gpt --hsdp --fault-tolerant` with rank 3 SIGKILLed
# must finish every step on the surviving replica and exit 0, with the losses of the same fault
# on the local backend. Faults inside a collective (`--inject-fault rank=R,collective=N`): a plain
# job stops every rank naming the killed one; FT-HSDP recovers and finishes every step.
# First, the binary's exit status on failed checks: `--check-against` a loss CSV with a planted
# NaN, a changed loss, a missing or an extra row exits 1, a malformed CSV 2, the unplanted CSV 0
# (tests/train_gpt_check.rs checks the same through real_main).
#
# Usage: scripts/ci_process.sh   (about a minute after `cargo test --workspace`, whose dev-profile
#                                 build it reuses)
# Env:   CDT_CI_PROFILE=release  builds in release instead of dev
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${CDT_CI_PROFILE:-dev}" == "release" ]]; then
    build_flag=(--release)
    dir=target/release
else
    build_flag=()
    dir=target/debug
fi

echo "== build (${CDT_CI_PROFILE:-dev}): dtrun, train_gpt, mp_allreduce"
cargo build "${build_flag[@]}" -p dtrun
cargo build "${build_flag[@]}" --example train_gpt --example mp_allreduce

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
tg=$dir/examples/train_gpt
args=(--mesh dp=2,tp=2 --steps 5 --json --timeout 120)

echo "== train_gpt --check-against: planted failures exit 1, a malformed CSV 2, the recording 0"
rec=(--mesh dp=2 --steps 3 --json --timeout 120)
"$tg" "${rec[@]}" --out "$out/rec" > /dev/null
expect_exit() { # status what --check-against-file
    local want="$1" what="$2" rc=0
    "$tg" "${rec[@]}" --out "$out/again" --check-against "$3" > "$out/check.log" 2>&1 || rc=$?
    if ((rc != want)); then
        echo "train_gpt --check-against with $what: exit $rc, expected $want" >&2
        cat "$out/check.log" >&2
        exit 1
    fi
    if ((want == 1)) && ! { grep -q '"check_passed":false' "$out/check.log" \
        && grep -q '^train_gpt: check failed: ' "$out/check.log"; }; then
        echo "train_gpt --check-against with $what: no failed-check summary or message" >&2
        cat "$out/check.log" >&2
        exit 1
    fi
    echo "   $what: exit $rc $(grep -o 'check failed: .*' "$out/check.log" | cut -c1-110)"
}
expect_exit 0 "the run's own CSV" "$out/rec.csv"
awk -F, -v OFS=, 'NR == 3 { $2 = "NaN" } 1' "$out/rec.csv" > "$out/nan.csv"
expect_exit 1 "a NaN loss" "$out/nan.csv"
awk -F, -v OFS=, 'NR == 2 { $2 = $2 * 1.01 } 1' "$out/rec.csv" > "$out/changed.csv"
expect_exit 1 "a loss 1% off" "$out/changed.csv"
head -n 3 "$out/rec.csv" > "$out/short.csv"
expect_exit 1 "a short run (a row missing)" "$out/short.csv"
{ cat "$out/rec.csv"; echo "3,5.0,"; } > "$out/long.csv"
expect_exit 1 "a long run (an extra row)" "$out/long.csv"
printf 'step,loss,eval_loss\n0,5.x,\n' > "$out/bad.csv"
expect_exit 2 "a malformed CSV" "$out/bad.csv"

echo "== train_gpt --backend local"
"$tg" --backend local "${args[@]}" --out "$out/local" | tail -n 1 > "$out/local.json"

echo "== dtrun --nproc 4 -- train_gpt --backend process"
"$dir/dtrun" --nproc 4 --timeout 600 -- "$tg" --backend process "${args[@]}" --out "$out/process" \
  | sed -n 's/^\[rank 0\] \({.*\)$/\1/p' > "$out/process.json"

python3 - "$out/local.json" "$out/process.json" <<'PY'
import json, sys
local, proc = (json.load(open(p)) for p in sys.argv[1:3])
a, b = local["losses"], proc["losses"]
print("local  :", a)
print("process:", b)
assert len(a) == len(b) == 5, (a, b)
diff = max(abs(x - y) for x, y in zip(a, b))
assert diff == 0.0, f"process and local losses differ by up to {diff}"
assert proc["backend"] == "process" and proc["world"] == 4, proc
print(f"train_gpt: process backend (4 processes) == local backend, bit for bit; "
      f"step {proc['step_ms_median']:.1f} ms vs {local['step_ms_median']:.1f} ms")
PY

echo "== the same world from Slurm-style variables alone (as srun sets them, no dtrun)"
# Two "nodes" of two tasks each on this host: SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID
# / SLURM_NODEID / SLURM_STEP_TASKS_PER_NODE, the store on the node list's first host at the port
# of the job id (comm::env::slurm); every rank's environment is only what srun would give it.
job_id=$((RANDOM * 32768 + RANDOM))
pids=()
for r in 0 1 2 3; do
    env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT SLURM_STEP_ID=0 SLURM_JOB_ID="$job_id" \
        SLURM_PROCID=$r SLURM_NTASKS=4 SLURM_STEP_NUM_TASKS=4 SLURM_LOCALID=$((r % 2)) \
        SLURM_NODEID=$((r / 2)) SLURM_STEP_TASKS_PER_NODE='2(x2)' \
        SLURM_JOB_NODELIST='localhost' CDT_JOB_TOKEN=ci-slurm-token \
        timeout 300 "$tg" --backend process "${args[@]}" --out "$out/slurm$r" \
        > "$out/slurm$r.json" 2> "$out/slurm$r.log" &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "rank $i of the Slurm-style world failed:" >&2
        cat "$out/slurm$i.log" >&2
        exit 1
    fi
done
python3 - "$out/local.json" "$out/slurm0.json" <<'PY'
import json, sys
local = json.load(open(sys.argv[1]))
slurm = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
assert slurm["backend"] == "process" and slurm["world"] == 4, slurm
assert slurm["losses"] == local["losses"], (slurm["losses"], local["losses"])
print("train_gpt: a world formed from SLURM_* variables alone (4 processes) == local backend, bit for bit")
PY

echo "== dtrun --max-restarts 1 -- train_gpt --backend process, rank 1 SIGKILLed after step 3"
ck="$out/ckpt"
"$dir/dtrun" --nproc 4 --timeout 600 --max-restarts 1 -- "$tg" --backend process "${args[@]}" \
  --save-dir "$ck" --save-every 2 --resume --inject-fault rank=1,step=3 \
  --out "$out/restart" | sed -n 's/^\[rank 0\] \({.*\)$/\1/p' > "$out/restart.json"
python3 - "$out/local.json" "$out/restart.json" <<'PY'
import json, sys
whole, restarted = (json.load(open(p)) for p in sys.argv[1:3])
a, b = whole["final_loss"], restarted["final_loss"]
assert restarted["start_step"] == 2, restarted["start_step"]
rel = abs(a - b) / abs(a)
assert rel <= 1e-4, f"restarted final loss {b} vs uninterrupted {a} (rel {rel})"
print(f"dtrun --max-restarts: resumed from step 2 after a SIGKILL, final loss {b} == {a} (rel {rel:.1e})")
PY

echo "== dtrun --nproc 4 -- mp_allreduce"
"$dir/dtrun" --nproc 4 --timeout 300 -- "$dir/examples/mp_allreduce"

echo "== dtrun --allow-failures 1 -- train_gpt --hsdp --fault-tolerant, rank 3 SIGKILLed after step 4"
"$dir/dtrun" --nproc 4 --timeout 300 --allow-failures 1 -- "$tg" --backend process \
  --mesh replicate=2,shard=2 --hsdp --fault-tolerant --steps 8 --timeout 1 --json \
  --inject-fault rank=3,step=4 --out "$out/ft" | sed -n 's/^\[rank [0-9]*\] \({.*\)$/\1/p' > "$out/ft.json"
python3 - "$out/ft.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["steps_completed"] == 8, d["steps_completed"]
assert d["lost_ranks"] == [2, 3], d["lost_ranks"]
assert d["recovery_ms"] is not None and d["recoveries"][0]["failed"] == [3], d["recoveries"]
print(f"fault-tolerant HSDP: finished 8 steps on the surviving replica, recovery {d['recovery_ms']:.0f} ms "
      f"(stall {d['recoveries'][0]['stall_ms']:.0f} ms)")
PY
# The local-backend twin (rank thread 3 fails after step 4): the same losses bit for bit, so the
# process run is held to what crates/parallel/tests/ft_hsdp.rs proves for the local one (the losses after
# the fault equal a run started on the surviving replica's state, 1e-5 relative).
"$tg" --mesh replicate=2,shard=2 --hsdp --fault-tolerant --steps 8 --timeout 1 --json \
  --inject-fault rank=3,step=4 --out "$out/ft_local" | tail -1 > "$out/ft_local.json"
python3 - "$out/ft.json" "$out/ft_local.json" <<'PY'
import json, sys
p, l = (json.load(open(f)) for f in sys.argv[1:3])
assert p["losses"] == l["losses"], (p["losses"], l["losses"])
assert p["lost_ranks"] == l["lost_ranks"], (p["lost_ranks"], l["lost_ranks"])
print("fault-tolerant HSDP: process and local runs lose the same ranks and print the same losses")
PY

echo "== faults inside collectives (--inject-fault rank=R,collective=N): a plain job stops, FT-HSDP recovers"
# A plain job: rank 1 SIGKILLs itself inside its 30th collective (issued, not completed, so its
# peers are in the middle of it); dtrun must stop every rank and name rank 1.
rc=0
"$dir/dtrun" --nproc 4 --timeout 300 -- "$tg" --backend process "${args[@]}" \
  --inject-fault rank=1,collective=30 --out "$out/mid" > /dev/null 2> "$out/mid.err" || rc=$?
if ((rc == 0)) || ! grep -q "rank 1 failed first (killed by signal 9 (SIGKILL))" "$out/mid.err"; then
    echo "a rank killed inside a collective: dtrun exit $rc, expected a failure naming rank 1" >&2
    cat "$out/mid.err" >&2
    exit 1
fi
grep -q "injecting a fault inside a collective" "$out/mid.err" \
  || { echo "the fault was not injected inside a collective" >&2; cat "$out/mid.err" >&2; exit 1; }
echo "   plain job: dtrun stopped every rank, naming rank 1 (killed inside a collective)"
# FT-HSDP: rank 3 dies inside its 50th collective (mid-step: an FSDP all-gather or
# reduce-scatter); the surviving replica finishes every step and reports the recovery.
"$dir/dtrun" --nproc 4 --timeout 300 --allow-failures 1 -- "$tg" --backend process \
  --mesh replicate=2,shard=2 --hsdp --fault-tolerant --steps 8 --timeout 1 --json \
  --inject-fault rank=3,collective=50 --out "$out/ftmid" 2> "$out/ftmid.err" \
  | sed -n 's/^\[rank [0-9]*\] \({.*\)$/\1/p' > "$out/ftmid.json"
python3 - "$out/ftmid.json" "$out/ftmid.err" <<'PY'
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
err = open(sys.argv[2]).read()
assert "injecting a fault inside a collective" in err, err[-2000:]
assert d["steps_completed"] == 8, d["steps_completed"]
assert d["lost_ranks"] == [2, 3], d["lost_ranks"]
assert d["recovery_ms"] is not None and d["recoveries"][0]["failed"] == [3], d["recoveries"]
print(f"   FT-HSDP: rank 3 killed inside a collective, the survivors finished 8 steps, "
      f"recovery {d['recovery_ms']:.0f} ms")
PY
