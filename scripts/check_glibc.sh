#!/usr/bin/env bash
# Fails when a binary needs a glibc newer than the oldest one supported (2.28: RHEL 8), naming
# the binary and each symbol (or version reference) that needs more. Reads the dynamic symbol
# table (`objdump -T`: each imported symbol with the glibc version it is bound to, e.g.
# `__libc_start_main` at GLIBC_2.34) and the version references the loader checks before
# anything runs (`objdump -p`, "Version References"). A GLIBC_PRIVATE reference fails too.
#
#   scripts/check_glibc.sh                 # the binaries scripts/build_release.sh built
#   scripts/check_glibc.sh BINARY...       # these
#   CDT_GLIBC_MAX=2.31 scripts/check_glibc.sh ...
#
# Needs objdump (binutils; scripts/setup.sh checks for it).
set -euo pipefail
cd "$(dirname "$0")/.."

MAX="${CDT_GLIBC_MAX:-2.28}"

command -v objdump >/dev/null 2>&1 || {
    echo "check_glibc.sh: objdump not found (binutils; scripts/setup.sh installs it)" >&2
    exit 1
}

bins=("$@")
if ((${#bins[@]} == 0)); then
    list="${CARGO_TARGET_DIR:-target/glibc${MAX//./}}/release-binaries.txt"
    [[ -s "$list" ]] || {
        echo "check_glibc.sh: no binaries given and no $list: run scripts/build_release.sh first" >&2
        exit 1
    }
    mapfile -t bins <"$list"
fi

# Whether version $1 is newer than $2 (numeric, field by field: 2.3 < 2.28 < 2.34).
newer() {
    [[ "$1" != "$2" && "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -n 1)" == "$1" ]]
}

failed=0
for bin in "${bins[@]}"; do
    if [[ ! -f "$bin" ]]; then
        echo "check_glibc.sh: $bin: no such file" >&2
        failed=1
        continue
    fi
    if ! syms=$(objdump -T "$bin" 2>&1); then
        echo "check_glibc.sh: $bin: objdump -T failed: $syms" >&2
        failed=1
        continue
    fi
    refs=$(objdump -p "$bin")
    # "... DF *UND* 0000000000000000 (GLIBC_2.34) __libc_start_main" -> "2.34 __libc_start_main"
    # (the version is in parentheses when hidden, bare otherwise; the name is the last field).
    pairs=$(awk '{ for (i = 1; i < NF; i++) if ($i ~ /^\(?GLIBC_/) {
                       v = $i; gsub(/[()]/, "", v); sub(/^GLIBC_/, "", v); print v, $NF } }' <<<"$syms" |
        sort -u)
    highest=""
    bad=()
    n=0
    while read -r v sym; do
        [[ -n "$v" ]] || continue
        n=$((n + 1))
        if [[ "$v" == PRIVATE ]]; then
            bad+=("$sym (GLIBC_PRIVATE)")
            continue
        fi
        if [[ -z "$highest" ]] || newer "$v" "$highest"; then highest="$v"; fi
        newer "$v" "$MAX" && bad+=("$sym (GLIBC_$v)")
    done <<<"$pairs"
    # The version references the loader checks, with or without a symbol behind them.
    while read -r v; do
        [[ -n "$v" ]] || continue
        if [[ "$v" == PRIVATE ]] || newer "$v" "$MAX"; then
            bad+=("version reference GLIBC_$v")
        fi
    done < <(awk '/^Version References:/ { on = 1; next } on && NF == 0 { on = 0 }
                  on && $NF ~ /^GLIBC_/ { v = $NF; sub(/^GLIBC_/, "", v); print v }' <<<"$refs" | sort -u)
    if ((n == 0)); then
        echo "check_glibc.sh: $bin: no GLIBC-versioned symbol at all (not a dynamically linked glibc binary?)" >&2
        failed=1
    elif ((${#bad[@]})); then
        echo "check_glibc.sh: $bin needs a glibc newer than $MAX:" >&2
        printf '  %s\n' "${bad[@]}" >&2
        failed=1
    else
        echo "check_glibc.sh: $bin: $n glibc symbols, highest version needed GLIBC_$highest (<= $MAX)"
    fi
done
if ((failed)); then
    echo "check_glibc.sh: FAILED: build release binaries for old glibc with scripts/build_release.sh" >&2
    exit 1
fi
echo "check_glibc.sh: ok: ${#bins[@]} binaries load on glibc $MAX"
