#!/usr/bin/env bash
# Checks that vendor/candle-core is candle-core 0.11.1 as published on crates.io plus
# vendor/candle-core.patch and nothing else (vendor/README.md): with the patch reversed, every
# file hashes as recorded from the published crate (vendor/candle-core.upstream.sha256, taken
# from the registry's copy, which cargo checks against the crate's checksum), and no file is
# missing or added. Fails naming the files that differ.
#
# Usage: scripts/check_vendor.sh   (needs git and sha256sum; CI: .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in git sha256sum; do
    command -v "$tool" >/dev/null 2>&1 || {
        echo "check_vendor.sh: $tool not found" >&2
        exit 1
    }
done

# The hash list itself, pinned: a change to a vendored file that also rewrote the list must
# change this line too, in plain sight.
list_sha256=add788a504080fa526bc03f1667821e25799cfbe1e9ec144691841eafa2423e0
if [[ "$(sha256sum <vendor/candle-core.upstream.sha256 | cut -d ' ' -f 1)" != "$list_sha256" ]]; then
    echo "check_vendor.sh: vendor/candle-core.upstream.sha256 is not the recorded list of the" \
        "published crate's files (sha256 $list_sha256)" >&2
    exit 1
fi
# The patch touches src/backprop.rs and src/utils.rs and nothing else (vendor/README.md).
touched=$(git apply --numstat -p1 vendor/candle-core.patch | cut -f 3 | LC_ALL=C sort | tr '\n' ' ')
if [[ "$touched" != "src/backprop.rs src/utils.rs " ]]; then
    echo "check_vendor.sh: vendor/candle-core.patch must change src/backprop.rs and" \
        "src/utils.rs only; it changes: $touched" >&2
    exit 1
fi
# Only regular files (a symlink would be hashed through its target).
odd=$(find vendor/candle-core ! -type d ! -type f)
if [[ -n "$odd" ]]; then
    echo "check_vendor.sh: vendor/candle-core holds files that are not regular: $odd" >&2
    exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r vendor/candle-core "$tmp/c"
patch=$(pwd)/vendor/candle-core.patch
if ! (cd "$tmp/c" && git apply -R -p1 "$patch"); then
    echo "check_vendor.sh: vendor/candle-core.patch does not reverse cleanly out of" \
        "vendor/candle-core: the vendored tree has changes the patch does not record" >&2
    exit 1
fi
(cd "$tmp/c" && find . -type f | LC_ALL=C sort | xargs sha256sum) >"$tmp/now"
if ! diff -u <(LC_ALL=C sort -k 2 vendor/candle-core.upstream.sha256) \
    <(LC_ALL=C sort -k 2 "$tmp/now") >"$tmp/diff"; then
    echo "check_vendor.sh: vendor/candle-core minus its patch is not the published" \
        "candle-core 0.11.1 (- recorded, + found):" >&2
    grep '^[-+]\S' "$tmp/diff" | grep -v '^[-+][-+]' >&2
    exit 1
fi
echo "check_vendor.sh: vendor/candle-core is candle-core 0.11.1 plus vendor/candle-core.patch"
