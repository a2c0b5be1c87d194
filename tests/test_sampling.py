import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import run_on_cpu_devices, tiny_model_config
from gpt.model import GPT, init_cache
from bench.nocache import full_recompute_generate
from gpt.sampling import (SamplingSettings, Sampler, filter_logits,
                          generate, left_pad, sample_token)


@pytest.fixture(scope="module")
def model():
    return GPT(tiny_model_config(block_size=96), rngs=nnx.Rngs(3))


def greedy(n, eot=None):
    return SamplingSettings(max_new_tokens=n, temperature=0.0, eot_id=eot)


def test_cached_greedy_equals_full_recompute(model):
    """64 greedy tokens, several prompt lengths in one batch (left padding), token for token."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 65, size=n).tolist() for n in (1, 5, 17)]
    got = Sampler(model, greedy(64), chunk=16).generate(prompts, jax.random.key(0))
    for p, row in zip(prompts, got):
        ref = full_recompute_generate(model, p, jax.random.key(0), greedy(64))
        assert row == ref


def test_cached_logits_match_full_forward(model):
    prompt = jnp.array([[3, 14, 15, 9, 2, 6]], jnp.int32)
    tokens = generate(model, prompt, jax.random.key(0), greedy(20))
    full, _ = nnx.jit(lambda m, x: m(x))(model, tokens)
    # Re-run the cached path step by step and compare each step's logits with the full pass
    # (compiled once per shape: eagerly, every op compiles on first use).
    step = nnx.jit(lambda m, x, cache: m(x, cache=cache))
    cache = init_cache(model.cfg, 1, 32, model.rt.dtype)
    logits, cache = step(model, tokens[:, :6], cache)
    steps = [logits[:, -1]]
    for t in range(6, tokens.shape[1] - 1):
        logits, cache = step(model, tokens[:, t:t + 1], cache)
        steps.append(logits[:, -1])
    cached = jnp.stack(steps, axis=1)
    assert float(jnp.abs(cached[..., :65] - full[:, 5:-1, :65]).max()) < 1e-4


def test_past_block_size_matches_nanogpt_crop():
    """Beyond block_size every token is conditioned on exactly the last block_size tokens."""
    model = GPT(tiny_model_config(block_size=16), rngs=nnx.Rngs(5))
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    got = Sampler(model, greedy(40), chunk=8).generate(prompts, jax.random.key(0))
    for p, row in zip(prompts, got):
        assert row == full_recompute_generate(model, p, jax.random.key(0), greedy(40))
    long_prompt = list(range(1, 30))  # longer than block_size: cropped like nanoGPT (learned positions)
    got = Sampler(model, greedy(10)).generate([long_prompt], jax.random.key(0))[0]
    assert got == full_recompute_generate(model, long_prompt, jax.random.key(0), greedy(10))


@pytest.mark.parametrize("pos", ["rope", "none"])
def test_rolling_cache_takes_a_long_prompt_through_its_window(pos):
    """A model whose cache rolls decodes with sliding-window attention of width block_size in every
    layer (deeper layers carry what left the window, as in Mistral); a prompt longer than that goes
    through the same window: its last logits equal feeding it one token at a time through a ring,
    rows of other lengths included, and where the prompt ends and generation begins changes nothing."""
    from gpt.sampling import fill_cache
    model = GPT(tiny_model_config(block_size=16, pos_embedding=pos, n_layer=3), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 65, 40).tolist(), rng.integers(0, 65, 23).tolist()]
    prompt_BP, start_B = left_pad(prompts)
    last_BV, cache = fill_cache(model, prompt_BP, start_B, 16, jnp.float32)
    assert cache.slots == 16 and int(cache.index) == 40
    graph, params = nnx.split(model)
    step = jax.jit(lambda params, t, ring: nnx.merge(graph, params)(t, cache=ring))
    for b, p in enumerate(prompts):
        ring = init_cache(model.cfg, 1, 16, jnp.float32)
        for t in p:
            logits, ring = step(params, jnp.array([[t]]), ring)
        np.testing.assert_allclose(last_BV[b, :65], logits[0, -1, :65], atol=1e-5)
    one = Sampler(model, greedy(16)).generate(prompts, jax.random.key(0))
    half = Sampler(model, greedy(8)).generate(prompts, jax.random.key(0))
    rest = Sampler(model, greedy(8)).generate([p + h for p, h in zip(prompts, half)], jax.random.key(0))
    assert one == [h + r for h, r in zip(half, rest)]


@pytest.mark.parametrize("pos", ["learned", "none"])
def test_decode_kernels_equal_full_recompute(pos):
    """sample.py --decode_kernels (Pallas's interpreter here): one row's greedy tokens from the
    kernels' layers, before block_size and past it, are the full recompute's (learned positions:
    the window recomputed by XLA's layers), or the XLA layers' (no positions: the cache rolls, the
    kernels attend over the ring); a sampled row is the XLA layers' (same key)."""
    from helpers import random_params, tiny_runtime
    from gpt.model import abstract_model
    cfg = tiny_model_config(block_size=16, pos_embedding=pos)
    std = {"wte": 1.0, "wpe": 1.0, "w_qkv": 1.0, "w_fc": 1.0, "w_o": 0.5, "w_proj": 0.5}  # varied tokens
    params = random_params(cfg, seed=7, std=std)
    models = {k: nnx.merge(nnx.graphdef(abstract_model(cfg, runtime=tiny_runtime(
        cfg, decode_weights="dot", decode_kernels=k))), params) for k in ("", "interpret")}
    prompt = [1, 2, 3, 4, 5]
    sampler = Sampler(models["interpret"], greedy(24), chunk=8)
    state = sampler.start([prompt], jax.random.key(0))
    jaxpr = str(jax.make_jaxpr(lambda p, st: sampler._decode.__wrapped__(p, st, 8))(sampler.params, state))
    assert jaxpr.count("pallas_call") == 3 * cfg.n_layer  # the kernels run (once, in the loop's body)
    got = sampler.generate([prompt], jax.random.key(0))[0]
    if pos == "learned":
        assert got == full_recompute_generate(models[""], prompt, jax.random.key(0), greedy(24))
    else:  # a rolling cache is not a recomputed window: the XLA layers' rolling cache
        assert got == Sampler(models[""], greedy(24)).generate([prompt], jax.random.key(0))[0]
    assert len(set(got)) >= 3
    sampled = SamplingSettings(max_new_tokens=12, temperature=1.0, top_k=20)
    rows = [Sampler(m, sampled).generate([prompt], jax.random.key(1))[0] for m in models.values()]
    assert rows[0] == rows[1]


def test_with_decode_kernels_says_why_not():
    """sample.py --decode_kernels's checks, each a one-line error (the bad-input matrix runs the
    off-a-GPU one), and the model it returns: a twin set to run the Triton kernels."""
    from gpt.errors import UserError
    from gpt.sampling import decode_kernels_by_default, with_decode_kernels
    gpt2, rope = GPT(tiny_model_config(), rngs=nnx.Rngs(0)), GPT(tiny_model_config(pos_embedding="rope"),
                                                                  rngs=nnx.Rngs(0))
    for model, rows, draft, backend, why in [(gpt2, 1, False, "cpu", "needs an NVIDIA GPU"),
                                             (gpt2, 2, False, "gpu", "--num_samples=1"),
                                             (gpt2, 1, True, "gpu", "no --draft_out_dir"),
                                             (rope, 1, False, "gpu", "this model has --pos_embedding=rope")]:
        with pytest.raises(UserError, match=why):
            with_decode_kernels(model, rows, draft, backend)
        assert not decode_kernels_by_default(model, rows, draft, backend)  # without the flag: XLA's
    assert decode_kernels_by_default(gpt2, 1, False, "gpu")  # sample.py's default where they run
    twin = with_decode_kernels(gpt2, 1, False, "gpu")
    assert twin.rt.decode_kernels == "triton" and gpt2.rt.decode_kernels == "" and twin.wte is gpt2.wte


def rope_window_greedy(model, prompt, n):
    """Greedy tokens where each is predicted from the last block_size tokens at their own positions
    (counted from the prompt's first token, or from its crop to block_size), recomputed each time
    by one full forward (a window shorter than block_size is left-padded and masked)."""
    W = model.cfg.block_size
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, window_1W, start_1):
        m = nnx.merge(graphdef, state)
        logits, _ = m(window_1W, cache=init_cache(m.cfg, 1, W, jnp.float32, start_1))
        return jnp.argmax(logits[0, -1])

    first = max(0, len(prompt) - W)
    tokens = list(prompt)
    for _ in range(n):
        window = tokens[-W:]
        offset = len(tokens) - len(window) - first  # positions offset .. offset + len(window) - 1
        pad = W - len(window)  # only while the text is shorter than W, when offset is 0
        start = pad - offset  # slot of position 0: padding before it is masked
        tokens.append(int(next_token(state, jnp.array([[0] * pad + window], jnp.int32),
                                     jnp.array([start], jnp.int32))))
    return tokens[len(prompt):]


@pytest.mark.parametrize("pos", ["rope", "none"])
def test_rope_cache_rolls_past_block_size(pos):
    """RoPE (and no positions): past block_size the cache is a ring of the last block_size tokens at
    their absolute positions; equal to recomputing that window at the same positions."""
    cfg = tiny_model_config(block_size=16, pos_embedding=pos, norm="rmsnorm", mlp="swiglu",
                            n_kv_head=2, n_head=4)
    model = GPT(cfg, rngs=nnx.Rngs(5))
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    sampler = Sampler(model, greedy(40), chunk=8)
    state = sampler.start(prompts, jax.random.key(0))
    assert state.cache.slots == 16  # never more than block_size slots
    for state in sampler.chunks(state):
        pass
    assert int(state.cache.index) == 5 + 40  # every step was a cached one (no recompute)
    for p, row in zip(prompts, sampler.new_tokens(state, prompts)):
        assert row == rope_window_greedy(model, p, 40)
    long_prompt = list(range(1, 30))
    got = Sampler(model, greedy(10)).generate([long_prompt], jax.random.key(0))[0]
    assert got == rope_window_greedy(model, long_prompt, 10)


def test_top_p_hand_built():
    probs = np.array([0.38, 0.18, 0.15, 0.12, 0.10, 0.07])
    logits = jnp.log(jnp.array([probs], jnp.float32))
    kept = jax.nn.softmax(filter_logits(logits, 1.0, 0, 0.5))[0]
    np.testing.assert_allclose(np.asarray(kept[:2]), [0.38 / 0.56, 0.18 / 0.56], atol=1e-6)
    assert abs(float(kept[0]) - 0.679) < 1e-3 and abs(float(kept[1]) - 0.321) < 1e-3
    assert float(kept[2:].sum()) == 0.0
    # p reached exactly by the first token: only it survives.
    only = jax.nn.softmax(filter_logits(logits, 1.0, 0, 0.38))[0]
    assert float(only[0]) == pytest.approx(1.0)


def test_top_k_exactly_k_with_ties():
    logits = jnp.array([[1.0, 3.0, 3.0, 3.0, 0.5, 3.0]])
    out = filter_logits(logits, 1.0, 2, 1.0)[0]
    assert int(jnp.isfinite(out).sum()) == 2
    assert np.isfinite(np.asarray(out))[[1, 2]].all()  # ties go to the lower index
    both = filter_logits(logits, 1.0, 3, 0.5)[0]  # top-k first, then top-p on what is left
    assert int(jnp.isfinite(both).sum()) == 2


def test_temperature_scales_before_filtering():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    hot = jax.nn.softmax(filter_logits(logits, 2.0, 0, 1.0))[0]
    expected = np.sqrt([0.5, 0.3, 0.2]) / np.sqrt([0.5, 0.3, 0.2]).sum()
    np.testing.assert_allclose(np.asarray(hot), expected, rtol=1e-5)


def test_chi_squared_frequencies_match_renormalized_distribution():
    from scipy.stats import chisquare
    probs = np.array([0.38, 0.18, 0.15, 0.12, 0.10, 0.07])
    logits = jnp.log(jnp.array(probs, jnp.float32))
    n = 40_000
    s = SamplingSettings(temperature=1.0, top_k=4, top_p=0.7)
    draws = sample_token(jax.random.key(0), jnp.broadcast_to(logits, (n, 6)), s)
    counts = np.bincount(np.asarray(draws), minlength=6)
    kept = probs[:3] / probs[:3].sum()  # top-4, then p=0.7 keeps 0.38+0.18+0.15
    assert counts[3:].sum() == 0
    stat, pvalue = chisquare(counts[:3], kept * n)
    assert pvalue > 1e-3, (counts, stat)


def test_padded_vocab_never_drawn(model):
    s = SamplingSettings(max_new_tokens=50, temperature=5.0)
    out = Sampler(model, s).generate([[1, 2]] * 8, jax.random.key(1))
    assert max(max(r) for r in out) < 65


def test_same_seed_same_tokens_and_greedy_is_argmax(model):
    s = SamplingSettings(max_new_tokens=20, temperature=0.9, top_k=10, top_p=0.9)
    a = Sampler(model, s).generate([[5, 6, 7]], jax.random.key(7))
    b = Sampler(model, s).generate([[5, 6, 7]], jax.random.key(7))
    c = Sampler(model, s).generate([[5, 6, 7]], jax.random.key(8))
    assert a == b and a != c
    logits = jax.random.normal(jax.random.key(0), (4, 65))
    np.testing.assert_array_equal(np.asarray(sample_token(jax.random.key(0), logits, greedy(1))),
                                  np.asarray(jnp.argmax(logits, -1)))


def test_stops_after_eot(model):
    # Pick as "eot" the token greedy decoding emits third, so the row must stop there.
    free = Sampler(model, greedy(10)).generate([[1, 2, 3]], jax.random.key(0))[0]
    eot = free[2]
    out = Sampler(model, greedy(10, eot=eot), chunk=4).generate([[1, 2, 3]], jax.random.key(0))[0]
    assert out[-1] == eot and out == free[:free.index(eot) + 1]


def test_zero_new_tokens_leave_each_row_empty(model):
    """max_new_tokens=0 (sample.py then prints the prompt alone): every row's new tokens are none;
    finding the rows' ends raised numpy's "argmax of an empty sequence" (a traceback)."""
    for prompts in ([[1, 2, 3]], [[1, 2], [3, 4, 5]]):
        assert Sampler(model, greedy(0, eot=0)).generate(prompts, jax.random.key(0)) == [[]] * len(prompts)


def test_any_eos_id_ends_a_row(model):
    """A model's other EOS ids (stop_ids) end a row as eot does; eot_id fills the row after."""
    prompts = [[5, 6, 7], [40, 2]]
    free = Sampler(model, greedy(12)).generate(prompts, jax.random.key(0))
    end = free[0][-1]  # row 0's last token: it ends there, after others; row 1 never emits it
    assert free[0].index(end) > 0 and end not in free[1]
    unused = min(set(range(65)) - set(free[0]) - set(free[1]))
    s = SamplingSettings(max_new_tokens=12, temperature=0.0, eot_id=unused, stop_ids=(end,))
    assert s.end_ids == (unused, end)
    out = Sampler(model, s, chunk=5).generate(prompts, jax.random.key(0))
    for row, want in zip(out, free):
        assert row == (want[:want.index(end) + 1] if end in want else want)
    prompt_BP, start_B = left_pad(prompts)
    tokens = np.asarray(generate(model, prompt_BP, jax.random.key(0), s, start_B))[0, 3:]
    n = free[0].index(end) + 1
    assert tokens.tolist() == free[0][:n] + [unused] * (12 - n)  # filled with eot after the end


def test_generate_is_usable_inside_jit(model):
    gd, params = nnx.split(model)
    prompt, start = left_pad([[1, 2, 3], [4]])

    @jax.jit
    def f(params, prompt, start, key):
        return generate(nnx.merge(gd, params), prompt, key, greedy(8), start)

    out = f(params, prompt, start, jax.random.key(0))
    assert out.shape == (2, 11)


_DECODE_HLO = """
import json, jax
from flax import nnx
from helpers import random_params, tiny_model_config
from gpt.model import abstract_model
from gpt.sampling import SamplingSettings, Sampler
cfg = tiny_model_config(block_size=96)
model = nnx.merge(nnx.graphdef(abstract_model(cfg)), random_params(cfg, seed=3))
out = {}
for batch in (1, 3):
    sampler = Sampler(model, SamplingSettings(max_new_tokens=8, temperature=1.0, top_k=5))
    state = sampler.start([[1, 2, 3]] * batch, jax.random.key(0))
    out[batch] = {"hlo": sampler._decode.lower(sampler.params, state, 8).compile().as_text(),
                  "caches": [list(state.cache.k_LBGKS.shape), list(state.cache.v_LBGSK.shape)],
                  "weights": [a.shape for a in jax.tree.leaves(sampler.params) if a.ndim >= 2]}
print(json.dumps(out))
"""


def test_decode_loop_reads_and_writes_the_cache_and_weights_in_place():
    """The compiled decode loop of a tiny model, for 1 row (XLA's matrix-vector dot) and 3 (the
    few-row fusion), as a user's run compiles it (the tests' XLA flags change a few fusions:
    tests/helpers.py), moves neither the cache nor a weight:
    - attention reads each layer's keys [B, G, K, S] and values [B, G, S, K] as they are held: no
      transposed copy of a layer's cache (held [B, S, G, K], XLA:CPU transposed every layer's keys
      and values on every step; BENCHMARKS.md);
    - each token's keys/values are written into the cache without copying the whole cache (such
      copies, twice per token, took about a sixth of a GPT-2 decode step on CPU);
    - no weight is transposed or copied: the decoding layers hold them [out, in] once
      (gpt.model.for_decoding) and every product reads them in place (an einsum over the
      unflattened weight made XLA copy w_qkv and w_o back to [in, out] on every token)."""
    compiled = run_on_cpu_devices(_DECODE_HLO, 1, as_users=True)
    assert set(compiled) == {"1", "3"}
    for batch, got in compiled.items():
        hlo, (k_shape, v_shape) = got["hlo"], got["caches"]
        ops = re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} (?:copy|transpose)\(", hlo)
        moved = [dims for dims in ops if sorted(int(d) for d in dims.split(",") if d) == sorted(v_shape[1:])]
        assert not moved, (batch, "a layer's cache transposed", moved)
        for shape in (k_shape, v_shape):
            cache_type = "f32[{}]".format(",".join(map(str, shape)))
            copies = [line for line in hlo.splitlines() if f"= {cache_type}" in line and " copy(" in line]
            assert not copies, (batch, "the whole cache copied", copies[:2])
        weights = {tuple(sorted(shape)) for shape in got["weights"]}
        moved = [line for line in hlo.splitlines() if (" copy(" in line or " transpose(" in line)
                 and (m := re.search(r"= f32\[([\d,]+)\]", line))
                 and tuple(sorted(int(d) for d in m.group(1).split(","))) in weights]
        assert not moved, (batch, "a weight moved", moved[:2])


def test_settings_and_prompts_are_checked_in_the_python_api_too():
    """SamplingSettings takes the command line's checks: a negative temperature turned the padded
    vocabulary's -inf into +inf and drew padding ids; an empty row divided by zero."""
    from gpt.errors import UserError
    for kw, field in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                      ({"top_k": -3}, "top_k"), ({"max_new_tokens": -1}, "max_new_tokens")):
        with pytest.raises(UserError, match=field):
            SamplingSettings(**kw)
    for prompts in ([[]], [[1], []], []):
        with pytest.raises(UserError, match="prompt is empty"):
            left_pad(prompts)


def test_a_prompt_file_is_read_as_the_corpus_is(tmp_path):
    """CRLF and CR line ends in --prompt_file reach the tokenizer unchanged and an editor's UTF-8
    byte-order mark is dropped, as the corpus reader does: text mode turned line ends into "\n",
    another prompt than the file's, and the mark was a character a char alphabet refused."""
    from types import SimpleNamespace
    from gpt.tokenizer import CharTokenizer
    from sample import read_prompt
    (tmp_path / "p.txt").write_bytes(b"\xef\xbb\xbfab\r\nb\ra")
    tok = CharTokenizer("\n\rab")
    cfg = SimpleNamespace(prompt="", prompt_file=str(tmp_path / "p.txt"))
    assert read_prompt(cfg, tok) == tok.encode("ab\r\nb\ra")


def test_a_prompt_id_outside_the_vocabulary_is_refused():
    """A tokenizer.json whose template names a special id its vocabulary lacks made prompts the
    embedding lookup silently clamps: one line naming the template instead."""
    from types import SimpleNamespace
    from tokenizers import Tokenizer, models, processors
    from gpt.errors import UserError
    from gpt.tokenizer import HFTokenizer
    from sample import read_prompt
    hf = Tokenizer(models.WordLevel({"a": 0, "<s>": 1}, unk_token="<s>"))
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 999_999)])
    tok = HFTokenizer(hf, hf, {"vocab_size": 2, "prompt_template": True})
    with pytest.raises(UserError, match="^the tokenizer made --prompt into id 999999, outside its 2 tokens"):
        read_prompt(SimpleNamespace(prompt="a", prompt_file=""), tok)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert read_prompt(SimpleNamespace(prompt="a", prompt_file=""), tok) == [1, 0]


def test_an_empty_prompt_starts_from_a_newline_or_says_what_to_pass(capsys):
    """A char model's alphabet may lack the newline an empty prompt starts from: one line saying
    to pass --prompt, where the char tokenizer's error named a '\\n' the user never typed."""
    from types import SimpleNamespace
    from gpt.errors import UserError
    from gpt.tokenizer import CharTokenizer
    from sample import read_prompt
    cfg = SimpleNamespace(prompt="", prompt_file="")
    assert read_prompt(cfg, CharTokenizer("\nab")) == [0] and "newline" in capsys.readouterr().err
    with pytest.raises(UserError, match="no newline to start from; pass --prompt"):
        read_prompt(cfg, CharTokenizer("ab"))
    with pytest.raises(UserError, match="^--prompt: text contains 1 character"):
        read_prompt(SimpleNamespace(prompt="abc", prompt_file=""), CharTokenizer("ab"))
    with pytest.raises(UserError, match="^--prompt is not valid UTF-8"):  # a byte 0xff on argv
        read_prompt(SimpleNamespace(prompt="ab\udcffcd", prompt_file=""), CharTokenizer("abcd"))
