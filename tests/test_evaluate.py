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
    assert abs(res["bpb"] - total / math.log(2) / len(text.encode())) < 1e-4
    assert abs(res["perplexity"] - math.exp(res["loss"])) < 1e-3


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
