"""GPT-2 style decoder-only Transformer in Flax NNX: the architecture, read top to bottom.

Axis letters (one convention for the whole repository), as shape suffixes (`x_BTD`): B batch,
T time (queries), S key/cache slots, D width, H heads, K head dim, F MLP width, V (padded)
vocabulary, L layers, A gradient-accumulation micro-batches. A lower-case letter is a block of that
axis (`p_BHtS`: a block of query rows). gpt/ops/dense.py's flattened matmuls add M rows, C contracted
and N output axes. Variables named `m`, `c`, `t` are the Model/Compute/Train configs, never axes.

Two choices shape this file:
- The per-layer parameters are stacked along a leading L axis and the layer loop is a `lax.scan`
  (fully unrolled unless `scan_layers`). One parameter layout serves both the fast-compile scanned
  model and the unrolled one, checkpoints move between them, and sharding has one rule per weight.
  With mixture-of-experts layers (gpt/moe.py) the blocks differ in structure, so there are two
  stacks, `blocks` (dense MLPs) and `moe_blocks` (experts), and the scan runs over groups of
  `moe_every` layers: moe_every - 1 dense blocks, then one MoE block.
- Everything stateful is explicit: dropout takes a key argument and the KV cache is a pytree that goes
  in and comes out. The model holds parameters only, so `nnx.split` gives a pure pytree of arrays.
How each piece is computed on this machine (kernels, dtype, layouts) is `gpt.runtime`'s business,
decided once when the model is built; the kernels live in `gpt/ops/`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt import lora as lora_lib
from gpt import moe as moe_lib
from gpt import runtime as runtime_lib
from gpt.config import ModelConfig
from gpt.ops import decode_kernels as dk
from gpt.ops import gelu_kernel as gelu_lib
from gpt.ops import norm_kernel as norm_lib
from gpt.ops.attention import attention, cached_attention, repeat_kv_heads
from gpt.ops.cross_entropy import LinearCE, cross_entropy, cross_entropy_rows, linear_cross_entropy, mask_padded
from gpt.ops.dense import contract_last, decode_dense, dense
from gpt.ops.dropout import dropout
from gpt.ops.norm import layer_norm, norm_factors, rms_norm
from gpt.runtime import Runtime

INIT_STD = 0.02  # the weights' and embeddings' initial std (GPT-2's)


class KVCache(NamedTuple):
    """Preallocated keys/values of every layer plus where to write next.

    `index` is the number of tokens written so far; token i goes to slot i mod S, so once `index`
    passes S the cache is a ring holding the last S tokens, which is how RoPE models decode past
    block_size (their keys keep their absolute positions). A query attends to at most the last
    block_size tokens, so a cache may hold more slots than that (speculative decoding keeps K spare
    slots, so the K+1 tokens it verifies never overwrite what their first query must still see).
    A scalar `index` is shared by all rows (plain decoding): a call of T > 1 tokens must then not
    wrap (index mod S + T <= S, as in a prefill), as it is written as one slice. An index of shape
    [B] counts each row's own tokens (speculative decoding, where rows accept different numbers of
    tokens; rolling back is lowering it): each row's tokens are scattered to their slots and may wrap.
    Rows of different prompt lengths are left-padded, and `start_B` is each row's first real token,
    so padding is never attended to and positions count from it (a negative start: the row began
    before the cache's first token, as when a window from the middle of a text is recomputed at
    its own positions). Keys are held [L, B, G, K, S] and values [L, B, G, S, K], the layouts the
    two products of attention read in place (`gpt.ops.attention.cached_attention`).
    """
    k_LBGKS: jax.Array  # keys, head dim before slots: the scores' product reads them in place
    v_LBGSK: jax.Array  # values, slots before head dim: the weighted sum reads them in place
    index: jax.Array  # int32: scalar (shared by all rows) or [B] (per row)
    start_B: jax.Array  # int32 [B]

    @property
    def slots(self) -> int:
        return self.v_LBGSK.shape[-2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype,
               start_B: jax.Array | None = None) -> KVCache:
    lead = (cfg.n_layer, batch, cfg.kv_heads)  # GQA: n_kv_head heads
    start = jnp.zeros((batch,), jnp.int32) if start_B is None else jnp.asarray(start_B, jnp.int32)
    return KVCache(jnp.zeros((*lead, cfg.head_dim, max_len), dtype),
                   jnp.zeros((*lead, max_len, cfg.head_dim), dtype), jnp.array(0, jnp.int32), start)


class Normed(NamedTuple):
    """A LayerNorm/RMSNorm output with its 1/std not applied yet (decoding: `Block.norm_in`): the
    norm is z * rstd, plus a bias that `for_decoding` folded into the next product's bias."""
    z_BTD: jax.Array  # the rows centred (RMSNorm: as they are) times the norm's scale, float32
    rstd_BT1: jax.Array


# ----------------------------------------------------------------------------- pure pieces


def dyt(x: jax.Array, alpha: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
    """Dynamic tanh (Zhu et al., 2025), the normalization-free replacement: scale * tanh(alpha x)."""
    y = jnp.tanh(alpha * x.astype(jnp.float32)) * scale
    return y + bias if bias is not None else y


def normalize(x: jax.Array, p: dict, cfg: ModelConfig) -> jax.Array:
    """The block's norm (`cfg.norm`) with parameters `p` = {scale, bias, alpha} (absent ones None)."""
    if cfg.norm == "rmsnorm":
        return rms_norm(x, p["scale"], cfg.norm_eps)
    if cfg.norm == "dyt":
        return dyt(x, p["alpha"], p["scale"], p["bias"])
    return layer_norm(x, p["scale"], p["bias"], cfg.norm_eps)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE's inverse frequencies [K / 2], float32 as `transformers` computes them (a constant of
    the config, computed on the host): theta^(-2i/K), then `cfg.rope_scaling`'s stretch. Llama 3's
    keeps the short wavelengths, divides the long ones by the factor and blends those between."""
    K = cfg.head_dim
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, K, 2, dtype=np.float32) / np.float32(K))))
    inv_freq = inv_freq.astype(np.float32)
    factor = np.float32(cfg.rope_factor)
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling != "llama3":
        return inv_freq
    context, low, high = (np.float32(v) for v in (cfg.rope_original_context, cfg.rope_low_freq_factor,
                                                  cfg.rope_high_freq_factor))
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope(x_BTHK: jax.Array, positions_BT: jax.Array, inv_freq_k: np.ndarray) -> jax.Array:
    """Rotary position embedding in Hugging Face Llama's layout: the head dim's first half is
    rotated against its second half (no interleaving), so imported q/k weights need no permutation."""
    half = x_BTHK.shape[-1] // 2
    angles_BTk = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_k)
    cos, sin = jnp.cos(angles_BTk)[:, :, None], jnp.sin(angles_BTk)[:, :, None]
    x1, x2 = x_BTHK[..., :half].astype(jnp.float32), x_BTHK[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BTHK.dtype)


def sinusoidal(positions: jax.Array, dim: int) -> jax.Array:
    """The fixed sin/cos position encoding of "Attention Is All You Need", interleaved."""
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)


def slot_tokens(last: jax.Array, slots: int) -> jax.Array:
    """The token number each of a ring's `slots` holds once token `last` is written (token i
    goes to slot i mod slots; negative: none yet). `last` may have a leading axis."""
    return last - jnp.mod(last - jnp.arange(slots), slots)


def cache_positions(cache: KVCache | None, B: int, T: int, window: int
                    ) -> tuple[jax.Array, jax.Array | None]:
    """Positions [B, T] of this call's tokens, and (with a cache) which slots each query sees
    [B, T, S]: the slots holding its row's real tokens from the last `window` (at most S) up to its
    own. With a per-row index the token numbers below gain a leading B axis (x: none, or B)."""
    if cache is None:
        return jnp.broadcast_to(jnp.arange(T), (B, T)), None
    S = cache.slots
    window = min(window, S)
    index_x = cache.index if jnp.ndim(cache.index) == 0 else cache.index[:, None]
    query_xT = index_x + jnp.arange(T)  # token numbers of this call's queries
    held_xS = slot_tokens(index_x + T - 1, S)  # the token each slot holds after this write
    positions_BT = jnp.maximum(query_xT - cache.start_B[:, None], 0)
    held_xTS, query_xTS = held_xS[..., None, :], query_xT[..., :, None]
    mask_BTS = (held_xTS <= query_xTS) & (held_xTS > query_xTS - window) & (held_xTS >= 0) & \
               (held_xTS >= cache.start_B[:, None, None])
    return positions_BT, mask_BTS


def write_cache(cache: jax.Array, new_xBTGK: jax.Array, index: jax.Array, slot_axis: int,
                layer: int | None = None) -> jax.Array:
    """`new` (this call's keys or values, any leading axes x) written into the cache's slots from
    `index` on (see KVCache): one slice for a shared index, a per-row scatter (wrapping around the
    ring) for an index of shape [B]. `slot_axis`: -1 for the keys [x, B, G, K, S], -2 for the
    values [x, B, G, S, K]. `layer`: `new` has no layer axis and goes into that layer of a cache
    that has one."""
    S, T = cache.shape[slot_axis], new_xBTGK.shape[-3]
    new_xBTGK = new_xBTGK.astype(cache.dtype)
    if jnp.ndim(index) == 0:
        new = jnp.moveaxis(new_xBTGK, -3, slot_axis)  # [x, B, G, K, T] or [x, B, G, T, K]
        at = [0] * cache.ndim
        at[slot_axis] = index % S
        if layer is not None:
            new, at[0] = new[None], layer
        return jax.lax.dynamic_update_slice(cache, new, tuple(at))
    slots_BT = jnp.mod(index[:, None] + jnp.arange(T), S)
    rows_B1 = jnp.arange(index.shape[0])[:, None]
    lead = () if layer is None else (layer,)
    _ = slice(None)
    at = (*lead, ..., rows_B1, _, _, slots_BT) if slot_axis == -1 else (*lead, ..., rows_B1, _, slots_BT, _)
    # Row and slot indices apart: the indexed axes come first, the update is [B, T, x, G, K].
    return cache.at[at].set(jnp.moveaxis(new_xBTGK, (-4, -3), (0, 1)))


SLOT_AXES = (-1, -2)  # the slot axis of the keys [.., K, S] and of the values [.., S, K]


def _write_kv(cache: KVCache, k_xBTGK: jax.Array, v_xBTGK: jax.Array, layer: int | None = None
              ) -> tuple[jax.Array, jax.Array]:
    return tuple(write_cache(c, new, cache.index, axis, layer)
                 for c, new, axis in zip((cache.k_LBGKS, cache.v_LBGSK), (k_xBTGK, v_xBTGK), SLOT_AXES))


def advance_cache(cache: KVCache, k_LBTGK: jax.Array, v_LBTGK: jax.Array) -> KVCache:
    """The cache with this call's keys/values of every layer written into their slots."""
    k_LBGKS, v_LBGSK = _write_kv(cache, k_LBTGK, v_LBTGK)
    return KVCache(k_LBGKS, v_LBGSK, cache.index + k_LBTGK.shape[2], cache.start_B)


def _write_group_layer(kv_group, j: int, index, written: list, k_BTGK, v_BTGK):
    """A `Block`'s cache_write in the layer scan: layer j of the group's cache slices ([n, B, G, K,
    S] keys, [n, B, G, S, K] values) with this call's keys/values written, for attention; the new
    keys/values are collected in `written` and go into the stacked cache once, after the scan
    (returning each layer's updated slice would copy it every decode step)."""
    written.append(tuple(new.astype(c.dtype) for c, new in zip(kv_group, (k_BTGK, v_BTGK))))
    return tuple(write_cache(c[j], new, index, axis)
                 for c, new, axis in zip(kv_group, written[-1], SLOT_AXES))


def _write_layer(held: list, layer: int, k_BTGK, v_BTGK):
    """A `Block`'s cache_write over unstacked blocks (`for_decoding`): the keys/values are written
    straight into `layer` of the stacked cache held[0] (replaced by the result), and the layer's
    slices read back. Writing first keeps every read after the write it depends on, so XLA updates
    the cache in place; reading the old slices and writing all layers at the end made it copy the
    whole cache twice per decode step."""
    k_LBGKS, v_LBGSK = _write_kv(held[0], k_BTGK, v_BTGK, layer)
    held[0] = held[0]._replace(k_LBGKS=k_LBGKS, v_LBGSK=v_LBGSK)
    return k_LBGKS[layer], v_LBGSK[layer]


def mlp_activation(fc_BTF: jax.Array, b_F: jax.Array | None, cfg: ModelConfig) -> jax.Array:
    """The MLP's activation of its first product plus bias (`_add_bias`): GELU, or SwiGLU's
    silu(gate) * up (fc [B, T, 2, F])."""
    fc_BTF = _add_bias(fc_BTF, b_F)
    if cfg.mlp == "swiglu":
        return jax.nn.silu(fc_BTF[:, :, 0]) * fc_BTF[:, :, 1]
    return jax.nn.gelu(fc_BTF, approximate=cfg.activation == "gelu_tanh")


def gelu_kernel_fits(cfg: ModelConfig) -> bool:
    """Whether gpt/ops/gelu_kernel.py computes this model's MLP activation: GPT-2's tanh GELU of
    fc's product plus a bias, at a width it tiles (`gelu_kernel.fits`)."""
    return cfg.mlp == "gelu" and cfg.activation == "gelu_tanh" and cfg.bias and gelu_lib.fits(cfg.ffn)


def _value(p: nnx.Param | None):
    return None if p is None else p[...]


def _add_bias(y: jax.Array, p: nnx.Param | jax.Array | None) -> jax.Array:
    """y + bias, rounded back to y's dtype: a matmul's bf16 product stays bf16 (as under PyTorch's
    autocast), so what follows it (GELU, SwiGLU) and what autodiff keeps of it are bf16, not
    float32. The sum itself is float32, so the bias gradient (a sum over every row) is too."""
    return y if p is None else (y.astype(jnp.float32) + p[...]).astype(y.dtype)


def _unstack(x: jax.Array, n: int, split: bool) -> list[jax.Array]:
    """x[:, :, i] for i < n (the fused projection's q/k/v axis), by a split or by indexing."""
    if split:
        return [a[:, :, 0] for a in jnp.split(x, n, axis=2)]
    return [x[:, :, i] for i in range(n)]


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A float32 parameter with its logical axes (`gpt.sharding` maps them onto a mesh). Placement is
    decided by the trainer, so the parameter is created unsharded (no eager sharding)."""
    return nnx.Param(value.astype(jnp.float32), sharding_names=axes, eager_sharding=False)


def _normal(key, shape, std, axes) -> nnx.Param:
    return _param(std * jax.random.normal(key, shape, jnp.float32), axes)


# ----------------------------------------------------------------------------- modules


def _norm_params(cfg: ModelConfig) -> tuple[nnx.Param, nnx.Param | None, nnx.Param | None]:
    """(scale, bias, alpha) of one norm: RMSNorm has no bias, only DyT has alpha."""
    D = cfg.n_embd
    bias = _param(jnp.zeros((D,)), ("embed",)) if cfg.bias and cfg.norm != "rmsnorm" else None
    alpha = _param(jnp.full((), dyt_alpha(D)), ()) if cfg.norm == "dyt" else None
    return _param(jnp.ones((D,)), ("embed",)), bias, alpha


def dyt_alpha(D: int) -> float:
    """DyT's initial alpha: 1 / (INIT_STD sqrt(D)), so that tanh(alpha x) starts at the scale a
    norm gives, on a stream whose embeddings are scaled by sqrt(D) (`GPT.embed_scale`), as the DyT
    paper's Llama recipe does; it is 0.78 at D = 4096, where that recipe takes 0.8 before attention.
    The paper's default of 0.5 left the default preset at the unigram loss (BENCHMARKS.md)."""
    return 1.0 / (INIT_STD * D ** 0.5)


def _norm(scale, bias, alpha) -> dict:
    return {"scale": scale[...], "bias": _value(bias), "alpha": _value(alpha)}


def uses_norm_kernel(rt: Runtime, cfg: ModelConfig, cached: bool) -> bool:
    """Whether a norm runs with gpt/ops/norm_kernel.py's backward (`Runtime.norm_kernel`): LayerNorm
    and RMSNorm, not DyT; in training and evaluation, not with a cache (decoding, a few rows a
    step); widths it takes in few chunks (`norm_kernel.fits`); `Block.norm_stream` has its own
    exceptions."""
    return (bool(rt.norm_kernel) and not cached and cfg.norm in ("layernorm", "rmsnorm")
            and norm_lib.fits(cfg.n_embd))


def kernel_norm(x_BTD: jax.Array, scale: nnx.Param, bias: nnx.Param | None, cfg: ModelConfig, rt: Runtime,
                stream: bool) -> "jax.Array | tuple[jax.Array, jax.Array]":
    """The norm of x in the products' dtype with gpt/ops/norm_kernel.py's backward (`Runtime.norm_kernel`):
    `norm_stream`'s (x, norm(x)) when `stream`, else `norm`'s norm(x)."""
    t = norm_lib.Tiles(interpret=rt.norm_kernel == "interpret")
    fn = norm_lib.norm_stream if stream else norm_lib.norm
    return fn(x_BTD, scale[...], _value(bias), cfg.norm_eps, cfg.norm == "layernorm", jnp.dtype(rt.dtype), t)


# The dense weights `Block.linear` multiplies by and their einsum specs (x's axes, the weight's ->
# the product's); `for_decoding` holds them permuted by `contract_last` of these (CPU, GPU).
SPECS = {"w_qkv": "btd,dchk->btchk", "w_q": "btd,dhk->bthk", "w_kv": "btd,dcgk->btcgk",
         "w_o": "bthk,hkd->btd", "w_fc": "btd,df->btf", "w_fc_gated": "btd,dcf->btcf",
         "w_proj": "btf,fd->btd"}


# The weights for_decoding keeps [in, out] for the decoding kernels (`Runtime.decode_kernels`),
# which read them by rows of the input
KERNELS_IN_OUT = ("w_o", "w_proj")


def _matmul(rt: Runtime, out_dtype):
    """x times a weight by einsum spec, as `rt` runs it: `decode_dense` over the [out, in] weights
    that for_decoding holds, else `dense` (with its backward). `name`: the block's weight, one
    of KERNELS_IN_OUT kept [in, out] under the decoding kernels."""
    kept = KERNELS_IN_OUT if rt.decode_kernels else ()

    def mm(x, w, spec, name: str | None = None):
        if rt.decode_layout and name not in kept:
            return decode_dense(x, w, spec, rt.dtype, out_dtype, rt.decode_weights == "rows")
        return dense(x, w, spec, rt.dtype, rt.cpu_layouts, rt.dense_vjp, out_dtype)
    return mm


class Block(nnx.Module):
    """Pre-norm Transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)).

    Multi-head attention (n_kv_head == n_head, GPT-2 included) keeps q, k and v in one fused
    projection w_qkv; grouped-query attention has w_q and a smaller w_kv. The gated (SwiGLU) MLP
    fuses gate and up projections in w_fc [D, 2, F]. With `lora`, the targeted weights also get
    LoRA adapters (gpt/lora.py), applied in `linear`. With `moe`, the MLP is a mixture of experts
    (gpt/moe.py): a router w_router [D, E] and the MLP's weights with a leading expert axis E.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: lora_lib.LoRAConfig | None = None,
                 moe: bool = False):
        D, H, G, K, F = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn
        proj_std = INIT_STD / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        bias = lambda on, shape, axes: _param(jnp.zeros(shape), axes) if on else None
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.ln1_scale, self.ln1_bias, self.ln1_alpha = _norm_params(cfg)
        fused = G == H
        self.w_qkv = _normal(rngs.params(), (D, 3, H, K), INIT_STD, ("embed", None, "heads", None)) \
            if fused else None
        self.b_qkv = bias(fused and qkv_bias, (3, H, K), (None, "heads", None))
        self.w_q = None if fused else _normal(rngs.params(), (D, H, K), INIT_STD, ("embed", "heads", None))
        self.b_q = bias(not fused and qkv_bias, (H, K), ("heads", None))
        self.w_kv = None if fused else \
            _normal(rngs.params(), (D, 2, G, K), INIT_STD, ("embed", None, "kv_heads", None))
        self.b_kv = bias(not fused and qkv_bias, (2, G, K), (None, "kv_heads", None))
        self.q_norm = _param(jnp.ones((K,)), (None,)) if cfg.qk_norm else None
        self.k_norm = _param(jnp.ones((K,)), (None,)) if cfg.qk_norm else None
        self.w_o = _normal(rngs.params(), (H, K, D), proj_std, ("heads", None, "embed"))
        self.b_o = bias(cfg.bias, (D,), ("embed",))
        self.ln2_scale, self.ln2_bias, self.ln2_alpha = _norm_params(cfg)
        # A mixture of experts (gpt/moe.py): a router, and the MLP's weights once per expert.
        E, ex = ((cfg.n_expert,), ("expert",)) if moe else ((), ())
        self.moe = moe
        self.w_router = _normal(rngs.params(), (D, cfg.n_expert), INIT_STD, ("embed", None)) if moe else None
        if cfg.mlp == "swiglu":
            self.w_fc = _normal(rngs.params(), (*E, D, 2, F), INIT_STD, (*ex, "embed", None, "mlp"))
            self.b_fc = bias(cfg.bias, (*E, 2, F), (*ex, None, "mlp"))
        else:
            self.w_fc = _normal(rngs.params(), (*E, D, F), INIT_STD, (*ex, "embed", "mlp"))
            self.b_fc = bias(cfg.bias, (*E, F), (*ex, "mlp"))
        self.w_proj = _normal(rngs.params(), (*E, F, D), proj_std, (*ex, "mlp", "embed"))
        self.b_proj = bias(cfg.bias, (*E, D), (*ex, "embed"))
        self.lora = lora
        if lora is not None:  # drawn after the base weights, which stay those of the plain model
            lora_lib.add_adapters(self, lora, rngs)

    def norm_in(self, x_BTD, which: str, cfg: ModelConfig, rt: Runtime) -> "jax.Array | Normed":
        """The block's norm `which` ("ln1", "ln2") of x. Decoding one row (`rt.decode_layout`, B =
        T = 1) takes a LayerNorm/RMSNorm without a bias (`for_decoding` folded it into the next
        product's) as `Normed` factors, and `linear` applies the 1/std after the product
        (`norm_factors`). More rows are products XLA:GPU runs as GEMMs, which take no fused
        normalisation either way, and there the 1/std became a kernel of its own (kernel counts:
        BENCHMARKS.md); a MoE block's router and experts take the normalised rows too."""
        scale, bias, alpha = (getattr(self, f"{which}_{n}") for n in ("scale", "bias", "alpha"))
        one_row = x_BTD.shape[0] * x_BTD.shape[1] == 1
        if rt.decode_layout and one_row and cfg.norm != "dyt" and bias is None and \
                not (self.moe and which == "ln2"):
            xc_BTD, rstd_BT1 = norm_factors(x_BTD, cfg.norm_eps, cfg.norm == "layernorm")
            return Normed(xc_BTD * scale[...], rstd_BT1)
        return normalize(x_BTD, _norm(scale, bias, alpha), cfg)

    def norm_stream(self, x_BTD: jax.Array, which: str, cfg: ModelConfig, rt: Runtime, cached: bool
                    ) -> tuple[jax.Array, "jax.Array | Normed"]:
        """(x, the block's norm `which` of x). Where `uses_norm_kernel`, the norm's backward is
        gpt/ops/norm_kernel.py's kernel, which adds x's gradient through the residual stream in the
        same pass. Its rows come in the products' dtype (bf16 on a GPU), which is all a single
        product takes of them; where something else reads them too, XLA's float32 rows stay: a
        MoE block's second norm (its router takes them in float32), and a block with LoRA adapters
        (their dropout would scale bf16 rows, and the adapter's and the product's gradients would
        be summed in bf16: further from float32's by about a third, as a review measured). GQA's
        two products (w_q, w_kv) do sum theirs in bf16, measured no further from float32's."""
        if uses_norm_kernel(rt, cfg, cached) and self.lora is None and not (self.moe and which == "ln2"):
            return kernel_norm(x_BTD, getattr(self, f"{which}_scale"), getattr(self, f"{which}_bias"),
                               cfg, rt, stream=True)
        return x_BTD, self.norm_in(x_BTD, which, cfg, rt)

    def linear(self, name: str, x: "jax.Array | Normed", spec: str, mm, key=None):
        """x times the weight `name`, plus its LoRA update if it has an adapter (`key`: the
        adapters' dropout, None when not training). A `Normed` x: its 1/std scales the product's rows."""
        if isinstance(x, Normed):  # decoding, which has no adapters (for_decoding)
            assert self.lora is None, "Normed rows are for for_decoding's layers, which have no adapters"
            y = mm(x.z_BTD, getattr(self, name)[...], spec, name)
            rstd = x.rstd_BT1.reshape(*x.rstd_BT1.shape[:2], *(1,) * (y.ndim - 2))
            return (y * rstd).astype(y.dtype)
        y = mm(x, getattr(self, name)[...], spec, name)
        if self.lora is None or name not in self.lora.targets:
            return y
        a, b = (getattr(self, n)[...] for n in lora_lib.adapter_names(name))
        key = None if key is None else jax.random.fold_in(key, lora_lib.WEIGHTS.index(name))
        return y + lora_lib.update(x, a, b, spec, self.lora, mm, key)

    def qkv(self, h_BTD, positions_BT, cfg: ModelConfig, mm, key=None, split: bool = False):
        """Queries [B, T, H, K] and keys/values [B, T, G, K]: projected, QK-normed, rotated.

        `split` (the CPU's choice): take them apart with a split, whose gradient is one
        concatenation; indexing's is three zero-padded copies summed, which XLA:CPU ran as one
        slow pass of three times the work (8% of a bf16 baby-GPT step). On a GPU the
        indexing compiles to fewer kernels and bytes (BENCHMARKS.md)."""
        if self.w_qkv is not None:
            qkv_BT3HK = _add_bias(self.linear("w_qkv", h_BTD, SPECS["w_qkv"], mm, key), self.b_qkv)
            q_BTHK, k_BTGK, v_BTGK = _unstack(qkv_BT3HK, 3, split)
        else:
            q_BTHK = _add_bias(self.linear("w_q", h_BTD, SPECS["w_q"], mm, key), self.b_q)
            kv_BT2GK = _add_bias(self.linear("w_kv", h_BTD, SPECS["w_kv"], mm, key), self.b_kv)
            k_BTGK, v_BTGK = _unstack(kv_BT2GK, 2, split)
        if cfg.qk_norm:  # per head, before the rotation (Qwen3)
            q_BTHK = rms_norm(q_BTHK, self.q_norm[...], cfg.norm_eps)
            k_BTGK = rms_norm(k_BTGK, self.k_norm[...], cfg.norm_eps)
        if cfg.pos_embedding == "rope":
            inv_freq_k = rope_frequencies(cfg)
            q_BTHK = rope(q_BTHK, positions_BT, inv_freq_k)
            k_BTGK = rope(k_BTGK, positions_BT, inv_freq_k)
        return q_BTHK, k_BTGK, v_BTGK

    def mlp(self, h_BTD, cfg: ModelConfig, mm, key=None, recompute: bool = True, kernel: str = ""):
        """proj(activation(fc(h) + b_fc)) + b_proj. With `recompute` the activation is recomputed
        in the backward pass from fc's product, which is kept anyway, instead of keeping its
        intermediates (GELU's tanh, SiLU's sigmoid): each of those is a [B, T, F] array written in
        the forward pass and read in the backward (on a GPU, GPT-2 at batch 64: 0.8 GB a layer;
        BENCHMARKS.md). Under a remat policy the block is recomputed anyway, and a checkpoint
        inside it would only add a third evaluation, so the caller passes False there. `kernel`
        (`Runtime.gelu_kernel`, training and evaluation only) takes GPT-2's tanh-GELU with its bias,
        forward and backward, as gpt/ops/gelu_kernel.py's kernels, which always recompute it."""
        fc_BTF = self.linear("w_fc", h_BTD, SPECS["w_fc_gated" if cfg.mlp == "swiglu" else "w_fc"], mm, key)
        if kernel and gelu_kernel_fits(cfg):
            tiles = gelu_lib.Tiles(interpret=kernel == "interpret")
            h_BTF = gelu_lib.gelu_bias(fc_BTF, _value(self.b_fc), tiles)
        else:
            act = functools.partial(mlp_activation, cfg=cfg)
            h_BTF = (jax.checkpoint(act) if recompute else act)(fc_BTF, _value(self.b_fc))
        return _add_bias(self.linear("w_proj", h_BTF, SPECS["w_proj"], mm, key), self.b_proj)

    def experts(self, h_BTD, cfg: ModelConfig, rt: Runtime, capacity_factor: float
                ) -> tuple[jax.Array, moe_lib.MoEStats]:
        """The mixture-of-experts MLP (gpt/moe.py) and its routing figures."""
        names = ("w_router", "w_fc", "b_fc", "w_proj", "b_proj")
        p = {n: _value(getattr(self, n)) for n in names}
        return moe_lib.moe_mlp(h_BTD, p, cfg, rt.dtype, capacity_factor, rt.mesh)

    def kernel_params(self, cfg: ModelConfig) -> tuple[dk.AttentionParams, dk.MLPParams]:
        """This decoding layer's arrays as the decoding kernels take them (gpt/ops/decode_kernels.py:
        for_decoding's layouts, w_o and w_proj kept [in, out]); a bias the model lacks as zeros."""
        D, F = cfg.n_embd, cfg.ffn
        layouts = {"w_qkv": (3, cfg.n_head, cfg.head_dim, D), "w_o": (cfg.n_head, cfg.head_dim, D),
                   "w_fc": (F, D), "w_proj": (F, D)}
        for name, shape in layouts.items():  # a reshape of another layout would multiply wrongly
            assert getattr(self, name).shape == shape, (name, getattr(self, name).shape, shape)

        def arr(p: nnx.Param | None, *shape: int) -> jax.Array:
            return jnp.zeros(shape, jnp.float32) if p is None else p[...].reshape(shape)
        attention = dk.AttentionParams(arr(self.ln1_scale, D), arr(self.ln1_bias, D),
                                       arr(self.w_qkv, 3 * D, D), arr(self.b_qkv, 3 * D),
                                       arr(self.w_o, D, D), arr(self.b_o, D))
        mlp = dk.MLPParams(arr(self.ln2_scale, D), arr(self.ln2_bias, D), arr(self.w_fc, F, D),
                           arr(self.b_fc, F), arr(self.w_proj, F, D), arr(self.b_proj, D))
        return attention, mlp

    def __call__(self, x_BTD, cache_write, positions_BT, mask_BTS, cfg: ModelConfig, rt: Runtime,
                 key, capacity_factor: float = 0.0):
        """`cache_write`: None without a cache, else a function that writes this call's keys and
        values [B, T, G, K] into this layer's cache (the caller keeps the cache) and returns what
        the queries attend to, the layer's keys [B, G, K, S] and values [B, G, S, K]. Returns x and a MoE
        block's routing figures (None for a dense block). `capacity_factor`: a MoE block's
        capacity (gpt/moe.py; 0: no token dropped)."""
        keys = jax.random.split(key, 3) if key is not None else (None, None, None)
        lora_key = None if key is None else jax.random.fold_in(key, 3)  # the adapters' dropout
        mm = _matmul(rt, rt.matmul_out)

        x_BTD, h_BTD = self.norm_stream(x_BTD, "ln1", cfg, rt, cache_write is not None)
        q_BTHK, k_BTGK, v_BTGK = (a.astype(rt.dtype)
                                  for a in self.qkv(h_BTD, positions_BT, cfg, mm, lora_key,
                                                    split=rt.cpu_layouts))
        if cache_write is None:
            k_BTHK, v_BTHK = (repeat_kv_heads(a, cfg.n_head) for a in (k_BTGK, v_BTGK))
            y_BTHK = attention(q_BTHK, k_BTHK, v_BTHK, None, rt.attention, cpu_layouts=rt.cpu_layouts,
                               rate=rt.dropout, key=keys[0], block=rt.attention_block)
        else:
            k_BGKS, v_BGSK = cache_write(k_BTGK, v_BTGK)
            y_BTHK = cached_attention(q_BTHK, k_BGKS, v_BGSK, mask_BTS, rt.cached_attention)
        attn_BTD = _add_bias(self.linear("w_o", y_BTHK, SPECS["w_o"], mm, lora_key), self.b_o)
        x_BTD = (x_BTD + dropout(attn_BTD, rt.dropout, keys[1])).astype(x_BTD.dtype)

        x_BTD, h_BTD = self.norm_stream(x_BTD, "ln2", cfg, rt, cache_write is not None)
        if self.moe:
            mlp_BTD, stats = self.experts(h_BTD, cfg, rt, capacity_factor)
        else:
            # a remat policy recomputes the block anyway
            recompute = rt.mlp_recompute and rt.remat not in REMAT_POLICIES
            kernel = rt.gelu_kernel if cache_write is None else ""  # decoding: not timed (a few rows)
            mlp_BTD, stats = self.mlp(h_BTD, cfg, mm, lora_key, recompute, kernel), None
        return (x_BTD + dropout(mlp_BTD, rt.dropout, keys[2])).astype(x_BTD.dtype), stats


def _stack_blocks(cfg: ModelConfig, rngs: nnx.Rngs, lora: lora_lib.LoRAConfig | None = None, *,
                  n: int | None = None, moe: bool = False) -> Block | None:
    """`n` (default n_layer) independently initialised blocks as one Block whose arrays have a
    leading "layers" axis (None if n is 0)."""
    n = cfg.n_layer if n is None else n
    if not n:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs, lora=lora, moe=moe)
    return make(rngs)


def layer_group(cfg: ModelConfig) -> tuple[bool, ...]:
    """Whether each block of the repeating group of layers is a MoE block: (False,) for a dense
    model, (True,) with moe_every=1, (False, True) with moe_every=2, ... (the layer scan runs over
    n_layer / len(group) groups)."""
    return (False,) * (cfg.moe_every - 1) + (True,) if cfg.n_expert else (False,)


REMAT_POLICIES = {"block": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, runtime: Runtime | None = None,
                 lora: lora_lib.LoRAConfig | None = None):
        """`lora`: LoRA adapters (nnx.LoRAParam) on the blocks' targeted weights (gpt/lora.py)."""
        self.cfg = cfg
        self.rt = runtime or runtime_lib.resolve(cfg)
        D = cfg.n_embd
        self.wte = _normal(rngs.params(), (cfg.padded_vocab_size, D), INIT_STD, ("vocab", "embed"))
        self.wpe = _normal(rngs.params(), (cfg.block_size, D), INIT_STD, (None, "embed")) \
            if cfg.pos_embedding == "learned" else None
        n_moe = len(cfg.moe_layers)
        self.blocks = _stack_blocks(cfg, rngs, lora, n=cfg.n_layer - n_moe)  # dense MLPs
        self.moe_blocks = _stack_blocks(cfg, rngs, lora, n=n_moe, moe=True)  # mixtures of experts
        self.lnf_scale, self.lnf_bias, self.lnf_alpha = _norm_params(cfg)
        # DyT normalizes nothing, so its stream starts at the embeddings' scale: a learned scalar,
        # sqrt(D) at first (the DyT paper's Llama recipe), brings it to a norm's (`dyt_alpha`).
        self.embed_scale = _param(jnp.full((), float(D) ** 0.5), ()) if cfg.norm == "dyt" else None
        self.w_head = None if cfg.tie_embeddings else \
            _normal(rngs.params(), (cfg.padded_vocab_size, D), INIT_STD, ("vocab", "embed"))

    def __call__(self, idx_BT: jax.Array, *, cache: KVCache | None = None,
                 dropout_key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        """Logits [B, T, V_padded] (padded entries are -inf), and the updated cache. The logits are
        float32 with a cache and otherwise in `rt.matmul_out` (bf16 on a GPU/TPU computing in bf16).

        With a cache, the tokens are written after the `cache.index` slots already filled and attend
        to those slots; without one, attention is causal over `idx_BT` alone. MoE layers drop no
        token (`forward` takes a capacity factor, for training). A cached call takes no dropout.
        """
        logits_BTV, cache, _ = self.forward(idx_BT, cache=cache, dropout_key=dropout_key)
        return logits_BTV, cache

    def forward(self, idx_BT: jax.Array, *, cache: KVCache | None = None,
                dropout_key: jax.Array | None = None, capacity_factor: float = 0.0, hidden: bool = False
                ) -> tuple[jax.Array, KVCache | None, moe_lib.MoEStats | None]:
        """`__call__`, plus the MoE layers' routing figures (each with a leading axis over the MoE
        layers; None for a dense model). `capacity_factor`: the experts' capacity (gpt/moe.py); 0,
        the default, drops no token. `hidden`: the final norm's output [B, T, D] instead of the
        logits (`loss` applies the head itself)."""
        cfg = self.cfg
        B, T = idx_BT.shape
        if cache is not None and dropout_key is not None and self.rt.dropout > 0:
            raise ValueError("dropout with a KV cache: cached calls are for inference (no dropout_key)")
        if cache is not None and T > cache.slots:
            raise ValueError(f"{T} tokens do not fit a KV cache of {cache.slots} slots")
        if cfg.pos_embedding == "learned" and max(T, cache.slots if cache else 0) > cfg.block_size:
            raise ValueError(f"{T} tokens (a cache of {cache.slots if cache else 0} slots) exceed block_size "
                             f"{cfg.block_size}, the learned position table's length: crop to the last "
                             f"block_size tokens, as gpt.sampling does")
        positions_BT, mask_BTS = cache_positions(cache, B, T, cfg.block_size)
        # The residual stream is float32 whatever dtype the weights are held in, unless the run
        # keeps it in the compute dtype (`Runtime.residual`); the embeddings are summed in float32.
        x_BTD = self.wte[...][idx_BT].astype(jnp.float32)
        if cfg.pos_embedding == "learned":
            x_BTD = x_BTD + self.wpe[...][positions_BT]
        elif cfg.pos_embedding == "sinusoidal":
            x_BTD = x_BTD + sinusoidal(positions_BT, cfg.n_embd)  # rope: inside attention
        if self.embed_scale is not None:
            x_BTD = x_BTD * self.embed_scale[...].astype(jnp.float32)
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        x_BTD = dropout(x_BTD, self.rt.dropout, keys[0]).astype(self.rt.residual)
        x_BTD, cache, stats = self._layers(x_BTD, cache, positions_BT, mask_BTS, keys[1], capacity_factor)
        if uses_norm_kernel(self.rt, cfg, cache is not None):
            x_BTD = kernel_norm(x_BTD, self.lnf_scale, self.lnf_bias, cfg, self.rt, stream=False)
        else:
            x_BTD = normalize(x_BTD, _norm(self.lnf_scale, self.lnf_bias, self.lnf_alpha), cfg)
        if hidden:
            return x_BTD, cache, stats
        return mask_padded(self.logits(x_BTD, cache is not None), cfg.vocab_size), cache, stats

    def logits(self, x_BTD: jax.Array, cached: bool) -> jax.Array:
        """The head's logits of the final norm's output, the padded vocabulary's entries included.
        Decoding (`cached`) writes them in float32: a few rows, no backward to save memory for, and
        greedy picks are not left to bf16 ties."""
        out = jnp.float32 if cached else self.rt.matmul_out
        return _matmul(self.rt, out)(x_BTD, self.head[...], "btd,vd->btv")  # [V, D]: [out, in] already

    @property
    def head(self):
        """The LM head's weight [V, D]: the token embedding's when tied."""
        return self.wte if self.w_head is None else self.w_head

    def loss(self, idx_BT: jax.Array, targets_BT: jax.Array, *, dropout_key: jax.Array | None = None,
             capacity_factor: float = 0.0) -> tuple[jax.Array, moe_lib.MoEStats | None]:
        """(mean next-token cross-entropy against `targets_BT`, the MoE routing figures or None), as
        `forward` then `cross_entropy` give it. In more than one chunk (`Runtime.loss_chunks`, or
        the CPU's auto for a large vocabulary, where it was faster: `gpt.runtime.loss_chunks_for`)
        the head's product is formed inside the loss a slice of T at a time
        (`linear_cross_entropy`): the [B, T, V] logits and their gradient are never whole. In one,
        with `Runtime.xent_kernel`, the whole logits go unmasked to `cross_entropy_rows`, whose
        kernel masks the padded vocabulary and gives the gradient in the forward pass."""
        rt = self.rt
        chunks = runtime_lib.loss_chunks_for(rt.loss_chunks, *idx_BT.shape, self.cfg.padded_vocab_size)
        kw = dict(dropout_key=dropout_key, capacity_factor=capacity_factor)
        if chunks <= 1 and not rt.xent_kernel:
            logits_BTV, _, stats = self.forward(idx_BT, **kw)
            return cross_entropy(logits_BTV, targets_BT, rt.lse_one_pass), stats
        h_BTD, _, stats = self.forward(idx_BT, hidden=True, **kw)
        if chunks <= 1:
            return cross_entropy_rows(self.logits(h_BTD, cached=False), targets_BT, self.cfg.vocab_size,
                                      rt.lse_one_pass, rt.xent_kernel == "interpret"), stats
        s = LinearCE(chunks, self.cfg.vocab_size, rt.dtype, rt.matmul_out, rt.lse_one_pass)
        return linear_cross_entropy(h_BTD, self.head[...], targets_BT, s), stats

    def _layers(self, x_BTD, cache: KVCache | None, positions_BT, mask_BTS, key, capacity_factor: float):
        """The blocks as a scan over groups of layers (`layer_group`: one block for a dense model,
        moe_every - 1 dense blocks and a MoE block otherwise), each group's slices of the stacked
        parameters and of the cache as the scan's inputs and outputs (no stacked cache carried
        through every layer). Returns x, the cache and the MoE layers' stacked routing figures."""
        if isinstance(self.blocks, nnx.List):  # unstacked (`for_decoding`): one module per layer
            return self._layer_loop(x_BTD, cache, positions_BT, mask_BTS, key, capacity_factor)
        cfg, rt = self.cfg, self.rt
        index = None if cache is None else cache.index
        group = layer_group(cfg)
        per_group, n_groups = len(group), cfg.n_layer // len(group)
        stacks = {moe: nnx.split(blocks) for moe, blocks in ((False, self.blocks), (True, self.moe_blocks))
                  if blocks is not None}
        graphdefs = {moe: gd for moe, (gd, _) in stacks.items()}
        # [n, ...] -> [groups, n / groups, ...]: each group's blocks of either kind.
        states = {moe: jax.tree.map(lambda a: a.reshape(n_groups, -1, *a.shape[1:]), st)
                  for moe, (_, st) in stacks.items()}

        def body(x_BTD, xs):
            states, group_index, kv_group = xs
            seen, new_kv, stats = {False: 0, True: 0}, [], None
            for j, moe in enumerate(group):
                layer = group_index * per_group + j
                layer_key = None if key is None else jax.random.fold_in(key, layer)
                block = nnx.merge(graphdefs[moe], jax.tree.map(lambda a: a[seen[moe]], states[moe]))
                seen[moe] += 1
                write = None if kv_group is None else \
                    functools.partial(_write_group_layer, kv_group, j, index, new_kv)
                x_BTD, s = block(x_BTD, write, positions_BT, mask_BTS, cfg, rt, layer_key,
                                 capacity_factor)
                stats = s if moe else stats
            kv_group = None if kv_group is None else tuple(jnp.stack(parts) for parts in zip(*new_kv))
            return x_BTD, (kv_group, stats)

        if rt.remat in REMAT_POLICIES:
            body = jax.checkpoint(body, policy=REMAT_POLICIES[rt.remat])
        kv_groups = None if cache is None else \
            tuple(c.reshape(n_groups, per_group, *c.shape[1:]) for c in (cache.k_LBGKS, cache.v_LBGSK))
        x_BTD, (kv_groups, stats) = jax.lax.scan(body, x_BTD, (states, jnp.arange(n_groups), kv_groups),
                                                 unroll=1 if rt.scan_layers else n_groups)
        if cache is not None:
            cache = advance_cache(cache, *(new.reshape(cfg.n_layer, *new.shape[2:]) for new in kv_groups))
        return x_BTD, cache, stats


    def _layer_loop(self, x_BTD, cache: KVCache | None, positions_BT, mask_BTS, key,
                    capacity_factor: float):
        """`_layers` over unstacked blocks (`for_decoding`): each layer's weights are arrays of
        their own. Returns x, the cache and the MoE layers' stacked routing figures."""
        cfg, rt = self.cfg, self.rt
        if rt.decode_kernels and rt.decode_layout and cache is not None and x_BTD.shape[:2] == (1, 1) \
                and cache.index.ndim == 0 and decode_kernels_problem(cfg) is None:
            return self._kernel_layers(x_BTD, cache)
        held, stats = [cache], []  # the cache as each layer's write leaves it
        for layer, block in enumerate(self.blocks):
            layer_key = None if key is None else jax.random.fold_in(key, layer)
            write = None if cache is None else functools.partial(_write_layer, held, layer)
            x_BTD, s = block(x_BTD, write, positions_BT, mask_BTS, cfg, rt, layer_key, capacity_factor)
            stats += [s] if s is not None else []
        if cache is not None:
            cache = held[0]._replace(index=cache.index + x_BTD.shape[1])
        return x_BTD, cache, (jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None)

    def _kernel_layers(self, x_BTD, cache: KVCache) -> tuple[jax.Array, KVCache, None]:
        """`_layer_loop` for one row's step as the decoding kernels (gpt/ops/decode_kernels.py):
        each layer's attention block, its keys and values written at slot index mod S, attending
        to the tokens `cache_positions` masks in (from the row's start, within the window), then
        its MLP block. The stream between the blocks is float32 (a `Flow`; a bf16 stream,
        `Runtime.residual`, is rounded after the last layer only), and each block adds its
        float32 output where XLA's layers round it to `matmul_out` first: bf16 rounding in other
        places, about as far from float32 (BENCHMARKS.md). The cache's layer, batch and head axes
        are one axis of rows: layer l's heads are rows l H to (l + 1) H."""
        cfg, rt = self.cfg, self.rt
        L, _, H, K, S = cache.k_LBGKS.shape
        k = dk.fit(dk.Kernels(eps=cfg.norm_eps, dtype=jnp.dtype(rt.dtype).name,
                              interpret=rt.decode_kernels == "interpret"), cfg.n_embd, cfg.ffn, K, S)
        k_NKS, v_NSK = cache.k_LBGKS.reshape(L * H, K, S), cache.v_LBGSK.reshape(L * H, S, K)
        lo = jnp.maximum(cache.start_B[0], cache.index - min(cfg.block_size, S) + 1)  # the first token seen
        flow = dk.start_flow(x_BTD.reshape(-1))
        for layer, block in enumerate(self.blocks):
            attention_p, mlp_p = block.kernel_params(cfg)
            flow, k_NKS, v_NSK = dk.attention_block(flow, attention_p, k_NKS, v_NSK, cache.index, lo, k,
                                                    head0=layer * H)
            flow = dk.mlp_block(flow, mlp_p, k)
        cache = cache._replace(k_LBGKS=k_NKS.reshape(cache.k_LBGKS.shape),
                               v_LBGSK=v_NSK.reshape(cache.v_LBGSK.shape), index=cache.index + 1)
        return flow.x.reshape(x_BTD.shape).astype(x_BTD.dtype), cache, None


def decode_kernels_problem(cfg: ModelConfig) -> str | None:
    """Why the decoding kernels (gpt/ops/decode_kernels.py, `Runtime.decode_kernels`) cannot run
    this model's layers, or None. They compute GPT-2's block: LayerNorm, a tanh-GELU MLP and
    multi-head attention (heads a power of two wide, n_embd in all), with learned, sinusoidal or
    no positions (none rotated inside attention, as RoPE's are)."""
    K = cfg.head_dim
    problems = [
        (cfg.norm != "layernorm", f"--norm={cfg.norm}"),
        (cfg.mlp != "gelu" or cfg.activation != "gelu_tanh",
         f"--mlp={cfg.mlp} --activation={cfg.activation}"),
        (cfg.kv_heads != cfg.n_head, f"grouped-query attention (--n_kv_head={cfg.n_kv_head})"),
        (cfg.qk_norm, "--qk_norm"),
        (cfg.pos_embedding == "rope", f"--pos_embedding={cfg.pos_embedding}"),
        (bool(cfg.n_expert), "a mixture of experts"),
        (K & (K - 1) != 0 or K * cfg.n_head != cfg.n_embd,
         f"heads {K} wide ({cfg.n_head} of them, n_embd {cfg.n_embd})"),
        (dk.row_tiles(cfg.n_embd) > dk.MAX_TILES,
         f"n_embd {cfg.n_embd}, read in more than {dk.MAX_TILES} tiles of a power of two"),
    ]
    return next((what for bad, what in problems if bad), None)


def for_decoding(model: GPT) -> GPT:
    """The same model (sharing its arrays) set up for sampling: its blocks held as L modules with
    arrays of their own, and no CPU layouts.

    A layer of the stacked blocks is a slice of [L, ...] arrays, and XLA:CPU copies that slice out
    before each matmul; and the CPU layouts (`gpt.ops.dense`, for the backward pass) transpose the
    [V, D] head into a [D, V] copy per call. Batch-1 decoding only has to read every weight once
    per token, and these copies made a GPT-2 token move the weights about three times (BENCHMARKS.md).
    Here the layer slices are taken once, outside the decoding loop. On CPU and GPU
    (`Runtime.decode_weights`) the dense weights are also held [out, in] (`gpt.ops.dense.decode_dense`):
    on CPU steps of a few rows (a batch, a speculative verify) then stream each weight once; on a
    GPU a one-row product over [in, out] became a column reduction that XLA split into a kernel
    writing the whole weight-sized product and a second one summing it, while over [out, in] it is
    one row reduction that reads the weight once (BENCHMARKS.md).
    """
    if isinstance(model.blocks, nnx.List):
        return model
    group = layer_group(model.cfg)
    stacks = {moe: nnx.split(b) for moe, b in ((False, model.blocks), (True, model.moe_blocks))
              if b is not None}
    taken, layers = {False: 0, True: 0}, []
    for layer in range(model.cfg.n_layer):  # layer l is the next unused block of its kind
        moe = group[layer % len(group)]
        graphdef, state = stacks[moe]
        layers.append(nnx.merge(graphdef, jax.tree.map(lambda a, i=taken[moe]: a[i], state)))
        taken[moe] += 1
    # The dense weights held [out, in] (decode_dense); not with LoRA adapters, whose update shares
    # the weight's spec (sampling merges them into the weights anyway)
    transpose = bool(model.rt.decode_weights) and all(b.lora is None for b in layers)
    if transpose:
        for block in layers:
            _fold_norm_biases(block)
            _hold_out_in(block, KERNELS_IN_OUT if model.rt.decode_kernels else ())
    out = nnx.merge(*nnx.split(model))  # a shallow twin: the other arrays are shared
    # nnx.data: with every block MoE, `blocks` was None (a static attribute) in the model
    out.blocks, out.moe_blocks = nnx.data(nnx.List(layers)), None
    out.rt = dataclasses.replace(out.rt, cpu_layouts=False, decode_layout=transpose)
    return out


def _axes(p: nnx.Param) -> tuple | None:
    """A layer's parameter's sharding names (a slice of the stack: without "layers"), or None."""
    axes = p.get_metadata().get("out_sharding")
    if axes is not None and len(axes) == p.ndim + 1:
        axes = axes[1:]
    return None if axes is None or len(axes) != p.ndim else tuple(axes)


def _replace(block: Block, name: str, value: jax.Array, axes: tuple | None) -> None:
    """Give the decoding layer's `name` a new array (its own Param: the trained one is untouched)."""
    setattr(block, name, nnx.Param(value, sharding_names=axes, eager_sharding=False))


def _spec(block: Block, name: str) -> str:
    """The einsum spec of a block's weight `name` (SwiGLU's w_fc has its own)."""
    return SPECS["w_fc_gated" if name == "w_fc" and getattr(block, name).ndim == 3 else name]


def _fold_norm_biases(block: Block) -> None:
    """Fold each norm's bias into the bias of the products that read the norm (b + bias @ W, in
    float32), and drop it: decoding applies a LayerNorm as `Normed` factors (`Block.norm_in`), so
    norm(x) @ W + b == rstd * ((xc * scale) @ W) + (b + bias @ W). DyT's bias, added after its
    tanh, folds the same way. A MoE block's second norm feeds the router and experts, and keeps
    its bias."""
    for norm, names in (("ln1", ("w_qkv", "w_q", "w_kv")), ("ln2", () if block.moe else ("w_fc",))):
        bias = getattr(block, f"{norm}_bias")
        if bias is None or not names:
            continue
        for name in (n for n in names if getattr(block, n) is not None):
            w, b = getattr(block, name), getattr(block, "b_" + name[2:])
            assert b is not None, "a norm's bias comes with cfg.bias, which gives every product one"
            folded = jnp.einsum(_spec(block, name), bias[...][None, None].astype(jnp.float32),
                                w[...].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)[0, 0]
            _replace(block, "b_" + name[2:], (folded + b[...]).astype(b.dtype), _axes(b))
        setattr(block, f"{norm}_bias", None)


def _hold_out_in(block: Block, keep: tuple[str, ...] = ()) -> None:
    """Replace a decoding layer's dense weights by copies with the contracted axes last, the
    layout `decode_dense` takes (the experts' weights of a MoE block are not `linear`'s: kept;
    so are those named in `keep`)."""
    for name in ("w_qkv", "w_q", "w_kv", "w_o", "w_fc", "w_proj"):
        w = getattr(block, name)
        if w is None or name in keep or (block.moe and name in ("w_fc", "w_proj")):
            continue
        perm, _ = contract_last(_spec(block, name))
        axes = _axes(w)
        axes = None if axes is None else tuple(axes[i] for i in perm)
        _replace(block, name, jnp.transpose(w[...], perm), axes)


# ----------------------------------------------------------------------------- sizes and FLOPs


def num_params(cfg: ModelConfig, *, include_position: bool = True, active: bool = False) -> int:
    """Parameter count without vocabulary padding (what transformers reports). `active`: the
    parameters one token uses: a MoE layer counts its router and n_expert_per_token experts, not
    all n_expert (what FLOPs and MFU are computed on)."""
    D, L, H, G, K, F = cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn
    norm = D * (1 + (cfg.bias and cfg.norm != "rmsnorm")) + (cfg.norm == "dyt")
    qkv_b = (cfg.bias or cfg.qkv_bias) * (H + 2 * G) * K
    attn = D * (H + 2 * G) * K + qkv_b + H * K * D + cfg.bias * D + 2 * K * cfg.qk_norm
    gates = 2 if cfg.mlp == "swiglu" else 1
    mlp = gates * (D * F + cfg.bias * F) + F * D + cfg.bias * D
    n_moe = len(cfg.moe_layers)
    experts = cfg.n_expert_per_token if active else cfg.n_expert
    moe_mlp = D * cfg.n_expert + experts * mlp  # router + experts
    total = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2) + L * (2 * norm + attn) + norm \
        + (L - n_moe) * mlp + n_moe * moe_mlp + (cfg.norm == "dyt")  # DyT's embed_scale
    if include_position and cfg.pos_embedding == "learned":
        total += cfg.block_size * D
    return int(total)


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6N + 12*L*T*H*K (PaLM, appendix B).

    N counts the parameters that take part in matmuls: no position embeddings, no vocabulary
    padding, and the token embedding once, for the LM head (nanoGPT's convention; an untied model's
    input embedding is a lookup). Padding is wasted work, not model work. In a mixture of experts,
    N counts the active parameters only (the router and the n_expert_per_token experts a token
    uses): slots an expert leaves empty below its capacity, and dropped tokens, are not model work
    either (the convention of Switch Transformer and MaxText).
    """
    T = seq_len or cfg.block_size
    n = num_params(cfg, include_position=False, active=True) - \
        (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.n_embd)
    return 6 * n + 12 * cfg.n_layer * T * cfg.n_head * cfg.head_dim


def abstract_model(cfg: ModelConfig, seed: int = 0, runtime: Runtime | None = None,
                   lora: lora_lib.LoRAConfig | None = None) -> GPT:
    """The model with shapes and dtypes only (no memory): its graphdef and parameter shapes."""
    return nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(seed), runtime=runtime, lora=lora))


def abstract_params(m: ModelConfig, shardings=None):
    """Shapes/dtypes of the parameters (no memory), placed on one device or on `shardings`."""
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(m)))
    if shardings is None:
        sd = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sd), shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)
