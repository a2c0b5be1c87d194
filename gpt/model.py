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
- Everything stateful is explicit: dropout takes a key argument and the KV cache is a pytree that goes
  in and comes out. The model holds parameters only, so `nnx.split` gives a pure pytree of arrays.
How each piece is computed on this machine (kernels, dtype, layouts) is `gpt.runtime`'s business,
decided once when the model is built; the kernels live in `gpt/ops/`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gpt import runtime as runtime_lib
from gpt.config import ModelConfig
from gpt.ops.attention import attention
from gpt.ops.dense import dense
from gpt.ops.dropout import dropout
from gpt.runtime import Runtime


class KVCache(NamedTuple):
    """Preallocated keys/values of every layer plus where to write next.

    `index` is the number of slots written (shared by all rows); rows of different prompt lengths are
    left-padded, and `start_B` is each row's first real slot, so padding is never attended to and
    positions count from the row's first real token.
    """
    k_LBSHK: jax.Array
    v_LBSHK: jax.Array
    index: jax.Array  # int32 scalar
    start_B: jax.Array  # int32 [B]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype,
               start_B: jax.Array | None = None) -> KVCache:
    shape = (cfg.n_layer, batch, max_len, cfg.n_head, cfg.head_dim)
    start = jnp.zeros((batch,), jnp.int32) if start_B is None else jnp.asarray(start_B, jnp.int32)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.array(0, jnp.int32), start)


# ----------------------------------------------------------------------------- pure pieces


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = 1e-5) -> jax.Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * scale
    return y + bias if bias is not None else y


def sinusoidal(positions: jax.Array, dim: int) -> jax.Array:
    """The fixed sin/cos position encoding of "Attention Is All You Need", interleaved."""
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)


def cache_positions(cache: KVCache | None, B: int, T: int) -> tuple[jax.Array, jax.Array | None]:
    """Positions [B, T] of this call's tokens, and (with a cache) which slots each query sees
    [B, T, S]: written slots up to its own, from its row's first real token on."""
    if cache is None:
        return jnp.broadcast_to(jnp.arange(T), (B, T)), None
    query_slot_T = cache.index + jnp.arange(T)
    positions_BT = jnp.maximum(query_slot_T[None] - cache.start_B[:, None], 0)
    slot_S = jnp.arange(cache.k_LBSHK.shape[2])
    mask_BTS = (slot_S[None, None, :] <= query_slot_T[None, :, None]) & \
               (slot_S[None, None, :] >= cache.start_B[:, None, None])
    return positions_BT, mask_BTS


def _value(p: nnx.Param | None):
    return None if p is None else p[...]


def _bias(p: nnx.Param | None):
    return 0.0 if p is None else p[...]


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A float32 parameter with its logical axes (`gpt.sharding` maps them onto a mesh). Placement is
    decided by the trainer, so the parameter is created unsharded (no eager sharding)."""
    return nnx.Param(value.astype(jnp.float32), sharding_names=axes, eager_sharding=False)


def _normal(key, shape, std, axes) -> nnx.Param:
    return _param(std * jax.random.normal(key, shape, jnp.float32), axes)


# ----------------------------------------------------------------------------- modules


class Block(nnx.Module):
    """Pre-LayerNorm Transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H, K, F = cfg.n_embd, cfg.n_head, cfg.head_dim, 4 * cfg.n_embd
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        bias = lambda shape, axes: _param(jnp.zeros(shape), axes) if cfg.bias else None
        self.ln1_scale = _param(jnp.ones((D,)), ("embed",))
        self.ln1_bias = bias((D,), ("embed",))
        self.w_qkv = _normal(rngs.params(), (D, 3, H, K), 0.02, ("embed", None, "heads", None))
        self.b_qkv = bias((3, H, K), (None, "heads", None))
        self.w_o = _normal(rngs.params(), (H, K, D), proj_std, ("heads", None, "embed"))
        self.b_o = bias((D,), ("embed",))
        self.ln2_scale = _param(jnp.ones((D,)), ("embed",))
        self.ln2_bias = bias((D,), ("embed",))
        self.w_fc = _normal(rngs.params(), (D, F), 0.02, ("embed", "mlp"))
        self.b_fc = bias((F,), ("mlp",))
        self.w_proj = _normal(rngs.params(), (F, D), proj_std, ("mlp", "embed"))
        self.b_proj = bias((D,), ("embed",))

    def __call__(self, x_BTD, kv, mask_BTS, cache_index, cfg: ModelConfig, rt: Runtime, key):
        """`kv`: this layer's cache (k, v) [B, S, H, K] or None; returns x and the updated kv."""
        keys = jax.random.split(key, 3) if key is not None else (None, None, None)
        mm = lambda x, w, spec: dense(x, w, spec, rt.dtype, rt.cpu_layouts, rt.dense_vjp)

        h_BTD = layer_norm(x_BTD, self.ln1_scale[...], _value(self.ln1_bias))
        qkv_BT3HK = mm(h_BTD, self.w_qkv[...], "btd,dchk->btchk") + _bias(self.b_qkv)
        q_BTHK, k_BTHK, v_BTHK = (qkv_BT3HK[:, :, i].astype(rt.dtype) for i in range(3))
        if kv is None:
            k_BSHK, v_BSHK, impl = k_BTHK, v_BTHK, rt.attention
        else:
            at = (0, cache_index, 0, 0)
            kv = tuple(jax.lax.dynamic_update_slice(c, new.astype(c.dtype), at)
                       for c, new in zip(kv, (k_BTHK, v_BTHK)))
            (k_BSHK, v_BSHK), impl = kv, rt.cached_attention
        y_BTHK = attention(q_BTHK, k_BSHK, v_BSHK, mask_BTS, impl, cpu_layouts=rt.cpu_layouts,
                           rate=rt.dropout, key=keys[0], block=rt.attention_block)
        attn_BTD = mm(y_BTHK, self.w_o[...], "bthk,hkd->btd") + _bias(self.b_o)
        x_BTD = x_BTD + dropout(attn_BTD, rt.dropout, keys[1])

        h_BTD = layer_norm(x_BTD, self.ln2_scale[...], _value(self.ln2_bias))
        h_BTF = jax.nn.gelu(mm(h_BTD, self.w_fc[...], "btd,df->btf") + _bias(self.b_fc),
                            approximate=cfg.activation == "gelu_tanh")
        mlp_BTD = mm(h_BTF, self.w_proj[...], "btf,fd->btd") + _bias(self.b_proj)
        return x_BTD + dropout(mlp_BTD, rt.dropout, keys[2]), kv


def _stack_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """L independently initialised blocks as one Block whose arrays have a leading "layers" axis."""
    @nnx.split_rngs(splits=cfg.n_layer)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)
    return make(rngs)


REMAT_POLICIES = {"block": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, runtime: Runtime | None = None):
        self.cfg = cfg
        self.rt = runtime or runtime_lib.resolve(cfg)
        D = cfg.n_embd
        self.wte = _normal(rngs.params(), (cfg.padded_vocab_size, D), 0.02, ("vocab", "embed"))
        self.wpe = _normal(rngs.params(), (cfg.block_size, D), 0.02, (None, "embed")) \
            if cfg.pos_embedding == "learned" else None
        self.blocks = _stack_blocks(cfg, rngs)
        self.lnf_scale = _param(jnp.ones((D,)), ("embed",))
        self.lnf_bias = _param(jnp.zeros((D,)), ("embed",)) if cfg.bias else None

    def __call__(self, idx_BT: jax.Array, *, cache: KVCache | None = None,
                 dropout_key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        """Logits [B, T, V_padded] in float32 (padded entries are -inf), and the updated cache.

        With a cache, the tokens are written after the `cache.index` slots already filled and attend
        to those slots; without one, attention is causal over `idx_BT` alone.
        """
        cfg = self.cfg
        B, T = idx_BT.shape
        positions_BT, mask_BTS = cache_positions(cache, B, T)
        # The residual stream is float32 whatever dtype the weights are held in.
        x_BTD = self.wte[...][idx_BT].astype(jnp.float32)
        x_BTD = x_BTD + (self.wpe[...][positions_BT] if self.wpe is not None
                         else sinusoidal(positions_BT, cfg.n_embd))
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        x_BTD = dropout(x_BTD, self.rt.dropout, keys[0])
        x_BTD, cache = self._layers(x_BTD, cache, mask_BTS, keys[1])
        x_BTD = layer_norm(x_BTD, self.lnf_scale[...], _value(self.lnf_bias))
        rt = self.rt
        logits_BTV = dense(x_BTD, self.wte[...], "btd,vd->btv", rt.dtype, rt.cpu_layouts, rt.dense_vjp)
        valid_V = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
        return jnp.where(valid_V, logits_BTV, -jnp.inf), cache

    def _layers(self, x_BTD, cache: KVCache | None, mask_BTS, key):
        """The blocks as a scan over the stacked parameters; each layer's cache slices are the
        scan's inputs and outputs (no stacked cache carried through every layer)."""
        cfg, rt = self.cfg, self.rt
        graphdef, state = nnx.split(self.blocks)
        index = None if cache is None else cache.index

        def body(x_BTD, xs):
            layer_state, layer, kv = xs
            layer_key = None if key is None else jax.random.fold_in(key, layer)
            block = nnx.merge(graphdef, layer_state)
            return block(x_BTD, kv, mask_BTS, index, cfg, rt, layer_key)

        if rt.remat in REMAT_POLICIES:
            body = jax.checkpoint(body, policy=REMAT_POLICIES[rt.remat])
        kv_L = None if cache is None else (cache.k_LBSHK, cache.v_LBSHK)
        L = cfg.n_layer
        x_BTD, kv_L = jax.lax.scan(body, x_BTD, (state, jnp.arange(L), kv_L),
                                   unroll=1 if rt.scan_layers else L)
        if cache is not None:
            cache = KVCache(*kv_L, cache.index + x_BTD.shape[1], cache.start_B)
        return x_BTD, cache


# ----------------------------------------------------------------------------- sizes and FLOPs


def num_params(cfg: ModelConfig, *, include_position: bool = True) -> int:
    """Parameter count without vocabulary padding (what transformers reports for GPT-2)."""
    D, L, F = cfg.n_embd, cfg.n_layer, 4 * cfg.n_embd
    b = 1 if cfg.bias else 0
    per_block = (D * 3 * D + b * 3 * D) + (D * D + b * D) + (D * F + b * F) + (F * D + b * D) \
        + 2 * (D + b * D)
    total = cfg.vocab_size * D + L * per_block + (D + b * D)
    if include_position and cfg.pos_embedding == "learned":
        total += cfg.block_size * D
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6N + 12*L*T*D (PaLM, appendix B).

    N excludes the position embeddings and the vocabulary padding; the tied token embedding counts
    once, for the LM head's matmul (nanoGPT's convention). Padding is wasted work, not model work.
    """
    T = seq_len or cfg.block_size
    return 6 * num_params(cfg, include_position=False) + 12 * cfg.n_layer * T * cfg.n_embd


def abstract_model(cfg: ModelConfig, seed: int = 0, runtime: Runtime | None = None) -> GPT:
    """The model with shapes and dtypes only (no memory): its graphdef and parameter shapes."""
    return nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(seed), runtime=runtime))


def abstract_params(m: ModelConfig, shardings=None):
    """Shapes/dtypes of the parameters (no memory), placed on one device or on `shardings`."""
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(m)))
    if shardings is None:
        sd = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sd), shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)
