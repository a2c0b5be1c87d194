"""One batch-1 decoding step's layer on the accelerator: XLA's kernels against two Pallas kernels.

    python bench/decode_layer.py [--chain=12] [--loops=4] [--reps=10] [--seq=1024] [--pos=512]

A GPT-2 token on a GPU is about 170 kernels of 2-3 us each, most far from the memory bandwidth
(BENCHMARKS.md): XLA runs a layer as about fourteen. XLA's products alone cap batch-1 decoding
near 40-50% of the bandwidth bound, under the 60% target. This measures whether a layer as
hand-written Pallas (Triton) kernels does better: those of `gpt/ops/decode_kernels.py` (which
says how they work and which `sample.py --decode_kernels` runs), in the variants below (block
sizes, warps; the MLP adding atomically or writing partial rows that XLA sums; attention in one
kernel or split in two).

XLA's blocks take the weights [out, in], its fastest layout for one-row products (bench/matvec.py),
and attend over the whole cache under a mask, as the sampler does. Every variant is checked against
a float64 block and against XLA's. Timed as chains of `--chain` blocks with distinct weights (and
caches), more bytes than the L2 cache, run `--loops` times in one jit call (so that dispatching
the call is not what is timed), as a decoding step runs them; per block: microseconds and the
read bandwidth they imply (weights, and for attention the cache up to pos). Then a whole greedy
token of a `--chain`-layer model (GPT-2's 12 by default: each layer's two blocks, the final norm,
the head [V, D], argmax and the token's embedding) with XLA's blocks and with the fastest Pallas
pair, against the copy bound of the bytes it must read, the measure of the decoding target (XLA's
blocks here are not the sampler's exact program: `bench/sample.py` times that). A variant that fails
(on the device: Triton out of resources, say) is its row's error, and the others still run. On
CPU the kernels run in Pallas's interpreter and only their values are checked (no timings). The
last line printed is one JSON object. Figures: BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timing import GPU, seconds_per_call  # noqa: E402
from gpt.ops import decode_kernels as dk  # noqa: E402
from gpt.ops.decode_kernels import Flow, gelu, start_flow  # noqa: E402
from gpt.ops.norm import layer_norm  # noqa: E402

D, F, H, EPS = 768, 3072, 12, 1e-5  # GPT-2's width, hidden width, heads and LayerNorm epsilon
V = 50304  # GPT-2's vocabulary as the model pads it
BF16, F32 = jnp.bfloat16, jnp.float32
# MLP: (hidden units per program, input columns per load, warps, atomic, both weights loaded first).
# The H200 timed the rows form fastest (9.5 us; atomic 11.8-15.5, BENCHMARKS.md): one atomic for
# reference, then rows with more programs (BF 8), more warps, or shorter loads
MLP_PALLAS = [(16, 256, 4, False, False), (16, 256, 4, False, True), (16, 256, 4, True, False),
              (8, 256, 4, False, False), (16, 256, 8, False, False), (32, 256, 8, False, False),
              (16, 128, 4, False, False)]
# attention: (input columns per load, cache positions per block, warps); one kernel a block timed
# 28.8-35.7 us on the H200, the split form 16.5-22.3: one for reference
ATTENTION_PALLAS = [(256, 256, 8)]  # 4 warps spilled registers (ptxas)
# the same in two kernels (`split_attention`): (q/k/v rows per program, columns, positions, warps,
# the output rows loaded before the cache's, programs a head taking parts of its output rows):
# the former default, the default (out3), then its output rows in 6 programs a head (loads of
# 128), more q/k/v programs (8 rows each), a shorter block of positions
ATTENTION_SPLIT = [(16, 256, 256, 8, True, 1), (16, 256, 256, 8, True, 3), (16, 128, 256, 8, True, 6),
                   (8, 256, 256, 8, True, 3), (16, 256, 128, 8, True, 3)]


MLP, Attention = dk.MLPParams, dk.AttentionParams  # the kernels' parameters


def _small(key, shape, dtype=F32):
    return (0.02 * jax.random.normal(key, shape)).astype(dtype)


def random_mlp(key: jax.Array, d: int = D, f: int = F) -> MLP:
    k = jax.random.split(key, 6)
    return MLP(1.0 + _small(k[0], (d,)), _small(k[1], (d,)), _small(k[2], (f, d), BF16),
               _small(k[3], (f,)), _small(k[4], (f, d), BF16), _small(k[5], (d,)))


def random_attention(key: jax.Array, d: int = D) -> Attention:
    k = jax.random.split(key, 6)
    return Attention(1.0 + _small(k[0], (d,)), _small(k[1], (d,)), 5 * _small(k[2], (3 * d, d), BF16),
                     _small(k[3], (3 * d,)), _small(k[4], (d, d), BF16), _small(k[5], (d,)))


def random_cache(key: jax.Array, h: int, k: int, s: int) -> tuple[jax.Array, jax.Array]:
    """Keys [H, K, S] and values [H, S, K] (bf16), as if s positions had been written."""
    kk, kv = jax.random.split(key)
    return (jax.random.normal(kk, (h, k, s)).astype(BF16), jax.random.normal(kv, (h, s, k)).astype(BF16))


def _bf16(a: jax.Array) -> jax.Array:
    """Rounded to bf16 and held in float32: where the sampler's model rounds (products' inputs)."""
    return dk.round_to(a, BF16)


def _on_x(block: Callable) -> Callable:
    """A block of x (x -> x, or -> (x, keys, values)) as a block of the flow."""
    def flow_block(flow: Flow, *args):
        out = block(flow.x, *args)
        return flow._replace(x=out) if not isinstance(out, tuple) else (flow._replace(x=out[0]), *out[1:])
    return flow_block


# XLA's blocks, as the sampler's model runs them: bf16 inputs to the products (float32 sums), the
# bias added in float32 and rounded back, the residual stream float32.

def xla_mlp(x_D: jax.Array, p: MLP) -> jax.Array:
    """`p` from `xla_layout` (proj's weight [D, F])."""
    h_D = layer_norm(x_D, p.scale, p.bias, EPS).astype(BF16)
    fc_F = jnp.dot(p.w_fc, h_D, preferred_element_type=F32)
    g_F = gelu(_bf16(fc_F + p.b_fc)).astype(BF16)
    return x_D + jnp.dot(p.w_proj, g_F, preferred_element_type=F32) + p.b_proj


def xla_attention(x_D, p: Attention, k_HKS, v_HSK, pos) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`p` from `xla_layout` (the output weight [D, D] as [out, in])."""
    (h, kd, s), d = k_HKS.shape, x_D.shape[0]
    x_h = layer_norm(x_D, p.scale, p.bias, EPS).astype(BF16)
    qkv = (jnp.dot(p.w_qkv, x_h, preferred_element_type=F32) + p.b_qkv).astype(BF16)
    q_HK, k_HK, v_HK = qkv.reshape(3, h, kd)
    k_HKS = jax.lax.dynamic_update_slice(k_HKS, k_HK[:, :, None], (0, 0, pos))
    v_HSK = jax.lax.dynamic_update_slice(v_HSK, v_HK[:, None, :], (0, pos, 0))
    scores_HS = jnp.einsum("hk,hks->hs", q_HK, k_HKS, preferred_element_type=F32) / math.sqrt(kd)
    scores_HS = jnp.where(jnp.arange(s) <= pos, scores_HS, -jnp.inf)
    probs_HS = jax.nn.softmax(scores_HS, axis=-1).astype(BF16)
    y_D = jnp.einsum("hs,hsk->hk", probs_HS, v_HSK, preferred_element_type=F32).astype(BF16).reshape(d)
    return x_D + jnp.dot(p.w_o, y_D, preferred_element_type=F32) + p.b_o, k_HKS, v_HSK


def xla_layout(p: MLP | Attention) -> MLP | Attention:
    """XLA's blocks take every weight [out, in] (made once, outside the timed steps)."""
    if isinstance(p, MLP):
        return p._replace(w_proj=jnp.asarray(p.w_proj.T.copy()))
    return p._replace(w_o=jnp.asarray(p.w_o.T.copy()))


def _kernels(**kw) -> dk.Kernels:
    return dk.Kernels(eps=EPS, interpret=not GPU, **kw)


def mlp_variants() -> dict[str, tuple[Callable, Callable]]:
    """name -> (its parameters' layout, block(flow, p) -> flow)."""
    out = {"xla": (xla_layout, _on_x(xla_mlp))}
    for BF, BK, warps, atomic, early in MLP_PALLAS:
        k = _kernels(BF=BF, BK=BK, mlp_warps=warps, early=early)
        block = functools.partial(dk.atomic_mlp, k=k) if atomic else _on_x(functools.partial(dk.mlp_rows, k=k))
        out[f"{'atomic' if atomic else 'rows'} BF{BF} BK{BK} w{warps}{' early' if early else ''}"] = (
            lambda p: p, block)
    return out


def _attention_block(k: dk.Kernels) -> Callable:
    """block(flow, p, keys, values, pos) -> (flow, keys, values): the kernels' block over one
    layer's cache, every position from 0 on."""
    def block(flow, p, keys, values, pos):
        (_, kd, s), d = keys.shape, flow.x.shape[0]  # fitted as the model's are (the tests' sizes)
        return dk.attention_block(flow, p, keys, values, pos, 0, dk.fit(k, d, 4 * d, kd, s))
    return block


def attention_variants() -> dict[str, tuple[Callable, Callable]]:
    """name -> (its parameters' layout, block(flow, p, keys, values, pos) -> (flow, keys, values))."""
    out = {"xla": (xla_layout, _on_x(xla_attention))}
    for BK, BS, warps in ATTENTION_PALLAS:
        k = _kernels(BK=BK, BS=BS, attention_warps=warps, attention="one")
        out[f"pallas BK{BK} BS{BS} w{warps}"] = (lambda p: p, _attention_block(k))
    for BQ, BK, BS, warps, early, parts in ATTENTION_SPLIT:
        k = _kernels(BQ=BQ, BK=BK, BS=BS, attention_warps=warps, early=early, attention="split", out_split=parts)
        name = f"split BQ{BQ} BK{BK} BS{BS} w{warps}{' early' if early else ''}"
        out[name + (f" out{parts}" if parts > 1 else "")] = (lambda p: p, _attention_block(k))
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _attempt(fn: Callable):
    """fn(), or its failure as {"error": ...}: one variant that fails on the device (Triton out of
    resources, say) is that variant's row, and the others still run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (recorded, not hidden: the row says what it was)
        return {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"}


def check_mlp(key: jax.Array, d: int = D, f: int = F) -> dict[str, dict]:
    """Each variant's relative error against the float64 block and its relative difference from
    XLA's (the residual x subtracted from each, so that both are of what the block adds)."""
    kx, kp = jax.random.split(key)
    x, p = jax.random.normal(kx, (d,)), random_mlp(kp, d, f)
    x64 = np.asarray(x, np.float64)
    ref = dk.reference_mlp(x, p, EPS) - x64
    out = {name: _attempt(lambda v=v: _outputs(jax.jit(v[1])(_test_flow(x), v[0](p)))[0] - x64)
           for name, v in mlp_variants().items()}
    return {name: y if isinstance(y, dict) else {"vs_float64": _rel(y, ref), "vs_xla": _rel(y, out["xla"])}
            for name, y in out.items()}


def _test_flow(x_D: jax.Array) -> Flow:
    """A flow whose spare buffer is not zeros, so that a block that should clear it is checked."""
    return Flow(x_D, jnp.zeros_like(x_D), jnp.ones_like(x_D))


def _outputs(out) -> list[np.ndarray]:
    """A block's flow (or flow, keys, values) as float64 arrays: x first, then keys and values;
    raises if the flow's next zeros are not zeros."""
    flow, *rest = out if isinstance(out, tuple) and isinstance(out[0], Flow) else (out,)
    if np.any(np.asarray(flow.zero)):
        raise AssertionError("the next block's zeros are not zeros")
    return [np.asarray(a, np.float64) for a in (flow.x, *rest)]


def _attention_errors(got, xla, ref, x64, keys, values, pos: int) -> dict:
    """One attention variant's errors (its output y, keys k and values v as float64 arrays); "cache":
    the largest relative difference of the key and value written at pos from XLA's. Every other
    cache entry must come back as it was."""
    y, k, v = got
    for new, old, axis in ((k, keys, 2), (v, values, 1)):
        if not np.array_equal(np.delete(new, pos, axis), np.delete(np.asarray(old, np.float64), pos, axis)):
            return {"error": f"changed the cache away from position {pos}"}
    return {"vs_float64": _rel(y - x64, ref), "vs_xla": _rel(y - x64, xla[0] - x64),
            "cache": max(_rel(k[:, :, pos], xla[1][:, :, pos]), _rel(v[:, pos], xla[2][:, pos]))}


def check_attention(key: jax.Array, d: int = D, h: int = H, s: int = 512, pos: int = 300) -> dict[str, dict]:
    """As `check_mlp` for the attention block at position `pos` of an `s`-position cache (by
    default past two blocks of the largest size, so that every variant rescales its softmax)."""
    kx, kp, kc = jax.random.split(key, 3)
    x, p = jax.random.normal(kx, (d,)), random_attention(kp, d)
    keys, values = random_cache(kc, h, d // h, s)
    x64, at = np.asarray(x, np.float64), jnp.int32(pos)
    run = lambda layout, block: _outputs(jax.jit(block)(_test_flow(x), layout(p), keys, values, at))  # noqa: E731
    out = {name: _attempt(lambda v=v: run(*v)) for name, v in attention_variants().items()}
    ref = dk.reference_attention(x, p, keys, values, pos, 0, EPS) - x64
    return {name: got if isinstance(got, dict) else _attention_errors(got, out["xla"], ref, x64, keys, values, pos)
            for name, got in out.items()}


def _timed(f, args: tuple, state, reps: int, blocks: int, read: int) -> dict:
    """Per block: calls of f(*args, state) -> state, each taking (donated) the state the last returned."""
    step = jax.jit(f, donate_argnums=(len(args),))
    us = 1e6 * seconds_per_call(step, *args, state, reps=reps, carry=True) / blocks
    return {"us": us, "read_gbps": read / us / 1e3}


def time_mlp(key: jax.Array, n: int, loops: int, reps: int) -> dict:
    """Per block: a chain of n blocks (distinct weights) run `loops` times in one call, so that
    dispatching the call's hundred arguments is not what is timed."""
    ps = [random_mlp(jax.random.fold_in(key, i)) for i in range(n)]
    rows = {}
    for name, (layout, block) in mlp_variants().items():
        def step(qs, flow, block=block):
            return jax.lax.fori_loop(0, loops, lambda _, flow: functools.reduce(block, qs, flow), flow)
        flow = start_flow(jax.random.normal(key, (D,)))
        rows[name] = _attempt(lambda: _timed(step, ([layout(p) for p in ps],), flow, reps, n * loops, 2 * F * D * 2))
        print(f"mlp       {name:24s} {rows[name]}", flush=True)
    return rows


def _layers(layers: list[tuple[Callable, Callable]], qs: list, at, flow: Flow, caches: list):
    """Each layer's attention block, then its MLP block: the flow and the layers' caches after."""
    new = []
    for (attention, mlp), (pa, pm), (k, v) in zip(layers, qs, caches):
        flow, k, v = attention(flow, pa, k, v, at)
        flow = mlp(flow, pm)
        new.append((k, v))
    return flow, new


def time_attention(key: jax.Array, n: int, loops: int, reps: int, s: int, pos: int) -> dict:
    """As `time_mlp`, each block with a cache of its own (donated: written in place). The bytes
    are those a block must read, the weights and keys and values up to pos; XLA's block reads the
    whole cache under a mask, as the sampler does."""
    ps = [random_attention(jax.random.fold_in(key, i)) for i in range(n)]
    read = (4 * D * D + (pos + 1) * 2 * D) * 2
    rows = {}
    for name, (layout, block) in attention_variants().items():
        def step(qs, at, state, block=block):  # the layers without their MLP blocks
            chain = [(block, lambda flow, _: flow)] * n
            return jax.lax.fori_loop(0, loops, lambda _, st: _layers(chain, qs, at, *st), state)
        caches = [random_cache(jax.random.fold_in(key, n + i), H, D // H, s) for i in range(n)]
        state = (start_flow(jax.random.normal(key, (D,))), caches)
        qs = [(layout(p), None) for p in ps]
        rows[name] = _attempt(lambda: _timed(step, (qs, jnp.int32(pos)), state, reps, n * loops, read))
        print(f"attention {name:24s} {rows[name]}", flush=True)
    return rows


def passed(e: dict) -> bool:
    """Whether a variant's values passed: bf16's precision against float64, and within 1e-2 of XLA's
    block. The kernels round where the sampler's model asks (products' inputs, GELU's), while XLA
    on a GPU may skip a float32 -> bf16 -> float32 round trip (its default
    --xla_allow_excess_precision): on the H200 its MLP block came within 3e-7 of float64, the
    kernels' 3.2e-3 from both (BENCHMARKS.md); the attention's online softmax also rounds its
    probabilities unnormalised."""
    return e.get("vs_float64", 1.0) < 2e-2 and e.get("vs_xla", 1.0) < 1e-2


def _fastest(rows: dict, errors: dict) -> str | None:
    """The fastest Pallas variant that ran and whose values passed, or None."""
    timed = {n: r["us"] for n, r in rows.items() if n != "xla" and "us" in r and passed(errors.get(n, {}))}
    return min(timed, key=timed.get) if timed else None


def _token_step(layers: list[tuple[Callable, Callable]], qs: list, head: tuple, at, state, loops: int):
    """`loops` greedy tokens: the layers, the final norm, the head and argmax (XLA's), and the
    token's embedding (the tied head's row) as the next x."""
    w_VD, scale, bias = head

    def token(_, state):
        flow, caches = _layers(layers, qs, at, *state)
        logits_V = jnp.dot(w_VD, layer_norm(flow.x, scale, bias, EPS).astype(BF16), preferred_element_type=F32)
        return flow._replace(x=w_VD[jnp.argmax(logits_V)].astype(F32)), caches
    return jax.lax.fori_loop(0, loops, token, state)


def time_token(key: jax.Array, blocks: dict, errors: dict, n: int, loops: int, reps: int, s: int, pos: int,
               v: int = V) -> dict:
    """A whole greedy token of an n-layer model, with XLA's blocks and with the fastest Pallas pair
    that `blocks` timed ({"mlp": rows, "attention": rows}; of those whose `errors` passed), against
    the copy bound of the bytes it must read (weights, head, cache up to pos) at the bandwidth
    measured here. n a multiple of 3, or XLA copies the flow's buffers back in place (`Flow`)."""
    from gpt.metrics import measure_copy_gbps
    names = {"xla": ("xla", "xla"),
             "pallas": tuple(_fastest(blocks[b], errors[b]) for b in ("attention", "mlp"))}
    ps = [(random_attention(jax.random.fold_in(key, i)), random_mlp(jax.random.fold_in(key, n + i))) for i in range(n)]
    head = (_small(jax.random.fold_in(key, 3 * n), (v, D), BF16), jnp.ones((D,)), jnp.zeros((D,)))
    read = n * (4 * D * D + 2 * F * D + (pos + 1) * 2 * D) * 2 + v * D * 2
    copy_gbps = measure_copy_gbps()
    rows = {"read_bytes": read, "copy_gbps": copy_gbps}
    for which, (a, m) in names.items():
        if a is None or m is None:
            continue
        (la, ba), (lm, bm) = attention_variants()[a], mlp_variants()[m]
        qs = [(la(pa), lm(pm)) for pa, pm in ps]
        caches = [random_cache(jax.random.fold_in(key, 2 * n + i), H, D // H, s) for i in range(n)]
        step = functools.partial(_token_step, [(ba, bm)] * n, loops=loops)
        state = (start_flow(jax.random.normal(key, (D,))), caches)
        row = _attempt(lambda: _timed(step, (qs, head, jnp.int32(pos)), state, reps, loops, read))
        if "us" in row:
            row["of_copy_bound"] = read / (copy_gbps * 1e3) / row["us"]
        rows[which] = dict(row, attention=a, mlp=m)
        print(f"token     {which:24s} {rows[which]}", flush=True)
    return rows


def _worst(errors: dict, key: str) -> float:
    """The largest of an error over every variant; inf if a variant failed."""
    return max(e.get(key, float("inf")) for e in errors.values())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", type=int, default=12, help="blocks (distinct weights) per timed chain")
    ap.add_argument("--loops", type=int, default=4, help="runs of the chain per timed call")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=1024, help="the cache's positions")
    ap.add_argument("--pos", type=int, default=512, help="the position decoded (< --seq)")
    args = ap.parse_args(argv)
    if not 0 <= args.pos < args.seq or args.seq % 256 or min(args.chain, args.loops, args.reps) < 1:
        ap.error(f"--pos={args.pos} must be in [0, --seq={args.seq}), --seq a multiple of 256 (the largest "
                 f"block of positions), and --chain, --loops and --reps positive")
    if args.chain % 3:  # the flow's three buffers must come back to their places each loop (`Flow`)
        ap.error(f"--chain={args.chain}: use a multiple of 3 (else XLA copies between blocks)")
    key = jax.random.key(0)
    errors = {"mlp": check_mlp(key), "attention": check_attention(key)}
    for rows in errors.values():
        for e in rows.values():
            e["passed"] = passed(e)
    worst = max(_worst(e, "vs_float64") for e in errors.values())
    apart = {b: _worst(errors[b], "vs_xla") for b in errors}
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; largest relative error against "
          f"float64: {worst:.1e}; largest difference from XLA's block: MLP {apart['mlp']:.1e}, attention "
          f"{apart['attention']:.1e}", flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "errors": errors,
              "seq": args.seq, "pos": args.pos}
    if GPU:
        result["mlp"] = time_mlp(key, args.chain, args.loops, args.reps)
        result["attention"] = time_attention(key, args.chain, args.loops, args.reps, args.seq, args.pos)
        result["token"] = time_token(key, result, errors, args.chain, args.loops, args.reps, args.seq, args.pos)
    print(json.dumps(result))
    return 0 if all(e["passed"] for rows in errors.values() for e in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
