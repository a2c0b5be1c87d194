"""Speculative decoding (gpt/speculative.py): exactly the target's output, checked against the
target's own greedy decoding, the target's filtered distributions (chi-squared), and a fresh
prefill of the accepted text; sample.py --draft_out_dir end to end and its bad inputs."""
from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx
from scipy.stats import chisquare

from helpers import CHARS, REPO, ci_first, run_cli, save_checkpoint, tiny_model_config
from gpt.model import GPT, init_cache
from gpt.sampling import SamplingSettings, generate, left_pad
from gpt.speculative import (SpeculativeSampler, generate_speculative, output_tokens, probs, speculate,
                             verify)

PROMPTS = [[5], [12, 40, 7, 3, 33], [int(x) for x in np.random.default_rng(0).integers(0, 65, 17)]]


def greedy(n, eot=None, stops=()):
    return SamplingSettings(max_new_tokens=n, temperature=0.0, eot_id=eot, stop_ids=stops)


def perturbed(model: GPT, scale: float, seed: int = 1) -> GPT:
    """The model with noise added to every weight: a draft that agrees with it part of the time."""
    gd, params = nnx.split(model)
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)  # numpy: no per-shape compilation of a random kernel
    return nnx.merge(gd, jax.tree.unflatten(tree, [p + scale * rng.standard_normal(p.shape, np.float32)
                                                   for p in leaves]))


@pytest.fixture(scope="module")
def pair():
    target = GPT(tiny_model_config(block_size=96), rngs=nnx.Rngs(3))
    return target, perturbed(target, 0.014)


def run(target, draft, prompts, s, k, key=jax.random.key(0)):
    """The final state of speculative decoding of `prompts` (left-padded), jitted."""
    prompt_BP, start_B = left_pad(prompts)
    return jax.jit(lambda p, b, key: speculate(target, draft, p, key, s, k, b))(prompt_BP, start_B, key)


def plain_greedy(target, prompts, n, eot=None, stops=()) -> np.ndarray:
    """The target's own greedy output (plain cached decoding, left-padded layout)."""
    f = jax.jit(lambda p, b: generate(target, p, jax.random.key(0), greedy(n, eot, stops), b))
    return np.asarray(f(*left_pad(prompts)))


@pytest.fixture(scope="module")
def greedy_64(pair):
    return plain_greedy(pair[0], PROMPTS, 64)


# ----------------------------------------------------------------------------- greedy: the target's own output


@pytest.mark.parametrize("k", ci_first([1, 3, 5], {1, 5}))
def test_greedy_equals_target_greedy(pair, greedy_64, k):
    """64 greedy tokens, three prompt lengths in one batch: token for token the target's greedy
    output, with the rows accepting different numbers of draft tokens."""
    target, draft = pair
    st = run(target, draft, PROMPTS, greedy(64), k)
    np.testing.assert_array_equal(np.asarray(output_tokens(st, None, k)[:, 1:]), greedy_64)
    accepted, drafted = np.asarray(st.accepted_B), np.asarray(st.drafted_B)
    assert 0 < accepted.sum() < drafted.sum(), (accepted, drafted)
    assert len(set(zip(accepted.tolist(), drafted.tolist()))) > 1, (accepted, drafted)  # rows differ
    assert int(st.rounds) < 64 and (np.asarray(st.length_B) >= 1 + 17 + 64).all()


def test_greedy_past_block_size_learned_positions():
    """A learned-position target past block_size recomputes its window per token (nanoGPT's crop,
    as plain sampling does) once a round no longer fits; a draft of another shape and block_size.
    Equal to the plain sampler."""
    target = GPT(tiny_model_config(block_size=16), rngs=nnx.Rngs(5))
    draft = GPT(tiny_model_config(block_size=12, n_layer=1, n_embd=16), rngs=nnx.Rngs(6))
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    st = run(target, draft, prompts, greedy(40), 3)
    assert not bool(st.speculating) and SpeculativeSampler.stats(st)["drafted"] > 0  # both kinds of round
    np.testing.assert_array_equal(np.asarray(output_tokens(st, None, 3)[:, 1:]), plain_greedy(target, prompts, 40))


def test_greedy_rope_rolls_past_block_size():
    """RoPE target and draft: the caches roll (k spare slots), every round stays speculative, and
    the output is the plain sampler's, which rolls its cache the same way (a prompt longer than
    block_size cropped as it crops it)."""
    rope = dict(pos_embedding="rope", norm="rmsnorm", mlp="swiglu", n_head=4, n_kv_head=2)
    target = GPT(tiny_model_config(block_size=16, **rope), rngs=nnx.Rngs(5))
    draft = perturbed(target, 0.004)
    prompts = [list(range(1, 30)), [1, 2, 3, 4, 5], [7, 8]]
    st = run(target, draft, prompts, greedy(40), 3)
    assert bool(st.speculating) and st.target.slots == 16 + 3
    assert SpeculativeSampler.stats(st)["accepted"] > 0
    np.testing.assert_array_equal(np.asarray(output_tokens(st, None, 3)[:, 1:]), plain_greedy(target, prompts, 40))


@pytest.mark.parametrize("as_stop_id", [False, True])
def test_end_of_text_ends_a_row(pair, greedy_64, as_stop_id):
    """A row ends after the end-of-text token, or after one of a model's other EOS ids, and the
    output repeats end-of-text after it, as plain decoding does."""
    target, draft = pair
    P = greedy_64.shape[1] - 64
    end = int(greedy_64[1, P + 4])  # the token the second row emits fifth
    unused = min(set(range(65)) - set(greedy_64[:, P:P + 30].ravel().tolist()))
    eot, stops = (unused, (end,)) if as_stop_id else (end, ())
    st = run(target, draft, PROMPTS, greedy(30, eot, stops), 4)
    want = plain_greedy(target, PROMPTS, 30, eot, stops)
    np.testing.assert_array_equal(np.asarray(output_tokens(st, eot, 4)[:, 1:]), want)
    rows = SpeculativeSampler(target, draft, greedy(30, eot, stops), 4).new_tokens(st, PROMPTS)
    assert rows[1][-1] == end and len(rows[1]) <= 5 and bool(st.done_B[1])
    for row, full in zip(rows, greedy_64[:, P:P + 30].tolist()):
        assert row == (full[:full.index(end) + 1] if end in full else full)


def test_sampler_chunks_equal_one_call(pair):
    """Streaming a few rounds per call gives the same tokens as one jitted call with the same key."""
    target, draft = pair
    s = SamplingSettings(max_new_tokens=24, temperature=0.9, top_k=20, top_p=0.95)
    prompt_BP, start_B = left_pad(PROMPTS)
    (gd_t, p_t), (gd_d, p_d) = nnx.split(target), nnx.split(draft)

    @jax.jit  # generate_speculative is pure: the parameters may be traced arguments
    def f(p_t, p_d, prompt_BP, start_B, key):
        return generate_speculative(nnx.merge(gd_t, p_t), nnx.merge(gd_d, p_d), prompt_BP, key, s, 3,
                                    start_B)
    whole = np.asarray(f(p_t, p_d, prompt_BP, start_B, jax.random.key(7)))
    assert whole.shape == (3, 17 + 24)
    sampler = SpeculativeSampler(target, draft, s, 3, rounds=2)
    st = sampler.start(PROMPTS, jax.random.key(7))
    n = 0
    for st in sampler.chunks(st):
        n += 1
    assert n > 2
    P = prompt_BP.shape[1]
    assert sampler.new_tokens(st, PROMPTS) == whole[:, P:].tolist()


# ----------------------------------------------------------------------------- caches after a rejection


def test_caches_after_rejection_equal_fresh_prefill(pair):
    """After rounds with rejections, each row's cached keys/values equal a fresh prefill of the text
    it kept (the target's: all but its last token; the draft's: all but its last two)."""
    target, draft = pair
    s = SamplingSettings(max_new_tokens=12, temperature=0.3)
    st = run(target, draft, PROMPTS, s, 4, jax.random.key(3))
    accepted, drafted = np.asarray(st.accepted_B), np.asarray(st.drafted_B)
    assert (accepted < drafted).sum() >= 2 and (accepted > 0).all(), (accepted, drafted)
    for model, cache, behind in ((target, st.target, 1), (draft, st.draft, 2)):
        n_B = np.asarray(st.length_B) - behind
        np.testing.assert_array_equal(np.asarray(cache.index), n_B)
        # One prefill of every row's text up to the longest: causal, so later tokens change nothing.
        empty = init_cache(model.cfg, 3, cache.slots, jnp.float32, st.start_B)
        fresh = jax.jit(lambda tokens, c: model(tokens, cache=c)[1])(st.tokens_BN[:, :n_B.max()], empty)
        for b, (n, start) in enumerate(zip(n_B, np.asarray(st.start_B))):
            for got, want, axis in ((cache.k_LBGKS, fresh.k_LBGKS, -1), (cache.v_LBGSK, fresh.v_LBGSK, -2)):
                held = [np.take(np.asarray(a[:, b]), np.arange(start, n), axis=axis) for a in (got, want)]
                np.testing.assert_allclose(*held, atol=2e-5)


# ----------------------------------------------------------------------------- the acceptance rule


P_TOY = np.array([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
                  [0.05, 0.40, 0.10, 0.25, 0.15, 0.05],
                  [0.10, 0.10, 0.10, 0.30, 0.30, 0.10],
                  [0.50, 0.05, 0.05, 0.10, 0.10, 0.20]])  # the target at K+1 = 4 positions
Q_TOY = np.array([[0.10, 0.40, 0.05, 0.30, 0.05, 0.10],
                  [0.30, 0.20, 0.20, 0.10, 0.10, 0.10],
                  [0.02, 0.18, 0.50, 0.10, 0.10, 0.10]])  # the draft at K = 3 positions
SETTINGS = {"plain": SamplingSettings(temperature=1.0),
            "temperature": SamplingSettings(temperature=0.6),
            "top-k": SamplingSettings(temperature=1.0, top_k=4),
            "top-p": SamplingSettings(temperature=1.3, top_p=0.8),
            "top-k-top-p": SamplingSettings(temperature=0.8, top_k=5, top_p=0.7)}


def toy_round(key, n: int, s: SamplingSettings, p=P_TOY, q=Q_TOY):
    """n independent rounds on toy logits (p [K+1, V] and q [K, V], or one of each per row):
    drafts drawn from the filtered q, then `verify`."""
    key_draft, key_verify = jax.random.split(key)
    p_logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, *p.shape[-2:]))
    q_logits = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (n, *q.shape[-2:]))
    q_filtered = probs(q_logits, s)
    draft = jax.random.categorical(key_draft, jnp.log(q_filtered), axis=-1).astype(jnp.int32)
    kept, nxt = verify(key_verify, p_logits, q_logits, draft, s)
    return np.asarray(draft), np.asarray(kept), np.asarray(nxt)


def assert_distributed_as(counts: np.ndarray, want: np.ndarray):
    """Chi-squared goodness of fit over the cells `want` gives mass; none outside them."""
    n, want = counts.sum(), np.asarray(want, np.float64)
    support = want > 0
    assert counts[~support].sum() == 0, (counts, want)
    stat, pvalue = chisquare(counts[support], want[support] / want[support].sum() * n)
    assert pvalue > 1e-3, (counts, want * n, stat)


# CI: no filter, and top-k with top-p (both filters at once)
@pytest.mark.parametrize("name", ci_first(list(SETTINGS), {"plain", "top-k-top-p"}))
def test_first_token_distributed_as_filtered_target(name):
    """40,000 rounds: the round's first token (the first draft token if kept, else the
    replacement) is distributed as the target's *filtered* p at that position."""
    s = SETTINGS[name]
    draft, kept, nxt = toy_round(jax.random.key(11), 40_000, s)
    first = np.where(kept >= 1, draft[:, 0], nxt)
    want = np.asarray(probs(jnp.log(jnp.asarray(P_TOY[0], jnp.float32)), s))
    assert_distributed_as(np.bincount(first, minlength=6), want)
    assert 0.05 < (kept >= 1).mean() < 0.95  # both branches taken often


def toy_sequences(key, n: int, s: SamplingSettings, p_LV, q_LV, k: int, length: int) -> np.ndarray:
    """n token sequences of `length` from rounds of `verify` with toy models whose distribution
    depends only on the position: the target's p_LV[i] and the draft's q_LV[i] at position i. Each
    round starts where the row's text ends (after a rejection, the bonus token, ...)."""
    out = np.zeros((n, length + 1), np.int64)  # the last column takes what is not kept
    filled = np.zeros(n, np.int64)
    rows = np.arange(n)[:, None]
    L = p_LV.shape[0]
    for r in range(length):  # every round emits at least one token
        at = np.minimum(filled[:, None] + np.arange(k + 1), L - 1)
        key, sub = jax.random.split(key)
        draft, kept, nxt = toy_round(sub, n, s, p_LV[at], q_LV[at[:, :k]])
        new = np.where(np.arange(k + 1) < kept[:, None], np.pad(draft, ((0, 0), (0, 1))), nxt[:, None])
        j = np.arange(k + 1)
        keep = (j <= kept[:, None]) & (filled[:, None] + j < length)
        out[rows, np.where(keep, filled[:, None] + j, length)] = new
        filled += kept + 1
    return out[:, :length]


P_POS = np.array([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05], [0.05, 0.40, 0.10, 0.25, 0.15, 0.05],
                  [0.10, 0.10, 0.10, 0.30, 0.30, 0.10], [0.02, 0.03, 0.05, 0.10, 0.20, 0.60],
                  [0.50, 0.05, 0.05, 0.10, 0.10, 0.20], [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])


def test_sequences_distributed_as_target_at_every_position():
    """Toy models that depend on the position only: the target's text is independent draws x_i ~
    p_i. 30,000 sequences of 5 tokens over rounds of K = 3 (the 4th token is the bonus token
    whenever the first round keeps all three): each position's token and the pair (x_2, x_3) are
    distributed as the filtered p."""
    s = SETTINGS["top-k"]
    q_pos = 0.5 * P_POS + 0.5 * np.roll(P_POS, 1, axis=1)  # close enough to keep 3 in a row often
    seqs = toy_sequences(jax.random.key(4), 30_000, s, P_POS, q_pos, 3, 5)
    pf = np.asarray(probs(jnp.log(jnp.asarray(P_POS, jnp.float32)), s))
    for i in range(5):
        assert_distributed_as(np.bincount(seqs[:, i], minlength=6), pf[i])
    assert_distributed_as(np.bincount(seqs[:, 1] * 6 + seqs[:, 2], minlength=36), np.outer(pf[1], pf[2]).ravel())


def test_greedy_rule_keeps_tokens_while_they_are_the_argmax():
    p = jnp.log(jnp.asarray(P_TOY, jnp.float32))[None].repeat(3, 0)  # argmax 0, 1, 3|4 (tie: 3), 0
    q = jnp.zeros((3, 3, 6))
    draft = jnp.array([[0, 1, 3], [0, 2, 3], [5, 1, 3]], jnp.int32)
    kept, nxt = verify(jax.random.key(0), p, q, draft, greedy(1))
    assert kept.tolist() == [3, 1, 0] and nxt.tolist() == [0, 1, 0]


@pytest.mark.slow
def test_end_to_end_two_tokens_distributed_as_target():
    """Tiny GPTs, 20,000 rows of one prompt: the first two new tokens (drafted, verified, rolled
    back and drafted again) are distributed as the target's own filtered p(x1) p(x2 | x1)."""
    target = GPT(tiny_model_config(block_size=32), rngs=nnx.Rngs(3))
    draft = perturbed(target, 0.02)
    s = SamplingSettings(max_new_tokens=2, temperature=0.1, top_k=3)
    prompt = [4, 9, 21, 30]
    n = 20_000
    st = speculate(target, draft, jnp.array([prompt] * n, jnp.int32), jax.random.key(5), s, 2)
    assert 0.05 < SpeculativeSampler.stats(st)["acceptance_rate"] < 0.95  # both branches, often
    out = np.asarray(output_tokens(st, None, 2)[:, 1:])
    x1, x2 = out[:, 4], out[:, 5]
    p1 = np.asarray(probs(target(jnp.array([prompt]))[0][0, -1], s))
    ctx = jnp.array([prompt + [v] for v in range(65)], jnp.int32)
    p2 = np.asarray(probs(target(ctx)[0][:, -1], s))[:, :65]
    joint = p1[:65, None] * p2
    assert_distributed_as(np.bincount(x1 * 65 + x2, minlength=65 * 65), joint.ravel())


# ----------------------------------------------------------------------------- sample.py --draft_out_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Checkpoints: a target, a draft that mostly agrees, a larger draft, a draft with another
    tokenizer, one with another vocabulary, a damaged one."""
    root = tmp_path_factory.mktemp("spec")
    V = len(CHARS)
    target = GPT(tiny_model_config(vocab_size=V, block_size=64), rngs=nnx.Rngs(3))
    save_checkpoint(root / "target", target)
    save_checkpoint(root / "draft", perturbed(target, 0.004))
    save_checkpoint(root / "big", GPT(tiny_model_config(vocab_size=V, n_layer=3, n_embd=48), rngs=nnx.Rngs(4)))
    save_checkpoint(root / "other_tok", target, CHARS[:-1] + "\u00e9")
    save_checkpoint(root / "other_vocab", GPT(tiny_model_config(vocab_size=V + 1), rngs=nnx.Rngs(4)))
    import shutil
    shutil.copytree(root / "draft", root / "damaged")
    for f in (root / "damaged" / "checkpoints" / "0" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(f.read_bytes()[:50])
    return root


def sample(capsys, *argv):
    """sample.py in this process: (exit status, stdout, stderr lines)."""
    import sample as sample_cli
    return run_cli(capsys, sample_cli.main, *argv)


def test_cli_speculative_equals_plain(dirs, capsys):
    """Greedy and streamed: the same text as without a draft, past block_size; sampled, with a
    stop string and several samples: each sample cut at the stop string."""
    common = [f"--out_dir={dirs / 'target'}", "--prompt=ROMEO:", "--max_new_tokens=90"]
    code, plain, _ = sample(capsys, *common, "--temperature=0")
    assert code == 0
    code, spec, err = sample(capsys, *common, "--temperature=0", f"--draft_out_dir={dirs / 'draft'}",
                             "--num_draft_tokens=3")
    assert code == 0 and spec == plain and "speculative decoding" in err[-1], err
    code, out, err = sample(capsys, *common, "--temperature=0.8", "--top_k=10", "--top_p=0.9",
                            "--num_samples=3", "--stop=e", f"--draft_out_dir={dirs / 'draft'}")
    samples = out.rstrip("\n").split("\n---------------\n")
    assert code == 0 and len(samples) == 3, out
    assert all(x.startswith("ROMEO:") and "e" not in x[len("ROMEO:"):] for x in samples), samples
    code, out, err = sample(capsys, *common[:2], "--max_new_tokens=0", f"--draft_out_dir={dirs / 'draft'}")
    assert code == 0 and out == "ROMEO:\n" and not any("speculative" in ln for ln in err), err  # "0% of 0"


def test_larger_draft_warns_once(dirs, capsys):
    from gpt.checkpoint import load_model
    from gpt.speculative import load_draft
    target, _, tok = load_model(dirs / "target", "float32")
    draft = load_draft(str(dirs / "big"), "float32", target, tok, str(dirs / "target"), 4)
    assert draft.cfg.n_layer == 3
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("warning: the draft") and "larger than the target" in err[0]


@pytest.mark.parametrize("flags,needle", [
    (["--draft_out_dir={root}/nowhere"], "--draft_out_dir="),
    (["--draft_out_dir={root}/damaged"], "--draft_out_dir="),
    (["--draft_out_dir={root}/other_tok"], "tokenizer"),
    (["--draft_out_dir={root}/other_vocab"], "vocabulary"),
    (["--draft_out_dir={root}/draft", "--num_draft_tokens=0"], "--num_draft_tokens=0"),
    (["--draft_out_dir={root}/draft", "--num_draft_tokens=1000"], "--num_draft_tokens=1000"),
    (["--num_draft_tokens=3"], "needs --draft_out_dir"),
])
def test_cli_bad_draft_is_one_line(dirs, capsys, flags, needle):
    code, _, err = sample(capsys, f"--out_dir={dirs / 'target'}", "--max_new_tokens=4",
                          *(f.format(root=dirs) for f in flags))
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    if "other_tok" in flags[0]:
        assert str(dirs / "other_tok") in err[0] and str(dirs / "target") in err[0]


@pytest.mark.parametrize("draft,needle", [("nowhere", "does not exist"),
                                          ("other_tok", "is not the target's")])
def test_cli_bad_draft_is_told_before_any_weights_are_read(dirs, monkeypatch, draft, needle):
    """A mistyped --draft_out_dir, or a draft trained with another tokenizer, is told from the
    checkpoints' metadata before the target's (or the draft's) weights are loaded: it was told
    only after loading the target's."""
    import sample as sample_cli
    from gpt import checkpoint
    from gpt.errors import UserError
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(UserError, match=needle):
        sample_cli.main([f"--out_dir={dirs / 'target'}", "--max_new_tokens=4",
                         f"--draft_out_dir={dirs / draft}"])


def test_notes_say_where_speculative_rounds_stop():
    """sample.py's notes past block_size: the target's window, and where speculative rounds stop,
    which is set by whichever model cannot roll its cache (the draft's limits said nothing before)."""
    import sys
    from types import SimpleNamespace
    sys.path.insert(0, str(REPO))
    from sample import length_notes
    model = lambda bs, pos: SimpleNamespace(cfg=SimpleNamespace(block_size=bs, pos_embedding=pos))  # noqa: E731
    rope32, learned16, learned32 = model(32, "rope"), model(16, "learned"), model(32, "learned")
    assert length_notes(20, rope32, None, 4) == []
    notes = length_notes(31, rope32, learned16, 4)  # within the target's 32, past the draft's 16 - 4
    assert len(notes) == 1 and "after about 12 tokens (the draft's block_size 16" in notes[0]
    notes = length_notes(40, learned32, model(64, "rope"), 4)
    assert "recomputed windows" in notes[0] and "the target's block_size 32" in notes[1]
    assert "rolling KV cache" in length_notes(40, rope32, model(64, "rope"), 4)[0]
    assert len(length_notes(40, rope32, model(64, "rope"), 4)) == 1  # both roll: rounds never stop
