"""The MLP's bias and tanh-GELU, forward and backward: XLA's fusions against gpt/ops/gelu_kernel.py's.

    python bench/gelu.py [--rows=65536] [--ffn=3072] [--reps=10]

GPT-2's training step at batch 64 x 1024 applies GELU to fc's product, [65536, 3072] bf16, 12 times,
and differentiates it with the activation recomputed from the product (`gpt.model.Block.mlp`).
`xla` is the model's path (`mlp_activation` under `jax.checkpoint`, XLA's fusions: 11.6 ms of the
H200's step at 1.9-2.3 TB/s); `kernel BR/BF wN` is `gelu_kernel.gelu_bias` with that tile
(`gelu_kernel.Tiles`). Each call runs the forward and the backward (activation, fc's gradient and
the bias's). Each variant's values are checked first against the same math in float32 throughout
(the kernel's: XLA's path rounds the biased product to bf16 before the GELU, which moves fc's
gradient by up to about 8% of an entry, so `xla` is shown, not held, to the kernels' bound: the
activation and fc's gradient within 2 bf16 ulps, the bias's gradient within 1e-3); then per variant:
microseconds per call (best of three batches of --reps calls) and GB/s by the bytes it must move
(the product read twice and the incoming gradient once, the activation and fc's gradient written
once). Off a GPU the kernels run in Pallas's interpreter (a check of this script, not a speed).
The last line printed is one JSON object.
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
from gpt.config import ModelConfig  # noqa: E402
from gpt.model import mlp_activation  # noqa: E402
from gpt.ops import gelu_kernel as gk  # noqa: E402

# (rows, columns, warps) of a tile; the first is the kernel's default. ptxas (H200, offline),
# backward/forward registers: 64/44, 72/46, 107/100, 128/96, 73/46; no spills
TILES = [(32, 256, 8), (16, 256, 4), (64, 256, 8), (32, 512, 8), (16, 512, 8)]


def both_passes(activation):
    """fc, b, g -> (activation, fc's gradient, the bias's) of `activation(fc, b)`."""
    def run(fc, b, g):
        y, vjp = jax.vjp(activation, fc, b)
        return (y, *vjp(g))
    return run


def variants() -> dict:
    cfg = ModelConfig()  # GPT-2's block: tanh GELU with biases
    out = {"xla": both_passes(jax.checkpoint(lambda fc, b: mlp_activation(fc, b, cfg)))}
    for BR, BF, warps in TILES:
        t = gk.Tiles(BR=BR, BF=BF, warps=warps, interpret=not GPU)
        out[f"kernel {BR}/{BF} w{warps}"] = both_passes(lambda fc, b, t=t: gk.gelu_bias(fc, b, t))
    return out


def _relative(got, want) -> float:
    """The largest difference relative to each entry's size (at least 1)."""
    want = np.asarray(want, np.float32)
    return float(np.max(np.abs(np.asarray(got, np.float32) - want) / np.maximum(np.abs(want), 1.0)))


def float32_reference(fc, b, g):
    """The kernels' math in float32 throughout, unrounded (XLA's): activation, fc's gradient, the bias's."""
    act = lambda fc32, bb: jax.nn.gelu(fc32 + bb, approximate=True)  # noqa: E731
    return jax.jit(both_passes(act))(fc.astype(jnp.float32), b, g.astype(jnp.float32))


def _difference(got, want) -> dict:
    """Differences from the float32 reference: the activation's and fc's gradient's (bf16) entry
    by entry, the bias gradient's relative to its largest; within 2 bf16 ulps and 1e-3 to pass
    (XLA's path, which rounds the biased product first, is exempt: it is the model's)."""
    y, d = _relative(got[0], want[0]), _relative(got[1], want[1])
    scale = float(np.max(np.abs(np.asarray(want[2])))) or 1.0
    db = float(np.max(np.abs(np.asarray(got[2]) - np.asarray(want[2])))) / scale
    return {"y": y, "dfc": d, "db": db, "passed": max(y, d) < 1.6e-2 and db < 1e-3}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if min(args.rows, args.ffn, args.reps) < 1:
        ap.error("--rows, --ffn and --reps positive")
    k = jax.random.split(jax.random.key(0), 3)
    fc = (3.0 * jax.random.normal(k[0], (args.rows, args.ffn))).astype(jnp.bfloat16)
    b = jax.random.normal(k[1], (args.ffn,))
    g = jax.random.normal(k[2], (args.rows, args.ffn)).astype(jnp.bfloat16)
    moved = 5 * args.rows * args.ffn * 2
    want = float32_reference(fc, b, g)
    rows = check_and_time(variants(), (fc, b, g), _difference, moved, args.reps, want)
    rows["xla"]["passed"] = "error" not in rows["xla"]  # the model's path: shown, not held to the bound
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows,
                      "ffn": args.ffn, "gb": moved / 1e9, "variants": rows}))
    return 0 if all(r.get("passed") for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
