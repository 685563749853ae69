#!/usr/bin/env bash
# Runs the project's benchmarks and prints the tables BENCHMARKS.md records.
#
#   scripts/bench.sh            # everything (about 4 minutes on the 2-core dev box, build excluded)
#   scripts/bench.sh train      # only the train_gpt layouts (also: comm, redistribute,
#                               # dispatch, moe, ckpt, cp, strategies)
#   ROUNDS=5 scripts/bench.sh   # more interleaved rounds per layout (default 3)
#
# Every figure is a median. train_gpt layouts are run in interleaved rounds (layout A, B, C, then
# A, B, C again, ...) so that a noisy neighbour slows all of them alike; the ratios between
# layouts are more trustworthy than the absolute milliseconds on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-all}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-20}"
export CANDLE_NUM_THREADS="${CANDLE_NUM_THREADS:-1}"

cargo build --release --examples -q
cargo build --release -q -p candle-dtensor-strategies --example propagation_bench
bin=${CARGO_TARGET_DIR:-target}/release/examples

# One markdown row per JSON line on stdin: the line's fields through Python's str.format
# (`{field:.2f}`, `{nested[key]:.1f}`); a null field prints as "-". A line without the field
# named by $2 (a summary such as comm_bench's memory line) prints as a note after the table.
json_rows() {
    python3 -c '
import json, sys
class F:
    def __init__(s, v): s.v = v
    def __format__(s, spec): return "-" if s.v is None else format(s.v, spec)
    def __getitem__(s, k): return F(None if s.v is None else s.v[k])
fmt, key = sys.argv[1], sys.argv[2]
notes = []
for line in sys.stdin:
    d = json.loads(line)
    if key not in d:
        notes.append(json.dumps(d))
        continue
    print(fmt.format(**{k: F(v) for k, v in d.items()}))
for n in notes:
    print(); print("note:", n)
' "$1" "$2"
}

echo "# candle-dtensor benchmarks ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg))"
echo

if [[ "$what" == all || "$what" == train ]]; then
    # name | flags
    layouts=(
        "single device|--mesh tp=1 --no-fsdp"
        "TP=4|--mesh tp=4 --no-fsdp"
        "TP=4 + SP|--mesh tp=4 --sp --no-fsdp"
        "FSDP dp=4|--mesh dp=4 --fsdp"
        "HSDP 2x2|--mesh replicate=2,shard=2 --hsdp"
        "FSDP x TP 2x2|--mesh dp=2,tp=2 --fsdp"
        "FSDP dp=2|--mesh dp=2 --fsdp"
        "FSDP dp=2, separate RS comm|--mesh dp=2 --fsdp --separate-rs-group"
    )
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    for r in $(seq "$rounds"); do
        for i in "${!layouts[@]}"; do
            flags="${layouts[$i]#*|}"
            # shellcheck disable=SC2086
            "$bin/train_gpt" --preset tiny --steps "$steps" --json --out "$tmp/loss" $flags \
                >"$tmp/$i.$r.json"
        done
    done
    python3 - "$tmp" "$rounds" "${layouts[@]}" <<'EOF'
import json, statistics, sys
tmp, rounds, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = []
for i, l in enumerate(layouts):
    name, flags = l.split("|", 1)
    runs = [json.load(open(f"{tmp}/{i}.{r}.json")) for r in range(1, rounds + 1)]
    med = lambda k: statistics.median(x[k] for x in runs)
    rows.append((name, flags, med("step_ms_median"), med("forward_ms_median"),
                 med("backward_ms_median"), med("optimizer_ms_median"),
                 med("exposed_comm_ms_per_step"), runs[0]["final_loss"],
                 runs[0].get("param_grad_optim_bytes_per_rank"),
                 runs[0].get("zero3_theory_bytes_per_rank")))
single = rows[0][2]
print(f"## train_gpt, tiny preset, {len(layouts)} layouts x {rounds} interleaved rounds")
print()
print("| layout | flags | step ms | vs single | fwd | bwd | optim | exposed comm | final loss | P+G+O bytes/rank | ZeRO-3 theory |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (name, flags, step, f, b, o, c, loss, pgo, th) in rows:
    th = "" if th is None else th
    print(f"| {name} | `{flags}` | {step:.1f} | {step / single:.2f} | {f:.1f} | {b:.1f} | {o:.1f} | {c:.1f} | {loss:.4f} | {pgo} | {th} |")
print()
EOF
fi

if [[ "$what" == all || "$what" == comm ]]; then
    echo "## comm_bench (local backend, world 4; outputs preallocated (into) and fresh (alloc))"
    echo
    echo "| op | output | bytes | median ms | algbw GB/s | busbw GB/s | efficiency vs memcpy floor |"
    echo "|---|---|---:|---:|---:|---:|---:|"
    "$bin/comm_bench" --json --mode into,alloc |
        json_rows "| {op} | {output} | {bytes} | {median_ms:.3f} | {algbw_gbps:.2f} | {busbw_gbps:.2f} | {efficiency:.2f} |" op
    echo
fi

if [[ "$what" == all || "$what" == redistribute ]]; then
    echo "## redistribute_bench (DTensor::redistribute, f32 n x n, 4 ranks)"
    echo
    echo "| case | mesh | n | median ms | floor ms | efficiency | plan |"
    echo "|---|---|---:|---:|---:|---:|---|"
    "$bin/redistribute_bench" --json |
        json_rows "| \`{case}\` | {mesh} | {n} | {median_ms:.2f} | {floor_ms:.2f} | {efficiency:.2f} | \`{plan}\` |" case
    echo
fi

if [[ "$what" == all || "$what" == dispatch ]]; then
    echo "## dispatch_bench (overhead of a DTensor op over the plain candle op)"
    echo
    echo "| op | shape | placements | candle us | dtensor us | overhead us |"
    echo "|---|---|---|---:|---:|---:|"
    "$bin/dispatch_bench" --json |
        json_rows "| {op} | {shape} | {placements} | {candle_us:.2f} | {dtensor_us:.2f} | {overhead_us:.2f} |" op
    echo
fi

if [[ "$what" == all || "$what" == moe ]]; then
    echo "## moe_bench (MoE dispatch + combine vs the all_to_all floor, 4 ranks, 8 experts, top-2, dim 256)"
    echo
    echo "| transport | tokens/rank | floor ms | dispatch+combine ms | ratio | counts | permute | dispatch | reverse | combine |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    "$bin/moe_bench" --json |
        json_rows "| {transport} | {tokens_per_rank} | {floor_ms:.1f} | {dispatch_combine_ms:.1f} | {ratio:.2f} | {phase_ms[counts]:.1f} | {phase_ms[permute]:.1f} | {phase_ms[dispatch]:.1f} | {phase_ms[reverse]:.1f} | {phase_ms[combine]:.1f} |" transport
    echo
fi

if [[ "$what" == all || "$what" == ckpt ]]; then
    echo "## ckpt_bench (small preset, FSDP dp=4, resharded load onto one rank)"
    echo
    echo '```json'
    "$bin/ckpt_bench" --reps 3 --reshard-to tp=1 --json
    echo '```'
    echo
fi

if [[ "$what" == all || "$what" == cp ]]; then
    echo "## cp_bench (context-parallel attention per layer, causal, load-balanced, 4 heads of 64, link cp=50us:1GBps)"
    echo
    echo "| strategy | T | cp | attention ms (fwd+bwd) | waited ms | waited share | no link: ms | no link: waited ms | link's share | one ring step modeled ms |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    "$bin/cp_bench" --t 1024,2048,4096 --cp 2,4 --reps 3 --json |
        json_rows "| {strategy} | {t} | {cp} | {attn_ms:.1f} | {exposed_ms:.2f} | {exposed_frac:.3f} | {attn_nolink_ms:.1f} | {exposed_nolink_ms:.2f} | {link_frac:+.3f} | {block_xfer_ms:.3f} |" strategy
    echo
fi

if [[ "$what" == all || "$what" == strategies ]]; then
    echo "## propagation_bench (sharding propagation; see strategies/BENCHMARKS.md)"
    echo
    echo '```'
    "$bin/propagation_bench"
    echo '```'
fi
