"""Data preparation and batches: exact streaming, splits, documents, atomicity, errors, loader state."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpt.data as data
import gpt.corpus as corpus
from gpt.corpus import resolve_inputs
from gpt import store
from gpt.batches import Batches
from gpt.data import FORMAT_VERSION, check_split_sizes, ensure_prepared, load_meta, prepare, token_dtype
from gpt.errors import UserError
from helpers import MULTIBYTE, make_hf_tokenizer
from gpt.tokenizer import TiktokenTokenizer, build_tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = (REPO / "data" / "shakespeare.txt").read_text(encoding="utf-8")
GPT2 = build_tokenizer("gpt2", None, "unused")


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else lambda t: path.write_text(t, encoding="utf-8"))(text)
    return path


def read_bin(d: Path, split: str) -> np.ndarray:
    """A split's tokens, all shards in order."""
    meta = load_meta(d)
    return np.concatenate([np.zeros(0, meta["dtype"])] + [np.asarray(a) for a in store.SplitTokens(d, meta, split).shards])


def files(d: Path) -> Path:
    """Where a data dir's tokenizer files are."""
    return store.files_dir(d, load_meta(d))


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("char")
    src = write(d / "src" / "input.txt", SHAKESPEARE[:20_000])
    prepare([src], "char", d / "out", val_fraction=0.1)
    return d / "out"


# ----- prepare: contents

def test_token_dtype():
    assert token_dtype(65) == np.uint16 and token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(200_000) == np.uint32


def test_char_matches_nanogpt_split(char_dir):
    meta = load_meta(char_dir)
    assert meta["format_version"] == FORMAT_VERSION and meta["dtype"] == "uint16"
    assert meta["splits"]["train"] == {"tokens": 18_000, "bytes": 18_000, "documents": 1}  # int(n * 0.9)
    assert meta["splits"]["val"] == {"tokens": 2_000, "bytes": 2_000, "documents": 0}  # cut inside it
    tok = load_tokenizer(meta["tokenizer"], files(char_dir))
    assert tok.decode(read_bin(char_dir, "train")) + tok.decode(read_bin(char_dir, "val")) == SHAKESPEARE[:20_000]
    assert meta["sources"][0]["bytes"] == 20_000 and len(meta["sources"][0]["sha256"]) == 64


@pytest.mark.parametrize("chunk", [3000, 1 << 20])
def test_gpt2_streaming_is_exact(tmp_path, monkeypatch, chunk, capsys):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", chunk)  # many small pieces: cuts must not change tokens
    text = SHAKESPEARE[:60_000] + "\n\nnon-ASCII: héllo 你好 🎉\n" * 50
    src = write(tmp_path / "a.txt", text)
    meta = prepare([src], "gpt2", tmp_path / "out", val_fraction=0.0, workers=2)
    assert "leaves no val split, and train.py evaluates on it" in capsys.readouterr().err
    assert read_bin(tmp_path / "out", "train").tolist() == GPT2.encode(text)
    assert meta["splits"]["val"]["tokens"] == 0 and meta["bytes_per_token"]["val"] is None


def test_streaming_is_exact_with_crlf(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 2000)
    text = SHAKESPEARE[:30_000].replace("\n", "\r\n")
    src = write(tmp_path / "a.txt", text.encode())
    prepare([src], "gpt2", tmp_path / "out", val_fraction=0.0)
    assert read_bin(tmp_path / "out", "train").tolist() == GPT2.encode(text)


def test_split_sizes_add_up(tmp_path):
    text = SHAKESPEARE[:40_000] + "ünïcödé ✓\n" * 300
    src = write(tmp_path / "a.txt", text)
    meta = prepare([src], "gpt2", tmp_path / "out", val_fraction=0.25)
    sp, total = meta["splits"], len(text.encode())
    assert sp["train"]["bytes"] + sp["val"]["bytes"] == total == meta["sources"][0]["bytes"]
    assert abs(sp["val"]["bytes"] / total - 0.25) < 0.001
    train, val = read_bin(tmp_path / "out", "train"), read_bin(tmp_path / "out", "val")
    assert (len(train), len(val)) == (sp["train"]["tokens"], sp["val"]["tokens"])
    assert GPT2.decode(train.tolist()) + GPT2.decode(val.tolist()) == text


def test_documents_separated_by_eot(tmp_path):
    docs = ["First document.\n", "", "Second, with ünicode.\n", "Third"]
    files = [write(tmp_path / "docs" / f"{i}.txt", t) for i, t in enumerate(docs)]
    prepare([tmp_path / "docs"], "gpt2", tmp_path / "out", val_fraction=0.0)
    want = GPT2.encode(docs[0]) + [50256] + GPT2.encode(docs[2]) + [50256] + GPT2.encode(docs[3])
    assert read_bin(tmp_path / "out", "train").tolist() == want
    prepare(files, "char", tmp_path / "char", val_fraction=0.0)  # char has no eot: plain concatenation
    tok = load_tokenizer(load_meta(tmp_path / "char")["tokenizer"], tmp_path / "char")
    assert tok.decode(read_bin(tmp_path / "char", "train")) == "".join(docs)


def test_uint32_for_large_vocab(tmp_path, monkeypatch):
    class Big(TiktokenTokenizer):  # GPT-2 ids shifted above 65535
        def encode_array(self, text, dtype=np.uint32):
            return (np.asarray(self.encode(text), dtype=np.int64) + 60_000).astype(dtype)

    big = Big(GPT2.encoding, {"kind": "gpt2"})
    big.vocab_size, big.eot_id = 120_000, 110_256
    monkeypatch.setattr(data, "build_tokenizer", lambda *a: big)
    src = write(tmp_path / "a.txt", SHAKESPEARE[:3000])
    meta = prepare([src], "gpt2", tmp_path / "out")
    assert meta["dtype"] == "uint32" and read_bin(tmp_path / "out", "train").nbytes == 4 * meta["splits"]["train"]["tokens"]
    x, _ = Batches(tmp_path / "out", "train", 8, 2, seed=0).next()
    assert x.min() >= 60_000


def test_bpe_prepare_writes_tokenizer_file(tmp_path):
    src = write(tmp_path / "a.txt", SHAKESPEARE[:60_000])
    meta = prepare([src], "bpe:300", tmp_path / "out")
    assert meta["vocab_size"] == 301 and (files(tmp_path / "out") / "tokenizer.tiktoken").is_file()
    tok = load_tokenizer(meta["tokenizer"], files(tmp_path / "out"))
    assert tok.decode(read_bin(tmp_path / "out", "train").tolist()) == SHAKESPEARE[:54_000]


@pytest.mark.parametrize("tokenizer", ["char", "gpt2", "hf"])
def test_multibyte_corpus_prepares_with_tiny_pieces(tmp_path, monkeypatch, tokenizer):
    """Every tokenizer, pieces of a few bytes, several split points: nothing is lost or garbled."""
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 7)
    name = f"hf:{make_hf_tokenizer(tmp_path / 'hf')}" if tokenizer == "hf" else tokenizer
    src = write(tmp_path / "m.txt", MULTIBYTE)
    for frac in (0.1, 0.37, 0.5):
        meta = prepare([src], name, tmp_path / f"out{frac}", val_fraction=frac)
        tok = load_tokenizer(meta["tokenizer"], files(tmp_path / f"out{frac}"))
        parts = [tok.decode(read_bin(tmp_path / f"out{frac}", s).tolist()) for s in ("train", "val")]
        assert "".join(parts) == MULTIBYTE
        if tokenizer == "char":  # exact anywhere
            assert read_bin(tmp_path / f"out{frac}", "train").tolist() + \
                read_bin(tmp_path / f"out{frac}", "val").tolist() == tok.encode(MULTIBYTE)


def test_hf_tokenizer_prepare_documents_and_cache(tmp_path):
    """hf:PATH: documents separated by the model's EOS, the tokenizer.json copied beside the data,
    the process workers rebuilding it from there, and the cache keyed by the file's content."""
    hf = make_hf_tokenizer(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    a, b = write(tmp_path / "a.txt", SHAKESPEARE[:20_000]), write(tmp_path / "b.txt", SHAKESPEARE[20_000:30_000])
    meta = prepare([a, b], f"hf:{hf}", tmp_path / "out", val_fraction=0.0, workers=2, backend="process")
    tok = load_tokenizer(meta["tokenizer"], files(tmp_path / "out"))
    assert meta["tokenizer"]["kind"] == "hf" and (files(tmp_path / "out") / "tokenizer.json").is_file()
    want = tok.encode(SHAKESPEARE[:20_000]) + [2] + tok.encode(SHAKESPEARE[20_000:30_000])
    assert read_bin(tmp_path / "out", "train").tolist() == want
    d1 = ensure_prepared([a], f"hf:{hf}", tmp_path / "cache")
    assert ensure_prepared([a], f"hf:{tmp_path / 'model'}", tmp_path / "cache") == d1  # same file
    make_hf_tokenizer(tmp_path / "model", vocab_size=280)  # a different tokenizer at the same path
    assert ensure_prepared([a], f"hf:{hf}", tmp_path / "cache") != d1


def test_backends_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 8192)  # several pieces in flight
    src = write(tmp_path / "a.txt", SHAKESPEARE[:60_000])
    outs = {}
    for backend in ["auto", "thread", "process"]:
        prepare([src], "gpt2", tmp_path / backend, workers=2, backend=backend)
        outs[backend] = read_bin(tmp_path / backend, "train").tolist()
    assert outs["auto"] == outs["thread"] == outs["process"] == GPT2.encode(SHAKESPEARE[:54_000])
    with pytest.raises(UserError, match="backend"):
        prepare([src], "gpt2", tmp_path / "x", backend="gpu")


@pytest.mark.parametrize("case, match", [
    ("missing", "does not exist"),
    ("empty", "empty"),
    ("nonutf8", "not valid UTF-8"),
    ("binary", "looks binary"),
    ("tokenizer", "valid names"),
    ("nomatch", "no files matching"),
])
def test_bad_input_is_user_error_and_leaves_nothing(tmp_path, case, match):
    out = tmp_path / "out"
    good = write(tmp_path / "good.txt", "fine text\n" * 100)
    inputs, tok = [good], "char"
    if case == "missing":
        inputs = [good, tmp_path / "nope.txt"]
    elif case == "empty":
        inputs = [write(tmp_path / "e.txt", "")]
    elif case == "nonutf8":
        inputs = [good, write(tmp_path / "bad.txt", b"caf\xc3\xa9 ok \xff\xfe rest")]
    elif case == "binary":
        inputs = [good, write(tmp_path / "bin.txt", b"abc\x00\x01")]
    elif case == "tokenizer":
        tok = "wordpiece"
    elif case == "nomatch":
        (tmp_path / "dir").mkdir()
        inputs = [tmp_path / "dir"]
    with pytest.raises(UserError, match=match) as e:
        prepare(inputs, tok, out)
    if case == "missing":
        assert "nope.txt" in str(e.value)
    if case == "nonutf8":
        assert "bad.txt" in str(e.value) and "offset 9" in str(e.value) and "--errors=replace" in str(e.value)
    if case == "binary":
        assert "bin.txt" in str(e.value) and "offset 3" in str(e.value)
    assert not out.exists()


def test_errors_replace(tmp_path):
    src = write(tmp_path / "bad.txt", b"caf\xc3\xa9 \xff ok\n")
    meta = prepare([src], "char", tmp_path / "out", errors="replace", val_fraction=0.0)
    tok = load_tokenizer(meta["tokenizer"], files(tmp_path / "out"))
    assert tok.decode(read_bin(tmp_path / "out", "train")) == "café \ufffd ok\n"


def test_unwritable_out_dir(tmp_path):
    src = write(tmp_path / "a.txt", "text\n")
    blocker = write(tmp_path / "file", "not a folder")
    with pytest.raises(UserError, match="out_dir"):
        prepare([src], "char", blocker / "sub")
    with pytest.raises(UserError, match="not a folder"):
        prepare([src], "char", blocker)


def tree(d: Path) -> dict:
    """Every file under d (but staging dirs) with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and not p.relative_to(d).parts[0].startswith(".prepare-")}


def test_failure_keeps_previous_data_and_no_partial_output(tmp_path, monkeypatch):
    src = write(tmp_path / "a.txt", SHAKESPEARE[:5000])
    out = tmp_path / "out"
    old_meta = prepare([src], "char", out)
    before = tree(out)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "_tokenize_jobs", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare([src], "gpt2", out)
    assert tree(out) == before and load_meta(out) == old_meta  # the old store, untouched
    with pytest.raises(KeyboardInterrupt):
        prepare([src], "gpt2", tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "meta.json").exists()  # only the staging dir, to resume from
    monkeypatch.setattr(data, "_tokenize_jobs", lambda *a, **k: (_ for _ in ()).throw(UserError("bad record")))
    with pytest.raises(UserError):
        prepare([src], "gpt2", tmp_path / "fresh2")
    assert not (tmp_path / "fresh2").exists()  # bad input: nothing left behind


# ----- meta checks

def test_load_meta_and_split_sizes(tmp_path, char_dir):
    with pytest.raises(UserError, match="python -m gpt.data"):
        load_meta(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no meta.json"):
        load_meta(tmp_path / "empty")
    meta = load_meta(char_dir)
    check_split_sizes(meta, 1999)
    with pytest.raises(UserError) as e:
        check_split_sizes(meta, 2000)
    assert "val split has 2000 tokens" in str(e.value) and "at least 2001" in str(e.value)
    broken = tmp_path / "broken"
    shutil.copytree(char_dir, broken)
    shard = store.files_dir(broken, meta) / meta["shards"]["val"][0]["file"]
    shard.write_bytes(b"\x00\x00")
    with pytest.raises(UserError, match="does not match meta.json"):
        load_meta(broken)


@pytest.mark.parametrize("edit,says", [
    (lambda m: m.update(bytes_per_token={"val": "2"}), "malformed"),
    (lambda m: m.update(bytes_per_token="x"), "malformed"),
    (lambda m: m.update(bytes_per_token={"val": -1.0}), "malformed"),
    (lambda m: m.update(vocab_size=m["vocab_size"] - 1), "gives vocab_size .* its tokenizer .*edited")])
def test_edited_meta_is_refused_before_training(tmp_path, char_dir, edit, says):
    """meta.json is a file a user may edit: what evaluation divides by (bytes_per_token) and the
    vocabulary the model is sized by must hold what preparing wrote, or training would stop with a
    traceback at its first evaluation, or with a NaN loss blamed on the learning rate."""
    edited = tmp_path / "edited"
    shutil.copytree(char_dir, edited)
    meta = json.loads((edited / "meta.json").read_text())
    edit(meta)
    (edited / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=says):
        load_meta(edited)


# ----- caching and defaults

def test_ensure_prepared_reuses(tmp_path, monkeypatch):
    src = write(tmp_path / "in" / "a.txt", SHAKESPEARE[:3000])
    calls = []
    real = data.prepare
    monkeypatch.setattr(data, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    d1 = ensure_prepared([tmp_path / "in"], "char", tmp_path / "cache")
    mtime = (d1 / "meta.json").stat().st_mtime_ns
    d2 = ensure_prepared([tmp_path / "in"], "char", tmp_path / "cache")
    assert d1 == d2 and len(calls) == 1 and (d1 / "meta.json").stat().st_mtime_ns == mtime
    assert ensure_prepared([tmp_path / "in"], "char", tmp_path / "cache", val_fraction=0.2) != d1
    write(src, SHAKESPEARE[:3001])  # content changed: new key
    assert ensure_prepared([tmp_path / "in"], "char", tmp_path / "cache") != d1
    assert len(calls) == 3


# ----- command line

@pytest.mark.parametrize("args, match", [
    (["--input", "no/such/file.txt", "--tokenizer", "char", "--out_dir", "OUT"], "does not exist"),
    (["--input", "data/shakespeare.txt", "--out_dir", "OUT"], "--tokenizer"),
])
def test_cli_bad_input_one_line_exit_2(tmp_path, args, match):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "gpt.data", *args], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_cli_prepares(tmp_path):
    src = write(tmp_path / "a.txt", SHAKESPEARE[:5000])
    r = subprocess.run([sys.executable, "-m", "gpt.data", "--input", str(src), "--tokenizer", "gpt2",
                        "--out_dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "train" in r.stdout and "MB/s" in r.stdout and load_meta(tmp_path / "out")["vocab_size"] == 50257
    assert "warning" not in r.stderr


def test_cli_says_when_text_field_reads_nothing(tmp_path, capsys):
    """--text_field names a record's field; given with plain text inputs only it does nothing,
    which the command says (it was silently ignored)."""
    src = write(tmp_path / "a.txt", SHAKESPEARE[:5000])
    assert data.main(["--input", str(src), "--tokenizer", "char", "--out_dir", str(tmp_path / "out"),
                      "--text_field", "body"]) == 0
    assert "warning: --text_field=body was not used: every input is plain text" in capsys.readouterr().err


# ----- record and compressed formats (.txt.gz, .jsonl, .jsonl.gz, .parquet)

DOCS = ["First document.\n", "", "Second, with ünicode 你好 🎉.\n", "Third\r\nline two", "x"]


def write_format(path: Path, docs: list, field: str = "text") -> Path:
    """Write `docs` (one per record; a .txt/.txt.gz holds them concatenated) in the format of
    `path`'s suffix; a dotted `field` nests the JSON objects."""
    import gzip
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=2)
        return path
    if ".json" in name:
        def obj(doc):
            for part in reversed(field.split(".")):
                doc = {part: doc}
            return doc
        raw = "".join(json.dumps(obj(d)) + "\n" for d in docs).encode()
    else:
        raw = "".join(docs).encode()
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    return path


def all_tokens(out: Path) -> list[int]:
    return read_bin(out, "train").tolist() + read_bin(out, "val").tolist()


def want_gpt2(docs: list[str]) -> list[int]:
    """Each non-empty document encoded on its own, end-of-text between them."""
    ids: list[int] = []
    for d in (d for d in docs if d):
        ids += ([50256] if ids else []) + GPT2.encode(d)
    return ids


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz", "parquet", "json", "json.gz"])
@pytest.mark.parametrize("frac", [0.0, 0.4])
def test_record_formats_round_trip(tmp_path, suffix, frac):
    """Every record format, .json read as JSON lines (as Hugging Face datasets reads it)."""
    src = write_format(tmp_path / f"docs.{suffix}", DOCS)
    meta = prepare([src], "gpt2", tmp_path / "gpt2", val_fraction=frac)
    assert all_tokens(tmp_path / "gpt2") == want_gpt2(DOCS)
    fmt = {"json": "jsonl", "json.gz": "jsonl.gz"}.get(suffix, suffix)
    assert meta["sources"][0]["format"] == fmt and meta["skipped_records"] == 0
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == len("".join(DOCS).encode())
    meta = prepare([src], "char", tmp_path / "char", val_fraction=frac)  # no end-of-text: concatenated
    tok = load_tokenizer(meta["tokenizer"], files(tmp_path / "char"))
    assert tok.decode(all_tokens(tmp_path / "char")) == "".join(DOCS)


def test_txt_gz_is_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 4096)  # several 256-byte gz pieces: still exact
    text = SHAKESPEARE[:20_000]
    a = write_format(tmp_path / "a.txt.gz", [text])
    plain = SHAKESPEARE[20_000:40_000]  # past the cut: a whole in train, b whole in val
    b = write(tmp_path / "b.txt", plain)
    meta = prepare([a, b], "gpt2", tmp_path / "out", val_fraction=0.3)
    assert all_tokens(tmp_path / "out") == want_gpt2([text, plain])
    assert meta["splits"]["val"]["documents"] == 1 and meta["splits"]["train"]["tokens"] == len(want_gpt2([text]))
    assert meta["sources"][0]["bytes"] == a.stat().st_size and len(meta["sources"][0]["sha256"]) == 64
    import hashlib
    assert meta["sources"][0]["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()


def test_nested_text_field_and_dotted_key(tmp_path):
    src = write_format(tmp_path / "n.jsonl.gz", DOCS, field="meta.body")
    prepare([src], "gpt2", tmp_path / "out", val_fraction=0.0, text_field="meta.body")
    assert all_tokens(tmp_path / "out") == want_gpt2(DOCS)
    flat = write(tmp_path / "f.jsonl", json.dumps({"meta.body": "dotted key", "meta": {}}) + "\n")
    prepare([flat], "gpt2", tmp_path / "flat", val_fraction=0.0, text_field="meta.body")  # exact key wins
    assert all_tokens(tmp_path / "flat") == GPT2.encode("dotted key")
    pq_src = write_format(tmp_path / "c.parquet", DOCS, field="content")
    prepare([pq_src], "gpt2", tmp_path / "pq", val_fraction=0.0, text_field="content")
    assert all_tokens(tmp_path / "pq") == want_gpt2(DOCS)


def test_mixed_folder_default_include(tmp_path):
    folder = tmp_path / "corpus"
    write(folder / "a.txt", "text file\n")
    write_format(folder / "b.txt.gz", ["gzipped text\n"])
    write_format(folder / "sub" / "c.jsonl", ["json one", "json two"])
    write_format(folder / "sub" / "d.jsonl.gz", ["gz json"])
    write_format(folder / "sub" / "e.parquet", ["parquet row"])
    write(folder / "notes.md", "not included")
    files = resolve_inputs([folder])
    assert [p.relative_to(folder).as_posix() for p in files] == \
        ["a.txt", "b.txt.gz", "sub/c.jsonl", "sub/d.jsonl.gz", "sub/e.parquet"]
    prepare([folder], "gpt2", tmp_path / "out", val_fraction=0.0)
    docs = ["text file\n", "gzipped text\n", "json one", "json two", "gz json", "parquet row"]
    assert all_tokens(tmp_path / "out") == want_gpt2(docs)
    assert [p.name for p in resolve_inputs([folder], include="*.md,*.txt")] == ["a.txt", "notes.md"]
    assert [p.name for p in resolve_inputs([folder], include=["*.parquet"])] == ["e.parquet"]
    assert [p.name for p in resolve_inputs([str(folder / "**" / "*.jsonl*")])] == ["c.jsonl", "d.jsonl.gz"]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "jsonl.gz"])
def test_whole_records_go_to_val(tmp_path, suffix):
    """Records are never split between train and val, and val is about val_fraction of them."""
    rng = np.random.default_rng(0)
    n = 200
    docs = [f"doc {i}: " + " ".join(f"{x:x}" for x in rng.integers(0, 1 << 30, 12)) + "\n" for i in range(n)]
    src = write_format(tmp_path / f"r.{suffix}", docs)
    prepare([src], "gpt2", tmp_path / "out", val_fraction=0.25)
    train, val = read_bin(tmp_path / "out", "train").tolist(), read_bin(tmp_path / "out", "val").tolist()
    assert train + val == want_gpt2(docs)
    assert val[0] == 50256 and train[-1] != 50256  # the cut falls between two documents
    n_val = val.count(50256)  # each val document is preceded by an end-of-text token
    assert GPT2.decode(val[1:]) == "<|endoftext|>".join(docs[-n_val:])
    assert abs(n_val / n - 0.25) < 0.02


def test_a_json_array_is_named_and_not_skipped(tmp_path):
    """A .json file that holds one JSON array (not JSON lines) is one clear error, with or without
    --skip_bad_records (which would otherwise skip the whole file, line by line)."""
    src = write(tmp_path / "docs.json", json.dumps([{"text": "one"}, {"text": "two"}], indent=1))
    for skip in (False, True):
        with pytest.raises(UserError, match=r"one JSON array, not JSON lines.*jq -c"):
            prepare([src], "gpt2", tmp_path / "out", skip_bad_records=skip)


def test_a_byte_order_mark_opens_a_jsonl_file(tmp_path):
    """A JSONL file saved with a UTF-8 byte-order mark (some Windows editors) reads its first
    record, which json.loads refused (and --skip_bad_records silently dropped)."""
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"text": d}) + "\n" for d in ("one", "two")).encode())
    prepare([src], "gpt2", tmp_path / "out", val_fraction=0.0)
    assert all_tokens(tmp_path / "out") == want_gpt2(["one", "two"])
    # a text file's mark is dropped too (it opened the document as U+FEFF, a char of its own);
    # UTF-16's is named, where the file was called binary for its NUL bytes
    import gzip
    write(tmp_path / "t.txt", b"\xef\xbb\xbfthree")
    write(tmp_path / "t.txt.gz", gzip.compress(b"\xef\xbb\xbffour"))
    meta = prepare([tmp_path / "t.txt", tmp_path / "t.txt.gz"], "char", tmp_path / "txt", val_fraction=0.0)
    assert meta["tokenizer"]["chars"] == "".join(sorted(set("threefour")))
    write(tmp_path / "u.txt", "five".encode("utf-16"))
    with pytest.raises(UserError, match="u.txt' is UTF-16 text .* convert it to UTF-8"):
        prepare([tmp_path / "u.txt"], "char", tmp_path / "u")


def test_small_gzip_files_split_by_their_text(tmp_path):
    """A .txt.gz or .jsonl.gz that the gzip reader reads whole at once (it reads ahead) still splits
    at val_fraction of its text: by the decompressed bytes, where the compressed bytes read so far
    put all of a small file in val."""
    text = SHAKESPEARE[:40_000]  # ASCII: a char token a byte
    meta = prepare([write_format(tmp_path / "one.txt.gz", [text])], "char", tmp_path / "t", val_fraction=0.1)
    assert (meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"]) == (36_000, 4_000)
    meta = prepare([write_format(tmp_path / "docs.jsonl.gz", MANY)], "char", tmp_path / "j", val_fraction=0.25)
    assert meta["splits"]["val"]["documents"] in (14, 15, 16)  # of 60


def test_a_split_left_empty_is_refused_and_the_store_kept(tmp_path, capsys):
    """Whole documents go to val: a corpus whose last document holds the text past the cut would
    publish an empty train split, and one whose documents past the cut hold no text an empty val
    split. Both are refused before the store in out_dir is replaced; a val share far from the one
    asked is a warning."""
    good = prepare([write(tmp_path / "a.txt", SHAKESPEARE[:5000])], "char", tmp_path / "out")
    with pytest.raises(UserError, match="the train split would be empty.*--val_documents"):
        prepare([write_format(tmp_path / "one.jsonl", ["a single record"])], "char", tmp_path / "out")
    empty_tail = [json.dumps({"text": "x" * 1000})] + [json.dumps({"text": ""})] * 100
    with pytest.raises(UserError, match="the val split would be empty"):
        prepare([write(tmp_path / "tail.jsonl", "\n".join(empty_tail) + "\n")], "char", tmp_path / "out")
    assert load_meta(tmp_path / "out") == good
    capsys.readouterr()
    meta = prepare([write(tmp_path / "in/0.txt", "tiny\n"), write(tmp_path / "in/1.txt", SHAKESPEARE[:5000])],
                   "char", tmp_path / "skew")
    assert meta["splits"]["train"]["tokens"] == 5 and "warning: val holds 100% of the tokens, not the 10% asked" \
        in capsys.readouterr().err


def test_skip_bad_records_counts(tmp_path):
    lines = ['{"text": "good one"}', "not json", '{"text": 5}', '{"other": "x"}', "[1, 2]", "",
             '{"text": null}', '{"text": "\\ud800 lone surrogate"}', '{"text": "good two"}']
    src = write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")
    meta = prepare([src], "gpt2", tmp_path / "out", val_fraction=0.0, skip_bad_records=True)
    assert meta["skipped_records"] == 6  # the blank line is not a record
    assert all_tokens(tmp_path / "out") == want_gpt2(["good one", "good two"])
    meta = prepare([src], "char", tmp_path / "rep", val_fraction=0.0, skip_bad_records=True, errors="replace")
    assert meta["skipped_records"] == 5  # the surrogate became U+FFFD
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "nulls.parquet")
    meta = prepare([tmp_path / "nulls.parquet"], "gpt2", tmp_path / "pq", val_fraction=0.0,
                   skip_bad_records=True)
    assert meta["skipped_records"] == 1 and all_tokens(tmp_path / "pq") == want_gpt2(["a", "b"])
    r = subprocess.run([sys.executable, "-m", "gpt.data", "--input", str(src), "--tokenizer", "gpt2",
                        "--out_dir", str(tmp_path / "cli"), "--skip_bad_records"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "skipped 6 bad record(s)" in r.stdout, r.stderr


def _bad_record_input(tmp_path: Path, case: str) -> tuple[Path, dict]:
    """A file with one kind of bad input, and the prepare() keywords that read it."""
    import gzip
    good = [json.dumps({"text": "fine"})] * 3
    if case == "not json":
        return write(tmp_path / "b.jsonl", "\n".join(good + ["{oops"]) + "\n"), {}
    if case == "no field":
        return write(tmp_path / "b.jsonl", "\n".join(good + ['{"body": "x"}']) + "\n"), {}
    if case == "not a string":
        return write(tmp_path / "b.jsonl", "\n".join(good + ['{"text": ["x"]}']) + "\n"), {}
    if case == "huge number":  # int() refuses over 4,300 digits: a ValueError, not a decode error
        return write(tmp_path / "b.jsonl", "\n".join(good + ['{"text": "x", "n": ' + "1" * 5000 + "}"]) + "\n"), {}
    if case == "array on one line":  # one record that is all of them: never skipped as one bad record
        return write(tmp_path / "b.jsonl", json.dumps([{"text": f"doc {i}"} for i in range(5)]) + "\n"), \
            {"skip_bad_records": True}
    if case == "parquet not utf-8":  # Arrow does not check UTF-8 on read
        import pyarrow as pa
        import pyarrow.parquet as pq
        column = pa.array([b"fine", b"bad \xff byte"]).view(pa.string())
        pq.write_table(pa.table({"text": column.dictionary_encode()}), tmp_path / "b.parquet")
        return tmp_path / "b.parquet", {}
    if case == "nested too deeply":  # json raises RecursionError, not a decode error
        return write(tmp_path / "b.jsonl", "\n".join(good + ["[" * 100_000 + "]" * 100_000]) + "\n"), {}
    if case == "parquet column":
        return write_format(tmp_path / "b.parquet", ["x"], field="content"), {}
    if case == "parquet null":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "b.parquet")
        return tmp_path / "b.parquet", {}
    if case == "not parquet":
        return write(tmp_path / "b.parquet", "text,label\nhello,1\n"), {}
    if case == "truncated gzip":
        raw = gzip.compress(SHAKESPEARE[:5000].encode())
        return write(tmp_path / "b.txt.gz", raw[:len(raw) // 2]), {}
    if case == "corrupt gzip":
        raw = bytearray(gzip.compress(("\n".join(good) + "\n").encode()))
        raw[-8:-4] = b"\0\0\0\0"  # the CRC
        return write(tmp_path / "b.jsonl.gz", bytes(raw)), {}
    assert case == "not gzip"
    return write(tmp_path / "b.jsonl.gz", "\n".join(good)), {}


@pytest.mark.parametrize("case, match", [
    ("not json", r"b\.jsonl' line 4 is not valid JSON.*--skip_bad_records"),
    ("no field", r"b\.jsonl' line 4 has no field 'text' \(top-level keys: body; pass --text_field"),
    ("not a string", r"line 4 has a list in field 'text', not a string.*--skip_bad_records"),
    ("huge number", r"b\.jsonl' line 4 holds a number too long to read"),
    ("array on one line", r"b\.jsonl' is one JSON array, not JSON lines"),
    ("parquet not utf-8", r"b\.parquet' row 2 is not valid UTF-8 \(pass --errors=replace"),
    ("nested too deeply", r"b\.jsonl' line 4 is JSON nested too deeply to read.*--skip_bad_records"),
    ("parquet column", r"b\.parquet' has no column 'text' \(columns: id, content\); pass --text_field"),
    ("parquet null", r"b\.parquet' row 2 has null in column 'text', not a string"),
    ("not parquet", r"b\.parquet' is not a readable Parquet file"),
    ("truncated gzip", r"b\.txt\.gz' is not a valid gzip file, or is truncated or corrupt"),
    ("corrupt gzip", r"b\.jsonl\.gz' is not a valid gzip file, or is truncated or corrupt \(CRC"),
    ("not gzip", r"b\.jsonl\.gz' is not a valid gzip file"),
])
def test_bad_records_and_files_are_user_errors(tmp_path, case, match):
    src, kw = _bad_record_input(tmp_path, case)
    good = write(tmp_path / "good.txt", "fine text\n" * 100)
    with pytest.raises(UserError, match=match):
        prepare([good, src], "gpt2", tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


def test_empty_records_are_fine_but_not_an_empty_corpus(tmp_path):
    empty = write(tmp_path / "e.jsonl", "")
    blank = write_format(tmp_path / "z.parquet", [])
    none = write_format(tmp_path / "n.jsonl", ["", ""])
    good = write_format(tmp_path / "g.jsonl.gz", ["some text"])
    prepare([empty, blank, none, good], "gpt2", tmp_path / "out", val_fraction=0.0)
    assert all_tokens(tmp_path / "out") == GPT2.encode("some text")
    for tok in ("gpt2", "char"):
        with pytest.raises(UserError, match="empty"):
            prepare([empty, blank, none], tok, tmp_path / "bad")
        assert not (tmp_path / "bad").exists()


def test_huge_record_is_cut_into_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 500)
    text = SHAKESPEARE[:6000] + MULTIBYTE * 20
    src = write_format(tmp_path / "h.jsonl", [text, "short"])
    pieces = list(corpus.iter_corpus(corpus.make_sources([src]), corpus.Reading(), 10**9))
    assert len(pieces) > 10 and all(n <= 500 for _, n, _, _ in pieces)
    assert "".join(t for _, _, t, _ in pieces) == text + "short"
    assert [new for _, _, _, new in pieces] == [True] + [False] * (len(pieces) - 2) + [True]
    prepare([src], "gpt2", tmp_path / "out", val_fraction=0.0)
    assert GPT2.decode(all_tokens(tmp_path / "out")) == text + "<|endoftext|>short"


def test_cache_key_covers_text_field(tmp_path):
    src = write_format(tmp_path / "in" / "a.jsonl", ["alpha"], field="body")
    write_format(tmp_path / "in" / "b.jsonl", ["beta"], field="text")
    d1 = ensure_prepared([src], "char", tmp_path / "cache", text_field="body", val_fraction=0.0)
    assert ensure_prepared([src], "char", tmp_path / "cache", text_field="body", val_fraction=0.0) == d1
    assert ensure_prepared([tmp_path / "in" / "b.jsonl"], "char", tmp_path / "cache", val_fraction=0.0) != d1
    assert data.cache_key([src], data.Settings("char", text_field="body")) != \
        data.cache_key([src], data.Settings("char", text_field="text"))


# ----- token shards: streaming, splits by document, resume, append

MANY = [SHAKESPEARE[i * 700:(i + 1) * 700] for i in range(60)]  # 60 documents of 700 bytes


def shard_counts(meta: dict) -> tuple[int, int]:
    return len(meta["shards"]["train"]), len(meta["shards"]["val"])


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_concatenate_to_the_whole_corpus(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(data, "CHUNK_BYTES", 2000)  # jobs of ~3 documents: shards can close often
    monkeypatch.setattr(data, "MIN_PARALLEL_BYTES", 0)
    src = write_format(tmp_path / "docs.jsonl", MANY)
    meta = prepare([src], "gpt2", tmp_path / "out", shard_tokens=500, val_documents=6, workers=workers)
    assert shard_counts(meta)[0] >= 5 and all_tokens(tmp_path / "out") == want_gpt2(MANY)
    assert meta["splits"]["train"]["documents"] == 54 and meta["splits"]["val"]["documents"] == 6
    assert GPT2.decode(read_bin(tmp_path / "out", "val")) == "<|endoftext|>" + "<|endoftext|>".join(MANY[-6:])
    starts = store.SplitTokens(tmp_path / "out", meta, "train").starts
    shards = store.SplitTokens(tmp_path / "out", meta, "train").shards
    heads = [int(sh[s]) for sh, st in zip(shards, starts) for s in st]
    assert len(heads) == 54 and heads[0] != 50256 and set(heads[1:]) == {50256}  # eot opens each later doc


def test_whole_documents_go_to_val(tmp_path):
    srcs = [write(tmp_path / f"in/{i:02d}.txt", d) for i, d in enumerate(MANY[:10])]
    meta = prepare([tmp_path / "in"], "char", tmp_path / "out", val_fraction=0.25)
    tok = load_tokenizer(meta["tokenizer"], files(tmp_path / "out"))
    assert tok.decode(read_bin(tmp_path / "out", "val")) == "".join(MANY[7:10])  # ends past 75%: 3 whole files
    assert meta["splits"]["val"]["documents"] == 3 and len(srcs) == 10
    with pytest.raises(UserError, match="val_documents=10 leaves no training text.*10 document"):
        prepare([tmp_path / "in"], "char", tmp_path / "out2", val_documents=10)


def test_interrupted_prepare_resumes_from_the_last_complete_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CHUNK_BYTES", 2000)
    src = write_format(tmp_path / "docs.jsonl", MANY)
    args = dict(shard_tokens=500, val_documents=6, workers=1)
    whole = prepare([src], "gpt2", tmp_path / "whole", **args)
    calls, real = [], data.encode_job

    def dies_at_job_8(*a):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt  # as a kill would, mid-way
        return real(*a)

    monkeypatch.setattr(data, "encode_job", dies_at_job_8)
    with pytest.raises(KeyboardInterrupt):
        prepare([src], "gpt2", tmp_path / "out", **args)
    assert not (tmp_path / "out" / "meta.json").exists()
    calls.clear()
    monkeypatch.setattr(data, "encode_job", lambda *a: calls.append(1) or real(*a))
    meta = prepare([src], "gpt2", tmp_path / "out", **args)
    n_jobs = len(list(data.make_jobs(data.iter_corpus(data.make_sources([src]), data.Reading(), 10**9), True)))
    assert 0 < len(calls) < n_jobs - 3  # only the jobs after the last complete shard
    assert {k: v for k, v in meta.items() if k != "store"} == {k: v for k, v in whole.items() if k != "store"}
    assert all_tokens(tmp_path / "out") == all_tokens(tmp_path / "whole")
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")] == []


def test_append_adds_new_files_as_shards(tmp_path):
    a = write_format(tmp_path / "in" / "a.jsonl", MANY[:30])
    b = write_format(tmp_path / "in" / "b.jsonl", MANY[30:])
    first = prepare([a], "gpt2", tmp_path / "out", val_documents=3)
    meta = prepare([tmp_path / "in"], None, tmp_path / "out", val_documents=3, append=True)  # a is skipped
    assert meta["store"] == first["store"] and [s["path"] for s in meta["sources"]] == [str(a), str(b)]
    assert shard_counts(meta) == (2, 2) and meta["splits"]["val"]["documents"] == 6
    assert GPT2.decode(read_bin(tmp_path / "out", "train")).count("<|endoftext|>") == 52  # 2 x 27 docs
    with pytest.raises(UserError, match="already in"):
        prepare([b], None, tmp_path / "out", append=True)
    with pytest.raises(UserError, match="not the tokenizer"):
        prepare([write(tmp_path / "c.txt", "more")], "char", tmp_path / "out", append=True)
    with pytest.raises(UserError, match="holds none"):
        prepare([b], "gpt2", tmp_path / "nothing", append=True)
    assert load_meta(tmp_path / "out") == meta
    # a file the store holds, edited: it went in twice (another size) or not at all (the same size)
    for edit in (MANY[30:] + ["one more"], [t.upper() for t in MANY[30:]]):
        write_format(b, edit)
        with pytest.raises(UserError, match="b.jsonl' has changed since it was prepared"):
            prepare([tmp_path / "in", write(tmp_path / "c.txt", "more")], None, tmp_path / "out", append=True)
    assert load_meta(tmp_path / "out") == meta


def test_append_summary_counts_the_appended_files(tmp_path, capsys):
    """--append's summary line gives the files and MB it added and their speed, not the whole
    store's over the append's time (2 files and 2x the speed for one appended file)."""
    a = write_format(tmp_path / "a.jsonl", MANY[:30])
    b = write_format(tmp_path / "b.jsonl", MANY[30:])
    out = str(tmp_path / "out")
    assert data.main(["--input", str(a), "--tokenizer", "gpt2", "--out_dir", out]) == 0
    capsys.readouterr()
    assert data.main(["--input", str(b), "--out_dir", out, "--append"]) == 0
    line = capsys.readouterr().out
    mb = f"{b.stat().st_size / 1e6:.1f} MB in"
    assert line.startswith(f"appended to {out}: 1 file(s), {mb}") and "; now 2 file(s);" in line, line


def test_val_fraction_and_val_documents_together_are_refused(tmp_path):
    """Both flags choose the validation split; --val_documents won and --val_fraction was ignored
    without a word. Refused before anything is written."""
    a = write_format(tmp_path / "a.jsonl", MANY[:30])
    with pytest.raises(UserError, match="--val_fraction and --val_documents both choose"):
        data.main(["--input", str(a), "--tokenizer", "gpt2", "--out_dir", str(tmp_path / "out"),
                   "--val_fraction", "0.2", "--val_documents", "3"])
    assert not (tmp_path / "out").exists()


def test_train_py_warns_of_a_text_field_plain_text_does_not_have(tmp_path, capsys):
    """train.py --text_field on plain text (the bundled Shakespeare, say) was silently unused, as
    gpt.data already warned."""
    (tmp_path / "a.txt").write_text("hello world\n" * 50, encoding="utf-8")
    data.ensure_prepared([tmp_path / "a.txt"], "char", tmp_path / "cache", text_field="body")
    assert "warning: --text_field=body was not used: every input is plain text" in capsys.readouterr().err
    data.ensure_prepared([tmp_path / "a.txt"], "char", tmp_path / "cache")
    assert "warning" not in capsys.readouterr().err


def test_a_glob_reaching_into_out_dir_is_refused(tmp_path):
    """out_dir inside a folder is refused before resolving; a glob's files inside it were read as
    input (the second run failed on its own meta.json as a bad JSON line)."""
    write_format(tmp_path / "c" / "a.jsonl", MANY[:10])
    prepare([str(tmp_path / "c" / "**")], "gpt2", tmp_path / "c" / "out", val_documents=1)
    with pytest.raises(UserError, match="lies inside --out_dir"):
        prepare([str(tmp_path / "c" / "**")], "gpt2", tmp_path / "c" / "out", val_documents=1)


def test_append_never_takes_another_commands_progress_and_resumes_its_own(tmp_path, monkeypatch):
    """An interrupted plain prepare of b and then an append of b into the same out_dir: the
    append does not pick up the plain prepare's shards (numbered from 0, with its own counts), so
    the live store stays intact; an interrupted append resumes."""
    monkeypatch.setattr(data, "CHUNK_BYTES", 2000)
    a = write_format(tmp_path / "a.jsonl", MANY[:30])
    b = write_format(tmp_path / "b.jsonl", MANY[30:])
    out = tmp_path / "out"
    prepare([a], "gpt2", out, shard_tokens=500, workers=1)
    live = tree(out)
    real = data.encode_job

    def dies_at(n):
        calls = []

        def encode(*args):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*args)
        return encode

    monkeypatch.setattr(data, "encode_job", dies_at(6))
    with pytest.raises(KeyboardInterrupt):
        prepare([b], "gpt2", out, shard_tokens=500, workers=1)  # a plain prepare, interrupted
    assert tree(out) == live
    monkeypatch.setattr(data, "encode_job", dies_at(6))
    with pytest.raises(KeyboardInterrupt):
        prepare([b], None, out, shard_tokens=500, workers=1, append=True)
    assert tree(out) == live
    calls = []
    monkeypatch.setattr(data, "encode_job", lambda *x: calls.append(1) or real(*x))
    meta = prepare([b], None, out, shard_tokens=500, workers=1, append=True)
    n_jobs = len(list(data.make_jobs(data.iter_corpus(data.make_sources([b]), data.Reading(), 10**9), True)))
    assert 0 < len(calls) < n_jobs  # resumed its own progress
    monkeypatch.setattr(data, "encode_job", real)
    prepare([a], "gpt2", tmp_path / "ref", shard_tokens=500, workers=1)
    ref = prepare([b], None, tmp_path / "ref", shard_tokens=500, workers=1, append=True)  # uninterrupted
    assert all_tokens(out) == all_tokens(tmp_path / "ref") and meta["shards"] == ref["shards"]
    assert meta["splits"]["train"]["documents"] == 54


def test_an_append_that_waited_while_the_store_was_replaced_says_so(tmp_path, monkeypatch):
    """--append read the store before taking the folder's lock: when another preparation replaced
    it meanwhile, the append failed on a missing staging file with advice about permissions."""
    import contextlib
    a, b = write(tmp_path / "a.txt", SHAKESPEARE[:20_000]), write(tmp_path / "b.txt", SHAKESPEARE[20_000:40_000])
    out = tmp_path / "out"
    prepare([a], "char", out)
    locked = data._one_at_a_time

    @contextlib.contextmanager
    def replaced_while_waiting(folder):
        monkeypatch.setattr(data, "_one_at_a_time", locked)
        prepare([a, b], "char", out)  # the other command, which held the lock
        with locked(folder):
            yield
    monkeypatch.setattr(data, "_one_at_a_time", replaced_while_waiting)
    with pytest.raises(UserError, match="was replaced by another preparation while this --append waited"):
        prepare([write(tmp_path / "c.txt", SHAKESPEARE[40_000:50_000])], None, out, append=True)
    assert load_meta(out)["splits"]["train"]["tokens"] > 0


def test_a_jsonl_of_array_lines_is_not_one_array(tmp_path):
    """A first line that is an array of objects is one JSON array only when no line follows (a
    chat-format JSONL has an array a line: each a bad record, skipped on request)."""
    chat = [json.dumps([{"role": "user", "content": "hi"}])] * 3 + [json.dumps({"text": "ok"})]
    src = write(tmp_path / "chat.jsonl", "\n".join(chat) + "\n")
    meta = prepare([src], "gpt2", tmp_path / "out", val_fraction=0.0, skip_bad_records=True)
    assert meta["skipped_records"] == 3 and all_tokens(tmp_path / "out") == want_gpt2(["ok"])


def test_parquet_text_that_is_not_utf8_is_replaced_on_request(tmp_path):
    """--errors=replace reaches Parquet's string columns too (plain and dictionary-encoded): their
    bytes are decoded by us, as a text file's are."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    column = pa.array([b"fine", b"bad \xff byte"]).view(pa.string())
    pq.write_table(pa.table({"text": column}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": column.dictionary_encode()}), tmp_path / "b.parquet")
    prepare([tmp_path / "a.parquet", tmp_path / "b.parquet"], "gpt2", tmp_path / "out", val_fraction=0.0,
            errors="replace")
    assert all_tokens(tmp_path / "out") == want_gpt2(["fine", "bad \ufffd byte"] * 2)
