"""GPU checks (`python -m pytest -m gpu`, run by bench/gpu.py on a machine with a GPU).

On CPU they are deselected by default and skipped when selected: each compares a GPU-only path
(cuDNN attention, bf16 training, cached decoding under GPU numerics) with its reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_gpt, tiny_model_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_cudnn_attention_matches_reference_values_and_gradients():
    """cuDNN flash attention (bf16) against the float32 einsum reference, forward and backward."""
    from gpt.ops.attention import attention_fused, attention_reference as attention_einsum, causal_mask
    B, T, H, K = 2, 256, 4, 64
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(x, (B, T, H, K), jnp.float32) for x in (kq, kk, kv))
    g = jax.random.normal(kg, (B, T, H, K), jnp.float32)

    def cudnn(q, k, v):
        bf = lambda a: a.astype(jnp.bfloat16)
        return jnp.sum(attention_fused(bf(q), bf(k), bf(v), None, "cudnn") * g)

    def ref(q, k, v):
        with jax.default_matmul_precision("highest"):
            return jnp.sum(attention_einsum(q, k, v, causal_mask(T)) * g)

    out_c = attention_fused(*(a.astype(jnp.bfloat16) for a in (q, k, v)), None, "cudnn")
    with jax.default_matmul_precision("highest"):
        out_r = attention_einsum(q, k, v, causal_mask(T))
    assert _rel(out_c, out_r) < 1e-2
    for gc, gr in zip(jax.grad(cudnn, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
        assert _rel(gc, gr) < 2e-2


def test_model_logits_cudnn_equal_einsum():
    """The whole model with --attention=cudnn against the einsum reference, both in bf16."""
    idx = jax.random.randint(jax.random.key(1), (2, 128), 0, 65)
    logits = {}
    cfg = tiny_model_config(block_size=128, n_embd=256, n_head=4)
    for attn in ("cudnn", "reference"):
        logits[attn] = tiny_gpt(cfg, dtype="bfloat16", attention=attn)(idx)[0][..., :65]
    assert _rel(logits["cudnn"], logits["reference"]) < 1e-2


def _gpu_defaults(cfg) -> dict:
    """The training kernels `gpt.runtime.resolve` turns on for `cfg` on this GPU, which `tiny_gpt`
    leaves out unless named: a check of the GPU's default step must name them."""
    from gpt.runtime import TRAINING_KERNELS, resolve
    rt = resolve(cfg)
    return {k: getattr(rt, k) for k in TRAINING_KERNELS}


def test_bf16_training_tracks_float32():
    """30 steps of the real train step in bf16 (the residual stream in float32, and in bf16 with
    --residual_dtype=compute) and in float32 from the same init and batches, with the GPU's default
    training kernels: the losses agree to within bf16's rounding and all fall."""
    from gpt.config import TrainConfig
    from gpt.train import make_optimizer, make_train_step
    t = TrainConfig(learning_rate=3e-3, min_lr=3e-4, warmup_iters=5, max_iters=30)
    rng = np.random.default_rng(0)
    # A learnable stream: each row counts up from a random start, so the loss can fall far.
    starts = rng.integers(0, 65, (30, 1, 8, 1))
    x = jnp.asarray((starts + np.arange(65)[None, None, None, :64]) % 65, jnp.int32)
    y = jnp.asarray((starts + 1 + np.arange(65)[None, None, None, :64]) % 65, jnp.int32)
    losses = {}
    for dtype, residual in (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "compute")):
        cfg = tiny_model_config(block_size=64, n_embd=128, n_head=4)
        gd, params = nnx.split(tiny_gpt(cfg, dtype=dtype, residual_dtype=residual, **_gpu_defaults(cfg)))
        params = nnx.to_pure_dict(params)
        tx = make_optimizer(t)
        opt = tx.init(params)
        step_fn = jax.jit(make_train_step(gd, tx, 0, train_mode=False))
        out, step = [], jnp.asarray(0, jnp.int32)
        for i in range(30):
            params, opt, step, met = step_fn(params, opt, step, x[i], y[i])
            out.append(float(met["loss"]))
        losses[dtype, residual] = np.array(out)
    f32 = losses.pop(("float32", "float32"))
    assert f32[-1] < 0.5 * f32[0]
    for bf16 in losses.values():
        assert bf16[-1] < 0.5 * bf16[0]
        assert np.max(np.abs(f32 - bf16) / f32) < 0.05, (f32, bf16)


def test_cached_greedy_equals_full_recompute_on_gpu():
    """KV-cached greedy decoding == re-running the whole context per token, on the GPU in float32
    at full matmul precision (TF32 would round the two paths differently)."""
    from bench.nocache import full_recompute_generate
    from gpt.sampling import SamplingSettings, Sampler
    model = tiny_gpt(tiny_model_config(block_size=96), 3)
    s = SamplingSettings(max_new_tokens=64, temperature=0.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 65, size=n).tolist() for n in (1, 5, 17)]
    with jax.default_matmul_precision("highest"):
        got = Sampler(model, s, chunk=16).generate(prompts, jax.random.key(0))
        for p, row in zip(prompts, got):
            assert row == full_recompute_generate(model, p, jax.random.key(0), s)


def test_cached_bf16_logits_match_full_forward_on_gpu():
    """bf16 cached decoding step by step against one bf16 full forward of the same tokens."""
    from gpt.model import init_cache
    model = tiny_gpt(tiny_model_config(block_size=64, n_embd=128, n_head=4), 4, dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, 65)
    full, _ = model(tokens)
    logits, cache = model(tokens[:, :8], cache=init_cache(model.cfg, 2, 64, model.rt.dtype))
    steps = [logits[:, -1]]
    for t in range(8, 39):
        logits, cache = model(tokens[:, t:t + 1], cache=cache)
        steps.append(logits[:, -1])
    assert _rel(jnp.stack(steps, 1)[..., :65], full[:, 7:-1, :65]) < 2e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernels_on_gpu(dtype):
    """sample.py --decode_kernels's Triton kernels (gpt/ops/decode_kernels.py) on the GPU: in float32
    one row's greedy tokens are the full recompute's (before block_size and past it); in bf16 their
    logits are as near float32's as XLA's bf16 layers are (the kernels round where they do)."""
    from flax import nnx

    from bench.nocache import full_recompute_generate
    from gpt.model import abstract_model
    from gpt.sampling import SamplingSettings, Sampler
    from helpers import random_params, tiny_runtime
    cfg = tiny_model_config(block_size=48, n_embd=128, n_head=4)
    std = {"wte": 1.0, "wpe": 1.0, "w_qkv": 0.5, "w_fc": 0.5, "w_o": 0.3, "w_proj": 0.3}
    params = random_params(cfg, seed=7, std=std)
    make = lambda kernels, dt: nnx.merge(nnx.graphdef(abstract_model(  # noqa: E731
        cfg, runtime=tiny_runtime(cfg, dtype=dt, decode_kernels=kernels))), params)
    with jax.default_matmul_precision("highest"):
        if dtype == "float32":
            s = SamplingSettings(max_new_tokens=64, temperature=0.0)
            for n in (1, 5, 17):
                prompt = np.random.default_rng(n).integers(0, 65, size=n).tolist()
                got = Sampler(make("triton", dtype), s, chunk=16).generate([prompt], jax.random.key(0))[0]
                assert got == full_recompute_generate(make("", dtype), prompt, jax.random.key(0), s)
            return
        s = SamplingSettings(max_new_tokens=24, temperature=0.0)
        last = {}
        for kernels, dt in (("", "float32"), ("", dtype), ("triton", dtype)):
            sampler = Sampler(make(kernels, dt), s, chunk=8)
            state = next(sampler.chunks(sampler.start([[1, 2, 3, 4, 5]], jax.random.key(0))))  # 8 steps
            last[kernels, dt] = np.asarray(state.next_logits_BV)[:, :65]
    ref = last["", "float32"]
    assert _rel(last["triton", dtype], ref) < max(2 * _rel(last["", dtype], ref), 1e-2)


@pytest.mark.parametrize("kernels", [dict(norm_kernel="triton"), dict(gelu_kernel="triton", norm_kernel="triton"),
                                     dict(gelu_kernel="triton", norm_kernel="triton", xent_kernel="triton")],
                         ids=["norm", "defaults", "all"])
def test_training_kernels_on_gpu(kernels):
    """The Pallas training kernels (`Runtime.norm_kernel`; with GELU's, a GPU's defaults; with the loss's) as
    Triton kernels: in float32 (highest matmul precision) the training objective's value and
    gradients are XLA's path's; in the GPU's bf16 settings its gradients lie no further from
    float32's than XLA's path's do (the kernels round in other places)."""
    from helpers import bf16_gradient_errors
    cfg = tiny_model_config(block_size=64, n_embd=128, n_head=4)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 65, (4, 64)), jnp.int32)
    _same_objective(tiny_gpt(cfg), tiny_gpt(cfg, **kernels), x)
    kernel_error, xla_error = bf16_gradient_errors(cfg, x, kernels)
    assert kernel_error <= 1.1 * xla_error, (kernel_error, xla_error)


def _same_objective(xla, kernels, x) -> None:
    """The training objective's value and gradients with `kernels` (a GPT) are `xla`'s (the same
    weights), in float32 at the highest matmul precision."""
    from gpt import train
    out = []
    for model in (xla, kernels):
        gd, params = nnx.split(model)
        fn = lambda p: train.objective(gd, p, x, x, moe=train.moe_lib.MoETraining())[0]  # noqa: E731
        with jax.default_matmul_precision("highest"):
            out.append(jax.jit(jax.value_and_grad(fn))(params))
    (la, ga), (lb, gb) = out
    assert abs(float(la) - float(lb)) <= 1e-5 * abs(float(la))
    assert max(jax.tree.leaves(jax.tree.map(_rel, gb, ga))) < 1e-4


def test_gpu_default_training_kernels_fit_odd_shapes():
    """On a GPU `gpt.runtime.resolve` turns both training kernels on, and their tiles fit shapes
    that are no power of two (n_embd 96 read in 3 chunks of 32, 21 rows, an MLP 384 wide): both
    run, and the objective is XLA's path's."""
    from gpt import train
    from gpt.config import ComputeConfig
    from gpt.model import GPT
    from gpt.runtime import resolve
    cfg = tiny_model_config(block_size=8, n_embd=96, n_head=4)
    rt = resolve(cfg, ComputeConfig(dtype="float32"))
    assert rt.norm_kernel == rt.gelu_kernel == "triton"
    x = jnp.asarray(np.random.default_rng(1).integers(0, 65, (3, 7)), jnp.int32)
    model = GPT(cfg, rngs=nnx.Rngs(0), runtime=rt)
    gd, params = nnx.split(model)
    grad = jax.grad(lambda p: train.objective(gd, p, x, x, moe=train.moe_lib.MoETraining())[0])
    assert str(jax.make_jaxpr(grad)(params)).count("pallas_call") >= 2  # the norms' and GELU's
    _same_objective(tiny_gpt(cfg), model, x)
