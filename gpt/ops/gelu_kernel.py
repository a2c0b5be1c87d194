"""GPT-2's MLP activation, tanh-GELU of fc's product plus its bias, and its backward as Pallas
(Triton) kernels over [rows, F] tiles.

In the H200's profile of GPT-2's training step (batch 64 x 1024, BENCHMARKS.md) XLA's fusions for
them were 11.6 ms of a 126.6 ms step: the forward (bias and GELU after fc's GEMM, 0.81 GB a layer)
at 2.3 TB/s, the backward (GELU's derivative recomputed from fc's product, times the incoming
gradient, with the bias gradient as a column reduction in the same fusion, 1.21 GB a layer) at
1.9 TB/s, where a copy reaches about 3.3. Here each program takes a [BR, BF] tile: the forward
writes the activation, the backward the gradient and its tile's column sums, which XLA adds up
([R / BR, F] float32, small). Both compute in float32 and round once, where XLA's fusion rounds the
biased product to bf16 before the GELU; tanh is taken from one exp.

`gelu_bias` is the differentiable function (a custom VJP keeping fc's product and the bias: the
activation is recomputed in the backward, as `Block.mlp`'s checkpoint does).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gpt.ops.pallas_util import pow2_divisor, triton_params

F32 = jnp.float32
GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715


class Tiles(NamedTuple):
    """A kernel's static choices: the largest power-of-two tile within (BR, BF) that divides the
    array (`fit`), Triton's warps a program, Pallas's interpreter off a GPU."""
    BR: int = 32  # rows a tile: the bias's partial sums are [R / BR, F] float32 (GPT-2, batch 64: 25 MB)
    BF: int = 256
    warps: int = 8  # 32 entries a thread; 64 registers (ptxas, H200), no spills
    interpret: bool = False


# The narrowest tile the MLP's width may take (tiles must divide it): a width with fewer factors of
# two would run many programs of a few entries each, so it keeps XLA's fusion (`fits`)
MIN_BF = 64


def fits(F: int) -> bool:
    """Whether an MLP F wide takes tiles at least MIN_BF columns wide."""
    return pow2_divisor(F, Tiles().BF) >= MIN_BF


def fit(t: Tiles, R: int, F: int) -> Tiles:
    """`t` with its tile shrunk to divide [R, F]: no tile runs past the array, so nothing is masked."""
    return t._replace(BR=pow2_divisor(R, t.BR), BF=pow2_divisor(F, t.BF))


def _tanh(u: jax.Array) -> jax.Array:
    """tanh(u) = 1 - 2 / (exp(2u) + 1): one exp and a division, saturating to -1 and 1 (exp's
    overflow to inf gives 1 exactly)."""
    return 1.0 - 2.0 / (jnp.exp(2.0 * u) + 1.0)


def _biased(fc_ref, b_ref) -> tuple[jax.Array, jax.Array]:
    """The tile's fc product plus bias in float32, and tanh of GELU's inner polynomial."""
    a = fc_ref[...].astype(F32) + b_ref[...].astype(F32)[None, :]
    return a, _tanh(GELU_C * (a + GELU_K * a * a * a))


def _forward_kernel(fc_ref, b_ref, out_ref):
    """The tile's gelu_tanh(fc + b), rounded once to the output's dtype."""
    a, t = _biased(fc_ref, b_ref)
    out_ref[...] = (0.5 * a * (1.0 + t)).astype(out_ref.dtype)


def _backward_kernel(fc_ref, b_ref, g_ref, d_ref, db_ref):
    """d = g * GELU'(a), and the tile's column sums of it (float32) as row i of the bias's partial
    gradients."""
    a, t = _biased(fc_ref, b_ref)
    slope = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_K * a * a)
    d = g_ref[...].astype(F32) * slope
    d_ref[...] = d.astype(d_ref.dtype)
    db_ref[...] = jnp.sum(d, axis=0, keepdims=True)


def _tile(t: Tiles) -> pl.BlockSpec:
    """Program (i, j)'s [BR, BF] tile of an [R, F] array."""
    return pl.BlockSpec((t.BR, t.BF), lambda i, j: (i, j))


def _bias(t: Tiles) -> pl.BlockSpec:
    """Program (i, j)'s BF entries of the bias."""
    return pl.BlockSpec((t.BF,), lambda i, j: (j,))


def _call(kernel, t: Tiles, R: int, F: int, in_specs: list, out_specs: list, out_shape: list):
    """pallas_call over the (R / BR, F / BF) tiles, Triton's warps on a GPU (one stage: a tile is
    one load, nothing to pipeline)."""
    return pl.pallas_call(kernel, grid=(R // t.BR, F // t.BF), in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=t.interpret,
                          compiler_params=triton_params(t.warps, 1, t.interpret))


def gelu_forward(fc_RF: jax.Array, b_F: jax.Array, t: Tiles = Tiles()) -> jax.Array:
    """gelu_tanh(fc + b) in fc's dtype [R, F]."""
    R, F = fc_RF.shape
    t = fit(t, R, F)
    out = [jax.ShapeDtypeStruct((R, F), fc_RF.dtype)]
    return _call(_forward_kernel, t, R, F, [_tile(t), _bias(t)], [_tile(t)], out)(fc_RF, b_F)[0]


def gelu_backward(fc_RF: jax.Array, b_F: jax.Array, g_RF: jax.Array, t: Tiles = Tiles()
                  ) -> tuple[jax.Array, jax.Array]:
    """The gradients of sum(g * gelu_tanh(fc + b)): for fc [R, F] in fc's dtype, for b [F] float32."""
    R, F = fc_RF.shape
    t = fit(t, R, F)
    out = [jax.ShapeDtypeStruct((R, F), fc_RF.dtype), jax.ShapeDtypeStruct((R // t.BR, F), F32)]
    partial_spec = pl.BlockSpec((1, t.BF), lambda i, j: (i, j))  # tile (i, j)'s column sums
    d_RF, db_PF = _call(_backward_kernel, t, R, F, [_tile(t), _bias(t), _tile(t)], [_tile(t), partial_spec],
                        out)(fc_RF, b_F, g_RF)
    return d_RF, db_PF.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gelu_bias(fc_BTF: jax.Array, b_F: jax.Array, t: Tiles = Tiles()) -> jax.Array:
    """gelu_tanh(fc + b) over [..., F] in fc's dtype, differentiable in both (Triton kernels, or
    Pallas's interpreter with t.interpret)."""
    return gelu_forward(fc_BTF.reshape(-1, fc_BTF.shape[-1]), b_F, t).reshape(fc_BTF.shape)


def _gelu_bias_fwd(fc_BTF, b_F, t):
    """The activation, keeping only its inputs: the backward recomputes the rest in its kernel."""
    return gelu_bias(fc_BTF, b_F, t), (fc_BTF, b_F)


def _gelu_bias_bwd(t, res, g_BTF):
    """fc's gradient in its dtype, the bias's summed in float32 and cast to its own."""
    fc_BTF, b_F = res
    F = fc_BTF.shape[-1]
    d_RF, db_F = gelu_backward(fc_BTF.reshape(-1, F), b_F, g_BTF.reshape(-1, F), t)
    return d_RF.reshape(fc_BTF.shape), db_F.astype(b_F.dtype)


gelu_bias.defvjp(_gelu_bias_fwd, _gelu_bias_bwd)
