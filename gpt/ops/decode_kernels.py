"""Batch-1 decoding's GPT-2 layer as hand-written Pallas (Triton) kernels: three kernels a layer and a sum.

A GPT-2 token that XLA compiles for a GPU is about 170 kernels of 2-3 us each, most of them far
from the memory bandwidth (BENCHMARKS.md): XLA's products alone cap batch-1 decoding near 40-50%
of the bandwidth bound. Here each block of a layer reads its weights once, in few kernels:

- the MLP block, x + proj(gelu(fc(LayerNorm(x)))): program j takes hidden units [j BF, (j+1) BF).
  It normalises x itself (768 entries: every program does, so no kernel has to come first),
  multiplies by its BF rows of fc's weight held [F, D] ([out, in]), adds the bias, applies GELU,
  multiplies by its BF rows of proj's weight held [F, D] ([in, out]: both contiguous rows, each
  weight read once in all) and writes a partial row that XLA sums after (`mlp_rows`, one more
  kernel), or adds the result into the output atomically (`atomic_mlp`: 192 programs adding into
  the same 768 entries, slower on an H200).
- the attention block, x + out(attention(qkv(LayerNorm(x)), cache)) of token `index`: one
  program a head (`attention_block`: its q, k and v rows of the qkv weight [3D, D], k and v into
  the cache at slot index mod S, attention over the tokens lo..index that the cache's ring of S
  slots holds, as an online softmax, and its rows of the output weight [D, D] ([in, out]) added
  into the output), or in two kernels (`split_attention`): q, k and v over 3D / BQ programs,
  then a program a head. H programs (12 of an H200's 132 SMs) read the one-kernel block's qkv
  weight; the split block's q/k/v kernel spreads it over more.

A block's programs cannot order a residual add among themselves, so the stream moves as a `Flow`:
each one-kernel block adds into a buffer of zeros (the rows MLP leaves the sum to XLA). Keys are
read [N, K, S] and values [N, S, K] (the model's cache with its layer, batch and head axes
flattened: `head0` is the layer's first head), and the new token's written in place. Products take
inputs rounded to `dtype` (the sampler's compute dtype) and sum in float32, as XLA's blocks do. Off
a GPU the kernels run in Pallas's interpreter (`interpret`): their values are checked there, their
speed only on a GPU (bench/decode_layer.py times the variants).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from gpt.ops.pallas_util import pow2_at_most, pow2_divisor, triton_params

F32 = jnp.float32
GELU_C = 0.7978845608028654  # sqrt(2 / pi): GPT-2's tanh GELU


class MLPParams(NamedTuple):
    """An MLP block's: the norm's scale and bias, fc's weight [F, D] ([out, in]) and bias, proj's
    weight [F, D] ([in, out]) and bias."""
    scale: jax.Array
    bias: jax.Array
    w_fc: jax.Array
    b_fc: jax.Array
    w_proj: jax.Array
    b_proj: jax.Array


class AttentionParams(NamedTuple):
    """An attention block's: the norm's, the qkv weight [3D, D] ([out, in]: q's rows, k's, v's,
    each head by head) and bias, the output weight [D, D] ([in, out]: head h's rows h K to
    (h+1) K) and bias."""
    scale: jax.Array
    bias: jax.Array
    w_qkv: jax.Array
    b_qkv: jax.Array
    w_o: jax.Array
    b_o: jax.Array


class Flow(NamedTuple):
    """The residual stream x [D] (float32) and two [D] buffers of zeros. A one-kernel block's
    programs add their parts into `zero` (program 0 adds x and the bias); program 0 also clears
    `spare`, the x of the block before last, which becomes the next block's `zero`. Three buffers
    in rotation: no kernel, copy or memset makes zeros between blocks. (A loop whose body runs
    blocks on one flow carried from step to step, as bench/decode_layer.py's chains do, must run a
    multiple of 3 of them, or XLA copies the buffers back to their places; the model starts a
    flow each step, `start_flow`.) Other blocks leave the two buffers alone."""
    x: jax.Array
    zero: jax.Array
    spare: jax.Array


def start_flow(x_D: jax.Array) -> Flow:
    """x's flow. The first block clears `spare` whatever it holds, so any buffer of x's size will
    do; made from x (x times 0 is zeros for a finite x, which XLA does not fold away), the two
    buffers are one fusion with x's, where two buffers of zeros compiled to a fill and two copies
    on a GPU, three kernels of a token's fifty (bench/kernel_count.py --decode_kernels)."""
    x_D = x_D.astype(F32)
    return Flow(x_D, x_D * 0.0, -x_D)


class Kernels(NamedTuple):
    """The kernels' static choices, the defaults the fastest measured on an H200 (BENCHMARKS.md).
    Block sizes are powers of two (Triton's); `fit` shrinks them to a model's sizes. `mlp`:
    "rows" (partial rows XLA sums) or "atomic"; `attention`: "one" kernel a block or "split" in
    two; `early`: every weight tile of a program loaded before its first product (one wait on the
    memory, more registers)."""
    BF: int = 16  # MLP: hidden units per program
    BK: int = 256  # columns per load of a row
    mlp: str = "rows"
    mlp_warps: int = 4
    attention: str = "split"
    BQ: int = 16  # split attention: q/k/v rows per program
    BS: int = 256  # cache positions per block of the online softmax
    attention_warps: int = 8  # 4 spilled registers at GPT-2's sizes (ptxas)
    # split attention: programs a head in its second kernel, each adding 1 / out_split of the head's
    # output rows (each computing the head's attention: more programs read w_o, the cache is read
    # out_split times); `fit` makes it divide the rows' tiles
    out_split: int = 3
    early: bool = True
    eps: float = 1e-5  # LayerNorm's
    dtype: str = "bfloat16"  # the products' input dtype
    interpret: bool = False  # Pallas's interpreter (off a GPU)


MAX_TILES = 8  # row tiles (d / BK) a kernel reads: 25 (GPT-2 XL's 1600 in tiles of 64) spilled registers
EARLY_BYTES = 640  # the MLP's weight bytes a thread may hold `early`: GPT-2 to 1280 wide (ptxas, offline)


def row_tiles(d: int, BK: int = Kernels().BK) -> int:
    """The tiles of a power of two (at most BK) that a row of d entries is read in."""
    return d // pow2_divisor(d, BK)


def fit(k: Kernels, d: int, f: int, head_dim: int, slots: int) -> Kernels:
    """`k` with its block sizes shrunk to divide a model's width d, hidden width f and head dim
    (a power of two), BS to fit a cache of `slots` positions, and the MLP's weights loaded
    `early` only where they fit in registers (EARLY_BYTES; the flag also has the per-head
    attention kernel load its output rows before the cache, a smaller load)."""
    k = k._replace(BK=pow2_divisor(d, k.BK), BF=pow2_divisor(f, k.BF), BQ=pow2_divisor(head_dim, k.BQ),
                   BS=pow2_at_most(slots, k.BS))
    per_thread = 2 * k.BF * d * jnp.dtype(k.dtype).itemsize // (32 * k.mlp_warps)
    return k._replace(early=k.early and per_thread <= EARLY_BYTES, out_split=math.gcd(k.out_split, d // k.BK))


def gelu(a: jax.Array) -> jax.Array:
    """GPT-2's tanh GELU written out, as XLA's block computes it."""
    return 0.5 * a * (1.0 + jnp.tanh(GELU_C * (a + 0.044715 * a * a * a)))


def round_to(a: jax.Array, dtype) -> jax.Array:
    """Rounded to the products' input dtype and held in float32."""
    return a.astype(dtype).astype(F32)


def _call(kernel, k: Kernels, warps: int, **kw):
    """pl.pallas_call with Triton's warps on a GPU, or in the interpreter."""
    params = triton_params(warps, 2, k.interpret)
    return pl.pallas_call(kernel, interpret=k.interpret, compiler_params=params, **kw)


def _normed_chunks(x_ref, s_ref, b_ref, k: Kernels) -> list[jax.Array]:
    """LayerNorm(x) in chunks of BK entries, rounded as the products take it."""
    d, BK = x_ref.shape[0], k.BK
    chunks = [pl.ds(c * BK, BK) for c in range(d // BK)]
    xs, scales, biases = ([ref[c] for c in chunks] for ref in (x_ref, s_ref, b_ref))  # loads first (`_tiles`)
    mean = sum(jnp.sum(x) for x in xs) / d
    rstd = jax.lax.rsqrt(sum(jnp.sum(jnp.square(x - mean)) for x in xs) / d + k.eps)
    return [round_to((x - mean) * rstd * sc + b, k.dtype)
            for x, sc, b in zip(xs, scales, biases, strict=True)]


def _atomic_add(ref, idx, value) -> None:
    """Pallas's Triton atomic add, imported where used: the interpreter needs no Triton module."""
    from jax.experimental.pallas import triton as plt
    plt.atomic_add(ref, idx, value)


def _tiles(w_ref, rows: pl.Slice, BK: int, first=0, count: int | None = None) -> list[jax.Array]:
    """w[rows] loaded as tiles of BK columns (`count` of them from column `first`; by default the
    whole rows), all before any is used: Triton emits the loads in this order, and a load issued
    after a cross-warp reduction (a barrier) waits for it, so loading a tile just before its
    product exposes the memory's latency once per tile (the PTX showed it)."""
    count = w_ref.shape[1] // BK if count is None else count
    return [w_ref[rows, pl.ds(first + c * BK, BK)] for c in range(count)]


def _rows_times(tiles: list[jax.Array], hs: list[jax.Array], k: Kernels) -> jax.Array:
    """w[rows] @ h summed in float32, both in chunks of columns (`_tiles`); the weight taken in the
    products' dtype, as XLA's layers take it (a no-op when it is held so)."""
    return sum(jnp.sum(round_to(t, k.dtype) * h[None, :], axis=1) for t, h in zip(tiles, hs, strict=True))


def _add_rows_times(o_ref, v: jax.Array, tiles: list[jax.Array], k: Kernels, row: int | None,
                    first=0) -> None:
    """v @ w[rows] (float32 sums, w in `_tiles` from column `first`) into o: added atomically (row
    None), or written as row `row` of o."""
    for c, t in enumerate(tiles):
        cols = pl.ds(first + c * k.BK, k.BK)
        part = jnp.sum(v[:, None] * round_to(t, k.dtype), axis=0)
        if row is None:
            _atomic_add(o_ref, cols, part)
        else:
            o_ref[row, cols] = part


def _add_residual(o_ref, cleared_ref, x_ref, b_ref, BK: int, axes: int = 1) -> None:
    """Program 0 (of a grid of `axes` axes) adds x and the output bias into o (atomically: the
    other programs are adding) and clears the flow's spare buffer (`Flow`)."""
    @pl.when(functools.reduce(jnp.logical_and, [pl.program_id(a) == 0 for a in range(axes)]))
    def _():
        for c in range(x_ref.shape[0] // BK):
            cols = pl.ds(c * BK, BK)
            _atomic_add(o_ref, cols, x_ref[cols] + b_ref[cols])
            cleared_ref[cols] = jnp.zeros((BK,), F32)


def _residual_row(o_ref, x_ref, b_ref, BK: int) -> None:
    """Program 0 writes x and the output bias as o's last row: the sum of o's rows is then the
    block's output, one reduction for XLA (x + rows.sum(0) + b compiled to two kernels)."""
    @pl.when(pl.program_id(0) == 0)
    def _():
        for c in range(x_ref.shape[0] // BK):
            cols = pl.ds(c * BK, BK)
            o_ref[o_ref.shape[0] - 1, cols] = x_ref[cols] + b_ref[cols]


def _mlp_kernel(x_ref, s_ref, b_ref, wfc_ref, bfc_ref, wp_ref, bp_ref, *refs, k: Kernels, atomic: bool):
    """Program j: hidden units [j BF, (j+1) BF) through fc, GELU and proj, into the output: its
    partial row j (and program 0 x plus the bias as the last row), or (`atomic`) added into the
    flow's zeros, whose spare buffer it clears."""
    j = pl.program_id(0)
    rows = pl.ds(j * k.BF, k.BF)
    w_fc = _tiles(wfc_ref, rows, k.BK)
    w_proj = _tiles(wp_ref, rows, k.BK) if k.early else None
    a = bfc_ref[rows] + _rows_times(w_fc, _normed_chunks(x_ref, s_ref, b_ref, k), k)
    g = round_to(gelu(round_to(a, k.dtype)), k.dtype)
    if w_proj is None:
        w_proj = _tiles(wp_ref, rows, k.BK)
    if atomic:
        _add_rows_times(refs[-2], g, w_proj, k, None)
        _add_residual(*refs[-2:], x_ref, bp_ref, k.BK)
    else:
        _add_rows_times(refs[-1], g, w_proj, k, j)
        _residual_row(refs[-1], x_ref, bp_ref, k.BK)


def _check_mlp(p: MLPParams, k: Kernels) -> tuple[int, int]:
    f, d = p.w_fc.shape
    assert f % k.BF == 0 and d % k.BK == 0 and p.w_proj.shape == (f, d), (p.w_fc.shape, p.w_proj.shape, k)
    return f, d


def mlp_rows(x_D: jax.Array, p: MLPParams, k: Kernels) -> jax.Array:
    """The MLP block as a kernel writing F / BF partial rows and x plus the bias as one more, which
    XLA sums."""
    f, d = _check_mlp(p, k)
    part_PD = _call(functools.partial(_mlp_kernel, k=k, atomic=False), k, k.mlp_warps,
                    out_shape=jax.ShapeDtypeStruct((f // k.BF + 1, d), F32), grid=(f // k.BF,))(x_D, *p)
    return part_PD.sum(0)


def atomic_mlp(flow: Flow, p: MLPParams, k: Kernels) -> Flow:
    """The MLP block as one kernel adding into the flow's zeros."""
    f, d = _check_mlp(p, k)
    args = (flow.x, *p, flow.zero, flow.spare)
    n, vec = len(args), jax.ShapeDtypeStruct((d,), F32)
    y, cleared = _call(functools.partial(_mlp_kernel, k=k, atomic=True), k, k.mlp_warps, out_shape=(vec, vec),
                       grid=(f // k.BF,), input_output_aliases={n - 2: 0, n - 1: 1})(*args)
    return Flow(y, cleared, flow.x)


def mlp_block(flow: Flow, p: MLPParams, k: Kernels) -> Flow:
    """The MLP block on the flow (`k.mlp`): `mlp_rows`, which leaves the flow's buffers alone, or
    `atomic_mlp`."""
    assert k.mlp in ("rows", "atomic"), k.mlp
    if k.mlp == "atomic":
        return atomic_mlp(flow, p, k)
    return flow._replace(x=mlp_rows(flow.x, p, k))


def _attend(q, kv_new, k_ref, v_ref, n, at_ref, BS: int) -> jax.Array:
    """Head row n's attention output (float32 [K]) over the cache's tokens lo..index-1 and the new
    key and value (`kv_new`, token `index` at slot pos: held here, not read back), as an online
    softmax over blocks of BS slots (`at_ref`: `_positions`). Slot p holds token index - (pos - p)
    mod S, as in the model's ring (`gpt.model.cache_positions`): before the cache wraps, the slots
    lo..pos-1; after, any slot but pos. A block that would reach past the cache's S slots is read
    from S - BS instead (no masked loads), the slots it had already covered masked out. (A start
    past index, which no row has, would leave the new token alone here and nothing in the model.)"""
    pos, index, lo = at_ref[0], at_ref[1], at_ref[2]
    k_new, v_new = kv_new
    qs = q * (1.0 / math.sqrt(q.shape[0]))
    carry = (jnp.sum(qs * k_new), jnp.float32(1.0), v_new)  # running max, sum of exp, weighted values
    S = k_ref.shape[-1]
    wrapped = index >= S
    first = jnp.where(wrapped, 0, lo // BS)
    last = jnp.where(wrapped, (S + BS - 1) // BS, (pos + BS - 1) // BS)

    def block(i, carry):
        m, l, acc = carry
        at = jnp.minimum(i * BS, S - BS)
        span = pl.ds(at, BS)
        k_KS, v_SK = k_ref[n, :, span], v_ref[n, span, :]  # both loads before a reduction (`_tiles`)
        p_S = at + jnp.arange(BS)
        held_S = index - (pos - p_S + S) % S  # the token each slot holds
        valid = (p_S >= i * BS) & (p_S != pos) & (held_S >= lo)  # other slots may hold anything
        s = jnp.where(valid, jnp.sum(k_KS.astype(F32) * qs[:, None], axis=0), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s))
        e, fix = jnp.exp(s - m_new), jnp.exp(m - m_new)
        v_SK = jnp.where(valid[:, None], v_SK.astype(F32), 0.0)
        acc = acc * fix + jnp.sum(round_to(e, v_ref.dtype)[:, None] * v_SK, axis=0)
        return m_new, l * fix + jnp.sum(e), acc

    _, l, acc = jax.lax.fori_loop(first, last, block, carry)
    return acc / l


def _write_kv(k_ref, v_ref, n, pos, k_new, v_new) -> None:
    k_ref[n, :, pos] = k_new.astype(k_ref.dtype)
    v_ref[n, pos, :] = v_new.astype(v_ref.dtype)


def _attention_kernel(at_ref, x_ref, s_ref, b_ref, wqkv_ref, bqkv_ref, wo_ref, bo_ref, _k, _v, _zero, _spare,
                      o_ref, k_ref, v_ref, cleared_ref, *, k: Kernels, head0: int):
    """Program h: head h's q, k, v; k and v into the cache at pos; attention; its output rows."""
    h, pos = pl.program_id(0), at_ref[0]
    kd, d = k_ref.shape[1], x_ref.shape[0]
    rows = [pl.ds(i * d + h * kd, kd) for i in range(3)]  # head h's rows of q, k and v
    w_q = _tiles(wqkv_ref, rows[0], k.BK)  # before the norm's reductions; k's and v's after (registers)
    hs = _normed_chunks(x_ref, s_ref, b_ref, k)
    q = round_to(bqkv_ref[rows[0]] + _rows_times(w_q, hs, k), k.dtype)
    k_new, v_new = (round_to(bqkv_ref[r] + _rows_times(_tiles(wqkv_ref, r, k.BK), hs, k), k_ref.dtype)
                    for r in rows[1:])
    _write_kv(k_ref, v_ref, head0 + h, pos, k_new, v_new)
    y = round_to(_attend(q, (k_new, v_new), k_ref, v_ref, head0 + h, at_ref, k.BS), k.dtype)
    _add_rows_times(o_ref, y, _tiles(wo_ref, pl.ds(h * kd, kd), k.BK), k, None)
    _add_residual(o_ref, cleared_ref, x_ref, bo_ref, k.BK)


def _positions(index, lo, slots: int) -> jax.Array:
    """[pos, index, lo] as the attention kernels take them: the new token's slot index mod S, its
    number, and the first token it attends to. The same array for every layer (one fusion a step;
    each layer's head0 is compiled in, as a run-time entry it made one kernel more a layer)."""
    index = jnp.asarray(index, jnp.int32)
    return jnp.stack([index % slots, index, jnp.maximum(jnp.asarray(lo, jnp.int32), 0)])


def _check_attention(flow: Flow, p: AttentionParams, k_NKS, v_NSK, heads: int, k: Kernels) -> None:
    (_, kd, s), d = k_NKS.shape, flow.x.shape[0]
    assert p.w_qkv.shape == (3 * d, d) and p.w_o.shape == (d, d) and heads * kd == d, \
        (p.w_qkv.shape, k_NKS.shape)
    assert d % k.BK == 0 and kd % k.BQ == 0 and k.BS <= s and v_NSK.shape == (k_NKS.shape[0], s, kd), \
        (d, kd, s, k)
    assert k.attention != "split" or (d // k.BK) % k.out_split == 0, (d, k)


def attention_block(flow: Flow, p: AttentionParams, k_NKS, v_NSK, index, lo, k: Kernels, head0: int = 0
                    ) -> tuple[Flow, jax.Array, jax.Array]:
    """The attention block of token number `index` (`k.attention`: one kernel, or
    `split_attention`), adding into the flow's zeros: its key and value written in place into
    heads head0.. of the cache at slot index mod S, and it attends to itself and the tokens lo..
    index-1 that the cache still holds (a ring of S slots, as the model's). The block's H heads:
    x's width over the cache's head dim."""
    heads = flow.x.shape[0] // k_NKS.shape[1]
    _check_attention(flow, p, k_NKS, v_NSK, heads, k)
    if k.attention == "split":
        return split_attention(flow, p, k_NKS, v_NSK, index, lo, k, head0)
    args = (_positions(index, lo, k_NKS.shape[-1]), flow.x, *p, k_NKS, v_NSK, flow.zero, flow.spare)
    vec = jax.ShapeDtypeStruct(flow.x.shape, F32)
    cache = (jax.ShapeDtypeStruct(k_NKS.shape, k_NKS.dtype), jax.ShapeDtypeStruct(v_NSK.shape, v_NSK.dtype))
    out = (vec, *cache, vec)
    n = len(args)
    y, k_NKS, v_NSK, cleared = _call(
        functools.partial(_attention_kernel, k=k, head0=head0), k, k.attention_warps, out_shape=out,
        grid=(heads,), input_output_aliases={n - 2: 0, n - 4: 1, n - 3: 2, n - 1: 3})(*args)
    return Flow(y, cleared, flow.x), k_NKS, v_NSK


def _qkv_kernel(at_ref, x_ref, s_ref, b_ref, wqkv_ref, bqkv_ref, _k, _v, q_ref, k_ref, v_ref, *, k: Kernels,
                head0: int):
    """Program r: rows [r BQ, (r+1) BQ) of q, k and v stacked (BQ divides a head's K), into q's
    buffer or the cache at pos."""
    r, pos = pl.program_id(0), at_ref[0]
    kd, d = k_ref.shape[1], x_ref.shape[0]
    rows = pl.ds(r * k.BQ, k.BQ)
    w = _tiles(wqkv_ref, rows, k.BK)
    y = bqkv_ref[rows] + _rows_times(w, _normed_chunks(x_ref, s_ref, b_ref, k), k)
    part, row = r * k.BQ // d, r * k.BQ % d  # which of q, k and v; its row
    n, within = head0 + row // kd, pl.ds(row % kd, k.BQ)

    @pl.when(part == 0)
    def _():
        q_ref[rows] = round_to(y, k.dtype)

    @pl.when(part == 1)
    def _():
        k_ref[n, within, pos] = y.astype(k_ref.dtype)

    @pl.when(part == 2)
    def _():
        v_ref[n, pos, within] = y.astype(v_ref.dtype)


def _head_kernel(at_ref, x_ref, q_ref, k_ref, v_ref, wo_ref, bo_ref, _zero, _spare, o_ref, cleared_ref, *,
                 k: Kernels, head0: int):
    """Program (h, c): head h's attention over the cache (this token's key and value written by
    `_qkv_kernel`) and its part c of the head's rows of the output product (`out_split`), added
    into the flow's zeros; those loaded before the cache's (`early`: their wait overlaps the
    attention's, for more registers) or after."""
    h, pos = pl.program_id(0), at_ref[0]
    kd, n = k_ref.shape[1], head0 + h
    per = wo_ref.shape[1] // k.BK // k.out_split  # tiles of the rows a program takes
    first = pl.program_id(1) * per * k.BK
    w_o = _tiles(wo_ref, pl.ds(h * kd, kd), k.BK, first, per) if k.early else None
    kv_new = (k_ref[n, :, pos].astype(F32), v_ref[n, pos, :].astype(F32))
    y = round_to(_attend(q_ref[pl.ds(h * kd, kd)], kv_new, k_ref, v_ref, n, at_ref, k.BS), k.dtype)
    if w_o is None:
        w_o = _tiles(wo_ref, pl.ds(h * kd, kd), k.BK, first, per)
    _add_rows_times(o_ref, y, w_o, k, None, first)
    _add_residual(o_ref, cleared_ref, x_ref, bo_ref, k.BK, axes=2)


def split_attention(flow: Flow, p: AttentionParams, k_NKS, v_NSK, index, lo, k: Kernels, head0: int = 0
                    ) -> tuple[Flow, jax.Array, jax.Array]:
    """The block as two kernels: q, k and v over 3D / BQ programs (the cache written in place),
    then `out_split` programs a head for the attention and the output rows."""
    d, heads = flow.x.shape[0], flow.x.shape[0] // k_NKS.shape[1]
    at = _positions(index, lo, k_NKS.shape[-1])
    cache = (jax.ShapeDtypeStruct(k_NKS.shape, k_NKS.dtype), jax.ShapeDtypeStruct(v_NSK.shape, v_NSK.dtype))
    vec = jax.ShapeDtypeStruct((d,), F32)
    q_D, k_NKS, v_NSK = _call(
        functools.partial(_qkv_kernel, k=k, head0=head0), k, k.attention_warps, out_shape=(vec, *cache),
        grid=(3 * d // k.BQ,), input_output_aliases={6: 1, 7: 2})(
        at, flow.x, p.scale, p.bias, p.w_qkv, p.b_qkv, k_NKS, v_NSK)
    y, cleared = _call(
        functools.partial(_head_kernel, k=k, head0=head0), k, k.attention_warps, out_shape=(vec, vec),
        grid=(heads, k.out_split), input_output_aliases={7: 0, 8: 1})(
        at, flow.x, q_D, k_NKS, v_NSK, p.w_o, p.b_o, flow.zero, flow.spare)
    return Flow(y, cleared, flow.x), k_NKS, v_NSK


# The blocks in float64 from the same weights, with no intermediate rounding: the references the
# kernels are checked against (tests/ops/test_decode_kernels.py, bench/decode_layer.py).

def _f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def _ln64(x: np.ndarray, p: MLPParams | AttentionParams, eps: float) -> np.ndarray:
    return (x - x.mean()) / np.sqrt(x.var() + eps) * _f64(p.scale) + _f64(p.bias)


def reference_mlp(x_D, p: MLPParams, eps: float = 1e-5) -> np.ndarray:
    x = _f64(x_D)
    a = _f64(p.w_fc) @ _ln64(x, p, eps) + _f64(p.b_fc)
    g = 0.5 * a * (1.0 + np.tanh(GELU_C * (a + 0.044715 * a ** 3)))
    return x + g @ _f64(p.w_proj) + _f64(p.b_proj)


def reference_attention(x_D, p: AttentionParams, k_HKS, v_HSK, index: int, lo: int = 0, eps: float = 1e-5
                        ) -> np.ndarray:
    """As `attention_block` for one layer's cache (keys [H, K, S], values [H, S, K]): the tokens it
    holds as held, the new one's key and value unrounded."""
    (h, kd, S), x = k_HKS.shape, _f64(x_D)
    q, k, v = (_f64(p.w_qkv) @ _ln64(x, p, eps) + _f64(p.b_qkv)).reshape(3, h, kd)
    pos = index % S
    keys, values = _f64(k_HKS).copy(), _f64(v_HSK).copy()
    keys[:, :, pos], values[:, pos] = k, v
    seen = index - (pos - np.arange(S)) % S >= max(lo, 0)  # the slots holding tokens lo..index
    s = np.einsum("hk,hks->hs", q, keys[:, :, seen]) / math.sqrt(kd)
    e = np.exp(s - s.max(-1, keepdims=True))
    y = np.einsum("hs,hsk->hk", e / e.sum(-1, keepdims=True), values[:, seen]).reshape(-1)
    return x + y @ _f64(p.w_o) + _f64(p.b_o)
