"""Hugging Face GPT-2 conversion: logit parity with transformers, exact round trips, clean errors."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from gpt import convert  # noqa: E402
from gpt.errors import UserError  # noqa: E402
from helpers import perturb_and_save, run_cli, tiny_gpt, torch_logits  # noqa: E402

TOL = 1e-4


def make_hf(path: Path, vocab: int, seed: int = 0, activation: str = "gelu_new"):
    """A small random GPT2LMHeadModel with every parameter (LN and biases too) perturbed, saved."""
    torch.manual_seed(seed)
    eot = 50256 if vocab == 50257 else vocab - 1
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=eot, eos_token_id=eot, activation_function=activation)
    return perturb_and_save(transformers.GPT2LMHeadModel(cfg), path)


def our_logits(cfg, params, idx: np.ndarray, attention: str = "xla") -> np.ndarray:
    model = tiny_gpt(cfg, attention=attention)
    nnx.update(model, params)
    out, _ = model(jax.numpy.asarray(idx))
    return np.asarray(out)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    model = make_hf(d, vocab=50257)
    idx = np.random.default_rng(0).integers(0, 50257, (2, 64))  # the full context: every wpe row
    return d, model, idx, torch_logits(model, idx)


@pytest.mark.parametrize("attention", ["xla", "reference"])
def test_load_hf_logit_parity(hf, attention):
    d, _, idx, ref = hf
    cfg, params = convert.load_hf(d)
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (50257, 64, 2, 4, 64)
    assert cfg.bias and cfg.pos_embedding == "learned"
    assert params["wte"].shape == (cfg.padded_vocab_size, 64) and params["wte"].dtype == np.float32
    assert not params["wte"][cfg.vocab_size:].any()  # padded rows are zero
    logits = our_logits(cfg, params, idx, attention)
    assert np.isneginf(logits[..., cfg.vocab_size:]).all()
    diff = float(np.abs(logits[..., :cfg.vocab_size] - ref).max())
    print(f"max abs logit diff vs transformers ({attention}): {diff:.3g}")
    assert diff < TOL


def test_exact_gelu_parity_and_export(tmp_path):
    """nanoGPT's models use exact GELU: HF "gelu" loads as activation=gelu and exports back as it."""
    model = make_hf(tmp_path / "hf", vocab=96, activation="gelu")
    idx = np.random.default_rng(1).integers(0, 96, (2, 64))
    ref = torch_logits(model, idx)
    cfg, params = convert.load_hf(tmp_path / "hf")
    assert cfg.activation == "gelu"
    diff = float(np.abs(our_logits(cfg, params, idx)[..., :96] - ref).max())
    tanh = our_logits(dataclasses.replace(cfg, activation="gelu_tanh"), params, idx)[..., :96]
    assert diff < TOL < float(np.abs(tanh - ref).max())  # the two GELUs are distinguishable here
    assert convert.hf_config(cfg)["activation_function"] == "gelu"


def test_cli_round_trip(hf, tmp_path):
    from gpt.checkpoint import load_model
    d, _, idx, ref = hf
    out, hf2 = tmp_path / "ckpt", tmp_path / "exported"
    assert convert.main(["--from_hf", str(d), "--out_dir", str(out)]) == 0

    model, meta, tok = load_model(out, dtype="float32")
    assert meta["step"] == 0 and meta["tokenizer"]["kind"] == "gpt2" and tok.vocab_size == 50257
    assert meta["config"]["model"]["vocab_size"] == 50257
    logits, _ = model(jax.numpy.asarray(idx))
    diff = float(np.abs(np.asarray(logits)[..., :50257] - ref).max())
    print(f"max abs logit diff vs transformers (via checkpoint): {diff:.3g}")
    assert diff < TOL

    with pytest.raises(UserError, match="already holds checkpoints"):
        convert.main(["--from_hf", str(d), "--out_dir", str(out)])

    assert convert.main(["--to_hf", "--out_dir", str(out), "--hf_dir", str(hf2)]) == 0
    assert sorted(p.name for p in hf2.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((hf2 / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["eos_token_id"] == 50256
    with pytest.raises(UserError, match="not empty"):
        convert.main(["--to_hf", "--out_dir", str(out), "--hf_dir", str(hf2)])

    # bit-identical through checkpoint and export
    _, a = convert.load_hf(d)
    _, b = convert.load_hf(hf2)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(x, y)
    exported, info = transformers.GPT2LMHeadModel.from_pretrained(hf2, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert np.array_equal(torch_logits(exported.eval(), idx), ref)


def test_small_vocab_prefixless_keys_and_buffers(tmp_path):
    """OpenAI's own upload: no "transformer." prefix, attn.bias buffers, an explicit lm_head."""
    model = make_hf(tmp_path / "a", vocab=500, seed=1)
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    raw = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(2):
        raw[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    raw["lm_head.weight"] = raw["wte.weight"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file(raw, tmp_path / "b" / "model.safetensors")

    cfg, a = convert.load_hf(tmp_path / "a")
    _, b = convert.load_hf(tmp_path / "b")
    assert cfg.padded_vocab_size == 512
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(x, y)
    idx = np.random.default_rng(1).integers(0, 500, (1, 16))
    assert np.abs(our_logits(cfg, a, idx)[..., :500] - torch_logits(model, idx)).max() < TOL

    convert.to_hf(a, cfg, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["eos_token_id"] == 499
    _, c = convert.load_hf(tmp_path / "c")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)):
        assert np.array_equal(x, y)

    with pytest.raises(UserError, match="bias=False"):
        convert.to_hf(a, dataclasses.replace(cfg, bias=False), tmp_path / "d")
    with pytest.raises(UserError, match="sinusoidal"):
        convert.to_hf(a, dataclasses.replace(cfg, pos_embedding="sinusoidal"), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_an_export_killed_part_way_is_recovered_by_the_next(tmp_path):
    """An export killed while writing left its hidden temporary copy (a whole model) for good, and
    one killed between its two renames left the previous export hidden as .NAME.old-PID with no
    NAME: the next export removes the first and puts the second back (then refuses to replace it
    without --overwrite). A running process's leftovers are not touched."""
    import subprocess
    import sys
    from helpers import random_params, tiny_model_config
    cfg = tiny_model_config(vocab_size=64)
    params = random_params(cfg)
    first = convert.to_hf(params, cfg, tmp_path / "hf")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    os.replace(first, tmp_path / f".hf.old-{gone.pid}")  # killed between the renames
    (tmp_path / f".hf.{gone.pid}.x1.tmp").mkdir()  # killed while writing
    (tmp_path / f".hf.{os.getpid()}.x2.tmp").mkdir()  # this process: still writing, say
    with pytest.raises(UserError, match="already exists"):
        convert.to_hf(params, cfg, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".hf.{os.getpid()}.x2.tmp", "hf"]
    convert.to_hf(params, cfg, tmp_path / "hf", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".hf.{os.getpid()}.x2.tmp", "hf"]


def test_recovery_touches_only_this_exports_leftovers(tmp_path):
    """Recovering --hf_dir=hf left alone what only looks alike: a sibling export's (hf.31000's
    previous model hidden as .hf.31000.old-PID when killed between its renames, which recovering
    hf.31000 puts back) and a user's own hidden folders (.hf.2024, .hf.123.tmp); it read the
    number after `.hf.` as a PID and deleted them where no such process ran."""
    import subprocess
    import sys
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    theirs = [f".hf.31000.old-{gone.pid}", f".hf.31000.{gone.pid}.abcd1234.tmp", ".hf.2024", ".hf.123.tmp"]
    for name in theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
    convert.recover_killed_write(tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)
    convert.recover_killed_write(tmp_path / "hf.31000")  # its own: the previous model comes back
    assert (tmp_path / "hf.31000" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.123.tmp", ".hf.2024", "hf.31000"]


def _bad_dirs(root: Path, good: Path) -> dict[str, tuple[list[str], str]]:
    cases: dict[str, tuple[list[str], str]] = {}
    cases["missing_dir"] = (["--from_hf", str(root / "nope")], "does not exist")
    (root / "noconfig").mkdir()
    cases["missing_config"] = (["--from_hf", str(root / "noconfig")], "config.json")
    (root / "gemma").mkdir()
    (root / "gemma" / "config.json").write_text(json.dumps(
        {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    cases["gemma"] = (["--from_hf", str(root / "gemma")], "GemmaForCausalLM")
    (root / "act").mkdir()  # a list where a name belongs: TypeError (unhashable) before
    (root / "act" / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()),
                                                          "activation_function": ["gelu"]}))
    cases["activation_a_list"] = (["--from_hf", str(root / "act")], "activation_function ['gelu']")
    (root / "tie").mkdir()  # a string: its untied lm_head was dropped as a tied model's
    (root / "tie" / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()),
                                                          "tie_word_embeddings": "false"}))
    (root / "tie" / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    cases["tie_a_string"] = (["--from_hf", str(root / "tie")], "tie_word_embeddings='false' must be")
    (root / "pickle").mkdir()
    (root / "pickle" / "config.json").write_text((good / "config.json").read_text())
    (root / "pickle" / "pytorch_model.bin").write_bytes(b"not read")
    cases["pickle_only"] = (["--from_hf", str(root / "pickle")], "pickle")
    (root / "shape").mkdir()
    (root / "shape" / "config.json").write_text((good / "config.json").read_text())
    t = load_file(good / "model.safetensors")
    t["transformer.h.1.attn.c_attn.weight"] = np.ascontiguousarray(t["transformer.h.1.attn.c_attn.weight"].T)
    save_file(t, root / "shape" / "model.safetensors")
    cases["wrong_shape"] = (["--from_hf", str(root / "shape")], "h.1.attn.c_attn.weight")
    (root / "empty_out").mkdir()
    cases["to_hf_no_checkpoint"] = (["--to_hf", "--out_dir", str(root / "empty_out"),
                                     "--hf_dir", str(root / "x")], "no checkpoint")
    cases["bad_flag"] = (["--from_hf", str(good), "--bogus"], "unrecognized")
    (root / "a_file").write_text("not a folder")
    cases["out_dir_a_file"] = (["--from_hf", str(good), "--out_dir", str(root / "a_file" / "sub")],
                               "is a file, not a folder")
    cases["out_dir_is_hf_dir"] = (["--from_hf", str(good), "--out_dir", str(good)], "Hugging Face directory")
    return cases


def test_bad_inputs_are_one_line_errors(hf, tmp_path, capsys):
    """Through convert's main in this process (an unexpected exception fails the test; the
    subprocess form of a convert case is in tests/test_bad_inputs.py)."""
    d = hf[0]
    for name, (args, needle) in _bad_dirs(tmp_path, d).items():
        args = args if "--out_dir" in args else args + ["--out_dir", str(tmp_path / f"out_{name}")]
        code, _, lines = run_cli(capsys, convert.main, *args)
        assert code == 2, (name, lines)
        assert len(lines) == 1 and lines[0].startswith("error:"), (name, lines)
        assert needle in lines[0], (name, lines[0])
        assert not (tmp_path / f"out_{name}" / "checkpoints").exists()
        assert not (tmp_path / "x").exists()


def test_from_hf_is_refused_while_a_run_holds_the_out_dir(hf, tmp_path):
    """--from_hf --overwrite into an out_dir a training run is using (it holds the folder's lock):
    one line, nothing moved aside; once the lock is free it converts."""
    import fcntl

    from gpt import checkpoint as ckpt
    out = tmp_path / "ckpt"
    args = ["--from_hf", str(hf[0]), "--out_dir", str(out), "--overwrite"]
    assert convert.main(args) == 0
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(UserError, match="is in use by another run"):
            convert.main(args)
        assert ckpt.list_steps(out) == [0] and not (out / ckpt.ASIDE).exists()
    finally:
        os.close(fd)
    assert convert.main(args) == 0


def gpt2_tokenizer_json(path: Path, edit=None) -> None:
    """GPT-2's tokenizer as a Hugging Face tokenizer.json (transformers' converter from the bundled
    ranks), optionally edited as a JSON dict first."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from gpt.tokenizer import GPT2_PATTERN, GPT2_RANKS_FILE
    hf = TikTokenConverter(vocab_file=str(GPT2_RANKS_FILE), pattern=GPT2_PATTERN,
                           extra_special_tokens=["<|endoftext|>"]).converted()
    spec = json.loads(hf.to_str())
    spec["model"]["vocab"]["<|endoftext|>"] = 50256  # as in GPT-2's own file (vocab.json holds it)
    if edit is not None:
        edit(spec)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(spec))


def _swap_two_ids(spec):
    vocab = spec["model"]["vocab"]
    vocab["Hello"], vocab["world"] = vocab["world"], vocab["Hello"]


def test_gpt2_sized_vocabulary_with_a_tokenizer_of_its_own(hf, tmp_path):
    """A GPT-2 model of GPT-2's 50,257 tokens samples with GPT-2's bundled tokenizer only if its
    tokenizer.json is GPT-2's: a community GPT-2 trained from scratch often keeps the size with a
    BPE of its own (here: two ids swapped, or GPT-2's vocabulary without its merges)."""
    from gpt.checkpoint import load_model
    from gpt.tokenizer import is_gpt2
    from tokenizers import Tokenizer
    from helpers import tiny_model_config
    cfg = tiny_model_config(vocab_size=50257)
    gpt2_tokenizer_json(tmp_path / "same")
    assert convert.hf_dir_tokenizer(tmp_path / "same", cfg)[0]["kind"] == "gpt2"
    assert is_gpt2(Tokenizer.from_file(str(tmp_path / "same" / "tokenizer.json")))
    pad = {"id": 50257, "content": "[PAD]", "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": True}  # added for batching: GPT-2's all the same
    gpt2_tokenizer_json(tmp_path / "padded", lambda spec: spec["added_tokens"].append(pad))
    assert convert.hf_dir_tokenizer(tmp_path / "padded", cfg)[0]["kind"] == "gpt2"
    for name, token in (("added", {**pad, "content": "zzqq", "special": False}),  # text encodes to it
                        ("merged", None)):
        edit = ((lambda spec: spec["added_tokens"].append(token)) if token else
                (lambda spec: (spec["model"]["vocab"].update({"Ġtokenizer": 50257}),
                               spec["model"]["merges"].append(["Ġtoken", "izer"]))))
        gpt2_tokenizer_json(tmp_path / name, edit)
        assert not is_gpt2(Tokenizer.from_file(str(tmp_path / name / "tokenizer.json"))), name
    gpt2_tokenizer_json(tmp_path / "nomerges", lambda spec: spec["model"].update(merges=[]))
    assert convert.hf_dir_tokenizer(tmp_path / "nomerges", cfg)[0]["kind"] == "hf"

    d, out = tmp_path / "own", tmp_path / "ckpt"
    gpt2_tokenizer_json(d, _swap_two_ids)
    for f in hf[0].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    assert convert.main(["--from_hf", str(d), "--out_dir", str(out)]) == 0
    _, meta, tok = load_model(out, dtype="float32")
    assert meta["tokenizer"]["kind"] == "hf" and (out / "tokenizer.json").is_file()
    assert tok.encode("Hello") == [6894] and tok.decode([15496]) == "world"  # GPT-2: 15496, 6894


def test_export_falls_back_past_a_damaged_step_and_never_replaces_its_source(tmp_path):
    """--to_hf exports the newest intact step (sampling falls back past a damaged one; the export
    refused and advised --overwrite, which would delete the good steps), and --overwrite never
    replaces an --hf_dir that holds the checkpoint being exported (it had deleted it)."""
    from gpt import checkpoint as ckpt
    from gpt.config import to_dict
    from helpers import tiny_model_config
    from test_reliability import damage
    cfg = dataclasses.replace(tiny_model_config(), bias=True)
    out = tmp_path / "run"
    c = ckpt.Checkpointer(out, keep=2, async_save=False)
    for step in (1, 2):
        meta = {"format_version": ckpt.FORMAT_VERSION, "step": step, "config": {"model": to_dict(cfg)},
                "tokenizer": {"kind": "char", "chars": "abc", "vocab_size": 3, "eot_id": None}}
        c.save(step, nnx.to_pure_dict(nnx.state(tiny_gpt(cfg, seed=step))), {"none": np.zeros(())}, meta, 1.0)
    c.close()
    damage(out, 2, "truncate_array")
    assert "exported step 1" in convert.checkpoint_to_hf(out, tmp_path / "hf")
    out = out.rename(tmp_path / "hf" / "ours")  # the run kept beside its export
    with pytest.raises(UserError, match="holds the checkpoint being exported"):
        convert.checkpoint_to_hf(out, tmp_path / "hf", overwrite=True)
    assert ckpt.list_steps(out) and (tmp_path / "hf" / "config.json").is_file()
