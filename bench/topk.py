"""Top-k of one row of logits on the accelerator, as the sampler draws a token: XLA's top_k against a
top-k in two stages, and from the entries above a bound.

    python bench/topk.py [--k=200] [--vocab=50304] [--chain=16] [--reps=20]

The sampler's default (`gpt.sampling`, nanoGPT's top-k 200) takes the 200 largest of GPT-2's
50,304 logits every token. On a GPU, XLA's top_k of a row that wide is a sort (CUB's radix sort):
35 us of the H200's 390 us token in the seventeenth session's profile, and a quarter of the 0.13 ms
a token that the decoding target allows. Two stages give the same values and indices: the top k of
each chunk of C entries (many short sorts side by side), then the top k of those C-chunks'
winners (a sort of V / C * k entries). Or from a bound (`threshold`): the k-th largest of the
chunks' maxima, below which no top-k entry lies, leaves typically a few hundred candidates for a
top_k of `cap` entries (more than cap: the whole row's top_k). This times them, per row, as
chains of `--chain` rows (a row's result feeds the next through one small update, the same for
every variant, so that none is skipped), after checking that every variant returns exactly
top_k's values and indices, ties included (equal logits: the lower index first). On CPU
only the check runs (no timings). The last line printed is one JSON object. Figures: BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timing import GPU, seconds_per_call  # noqa: E402

CHUNKS = (1024, 2048, 4096, 8192)
THRESHOLDS = ((64, 1024), (128, 1024))  # (chunk, candidates at most) of `threshold`


def two_stage(x_V: jax.Array, k: int, C: int) -> tuple[jax.Array, jax.Array]:
    """top_k(x, k) as the top k of each chunk of C entries, then the top k of their winners (the
    last chunk padded with -inf, which never wins over a real entry's tie: top_k keeps the lower
    index, and the padding comes last)."""
    V = x_V.shape[0]
    R = -(-V // C)
    x_RC = jnp.pad(x_V, (0, R * C - V), constant_values=-jnp.inf).reshape(R, C)
    vals_Rk, idx_Rk = jax.lax.top_k(x_RC, min(k, C))
    idx_Rk = idx_Rk + (jnp.arange(R) * C)[:, None]
    vals_k, pick_k = jax.lax.top_k(vals_Rk.reshape(-1), k)
    return vals_k, idx_Rk.reshape(-1)[pick_k]


def threshold(x_V: jax.Array, k: int, C: int, cap: int) -> tuple[jax.Array, jax.Array]:
    """top_k(x, k) from the entries at or above m, the k-th largest of the maxima of chunks of C
    entries (V / C >= k of them): k chunks hold an entry >= m each, so the k-th largest entry is
    >= m too. The candidates, in index order (so that top_k's ties keep the lower index), go
    through a top_k of `cap` entries; if there are more than cap (a row of many equal logits), the
    whole row's top_k answers instead."""
    V = x_V.shape[0]
    R = -(-V // C)
    assert R >= k, (V, C, k)
    maxes_R = jnp.pad(x_V, (0, R * C - V), constant_values=-jnp.inf).reshape(R, C).max(axis=1)
    m = jax.lax.top_k(maxes_R, k)[0][-1]
    keep_V = x_V >= m
    n = jnp.sum(keep_V)
    idx_c = jnp.nonzero(keep_V, size=cap, fill_value=V - 1)[0]
    vals_c = jnp.where(jnp.arange(cap) < n, x_V[idx_c], -jnp.inf)  # the fill: never picked

    def candidates(_):
        vals_k, pick_k = jax.lax.top_k(vals_c, k)
        return vals_k, idx_c[pick_k]
    return jax.lax.cond(n <= cap, candidates, lambda _: tuple(jax.lax.top_k(x_V, k)), None)


def variants(k: int, vocab: int) -> dict:
    out = {"lax.top_k": lambda x: jax.lax.top_k(x, k)}
    for C in CHUNKS:
        if C < vocab:
            out[f"two-stage C{C}"] = lambda x, C=C: two_stage(x, k, C)
    for C, cap in THRESHOLDS:
        if -(-vocab // C) >= k and cap >= 2 * k:
            out[f"threshold C{C} cap{cap}"] = lambda x, C=C, cap=cap: threshold(x, k, C, cap)
    return out


def test_row(key: jax.Array, vocab: int) -> jax.Array:
    """Logits with ties inside a chunk and across chunks, at the top and at the k-th place."""
    x = jax.random.normal(key, (vocab,))
    top = jnp.argsort(-x)
    for a, b in ((top[0], 7), (top[1], vocab - 1), (top[150], 3000), (top[199], 5)):
        x = x.at[b].set(x[a])
    return x


def check(key: jax.Array, k: int, vocab: int) -> dict[str, bool]:
    """Whether each variant returns exactly lax.top_k's values and indices: of the tied row, and of
    a row whose top 3k entries are equal (`threshold`'s fallback)."""
    flat = jnp.where(jnp.arange(vocab) % 7 < 3, 5.0, test_row(key, vocab))[:vocab]
    flat = jnp.where(jnp.arange(vocab) < 7 * k, flat, jnp.minimum(flat, 4.0))
    out = {}
    for x in (test_row(key, vocab), flat):
        want = [np.asarray(a) for a in jax.jit(jax.lax.top_k, static_argnums=1)(x, k)]
        for name, f in variants(k, vocab).items():
            same = all(np.array_equal(np.asarray(g), w) for g, w in zip(jax.jit(f)(x), want, strict=True))
            out[name] = out.get(name, True) and same
    return out


def chain(topk, x_V: jax.Array, n: int) -> jax.Array:
    """n top-k's, each row shifted by the last one's result, so that none can be skipped."""
    for _ in range(n):
        vals, idx = topk(x_V)
        x_V = x_V.at[idx[0]].add(-vals[-1] * 1e-3)
    return x_V


def time_rows(key: jax.Array, k: int, vocab: int, n: int, reps: int) -> dict[str, float]:
    """Microseconds a row for each variant, from chains of n rows."""
    x, out = test_row(key, vocab), {}
    for name, f in variants(k, vocab).items():
        out[name] = 1e6 * seconds_per_call(jax.jit(lambda x, f=f: chain(f, x, n)), x, reps=reps) / n
        print(f"{name:18s} {out[name]:8.2f} us", flush=True)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not 0 < args.k <= min(CHUNKS) or args.vocab < 2 * args.k or min(args.chain, args.reps) < 1:
        ap.error(f"--k={args.k} must be in [1, {min(CHUNKS)}], --vocab at least 2k, --chain and --reps positive")
    key = jax.random.key(0)
    exact = check(key, args.k, args.vocab)
    print(f"device: {jax.devices()[0].device_kind}; exact: {exact}", flush=True)
    result = {"device": jax.devices()[0].device_kind, "k": args.k, "vocab": args.vocab, "exact": exact}
    if GPU:
        result["us"] = time_rows(key, args.k, args.vocab, args.chain, args.reps)
    print(json.dumps(result))
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
