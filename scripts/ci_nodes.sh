#!/usr/bin/env bash
# dtrun across nodes, for real, on one machine: two network namespaces ("nodes") joined by a veth
# pair (10.77.0.1/24 and 10.77.0.2/24), one dtrun per namespace. Checks:
#  1. bad input fails on every node within --rdzv-timeout, naming the node and the setting:
#     nodes disagreeing on --nproc-per-node, and a node holding another job token;
#  2. 2 nodes x 2 ranks of `train_gpt --backend process --mesh dp=2,tp=2 --steps 5` print the
#     same losses as the single-node 4-rank run (`dtrun --nproc 4`), bit for bit;
#  3. a rank SIGKILLed on node 1 (`--inject-fault rank=3,step=2`: global rank 3 is node 1's local
#     rank 1) stops every rank on both nodes within a few seconds, and both dtruns name node 1
#     rank 3 and exit non-zero;
#  4. --max-restarts and --allow-failures across nodes;
#  5. the same 4-rank world formed from Slurm-style variables alone (2 tasks per namespace, no
#     dtrun, the store on the node list's first host) prints the single-node losses.
# All traffic stays inside the namespaces; they are deleted on exit (trap). Needs root and `ip`
# (iproute2): without them it says so and exits 0, or 1 when CI=true.
#
# Usage: scripts/ci_nodes.sh   (reuses the dev-profile build of `cargo test --workspace`)
# Env:   CDT_CI_PROFILE=release  builds in release instead of dev
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
    echo "ci_nodes.sh: SKIPPED: $*"
    if [[ "${CI:-}" == "true" ]]; then
        echo "ci_nodes.sh: CI=true: a skipped check fails CI" >&2
        exit 1
    fi
    exit 0
}
[[ "$(id -u)" == 0 ]] || skip "network namespaces need root (this is uid $(id -u))"
command -v ip > /dev/null || skip "no 'ip' command (iproute2)"

if [[ "${CDT_CI_PROFILE:-dev}" == "release" ]]; then
    build_flag=(--release)
    dir=target/release
else
    build_flag=()
    dir=target/debug
fi

echo "== build (${CDT_CI_PROFILE:-dev}): dtrun, train_gpt"
cargo build "${build_flag[@]}" -p dtrun
cargo build "${build_flag[@]}" --example train_gpt
dtrun=$PWD/$dir/dtrun
tg=$PWD/$dir/examples/train_gpt

ns0=cdt-node0-$$
ns1=cdt-node1-$$
veth=cdtv$$
out=$(mktemp -d)
cleanup() {
    ip netns del "$ns0" 2> /dev/null || true
    ip netns del "$ns1" 2> /dev/null || true
    rm -rf "$out"
}
trap cleanup EXIT
ip netns add "$ns0" || skip "cannot create a network namespace (ip netns add failed)"
ip netns add "$ns1" || skip "cannot create a second network namespace"
ip link add "${veth}a" type veth peer name "${veth}b" || skip "cannot create a veth pair"
ip link set "${veth}a" netns "$ns0"
ip link set "${veth}b" netns "$ns1"
ip -n "$ns0" addr add 10.77.0.1/24 dev "${veth}a"
ip -n "$ns1" addr add 10.77.0.2/24 dev "${veth}b"
for ns in "$ns0" "$ns1"; do
    ip -n "$ns" link set lo up
done
ip -n "$ns0" link set "${veth}a" up
ip -n "$ns1" link set "${veth}b" up
echo "   namespaces $ns0 (10.77.0.1) and $ns1 (10.77.0.2), veth ${veth}a/${veth}b"

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$out/token"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$out/other_token"
port=29577
args=(--mesh dp=2,tp=2 --steps 5 --json --timeout 10)

# node NS RANK OUT DTRUN-ARGS... -- CMD...: one dtrun in namespace NS, in the background.
node() {
    local ns=$1 rank=$2 log=$3
    shift 3
    ip netns exec "$ns" "$dtrun" --nnodes 2 --node-rank "$rank" --master-addr 10.77.0.1 \
        --master-port "$port" --timeout 300 "$@" > "$log.out" 2> "$log.err" &
    pids+=($!)
}
# wait_nodes: waits for the two dtruns just started; sets rc0 and rc1 (and t_0, t_1: when each
# had exited, in seconds since the epoch).
wait_nodes() {
    rc0=0; wait "${pids[0]}" || rc0=$?
    t_0=$(date +%s.%N)
    rc1=0; wait "${pids[1]}" || rc1=$?
    t_1=$(date +%s.%N)
    pids=()
}
pids=()
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# expect_fail LOG WHAT...: the dtrun of LOG failed and its stderr says every WHAT.
expect_fail() {
    local log=$1 rc=$2
    shift 2
    if ((rc == 0)); then
        echo "ci_nodes.sh: $log: dtrun exited 0, expected a failure" >&2
        cat "$log.err" >&2
        exit 1
    fi
    for w in "$@"; do
        if ! grep -q -- "$w" "$log.err"; then
            echo "ci_nodes.sh: $log: dtrun (exit $rc) does not say '$w':" >&2
            cat "$log.err" >&2
            exit 1
        fi
    done
}

echo "== bad input: the nodes disagree on --nproc-per-node"
t0=$(date +%s.%N)
node "$ns0" 0 "$out/np0" --nproc-per-node 2 --token-file "$out/token" --rdzv-timeout 10 -- /bin/true
node "$ns1" 1 "$out/np1" --nproc-per-node 3 --token-file "$out/token" --rdzv-timeout 10 -- /bin/true
wait_nodes
t1=$(date +%s.%N)
expect_fail "$out/np0" "$rc0" "disagree on --nproc-per-node" "node 0 (" "has 2" "node 1 (" "has 3"
expect_fail "$out/np1" "$rc1" "disagree on --nproc-per-node" "node 0 (" "has 2" "node 1 (" "has 3"
printf '   both nodes failed in %ss: %s\n' "$(secs "$t0" "$t1")" "$(grep -o 'the nodes disagree.*' "$out/np1.err" | cut -c1-150)"

echo "== bad input: node 1 holds another job token"
t0=$(date +%s.%N)
node "$ns0" 0 "$out/tk0" --nproc-per-node 2 --token-file "$out/token" --rdzv-timeout 5 -- /bin/true
node "$ns1" 1 "$out/tk1" --nproc-per-node 2 --token-file "$out/other_token" --rdzv-timeout 5 -- /bin/true
wait_nodes
t1=$(date +%s.%N)
expect_fail "$out/tk1" "$rc1" "node 1: node 0's control store" "refused this node's job token"
expect_fail "$out/tk0" "$rc0" "only 1 of 2 nodes" "job token differs"
printf '   both nodes failed in %ss (--rdzv-timeout 5): node 1: %s\n' "$(secs "$t0" "$t1")" \
    "$(grep -o 'refused this node.s job token' "$out/tk1.err")"

echo "== reference: dtrun --nproc 4 -- train_gpt --backend process (one node, in $ns0)"
ip netns exec "$ns0" "$dtrun" --nproc 4 --timeout 300 -- "$tg" --backend process "${args[@]}" \
    --out "$out/single" | sed -n 's/^\[rank 0\] \({.*\)$/\1/p' > "$out/single.json"

echo "== 2 nodes x 2 ranks: dtrun --nnodes 2 --nproc-per-node 2 -- train_gpt --backend process"
t0=$(date +%s.%N)
node "$ns0" 0 "$out/n0" --nproc-per-node 2 --token-file "$out/token" -- \
    "$tg" --backend process "${args[@]}" --out "$out/multi"
node "$ns1" 1 "$out/n1" --nproc-per-node 2 --token-file "$out/token" -- \
    "$tg" --backend process "${args[@]}" --out "$out/multi1"
wait_nodes
t1=$(date +%s.%N)
if ((rc0 != 0 || rc1 != 0)); then
    echo "ci_nodes.sh: the 2-node run failed (node 0: exit $rc0, node 1: exit $rc1)" >&2
    tail -n 30 "$out/n0.err" "$out/n1.err" >&2
    exit 1
fi
sed -n 's/^\[rank 0\] \({.*\)$/\1/p' "$out/n0.out" > "$out/multi.json"
good_s=$(secs "$t0" "$t1")
python3 - "$out/single.json" "$out/multi.json" "$good_s" <<'PY'
import json, sys
single, multi = (json.load(open(p)) for p in sys.argv[1:3])
a, b = single["losses"], multi["losses"]
print("   1 node x 4 :", a)
print("   2 nodes x 2:", b)
assert len(a) == len(b) == 5, (a, b)
assert a == b, "the 2-node losses differ from the single-node run's"
assert multi["backend"] == "process" and multi["world"] == 4, multi
print(f"   2 nodes x 2 ranks == 1 node x 4 ranks, bit for bit ({float(sys.argv[3]):.1f}s wall)")
PY

echo "== a rank SIGKILLed on node 1 (--inject-fault rank=3,step=2) stops both nodes"
t0=$(date +%s.%N)
node "$ns0" 0 "$out/f0" --nproc-per-node 2 --token-file "$out/token" -- \
    "$tg" --backend process "${args[@]}" --inject-fault rank=3,step=2 --out "$out/fault"
node "$ns1" 1 "$out/f1" --nproc-per-node 2 --token-file "$out/token" -- \
    "$tg" --backend process "${args[@]}" --inject-fault rank=3,step=2 --out "$out/fault1"
wait_nodes
expect_fail "$out/f0" "$rc0" "job failed on" "node 1 rank 3 (local rank 1) failed: killed by signal 9"
expect_fail "$out/f1" "$rc1" "job failed on" "node 1 rank 3 (local rank 1) failed: killed by signal 9"
# Every rank of both nodes is gone: each dtrun reaps its ranks before it exits.
if ip netns exec "$ns0" pgrep -f "$out/fault" > /dev/null || ip netns exec "$ns1" pgrep -f "$out/fault" > /dev/null; then
    echo "ci_nodes.sh: ranks of the faulted job outlived their dtruns" >&2
    exit 1
fi
printf '   node 0 exit %d after %ss, node 1 exit %d after %ss (the clean run: %ss; ops time out in 10s)\n' \
    "$rc0" "$(secs "$t0" "$t_0")" "$rc1" "$(secs "$t0" "$t_1")" "$good_s"
grep -h -o 'job failed on .*' "$out/f0.err" | cut -c1-200 | sed 's/^/   node 0: /'
python3 - "$t0" "$t_0" "$t_1" "$good_s" <<'PY'
import sys
t0, a, b, good = map(float, sys.argv[1:5])
# At most the clean run's time plus the op timeout (10s) and a few seconds.
assert max(a, b) - t0 <= good + 10 + 5, (a - t0, b - t0, good)
PY

echo "== --max-restarts 1 on both nodes: rank 3 (node 1) SIGKILLed after step 3, every node restarts"
t0=$(date +%s.%N)
ck="$out/ckpt"
for r in 0 1; do
    ns=$ns0; ((r == 1)) && ns=$ns1
    node "$ns" "$r" "$out/r$r" --nproc-per-node 2 --token-file "$out/token" --max-restarts 1 -- \
        "$tg" --backend process "${args[@]}" --save-dir "$ck" --save-every 2 --resume \
        --inject-fault rank=3,step=3 --out "$out/restart$r"
done
wait_nodes
if ((rc0 != 0 || rc1 != 0)); then
    echo "ci_nodes.sh: the restarted 2-node run failed (node 0: exit $rc0, node 1: exit $rc1)" >&2
    tail -n 30 "$out/r0.err" "$out/r1.err" >&2
    exit 1
fi
for r in 0 1; do
    grep -q "restarting the job (1 of at most 1 restarts)" "$out/r$r.err" \
        || { echo "ci_nodes.sh: node $r did not restart" >&2; cat "$out/r$r.err" >&2; exit 1; }
done
sed -n 's/^\[rank 0\] \({.*\)$/\1/p' "$out/r0.out" | tail -n 1 > "$out/restart.json"
python3 - "$out/single.json" "$out/restart.json" "$(secs "$t0" "$t_1")" <<'PY'
import json, sys
whole, restarted = (json.load(open(p)) for p in sys.argv[1:3])
a, b = whole["final_loss"], restarted["final_loss"]
assert restarted["start_step"] == 2, restarted["start_step"]
rel = abs(a - b) / abs(a)
assert rel <= 1e-4, f"restarted final loss {b} vs uninterrupted {a} (rel {rel})"
print(f"   both nodes restarted together, resumed from step 2, final loss {b} == {a} (rel {rel:.1e}; {float(sys.argv[3]):.1f}s wall)")
PY

echo "== --allow-failures 1 across nodes: train_gpt --hsdp --fault-tolerant, rank 3 (node 1) SIGKILLed after step 4"
ft=(--mesh replicate=2,shard=2 --hsdp --fault-tolerant --steps 8 --timeout 1 --json --inject-fault rank=3,step=4)
for r in 0 1; do
    ns=$ns0; ((r == 1)) && ns=$ns1
    node "$ns" "$r" "$out/a$r" --nproc-per-node 2 --token-file "$out/token" --allow-failures 1 -- \
        "$tg" --backend process "${ft[@]}" --out "$out/ft$r"
done
wait_nodes
if ((rc0 != 0 || rc1 != 0)); then
    echo "ci_nodes.sh: the fault-tolerant 2-node run failed (node 0: exit $rc0, node 1: exit $rc1)" >&2
    tail -n 30 "$out/a0.err" "$out/a1.err" >&2
    exit 1
fi
sed -n 's/^\[rank 0\] \({.*\)$/\1/p' "$out/a0.out" | tail -n 1 > "$out/ft.json"
ip netns exec "$ns0" "$tg" "${ft[@]}" --out "$out/ft_local" 2> "$out/ft_local.err" | tail -n 1 > "$out/ft_local.json"
python3 - "$out/ft.json" "$out/ft_local.json" <<'PY'
import json, sys
p, l = (json.load(open(f)) for f in sys.argv[1:3])
assert p["steps_completed"] == 8, p["steps_completed"]
assert p["lost_ranks"] == [2, 3] == l["lost_ranks"], (p["lost_ranks"], l["lost_ranks"])
assert p["losses"] == l["losses"], (p["losses"], l["losses"])
print("   node 1's replica lost, node 0 finished 8 steps with the local backend's losses; both dtruns exit 0")
PY
echo "== the same world from Slurm-style variables alone: 2 tasks per namespace, no dtrun"
# What srun gives each task (comm::env::slurm): the store on the node list's first host
# (10.77.0.1, node 0) at the port of the job id; each task's environment holds only these.
job_id=$((RANDOM * 32768 + RANDOM))
pids=()
for r in 0 1 2 3; do
    ns=$ns0; ((r >= 2)) && ns=$ns1
    ip netns exec "$ns" env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT \
        SLURM_STEP_ID=0 SLURM_JOB_ID="$job_id" SLURM_PROCID=$r SLURM_NTASKS=4 \
        SLURM_STEP_NUM_TASKS=4 SLURM_LOCALID=$((r % 2)) SLURM_NODEID=$((r / 2)) \
        SLURM_STEP_TASKS_PER_NODE='2(x2)' SLURM_JOB_NODELIST='10.77.0.1,10.77.0.2' \
        CDT_JOB_TOKEN="$(cat "$out/token")" timeout 300 "$tg" --backend process "${args[@]}" \
        --out "$out/slurm$r" > "$out/slurm$r.json" 2> "$out/slurm$r.err" &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "ci_nodes.sh: task $i of the Slurm-style world failed:" >&2
        tail -n 30 "$out/slurm$i.err" >&2
        exit 1
    fi
done
python3 - "$out/single.json" "$out/slurm0.json" <<'PY'
import json, sys
single = json.load(open(sys.argv[1]))
slurm = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
assert slurm["world"] == 4 and slurm["backend"] == "process", slurm
assert slurm["losses"] == single["losses"], (slurm["losses"], single["losses"])
print("   4 tasks on 2 namespaces from SLURM_* variables == 1 node x 4 ranks, bit for bit")
PY
echo "ci_nodes.sh: OK"
