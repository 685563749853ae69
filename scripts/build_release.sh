#!/usr/bin/env bash
# Builds the release binaries for Linux machines with an old glibc: `dtrun` and every example
# the default features build (train_gpt, train_llama, the benchmarks; the mpi/nccl/cuda examples
# need their features and are not built here), linked against glibc 2.28 (RHEL 8, Ubuntu 20.04
# and later load them) whatever glibc this machine has.
#
#   scripts/build_release.sh            # binaries in target/glibc228/<arch>-unknown-linux-gnu/release
#   scripts/check_glibc.sh              # then: no symbol of them needs a glibc newer than 2.28
#
# Why not a plain `cargo build --release`: a Rust binary links against the glibc it is built on,
# and glibc versions its symbols, so one built on glibc 2.34 or later references
# `__libc_start_main@GLIBC_2.34` (and more) and refuses to load on an older system.
# cargo-zigbuild links with zig, which carries the headers and symbol lists of every glibc
# version: the target `x86_64-unknown-linux-gnu.2.28` links against 2.28's.
#
# Tools: cargo-zigbuild and zig, both from PyPI (`cargo-zigbuild` is the crates.io release built
# as a wheel; `ziglang` is zig), pinned below and installed with `pip install --target` into
# $CDT_ZIG_DIR (default <repo>/.zig, git-ignored); a stamp naming the versions skips pip when
# they are there. Needs python3 with pip (scripts/setup.sh checks for both).
#
# Env:  CDT_GLIBC_VERSION  the glibc to link against (default 2.28)
#       CARGO_TARGET_DIR   default target/glibc228 (its own, so the default builds' cache is
#                          not disturbed)
#       CDT_ZIG_DIR        where the tools go (default <repo>/.zig)
# Writes $CARGO_TARGET_DIR/release-binaries.txt, the built binaries' paths, one a line, which
# scripts/check_glibc.sh reads.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

# Pinned: cargo-zigbuild 0.24.1 (its wheel asks for ziglang, resolved to 0.17.1 when this was
# written) built every binary here for glibc 2.28.
CARGO_ZIGBUILD_VERSION=0.24.1
ZIGLANG_VERSION=0.17.1
GLIBC_VERSION="${CDT_GLIBC_VERSION:-2.28}"
DIR="${CDT_ZIG_DIR:-$ROOT/.zig}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target/glibc${GLIBC_VERSION//./}}"

log() { echo "build_release.sh: $*" >&2; }
t0=$(date +%s)

py="$(command -v python3 || true)"
if [[ -z "$py" ]] || ! "$py" -m pip --version >/dev/null 2>&1; then
    log "python3 with pip is needed to install cargo-zigbuild and zig (scripts/setup.sh installs them)"
    exit 1
fi

stamp="$DIR/.installed-cargo-zigbuild-$CARGO_ZIGBUILD_VERSION-ziglang-$ZIGLANG_VERSION"
if [[ ! -f "$stamp" || ! -x "$DIR/bin/cargo-zigbuild" || ! -x "$DIR/ziglang/zig" ]]; then
    log "installing cargo-zigbuild==$CARGO_ZIGBUILD_VERSION ziglang==$ZIGLANG_VERSION into $DIR (pip --target)"
    mkdir -p "$DIR"
    # Bounded: a stuck index must not hang CI. --no-deps: the two pins are the whole set.
    timeout 600 "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
        --no-deps --upgrade --target "$DIR" \
        "cargo-zigbuild==$CARGO_ZIGBUILD_VERSION" "ziglang==$ZIGLANG_VERSION" >&2
    for f in "$DIR/bin/cargo-zigbuild" "$DIR/ziglang/zig"; do
        [[ -x "$f" ]] || { log "pip finished but $f is missing"; exit 1; }
    done
    rm -f "$DIR"/.installed-*
    touch "$stamp"
fi
export PATH="$DIR/bin:$DIR/ziglang:$PATH"
export CARGO_ZIGBUILD_ZIG_PATH="$DIR/ziglang/zig"
log "$(cargo-zigbuild --version), zig $(zig version)"

arch="$(uname -m)"
triple="$arch-unknown-linux-gnu"

# The examples the default features build: the facade's examples without required-features.
examples=()
while IFS= read -r name; do
    examples+=("$name")
done < <(cargo metadata --format-version 1 --no-deps --locked | "$py" -c '
import json, sys
meta = json.load(sys.stdin)
for p in meta["packages"]:
    if p["name"] != "candle-dtensor":
        continue
    for t in p["targets"]:
        if "example" in t["kind"] and not t.get("required-features"):
            print(t["name"])
')
((${#examples[@]})) || { log "cargo metadata lists no default-feature example"; exit 1; }

example_args=()
for e in "${examples[@]}"; do
    example_args+=(--example "$e")
done
log "cargo zigbuild --release --target $triple.$GLIBC_VERSION: dtrun and ${examples[*]} (target dir $CARGO_TARGET_DIR)"
cargo zigbuild --locked --release --target "$triple.$GLIBC_VERSION" -p dtrun --bin dtrun \
    -p candle-dtensor "${example_args[@]}"

out="$CARGO_TARGET_DIR/$triple/release"
list="$CARGO_TARGET_DIR/release-binaries.txt"
: >"$list"
for bin in "$out/dtrun" "${examples[@]/#/$out/examples/}"; do
    [[ -x "$bin" ]] || { log "the build finished but $bin is missing"; exit 1; }
    echo "$bin" >>"$list"
done
log "built $(wc -l <"$list") binaries for glibc $GLIBC_VERSION in $(($(date +%s) - t0)) s (listed in $list)"
