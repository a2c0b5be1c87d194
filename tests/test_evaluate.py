import json
import math
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

import pytest

from helpers import REPO, run_cli
from test_train import run


@pytest.fixture(scope="module")
def trained(tmp_path_factory, char_data):
    """A 4-step char model that both tests read (neither writes into it)."""
    out = tmp_path_factory.mktemp("evaluate") / "o"
    run(out, char_data, "--max_iters=4", "--eval_interval=4")
    return out


def test_evaluate_matches_direct_loss_and_reports_bpb(tmp_path, trained):
    out = trained
    text = (REPO / "data" / "shakespeare.txt").read_text()[:1000]
    f = tmp_path / "t.txt"
    f.write_text(text)
    r = subprocess.run([sys.executable, "-m", "gpt.evaluate", f"--out_dir={out}", "--input", str(f)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    from gpt.checkpoint import load_model
    from gpt.train import cross_entropy
    model, _, tok = load_model(out, "float32")
    forward = nnx.jit(lambda m, x: m(x))  # compiled per window length: eager compiles op by op
    ids = np.array(tok.encode(text))
    T = model.cfg.block_size
    total, n = 0.0, 0
    for i in range(0, len(ids) - 1, T):
        w = ids[i:i + T + 1]
        logits, _ = forward(model, jnp.asarray(w[None, :-1]))
        total += float(cross_entropy(logits, jnp.asarray(w[None, 1:]))) * (len(w) - 1)
        n += len(w) - 1
    assert res["tokens"] == n == len(ids) - 1
    assert abs(res["loss"] - total / n) < 1e-4
    # bytes of the predicted text: a char model's first character is context only
    assert res["bytes"] == len(text.encode()) - len(text[0].encode())
    assert abs(res["bpb"] - total / math.log(2) / res["bytes"]) < 1e-4
    assert abs(res["perplexity"] - math.exp(res["loss"])) < 1e-3


def test_files_formats_and_folders_read_as_training_reads_them(tmp_path, trained):
    """A char model (no end-of-text token) runs documents together as its training data did, so
    the text cut into files, JSON lines, a .txt.gz or a Parquet file gives the same figures as
    one file; every file's first token was unscored while its bytes counted (bits per byte 11%
    low over 40 one-line files), .jsonl was scored as its JSON syntax and .txt.gz refused."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpt.evaluate import evaluate_text
    text = (REPO / "data" / "shakespeare.txt").read_text()[:600]
    parts = [text[:150], text[150:400], text[400:]]
    (tmp_path / "one.txt").write_text(text)
    (tmp_path / "dir").mkdir()
    for i, p in enumerate(parts):
        (tmp_path / "dir" / f"{i}.txt").write_text(p)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": p}) + "\n" for p in parts))
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(text.encode()))
    pq.write_table(pa.table({"body": parts}), tmp_path / "d.parquet")
    want = evaluate_text(str(trained), [str(tmp_path / "one.txt")], "float32")
    for inputs in ([tmp_path / "dir"], [tmp_path / "d.jsonl"], [tmp_path / "d.txt.gz"], [tmp_path / "d.parquet"]):
        got = evaluate_text(str(trained), [str(i) for i in inputs], "float32", text_field="body")
        assert (got["tokens"], got["bytes"]) == (want["tokens"], want["bytes"]) == (599, 599), inputs
        assert abs(got["loss"] - want["loss"]) < 1e-5 and abs(got["bpb"] - want["bpb"]) < 1e-5, inputs


def test_a_file_read_in_many_pieces_scores_as_one(tmp_path, trained, monkeypatch):
    """gpt.evaluate streams: a file is read, tokenized and scored piece by piece (memory bounded on
    any input, where it held the whole text and its ids), and pieces of 200 bytes give the figures
    of one piece."""
    from gpt import corpus
    from gpt.evaluate import evaluate_text
    f = tmp_path / "t.txt"
    f.write_text((REPO / "data" / "shakespeare.txt").read_text()[:3000])
    want = evaluate_text(str(trained), [str(f)], "float32")
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 200)
    pieces = list(corpus.iter_file_pieces(f, "strict"))
    assert len(pieces) > 10
    got = evaluate_text(str(trained), [str(f)], "float32")
    assert (got["tokens"], got["bytes"]) == (want["tokens"], want["bytes"]) == (2999, 2999)
    assert abs(got["loss"] - want["loss"]) < 1e-6


def test_streamed_batches_predict_every_token_once_across_batch_boundaries(monkeypatch):
    """`score_stream` scores batches of rows * T + 1 ids, each batch's last id the next one's first
    input: streams one shorter, as long as, and one longer than one or two batches (and under 2
    ids), cut into pieces of any size (empty ones too), give the count and loss of consecutive
    T-windows of the whole stream, so no token is dropped or predicted twice at a boundary."""
    from gpt import evaluate as E
    from helpers import tiny_gpt, tiny_model_config
    model = tiny_gpt(tiny_model_config(block_size=8))
    T = model.cfg.block_size
    monkeypatch.setattr(E, "WINDOW_TOKENS", 2 * T)  # rows = 2: a batch spans 17 ids
    nats = E._window_loss(model)
    monkeypatch.setattr(E, "_window_loss", lambda m: nats)  # one compilation for every case
    rng = np.random.default_rng(0)
    span = 2 * T + 1
    for n in (0, 1, 2, span - 1, span, span + 1, 2 * span - 2, 2 * span - 1, 2 * span, 3 * span):
        ids, scored = rng.integers(0, 65, n), rng.random(n) < 0.8
        want_nats, want_n = 0.0, 0
        for s in range(0, max(n - 1, 0), T):  # windows of T from the start, one at a time
            x, y, w = (np.zeros((1, T), a.dtype) for a in (ids, ids, scored))
            k = min(T, n - 1 - s)
            x[0, :k], y[0, :k], w[0, :k] = ids[s:s + k], ids[s + 1:s + k + 1], scored[s + 1:s + k + 1]
            want_nats += float(nats(x, y, w))
            want_n += int(w.sum())
        assert want_n == int(scored[1:].sum())
        for cuts in ([], [0, 0], list(range(1, n)), sorted(rng.integers(0, n + 1, 5).tolist())):
            bounds = [0, *cuts, n]
            pieces = [(ids[a:b], scored[a:b]) for a, b in zip(bounds, bounds[1:])]
            got_nats, got_n = E.score_stream(model, pieces)
            assert got_n == want_n, (n, cuts)
            assert abs(got_nats - want_nats) < 1e-3, (n, cuts)


def test_text_that_cannot_be_tokenized_is_told_before_any_scoring(tmp_path, trained, monkeypatch):
    """A character outside the char model's vocabulary at the end of a long input is one line at
    once, before the weights are read: the streamed scoring would have found it only when it
    reached it."""
    from gpt import checkpoint, evaluate
    from gpt.errors import UserError
    f = tmp_path / "t.txt"
    f.write_text((REPO / "data" / "shakespeare.txt").read_text()[:5000] + "\u00e9")
    monkeypatch.setattr(evaluate, "score_stream", lambda *a: pytest.fail("scored before the check"))
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(UserError, match="not in the char tokenizer's vocabulary"):
        evaluate.evaluate_text(str(trained), [str(f)], "float32")


def test_an_input_with_nothing_to_predict_is_told_before_the_weights_are_read(tmp_path, trained, monkeypatch):
    """An empty file, or one character (a char model predicts none of it), is one line from the
    first reading of the input: it was told only after loading the weights and scoring."""
    from gpt import checkpoint, evaluate
    from gpt.errors import UserError
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    for text in ("", "\ufeff", "x"):
        f = tmp_path / "t.txt"
        f.write_text(text, encoding="utf-8")
        with pytest.raises(UserError, match="fewer than 2 tokens"):
            evaluate.evaluate_text(str(trained), [str(f)], "float32")


def test_sample_cli_rejects_a_prompt_before_reading_the_weights(tmp_path, trained, monkeypatch):
    """sample.py tokenizes the prompt with the checkpoint's tokenizer before it loads the model: a
    character the char vocabulary lacks, or an unreadable --prompt_file, is told at once."""
    import sample as sample_cli
    from gpt import checkpoint
    from gpt.errors import UserError
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(UserError, match="not in the char tokenizer's vocabulary"):
        sample_cli.main([f"--out_dir={trained}", "--prompt=\u00e9t\u00e9", "--max_new_tokens=2"])
    with pytest.raises(UserError, match="cannot read --prompt_file"):
        sample_cli.main([f"--out_dir={trained}", f"--prompt_file={tmp_path / 'nope.txt'}"])


def test_sample_cli_empty_prompt_note_waits_for_the_models(tmp_path, trained, capsys):
    """The prompt is read before the weights, but an empty prompt's note is printed only once the
    models have loaded: a --draft_out_dir (or target) that fails is one line, as it was; a run that
    goes on still says where the empty prompt starts."""
    import sample as sample_cli
    code, _, err = run_cli(capsys, sample_cli.main, f"--out_dir={trained}", "--prompt=",
                           f"--draft_out_dir={tmp_path / 'none'}", "--max_new_tokens=2")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --draft_out_dir="), err
    code, _, err = run_cli(capsys, sample_cli.main, f"--out_dir={trained}", "--prompt=", "--max_new_tokens=2")
    assert code == 0 and "note: empty prompt; starting from a newline" in err, err


def test_documents_follow_an_end_of_text_token_which_is_not_scored(tmp_path):
    """With a tokenizer that has one (gpt2), each document is predicted from an end-of-text token,
    as training separates documents, and that token (no bytes) is not a target."""
    from flax import nnx as nnx_

    from gpt import checkpoint as ckpt
    from gpt.config import to_dict
    from gpt.evaluate import evaluate_text
    from gpt.tokenizer import gpt2_tokenizer
    from helpers import tiny_gpt, tiny_model_config
    cfg = tiny_model_config(vocab_size=50257, block_size=64)
    model = tiny_gpt(cfg)
    c = ckpt.Checkpointer(tmp_path / "m", keep=1, async_save=False)
    c.save(0, nnx_.to_pure_dict(nnx_.state(model)), {"none": np.zeros(())},
           {"format_version": ckpt.FORMAT_VERSION, "step": 0, "config": {"model": to_dict(cfg)},
            "tokenizer": {"kind": "gpt2"}}, None)
    c.close()
    docs = ["To be, or not to be: that is the question.", "Whether 'tis nobler in the mind to suffer"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    got = evaluate_text(str(tmp_path / "m"), [str(tmp_path / "d.jsonl")], "float32")
    tok = gpt2_tokenizer()
    ids = [50256, *tok.encode(docs[0]), 50256, *tok.encode(docs[1])]
    logits = np.asarray(model(jnp.asarray([ids[:-1]]))[0][0, :, :50257], np.float64)
    nats = [np.log(np.exp(row - row.max()).sum()) + row.max() - row[t] for row, t in zip(logits, ids[1:])]
    keep = [n for n, t in zip(nats, ids[1:]) if t != 50256]
    assert got["tokens"] == len(keep) == len(ids) - 2 and got["bytes"] == sum(len(d.encode()) for d in docs)
    assert abs(got["loss"] - np.mean(keep)) < 1e-4


def test_sample_cli_streams_and_stops(trained, capsys):
    """Prompt, length, seed and --num_samples through sample.py's main (its bad inputs are cases of
    tests/test_bad_inputs.py, in subprocesses; the bpe test below runs sample.py as a script)."""
    import sample as sample_cli
    argv = [f"--out_dir={trained}", "--prompt=ROMEO:", "--max_new_tokens=30", "--seed=1"]
    code, out, err = run_cli(capsys, sample_cli.main, *argv)
    assert code == 0, err
    assert out.startswith("ROMEO:") and len(out) >= len("ROMEO:") + 30
    code, again, err = run_cli(capsys, sample_cli.main, *argv, "--num_samples=2")
    assert code == 0 and again.count("ROMEO:") == 2, err
    assert again.split("\n---------------\n")[0].strip() == out.strip()  # same seed, same text
    for n, flags in ((1, []), (2, ["--num_samples=2", "--no_stream"])):  # the prompt alone; was a traceback
        code, out, err = run_cli(capsys, sample_cli.main, *argv, "--max_new_tokens=0", *flags)
        assert code == 0 and out == "\n---------------\n".join(["ROMEO:"] * n) + "\n", err


def test_bpe_tokenizer_travels_from_input_to_sampling(tmp_path):
    """train.py --input --tokenizer=bpe:N prepares (cached) and trains; sample.py needs no flags."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = (REPO / "data" / "shakespeare.txt").read_text()[:60_000]
    (corpus / "a.txt").write_text(text[:30_000])
    (corpus / "b.txt").write_text(text[30_000:])
    env = {"GPT_DATA_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    import os
    env = {**os.environ, **env}
    args = [sys.executable, "train.py", "--preset=tiny", f"--input={corpus}", "--tokenizer=bpe:300",
            "--max_iters=4", "--eval_interval=4", "--no_progress"]
    r = subprocess.run([*args, f"--out_dir={tmp_path / 'o'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    prepared = list((tmp_path / "cache").iterdir())
    assert len(prepared) == 1
    meta = json.loads((prepared[0] / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "bpe" and meta["vocab_size"] == 301  # 300 + <|endoftext|>
    stamp = (prepared[0] / "meta.json").stat().st_mtime_ns
    r2 = subprocess.run([*args, f"--out_dir={tmp_path / 'o2'}"], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env=env)
    assert r2.returncode == 0 and (prepared[0] / "meta.json").stat().st_mtime_ns == stamp  # cached
    assert (tmp_path / "o" / "tokenizer.tiktoken").exists()
    s = subprocess.run([sys.executable, "sample.py", f"--out_dir={tmp_path / 'o'}", "--prompt=KING",
                        "--max_new_tokens=20"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert s.returncode == 0, s.stderr
    assert s.stdout.startswith("KING") and len(s.stdout) > len("KING")  # may stop early at eot
