#!/usr/bin/env bash
# The prepared GPU run of issue 33 as ONE command, fitted to a short lease of a lent GPU
# machine: one call of at most 600 s, a working tree of at most 64 MiB travelling there, at
# most 8 files of at most 16 MiB coming back from $OUT, nothing downloaded or built there.
#
# Here, before (a machine with the toolchain; no GPU needed):
#   scripts/build_gpu.sh                  # target/gpu/gpu_bins.tar.xz (the binaries)
#   scripts/real_text.sh --fetch-only     # target/real_text/shakespeare.txt (the real run's text)
#   scripts/gpu_session.sh --prepare      # checks the binaries are HEAD's, compresses the text,
#                                         # adds up what travels, prints the device call
# There (the device tool's `run`, carrying target/gpu/gpu_bins.tar.xz and
# target/real_text/shakespeare.txt.xz, timeout_s 600):
#   scripts/gpu_session.sh --out "$OUT"
#
# With the default budgets the worst case (both scripts cut at their outer limits, 270 and
# 305 s, plus unpacking and collecting) ends by about 590 s, inside the call's 600; session.log is written as the run goes and
# gpu_check.json is copied as soon as the check ends, so even a call cut short returns them.
#
# The run unpacks the binaries (into target/gpu/bin) and the text where they are missing,
# runs scripts/gpu_check.sh (--budget, default 240 s: the kernels against their CPU
# references, every layout --check'ed against the CPU) and then scripts/gpu_bench.sh
# --real-text (--budget, default 260 s: ours vs PyTorch eager and torch.compile, the real
# run), each under an outer timeout, and whatever either does, leaves in --out: gpu_check.json,
# gpu_bench.json, table.md (gpu_bench's Markdown), session.log (this script's output) and
# logs.tgz (every log of both, files over 4 MB left out and listed). It prints the check's
# table and table.md's first part last, so a reply that keeps only the output's tail has them.
#
# Options:
#   --prepare            the checks and the text compression above, here; nothing runs
#   --out DIR            where the results go (default target/gpu_session)
#   --work DIR           the scripts' own output folders (default /tmp/gpu_session)
#   --check-budget S     gpu_check.sh's --budget (default 240; 0 leaves the check out)
#   --bench-budget S     gpu_bench.sh's --budget (default 260; 0 leaves the benchmark out)
# Exit status: 0 when both scripts ran and their results were collected (whatever their
# steps did: read the JSON), 1 when something needed was missing, 2 on a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare=0 out=target/gpu_session work=/tmp/gpu_session check_budget=240 bench_budget=260
while (($#)); do
    case "$1" in
        --prepare) prepare=1 ;;
        --out) out="$2"; shift ;;
        --work) work="$2"; shift ;;
        --check-budget) check_budget="$2"; shift ;;
        --bench-budget) bench_budget="$2"; shift ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        *) echo "gpu_session.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
for b in "$check_budget" "$bench_budget"; do
    [[ "$b" =~ ^[0-9]+$ ]] || { echo "gpu_session.sh: a budget takes whole seconds, not '$b'" >&2; exit 2; }
done

tarball=target/gpu/gpu_bins.tar.xz
text=target/real_text/shakespeare.txt
# The device tool's limit on what travels (tracked and untracked-not-ignored files plus the
# carried paths), and on each file coming back.
travel_limit=$((64 << 20))
back_limit=$((16 << 20))

if ((prepare)); then
    status=0
    if [[ ! -f "$tarball" ]]; then
        echo "gpu_session.sh: no $tarball: run scripts/build_gpu.sh" >&2
        exit 1
    fi
    built="$(tar -xJOf "$tarball" bin/BUILD_INFO 2>/dev/null | sed -n 's/^commit=//p')"
    head="$(git rev-parse --short HEAD)"
    # What the binaries are built from: the Rust sources, manifests and the vendored crate.
    code=(crates src examples vendor Cargo.toml Cargo.lock build.rs)
    if [[ -z "$built" ]]; then
        echo "warning: $tarball has no bin/BUILD_INFO commit" >&2
        status=1
    elif [[ "$built" == *+dirty ]]; then
        echo "warning: the binaries were built from a dirty tree ($built): rebuild at a commit" >&2
        status=1
    elif ! git diff --quiet "$built" HEAD -- "${code[@]}" 2>/dev/null; then
        echo "warning: the binaries are of $built; the code changed since (HEAD $head):" >&2
        git diff --stat "$built" HEAD -- "${code[@]}" | tail -n 1 >&2
        echo "         rebuild with scripts/build_gpu.sh" >&2
        status=1
    else
        echo "binaries: of $built; no code change since (HEAD $head)"
    fi
    carry=("$tarball")
    if [[ -f "$text" ]]; then
        if [[ ! -f "$text.xz" || "$text" -nt "$text.xz" ]]; then
            xz -9 -k -c "$text" > "$text.xz.tmp" && mv "$text.xz.tmp" "$text.xz"
        fi
        carry+=("$text.xz")
    else
        echo "warning: no $text (scripts/real_text.sh --fetch-only): the real run will fail" >&2
        status=1
    fi
    # What travels: the files git does not ignore, plus the carried paths.
    tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
        awk '{ s += $1 } END { print s + 0 }')
    carried=$(stat -c %s "${carry[@]}" | awk '{ s += $1 } END { print s + 0 }')
    total=$((tree + carried))
    printf 'travels: %d bytes of tree + %d carried = %d of %d (%d%%)\n' \
        "$tree" "$carried" "$total" "$travel_limit" $((100 * total / travel_limit))
    if ((total > travel_limit)); then
        echo "gpu_session.sh: over the device tool's 64 MiB: the call would be refused" >&2
        status=1
    fi
    echo "the device call: run(command=\"scripts/gpu_session.sh --out \\\"\$OUT\\\"\","
    echo "                 carry=[$(printf '"%s", ' "${carry[@]}" | sed 's/, $//')], timeout_s=600)"
    exit "$status"
fi

mkdir -p "$out" "$work"
out="$(cd "$out" && pwd)"
log="$out/session.log"
: > "$log"
# Everything this script and the two scripts print also goes to session.log.
exec > >(tee -a "$log") 2>&1
tee_pid=$!
# At the end: close the pipe to tee and give it up to 5 s to finish, so that the last lines
# (the summary a reply's output tail keeps) are written before this script returns. Bounded:
# a process a step left behind may still hold the pipe open.
finish() {
    exec >&- 2>&-
    local i
    for ((i = 0; i < 50; i++)); do
        kill -0 "$tee_pid" 2>/dev/null || break
        sleep 0.1
    done
    exit "$1"
}
t0=$(date +%s)
say() { echo "== gpu_session +$(( $(date +%s) - t0 ))s: $*"; }

# Unpack with the tools there, or with python (tarfile and lzma are in its standard library).
unpack_bins() {
    [[ -x target/gpu/bin/train_gpt ]] && return 0
    [[ -f "$tarball" ]] || { say "no target/gpu/bin and no $tarball"; return 1; }
    say "unpacking $tarball"
    if command -v xz >/dev/null 2>&1; then
        tar -C target/gpu -xJf "$tarball" && return 0
    fi
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$tarball" target/gpu
}
unpack_text() {
    [[ -f "$text" ]] && return 0
    [[ -f "$text.xz" ]] || { say "no $text and no $text.xz: the real run will fail"; return 0; }
    say "unpacking $text.xz"
    python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$text.xz" "$text"
}
unpack_bins || { say "cannot unpack the binaries"; finish 1; }
[[ -f target/gpu/bin/BUILD_INFO ]] && say "binaries: $(paste -sd' ' target/gpu/bin/BUILD_INFO)"
unpack_text

check_dir="$work/check" bench_dir="$work/bench"
rm -rf "$check_dir" "$bench_dir"
if ((check_budget > 0)); then
    say "gpu_check.sh --budget $check_budget"
    # The outer limit: the budget, the last step's kill grace (10 s) and the table.
    CDT_GPU_LOG_DIR="$check_dir" timeout --kill-after=5 $((check_budget + 25)) \
        scripts/gpu_check.sh --bin-dir target/gpu/bin --budget "$check_budget"
    say "gpu_check.sh exit $?"
    # Back at once: a call cut short later still returns the check.
    [[ -f "$check_dir/gpu_check.json" ]] && cp "$check_dir/gpu_check.json" "$out/"
fi
if ((bench_budget > 0)); then
    say "gpu_bench.sh --real-text --budget $bench_budget"
    # gpu_bench.py ends within its budget plus one run's kill grace (10 s); torch's import and
    # gpu_bench.sh's library checks come before it.
    timeout --kill-after=5 $((bench_budget + 40)) \
        scripts/gpu_bench.sh --bin-dir target/gpu/bin --real-text --budget "$bench_budget" --out "$bench_dir"
    say "gpu_bench.sh exit $?"
fi

# Back: the result files, and one archive of the logs (the device tool returns at most 8
# files, each at most 16 MiB).
say "collecting into $out"
[[ -f "$bench_dir/gpu_bench.json" ]] && cp "$bench_dir/gpu_bench.json" "$out/"
[[ -f "$bench_dir/table.md" ]] && cp "$bench_dir/table.md" "$out/"
big="$(find "$work" -type f -size +4M 2>/dev/null)"
if [[ -n "$big" ]]; then
    echo "left out of logs.tgz (over 4 MB):"
    ls -l $big
fi
find "$work" -type f -size -4097k -printf '%P\n' 2>/dev/null | sort > "$work/.files"
tar -C "$work" -czf "$out/logs.tgz" -T "$work/.files" 2>/dev/null
size=$(stat -c %s "$out/logs.tgz" 2>/dev/null || echo 0)
if ((size > back_limit)); then
    # Too large to come back: the largest logs go until it fits.
    while ((size > back_limit)) && [[ -s "$work/.files" ]]; do
        drop="$(cd "$work" && xargs -d '\n' ls -S < .files | head -n 1)"
        grep -vxF "$drop" "$work/.files" > "$work/.files.tmp"; mv "$work/.files.tmp" "$work/.files"
        echo "left out of logs.tgz (too large to come back): $drop"
        tar -C "$work" -czf "$out/logs.tgz" -T "$work/.files" 2>/dev/null
        size=$(stat -c %s "$out/logs.tgz")
    done
fi
say "results: $(cd "$out" && ls | paste -sd' ' -)"

# Last, for a reply that keeps only the output's tail: the check's rows and table.md's start.
if [[ -f "$out/gpu_check.json" ]]; then
    echo "== gpu_check rows"
    python3 - "$out/gpu_check.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{d.get('gpu', '')}: {d.get('seconds')} s of budget {d.get('budget')}")
for s in d.get("steps", []):
    print(f"{s['step']:<6} {s['result']:<5} {s['seconds']:>4}s  {s['detail'][:110]}")
PY
fi
if [[ -f "$out/table.md" ]]; then
    echo "== table.md (first 7000 characters; all of it in $out/table.md)"
    head -c 7000 "$out/table.md"
    echo
fi
say "done"
finish 0
