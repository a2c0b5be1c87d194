"""gpt.ops.attention: every implementation against the reference, values and gradients; which
kernel the runtime picks; the blocked kernel keeps batch/head sharding."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt.model import GPT, abstract_model
from gpt.ops import attention as A
from gpt.ops.dropout import drop_rate, keep_mask
from gpt.config import ComputeConfig
from gpt.runtime import resolve, training_attention
from helpers import ci_first, run_on_4_cpu_devices, tiny_model_config, tiny_runtime


def qkv(B=2, T=16, H=2, K=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (B, T, H, K)) for k in ks)


# CI: every block size and rate in float32 in the CPU layouts, the GPU/TPU form (cpu_layouts=False)
# and bfloat16 each with and without dropout; `-m slow` the whole product.
BLOCKED_CI = {*itertools.product(["float32"], [0.0, 0.3], [A.ATTENTION_BLOCK, 8, 5], [True]),
              ("float32", 0.0, A.ATTENTION_BLOCK, False), ("float32", 0.3, 5, False),
              ("bfloat16", 0.0, A.ATTENTION_BLOCK, True), ("bfloat16", 0.3, 5, True)}


@pytest.mark.parametrize("dtype,rate,block,cpu_layouts", ci_first(list(itertools.product(
    ["float32", "bfloat16"], [0.0, 0.3], [A.ATTENTION_BLOCK, 8, 5], [True, False])), BLOCKED_CI))
def test_blocked_attention_matches_reference(rate, dtype, block, cpu_layouts):
    """The hand-written backward against autodiff of the reference, with the same dropout mask:
    equal forward, gradients equal up to bf16 rounding; in one query block and in several (the
    causal blocks skipped), including a ragged last block."""
    B, T, H, K = 2, 16, 2, 8
    q, k, v = qkv(B, T, H, K)
    key = jax.random.key(3) if rate else None
    keep = A.attention_keep_masks(key, rate, B, H, T, block)
    full = keep_mask(key, rate, (B, H, T, T))
    for (t0, t1), blk in zip(A.causal_blocks(T, block), keep, strict=True):  # the full mask's blocks
        assert bool(jnp.all(blk == (full[:, :, t0:t1, :t1] if full.ndim else full)))
    dt = jnp.dtype(dtype)
    cast = lambda *a: [x.astype(dt) for x in a]
    y1, vjp1 = jax.vjp(lambda *a: A.attention_blocked(*cast(*a), keep, drop_rate(rate), block,
                                                      cpu_layouts), q, k, v)
    y2, vjp2 = jax.vjp(lambda *a: A.attention_reference(*cast(*a), A.causal_mask(T), rate, key),
                       q, k, v)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), atol=1e-6)
    g = jax.random.normal(jax.random.key(4), y1.shape)
    for a, b in zip(vjp1(g), vjp2(g)):
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert err < (1e-5 if dtype == "float32" else 2e-2), err


def test_fused_xla_matches_reference_with_and_without_mask():
    q, k, v = qkv(2, 8, 4, 16)
    ref = A.attention_reference(q, k, v, A.causal_mask(8))
    np.testing.assert_allclose(np.asarray(A.attention_fused(q, k, v, None, "xla")), np.asarray(ref),
                               atol=1e-5)
    mask = jnp.broadcast_to(A.causal_mask(8), (2, 8, 8)).at[1, :, :3].set(False)  # the cache path
    np.testing.assert_allclose(np.asarray(A.attention_fused(q, k, v, mask, "xla")),
                               np.asarray(A.attention_reference(q, k, v, mask)), atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "cudnn"])  # "xla" takes the reference's path
@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (4, 1)])
def test_cached_attention_reads_the_cache_layout(impl, H, G, monkeypatch):
    """Queries against a cache held [B, G, K, S] (keys) and [B, G, S, K] (values): the reference's
    values over the same keys and values in [B, S, H, K] (each of the G heads repeated for H / G
    query heads), with a mask. "cudnn" goes through the fused op in its layout (run here as XLA's)."""
    B, T, S, K = 2, 3, 10, 8
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k_BSGK, v_BSGK = (jax.random.normal(key, (B, S, G, K)) for key in ks[1:])
    mask = jax.random.bernoulli(jax.random.key(6), 0.7, (B, T, S)).at[:, :, 0].set(True)
    want = A.attention_reference(q, *(jnp.repeat(a, H // G, axis=2) for a in (k_BSGK, v_BSGK)), mask)
    fused = A.attention_fused
    monkeypatch.setattr(A, "attention_fused", lambda q, k, v, m, impl: fused(q, k, v, m, "xla"))
    got = A.cached_attention(q, jnp.transpose(k_BSGK, (0, 2, 3, 1)), jnp.transpose(v_BSGK, (0, 2, 1, 3)),
                             mask, impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "blocked", "xla"])
def test_entry_point_dispatch_equals_reference(impl):
    """`attention` gives the reference's values for every CPU-runnable kernel, with and without a
    mask; with dropout the fused choice yields to the blocked kernel (same mask, same values)."""
    q, k, v = qkv()
    ref = A.attention_reference(q, k, v, A.causal_mask(16))
    np.testing.assert_allclose(np.asarray(A.attention(q, k, v, None, impl, block=8)),
                               np.asarray(ref), atol=1e-5)
    key = jax.random.key(9)
    with_drop = A.attention(q, k, v, None, impl, rate=0.2, key=key, block=8)
    ref_drop = A.attention_reference(q, k, v, A.causal_mask(16), 0.2, key)
    np.testing.assert_allclose(np.asarray(with_drop), np.asarray(ref_drop), atol=1e-5)


def test_runtime_picks_the_kernel_once():
    """auto: the blocked kernel on CPU; cuDNN for bf16 on a GPU (JAX left alone picks XLA, which
    materialises the scores); XLA where cuDNN does not apply; the user's choice otherwise."""
    bf, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert training_attention("auto", f32, 64, "cpu") == "blocked"
    assert training_attention("auto", bf, 64, "gpu") == "cudnn"
    assert training_attention("auto", f32, 64, "gpu") == "xla"
    assert training_attention("auto", bf, 60, "gpu") == "xla"
    assert training_attention("auto", bf, 64, "tpu") == "xla"
    assert training_attention("einsum", bf, 64, "gpu") == "reference"
    rt = resolve(tiny_model_config(n_embd=36, n_head=3), backend="gpu")  # head dim 12
    assert (rt.dtype, rt.attention, rt.cached_attention, rt.cpu_layouts) == (bf, "xla", "xla", False)
    rt = resolve(tiny_model_config(n_embd=128, n_head=2), backend="gpu")
    assert rt.attention == "cudnn"
    rt = resolve(tiny_model_config(), ComputeConfig(attention="einsum"), backend="cpu")
    assert (rt.attention, rt.cached_attention, rt.cpu_layouts) == ("reference", "reference", True)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5),
                                       pytest.param("bfloat16", 5e-2, marks=pytest.mark.slow)])
def test_blocked_attention_is_the_training_path(dtype, tol):
    """A model with dropout trains through `attention_blocked` in either dtype (a reference runtime
    keeps the reference); its loss gradient matches the reference's: to float32 rounding in
    float32, to bf16 accuracy in bfloat16 (with two query blocks; emulated and slow on AVX2)."""
    cfg = tiny_model_config()
    params = nnx.state(GPT(cfg, rngs=nnx.Rngs(0)))
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, 65)

    def loss(p, rt):
        m = nnx.merge(nnx.graphdef(abstract_model(cfg, runtime=rt)), p)  # no init traced
        logits, _ = m(x, dropout_key=jax.random.key(3))
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    rt = lambda dtype, **kw: tiny_runtime(cfg, dropout=0.1, dtype=dtype, attention_block=8, **kw)
    uses = lambda r: "name=attention_blocked" in str(jax.make_jaxpr(loss, static_argnums=1)(params, r))
    assert uses(rt(dtype)) and uses(rt(dtype, attention="xla"))
    assert not uses(rt(dtype, attention="reference"))
    grad = jax.jit(jax.grad(loss), static_argnums=1)  # compiled once each: eager is op by op, slow
    ref = grad(params, rt("float32", attention="reference"))
    for a, b in zip(jax.tree.leaves(grad(params, rt(dtype))), jax.tree.leaves(ref)):
        assert float(jnp.max(jnp.abs(a - b))) / (float(jnp.max(jnp.abs(b))) or 1.0) < tol


def test_model_attention_choices_agree():
    """The whole model gives the same logits with the blocked, XLA and reference kernels."""
    cfg = tiny_model_config()
    params = nnx.state(GPT(cfg, rngs=nnx.Rngs(0)))
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, 65)
    out = {impl: nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0), runtime=tiny_runtime(
        cfg, attention=impl))), params)(x)[0][..., :65] for impl in ("blocked", "xla", "reference")}
    for impl in ("blocked", "xla"):
        np.testing.assert_allclose(np.asarray(out[impl]), np.asarray(out["reference"]), atol=1e-5)


_GATHER_SCRIPT = """
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from gpt.ops.attention import attention_blocked, attention_keep_masks
from gpt.ops.dense import dense
from gpt.ops.dropout import drop_rate
from gpt.sharding import make_mesh
mesh = make_mesh("data:2,tensor:2")
put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
x = put(jnp.ones((4, 8, 16)), "data")
w = put(jnp.ones((16, 3, 2, 8)), None, None, "tensor")  # heads over `tensor`
q = put(jnp.ones((4, 32, 2, 8)), "data", None, "tensor")
keep = attention_keep_masks(jax.random.key(0), 0.1, 4, 2, 32, 8)
gathers = lambda f, *a: jax.jit(f).lower(*a).compile().as_text().count("all-gather(")
out = {}
for cpu in (True, False):
    d = jax.grad(lambda x, w: dense(x, w, "btd,dchk->btchk", jnp.bfloat16, cpu).sum(), (0, 1))
    a = jax.grad(lambda q: attention_blocked(q, q, q, keep, drop_rate(0.1), 8, cpu).sum())
    out[str(cpu)] = {"dense": gathers(d, x, w), "attention": gathers(a, q)}
print(json.dumps(out))
"""


def test_head_sharded_dense_and_attention_do_not_gather():
    """With heads sharded over `tensor`, the GPU/TPU form of `dense` keeps the weight's axes (no
    all-gather of w_qkv), and the blocked attention's transposes keep batch and head sharding in
    either form. (The CPU form of `dense` flattens [D, 3, H, K] and does gather: a CPU-only trade
    for its fast layouts.)"""
    out = run_on_4_cpu_devices(_GATHER_SCRIPT)
    assert out["False"] == {"dense": 0, "attention": 0}, out
    assert out["True"]["attention"] == 0, out
