"""Mixture of experts (gpt/moe.py and its hooks): routing and capacity against plain Python, the
layer against a dense loop over experts (values and gradients), the model's cache, sizes and FLOPs,
training (metrics, exact resume, sampling), refusals, and expert parallelism on 8 simulated devices.

Models are built from shapes with host-drawn parameters (eager construction compiles every
initialiser op by op); one short MoE run serves the metrics, resume, sampling and refusal tests.
"""
from __future__ import annotations

import json
import math
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import random_params, run_on_cpu_devices, tiny_model_config, tiny_runtime, xla_flags
from test_train import configs, run
from gpt import model as M
from gpt import moe
from gpt import train as T
from gpt.errors import UserError

MOE = dict(n_expert=4, n_expert_per_token=2)
ARCHS = {  # GPT-2 block (biases) with MoE in every layer; the modern block with MoE every 2nd layer
    "gelu": dict(**MOE),
    "swiglu-every2": dict(**MOE, moe_every=2, mlp="swiglu", pos_embedding="rope", norm="rmsnorm",
                          bias=False, n_head=4, n_kv_head=2, tie_embeddings=False),
}
ROUTER_STD = {"w_router": 0.5}  # decisive routing: no near-ties in the top-k choice


def build(cfg, params, **runtime):
    return nnx.merge(nnx.graphdef(M.abstract_model(cfg, runtime=tiny_runtime(cfg, **runtime))), params)


# ----------------------------------------------------------------------------- routing and capacity


def python_top_k(logits, k):
    """Each token's k most probable experts (ties: lower index) and their gates, one by one."""
    B, T, E = logits.shape
    gates, experts = np.zeros((B, T, k)), np.zeros((B, T, k), int)
    for b in range(B):
        for t in range(T):
            z = np.exp(logits[b, t] - logits[b, t].max())
            p = z / z.sum()
            order = sorted(range(E), key=lambda e: (-p[e], e))[:k]
            chosen = [p[e] for e in order]
            total = sum(chosen) if k > 1 else 1.0  # k = 1: the raw probability (Switch)
            gates[b, t] = [g / total for g in chosen]
            experts[b, t] = order
    return gates, experts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_gates_match_a_python_loop(k):
    logits = np.random.default_rng(k).standard_normal((2, 7, 5)).astype(np.float32)
    logits[0, 0, 1] = logits[0, 0, 3] = 5.0  # a tie: the lower index first
    gates, experts = moe.top_k_gates(jnp.asarray(logits), k)
    want_gates, want_experts = python_top_k(logits, k)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(gates), want_gates, rtol=1e-6)
    assert experts[0, 0, 0] == 1 and (k == 1 or experts[0, 0, 1] == 3)


def test_capacity_and_slots_on_a_hand_built_case():
    """C = ceil(factor * T * k / E), at most T (factor 0: T), exact for decimal factors; slots in
    token order (each token's choices best first); past C a choice is dropped."""
    assert moe.capacity(64, 2, 8, 1.25) == 20 and moe.capacity(64, 2, 8, 0.0) == 64
    assert moe.capacity(4, 1, 8, 1.0) == 1 and moe.capacity(10, 2, 2, 4.0) == 10
    assert moe.capacity(100, 1, 10, 1.1) == 11  # not ceil(11.000000000000002)
    experts = jnp.array([[[0, 1], [0, 2], [1, 0], [0, 1]]])  # T=4 tokens, k=2, E=3
    slot, kept = moe.assign_slots(experts, 3, C=2)
    # t0: e0 slot 0, e1 slot 0; t1: e0 slot 1, e2 slot 0; t2: e1 slot 1, e0 slot 2 (over C);
    # t3: e0 slot 3, e1 slot 2 (both over C)
    assert slot.tolist() == [[[0, 0], [1, 0], [1, 2], [3, 2]]]
    assert kept.tolist() == [[[True, True], [True, True], [True, False], [False, False]]]


def test_capacity_dropping_is_causal():
    """With drops (k=2), a token's output never depends on later tokens: changing the tail of a
    sequence leaves the outputs before it unchanged (a language model must not see the future)."""
    cfg = tiny_model_config(n_expert=4, n_expert_per_token=2)
    p = expert_weights(cfg, 4, 8, 12, router_std=1.5)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((2, 16, 8)), jnp.float32)
    out, stats = moe.moe_mlp(h, p, cfg, jnp.float32, capacity_factor=0.75)
    assert float(stats.dropped) > 0.1  # the case exercises the capacity
    for t in (3, 8, 12):
        tail = jnp.asarray(np.random.default_rng(t).standard_normal((2, 16 - t, 8)), jnp.float32)
        changed, _ = moe.moe_mlp(h.at[:, t:].set(tail), p, cfg, jnp.float32, capacity_factor=0.75)
        np.testing.assert_array_equal(np.asarray(changed[:, :t]), np.asarray(out[:, :t]))


def expert_weights(cfg, E, D, F, seed=0, router_std=0.5):
    rng = np.random.default_rng(seed)
    n = lambda *shape, s=0.3: jnp.asarray(s * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    gates = (2,) if cfg.mlp == "swiglu" else ()
    p = {"w_router": n(D, E, s=router_std), "w_fc": n(E, D, *gates, F), "w_proj": n(E, F, D)}
    p["b_fc"] = n(E, *gates, F) if cfg.bias else None
    p["b_proj"] = n(E, D) if cfg.bias else None
    return p


def dense_loop(h, p, cfg, experts_BTX):
    """The reference: every expert's MLP on every token, weighted by the token's gate for it (0
    unless chosen; the choice `experts_BTX` is given, as top-k is piecewise constant)."""
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", h, p["w_router"], precision="highest"), -1)
    chosen = jax.nn.one_hot(experts_BTX, p["w_router"].shape[1]).sum(-2)
    gates = probs * chosen
    if cfg.n_expert_per_token > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    out = jnp.zeros_like(h)
    for e in range(p["w_router"].shape[1]):
        b = lambda name: 0.0 if p[name] is None else p[name][e]  # noqa: E731
        if cfg.mlp == "swiglu":
            gu = jnp.einsum("btd,dgf->btgf", h, p["w_fc"][e], precision="highest") + b("b_fc")
            a = jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]
        else:
            a = jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["w_fc"][e], precision="highest") + b("b_fc"))
        out = out + gates[..., e:e + 1] * (jnp.einsum("btf,fd->btd", a, p["w_proj"][e], precision="highest")
                                           + b("b_proj"))
    return out


@pytest.mark.parametrize("mlp,k", [("gelu", 2), ("swiglu", 1)])
def test_moe_layer_equals_a_dense_loop_over_experts(mlp, k):
    """No drops (capacity factor 0), float32: values and gradients (input, router, experts)."""
    cfg = tiny_model_config(n_expert=5, n_expert_per_token=k, mlp=mlp, bias=mlp == "gelu")
    B, T, D, F, E = 2, 9, 8, 12, 5
    p = expert_weights(cfg, E, D, F)
    h = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
    _, experts = moe.top_k_gates(moe.router_logits(h, p["w_router"]), k)
    got = lambda h, p: jnp.sum(moe.moe_mlp(h, p, cfg, jnp.float32)[0] * cot)  # noqa: E731
    want = lambda h, p: jnp.sum(dense_loop(h, p, cfg, experts) * cot)  # noqa: E731
    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, p) for f in (got, want))
    assert abs(float(v1) - float(v2)) <= 1e-5 * abs(float(v2))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
        err = float(jnp.max(jnp.abs(a - b))) / float(jnp.max(jnp.abs(b)))
        assert err < 1e-5, (jax.tree_util.keystr(path), err)
    out, stats = moe.moe_mlp(h, p, cfg, jnp.float32)
    assert float(stats.dropped) == 0.0 and abs(float(stats.load_E.sum()) - 1) < 1e-6


def test_tokens_over_capacity_pass_through_the_residual_only():
    """k=1, capacity 2 of 6 tokens: the choices past each expert's 2 slots add exactly 0, the kept
    ones their gate times their expert's output; the dropped share is counted."""
    cfg = tiny_model_config(n_expert=3, n_expert_per_token=1, bias=True)
    p = expert_weights(cfg, 3, 3, 4)
    p["w_router"] = 10.0 * jnp.eye(3)  # a token goes to its largest coordinate's expert
    h = jnp.asarray([[[1, 0, 0], [1, .1, 0], [.9, 0, .2], [0, 1, 0], [1, 0, .1], [0, 0, 1]]], jnp.float32)
    # experts 0, 0, 0, 1, 0, 2: the 3rd and 5th tokens are the 3rd and 4th of expert 0
    out, stats = moe.moe_mlp(h, p, cfg, jnp.float32, capacity_factor=1.0)  # C = ceil(6 / 3) = 2
    _, experts = moe.top_k_gates(moe.router_logits(h, p["w_router"]), 1)
    assert experts[0, :, 0].tolist() == [0, 0, 0, 1, 0, 2]
    want = jax.jit(dense_loop, static_argnums=2)(h, p, cfg, experts)
    kept = np.array([1, 1, 0, 1, 0, 1], bool)
    np.testing.assert_allclose(np.asarray(out[0, kept]), np.asarray(want[0, kept]), rtol=1e-5, atol=1e-6)
    assert not np.asarray(out[0, ~kept]).any()  # exactly zero: the block adds nothing
    assert abs(float(stats.dropped) - 2 / 6) < 1e-6
    np.testing.assert_allclose(np.asarray(stats.load_E), [4 / 6, 1 / 6, 1 / 6], rtol=1e-6)


@pytest.mark.parametrize("T", [41, 55])
def test_nothing_dropped_is_a_dropped_share_of_exactly_zero(T):
    """Without a capacity limit no choice drops, and the logged share is 0, not float rounding of
    1 - mean(kept) (at these T, 6e-8 eagerly and 3e-8 under jit; -7e-9 in a training run)."""
    cfg = tiny_model_config(n_expert=4, n_expert_per_token=1)
    p = expert_weights(cfg, 4, 8, 12)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((1, T, 8)), jnp.float32)
    for f in (moe.moe_mlp, jax.jit(moe.moe_mlp, static_argnums=(2, 3))):
        _, stats = f(h, p, cfg, jnp.float32)
        assert float(stats.dropped) == 0.0


def test_load_balancing_loss_is_one_when_uniform_and_z_loss():
    E = 4
    experts = jnp.arange(8).reshape(1, 4, 2) % E  # each expert chosen equally often
    aux, load = moe.load_balancing_loss(jnp.full((1, 4, E), 1 / E), experts)
    assert abs(float(aux) - 1.0) < 1e-6 and np.allclose(np.asarray(load), 1 / E)
    one_hot = jax.nn.one_hot(jnp.zeros((1, 4), int), E)  # every token on expert 0, with certainty
    aux, _ = moe.load_balancing_loss(one_hot, jnp.zeros((1, 4, 1), jnp.int32))
    assert abs(float(aux) - E) < 1e-6
    logits = jnp.asarray([[[0.0, 0.0, 0.0, 0.0]]])
    assert abs(float(moe.z_loss(logits)) - math.log(4) ** 2) < 1e-6


# ----------------------------------------------------------------------------- the model


@partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, x, cache):
    return nnx.merge(graphdef, state)(x, cache=cache)


@pytest.mark.parametrize("arch", ["swiglu-every2", pytest.param("gelu", marks=pytest.mark.slow)])
def test_cached_decoding_equals_full_forward(arch):
    """Inference never drops a token, so a token's MoE output depends on itself alone: prefill +
    one-token steps equal the full forward (the layer groups of moe_every=2 included)."""
    cfg = tiny_model_config(**ARCHS[arch])
    model = build(cfg, random_params(cfg, std=ROUTER_STD))
    gd, state = nnx.split(model)
    x = jax.random.randint(jax.random.key(1), (2, 12), 0, 65)
    full, _ = _forward(gd, state, x, None)
    out, cache = _forward(gd, state, x[:, :8], M.init_cache(cfg, 2, 16, jnp.float32))
    parts = [out]
    for t in range(8, 12):
        o, cache = _forward(gd, state, x[:, t:t + 1], cache)
        parts.append(o)
    got = jnp.concatenate(parts, axis=1)
    assert float(jnp.abs(got[..., :65] - full[..., :65]).max()) < 1e-4


def test_layout_param_counts_and_flops():
    """Dense models keep their parameter tree; MoE blocks have their own stack with an expert
    axis; num_params counts what is built, `active` what one token uses, and FLOPs take active."""
    dense = tiny_model_config()
    assert "moe_blocks" not in nnx.to_pure_dict(nnx.state(M.abstract_model(dense)))
    for arch, kw in ARCHS.items():
        cfg = tiny_model_config(**kw)
        shapes = nnx.to_pure_dict(nnx.state(M.abstract_model(cfg)))
        n_moe = len(cfg.moe_layers)
        assert shapes["moe_blocks"]["w_fc"].shape[:2] == (n_moe, 4)
        assert shapes["moe_blocks"]["w_router"].shape == (n_moe, cfg.n_embd, 4)
        assert ("blocks" in shapes) == (n_moe < cfg.n_layer)
        built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
        padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd * (1 + (not cfg.tie_embeddings))
        assert M.num_params(cfg) == built - padding, arch
        expert = sum(int(np.prod(x.shape[2:])) for k, x in shapes["moe_blocks"].items()
                     if k in ("w_fc", "b_fc", "w_proj", "b_proj"))
        assert M.num_params(cfg, active=True) == M.num_params(cfg) - n_moe * (4 - 2) * expert
        n = M.num_params(cfg, include_position=False, active=True) - \
            (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.n_embd)
        assert M.flops_per_token(cfg, 32) == 6 * n + 12 * cfg.n_layer * 32 * cfg.n_head * cfg.head_dim
    assert tiny_model_config(**ARCHS["swiglu-every2"], n_layer=4).moe_layers == (1, 3)


def test_training_objective_adds_the_auxiliary_losses():
    """The objective is the cross-entropy plus the auxiliary losses (averaged over the MoE layers)
    times their coefficients; the cross-entropy comes apart (the logged loss)."""
    cfg = tiny_model_config(**ARCHS["gelu"])
    params = random_params(cfg, std=ROUTER_STD)
    gd = nnx.graphdef(M.abstract_model(cfg, runtime=tiny_runtime(cfg)))
    x = jax.random.randint(jax.random.key(0), (2, 16), 0, 65)
    y = jnp.roll(x, -1, axis=1)
    coefs = moe.MoETraining(capacity_factor=1.0, aux_loss_coef=0.5, z_loss_coef=0.25)
    total, (ce, stats) = jax.jit(lambda p: T.objective(gd, p, x, y, moe=coefs))(params)
    assert stats.aux_loss.shape == (2,) and float(stats.dropped.max()) > 0  # capacity 1.0 drops some
    want = ce + 0.5 * stats.aux_loss.mean() + 0.25 * stats.z_loss.mean()
    assert abs(float(total) - float(want)) < 1e-6 and float(total) > float(ce) + 0.5


# ----------------------------------------------------------------------------- training


MOE_FLAGS = ["--n_expert=4", "--n_expert_per_token=2", "--moe_every=2", "--expert_capacity_factor=1.0",
             "--moe_aux_loss_coef=0.1"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, char_data):
    """A 2-step MoE run (a dense and a MoE layer, capacity 1.0: some tokens drop)."""
    out = tmp_path_factory.mktemp("moe_run") / "out"
    run(out, char_data, *MOE_FLAGS, "--max_iters=2", "--eval_interval=2", "--eval_iters=1")
    return out


@pytest.mark.slow
def test_resume_is_exact(tmp_path, char_data):
    """4 steps == 2 steps + resume + 2 steps, bit for bit (capacity drops and dropout on)."""
    flags = [*MOE_FLAGS, "--dropout=0.1", "--eval_interval=2", "--max_iters=4", "--lr_decay_iters=4"]
    full = run(tmp_path / "full", char_data, *flags)
    run(tmp_path / "split", char_data, *flags, "--max_iters=2")
    resumed = run(tmp_path / "split", char_data, *flags, "--init_from=resume")
    assert resumed["start_step"] == 2
    assert dict(resumed["train_losses"]) == {k: v for k, v in full["train_losses"] if k > 2}
    assert resumed["val_loss"] == full["val_loss"]


def test_metrics_hold_the_routing_figures(moe_run):
    records = [json.loads(ln) for ln in (moe_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["moe_aux_loss"] >= 1.0 - 1e-3 and r["moe_z_loss"] > 0  # E * sum f P >= 1 (nearly)
        assert 0 <= r["moe_dropped_fraction"] < 0.5
        assert list(r["moe_load"]) == ["layer1"] and len(r["moe_load"]["layer1"]) == 4
        assert abs(sum(r["moe_load"]["layer1"]) - 1) < 1e-5
    assert any(r["moe_dropped_fraction"] > 0 for r in train)  # capacity 1.0 drops some
    evals = [r for r in records if r["kind"] == "eval"]
    assert all(math.isfinite(r["val_loss"]) and "moe_aux_loss" not in r for r in evals)


def test_sample_and_refusals(moe_run, char_data, capsys, tmp_path):
    """sample.py reads a MoE checkpoint (KV cache, no drops); LoRA and the Hugging Face export
    refuse a MoE model in one line."""
    import sample
    from gpt.convert import checkpoint_to_hf
    out = moe_run
    capsys.readouterr()
    assert sample.main([f"--out_dir={out}", "--prompt=ROMEO:", "--max_new_tokens=20", "--seed=1"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    with pytest.raises(UserError, match="LoRA fine-tuning of a mixture-of-experts model"):
        T.prepare_setup(*configs(tmp_path / "lora", char_data, f"--init_from={out}", "--lora_rank=2"))
    with pytest.raises(UserError, match="exporting them to Hugging Face is not supported"):
        checkpoint_to_hf(out, tmp_path / "hf")


def test_moe_settings_on_a_dense_checkpoint_are_refused(char_data, tmp_path):
    """Fine-tuning or resuming a dense model with a mixture-of-experts training setting is one
    line (the flag used to be ignored: the run trained without it and exited 0)."""
    dense = tmp_path / "dense"
    run(dense, char_data, "--max_iters=1", "--eval_interval=1", "--eval_iters=1")
    with pytest.raises(UserError, match=f"--moe_aux_loss_coef is a mixture-of-experts setting, and the "
                                        f"model of --init_from={re.escape(str(dense))} is dense"):
        T.prepare_setup(*configs(tmp_path / "ft", char_data, f"--init_from={dense}", "--moe_aux_loss_coef=0.5"))
    with pytest.raises(UserError, match="--expert_capacity_factor is a mixture-of-experts setting"):
        T.prepare_setup(*configs(dense, char_data, "--init_from=resume", "--expert_capacity_factor=1.25"))
    T.prepare_setup(*configs(tmp_path / "ft2", char_data, f"--init_from={dense}"))  # without: as before


@pytest.mark.parametrize("argv,words", [
    (["--n_expert=4", "--n_expert_per_token=5"], "--n_expert_per_token=5 must be at most --n_expert=4"),
    (["--n_expert=4", "--n_expert_per_token=0"], "--n_expert_per_token=0 must be positive"),
    (["--n_expert=-1"], "--n_expert=-1 must be zero or more"),
    (["--n_expert=4", "--moe_every=3"], "--moe_every=3 must divide --n_layer=2"),
    (["--n_expert=4", "--expert_capacity_factor=-1"], "--expert_capacity_factor=-1.0 must be zero or more"),
    (["--n_expert=4", "--moe_aux_loss_coef=-0.1"], "--moe_aux_loss_coef=-0.1 must be zero or more"),
    (["--n_expert=4", "--moe_z_loss_coef=-1e-3"], "--moe_z_loss_coef=-0.001 must be zero or more"),
    (["--moe_every=2"], "--moe_every needs --n_expert=N"),
])
def test_bad_settings_name_the_field(argv, words):
    from gpt.config import build_train
    with pytest.raises(UserError, match=words):
        build_train(["--preset=tiny", *argv])


# ----------------------------------------------------------------------------- 8 devices

_SHARDED = """
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from helpers import random_params
from gpt import moe, sharding
from gpt.config import ComputeConfig, ModelConfig
from gpt.model import abstract_model
from gpt.runtime import resolve
from gpt.train import objective
cfg = ModelConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32, bias=True, n_expert=8,
                  n_expert_per_token=2)
params = random_params(cfg, std={"w_router": 0.5})
x = jax.random.randint(jax.random.key(1), (8, 16), 0, 65)
y = jnp.roll(x, -1, axis=1)
coefs = moe.MoETraining(capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.01)

def grads(mesh):
    rt = dataclasses.replace(resolve(cfg, ComputeConfig(dtype="float32")), mesh=mesh)
    model = abstract_model(cfg, runtime=rt)
    f = jax.jit(jax.value_and_grad(lambda p, x, y: objective(nnx.graphdef(model), p, x, y, moe=coefs),
                                   has_aux=True))
    if mesh is None:
        return f(params, x, y), ""
    shard = sharding.param_shardings(nnx.state(model), mesh)
    rows = sharding.batch_sharding(mesh)
    args = (jax.device_put(params, shard), jax.device_put(x, rows), jax.device_put(y, rows))
    compiled = f.lower(*args).compile()
    spec = str(shard["moe_blocks"]["w_fc"].spec)
    return compiled(*args), spec + " all-to-all" * ("all-to-all" in compiled.as_text())

ref, _ = grads(None)
out = {}
for spec in ("data:2,expert:4", "fsdp:2,expert:2,tensor:2"):
    got, how = grads(sharding.make_mesh(spec))
    rel = lambda a, b: float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(b))), 1e-30)
    out[spec] = [max(rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))), how]
print(json.dumps(out))
"""


def test_expert_axis_shards_experts_and_batch():
    """On a mesh with an expert axis (abstract: no devices needed) the experts' weights split their
    E axis over it, everything else is as before, batch rows split over data x fsdp x expert, and
    an expert axis that does not divide n_expert is one line."""
    from jax.sharding import AbstractMesh

    from gpt import sharding
    cfg = tiny_model_config(**ARCHS["swiglu-every2"])
    mesh = AbstractMesh((2, 1, 2, 2), sharding.AXES)
    shardings = sharding.param_shardings(nnx.state(M.abstract_model(cfg)), mesh)
    specs = jax.tree.map(lambda s: tuple(s.spec), shardings)
    assert specs["moe_blocks"]["w_fc"] == (None, "expert", None, None, "tensor")
    assert specs["moe_blocks"]["w_proj"] == (None, "expert", "tensor", None)
    assert specs["moe_blocks"]["w_router"] == (None, None, None)
    assert specs["blocks"]["w_fc"] == (None, None, None, "tensor") and specs["blocks"]["w_q"][2] == "tensor"
    assert specs["moe_blocks"]["w_q"] == specs["blocks"]["w_q"]
    assert sharding.batch_degree(mesh) == 4 and sharding.BATCH_AXES == ("data", "fsdp", "expert")
    sharding.check_divisibility(cfg, mesh, 4)
    with pytest.raises(UserError, match=r"--n_expert=6 is not divisible by the mesh's expert axis \(4\)"):
        sharding.check_divisibility(tiny_model_config(n_expert=6), AbstractMesh((2, 1, 4, 1), sharding.AXES),
                                    8)
    with pytest.raises(UserError, match="--batch_size=2 is not divisible by the data-parallel degree 4"):
        sharding.check_divisibility(cfg, mesh, 2)


@pytest.mark.slow
def test_expert_parallel_equals_one_device():
    """Loss, cross-entropy, routing figures and every gradient on 8-device meshes (experts over
    `expert`, mixed with data, fsdp and tensor; capacity 1.0, so tokens drop) equal one device's
    within 1e-5 relative, and the tokens travel by all-to-all. (30 s on 2 cores: compilation.)"""
    out = run_on_cpu_devices(_SHARDED, 8, timeout=300)
    for spec, (err, how) in out.items():
        assert err < 1e-5, (spec, err)
        assert "'expert'" in how.split(")")[0] and how.endswith("all-to-all"), (spec, how)
    assert "'tensor'" in out["fsdp:2,expert:2,tensor:2"][1]


_TRAIN_ON_MESHES = """
import json, sys
from gpt import train as T
from gpt.config import build_train
out = {}
for mesh in json.loads(sys.argv[1]):
    argv = [*json.loads(sys.argv[2]), f"--out_dir={sys.argv[3]}/{mesh.replace(':', '').replace(',', '_')}",
            f"--mesh={mesh}"]
    out[mesh] = T.train(T.prepare_setup(*build_train(argv)), log=lambda msg: None)["train_losses"]
print(json.dumps(out))
"""
SLOW_MESHES = ["expert:8", "data:2,expert:4", "fsdp:2,expert:4", "data:2,expert:2,tensor:2",
               "fsdp:2,expert:2,tensor:2"]


@pytest.mark.slow
def test_training_on_expert_meshes_equals_one_device(char_data, tmp_path):
    """5 steps of train.py's training (MoE in both layers, 8 experts, capacity 1.0, dropout) on
    meshes with an expert axis give one device's losses within 1e-5 relative."""
    import subprocess
    import sys

    from helpers import REPO
    argv = ["--preset=tiny", f"--data_dir={char_data}", "--no_progress", "--log_interval=1", "--n_expert=8",
            "--n_expert_per_token=2", "--expert_capacity_factor=1.0", "--dropout=0.1", "--batch_size=8",
            "--max_iters=5", "--eval_interval=5", "--eval_iters=1"]
    ref = run(tmp_path / "one", char_data, *argv[3:])["train_losses"]
    env = dict(__import__("os").environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _TRAIN_ON_MESHES, json.dumps(SLOW_MESHES), json.dumps(argv),
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mesh, losses in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert [s for s, _ in losses] == [s for s, _ in ref] == [1, 2, 3, 4, 5]
        for (step, a), (_, b) in zip(losses, ref):
            assert abs(a - b) <= 1e-5 * abs(b), (mesh, step, a, b)
