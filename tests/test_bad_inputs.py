"""A bad-input matrix for every command: exit status 2, one stderr line naming the problem, no
traceback, and nothing changed in the output directory.

Each case is a real subprocess (`train.py`, `sample.py`, `python -m gpt.data|convert|evaluate`).
Most fail during argument validation, before JAX is imported, so they are cheap; the rest load
a checkpoint. They run two at a time. The whole matrix is marked slow; a subset covering every
command runs in CI.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, xla_flags
from gpt import checkpoint as ckpt

PY = sys.executable


@dataclass
class Case:
    name: str
    cmd: list[str]
    needle: str  # must appear in the error line
    watch: Path  # the output directory that must not change
    env: dict[str, str] = field(default_factory=dict)


def snapshot(root: Path) -> dict[str, tuple[int, int]] | None:
    """Every path under root, with size and mtime for files (None if root does not exist).

    A folder's own mtime is left out: `gpt.data` makes and removes a staging dir inside out_dir
    before it reads the inputs, which changes no file."""
    if not root.exists():
        return None
    snap = {}
    for p in root.rglob("*"):
        st = p.lstat()
        snap[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns) if p.is_file() else (0, 0)
    return snap


@pytest.fixture(scope="module")
def w(tmp_path_factory, char_data):
    """The workspace: a prepared corpus, a trained checkpoint, a damaged one, and bad files."""
    root = tmp_path_factory.mktemp("bad_inputs")
    from test_reliability import damage, run_inproc
    good = root / "good"
    run_inproc(good, char_data, "--max_iters=4", "--ckpt_interval=2", "--eval_interval=4")
    bad = root / "damaged"
    shutil.copytree(good, bad)
    for s in ckpt.list_steps(bad):
        damage(bad, s, "truncate_array")
    shutil.copytree(char_data, root / "old_data")  # a failed prepare must leave it intact
    (root / "empty").mkdir()
    (root / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (root / "binary.txt").write_bytes(b"GIF89a\x00\x01\x02" * 100)
    (root / "short.txt").write_text("To be.\n")  # far fewer tokens than block_size + 1
    (root / "a_file").write_text("x")
    (root / "hf_noconfig").mkdir()
    (root / "hf_gemma").mkdir()
    (root / "hf_gemma" / "config.json").write_text(json.dumps({"model_type": "gemma",
                                                               "architectures": ["GemmaForCausalLM"]}))
    (root / "hf_bin").mkdir()
    (root / "hf_bin" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_positions": 1024,
        "n_embd": 768, "n_layer": 12, "n_head": 12, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5}))
    (root / "hf_bin" / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    (root / "text.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # truncated
    vocab = root / "vocab_mismatch"  # hand-edited metadata: a tokenizer larger than the model
    shutil.copytree(good, vocab)
    for s in ckpt.list_steps(vocab):
        path = ckpt.checkpoint_dir(vocab) / str(s) / "meta" / "metadata"
        meta = json.loads(path.read_text())
        meta["tokenizer"]["chars"] += "αβγδε"
        path.write_text(json.dumps(meta))
    import gzip
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')  # line 2 is not JSON
    (root / "nocol.parquet").write_bytes(_parquet_bytes({"content": ["a document"]}))
    (root / "fake.parquet").write_text("text,label\nhello,1\n")  # a CSV named .parquet
    raw = gzip.compress(b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50)
    (root / "cut.txt.gz").write_bytes(raw[:len(raw) // 2])  # a truncated download
    _edited_data_dirs(root, char_data)
    _edited_checkpoints(root, good)
    (root / "textdir").mkdir()
    (root / "textdir" / "a.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    _lora_runs(root, good, char_data, run_inproc)
    return dict(root=root, data=char_data, good=good, bad=bad, old_data=root / "old_data")


def _edited_checkpoints(root: Path, good: Path) -> None:
    """Copies of a trained run whose checkpoint metadata was edited by hand: a null section, a
    wrong type, a tokenizer file name that climbs out of the directory."""
    edits = {"ck_null_config": lambda m: m.update(config=None),
             "ck_wrong_type": lambda m: m["config"]["model"].update(n_layer="four"),
             "ck_nan_eps": lambda m: m["config"]["model"].update(norm_eps=float("nan")),  # sampled newlines
             "ck_nan_best": lambda m: m.update(best_val_loss=float("nan")),  # "best nan" for good
             "ck_traversal": lambda m: m.update(tokenizer={"kind": "bpe", "n_regular": 256, "file": "../../x.tiktoken",
                                                           "sha256": "0" * 64, "vocab_size": 257, "eot_id": 256})}
    for name, edit in edits.items():
        shutil.copytree(good, root / name)
        for s in ckpt.list_steps(root / name):
            path = ckpt.checkpoint_dir(root / name) / str(s) / "meta" / "metadata"
            meta = json.loads(path.read_text())
            edit(meta)
            path.write_text(json.dumps(meta))


def _edited_data_dirs(root: Path, char_data: Path) -> None:
    """Data dirs whose meta.json was edited: its store outside the data dir, a newer format, and
    the single-file layout of format version 1 (which has no document index)."""
    from gpt import store
    from gpt.data import load_meta
    meta = load_meta(char_data)
    for name, edit in [("data_outside", {"store": ".."}), ("data_newer", {"format_version": 99})]:
        shutil.copytree(char_data, root / name)
        (root / name / "meta.json").write_text(json.dumps({**meta, **edit}))
    v1 = root / "data_v1"
    v1.mkdir()
    for split in ("train", "val"):
        tokens = store.SplitTokens(char_data, meta, split)
        (v1 / f"{split}.bin").write_bytes(b"".join(bytes(s) for s in tokens.shards))
    old = {k: meta[k] for k in ("tokenizer", "vocab_size", "dtype")}
    old["splits"] = {s: {k: meta["splits"][s][k] for k in ("tokens", "bytes")} for s in ("train", "val")}
    (v1 / "meta.json").write_text(json.dumps({"format_version": 1, **old}))


def _lora_runs(root: Path, good: Path, char_data: Path, run_inproc) -> None:
    """A LoRA run of `good`, and copies of it whose base is gone or has changed since."""
    from gpt import lora
    run_inproc(root / "lora", char_data, f"--init_from={good}", "--lora_rank=4", "--max_iters=2",
               "--eval_interval=2")
    changed = root / "changed_base"  # good's weights at the same step, one of them perturbed
    step, meta = ckpt.read_meta(good)
    params = lora.read_base(good).params
    params["lnf_scale"] = params["lnf_scale"] + 1.0
    c = ckpt.Checkpointer(changed, keep=1, async_save=False)
    c.save(step, params, {"none": np.zeros((), np.int32)}, meta, None)
    c.close()
    for name, base in (("lora_gone", root / "gone_base"), ("lora_changed", changed)):
        shutil.copytree(root / "lora", root / name)
        for s in ckpt.list_steps(root / name):
            path = ckpt.checkpoint_dir(root / name) / str(s) / "meta" / "metadata"
            meta = json.loads(path.read_text())
            meta["lora"]["base"]["path"] = str(base)
            path.write_text(json.dumps(meta))
    (root / "nonempty").mkdir()
    (root / "nonempty" / "notes.txt").write_text("mine")


def _parquet_bytes(columns: dict) -> bytes:
    """A small Parquet file's bytes (pyarrow writes it)."""
    import io
    import pyarrow as pa
    import pyarrow.parquet as pq
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()


def cases(w) -> list[Case]:
    root, data, good, bad = w["root"], w["data"], w["good"], w["bad"]
    new = root / "new_out"  # never created by a failing run
    T = [PY, "train.py", "--preset=tiny", f"--data_dir={data}", "--no_progress"]
    S = [PY, "sample.py", f"--out_dir={good}", "--max_new_tokens=4"]
    D = [PY, "-m", "gpt.data"]
    C = [PY, "-m", "gpt.convert"]
    E = [PY, "-m", "gpt.evaluate"]
    two_devices = {"XLA_FLAGS": xla_flags(2)}
    all_cases = [
        # train.py: flags
        Case("train unknown flag", T + [f"--out_dir={new}", "--n_layr=2"], "did you mean --n_layer", new),
        Case("train ill-typed int", T + [f"--out_dir={new}", "--batch_size=x"], "--batch_size", new),
        Case("train ill-typed float", T + [f"--out_dir={new}", "--dropout=lots"], "--dropout", new),
        Case("train ill-typed bool", T + [f"--out_dir={new}", "--bias=maybe"], "--bias", new),
        Case("train fractional int", T + [f"--out_dir={new}", "--max_iters=2.5"], "--max_iters", new),
        Case("train zero layers", T + [f"--out_dir={new}", "--n_layer=0"], "--n_layer=0", new),
        Case("train negative block", T + [f"--out_dir={new}", "--block_size=-4"], "--block_size=-4", new),
        Case("train zero batch", T + [f"--out_dir={new}", "--batch_size=0"], "--batch_size=0", new),
        Case("train zero lr", T + [f"--out_dir={new}", "--learning_rate=0"], "--learning_rate=0", new),
        Case("train negative lr", T + [f"--out_dir={new}", "--learning_rate=-1e-3"], "--learning_rate", new),
        Case("train nan lr", T + [f"--out_dir={new}", "--learning_rate=nan"], "--learning_rate", new),
        Case("train heads", T + [f"--out_dir={new}", "--n_embd=30", "--n_head=4"], "divisible by --n_head",
             new),
        Case("train unknown preset", [PY, "train.py", "--preset=gpt5", f"--out_dir={new}"], "unknown preset",
             new),
        Case("train missing config", T + [f"--out_dir={new}", f"--config={root / 'nope.toml'}"],
             "config file", new),
        Case("train block too big", T + [f"--out_dir={new}", "--block_size=100000"], "block_size=100000", new),
        Case("train short corpus", [PY, "train.py", "--preset=tiny", f"--out_dir={new}",
                                    f"--input={root / 'short.txt'}", "--no_progress"], "block_size", new,
             {"GPT_DATA_CACHE": str(root / "cache")}),
        Case("train batch vs devices", T + [f"--out_dir={new}", "--batch_size=3"], "not divisible", new,
             two_devices),
        Case("train model too big for memory", T + [f"--out_dir={new}", "--n_embd=1048576", "--n_head=1",
                                                     "--block_size=8", "--max_iters=1"], "out of memory", new),
        Case("train batch beyond host memory", T + [f"--out_dir={new}", "--batch_size=1000000000"],
             "of host memory", new),  # the kernel's OOM killer ended the run before
        Case("train size beyond int32", T + [f"--out_dir={new}", "--n_layer=10000000000000000"],
             "beyond what any setting takes", new),  # XLA aborted
        Case("train mesh size", T + [f"--out_dir={new}", "--mesh=data:3"], "--mesh=data:3", new),
        Case("train mesh axis", T + [f"--out_dir={new}", "--mesh=model:1"], "unknown axis", new),
        # train.py: mixture of experts
        Case("train moe k above experts", T + [f"--out_dir={new}", "--n_expert=4", "--n_expert_per_token=5"],
             "--n_expert_per_token=5 must be at most --n_expert=4", new),
        Case("train moe k zero", T + [f"--out_dir={new}", "--n_expert=4", "--n_expert_per_token=0"],
             "--n_expert_per_token=0", new),
        Case("train moe expert axis", T + [f"--out_dir={new}", "--n_expert=3", "--mesh=expert:2"],
             "--n_expert=3 is not divisible by the mesh's expert axis", new, two_devices),
        Case("train moe negative aux coef", T + [f"--out_dir={new}", "--n_expert=4", "--moe_aux_loss_coef=-1"],
             "--moe_aux_loss_coef=-1.0", new),
        Case("train moe negative z coef", T + [f"--out_dir={new}", "--n_expert=4", "--moe_z_loss_coef=-0.5"],
             "--moe_z_loss_coef=-0.5", new),
        Case("train moe negative capacity", T + [f"--out_dir={new}", "--n_expert=4", "--expert_capacity_factor=-0.5"],
             "--expert_capacity_factor=-0.5", new),
        Case("train moe flag without experts", T + [f"--out_dir={new}", "--moe_every=2"],
             "--moe_every needs --n_expert", new),
        Case("train moe_every not dividing", T + [f"--out_dir={new}", "--n_expert=4", "--moe_every=3"],
             "--moe_every=3 must divide --n_layer=2", new),
        # train.py: checkpoints
        Case("train resume nothing", T + [f"--out_dir={root / 'empty'}", "--init_from=resume"],
             "no checkpoint found", root / "empty"),
        Case("train resume other model", T + [f"--out_dir={good}", "--init_from=resume", "--n_layer=3"],
             "n_layer (2 in the checkpoint, 3 requested)", good),
        Case("train scratch over checkpoints", T + [f"--out_dir={good}"], "already holds checkpoints", good),
        Case("train resume all damaged", T + [f"--out_dir={bad}", "--init_from=resume"],
             "every checkpoint", bad),
        Case("train init_from missing dir", T + [f"--out_dir={new}", f"--init_from={root / 'nowhere'}"],
             "nowhere: no checkpoint found", new),
        # train.py: LoRA
        Case("train lora without init_from", T + [f"--out_dir={new}", "--lora_rank=8"],
             "pass --init_from=DIR", new),
        Case("train lora rank zero", T + [f"--out_dir={new}", f"--init_from={good}", "--lora_rank=0"],
             "--lora_rank=0 must be positive", new),
        Case("train lora rank negative", T + [f"--out_dir={new}", f"--init_from={good}", "--lora_rank=-2"],
             "--lora_rank=-2", new),
        Case("train lora rank above matrix", T + [f"--out_dir={new}", f"--init_from={good}",
                                                  "--lora_rank=1000"], "larger than the matrix", new),
        Case("train lora unknown target", T + [f"--out_dir={new}", f"--init_from={good}", "--lora_rank=8",
                                               "--lora_targets=attn,q_proj"], "unknown target 'q_proj'", new),
        Case("train lora target not in model", T + [f"--out_dir={new}", f"--init_from={good}",
                                                    "--lora_rank=8", "--lora_targets=w_q"],
             "this model has no w_q", new),
        Case("train lora alpha zero", T + [f"--out_dir={new}", f"--init_from={good}", "--lora_rank=8",
                                           "--lora_alpha=0"], "--lora_alpha=0", new),
        Case("train lora of a lora run", T + [f"--out_dir={new}", f"--init_from={root / 'lora'}",
                                              "--lora_rank=8"], "is a LoRA run", new),
        Case("train lora resume base gone", T + [f"--out_dir={root / 'lora_gone'}", "--init_from=resume"],
             "is gone", root / "lora_gone"),
        Case("train lora resume base changed", T + [f"--out_dir={root / 'lora_changed'}",
                                                    "--init_from=resume"], "has changed",
             root / "lora_changed"),
        # sample.py
        Case("sample no checkpoint", [PY, "sample.py", f"--out_dir={root / 'empty'}"], "no checkpoint found",
             root / "empty"),
        Case("sample all damaged", [PY, "sample.py", f"--out_dir={bad}"], "every checkpoint", bad),
        Case("sample out_dir inside checkpoints", [PY, "sample.py", f"--out_dir={good / 'checkpoints'}"],
             f"pass {good} itself", good),  # it said to train a new run in there
        Case("sample tokenizer larger than model", [PY, "sample.py", f"--out_dir={root / 'vocab_mismatch'}"],
             "tokens but the model only", root / "vocab_mismatch"),
        Case("sample prompt outside vocab", S + ["--prompt=日本語"], "not in the char tokenizer", good),
        Case("sample prompt not utf-8", S + ["--prompt=ab\udcffcd"], "--prompt is not valid UTF-8", good),
        Case("sample stop not utf-8", S + ["--stop=ab\udcffcd"], "--stop is not valid UTF-8", good),
        Case("sample top_p 0", S + ["--top_p=0"], "--top_p=0", good),
        Case("sample top_p above 1", S + ["--top_p=1.5"], "--top_p=1.5", good),
        Case("sample top_k negative", S + ["--top_k=-1"], "--top_k=-1", good),
        Case("sample negative temperature", S + ["--temperature=-0.5"], "--temperature", good),
        Case("sample no samples", S + ["--num_samples=0"], "--num_samples=0", good),
        Case("sample negative tokens", S + ["--max_new_tokens=-1"], "--max_new_tokens=-1", good),
        Case("sample missing prompt file", S + [f"--prompt_file={root / 'nope.txt'}"], "--prompt_file", good),
        Case("sample unknown flag", S + ["--temprature=1"], "did you mean --temperature", good),
        Case("sample draft missing", S + [f"--draft_out_dir={root / 'nowhere'}"], "--draft_out_dir=", good),
        Case("sample draft damaged", S + [f"--draft_out_dir={bad}"], "every checkpoint", good),
        Case("sample draft tokens 0", S + [f"--draft_out_dir={good}", "--num_draft_tokens=0"],
             "--num_draft_tokens=0", good),
        Case("sample lora base gone", [PY, "sample.py", f"--out_dir={root / 'lora_gone'}"], "is gone",
             root / "lora_gone"),
        Case("sample lora base changed", [PY, "sample.py", f"--out_dir={root / 'lora_changed'}"],
             "has changed", root / "lora_changed"),
        # python -m gpt.data
        Case("data missing path", D + ["--input", str(root / "nope.txt"), "--tokenizer=char",
                                       f"--out_dir={new}"], "does not exist", new),
        Case("data empty corpus", D + ["--input", str(root / "empty.txt"), "--tokenizer=char",
                                       f"--out_dir={new}"], "empty", new),
        Case("data not utf-8", D + ["--input", str(root / "latin1.txt"), "--tokenizer=char",
                                    f"--out_dir={new}"], "not valid UTF-8", new),
        Case("data bad input over old data", D + ["--input", str(root / "latin1.txt"), "--tokenizer=char",
                                                  f"--out_dir={w['old_data']}"], "not valid UTF-8", w["old_data"]),
        Case("data binary", D + ["--input", str(root / "binary.txt"), "--tokenizer=char", f"--out_dir={new}"],
             "looks binary", new),
        Case("data unwritable out", D + ["--input", str(root / "text.txt"), "--tokenizer=char",
                                         f"--out_dir={root / 'a_file' / 'sub'}"], "out_dir", root / "a_file"),
        Case("data unknown tokenizer", D + ["--input", str(root / "text.txt"), "--tokenizer=word",
                                            f"--out_dir={new}"], "unknown tokenizer", new),
        Case("data hf tokenizer missing", D + ["--input", str(root / "text.txt"),
                                               f"--tokenizer=hf:{root / 'nope' / 'tokenizer.json'}",
                                               f"--out_dir={new}"], "cannot read tokenizer", new),
        Case("data hf tokenizer unreadable", D + ["--input", str(root / "text.txt"),
                                                  f"--tokenizer=hf:{root / 'tokenizer.json'}",
                                                  f"--out_dir={new}"], "not a readable Hugging Face", new),
        Case("data missing tokenizer", D + ["--input", str(root / "text.txt"), f"--out_dir={new}"],
             "--tokenizer", new),
        Case("data jsonl not json", D + ["--input", str(root / "bad.jsonl"), "--tokenizer=gpt2",
                                         f"--out_dir={new}"], "bad.jsonl' line 2 is not valid JSON", new),
        Case("data parquet no column", D + ["--input", str(root / "nocol.parquet"), "--tokenizer=gpt2",
                                            f"--out_dir={new}"], "no column 'text' (columns: content)", new),
        Case("data not parquet", D + ["--input", str(root / "fake.parquet"), "--tokenizer=char",
                                      f"--out_dir={w['old_data']}"], "not a readable Parquet", w["old_data"]),
        Case("data val_documents all", D + ["--input", str(root / "text.txt"), "--tokenizer=char",
                                            "--val_documents=1", f"--out_dir={new}"],
             "--val_documents=1 leaves no training text", new),
        Case("data val_documents zero", D + ["--input", str(root / "text.txt"), "--tokenizer=char",
                                             "--val_documents=0", f"--out_dir={new}"], "val_documents=0", new),
        Case("data shard_tokens zero", D + ["--input", str(root / "text.txt"), "--tokenizer=char",
                                            "--shard_tokens=0", f"--out_dir={new}"], "shard_tokens=0", new),
        Case("data append to nothing", D + ["--input", str(root / "text.txt"), "--append", f"--out_dir={new}"],
             "holds none", new),
        Case("data append other tokenizer", D + ["--input", str(root / "text.txt"), "--append", "--tokenizer=gpt2",
                                                 f"--out_dir={w['old_data']}"], "not the tokenizer", w["old_data"]),
        Case("data append to old format", D + ["--input", str(root / "text.txt"), "--append",
                                               f"--out_dir={root / 'data_v1'}"], "format version 1", root / "data_v1"),
        Case("train data store outside", [PY, "train.py", f"--data_dir={root / 'data_outside'}", f"--out_dir={new}"],
             "not a store dir of ours", new),
        Case("train data newer format", [PY, "train.py", f"--data_dir={root / 'data_newer'}", f"--out_dir={new}"],
             "update this code", new),
        Case("train align old format", [PY, "train.py", f"--data_dir={root / 'data_v1'}", "--align_documents",
                                        "--preset=tiny", f"--out_dir={new}"], "no document index", new),
        Case("train cudnn without gpu", T + ["--attention=cudnn", f"--out_dir={new}"], "needs an NVIDIA GPU", new),
        Case("train seed negative", T + ["--seed=-1", f"--out_dir={new}"], "--seed=-1 must be in", new),
        Case("train seed huge", T + ["--seed=99999999999999999999", f"--out_dir={new}"], "--seed=", new),
        Case("train n_embd absurd", T + ["--n_embd=100000000", "--n_head=1", f"--out_dir={new}"], "out of memory", new),
        Case("train resume null config", [PY, "train.py", "--init_from=resume", f"--out_dir={root / 'ck_null_config'}",
                                          f"--data_dir={data}"], "checkpoint", root / "ck_null_config"),
        Case("train resume wrong type", [PY, "train.py", "--init_from=resume", f"--out_dir={root / 'ck_wrong_type'}",
                                         f"--data_dir={data}"], "n_layer", root / "ck_wrong_type"),
        Case("train resume nan best loss", [PY, "train.py", "--init_from=resume", f"--out_dir={root / 'ck_nan_best'}",
                                            f"--data_dir={data}", "--max_iters=8"], "best_val_loss=nan",
             root / "ck_nan_best"),
        Case("sample nan norm_eps", [PY, "sample.py", f"--out_dir={root / 'ck_nan_eps'}"], "norm_eps=nan",
             root / "ck_nan_eps"),
        Case("sample null config", [PY, "sample.py", f"--out_dir={root / 'ck_null_config'}"], "checkpoint",
             root / "ck_null_config"),
        Case("sample wrong type", [PY, "sample.py", f"--out_dir={root / 'ck_wrong_type'}"], "n_layer",
             root / "ck_wrong_type"),
        Case("sample tokenizer traversal", [PY, "sample.py", f"--out_dir={root / 'ck_traversal'}"], "x.tiktoken",
             root / "ck_traversal"),
        Case("evaluate tokenizer traversal", E + [f"--out_dir={root / 'ck_traversal'}", "--input",
                                                  str(root / "text.txt")], "x.tiktoken", root / "ck_traversal"),
        Case("sample absurd samples", S + ["--num_samples=100000000"], "--num_samples=100000000", good),
        Case("sample absurd tokens", S + ["--max_new_tokens=1000000000"], "--max_new_tokens=1000000000", good),
        Case("sample prompt and prompt file", S + ["--prompt=hi", f"--prompt_file={root / 'text.txt'}"],
             "either --prompt or --prompt_file", good),
        Case("sample empty prompt file flag", S + ["--prompt_file="], "--prompt_file names no file", good),
        Case("sample empty draft flag", S + ["--draft_out_dir="], "--draft_out_dir names no folder", good),
        Case("sample endless prompt file", S + ["--prompt_file=/dev/zero"], "not a text prompt", good),
        Case("sample seed negative", S + ["--seed=-5"], "--seed=-5", good),
        Case("sample decode kernels off a GPU", S + ["--decode_kernels"], "needs an NVIDIA GPU", good),
        Case("sample decode kernels not a choice", S + ["--decode_kernels=maybe"], "auto, true or false", good),
        Case("data workers above cores", D + ["--input", str(root / "text.txt"), "--tokenizer=char", "--workers=1000",
                                              f"--out_dir={new}"], "--workers=1000", new),
        Case("data out_dir is the input", D + ["--input", str(root / "textdir"), "--tokenizer=char",
                                               f"--out_dir={root / 'textdir'}"], "inside the input folder",
             root / "textdir"),
        Case("data out_dir inside the input", D + ["--input", str(root / "textdir"), "--tokenizer=char",
                                                   f"--out_dir={root / 'textdir' / 'out'}"], "inside the input folder",
             root / "textdir"),
        Case("data val_fraction one", D + ["--input", str(root / "text.txt"), "--tokenizer=char", "--val_fraction=1",
                                           f"--out_dir={new}"], "val_fraction=1", new),
        Case("data empty text_field", D + ["--input", str(root / "bad.jsonl"), "--tokenizer=char", "--text_field=",
                                           f"--out_dir={new}"], "text_field", new),
        Case("evaluate binary input", E + [f"--out_dir={good}", "--input", str(root / "binary.txt")], "binary", good),
        Case("train truncated gzip", [PY, "train.py", "--preset=tiny", f"--out_dir={new}",
                                      f"--input={root / 'cut.txt.gz'}", "--no_progress"],
             "cut.txt.gz' is not a valid gzip file", new, {"GPT_DATA_CACHE": str(root / "cache")}),
        # python -m gpt.convert
        Case("convert missing dir", C + ["--from_hf", str(root / "nope"), f"--out_dir={new}"],
             "does not exist", new),
        Case("convert no config", C + ["--from_hf", str(root / "hf_noconfig"), f"--out_dir={new}"],
             "config.json", new),
        Case("convert not gpt2", C + ["--from_hf", str(root / "hf_gemma"), f"--out_dir={new}"], "gemma", new),
        Case("convert pickle only", C + ["--from_hf", str(root / "hf_bin"), f"--out_dir={new}"],
             "pytorch_model.bin", new),
        Case("convert to_hf no dir", C + ["--to_hf", f"--out_dir={good}"], "--hf_dir", good),
        Case("convert merge into non-empty", C + ["--merge_lora", f"--out_dir={root / 'lora'}",
                                                  f"--merged_dir={root / 'nonempty'}"], "is not empty",
             root / "nonempty"),
        Case("convert merge not lora", C + ["--merge_lora", f"--out_dir={good}", f"--merged_dir={new}"],
             "not a LoRA run", new),
        Case("convert merge base gone", C + ["--merge_lora", f"--out_dir={root / 'lora_gone'}",
                                             f"--merged_dir={new}"], "is gone", new),
        Case("convert to_hf lora base changed", C + ["--to_hf", f"--out_dir={root / 'lora_changed'}",
                                                     f"--hf_dir={new}"], "has changed", new),
        # python -m gpt.evaluate
        Case("evaluate missing file", E + [f"--out_dir={good}", "--input", str(root / "nope.txt")],
             "does not exist", good),
        Case("evaluate no checkpoint", E + [f"--out_dir={root / 'empty'}", "--input", str(root / "text.txt")],
             "no checkpoint found", root / "empty"),
        Case("evaluate missing input flag", E + [f"--out_dir={good}"], "--input", good),
        Case("evaluate empty include", E + [f"--out_dir={good}", "--input", str(root / "textdir"),
                                            "--include="], "--include '' names no pattern", good),  # was the default
    ]
    return [own_new_dir(c, new) for c in all_cases]


def own_new_dir(case: Case, new: Path) -> Case:
    """Give each case that watches the never-created dir its own copy of it.

    The matrix runs cases in parallel; with one shared dir, a case that stages inside it (and
    removes it again) would show up as a change in another case's snapshot."""
    if case.watch != new:
        return case
    mine = new.with_name(f"{new.name}-{re.sub(r'[^a-z0-9]+', '-', case.name)}")
    cmd = [arg.replace(str(new), str(mine)) for arg in case.cmd]
    return Case(case.name, cmd, case.needle, mine, case.env)


# A subset that covers every command and both kinds (flag checks, checkpoint/file checks); CI runs
# it (each case is a process start-up, ~3 s here). The modules' own tests check more messages in
# process (tests/test_data.py, test_lora.py, test_moe.py, test_convert.py, ...).
FAST = {"train unknown flag", "train negative lr", "train heads", "train resume other model",
        "train scratch over checkpoints", "train model too big for memory", "sample all damaged",
        "sample prompt outside vocab", "sample endless prompt file", "data not utf-8",
        "data out_dir is the input", "train data newer format", "convert pickle only",
        "evaluate no checkpoint", "train moe expert axis", "sample tokenizer larger than model",
        "convert merge into non-empty"}  # mesh flags: tests/test_sharding.py


def check(case: Case) -> str | None:
    """None if the case behaves; otherwise what went wrong."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(), **case.env}
    before = snapshot(case.watch)
    r = subprocess.run(case.cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    after = snapshot(case.watch)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    problems = []
    if r.returncode != 2:
        problems.append(f"exit status {r.returncode}")
    if len(lines) != 1 or not lines[0].startswith("error: "):
        problems.append(f"{len(lines)} stderr lines")
    elif case.needle not in lines[0]:
        problems.append(f"{case.needle!r} not in the message")
    if "Traceback" in r.stderr:
        problems.append("a traceback")
    if before != after:
        changed = sorted(set((before or {}).items()) ^ set((after or {}).items()))[:4]
        problems.append(f"{case.watch} changed: {changed}")
    return f"{case.name}: {', '.join(problems)}\n{r.stderr[-1500:]}" if problems else None


def run_matrix(selected: list[Case]) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(check, selected) if f]
    assert not failures, f"{len(failures)} of {len(selected)} cases failed:\n\n" + "\n\n".join(failures)


def test_matrix_is_big_and_names_are_unique(w):
    all_cases = cases(w)
    assert len(all_cases) >= 90 and len({c.name for c in all_cases}) == len(all_cases)
    assert FAST <= {c.name for c in all_cases}


def test_bad_inputs_fast_subset(w):
    run_matrix([c for c in cases(w) if c.name in FAST])


@pytest.mark.slow
def test_bad_inputs_full_matrix(w):
    run_matrix(cases(w))
