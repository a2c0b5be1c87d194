"""A block norm's backward: XLA's fusions against gpt/ops/norm_kernel.py's kernel.

    python bench/norm.py [--rows=65536] [--dim=768] [--reps=10]

GPT-2's training step at batch 64 x 1024 runs 24 block LayerNorms' backward over [65536, 768] bf16
rows. Each takes the input x, the forward's row statistics, the incoming gradient g (the next
product's, bf16) and the residual stream's own gradient gx, and gives x's total gradient (bf16)
and the scale's and bias's (float32 sums over the rows). `xla` is the model's path as XLA compiles
it (the normalised rows recomputed from x, `gpt.ops.norm`'s backward, the stream's gradient added);
`kernel BR/SUB/BD wN` the kernel with those tiles (`norm_kernel.Tiles`). Each variant's values are
checked against `xla`'s first (x's gradient within bf16's rounding, the sums within 1e-3 of their
size); then per variant: microseconds per call (best of three batches of --reps calls) and GB/s by
the bytes it must move (x, g and gx read once, x's gradient written once). Off a GPU the kernel
runs in Pallas's interpreter (a check of this script, not a speed). The last line printed is one
JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import GPU, check_and_time  # noqa: E402
from gpt.ops import norm as norm_ops  # noqa: E402
from gpt.ops import norm_kernel as nk  # noqa: E402

EPS = 1e-5
# (rows a tile, tiles a program, columns a chunk, warps), the default (`nk.Tiles()`) first: ptxas
# registers for GPT-2's width (H200, offline) 64, 108, 96, 108, 196; on the H200 at [65536, 768]
# 0.147, 0.161, 0.162, 0.157 and 0.197 ms, XLA's 0.367 (BENCHMARKS.md, thirty-fifth session)
TILES = [(2, 16, 256, 8), (2, 16, 256, 4), (1, 32, 256, 2), (4, 8, 256, 8), (8, 4, 256, 8)]


def xla_backward(x, g, gx, scale, bias, stats):
    """The model's XLA path: xhat recomputed from x and the statistics, `gpt.ops.norm`'s backward
    of the float32 norm (g converted from the product's bf16), the stream's gradient added."""
    rstd, shift, mean = stats
    xhat = ((x.astype(jnp.float32) - shift) - mean) * rstd
    like = (jnp.zeros((), x.dtype), jnp.zeros((), bias.dtype))
    dx, ds, db = norm_ops._norm_bwd(EPS, True, (xhat, rstd, scale, like), g.astype(jnp.float32))
    return dx + gx, jnp.stack([ds, db])


def variants() -> dict:
    out = {"xla": xla_backward}
    for tiles in TILES:
        t = nk.Tiles(*tiles, interpret=not GPU)
        out[f"kernel {'/'.join(map(str, tiles[:3]))} w{tiles[3]}"] = (
            lambda x, g, gx, s, b, st, t=t: nk.norm_backward(x, g, s, st, centre=True, bias=True,
                                                             gx_RD=gx, t=t))
    return out


def _difference(got, want) -> dict:
    """Largest differences from `xla`'s gradients, relative: x's (bf16) to each entry's size (at
    least 1), the sums to their largest."""
    want_dx = np.asarray(want[0], np.float32)
    dx = np.abs(np.asarray(got[0], np.float32) - want_dx) / np.maximum(np.abs(want_dx), 1.0)
    scale = float(np.max(np.abs(np.asarray(want[1])))) or 1.0
    sums = float(np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1])))) / scale
    # x's gradient: 2 bf16 ulps (XLA rounds it before adding the stream's, the kernel once after)
    return {"dx": float(dx.max()), "sums": sums, "passed": float(dx.max()) < 1.6e-2 and sums < 1e-3}


def inputs(rows: int, dim: int) -> tuple:
    """x (rows off zero, as a trained stream's are), g, gx in bf16; scale, bias; x's statistics."""
    k = jax.random.split(jax.random.key(0), 5)
    x = (1.0 + jax.random.normal(k[0], (rows, dim))).astype(jnp.bfloat16)
    g, gx = (jax.random.normal(kk, (rows, dim)).astype(jnp.bfloat16) for kk in k[1:3])
    scale, bias = 1.0 + 0.1 * jax.random.normal(k[3], (dim,)), 0.1 * jax.random.normal(k[4], (dim,))
    return x, g, gx, scale, bias, norm_ops.row_stats(x.astype(jnp.float32), EPS, True)[1]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if min(args.rows, args.dim, args.reps) < 1:
        ap.error("--rows, --dim and --reps positive")
    args_ = inputs(args.rows, args.dim)
    moved = 4 * args.rows * args.dim * 2
    rows = check_and_time(variants(), args_, _difference, moved, args.reps)
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows,
                      "dim": args.dim, "gb": moved / 1e9, "variants": rows}))
    return 0 if all(r.get("passed") for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
