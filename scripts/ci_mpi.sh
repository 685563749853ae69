#!/usr/bin/env bash
# CI for the `mpi` backend (called from .ci/run after the default steps, whose dev-profile
# dependency builds it reuses): installs Open MPI, checks and lints the workspace with
# `--features mpi`, runs the conformance suite under mpirun (4 and 3 processes), and checks
# that train_gpt under mpirun reports the same losses as the local backend. (The mpi module's
# descriptor tests run in `cargo test --workspace`; its other unit tests need the feature:
# `cargo test -p candle-dtensor-comm-mpi --features mpi --lib`.) Every step is bounded; the
# script prints the time of each step.
#
# Usage: scripts/ci_mpi.sh            (from anywhere; needs root or sudo to install packages)
# Env:   CDT_MPI_CI_PROFILE=release   builds the examples in release instead of dev
set -euo pipefail
cd "$(dirname "$0")/.."

profile="${CDT_MPI_CI_PROFILE:-dev}"
if [[ "$profile" == "release" ]]; then
    build_flag=(--release)
    bin_dir=target/release/examples
else
    build_flag=()
    bin_dir=target/debug/examples
fi
# Open MPI refuses root without this, and the CI machine has fewer cores than ranks.
mpirun_args=(--allow-run-as-root --oversubscribe)
t_start=$(date +%s)
step() {
    local now
    now=$(date +%s)
    echo "== [mpi ci +$((now - t_start))s] $*"
}

step "scripts/setup_mpi.sh"
scripts/setup_mpi.sh

step "cargo check --workspace --features mpi --all-targets"
cargo check --workspace --features mpi --all-targets

# The feature changes the mpi backend's crate, the comm front that forwards it, and the facade
# (its mpi_* examples); .ci/run already linted the crates in between, which the feature does
# not touch.
step "cargo clippy -p candle-dtensor-comm-mpi -p candle-dtensor-comm -p candle-dtensor --all-targets --features mpi"
cargo clippy -p candle-dtensor-comm-mpi -p candle-dtensor-comm -p candle-dtensor --all-targets --features mpi -- -D warnings

step "build mpi_conformance and train_gpt ($profile)"
cargo build "${build_flag[@]}" --features mpi --example mpi_conformance --example train_gpt

for np in 4 3; do
    step "mpirun -np $np mpi_conformance"
    timeout 600 mpirun "${mpirun_args[@]}" -np "$np" "$bin_dir/mpi_conformance"
done

step "train_gpt: mpi (mpirun -np 4) vs local losses, mesh dp=2,tp=2, 5 steps"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
timeout 600 "$bin_dir/train_gpt" --backend local --mesh dp=2,tp=2 --steps 5 --json \
    --out "$out/local" >"$out/local.json"
timeout 600 mpirun "${mpirun_args[@]}" -np 4 "$bin_dir/train_gpt" --backend mpi \
    --mesh dp=2,tp=2 --steps 5 --json --out "$out/mpi" >"$out/mpi.json"
losses() {
    # The "losses" array of the JSON summary line, one number per line.
    grep -o '"losses":\[[^]]*\]' "$1" | head -n 1 | sed 's/.*\[//; s/\]//' | tr ',' '\n'
}
losses "$out/local.json" >"$out/local.txt"
losses "$out/mpi.json" >"$out/mpi.txt"
paste -d' ' "$out/local.txt" "$out/mpi.txt" | awk '
    NF != 2 { bad = 1 }
    {
        d = $1 - $2; if (d < 0) d = -d
        r = d / ($1 < 0 ? -$1 : $1)
        if (r > max) max = r
        n++
        printf "  step %d: local %s mpi %s\n", n - 1, $1, $2
    }
    END {
        if (bad || n != 5) { print "train_gpt: loss lists differ in length"; exit 1 }
        printf "train_gpt: max relative loss difference mpi vs local: %.3g\n", max
        if (max > 1e-6) { print "train_gpt: mpi and local losses differ by more than 1e-6"; exit 1 }
    }'

step "train_gpt --backend process under mpirun (Open MPI gives rank and size; MASTER_ADDR/PORT exported)"
timeout 600 mpirun "${mpirun_args[@]}" -np 4 -x MASTER_ADDR=127.0.0.1 \
    -x MASTER_PORT=$((20000 + RANDOM % 20000)) -x CDT_JOB_TOKEN="ci-mpirun-$RANDOM$RANDOM$RANDOM" \
    "$bin_dir/train_gpt" --backend process --mesh dp=2,tp=2 --steps 5 --json \
    --out "$out/mpirun_process" >"$out/mpirun_process.json"
losses "$out/mpirun_process.json" >"$out/mpirun_process.txt"
if ! cmp -s "$out/local.txt" "$out/mpirun_process.txt"; then
    echo "train_gpt: process backend under mpirun differs from local:" >&2
    paste -d' ' "$out/local.txt" "$out/mpirun_process.txt" >&2
    exit 1
fi
echo "train_gpt: process backend under mpirun (4 processes) == local backend, bit for bit"

step "done"
