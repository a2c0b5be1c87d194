"""LayerNorm's and RMSNorm's backward as one Pallas (Triton) kernel, with the residual stream's
own gradient added in.

In the H200's profile of GPT-2's training step (batch 64 x 1024, BENCHMARKS.md), XLA ran each of
the 24 block norms' backward as two kernels: the input's gradient, a Triton row fusion of 0.4 GB
at about 1.2 TB/s (0.33 ms), and the scale's and bias's sums, a column reduction that read the
incoming gradient and the input again (0.14 ms): about 11 ms of a 126.6 ms step, where a copy
of the same bytes runs at about 3 TB/s. Here program p takes rows [p BR SUB, (p + 1) BR SUB) in
SUB tiles of BR rows, each row in chunks of BD columns (Triton's blocks are powers of two; GPT-2's
768 is three of 256). It recomputes the normalised rows from the input and the forward's row
statistics, writes the input's gradient plus the stream's (`norm_stream`), and keeps the tiles'
column sums of g * xhat (and g, with a bias) in registers, written once as its row of partial
sums, which XLA adds up ([R / (BR SUB), 2, D] float32, small). Math in float32, one rounding.

`norm_stream(x, ...)` returns (x, norm(x)) with this backward: the identity's cotangent (the
residual branch's gradient) and the norm's arrive together, so their sum is never a pass of its
own. `norm(x, ...)` is the same without the stream (the final norm). The forward stays XLA's
(its statistics, then the normalised rows in the products' dtype, so that the incoming gradient
arrives in that dtype too). The references are gpt/ops/norm.py's.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gpt.ops.norm import RowStats, normalize_rows
from gpt.ops.pallas_util import pow2_at_most, pow2_divisor, triton_params

F32 = jnp.float32
# Entries of each [BR, D] operand (x, g, the stream's gradient) a thread holds, at most, where the
# row allows: GPT-2's 2 x 768 at 8 warps is 6, 64 registers (ptxas, H200); wider rows take more warps
PER_THREAD = 12


class Tiles(NamedTuple):
    """The kernel's static choices, fitted by `fit` to the array: rows a tile, tiles a program,
    columns a chunk, Triton's warps; Pallas's interpreter off a GPU."""
    BR: int = 2  # GPT-2: 2 x 768 entries of x, g and the stream's gradient, 6 a thread each
    SUB: int = 16  # partial sums [R / 32, 2, D] float32 (GPT-2, batch 64: 12.6 MB)
    BD: int = 256
    # the fastest of bench/norm.py's five tilings on an H200 at GPT-2's width (0.147 ms against 0.161
    # at 4 warps, XLA's 0.367; BENCHMARKS.md); ptxas: 64 registers (108 at 4 warps)
    warps: int = 8
    interpret: bool = False


def fit(t: Tiles, R: int, D: int) -> Tiles:
    """`t` fitted to [R, D] so that no tile runs past the array and the registers stay bounded as
    D grows (ptxas: 4,096 wide at 2 rows and 4 warps spilled): warps doubled (to 32 at
    most) until a row is at most PER_THREAD entries a thread, then the largest power-of-two BR up
    to t.BR that divides R and keeps a tile within it; chunks of columns a power of two that
    divides D, at least two entries a thread where D allows; SUB the largest divisor of R / BR up
    to t.SUB (a loop's trip count, any number: an odd R still gets programs of several rows)."""
    warps = t.warps
    while D > PER_THREAD * 32 * warps and warps < 32:
        warps *= 2
    BR = pow2_divisor(R, pow2_at_most(max(1, PER_THREAD * 32 * warps // D), t.BR))
    SUB = max(d for d in range(1, min(t.SUB, R // BR) + 1) if (R // BR) % d == 0)
    return t._replace(BR=BR, SUB=SUB, BD=pow2_divisor(D, max(t.BD, 64 * warps)), warps=warps)


# Chunks of a row the kernel takes at most: each is unrolled, so a width with few factors of two
# (GPT-2 XL's 1,600: 25 chunks of 64, 237 registers by ptxas; an odd width: one column a chunk)
# would compile long and spill. Such widths keep XLA's norms (`fits`). Llama's and Qwen's widths
# (4,096: 4 chunks; 3,584: 7) and GPT-2's up to large (1,280: 5) fit.
MAX_CHUNKS = 8


def fits(D: int) -> bool:
    """Whether rows D wide take at most MAX_CHUNKS chunks at `fit`'s tiles."""
    return D // fit(Tiles(), 1, D).BD <= MAX_CHUNKS


def _load_stats(refs: tuple, rows: pl.Slice, centre: bool
                ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The tile's 1/std, shift and mean of x - shift as [BR, 1] columns (RMSNorm: 1/rms alone)."""
    rstd_ref, shift_ref, mean_ref = refs
    col = (lambda ref: ref[rows][:, None])
    return col(rstd_ref), (col(shift_ref) if centre else None), (col(mean_ref) if centre else None)


def _row_sum(chunks: list[jax.Array]) -> jax.Array:
    """The rows' sums [BR, 1] over their chunks: added entry by entry first, so that it is one
    reduction across the program's threads (a barrier each in Triton), not one a chunk."""
    return jnp.sum(functools.reduce(jnp.add, chunks), axis=1, keepdims=True)


def _tile_backward(x: list[jax.Array], g: list[jax.Array], scale: list[jax.Array], rstd: jax.Array,
                   shift: jax.Array | None, mean: jax.Array | None, D: int, centre: bool
                   ) -> tuple[list[jax.Array], list[jax.Array]]:
    """One tile's normalised rows and input gradient, chunk by chunk (lists over the chunks of
    columns, float32): dx = rstd * (gs - mean(gs) - xhat * mean(gs * xhat)), gs = g * scale,
    as `gpt.ops.norm._norm_bwd` computes it (RMSNorm: gs not centred)."""
    xhat = [((xc - shift) - mean) * rstd if centre else xc * rstd for xc in x]
    gs = [gc * sc[None, :] for gc, sc in zip(g, scale, strict=True)]
    dot = _row_sum([a * b for a, b in zip(gs, xhat, strict=True)]) / D
    gs_mean = _row_sum(gs) / D if centre else None
    centred = [gc - gs_mean for gc in gs] if centre else gs
    return xhat, [rstd * (c - h * dot) for c, h in zip(centred, xhat, strict=True)]


def _backward_kernel(x_ref, g_ref, scale_ref, rstd_ref, shift_ref, mean_ref, *refs, t: Tiles,
                     centre: bool, stream: bool, sums: int) -> None:
    """Program p: its SUB tiles' input gradients (plus the stream's), and the column sums of
    g * xhat (and of g with a bias) over its rows, as row p of the partial sums: the tiles are
    added entry by entry in the loop, and summed over their BR rows once at the end."""
    gx_ref, dx_ref, part_ref = refs if stream else (None, *refs)
    p, D = pl.program_id(0), x_ref.shape[1]
    cols = [pl.ds(c * t.BD, t.BD) for c in range(D // t.BD)]
    scale = [scale_ref[c].astype(F32) for c in cols]

    def tile(i, acc):
        rows = pl.ds(pl.multiple_of((p * t.SUB + i) * t.BR, t.BR), t.BR)
        # every load first: one issued after the rows' sums (a barrier) would wait for them
        # (`decode_kernels._tiles`)
        x, g = ([ref[rows, c].astype(F32) for c in cols] for ref in (x_ref, g_ref))
        gx = [gx_ref[rows, c].astype(F32) for c in cols] if stream else [0.0] * len(cols)
        xhat, dx = _tile_backward(x, g, scale, *_load_stats((rstd_ref, shift_ref, mean_ref), rows, centre),
                                  D, centre)
        for c, d, s in zip(cols, dx, gx, strict=True):
            dx_ref[rows, c] = (d + s).astype(dx_ref.dtype)
        new = [gc * h for gc, h in zip(g, xhat, strict=True)] + (g if sums == 2 else [])
        return [a + b for a, b in zip(acc, new, strict=True)]

    zeros = [jnp.zeros((t.BR, t.BD), F32) for _ in range(sums * len(cols))]
    acc = jax.lax.fori_loop(0, t.SUB, tile, zeros)
    for k, c in enumerate(cols * sums):
        part_ref[p, k // len(cols), c] = jnp.sum(acc[k], axis=0)


def norm_backward(x_RD: jax.Array, g_RD: jax.Array, scale_D: jax.Array, stats: RowStats, *, centre: bool,
                  bias: bool, gx_RD: jax.Array | None = None, t: Tiles = Tiles()
                  ) -> tuple[jax.Array, jax.Array]:
    """The input's gradient [R, D] in x's dtype (plus `gx_RD`, the stream's gradient, when given)
    and the parameters' [2 or 1, D] float32: sum(g * xhat) for the scale, sum(g) for the bias.
    `stats`: the forward's (`gpt.ops.norm.row_stats`), each [R] or [R, 1] float32."""
    R, D = x_RD.shape
    t = fit(t, R, D)
    programs, sums = R // (t.BR * t.SUB), 2 if bias else 1
    rstd, shift, mean = (jnp.zeros((R,), F32) if s is None else s.reshape(R) for s in stats)
    kernel = functools.partial(_backward_kernel, t=t, centre=centre, stream=gx_RD is not None, sums=sums)
    out = (jax.ShapeDtypeStruct((R, D), x_RD.dtype), jax.ShapeDtypeStruct((programs, sums, D), F32))
    extra = () if gx_RD is None else (gx_RD,)
    # one stage: the loop's loads feed reductions, which Triton does not pipeline
    dx, part = pl.pallas_call(kernel, grid=(programs,), out_shape=out, interpret=t.interpret,
                              compiler_params=triton_params(t.warps, 1, t.interpret))(
        x_RD, g_RD, scale_D, rstd, shift, mean, *extra)
    return dx, part.sum(0)


Residuals = tuple  # (x, its RowStats, scale, bias or None): what the backward reads


def _norm_fwd(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, centre: bool,
              out_dtype, t: Tiles) -> tuple[jax.Array, Residuals]:
    """XLA's normalisation (`gpt.ops.norm.normalize_rows`) in `out_dtype`, keeping x and its row
    statistics: the kernel recomputes the normalised rows from them."""
    y, _, stats = normalize_rows(x, scale, bias, eps, centre)
    return y.astype(out_dtype), (x, stats, scale, bias)


def _backward(centre: bool, t: Tiles, res: Residuals, g: jax.Array, gx: jax.Array | None
              ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The cotangents of (x, scale, bias) from the norm's `g` and the stream's `gx` (or None)."""
    x, stats, scale, bias = res
    D = x.shape[-1]
    dx, sums = norm_backward(x.reshape(-1, D), g.reshape(-1, D), scale, stats, centre=centre,
                             bias=bias is not None, t=t, gx_RD=None if gx is None else gx.reshape(-1, D))
    dbias = None if bias is None else sums[1].astype(bias.dtype)
    return dx.reshape(x.shape), sums[0].astype(scale.dtype), dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, centre: bool, out_dtype,
         t: Tiles = Tiles()) -> jax.Array:
    """LayerNorm (`centre`) or RMSNorm of x over its last axis, in `out_dtype`; bias [D] or None."""
    return _norm_fwd(x, scale, bias, eps, centre, out_dtype, t)[0]


def _norm_bwd(eps, centre, out_dtype, t, res, g):
    return _backward(centre, t, res, g, None)


norm.defvjp(_norm_fwd, _norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def norm_stream(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, centre: bool, out_dtype,
                t: Tiles = Tiles()) -> tuple[jax.Array, jax.Array]:
    """(x, `norm`(x)): the residual stream as it is and its norm, whose backward adds x's
    gradient through the stream to the norm's in the kernel."""
    return x, _norm_fwd(x, scale, bias, eps, centre, out_dtype, t)[0]


def _stream_fwd(x, scale, bias, eps, centre, out_dtype, t):
    y, res = _norm_fwd(x, scale, bias, eps, centre, out_dtype, t)
    return (x, y), res


def _stream_bwd(eps, centre, out_dtype, t, res, cotangents):
    gx, g = cotangents
    return _backward(centre, t, res, g, gx)


norm_stream.defvjp(_stream_fwd, _stream_bwd)
