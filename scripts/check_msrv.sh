#!/usr/bin/env bash
# Checks that the workspace's declared `rust-version` (Cargo.toml, [workspace.package]) is at
# least the `rust-version` of every crate in the locked dependency graph: every package
# `cargo metadata --locked` resolves (normal, dev and build dependencies, every platform), so a
# user whose Rust is older than a locked crate needs gets cargo's clear "requires rustc X"
# message for this workspace instead of a compile error deep inside a dependency.
#
# Fails naming the crates that need more than the workspace declares, when a member declares
# none, or when Cargo.lock is out of date with the manifests (--locked). A declaration above
# what the lock file needs passes with a note: the workspace's own code may need more (clippy's
# `incompatible_msrv` lint, on in .ci/run's clippy, checks std APIs against the declaration).
#
# Usage: scripts/check_msrv.sh [--manifest-path PATH]   (needs cargo and python3; CI: .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in cargo python3; do
    command -v "$tool" >/dev/null 2>&1 || {
        echo "check_msrv.sh: $tool not found (scripts/setup.sh checks for it)" >&2
        exit 1
    }
done

meta=$(mktemp)
trap 'rm -f "$meta"' EXIT
if ! cargo metadata --format-version 1 --locked "$@" >"$meta"; then
    echo "check_msrv.sh: cargo metadata --locked failed: is Cargo.lock out of date with the" \
        "manifests? (a build updates it; commit it)" >&2
    exit 1
fi

python3 - "$meta" <<'PY'
import json, sys

meta = json.load(open(sys.argv[1]))
members = set(meta["workspace_members"])
resolved = {node["id"] for node in meta["resolve"]["nodes"]}
packages = {p["id"]: p for p in meta["packages"] if p["id"] in resolved}


def version(text):
    # "1.89" and "1.89.0" are the same requirement.
    parts = [int(x) for x in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def show(v):
    return ".".join(str(x) for x in v)


declared = {}
for pid in members:
    p = packages[pid]
    if not p.get("rust_version"):
        print(f"check_msrv.sh: workspace member {p['name']} declares no rust-version", file=sys.stderr)
        sys.exit(1)
    declared[p["name"]] = version(p["rust_version"])

deps = [p for pid, p in packages.items() if pid not in members and p.get("rust_version")]
if not deps:
    print("check_msrv.sh: no locked crate declares a rust-version; nothing to compare", file=sys.stderr)
    sys.exit(1)
needed = max(version(p["rust_version"]) for p in deps)
needers = sorted(f"{p['name']} {p['version']}" for p in deps if version(p["rust_version"]) == needed)
print(f"check_msrv.sh: {len(packages)} locked packages, {len(deps)} of them declare a rust-version; "
      f"the highest is {show(needed)} ({', '.join(needers)})")

def declaration(v):
    return show(v[:2]) if v[2] == 0 else show(v)


failed = False
by_version = {}
for name, v in declared.items():
    by_version.setdefault(v, []).append(name)
for v, names in sorted(by_version.items()):
    who = ", ".join(sorted(names))
    if v < needed:
        over = sorted(
            ((version(p["rust_version"]), p["name"], p["version"])
             for p in deps if version(p["rust_version"]) > v),
            reverse=True,
        )
        print(f"check_msrv.sh: rust-version {show(v)} (declared by {who}) is lower than these locked "
              "crates need:", file=sys.stderr)
        for rv, n, ver in over:
            print(f"  {n} {ver} needs {show(rv)}", file=sys.stderr)
        failed = True
    elif v > needed:
        print(f"check_msrv.sh: note: rust-version {show(v)} (declared by {who}) is more than the locked "
              f"crates need ({show(needed)}): the workspace's own code must be what needs it")
if failed:
    print(f"check_msrv.sh: set rust-version = \"{declaration(needed)}\" in Cargo.toml's [workspace.package]",
          file=sys.stderr)
    sys.exit(1)
print(f"check_msrv.sh: ok: every member's rust-version is at least {show(needed)}, "
      "the most any locked crate needs")
PY
