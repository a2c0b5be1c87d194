"""Property-based tests (hypothesis): tokenizers round-trip any text they accept; top-k/top-p
filtering keeps a non-empty set of unmasked tokens whose probabilities sum to 1."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import REPO

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any Unicode scalar value except lone surrogates (not encodable as UTF-8), including the rare
# planes, controls, NUL, combining marks and the text of special tokens such as "<|endoftext|>".
TEXT = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=200),
                 st.lists(st.sampled_from(["<|endoftext|>", " ", "\n", "\r\n", "  ", "é", "日本", "🙂",
                                           "\u200d", "\x00", "'s", "123"]), max_size=20).map("".join))


@pytest.fixture(scope="module")
def gpt2():
    from gpt.tokenizer import gpt2_tokenizer
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from gpt.tokenizer import build_tokenizer
    text = (REPO / "data" / "shakespeare.txt").read_text()[:60_000]
    return build_tokenizer("bpe:300", [text[i:i + 20_000] for i in range(0, len(text), 20_000)],
                           tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def char():
    from gpt.tokenizer import CharTokenizer
    return CharTokenizer("".join(sorted(set((REPO / "data" / "shakespeare.txt").read_text()))))


@SETTINGS
@given(text=TEXT)
def test_gpt2_round_trips_any_text(gpt2, text):
    ids = gpt2.encode(text)
    assert all(0 <= i < 50256 for i in ids)  # ordinary text never yields the end-of-text id
    assert gpt2.decode(ids) == text
    assert gpt2.encode_array(text).tolist() == ids


@SETTINGS
@given(text=TEXT)
def test_trained_bpe_round_trips_any_text(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


@SETTINGS
@given(data=st.data())
def test_char_round_trips_its_alphabet(char, data):
    text = data.draw(st.text(st.sampled_from(char.chars), max_size=300))
    ids = char.encode(text)
    assert len(ids) == len(text) and all(0 <= i < char.vocab_size for i in ids)
    assert char.decode(ids) == text


# ----------------------------------------------------------------------------- filter_logits


@st.composite
def logits_and_settings(draw):
    B = draw(st.sampled_from([1, 3]))  # few distinct shapes: each new one costs a compile
    V = draw(st.sampled_from([1, 2, 5, 17, 40]))
    finite = st.floats(-30, 30, allow_nan=False, width=32)
    value = st.one_of(finite, finite, finite, st.just(-math.inf))  # some tokens already masked
    rows = []
    for _ in range(B):
        row = draw(st.lists(value, min_size=V, max_size=V))
        if all(v == -math.inf for v in row):  # a row has at least one possible token
            row[draw(st.integers(0, V - 1))] = draw(finite)
        if draw(st.booleans()):  # ties are common in practice (e.g. quantised logits)
            row = [round(v) if math.isfinite(v) else v for v in row]
        rows.append(row)
    temperature = draw(st.floats(0.05, 5.0))
    top_k = draw(st.sampled_from([0, 1, 2, 3, 10, 50]))
    top_p = draw(st.one_of(st.just(1.0), st.floats(1e-6, 1.0), st.sampled_from([1e-9, 0.5, 0.9, 0.999999])))
    return np.asarray(rows, np.float32), temperature, top_k, top_p


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=logits_and_settings())
@example(case=(np.array([[0.0, -np.inf], [0.0, -np.inf], [0.0, 1.1754944e-38]], np.float32), 2.0, 1, 1.0))
def test_filter_logits_keeps_a_valid_distribution(case):
    import jax
    import jax.numpy as jnp

    from gpt.sampling import filter_logits
    logits, temperature, top_k, top_p = case
    out = np.asarray(filter_logits(jnp.asarray(logits), temperature, top_k, top_p))
    masked_in = np.isneginf(logits)
    kept = ~np.isneginf(out)
    assert not np.isnan(out).any()
    assert kept.any(axis=-1).all()  # never an empty set
    assert not (kept & masked_in).any()  # never brings back a masked token
    n_possible = (~masked_in).sum(-1)
    if 0 < top_k < logits.shape[-1]:
        assert (kept.sum(-1) <= top_k).all()
    assert (kept.sum(-1) <= n_possible).all()
    probs = np.asarray(jax.nn.softmax(jnp.asarray(out), axis=-1), np.float64)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert (probs[~kept] == 0).all()
    # The kept set is the most likely tokens: nothing dropped is more likely than something kept,
    # as the filter sees them, after the temperature (on CPU, XLA flushes a subnormal quotient
    # such as 1.2e-38 / 2 to zero: a tie with 0, which goes to the lower index).
    scaled = np.asarray(jnp.asarray(logits) / temperature)
    for r in range(logits.shape[0]):
        if (~kept[r] & ~masked_in[r]).any():
            assert scaled[r][~kept[r] & ~masked_in[r]].max() <= scaled[r][kept[r]].min()
