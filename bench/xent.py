"""The loss's pass over the logits: XLA's reductions against gpt/ops/xent_kernel.py's rows.

    python bench/xent.py [--rows=65536] [--vocab=50257] [--padded=50304] [--reps=10]

GPT-2's training step at batch 64 x 1024 scores [65536, 50304] bf16 logits. What the loss needs from
them, each row's logsumexp and target logit and the gradient (softmax - one-hot) in bf16, XLA
computes as a reduction and an elementwise pass (`xla`: the one-pass logsumexp the GPU runs; `xla
two-pass`: a max then a sum), the kernel in one program a row (`rows W<width> w<warps>`: its block
of columns and warps; `held`: the row kept in registers between its two passes). Each variant's
values are checked against `xla`'s first (the logsumexp within 1e-3, the target logit exactly, the
gradient within bf16's rounding); then per variant: microseconds per call (best of three batches of
--reps calls) and GB/s by the bytes it must move, the logits read once and the gradient written
once. Off a GPU the kernel runs in Pallas's interpreter (a check of this script, not a speed). The
last line printed is one JSON object.
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
from gpt.ops import cross_entropy as ce  # noqa: E402
from gpt.ops import xent_kernel as xk  # noqa: E402

# (block width, warps, the row held in registers between its passes rather than read twice)
KERNELS = [(4096, 8, False), (4096, 16, False), (8192, 16, False), (8192, 32, False), (2048, 4, False),
           (4096, 32, True), (2048, 32, True)]


def xla_rows(x_RV, t_R, s_R, vocab: int, one_pass: bool):
    """The loss's pass as the model's XLA path runs it: padded entries -inf, then the logsumexp
    and target logit, then (softmax - one-hot) * scale in the logits' dtype."""
    x_RV = jnp.where(jnp.arange(x_RV.shape[1]) < vocab, x_RV, -jnp.inf)
    lse_R, target_R = ce._lse_and_target(x_RV, t_R, one_pass)
    return lse_R, target_R, ce._softmax_minus_onehot(x_RV, lse_R, t_R, s_R[:, None], x_RV.dtype)


def variants(vocab: int) -> dict:
    out = {"xla": lambda x, t, s: xla_rows(x, t, s, vocab, True),
           "xla two-pass": lambda x, t, s: xla_rows(x, t, s, vocab, False)}
    for width, warps, hold in KERNELS:
        kw = dict(width=width, warps=warps, hold=hold, interpret=not GPU)
        name = f"rows W{width} w{warps}{' held' if hold else ''}"
        out[name] = lambda x, t, s, kw=kw: xk.xent_rows(x, t, s, vocab, **kw)
    return out


def _difference(got, want) -> dict:
    """Largest differences from `xla`'s logsumexp, target logit and gradient."""
    lse, target = (float(np.max(np.abs(np.asarray(got[i]) - np.asarray(want[i])))) for i in (0, 1))
    d = float(np.max(np.abs(np.asarray(got[2], np.float32) - np.asarray(want[2], np.float32))))
    return {"lse": lse, "target": target, "grad": d,
            "passed": lse < 1e-3 and target < 1e-6 and d < 1.6e-2}  # the gradient: 2 bf16 ulps at 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--padded", type=int, default=50304)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not 0 < args.vocab <= args.padded or min(args.rows, args.reps) < 1:
        ap.error("--rows and --reps positive, 0 < --vocab <= --padded")
    kx, kt = jax.random.split(jax.random.key(0))
    x = (2.0 * jax.random.normal(kx, (args.rows, args.padded))).astype(jnp.bfloat16)
    t = jax.random.randint(kt, (args.rows,), 0, args.vocab)
    s = jnp.ones((args.rows,), jnp.float32)
    moved = 2 * x.size * x.dtype.itemsize
    rows = check_and_time(variants(args.vocab), (x, t, s), _difference, moved, args.reps)
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows,
                      "padded": args.padded, "vocab": args.vocab, "gb": moved / 1e9, "variants": rows}))
    return 0 if all(r.get("passed") for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
