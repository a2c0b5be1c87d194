"""Hugging Face Llama-family conversion (Llama, Mistral, Qwen2, Qwen3): logit parity with
transformers on small random models built here, exact round trips, greedy decoding, clean errors."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from gpt import convert  # noqa: E402
from gpt.errors import UserError  # noqa: E402
from helpers import make_hf_tokenizer, perturb_and_save, tiny_gpt, torch_logits  # noqa: E402

TOL = 1e-4
V = 300
# Odd sizes on purpose: 3 KV groups, an untied head, rope_theta other than 10000, Llama 3's and
# linear RoPE scaling, Qwen2's q/k/v biases, Qwen3's QK-norm with a head dim that is not hidden / heads.
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
MODELS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM",  # Llama 3.1's RoPE bands: kept, blended, divided
                  dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=0.125,
                                                              high_freq_factor=0.5,
                                                              original_max_position_embeddings=32))),
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=6, num_key_value_heads=3, sliding_window=64,  # = the context
                     tie_word_embeddings=False, rope_theta=20000.0,
                     rope_scaling=dict(rope_type="linear", factor=2.0))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                   rope_theta=1e6)),
}


def make_hf(path: Path, name: str, seed: int = 0):
    """A small random model of family `name` with every parameter perturbed (norm weights and
    biases too, so none is trivially 1 or 0), saved as safetensors."""
    config_cls, model_cls, kw = MODELS[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**COMMON, **kw)
    return perturb_and_save(getattr(transformers, model_cls)(cfg), path)


def our_logits(cfg, params, idx, attention="xla") -> np.ndarray:
    from flax import nnx
    model = tiny_gpt(cfg, attention=attention)
    nnx.update(model, params)
    return np.asarray(model(jax.numpy.asarray(idx))[0])[..., :cfg.vocab_size]


@pytest.mark.parametrize("name", list(MODELS))
def test_llama_family_parity_and_round_trip(tmp_path, name):
    src, out, dst = tmp_path / "hf", tmp_path / "ours", tmp_path / "hf2"
    model = make_hf(src, name)
    idx = np.random.default_rng(0).integers(0, V, (2, 64))  # the whole context
    ref = torch_logits(model, idx)
    cfg, params = convert.load_hf(src)
    from gpt.model import num_params
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    for attention in ("xla", "reference"):
        diff = float(np.abs(our_logits(cfg, params, idx, attention) - ref).max())
        print(f"{name} ({attention}): max |logits diff| {diff:.3g}")
        assert diff < TOL

    assert convert.main(["--from_hf", str(src), "--out_dir", str(out)]) == 0
    assert convert.main(["--to_hf", "--out_dir", str(out), "--hf_dir", str(dst)]) == 0
    a, b = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bit-identical
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == [MODELS[name][1]]
    back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert np.array_equal(torch_logits(back, idx), ref)


@pytest.mark.parametrize("name,length", [("llama-gqa", 5), ("qwen3", 5), ("mistral", 90)])
def test_greedy_continuation_equals_generate(tmp_path, name, length):
    """Greedy decoding equals transformers' generate; for Mistral, whose sliding window is its
    64-token context, a 90-token prompt and its continuation too: the prompt goes through the
    window as decoding does (gpt.sampling.fill_cache), as HF's sliding-window attention has it."""
    from gpt.sampling import Sampler, SamplingSettings
    model = make_hf(tmp_path / "hf", name, seed=1)
    cfg, params = convert.load_hf(tmp_path / "hf")
    prompt = [5, 17, 42, 7, 99] if length == 5 else np.random.default_rng(2).integers(0, V, length).tolist()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    from flax import nnx
    ours = tiny_gpt(cfg)
    nnx.update(ours, params)
    got = Sampler(ours, SamplingSettings(max_new_tokens=20, temperature=0.0)).generate(
        [prompt], jax.random.key(0))[0]
    assert got == want


def _write_config(path: Path, **kw) -> Path:
    path.mkdir()
    base = dict(model_type="llama", architectures=["LlamaForCausalLM"], **COMMON, num_attention_heads=6,
                num_key_value_heads=2)
    base.update(kw)
    (path / "config.json").write_text(json.dumps(base))
    return path


def test_a_qwen_window_that_no_layer_uses_is_full_attention(tmp_path):
    """transformers slides a Qwen model's layers from max_window_layers (default 28) on: with two
    layers, use_sliding_window and a short window change nothing, and the model converts."""
    d = _write_config(tmp_path / "m", model_type="qwen2", use_sliding_window=True, sliding_window=8)
    assert convert.config_from_hf(json.loads((d / "config.json").read_text())).n_layer == COMMON["num_hidden_layers"]


def test_a_qwen3_config_without_head_dim_has_transformers_default():
    """Qwen3Config's head_dim defaults to 128, not hidden / heads (12 here), as Llama's does."""
    kw = dict(COMMON, num_attention_heads=4, num_key_value_heads=2)
    ours = convert.config_from_hf(dict(kw, model_type="qwen3"))
    assert ours.head_dim == transformers.Qwen3Config(**kw).head_dim == 128


@pytest.mark.parametrize("kw,match", [
    (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), r"gemma.*supported.*llama, mistral, qwen2, qwen3"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 8.0}), "rope scaling 'yarn' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor=None must be a positive"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 0}), "factor=0 must be a positive number"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor is not supported"),
    (dict(model_type="mistral", sliding_window=32), "sliding_window=32, shorter than max_position_emb"),
    (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True, max_window_layers=1),
     "sliding-window attention"),  # the layers from max_window_layers on slide (none of 2 at 28)
    (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=0, max_position_embeddings=8192),
     "sliding_window=4096"),
    (dict(num_key_value_heads=4), "--n_head=6 must be divisible by --n_kv_head=4"),
    (dict(hidden_size=42, num_attention_heads=6, num_key_value_heads=2), "RoPE needs an even head dimension"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    # transformers' 4,096-token window where Mistral's config leaves the key out
    (dict(model_type="mistral", max_position_embeddings=8192), "sliding_window=4096, shorter than"),
    (dict(model_type=["llama"], architectures=[1]), r"model_type \['llama'\] \(1\), which is not supported"),
    (dict(rope_parameters=[1]), r"rope_parameters=\[1\] is not an object"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps=nan must be a positive number"),
    (dict(rope_theta=float("inf")), "rope_theta=inf must be a positive number"),
    # a string is truthy: "false" tied the model and dropped its own lm_head.weight
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false' must be true or false"),
    # the same for the flags of sliding windows and biases (read as true: a misleading refusal)
    (dict(model_type="qwen2", use_sliding_window="false"), "use_sliding_window='false' must be true or false"),
    (dict(attention_bias="false"), "attention_bias='false' must be true or false"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0 must be a positive integer"),  # not unset
    (dict(head_dim=True), "head_dim=True must be a positive integer"),  # not a head of width 1
])
def test_unsupported_configs_are_one_clear_error(tmp_path, kw, match):
    d = _write_config(tmp_path / "m", **kw)
    with pytest.raises(UserError, match=match):
        convert.load_hf(d)


def test_converted_dir_samples_with_its_tokenizer(tmp_path, capsys):
    """A Hugging Face directory with tokenizer.json: sample.py needs no flags, its prompt ids and
    greedy text equal transformers' (tokenizer template with BOS, generate stopping at any of the
    model's EOS ids), the tokenizer and the EOS list go back out with --to_hf, and a run past
    block_size rolls the RoPE cache."""
    import sample
    src, out, dst = tmp_path / "hf", tmp_path / "ours", tmp_path / "hf2"
    model = make_hf(src, "llama-gqa", seed=2)
    make_hf_tokenizer(src)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    ids = ref("ROMEO: so")["input_ids"]
    with torch.no_grad():
        free = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(ids):].tolist()
    stop = next(t for t in free[3:] if t not in free[:3] and t != 2)  # a second EOS id it emits
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, stop]}))
    assert convert.main(["--from_hf", str(src), "--out_dir", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # --tokenizer=hf:OUT/tokenizer.json (data for a LoRA run on it): no configs beside the copy, so
    # the ids come from the checkpoint that recorded this very file
    from gpt.tokenizer import hf_spec
    spec = hf_spec(out / "tokenizer.json", "fix")[2]
    assert (spec["bos_id"], spec["eot_id"], spec["stop_ids"]) == (1, 2, [stop])
    meta_file = out / "checkpoints" / "0" / "meta" / "metadata"
    saved = meta_file.read_text()
    for edit in ({"eot_id": 10**9}, {"bos_id": True}, {"stop_ids": list(range(100))}):
        meta = json.loads(saved)
        meta["tokenizer"].update(edit)
        meta_file.write_text(json.dumps(meta))
        with pytest.raises(UserError, match="recorded for .* in its checkpoint step 0 are not ids"):
            hf_spec(out / "tokenizer.json", "fix")
    meta_file.write_text(saved)

    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=[2, stop],
                             pad_token_id=0)[0, len(ids):].tolist()
    assert gen == free[:free.index(stop) + 1]
    want = ref.decode(ids + gen[:-1], skip_special_tokens=True)
    capsys.readouterr()
    assert sample.main([f"--out_dir={out}", "--prompt=ROMEO: so", "--temperature=0",
                        "--max_new_tokens=12"]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert sample.main([f"--out_dir={out}", "--prompt=ROMEO: so", "--max_new_tokens=80"]) == 0
    assert "rolling KV cache" in capsys.readouterr().err  # 64-token context, 84 tokens

    assert convert.main(["--to_hf", "--out_dir", str(out), "--hf_dir", str(dst)]) == 0
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    config = json.loads((dst / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, [2, stop])


def test_hf_tokenizer_bad_input_writes_nothing(tmp_path, monkeypatch):
    src = tmp_path / "hf"
    make_hf(src, "qwen2")
    make_hf_tokenizer(src, vocab_size=V + 40)  # more tokens than the model's 300
    with pytest.raises(UserError, match=f"tokens but the model.s vocabulary is {V}; use the tokenizer"):
        convert.from_hf_to_checkpoint(src, tmp_path / "out")
    (src / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="not a readable Hugging Face tokenizer.json.*fix or remove"):
        convert.from_hf_to_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    good = tmp_path / "good"  # an existing conversion survives a failed --overwrite
    make_hf(good, "qwen2")
    convert.from_hf_to_checkpoint(good, tmp_path / "out")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "out").rglob("*"))
    with pytest.raises(UserError, match="not a readable"):
        convert.from_hf_to_checkpoint(src, tmp_path / "out", overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "out").rglob("*")) == before
    from gpt import checkpoint as ckpt  # a save that fails puts the old conversion back

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt.Checkpointer, "save", full_disk)
    with pytest.raises(OSError):
        convert.from_hf_to_checkpoint(good, tmp_path / "out", overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "out").rglob("*")) == before


def test_a_layer_count_past_the_files_is_refused_before_listing_every_tensor(tmp_path):
    """num_hidden_layers far past the weights' (a typo) names the last layer's missing tensor at
    once; every layer's tensor names were listed first (10**7 layers: 15 GB, two minutes)."""
    src = tmp_path / "hf"
    make_hf(src, "qwen2")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=10**6)))
    with pytest.raises(UserError, match=r"missing tensor model\.layers\.999999\.input_layernorm\.weight"):
        convert.load_hf(src)


def test_from_hf_keeps_a_tokenizer_json_it_did_not_write(tmp_path, monkeypatch):
    """An --out_dir holding a tokenizer.json and no checkpoints (another model's folder): the
    conversion is refused before the weights are read, not written over it, nor does a failed one
    delete it; these very bytes (a conversion killed before its save) convert."""
    from gpt import checkpoint as ckpt
    src, bare, out = tmp_path / "hf", tmp_path / "bare", tmp_path / "out"
    make_hf(src, "qwen2")
    make_hf(bare, "qwen2")  # no tokenizer.json
    make_hf_tokenizer(src)
    out.mkdir()
    (out / "tokenizer.json").write_text("theirs")
    with monkeypatch.context() as m:  # refused before a weight is read (gigabytes of a large model)
        m.setattr(convert, "_open_weights", lambda d: pytest.fail("weights read before the refusal"))
        with pytest.raises(UserError, match="tokenizer.json is there already, with no checkpoints"):
            convert.from_hf_to_checkpoint(src, out)

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(ckpt.Checkpointer, "save", full_disk)
        with pytest.raises(OSError):
            convert.from_hf_to_checkpoint(bare, out)
        assert (out / "tokenizer.json").read_text() == "theirs"
        (out / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
        with pytest.raises(OSError):
            convert.from_hf_to_checkpoint(src, out)
        assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    convert.from_hf_to_checkpoint(src, out)
    assert ckpt.list_steps(out) == [0]


def test_a_conversion_killed_after_its_save_is_complete(tmp_path):
    """--from_hf killed once its checkpoint is on disk (a subprocess that exits there, as a kill
    does: no clean-up runs): the tokenizer.json that checkpoint names is there too (it was written
    after the save, so the conversion could not sample and a rerun was refused as already done), and
    an --overwrite killed there replaces the old conversion only with a complete one."""
    import subprocess
    import sys

    from gpt.checkpoint import list_steps, load_model
    from helpers import REPO
    src, out = tmp_path / "hf", tmp_path / "out"
    make_hf(src, "qwen2")
    make_hf_tokenizer(src)
    killed = ("import os, sys; from gpt import checkpoint as c; close = c.Checkpointer.close; "
              "c.Checkpointer.close = lambda self: (close(self), os._exit(137)); "
              "from gpt.convert import main; main(sys.argv[1:])")
    for extra in ([], ["--overwrite"]):
        r = subprocess.run([sys.executable, "-c", killed, "--from_hf", str(src), "--out_dir", str(out), *extra],
                           cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 137, r.stderr
        assert list_steps(out) == [0]
        _, meta, tok = load_model(out, dtype="float32")
        assert meta["tokenizer"]["kind"] == "hf" and tok.encode("ROMEO")


def test_sharded_safetensors_are_read_and_stay_inside(tmp_path):
    """A model saved in shards (model.safetensors.index.json) converts with the same logits, each
    tensor read from the shard the index names; an index naming a file outside its directory, or a
    shard that lacks the tensor, is refused."""
    model = make_hf(tmp_path / "one", "qwen3", seed=3)
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    assert index.is_file() and len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    idx = np.random.default_rng(1).integers(0, V, (1, 16))
    cfg, params = convert.load_hf(tmp_path / "sharded")
    assert float(np.abs(our_logits(cfg, params, idx) - torch_logits(model, idx)).max()) < TOL
    spec = json.loads(index.read_text())
    shards = sorted(set(spec["weight_map"].values()))
    moved, last = next(name for name, f in spec["weight_map"].items() if f == shards[0]), shards[-1]
    wrong = dict(spec, weight_map={**spec["weight_map"], moved: last})
    index.write_text(json.dumps(wrong))
    with pytest.raises(UserError, match=f"{last} lacks {re.escape(moved)}, which .* places there"):
        convert.load_hf(tmp_path / "sharded")
    spec["weight_map"][moved] = "../one/model.safetensors"
    index.write_text(json.dumps(spec))
    with pytest.raises(UserError, match="outside its directory"):
        convert.load_hf(tmp_path / "sharded")
