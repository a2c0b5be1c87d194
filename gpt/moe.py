"""Mixture of experts: a token-choice top-k router over expert MLPs, with a capacity per expert.

The MLP of every `moe_every`-th block (ModelConfig.n_expert, n_expert_per_token, moe_every) is
replaced by `moe_mlp`: a router picks k of E experts for each token, the tokens travel to their
experts, each expert is an MLP of the block's kind (GELU or SwiGLU, ffn wide), and the outputs come
back weighted by the gates. gpt/model.py holds the parameters (`Block`, with an E axis on the expert
weights) and the layer stack; this file holds the math.

Axis letters as in gpt/model.py, plus E experts, X the experts a token is routed to (its top k; K
is the head dim elsewhere), C capacity (an expert's slots for the tokens of one sequence) and
S = E * C, the slots flattened.

Why it is computed this way:
- The router runs in float32 at full matmul precision: the top-k choice is discrete, and the
  softmax and the z-loss need the range.
- Gates are the softmax over all E experts, top k, renormalized over the chosen k (Mixtral,
  DeepSeek), so a token's gates sum to 1. With k = 1 the gate is the raw probability (Switch
  Transformer): renormalized it would always be 1 and the router would learn from the auxiliary
  loss alone.
- A capacity group is one sequence: each row of T tokens has C = ceil(factor * T * k / E) slots per
  expert (at most T). Slots are filled in token order (a token's choices best first), so whether a
  token's choice is kept depends on the tokens before it only: training stays causal. (GShard's
  priority, every first choice before any second choice, would let a later token's first choice
  push out an earlier token's second.) A choice past the capacity is dropped, and a token
  whose every choice is dropped passes through the residual connection only (this layer adds 0).
  A row never spans devices or micro-batches, so which tokens drop does not depend on the mesh or on
  gradient accumulation. Capacity factor 0 means C = T: nothing can drop. Evaluation and sampling
  always run so (a token's output then depends on itself alone, which is what lets cached decoding
  equal a full forward); only the training forward pass takes --expert_capacity_factor.
- Dispatch by index, not by one-hot einsums: a cumulative sum gives each choice its slot, the tokens
  are gathered into [B, E, C, D] and the experts' outputs gathered back per token. One-hot dispatch
  and combine einsums cost 2 B T E C D FLOPs each, quadratic in T in the no-drop mode; gathers move
  bytes only (their gradients are scatter-adds onto distinct rows).
- Expert parallelism: the expert weights' E axis lies on the mesh axis `expert`, and batch rows are
  sharded over data x fsdp x expert. The dispatched tokens are constrained to E on `expert` (rows on
  data x fsdp), so XLA moves them with an all-to-all over the expert axis, and the outputs come back
  to the rows' devices the same way. The tokens travel in the compute dtype.
- Auxiliary losses (gpt/train.py adds them to the training objective, averaged over the MoE layers):
  Switch Transformer's load-balancing loss E * sum_e f_e P_e (f_e: the share of the token choices that
  picked expert e, before capacity; P_e: e's mean router probability), which is 1 for perfectly
  uniform routing, and ST-MoE's router z-loss mean(logsumexp(router logits)^2).
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from gpt.config import ModelConfig
from gpt.ops.dense import dense_reference
from gpt.sharding import BATCH_AXES

# Where the tokens are while the experts compute, and where they live otherwise (gpt/sharding.py's
# mesh axes; batch rows span data x fsdp x expert).
EXPERT_LAYOUT = P("expert", ("data", "fsdp"), None, None)  # [E, B, C, D]
TOKEN_LAYOUT = P(BATCH_AXES, None, None, None)  # [B, E, C, D]
ROW_LAYOUT = P(BATCH_AXES, None, None)  # [B, T, D]: whole rows, whole vectors (the gathers stay local)


@dataclasses.dataclass(frozen=True)
class MoETraining:
    """What the training step does with MoE layers (TrainConfig's flags of the same names)."""
    capacity_factor: float = 1.25  # 0: no limit (what every other forward pass uses)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001


class MoEStats(NamedTuple):
    """One MoE layer's routing figures (the model stacks them over its MoE layers)."""
    aux_loss: jax.Array  # load-balancing loss, 1.0 for uniform routing
    z_loss: jax.Array  # mean squared logsumexp of the router logits
    dropped: jax.Array  # share of the token choices over capacity
    load_E: jax.Array  # share of the token choices that picked each expert (sums to 1)


# ----------------------------------------------------------------------------- routing


def router_logits(h_BTD: jax.Array, w_router_DE: jax.Array) -> jax.Array:
    """Router logits in float32 at full precision (GPUs would otherwise round to TF32)."""
    return jnp.einsum("btd,de->bte", h_BTD.astype(jnp.float32), w_router_DE.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def top_k_gates(logits_BTE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(gates [B, T, X], experts [B, T, X]): each token's k most probable experts, best first
    (ties: the lower index), and their probabilities renormalized over the k (k = 1: the raw
    probability, as Switch Transformer)."""
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    gates_BTX, experts_BTX = jax.lax.top_k(probs_BTE, k)
    if k > 1:
        gates_BTX = gates_BTX / jnp.sum(gates_BTX, axis=-1, keepdims=True)
    return gates_BTX, experts_BTX.astype(jnp.int32)


def capacity(T: int, k: int, n_expert: int, factor: float) -> int:
    """An expert's slots for one sequence of T tokens: ceil(factor * T * k / E), between 1 and T
    (an expert takes a token at most once); factor 0: T, so no token is ever dropped."""
    if factor == 0:
        return T
    exact = Fraction(repr(factor)) * T * k / n_expert  # 1.1 * 100 * 1 / 10 is 11, not 11.000000000000002
    return max(1, min(T, math.ceil(exact)))


def assign_slots(experts_BTX: jax.Array, n_expert: int, C: int) -> tuple[jax.Array, jax.Array]:
    """(slot [B, T, X], kept [B, T, X]): the slot each token choice takes in its expert, in token
    order (a token's choices best first; causal), and whether it is within the capacity C."""
    B, T, X = experts_BTX.shape
    onehot_BTXE = jax.nn.one_hot(experts_BTX, n_expert, dtype=jnp.int32)
    taken_BTXE = jnp.cumsum(onehot_BTXE.reshape(B, T * X, n_expert), axis=1).reshape(B, T, X, n_expert)
    slot_BTX = jnp.sum((taken_BTXE - 1) * onehot_BTXE, axis=-1)
    return slot_BTX, slot_BTX < C


def slot_index(experts_BTX: jax.Array, slot_BTX: jax.Array, kept_BTX: jax.Array, C: int,
               n_expert: int) -> jax.Array:
    """Each token choice's place among the S = E * C flattened slots; S (past the end) if dropped."""
    return jnp.where(kept_BTX, experts_BTX * C + slot_BTX, n_expert * C)


# ----------------------------------------------------------------------------- dispatch and combine


def dispatch(x_BTD: jax.Array, index_BTX: jax.Array, n_expert: int, C: int) -> jax.Array:
    """The tokens in their experts' slots [B, E, C, D] (empty slots hold zeros): per row, the
    token of each slot is scattered from `index` (dropped choices fall off the end), then gathered."""
    B, T, D = x_BTD.shape
    S = n_expert * C
    token_TX = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], index_BTX.shape[1:])

    def row(x_TD, index_TX):
        token_S = jnp.full((S,), T, jnp.int32).at[index_TX.reshape(-1)].set(token_TX.reshape(-1), mode="drop")
        return jnp.take(x_TD, token_S, axis=0, mode="fill", fill_value=0)
    return jax.vmap(row)(x_BTD, index_BTX).reshape(B, n_expert, C, D)


def combine(y_BECD: jax.Array, index_BTX: jax.Array, gates_BTX: jax.Array) -> jax.Array:
    """Each token's expert outputs weighted by its gates, in float32 [B, T, D]; a dropped choice
    adds nothing (its index is past the slots, which reads as zeros)."""
    B, E, C, D = y_BECD.shape
    take = lambda y_SD, index_TX: jnp.take(y_SD, index_TX, axis=0, mode="fill", fill_value=0)  # noqa: E731
    picked_BTXD = jax.vmap(take)(y_BECD.reshape(B, E * C, D), index_BTX)
    return jnp.einsum("btxd,btx->btd", picked_BTXD.astype(jnp.float32), gates_BTX)


def expert_mlp(x_EBCD: jax.Array, p: dict, cfg: ModelConfig, dtype) -> jax.Array:
    """Every expert's MLP on its slots, batched over E (the block's GELU or SwiGLU MLP, with an E
    axis on each weight): matmuls in `dtype` with float32 accumulation. E leads, as the batch axis
    of a batched matmul does (another order costs transposes, and on a mesh reshardings)."""
    mm = lambda x, w, spec: dense_reference(x, w, spec, dtype)  # noqa: E731
    if cfg.mlp == "swiglu":
        gu_EBC2F = mm(x_EBCD, p["w_fc"], "ebcd,edgf->ebcgf") + _bias(p.get("b_fc"))
        h_EBCF = jax.nn.silu(gu_EBC2F[..., 0, :]) * gu_EBC2F[..., 1, :]
    else:
        h_EBCF = jax.nn.gelu(mm(x_EBCD, p["w_fc"], "ebcd,edf->ebcf") + _bias(p.get("b_fc")),
                             approximate=cfg.activation == "gelu_tanh")
    return mm(h_EBCF, p["w_proj"], "ebcf,efd->ebcd") + _bias(p.get("b_proj"))


def _bias(b_E: jax.Array | None):
    """An expert bias [E, ...] broadcast over [E, B, C, ...] (0 without biases)."""
    return 0.0 if b_E is None else b_E[:, None, None]


# ----------------------------------------------------------------------------- losses and the layer


def load_balancing_loss(probs_BTE: jax.Array, experts_BTX: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(Switch Transformer's E * sum_e f_e P_e, the load f [E]): f_e the share of all token choices
    that picked e (sums to 1, no gradient), P_e the mean router probability of e. Uniform routing
    gives 1 (f_e = P_e = 1 / E); all tokens on one expert gives E."""
    E = probs_BTE.shape[-1]
    load_E = jnp.mean(jax.nn.one_hot(experts_BTX, E, dtype=jnp.float32), axis=(0, 1, 2))
    importance_E = jnp.mean(probs_BTE, axis=(0, 1))
    return E * jnp.sum(load_E * importance_E), load_E


def z_loss(logits_BTE: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: keeps the router logits small (and their softmax stable)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))


def constrain(x: jax.Array, mesh, spec: P) -> jax.Array:
    """x laid out as `spec` on the training mesh (None: one device, or outside training: as is)."""
    return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def moe_mlp(h_BTD: jax.Array, p: dict, cfg: ModelConfig, dtype, capacity_factor: float = 0.0,
            mesh=None) -> tuple[jax.Array, MoEStats]:
    """The MoE layer: (output [B, T, D] in float32, the routing figures). `p` holds the router
    w_router [D, E] and the experts' w_fc, b_fc, w_proj, b_proj with a leading E axis (biases may
    be None); `capacity_factor` 0: no token dropped; `mesh`: the training mesh (expert parallelism)."""
    E, k = cfg.n_expert, cfg.n_expert_per_token
    h_BTD = constrain(h_BTD, mesh, ROW_LAYOUT)
    logits_BTE = router_logits(h_BTD, p["w_router"])
    gates_BTX, experts_BTX = top_k_gates(logits_BTE, k)
    C = capacity(h_BTD.shape[1], k, E, capacity_factor)
    slot_BTX, kept_BTX = assign_slots(experts_BTX, E, C)
    index_BTX = slot_index(experts_BTX, slot_BTX, kept_BTX, C, E)
    x_BECD = dispatch(h_BTD.astype(dtype), index_BTX, E, C)
    x_EBCD = constrain(jnp.swapaxes(x_BECD, 0, 1), mesh, EXPERT_LAYOUT)
    # Both ends constrained, so that the backward pass's cotangents make the same two trips.
    y_EBCD = constrain(expert_mlp(x_EBCD, p, cfg, dtype).astype(dtype), mesh, EXPERT_LAYOUT)
    y_BECD = constrain(jnp.swapaxes(y_EBCD, 0, 1), mesh, TOKEN_LAYOUT)
    aux, load_E = load_balancing_loss(jax.nn.softmax(logits_BTE, axis=-1), experts_BTX)
    # The mean of the dropped choices, not 1 - the kept share: mean(ones) rounds to 1 +- 6e-8 at
    # some sizes, which logged a nonzero (or negative) share when nothing can drop.
    stats = MoEStats(aux, z_loss(logits_BTE), jnp.mean((~kept_BTX).astype(jnp.float32)), load_E)
    return combine(y_BECD, index_BTX, gates_BTX), stats
