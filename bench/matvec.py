"""One-row products (a batch-1 decode step's) on the accelerator: XLA against Pallas kernels.

    python bench/matvec.py [--chain=32] [--reps=20]

A decode step multiplies one row by every weight, each read once from memory, so each product
should run at the memory bandwidth. For GPT-2's weight shapes it times chains of `--chain`
distinct bf16 weights (more bytes than the L2 cache) applied one after another inside one jit, as
a decode step applies them: XLA's product with the weight held [in, out] (as trained) and [out, in]
(as `gpt.model.for_decoding` holds it on GPU), and Pallas (Triton) matvecs with the weight [in, out]:
one program per block of output columns, and split-K (programs over slices of the input too, XLA
summing their partial rows). Reported per product: microseconds and the read bandwidth they imply.
On CPU the kernels run in Pallas's interpreter and only their values are checked (no timings).
The last line printed is one JSON object. Figures: BENCHMARKS.md.
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
from jax.experimental import pallas as pl  # noqa: E402

from bench.timing import GPU, seconds_per_call  # noqa: E402
from gpt.ops.pallas_util import triton_params  # noqa: E402

SHAPES = [(768, 2304), (768, 3072), (3072, 768), (768, 768)]  # [in, out]: qkv, fc, proj, attention out
# (block of output columns, block of the input, input slices (split-K; 0: one per BK), warps)
PALLAS = [(32, 256, 1, 4), (64, 256, 1, 4), (64, 256, 0, 4), (128, 128, 0, 4), (128, 256, 0, 8)]


def matvec(x_D: jax.Array, w_DN: jax.Array, BN: int, BK: int, S: int, warps: int = 4) -> jax.Array:
    """x[D] @ w[D, N] in float32. Program (i, s) sums input rows [s D/S, (s+1) D/S) for output
    columns [i BN, (i+1) BN), in chunks of BK rows; XLA adds the S partial rows (S = 1: none)."""
    D, N = w_DN.shape
    rows = D // S
    assert N % BN == 0 and D % S == 0 and rows % BK == 0, (D, N, BN, BK, S)

    def kernel(x_ref, w_ref, o_ref):
        n0, d0 = pl.program_id(0) * BN, pl.program_id(1) * rows
        acc = jnp.zeros((BN,), jnp.float32)
        for k in range(rows // BK):  # static: Triton blocks must be powers of two, D need not be
            xk = x_ref[pl.ds(d0 + k * BK, BK)].astype(jnp.float32)
            wk = w_ref[pl.ds(d0 + k * BK, BK), pl.ds(n0, BN)].astype(jnp.float32)
            acc = acc + jnp.sum(xk[:, None] * wk, axis=0)
        o_ref[pl.program_id(1), pl.ds(n0, BN)] = acc

    part_SN = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((S, N), jnp.float32), grid=(N // BN, S),
                             interpret=not GPU, compiler_params=triton_params(warps, 2, not GPU))(x_D, w_DN)
    return part_SN.sum(0)


def xla_in_out(x_D, w_DN):
    return jnp.dot(x_D, w_DN, preferred_element_type=jnp.float32)


def xla_out_in(x_D, w_ND):
    return jnp.dot(w_ND, x_D, preferred_element_type=jnp.float32)


def variants(D: int) -> dict:
    """name -> (product(x, w), whether it takes the weight [out, in])."""
    out = {"xla [in, out]": (xla_in_out, False), "xla [out, in]": (xla_out_in, True)}
    for BN, BK, S, warps in PALLAS:
        S = S or D // BK
        out[f"pallas BN{BN} BK{BK} S{S} w{warps}"] = (
            lambda x, w, BN=BN, BK=BK, S=S, warps=warps: matvec(x, w, BN, BK, S, warps), False)
    return out


def chain(product, ws: list[jax.Array], x: jax.Array) -> jax.Array:
    """Each product's output (cut or tiled to the input's length) feeds the next, so none is skipped."""
    for w in ws:
        y = product(x, w)
        n = x.shape[0]
        x = (y[:n] if y.shape[0] >= n else jnp.tile(y, n // y.shape[0])).astype(x.dtype) * 0.5
    return x


def check(key: jax.Array) -> float:
    """The largest relative error of every variant against a float64 product (bf16 inputs)."""
    worst = 0.0
    for D, N in SHAPES:
        kx, kw = jax.random.split(jax.random.fold_in(key, D * N))
        x = jax.random.normal(kx, (D,), jnp.bfloat16)
        w = (0.02 * jax.random.normal(kw, (D, N))).astype(jnp.bfloat16)
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        for name, (product, out_in) in variants(D).items():
            y = np.asarray(jax.jit(product)(x, w.T if out_in else w), np.float64)
            worst = max(worst, float(np.linalg.norm(y - ref) / np.linalg.norm(ref)))
    return worst


def time_shape(key: jax.Array, D: int, N: int, n: int, reps: int) -> dict:
    ws = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (D, N))).astype(jnp.bfloat16) for i in range(n)]
    ws_t = [w.T.copy() for w in ws]
    x = jax.random.normal(key, (D,), jnp.bfloat16)
    row = {}
    for name, (product, out_in) in variants(D).items():
        f = jax.jit(lambda ws, x, product=product: chain(product, ws, x))
        us = 1e6 * seconds_per_call(f, ws_t if out_in else ws, x, reps=reps) / n
        row[name] = {"us": us, "read_gbps": D * N * 2 / us / 1e3}
        print(f"{D}x{N:<6} {name:28s} {us:8.2f} us {row[name]['read_gbps']:8.0f} GB/s", flush=True)
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", type=int, default=32, help="distinct weights per timed chain")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    key = jax.random.key(0)
    err = check(key)
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"largest relative error against float64: {err:.1e}", flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "max_rel_err": err}
    if GPU:
        result["shapes"] = {f"{D}x{N}": time_shape(key, D, N, args.chain, args.reps) for D, N in SHAPES}
    print(json.dumps(result))
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
