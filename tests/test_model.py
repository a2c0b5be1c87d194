
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import ci_first, random_params, tiny_gpt, tiny_model_config, tiny_runtime
from gpt import model as M
from gpt.config import PRESETS, ModelConfig


def make(cfg, seed=0, **compute):
    return tiny_gpt(cfg, seed, **compute)


# One compiled forward per shape: the eager model dispatches op by op and compiles each op
# on first use, tens of seconds for a decoding loop on a 2-core CPU.
forward = nnx.jit(lambda model, x: model(x))
forward_cached = nnx.jit(lambda model, x, cache: model(x, cache=cache))


def tokens(B, T, V, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_shapes_and_padded_vocab(pos):
    cfg = tiny_model_config(vocab_size=70, pos_embedding=pos)
    assert cfg.padded_vocab_size == 128
    logits, cache = make(cfg)(tokens(3, 16, 70))
    assert logits.shape == (3, 16, 128) and logits.dtype == jnp.float32 and cache is None
    assert bool(jnp.all(jnp.isneginf(logits[..., 70:])))  # padded entries are never scored
    assert bool(jnp.all(jnp.isfinite(logits[..., :70])))


@pytest.mark.parametrize("attention", ["xla", "reference", "blocked"])
def test_causality(attention):
    cfg = tiny_model_config()
    model = make(cfg, attention=attention)
    x = tokens(2, 16, 65)
    t = 9
    x2 = x.at[:, t + 1].set((x[:, t + 1] + 1) % 65)
    a, _ = model(x)
    b, _ = model(x2)
    np.testing.assert_array_equal(np.asarray(a[:, :t + 1, :65]), np.asarray(b[:, :t + 1, :65]))
    assert float(jnp.abs(a[:, t + 1:, :65] - b[:, t + 1:, :65]).max()) > 0


def test_gpt2_parameter_count():
    cfg = ModelConfig(**{k: v for k, v in PRESETS["gpt2"].items() if k in ModelConfig.__dataclass_fields__})
    assert M.num_params(cfg) == 124_439_808
    # The built model has exactly that many parameters plus the vocabulary padding rows.
    shapes = nnx.state(nnx.eval_shape(lambda: M.GPT(cfg, rngs=nnx.Rngs(0))))
    total = sum(x.size for x in jax.tree.leaves(shapes))
    assert total == 124_439_808 + (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd
    # FLOPs: 6N (no position embeddings) + 12*L*T*D.
    n = 124_439_808 - 1024 * 768
    assert M.flops_per_token(cfg) == 6 * n + 12 * 12 * 1024 * 768


def test_init_statistics():
    cfg = tiny_model_config(n_layer=4, n_embd=64)
    state = nnx.to_pure_dict(nnx.state(make(cfg)))
    assert abs(float(state["wte"].std()) - 0.02) < 0.002
    proj_std = 0.02 / np.sqrt(2 * cfg.n_layer)
    assert abs(float(state["blocks"]["w_proj"].std()) - proj_std) < 0.15 * proj_std
    assert float(jnp.abs(state["blocks"]["b_fc"]).max()) == 0.0
    assert float(state["blocks"]["ln1_scale"].min()) == 1.0


def test_kv_cache_matches_full_forward():
    cfg = tiny_model_config()
    model = make(cfg)
    x = tokens(2, 20, 65)
    full, _ = forward(model, x)
    cache = M.init_cache(cfg, 2, 32, jnp.float32)
    out, cache = forward_cached(model, x[:, :7], cache)
    parts = [out]
    for t in range(7, 20):
        o, cache = forward_cached(model, x[:, t:t + 1], cache)
        parts.append(o)
    assert int(cache.index) == 20
    got = jnp.concatenate(parts, axis=1)
    assert float(jnp.abs(got[..., :65] - full[..., :65]).max()) < 1e-4


def test_per_row_cache_index_matches_full_forward():
    """A per-row index (speculative decoding): each row writes several tokens from its own offset,
    and a row whose index was lowered (a rollback) overwrites the slots it gave up."""
    cfg = tiny_model_config()
    model = make(cfg)
    x = tokens(2, 20, 65)
    full, _ = model(x)
    cache = M.init_cache(cfg, 2, 32, jnp.float32)
    _, cache = model(jnp.concatenate([x[:, :6], jnp.zeros((2, 3), jnp.int32)], axis=1), cache=cache)
    cache = cache._replace(index=jnp.array([6, 4]))  # junk in slots 6-8; row 1 also gives up 4-5
    out, cache = model(jnp.stack([x[0, 6:9], x[1, 4:7]]), cache=cache)
    assert cache.index.tolist() == [9, 7]
    assert float(jnp.abs(out[0, :, :65] - full[0, 6:9, :65]).max()) < 1e-4
    assert float(jnp.abs(out[1, :, :65] - full[1, 4:7, :65]).max()) < 1e-4


def test_left_padded_cache_rows_match_unpadded():
    """A left-padded row gives the same logits as the same prompt alone (positions count from 0)."""
    cfg = tiny_model_config()
    model = make(cfg)
    x = tokens(1, 10, 65)
    alone, _ = model(x)
    padded = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), x], axis=1)
    cache = M.init_cache(cfg, 1, 32, jnp.float32, start_B=jnp.array([4]))
    out, _ = model(padded, cache=cache)
    assert float(jnp.abs(out[:, 4:, :65] - alone[..., :65]).max()) < 1e-4


@pytest.mark.parametrize("remat,scan", [("block", False), ("dots", True), ("none", True)])
def test_remat_and_scan_give_same_loss_and_grads(remat, scan):
    cfg = tiny_model_config()
    x = tokens(2, 16, 65)

    def loss(model):
        logits, _ = model(x[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits[..., :65])[..., 0])

    base = make(cfg)
    other = make(cfg, remat=remat, scan_layers=scan)
    l1, g1 = nnx.value_and_grad(loss)(base)
    l2, g2 = nnx.value_and_grad(loss)(other)
    assert abs(float(l1) - float(l2)) < 1e-6
    for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g2))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("mlp,op", [("gelu", "tanh"), ("swiglu", "logistic")])
def test_mlp_activation_is_recomputed_not_kept(mlp, op):
    """The backward recomputes the MLP's activation from fc's product instead of keeping its
    tanh/sigmoid (Block.mlp): the gradient evaluates it twice per layer, as a remat policy
    does, and a remat policy around the block adds no third evaluation."""
    cfg = tiny_model_config(**({"mlp": "swiglu"} if mlp == "swiglu" else {}))
    x = tokens(2, 8, 65)
    counts = {}
    for remat in ("none", "block", "dots"):
        gd, params = nnx.split(make(cfg, remat=remat))
        grad = jax.grad(lambda p: jnp.mean(nnx.merge(gd, p)(x)[0][..., :65]))
        counts[remat] = str(jax.make_jaxpr(grad)(params)).count(f" {op} ")
    assert counts == {"none": 2, "block": 2, "dots": 2}  # the layer scan's body: one layer
    gd, params = nnx.split(make(cfg, mlp_recompute=False))  # kept: evaluated once
    grad = jax.grad(lambda p: jnp.mean(nnx.merge(gd, p)(x)[0][..., :65]))
    assert str(jax.make_jaxpr(grad)(params)).count(f" {op} ") == 1


def test_bfloat16_compute_keeps_float32_params_and_logits():
    cfg = tiny_model_config()
    model = make(cfg, dtype="bfloat16")
    logits, _ = model(tokens(2, 8, 65))
    assert logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
    ref, _ = make(cfg)(tokens(2, 8, 65))
    assert float(jnp.abs(logits[..., :65] - ref[..., :65]).max()) < 0.1


def _stream_dtypes(model, x) -> set:
    """The dtypes of the [B, T, D] arrays the layer scan carries from block to block."""
    gd, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(gd, s)(x)[0])(state)
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1
    return {v.aval.dtype.name for v in scans[0].outvars if v.aval.shape == (*x.shape, model.cfg.n_embd)}


@pytest.mark.parametrize("remat", ci_first(["none", "block"], {"none"}))
def test_residual_stream_in_the_compute_dtype(remat):
    """--residual_dtype=compute carries the stream between blocks in bf16 (float32 by default),
    unrolled or scanned alike, and its loss and gradients stay within bf16's rounding of the
    float32 stream's."""
    cfg = tiny_model_config()
    x = tokens(2, 16, 65)

    def loss(model):
        logits, _ = model(x[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits[..., :65].astype(jnp.float32))[..., 0])

    kw = dict(dtype="bfloat16", remat=remat)
    assert _stream_dtypes(make(cfg, scan_layers=True, **kw), x[:, :-1]) == {"float32"}
    bf16_stream = make(cfg, scan_layers=True, residual_dtype="compute", **kw)
    assert _stream_dtypes(bf16_stream, x[:, :-1]) == {"bfloat16"}
    l32, g32 = nnx.value_and_grad(loss)(make(cfg, **kw))
    results = [nnx.value_and_grad(loss)(make(cfg, residual_dtype="compute", scan_layers=scan, **kw))
               for scan in (False, True)]
    (l_unrolled, g_unrolled), (l_scan, g_scan) = results
    assert abs(float(l_unrolled) - float(l_scan)) < 1e-6
    assert 0 < abs(float(l_unrolled) - float(l32)) < 2e-2 * abs(float(l32))  # rounded, not the same
    for a, b, c in zip(*(jax.tree.leaves(nnx.state(g)) for g in (g32, g_unrolled, g_scan))):
        assert a.dtype == b.dtype == jnp.float32  # the parameters' gradients stay float32
        np.testing.assert_allclose(np.asarray(b), np.asarray(c), atol=1e-6)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.05 * float(jnp.abs(a).max()) + 1e-6)


@pytest.mark.parametrize("name", ci_first(["gpt2", "moe"], {"gpt2"}))
def test_bf16_stream_with_the_gpus_bf16_products(name):
    """A GPU's runtime run here (bf16 products, so the stream's adds are bf16 + bf16; the layers
    for_decoding makes): with --residual_dtype=compute the scanned stream stays bf16, and cached
    decoding, through the stacked layers and through for_decoding's, gives the full forward's
    logits to within bf16's rounding."""
    cfg = tiny_model_config(**({"n_layer": 4, "n_expert": 4, "n_expert_per_token": 2, "moe_every": 2}
                               if name == "moe" else {}))
    kw = dict(backend="gpu", dtype="bfloat16", residual_dtype="compute", attention="xla",
              cached_attention="xla")
    x = tokens(2, 12, 65)
    assert _stream_dtypes(make(cfg, scan_layers=True, **kw), x) == {"bfloat16"}
    model = make(cfg, **kw)
    assert model.rt.matmul_out == jnp.bfloat16 and model.rt.residual == jnp.bfloat16
    call = nnx.jit(lambda m, x, cache: m(x, cache=cache))
    full = call(model, x, None)[0][..., :65].astype(jnp.float32)
    for m in (model, M.for_decoding(model)):
        cache = M.init_cache(cfg, 2, 16, jnp.float32)
        _, cache = call(m, x[:, :8], cache)
        for t in range(8, 12):
            step, cache = call(m, x[:, t:t + 1], cache)
            err = float(jnp.abs(step[:, 0, :65] - full[:, t]).max())
            assert err < 0.05 * float(jnp.abs(full[:, t]).max()), (t, err)


def test_dropout_is_active_only_with_a_key():
    model = make(tiny_model_config(), dropout=0.5)
    x = tokens(2, 8, 65)
    a, _ = model(x)
    b, _ = model(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c, _ = model(x, dropout_key=jax.random.key(0))
    assert float(jnp.abs(c[..., :65] - a[..., :65]).max()) > 0


def test_weights_held_in_bf16_run_with_and_without_cache():
    """Sampling may hold the parameters in the compute dtype: the residual stream stays float32
    (the layer scan's carry) and the logits match float32-held weights in bf16 compute."""
    from gpt.model import init_cache
    cfg = tiny_model_config()
    model = make(cfg, dtype="bfloat16")
    gd, params = nnx.split(model)
    half = nnx.merge(gd, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))
    idx = jnp.array([[1, 2, 3, 4, 5, 6]], jnp.int32)
    full, _ = model(idx)
    got, _ = half(idx)
    cached, _ = half(idx, cache=init_cache(cfg, 1, 8, jnp.bfloat16))
    assert float(jnp.abs(got - full)[..., :65].max()) < 0.1
    assert float(jnp.abs(cached - got)[..., :65].max()) < 0.05


MODERN = {  # the modern block's options, each mixed with others
    "llama": dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_head=4, n_kv_head=2,
                  bias=False, tie_embeddings=False),
    "mqa-qknorm": dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_head=4, n_kv_head=1,
                       qk_norm=True, head_size=12, rope_theta=5e5, bias=False),
    "dyt-qkvbias": dict(pos_embedding="rope", norm="dyt", mlp="gelu", n_head=4, n_kv_head=2,
                        qkv_bias=True, bias=False),
    "nopos-mha": dict(pos_embedding="none", norm="rmsnorm", mlp="swiglu", n_head=2, ffn_dim=40),
}


@pytest.mark.parametrize("name", ci_first(list(MODERN), {"llama"}))
def test_modern_block_cache_matches_full_forward(name):
    """Cached decoding == full recompute for every mix of the new options (RoPE keys are cached
    already rotated at their absolute positions; GQA caches hold n_kv_head heads)."""
    cfg = tiny_model_config(**MODERN[name])
    model = make(cfg)
    x = tokens(2, 20, 65)
    full, _ = forward(model, x)
    cache = M.init_cache(cfg, 2, 32, jnp.float32)
    assert cache.k_LBGKS.shape[2] == cache.v_LBGSK.shape[2] == cfg.kv_heads
    out, cache = forward_cached(model, x[:, :7], cache)
    parts = [out]
    for t in range(7, 20):
        o, cache = forward_cached(model, x[:, t:t + 1], cache)
        parts.append(o)
    got = jnp.concatenate(parts, axis=1)
    assert float(jnp.abs(got[..., :65] - full[..., :65]).max()) < 1e-4


@pytest.mark.parametrize("name", ci_first(list(MODERN), {"mqa-qknorm"}))
def test_modern_block_kernels_agree_with_reference(name):
    """The CPU kernels (custom-VJP dense, blocked attention with dropout, q/k/v taken apart by a
    split) serve the new options: loss gradients equal the plain reference's (indexing, as on GPU)."""
    cfg = tiny_model_config(**MODERN[name])
    params = nnx.state(make(cfg))
    x = tokens(2, 16, 65)

    def loss(p, rt):
        m = nnx.merge(nnx.graphdef(M.abstract_model(cfg, runtime=rt)), p)  # no init traced
        logits, _ = m(x, dropout_key=jax.random.key(3))
        return jnp.mean(jax.nn.logsumexp(logits[..., :65], -1))

    fast = tiny_runtime(cfg, dropout=0.1, attention_block=8)
    ref = tiny_runtime(cfg, dropout=0.1, attention="reference", dense_vjp=False, cpu_layouts=False)
    assert fast.attention == "blocked"
    grad = jax.jit(jax.grad(loss), static_argnums=1)  # compiled once each: eager is op by op, slow
    for a, b in zip(jax.tree.leaves(grad(params, fast)), jax.tree.leaves(grad(params, ref))):
        assert float(jnp.max(jnp.abs(a - b))) / (float(jnp.max(jnp.abs(b))) or 1.0) < 1e-5


def test_modern_params_flops_and_bad_shapes():
    """num_params counts exactly the parameters built (GQA, SwiGLU, QK-norm, untied head, DyT's
    alpha); flops use the attention width H*K; impossible shapes are one clear error."""
    from gpt.config import validate_model
    from gpt.errors import UserError
    for name, kw in MODERN.items():
        cfg = tiny_model_config(**kw)
        built = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(make(cfg))))
        padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd * (1 + (not cfg.tie_embeddings))
        assert M.num_params(cfg) == built - padding, name
    cfg = tiny_model_config(**MODERN["mqa-qknorm"])
    assert M.flops_per_token(cfg, 32) == 6 * (M.num_params(cfg) - 0) + 12 * 2 * 32 * 4 * 12
    with pytest.raises(UserError, match="--n_head=4 must be divisible by --n_kv_head=3"):
        validate_model(tiny_model_config(n_head=4, n_kv_head=3))
    with pytest.raises(UserError, match="RoPE needs an even head dimension"):
        validate_model(tiny_model_config(n_embd=36, n_head=4, pos_embedding="rope"))
    for kw, match in ((dict(rope_scaling="yarn"), "--rope_scaling=yarn is not valid"),
                      (dict(rope_scaling="linear"), "needs --pos_embedding=rope"),
                      (dict(pos_embedding="rope", rope_factor=0.0), "--rope_factor=0.0 must be positive"),
                      (dict(pos_embedding="rope", rope_scaling="llama3", rope_low_freq_factor=4.0),
                       "--rope_high_freq_factor=4.0 must exceed --rope_low_freq_factor=4.0")):
        with pytest.raises(UserError, match=re.escape(match) if "--" in match else match):
            validate_model(tiny_model_config(**kw))


def test_learned_positions_refuse_more_than_block_size():
    """The learned position table has block_size rows: a longer call would silently reuse the last
    row (a gather clamps), so it is refused as nanoGPT's assert does; RoPE has no such table."""
    model = make(tiny_model_config(block_size=8))
    with pytest.raises(ValueError, match="12 tokens .* exceed block_size 8"):
        model(jnp.zeros((1, 12), jnp.int32))
    with pytest.raises(ValueError, match="a cache of 12 slots"):
        model(jnp.zeros((1, 1), jnp.int32), cache=M.init_cache(model.cfg, 1, 12, jnp.float32))
    make(tiny_model_config(block_size=8, pos_embedding="rope"))(jnp.zeros((1, 12), jnp.int32))


def test_rope_scaling_frequencies():
    """Linear scaling divides every frequency; Llama 3's keeps the short wavelengths, divides the
    long ones and blends the ones between (the HF parity lives in test_convert_llama.py)."""
    cfg = tiny_model_config(n_embd=48, n_head=6, pos_embedding="rope", rope_theta=5e5)
    base = M.rope_frequencies(cfg)
    np.testing.assert_allclose(base, 5e5 ** -(np.arange(0, 8, 2) / 8), rtol=1e-6)
    linear = M.rope_frequencies(dataclasses.replace(cfg, rope_scaling="linear", rope_factor=4.0))
    np.testing.assert_allclose(linear, base / 4, rtol=1e-6)
    llama3 = M.rope_frequencies(dataclasses.replace(cfg, rope_scaling="llama3", rope_factor=8.0,
                                                    rope_low_freq_factor=0.125, rope_high_freq_factor=0.5,
                                                    rope_original_context=32))
    assert llama3[0] == base[0] and base[1] / 8 < llama3[1] < base[1]  # wavelengths 6.3 and 167
    np.testing.assert_allclose(llama3[2:], base[2:] / 8, rtol=1e-6)


FOR_DECODING = {"gpt2": {}, "llama": MODERN["llama"],
                "gqa-swiglu": dict(n_head=4, n_kv_head=2, mlp="swiglu"),  # LayerNorm biases, [2, F] b_fc
                "dyt": dict(norm="dyt"),
                "moe": dict(n_layer=4, n_expert=4, n_expert_per_token=2, moe_every=2),
                "moe-every-layer": dict(n_expert=4, n_expert_per_token=2)}  # no dense blocks at all


# CI: the MoE mix (its dense blocks are GPT-2's) with the GPU's decoding weights; every sampling
# test decodes through the CPU's ("rows") decoding layers of the plain GPT-2 block.
@pytest.mark.parametrize("name,weights", ci_first([(n, w) for w in ("rows", "dot") for n in FOR_DECODING]
                                                  + [("gpt2", "")], {("moe", "dot")}))
def test_for_decoding_is_the_same_model(name, weights):
    """`for_decoding` (per-layer modules in layer order, no CPU layouts, [out, in] weights where
    `Runtime.decode_weights` says: "rows" on CPU, "dot" on GPU) gives the stacked model's logits,
    with and without a cache, for one, a few and many rows, and leaves the original untouched.
    Every parameter is random, the norms' scales and biases too: decoding folds a LayerNorm's bias
    into the next product's bias and applies its 1/std after the product (`Block.norm_in`)."""
    cfg = tiny_model_config(**FOR_DECODING[name])
    graphdef = nnx.graphdef(M.abstract_model(cfg, runtime=tiny_runtime(cfg, decode_weights=weights)))
    norm_biases = {f"{n}_bias": 0.5 for n in ("ln1", "ln2", "lnf")}  # well clear of the tolerance
    model = nnx.merge(graphdef, random_params(cfg, seed=2, std=norm_biases))
    trained = jax.tree.map(np.asarray, nnx.state(model))
    shapes = jax.tree.map(jnp.shape, nnx.state(model))
    dec = M.for_decoding(model)
    assert isinstance(dec.blocks, nnx.List) and len(dec.blocks) == cfg.n_layer
    assert not dec.rt.cpu_layouts and not isinstance(model.blocks, nnx.List)
    assert M.for_decoding(dec) is dec
    # the dense weights are held [out, in] (gpt.ops.dense.decode_dense) unless decode_weights is ""
    assert dec.rt.decode_layout == bool(weights) and not model.rt.decode_layout
    if dec.rt.decode_layout:
        assert dec.blocks[0].w_o.shape == (cfg.n_embd, cfg.n_head, cfg.head_dim)
        assert dec.blocks[0].w_o.get_metadata()["out_sharding"] == ("embed", "heads", None)
    assert jax.tree.map(jnp.shape, nnx.state(model)) == shapes  # the stacked model's kept
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model), trained)
    if dec.rt.decode_layout and cfg.bias:  # folded into the products' biases (b_fc: dense MLPs)
        assert dec.blocks[0].ln1_bias is None
        if name == "gpt2":
            assert not np.allclose(dec.blocks[0].b_qkv[...], model.blocks.b_qkv[...][0])
    x = tokens(3, 12, cfg.vocab_size)
    call = nnx.jit(lambda m, x, cache: m(x, cache=cache))  # compiled: eager MoE ops are slow
    np.testing.assert_allclose(call(dec, x, None)[0], call(model, x, None)[0], rtol=1e-5, atol=1e-5)
    cache = M.init_cache(cfg, 3, 16, jnp.float32)
    (la, ca), (lb, cb) = (call(m, x[:, :8], cache) for m in (model, dec))
    (la, ca), (lb, cb) = (call(m, x[:, 8:9], c) for m, c in ((model, ca), (dec, cb)))
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
    # 24, 3 and 9 rows: the few-row products ("rows"; "dot": dots); 36 above: a dot either way
    (la, ca), (lb, cb) = (call(m, x[:, 9:12], c) for m, c in ((model, ca), (dec, cb)))
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cb.k_LBGKS, ca.k_LBGKS, rtol=1e-5, atol=1e-6)
    assert int(cb.index) == int(ca.index) == 12
    # one row (batch 1, one token): the norms' 1/std applied after the products (Block.norm_in)
    cache = M.init_cache(cfg, 1, 16, jnp.float32)
    (la, ca), (lb, cb) = (call(m, x[:1, :8], cache) for m in (model, dec))
    (la, ca), (lb, cb) = (call(m, x[:1, 8:9], c) for m, c in ((model, ca), (dec, cb)))
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "moe"])
def test_chunked_loss_is_the_same_loss(arch):
    """GPT.loss with loss_chunks (the head formed inside the loss, 3 slices of T = 8, the last
    padded), and with the loss's kernel over the whole unmasked logits (`cross_entropy_rows`),
    == the logits then cross_entropy, in value and in every gradient: a tied head (GPT-2), an
    untied one (Llama's w_head) and a mixture of experts through the training objective
    (capacity applied)."""
    from gpt import train
    cfg = tiny_model_config(vocab_size=61, **{
        "gpt2": {}, "moe": dict(n_expert=4, n_expert_per_token=2),
        "llama": dict(bias=False, pos_embedding="rope", norm="rmsnorm", mlp="swiglu",
                      tie_embeddings=False)}[arch])
    x = tokens(2, 8, 61)
    results = {}
    for chunks, kernel in ((1, ""), (3, ""), (1, "interpret")):  # the last: gpt/ops/xent_kernel.py
        model = make(cfg, loss_chunks=chunks, attention="reference", xent_kernel=kernel)
        assert model.rt.loss_chunks == chunks
        gd, params = nnx.split(model)
        fn = lambda p: train.objective(gd, p, x, x, moe=train.moe_lib.MoETraining(capacity_factor=1.25))[0]  # noqa: E731
        jaxpr = str(jax.make_jaxpr(fn)(params))
        assert ("_linear_ce" in jaxpr) == (chunks > 1)
        assert ("pallas_call" in str(jax.make_jaxpr(jax.grad(fn))(params))) == bool(kernel)  # it ran
        results[chunks, kernel] = jax.jit(jax.value_and_grad(fn))(params)
    la, ga = results[1, ""]
    for lb, gb in (results[3, ""], results[1, "interpret"]):
        np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), ga, gb)


def _same_objective_with_kernel(cfg, x, scan: bool, field: str, runs: bool, atol: float) -> None:
    """The training objective's value and every gradient with the Pallas kernel `field` of
    Runtime (in Pallas's interpreter) equal XLA's path, and the kernel runs exactly when `runs`."""
    from gpt import train
    results = {}
    for kernel in ("", "interpret"):
        gd, params = nnx.split(make(cfg, attention="reference", scan_layers=scan, **{field: kernel}))
        fn = lambda p: train.objective(gd, p, x, x, moe=train.moe_lib.MoETraining())[0]  # noqa: E731
        ran = "pallas_call" in str(jax.make_jaxpr(jax.grad(fn))(params))
        assert ran == (bool(kernel) and runs), (cfg, field, kernel)
        results[kernel] = jax.jit(jax.value_and_grad(fn))(params)
    (la, ga), (lb, gb) = results[""], results["interpret"]
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=atol), ga, gb)


def test_gelu_kernel_is_the_same_training_objective():
    """Runtime.gelu_kernel: GPT-2's MLP activation and its backward as gpt/ops/gelu_kernel.py's
    kernels (Pallas's interpreter here) give the training objective's value and every gradient of
    XLA's, unrolled and scanned; a block without GPT-2's tanh GELU (SwiGLU) keeps XLA's, and so
    does decoding (a few rows a step, never timed through them)."""
    x = tokens(2, 8, 61)
    for cfg in (tiny_model_config(vocab_size=61), tiny_model_config(vocab_size=61, mlp="swiglu")):
        for scan in (False, True):
            _same_objective_with_kernel(cfg, x, scan, "gelu_kernel", cfg.mlp == "gelu", atol=1e-6)
    model = make(tiny_model_config(vocab_size=61), attention="reference", gelu_kernel="interpret")
    cache = M.init_cache(model.cfg, 2, 16, jnp.float32)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: model(x, cache=cache))(x))


NORM_KERNEL_CONFIGS = {"gpt2": {}, "nobias": dict(bias=False),
                       "llama": dict(norm="rmsnorm", mlp="swiglu", pos_embedding="rope", bias=False, n_kv_head=1),
                       "moe": dict(n_layer=4, n_expert=4, n_expert_per_token=2, moe_every=2),
                       "dyt": dict(norm="dyt")}


@pytest.mark.parametrize("name", ci_first(list(NORM_KERNEL_CONFIGS), {"gpt2", "llama"}))
def test_norm_kernel_is_the_same_training_objective(name):
    """Runtime.norm_kernel: the norms' backward as gpt/ops/norm_kernel.py's kernel (Pallas's
    interpreter here), the stream's gradient added in it, gives the training objective's value and
    every gradient of XLA's, unrolled and scanned, for GPT-2's LayerNorm, one without biases,
    Llama's RMSNorm and a MoE model (whose router's norm keeps XLA's); DyT keeps XLA's."""
    x = tokens(2, 8, 61)
    for scan in (False, True) if name == "gpt2" else (False,):
        _same_objective_with_kernel(tiny_model_config(vocab_size=61, **NORM_KERNEL_CONFIGS[name]), x, scan,
                                    "norm_kernel", name != "dyt", atol=2e-6)


def test_norm_kernel_is_not_for_decoding_nor_lora_blocks():
    """Decoding keeps XLA's norms, and so do blocks with LoRA adapters (their rows feed the
    adapters too): the final norm's alone runs the kernel there."""
    x = tokens(2, 8, 61)
    model = make(tiny_model_config(vocab_size=61), attention="reference", norm_kernel="interpret")
    cache = M.init_cache(model.cfg, 2, 16, jnp.float32)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: model(x, cache=cache))(x))
    from gpt.lora import LoRAConfig
    cfg = tiny_model_config(vocab_size=61)
    lora = M.GPT(cfg, rngs=nnx.Rngs(0), runtime=tiny_runtime(cfg, attention="reference", norm_kernel="interpret"),
                 lora=LoRAConfig(4, 8.0, ("w_qkv",)))
    gd, params = nnx.split(lora)
    fn = lambda p: nnx.merge(gd, p).loss(x, x)[0]  # noqa: E731
    assert str(jax.make_jaxpr(jax.grad(fn))(params)).count("pallas_call") == 1


def test_norm_kernel_in_bf16_is_as_near_float32_as_xla():
    """In the GPU's bf16 settings the norm kernel's rows come in bf16, where XLA's path has them in
    float32 and each product rounds them: the same forward, gradients rounded in other places. They
    lie no further from float32's than XLA's path's do, for GPT-2's block and for GQA's (whose two
    products then sum their gradients in bf16)."""
    from helpers import bf16_gradient_errors
    x = tokens(2, 16, 61)
    gqa = dict(norm="rmsnorm", mlp="swiglu", pos_embedding="rope", bias=False, n_head=4, n_kv_head=2, n_embd=64)
    for kw in ({}, gqa):
        kernel_error, xla_error = bf16_gradient_errors(tiny_model_config(vocab_size=61, **kw), x,
                                                       dict(norm_kernel="interpret"), attention="reference")
        assert 0 < kernel_error <= 1.1 * xla_error, (kw, kernel_error, xla_error)


def test_chunked_loss_never_holds_the_logits():
    """The point of loss_chunks: the compiled training gradient's temporary memory shrinks, a
    [B, T, V] float32 array less, as the chunks' logits replace the whole (B x T x V = 8 x 64 x
    4096 here: 8 MB each)."""
    from gpt import train
    cfg = tiny_model_config(vocab_size=4096, block_size=64)
    x = tokens(8, 64, 4096)
    temp = {}
    for chunks in (1, 8):
        gd, params = nnx.split(make(cfg, loss_chunks=chunks))
        grad = jax.jit(jax.grad(lambda p: train.loss_fn(gd, p, x, x)))
        temp[chunks] = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
    assert temp[8] < temp[1] - 8 * 64 * 4096 * 4, temp


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "none"])
def test_decode_kernels_are_the_same_model(pos):
    """`Runtime.decode_kernels` (gpt/ops/decode_kernels.py, Pallas's interpreter here): for_decoding
    keeps w_o and w_proj [in, out] for them, one-row steps run the layers as the kernels and give
    the stacked model's logits and cache: from a left-padded start, into a cache whose last block of
    positions overlaps the one before (20 slots, blocks of 16), and (no positions: the cache rolls)
    past its slots and the window; a prompt and a batch of rows (the XLA layers, over the mixed
    layouts) still do."""
    cfg = tiny_model_config(pos_embedding=pos, block_size=16 if pos == "none" else 32)
    rt = tiny_runtime(cfg, decode_weights="dot", decode_kernels="interpret")
    graphdef = nnx.graphdef(M.abstract_model(cfg, runtime=rt))
    norm_biases = {f"{n}_bias": 0.5 for n in ("ln1", "ln2", "lnf")}
    model = nnx.merge(graphdef, random_params(cfg, seed=4, std=norm_biases))
    dec = M.for_decoding(model)
    D, H, K = cfg.n_embd, cfg.n_head, cfg.head_dim
    assert dec.blocks[0].w_o.shape == (H, K, D) and dec.blocks[0].w_proj.shape == (cfg.ffn, D)
    assert dec.blocks[0].w_fc.shape == (cfg.ffn, D) and dec.blocks[0].w_qkv.shape == (3, H, K, D)
    call = nnx.jit(lambda m, x, cache: m(x, cache=cache))
    x = tokens(3, 30, cfg.vocab_size)
    for start in (0, 3):  # row 0's real tokens from `start` on (left padding)
        cache = M.init_cache(cfg, 1, 20, jnp.float32, jnp.array([start]))
        (la, ca), (lb, cb) = (call(m, x[:1, :8], cache) for m in (model, dec))
        for t in range(8, 30 if pos == "none" else 20):  # the kernels' steps
            if t == 8:
                jaxpr = str(jax.make_jaxpr(lambda c: dec(x[:1, t:t + 1], cache=c))(cb))
                assert jaxpr.count("pallas_call") == 3 * cfg.n_layer
            (la, ca), (lb, cb) = (call(m, x[:1, t:t + 1], c) for m, c in ((model, ca), (dec, cb)))
            np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cb.k_LBGKS, ca.k_LBGKS, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cb.v_LBGSK, ca.v_LBGSK, rtol=1e-5, atol=1e-6)
        assert int(cb.index) == int(ca.index)
    cache = M.init_cache(cfg, 3, 16, jnp.float32)
    (la, ca), (lb, cb) = (call(m, x[:, :8], cache) for m in (model, dec))
    (la, _), (lb, _) = (call(m, x[:, 8:9], c) for m, c in ((model, ca), (dec, cb)))
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)


def test_decode_kernels_problem_names_what_they_lack():
    gpt2 = ModelConfig(**{k: v for k, v in PRESETS["gpt2"].items() if k in ModelConfig.__dataclass_fields__})
    assert M.decode_kernels_problem(gpt2) is None
    assert M.decode_kernels_problem(tiny_model_config()) is None
    assert M.decode_kernels_problem(tiny_model_config(norm="rmsnorm")) == "--norm=rmsnorm"
    assert M.decode_kernels_problem(tiny_model_config(pos_embedding="rope")) == "--pos_embedding=rope"
    assert M.decode_kernels_problem(tiny_model_config(pos_embedding="none")) is None
    assert M.decode_kernels_problem(ModelConfig(n_embd=1600, n_head=25)).startswith("n_embd 1600")  # GPT-2 XL
    assert M.decode_kernels_problem(tiny_model_config(n_head=4, n_kv_head=2)).startswith("grouped-query")
    assert M.decode_kernels_problem(tiny_model_config(n_embd=48, n_head=2)) == \
        "heads 24 wide (2 of them, n_embd 48)"
    # a model the kernels cannot run decodes through XLA's layers, whatever the runtime says
    cfg = tiny_model_config(norm="rmsnorm")
    dec = M.for_decoding(make(cfg, decode_weights="dot", decode_kernels="interpret"))
    cache = M.init_cache(cfg, 1, 8, jnp.float32)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda c: dec(tokens(1, 1, 65), cache=c))(cache))


@pytest.mark.parametrize("D", [64, 256])
def test_dyt_starts_at_a_norms_scale(D):
    """DyT's first norm sees the embeddings scaled by sqrt(D) (`embed_scale`) through alpha =
    1 / (0.02 sqrt(D)): tanh of a unit-scale input, as a norm gives. With the paper's alpha of 0.5
    and no scale it gave about 1% of that, and the default preset stalled at the unigram loss."""
    cfg = tiny_model_config(norm="dyt", n_embd=D, vocab_size=61)
    model = tiny_gpt(cfg)
    x_BTD = model.wte[...][tokens(4, 16, 61)] * model.embed_scale[...]
    alpha = model.blocks.ln1_alpha[...][0]  # the first block's (the blocks are stacked)
    assert np.isclose(alpha, M.dyt_alpha(D)) and np.isclose(model.embed_scale[...], D ** 0.5)
    h = M.dyt(x_BTD, alpha, jnp.ones((D,)), None)
    rms = float(jnp.sqrt(jnp.mean(h ** 2)))
    assert 0.5 < rms < 0.8, rms  # E[tanh(z)^2] ~ 0.39 for z ~ N(0, 1)
    held = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert M.num_params(cfg) == held - (cfg.padded_vocab_size - cfg.vocab_size) * D  # embed_scale counted
