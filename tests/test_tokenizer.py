"""Tokenizers: GPT-2 equals tiktoken's, char and trained bpe:N round-trip, errors are UserErrors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
from hypothesis import given, settings, strategies as st

from gpt.errors import UserError
from helpers import make_hf_tokenizer
from gpt.tokenizer import (BPE_FILE, GPT2_PATTERN, GPT2_RANKS_FILE, GPT2_RANKS_SHA256, EOT, HFTokenizer,
                           RowText, build_tokenizer, bytes_to_unicode, continuation, gpt2_tokenizer,
                           hf_tokenizer_into, load_tokenizer, tokenizer_from_hf, train_hf_bpe, unicode_to_bytes)

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = (REPO / "data" / "shakespeare.txt").read_text(encoding="utf-8")

SAMPLES = [
    "Hello world",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n",
    "  leading and trailing   \n\n\n\t\t  ",
    "héllo wörld, ça va? naïve café — “quotes” ‘single’",
    "你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 🎉🎉🎉 👩‍👩‍👧 🇫🇷 flags and ZWJ",
    "numbers 1234567890 3.14159 -42 1e10",
    "Ελληνικά, русский текст, עברית, العربية",
    "code: def f(x):\n    return x**2  # comment\r\n",
    "literal <|endoftext|> is plain text here",
    "",
    " ",
    "\x00\x01\x7f control chars",
]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("gpt2", None, "unused")


@pytest.fixture(scope="module")
def reference_gpt2():
    """tiktoken's own loader on the same bundled file (caching into /tmp disabled)."""
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(GPT2_RANKS_FILE), expected_hash=GPT2_RANKS_SHA256)
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 50256})


TRAIN_TEXT = SHAKESPEARE[:200_000]
HELD_OUT = SHAKESPEARE[-50_000:]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """bpe:512 trained on a slice of Shakespeare, plus the HF tokenizer it was converted from."""
    d = tmp_path_factory.mktemp("bpe")
    chunks = [TRAIN_TEXT[i:i + 20_000] for i in range(0, len(TRAIN_TEXT), 20_000)]
    hf = train_hf_bpe(iter(chunks), 512)
    tok = tokenizer_from_hf(hf, 512, d)
    return tok, hf, d


# ----- GPT-2

def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.files() == []
    assert gpt2.decode([50256]) == "<|endoftext|>"


@pytest.mark.parametrize("text", SAMPLES)
def test_gpt2_matches_tiktoken_and_round_trips(gpt2, reference_gpt2, text):
    ids = gpt2.encode(text)
    assert ids == reference_gpt2.encode_ordinary(text)
    assert gpt2.decode(ids) == text
    assert gpt2.encode_array(text).tolist() == ids


def test_gpt2_special_text_is_ordinary(gpt2):
    ids = gpt2.encode("a<|endoftext|>b")
    assert 50256 not in ids and gpt2.decode(ids) == "a<|endoftext|>b"


def test_gpt2_matches_tiktoken_on_shakespeare(gpt2, reference_gpt2):
    text = SHAKESPEARE[:100_000]
    assert gpt2.encode(text) == reference_gpt2.encode_ordinary(text)
    assert gpt2.encode_batch(SAMPLES) == [gpt2.encode(s) for s in SAMPLES]


def test_decode_tolerates_any_id(gpt2):
    ids = gpt2.encode("你")
    assert len(ids) > 1  # a multi-byte character split across tokens
    assert "\ufffd" in gpt2.decode(ids[:1])
    assert gpt2.decode([15496, 60000, -1, 995]) == "Hello\ufffd\ufffd world"
    assert isinstance(gpt2.decode(list(range(0, 50257, 97))), str)


@settings(max_examples=150, deadline=None)
@given(st.text())
def test_gpt2_round_trips_any_unicode(text):
    tok = build_tokenizer("gpt2", None, "unused")
    assert tok.decode(tok.encode(text)) == text


# ----- char

def test_char_round_trip_and_unknown(tmp_path):
    tok = build_tokenizer("char", iter([SHAKESPEARE[:500_000], SHAKESPEARE[500_000:]]), tmp_path)
    assert tok.vocab_size == 65 and tok.eot_id is None and tok.files() == []
    text = SHAKESPEARE[:5000]
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("\n") == [0]
    assert load_tokenizer(json.loads(json.dumps(tok.spec)), tmp_path).encode(text) == tok.encode(text)
    with pytest.raises(UserError) as e:
        tok.encode("Hello ~ wörld")
    assert "'~'" in str(e.value) and "'ö'" in str(e.value)
    assert tok.decode([0, 65, 1000, -3]) == "\n\ufffd\ufffd\ufffd"
    assert list(tmp_path.iterdir()) == []  # char writes no files


def test_char_empty_corpus(tmp_path):
    with pytest.raises(UserError, match="empty"):
        build_tokenizer("char", iter(["", ""]), tmp_path)


# ----- bpe:N

def test_bpe_vocab_and_files(bpe):
    tok, hf, d = bpe
    assert tok.vocab_size == 513 and tok.eot_id == 512
    assert tok.files() == [BPE_FILE] and (d / BPE_FILE).is_file()
    assert len(hf.get_vocab()) == 512
    assert tok.decode([512]) == "<|endoftext|>"
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temp files left


def test_bpe_matches_hf(bpe):
    tok, hf, _ = bpe
    for text in [HELD_OUT, *SAMPLES]:
        assert tok.encode(text) == hf.encode(text).ids, text[:40]
    assert tok.encode(HELD_OUT) == hf.encode(HELD_OUT).ids


def test_bpe_reload_from_spec(bpe, tmp_path):
    tok, _, d = bpe
    spec = json.loads(json.dumps(tok.spec))
    again = load_tokenizer(spec, d)
    assert again.encode(HELD_OUT) == tok.encode(HELD_OUT) and again.vocab_size == 513
    with pytest.raises(UserError, match="missing"):
        load_tokenizer(spec, tmp_path)
    (tmp_path / BPE_FILE).write_bytes((d / BPE_FILE).read_bytes() + b"\n")  # same ranks, other hash
    with pytest.raises(UserError, match="sha256"):
        load_tokenizer(spec, tmp_path)
    import base64  # ranks 0..n-1 without the single bytes: tiktoken panicked encoding a prompt
    pairs = [bytes([65 + i // 26, 65 + i % 26]) for i in range(spec["n_regular"])]
    (tmp_path / BPE_FILE).write_text("".join(f"{base64.b64encode(p).decode()} {r}\n" for r, p in enumerate(pairs)))
    with pytest.raises(UserError, match="lacks some of the 256 single bytes"):
        load_tokenizer({**spec, "sha256": None}, tmp_path)


def test_hand_edited_spec_is_one_line(bpe):
    """A spec read back from metadata with an n_regular JSON allows but no int is (Infinity
    overflowed int()), or a file name no filesystem takes (NUL, a lone surrogate, over 255
    bytes: ValueError or OSError on opening it), is a UserError, not a traceback."""
    tok, _, d = bpe
    for n in (float("inf"), float("nan"), True, 512.5, "512"):
        with pytest.raises(UserError, match="is incomplete"):
            load_tokenizer({**tok.spec, "n_regular": n}, d)
    for name in ("a\x00b", "\ud800", "x" * 256):
        for spec in ({**tok.spec, "file": name}, {"kind": "hf", "file": name, "vocab_size": 3}):
            with pytest.raises(UserError, match="not a plain file name"):
                load_tokenizer(spec, d)


def test_unreadable_ranks_file_is_one_line(bpe, monkeypatch):
    """A ranks file that exists but cannot be read (no permission, an I/O error) is a UserError, as
    an unreadable tokenizer.json is; it was an OSError traceback from sample.py and train.py."""
    tok, _, d = bpe

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "read_bytes", unreadable)
    with pytest.raises(UserError, match="cannot read tokenizer file .*Permission denied"):
        load_tokenizer(tok.spec, d)


def test_bpe_build_tokenizer(tmp_path):
    tok = build_tokenizer("bpe:300", iter([TRAIN_TEXT[:30_000]]), tmp_path)
    assert tok.vocab_size == 301 and tok.spec["n_regular"] == 300
    assert tok.decode(tok.encode(SAMPLES[4])) == SAMPLES[4]


@settings(max_examples=150, deadline=None)
@given(st.text())
def test_bpe_round_trips_any_unicode(bpe, text):
    tok = bpe[0]
    assert tok.decode(tok.encode(text)) == text


def test_bpe_errors(tmp_path):
    with pytest.raises(UserError, match="N >= 256"):
        build_tokenizer("bpe:100", iter(["abc"]), tmp_path)
    with pytest.raises(UserError, match="too small"):
        build_tokenizer("bpe:5000", iter(["tiny corpus"]), tmp_path)
    with pytest.raises(UserError, match="integer"):
        build_tokenizer("bpe:lots", iter(["x"]), tmp_path)


def test_unknown_name_lists_valid(tmp_path):
    with pytest.raises(UserError) as e:
        build_tokenizer("gpt3", None, tmp_path)
    assert "gpt2" in str(e.value) and "char" in str(e.value) and "bpe:N" in str(e.value)
    with pytest.raises(UserError, match="unknown tokenizer kind"):
        load_tokenizer({"kind": "sentencepiece"}, tmp_path)


def test_byte_table_is_a_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert unicode_to_bytes("".join(table[b] for b in range(256))) == bytes(range(256))
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ"


# ----------------------------------------------------------------------------- hf:PATH (tokenizer.json)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tok")
    make_hf_tokenizer(d)
    (d / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    return d


def test_hf_tokenizer_matches_transformers(hf_dir, tmp_path):
    """With the prompt template (converted checkpoints), prompts are encoded exactly as
    transformers' tokenizer does (BOS here); plain text and data-prepared tokenizers have no
    template; decode inverts; ids come from config.json."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    tok = hf_tokenizer_into(hf_dir / "tokenizer.json", tmp_path, prompt_template=True)
    assert (tmp_path / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert (tok.vocab_size, tok.bos_id, tok.eot_id) == (len(ref), 1, 2)  # EOS list: the first
    assert tok.stop_ids == (0,)  # and the others end generation too
    for text in SAMPLES[:10]:
        assert tok.encode_prompt(text) == ref(text)["input_ids"]
        assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<s>") != [1] and tok.encode_prompt("<s>") == [1, 1]  # corpus text stays text
    again = load_tokenizer(json.loads(json.dumps(tok.spec)), tmp_path)
    assert again.encode_prompt(SAMPLES[1]) == tok.encode_prompt(SAMPLES[1]) and again.files() == tok.files()
    plain = build_tokenizer(f"hf:{hf_dir}", None, tmp_path / "data")  # the directory works too
    assert plain.encode_prompt(SAMPLES[1]) == plain.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])


def test_data_tokenizer_checked_against_the_models(tmp_path):
    """The data must be tokenized as the model was: another file, vocabulary or kind, or other
    BOS/EOS ids (a tokenizer.json read without the configs that name them) is one line naming what
    differs; file names, the prompt template and the extra EOS ids do not count. The extra EOS ids
    still key the data cache, since the run records the data's spec."""
    from gpt.tokenizer import check_data_tokenizer, identity
    model = {"kind": "hf", "file": "tokenizer.json", "sha256": "a" * 64, "vocab_size": 290, "bos_id": 1,
             "eot_id": 2, "stop_ids": [0], "prompt_template": True}
    check_data_tokenizer(model, {**model, "file": "x.json", "stop_ids": [], "prompt_template": False}, "m", "fix")
    with pytest.raises(UserError, match=r"hf \(290 tokens\) but the model in ck with hf \(290 tokens, BOS 1, "
                                        r"EOS 2\) \(they differ in bos_id, eot_id\); prepare it with --tokenizer=hf: "
                                        r"of the Hugging Face folder the model came from"):
        check_data_tokenizer(model, {**model, "eot_id": None, "bos_id": None}, "the model in ck", "fix")
    with pytest.raises(UserError, match=r"\(they differ in sha256\); fix"):
        check_data_tokenizer(model, {**model, "sha256": "b" * 64}, "m", "fix")
    with pytest.raises(UserError, match=r"\(they differ in n_regular\)"):
        check_data_tokenizer({**model, "n_regular": None}, model, "m", "fix")
    check_data_tokenizer(None, model, "an HF folder without tokenizer.json", "fix")
    one, two = tmp_path / "one", tmp_path / "two"
    for d, eos in ((one, 2), (two, [2, 0])):
        make_hf_tokenizer(d, vocab_size=260)
        (d / "config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert identity(f"hf:{one}") != identity(f"hf:{two}")


def test_hf_tokenizer_ids_from_tokenizer_config(tmp_path):
    d = tmp_path / "m"
    make_hf_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tok = build_tokenizer(f"hf:{d / 'tokenizer.json'}", None, tmp_path / "out")
    assert (tok.bos_id, tok.eot_id) == (1, 2)


def test_hf_tokenizer_errors(hf_dir, tmp_path):
    with pytest.raises(UserError, match="cannot read tokenizer"):
        build_tokenizer(f"hf:{tmp_path / 'none.json'}", None, tmp_path / "o")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable Hugging Face tokenizer.json"):
        build_tokenizer(f"hf:{tmp_path / 'bad.json'}", None, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    tok = build_tokenizer(f"hf:{hf_dir}", None, tmp_path / "ok")
    with pytest.raises(UserError, match="plain file name"):
        load_tokenizer({**tok.spec, "file": "../tokenizer.json"}, tmp_path / "ok")
    (tmp_path / "ok" / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text() + " ")
    with pytest.raises(UserError, match="has changed"):
        load_tokenizer(tok.spec, tmp_path / "ok")
    bad_ids = tmp_path / "ids"
    make_hf_tokenizer(bad_ids)
    (bad_ids / "generation_config.json").write_text(json.dumps({"eos_token_id": 5000}))
    with pytest.raises(UserError, match="eot_id=5000"):
        build_tokenizer(f"hf:{bad_ids}", None, tmp_path / "o2")
    (bad_ids / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5000]}))
    with pytest.raises(UserError, match=r"EOS ids \[5000\] .* not a list of at most 64 ids"):
        build_tokenizer(f"hf:{bad_ids}", None, tmp_path / "o2")
    good = build_tokenizer(f"hf:{hf_dir}", None, tmp_path / "ok2")
    for stops in ("3", [True], [1.5], [-1], list(range(65))):  # a spec edited by hand
        with pytest.raises(UserError, match="EOS ids .* fix the config files"):
            load_tokenizer({**good.spec, "stop_ids": stops}, tmp_path / "ok2")
    with pytest.raises(UserError, match="beside an eot_id"):
        load_tokenizer({**good.spec, "eot_id": None, "stop_ids": [3]}, tmp_path / "ok2")
    with pytest.raises(UserError, match="needs a path"):
        build_tokenizer("hf:", None, tmp_path / "o3")


def test_hf_vocabulary_with_gaps_is_sized_by_its_highest_id(tmp_path):
    """A tokenizer.json whose ids skip numbers: the vocabulary is its highest id plus one, so the
    store's integers and the model's embedding hold every id it produces (5 entries, id 70000:
    preparation overflowed uint16 with a traceback; with id 600 it stored ids past the model)."""
    import json
    from tokenizers import Tokenizer, models, pre_tokenizers
    from gpt.data import load_meta, prepare
    for top, dtype in ((600, "uint16"), (70000, "uint32")):
        d = tmp_path / f"tok{top}"
        d.mkdir()
        hf = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "</s>": 3, "c": top}, unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        hf.save(str(d / "tokenizer.json"))
        (d / "config.json").write_text(json.dumps({"eos_token_id": 3}))
        (tmp_path / "in.txt").write_text("a b c " * 400)
        prepare([tmp_path / "in.txt"], f"hf:{d / 'tokenizer.json'}", tmp_path / f"out{top}", val_fraction=0.1)
        meta = load_meta(tmp_path / f"out{top}")
        assert meta["vocab_size"] == meta["tokenizer"]["vocab_size"] == top + 1 and meta["dtype"] == dtype
    # data and checkpoints from before, whose spec counted the 5 entries, still load as they were
    from gpt.tokenizer import hf_spec, load_hf_spec
    spec = {**hf_spec(tmp_path / "tok600" / "tokenizer.json", "fix")[2], "vocab_size": 5}
    assert load_hf_spec(spec, tmp_path / "tok600").vocab_size == 5
    with pytest.raises(UserError, match="has 601 tokens, its spec says 7"):
        load_hf_spec({**spec, "vocab_size": 7}, tmp_path / "tok600")


def test_hf_tokenizer_that_cannot_encode_a_text_is_one_line(tmp_path):
    """A tokenizer.json whose unk token is missing from its vocabulary: `tokenizers` raises a plain
    Exception on a word it lacks, which was a traceback from data preparation, a prompt or
    gpt.evaluate; it is a UserError naming the tokenizer and its reason."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    hf = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = build_tokenizer(f"hf:{tmp_path}", None, tmp_path / "out")
    assert tok.encode("a b") == [0, 1]
    for encode in (tok.encode, tok.encode_prompt, lambda t: tok.encode_batch(["a", t])):
        with pytest.raises(UserError, match=r"tokenizer.json cannot encode the text \(.*\[UNK\]"):
            encode("a c")


def test_sampled_text_is_decoded_once_and_as_a_whole(tmp_path):
    """RowText (sample.py's streamed text) gives after each chunk the text that decoding the
    prompt and all new tokens together gives (a character split across tokens, a byte-fallback
    run that turns out not to be UTF-8), while decoding each token about once: decoding
    everything at every chunk was quadratic in the sample's length and a long prompt's."""
    from tokenizers import Tokenizer, decoders, models

    class Counting:  # a tokenizer that counts the tokens it decodes
        def __init__(self, tok):
            self.tok, self.settled, self.decoded = tok, tok.settled, 0

        def decode(self, ids):
            self.decoded += len(ids)
            return self.tok.decode(ids)

    gpt2 = gpt2_tokenizer()
    vocab = {"<s>": 0, "a": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    hf = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    hf.add_special_tokens(["<s>"])  # skipped by decode, as are unknown ids
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fallback = HFTokenizer(hf, hf, {"vocab_size": len(vocab)})
    ni_hao = [2 + 0xE4, 2 + 0xBD, 2 + 0xA0]  # 你 in three byte tokens
    cases = [(gpt2, gpt2.encode("P: " * 500), gpt2.encode("héllo 😀 你好 " * 40)),
             (fallback, [1], [1, *ni_hao, 0, 2 + 0xE4, 1, ni_hao[0], 0, *ni_hao[1:]])]
    for tok, prompt, new in cases:
        counting = Counting(tok)
        row = RowText(counting, prompt)
        for k in range(len(new) + 1):
            assert row.text(new[:k]) == continuation(tok, prompt, new[:k])
        assert counting.decoded < 4 * len(new) + 20 * (len(new) + 1)
    assert continuation(fallback, [1], new[:4]) == "a你"  # until a byte after it makes the run not UTF-8
    assert continuation(fallback, [1], new) == "a" + "\ufffd" * 4 + "a你"


def test_streamed_text_after_a_prompt_ending_in_byte_tokens_or_specials(tmp_path):
    """RowText's first window is the prompt's last tokens: one that began inside a byte-fallback
    run (a prompt ending in three CJK characters of byte tokens) decoded the sample's own bytes of
    that run as U+FFFD, and one of special tokens only lost the sample's leading space to the
    decoder's Strip; the text is the one the prompt and the sample decode to together."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {"<s>": 0, "\u2581a": 1, "b": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    hf = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    hf.add_special_tokens(["<s>"])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = HFTokenizer(hf, hf, {"vocab_size": len(vocab)})
    utf8 = lambda s: [3 + b for b in s.encode()]
    for prompt, new in (([1, *utf8("\u4f60\u597d\u4f60")], [*utf8("\u597d"), 1]), ([1, 2, *[0] * 8], [1, 2])):
        assert RowText(tok, prompt).text(new) == continuation(tok, prompt, new), prompt
