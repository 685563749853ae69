#!/usr/bin/env python3
"""JAX's figure for the 1-D cases of `redistribute_bench`, for a back-to-back comparison.

Four XLA host devices on this machine's CPU (XLA_FLAGS is set below, before jax is
imported), an n x n f32 tensor, each case one jitted program whose input and output
shardings are the placements of the case; Partial inputs are expressed as a shard_map over
per-device summands (JAX has no Partial sharding). Median of the timed iterations after
warm-up, `block_until_ready` on the result, the result dropped each iteration like the Rust
bench. One JSON object per case on stdout, the same keys as `redistribute_bench --json`
(`floor_ms`/`efficiency` are left to the Rust side, which measures the floor).

    python3 scripts/jax_redistribute.py --n 4096 --iters 7

Needs jax and jaxlib (`pip install jax jaxlib`); not part of CI.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

try:
    from jax import shard_map  # jax >= 0.7
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map


def cases(mesh, n):
    """(name, program, input) per case; the input already carries the source placement."""
    world = mesh.devices.size
    row = NamedSharding(mesh, P("x", None))
    key = jax.random.PRNGKey(0)
    full = jax.device_put(jax.random.normal(key, (n, n), jnp.float32), row)
    # Partial: device d holds the d-th of `world` distinct n x n summands, stacked on dim 0.
    summands = jax.device_put(
        jax.random.normal(key, (world * n, n), jnp.float32), row
    )

    to_r = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P(None, None)))
    to_s1 = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P(None, "x")))
    p_to_r = jax.jit(
        shard_map(
            lambda x: jax.lax.psum(x, "x"),
            mesh=mesh,
            in_specs=P("x", None),
            out_specs=P(None, None),
        )
    )
    p_to_s0 = jax.jit(
        shard_map(
            lambda x: jax.lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True),
            mesh=mesh,
            in_specs=P("x", None),
            out_specs=P("x", None),
        )
    )
    return [
        ("S(0)->R", to_r, full),
        ("P->R", p_to_r, summands),
        ("P->S(0)", p_to_s0, summands),
        ("S(0)->S(1)", to_s1, full),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    devices = jax.devices()
    if len(devices) != 4:
        raise SystemExit(f"expected 4 host devices, got {len(devices)}: is XLA_FLAGS set?")
    mesh = Mesh(devices, ("x",))
    for n in args.n:
        for name, prog, x in cases(mesh, n):
            for _ in range(args.warmup):
                prog(x).block_until_ready()
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                prog(x).block_until_ready()
                times.append((time.perf_counter() - t) * 1e3)
            print(
                json.dumps(
                    {
                        "case": name,
                        "mesh": "4",
                        "n": n,
                        "median_ms": round(statistics.median(times), 3),
                        "impl": f"jax {jax.__version__}",
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
