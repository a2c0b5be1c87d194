"""Helpers shared by the tests (importable from any test module: pyproject's pytest pythonpath)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# XLA compiles the tests' many small programs the fastest way it can, compilation being most of the
# default run's time on CPU: LLVM at -O0 (the machine code is slower, the optimised HLO the same),
# XLA:CPU's older fusion emitters (its newer MLIR ones compile about 25% slower; a few fusions
# differ, so the decode loop's in-place checks compile it with user_xla_flags())
# and one LLVM module per program (no split for parallel codegen: the two test workers already use
# both cores). tests/conftest.py sets them for every test process, and only the first if this XLA
# does not take the others silently.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")
USER_XLA_FLAGS_ENV = "GPT_TESTS_USER_XLA_FLAGS"  # XLA_FLAGS as the developer set them (tests/conftest.py)


def user_xla_flags() -> str:
    """XLA_FLAGS as the developer set them, before TEST_XLA_FLAGS were added: programs compiled as
    a user's run compiles them."""
    return os.environ.get(USER_XLA_FLAGS_ENV, "")


def xla_flags(devices: int | None = None, as_users: bool = False) -> str:
    """XLA_FLAGS for a test process: this process's flags (tests/conftest.py adds TEST_XLA_FLAGS to
    the developer's; `as_users`: without them), with `devices` simulated CPU devices in place of
    any device count there."""
    base = user_xla_flags() if as_users else os.environ.get("XLA_FLAGS", TEST_XLA_FLAGS)
    flags = [f for f in base.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


def takes_silently(flags: str) -> bool:
    """Whether this XLA starts with `flags` and says nothing (an unknown flag aborts, a retired one
    warns on stderr, which the one-line error tests would see): a CPU start-up in a subprocess."""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        r = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                           env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and not r.stderr.strip()


# Unspaced CJK, emoji with ZWJ and a flag, combining marks: text whose characters are 2-4 bytes.
MULTIBYTE = "漢字かなカナ、한국어텍스트🎉👩\u200d👩\u200d👧🇫🇷e\u0301a\u0308Ελληνικά\n" * 3


def ci_first(values: list, ci) -> list:
    """Parameter values for `pytest.mark.parametrize`, those outside `ci` marked slow: CI checks a
    representative few (the default run stays within its time), `pytest -m slow` all of them.
    A tuple value stands for several arguments."""
    import pytest
    assert all(c in values for c in ci), [c for c in ci if c not in values]  # a typo: all slow
    return [v if v in ci else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]


def tiny_model_config(**kw):
    from gpt.config import ModelConfig
    base = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=True)
    base.update(kw)
    return ModelConfig(**base)


def tiny_runtime(cfg, backend=None, *, dropout=0.0, dtype="float32", remat="none",
                 scan_layers=False, residual_dtype="float32", loss_chunks=0, **override):
    """The Runtime of `cfg` run with these ComputeConfig settings (float32 by default); `override`
    replaces resolved fields (attention="reference" picks that kernel). XLA's path unless a test
    names a Pallas training kernel: a GPU's default kernels (`resolve`) would make the tests'
    references the kernels they check, and backend="gpu" on a CPU would ask for Triton there."""
    from gpt.config import ComputeConfig
    from gpt.runtime import TRAINING_KERNELS, resolve
    compute = ComputeConfig(dropout=dropout, dtype=dtype, remat=remat, scan_layers=scan_layers,
                            residual_dtype=residual_dtype, loss_chunks=loss_chunks)
    return resolve(cfg, compute, backend, **{**dict.fromkeys(TRAINING_KERNELS, ""), **override})


def tiny_gpt(cfg, seed=0, **kw):
    """A GPT of `cfg` with random weights from `seed`, run as `tiny_runtime(cfg, **kw)`."""
    from flax import nnx

    from gpt.model import GPT
    return GPT(cfg, rngs=nnx.Rngs(seed), runtime=tiny_runtime(cfg, **kw))


def bf16_gradient_errors(cfg, x, kernels: dict, **compute) -> tuple[float, float]:
    """How far the training objective's gradients in bf16 (the GPU's settings: bf16 products and
    residual stream) lie from float32's, with the Pallas training kernels `kernels` (Runtime
    fields, e.g. norm_kernel="interpret") and with XLA's path: each the largest relative norm of
    a parameter's difference, all at the highest matmul precision."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gpt import train

    def grads(dtype: str, **kw):
        bf16 = dict(residual_dtype="compute", matmul_out=jnp.dtype("bfloat16")) if dtype == "bfloat16" else {}
        gd, params = nnx.split(tiny_gpt(cfg, dtype=dtype, **bf16, **compute, **kw))
        fn = lambda p: train.objective(gd, p, x, x, moe=train.moe_lib.MoETraining())[0]  # noqa: E731
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.grad(fn))(params)

    def error(got) -> float:
        rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))  # noqa: E731
                                 / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))
        return max(jax.tree.leaves(jax.tree.map(rel, got, want)))

    want = grads("float32")
    return error(grads("bfloat16", **kernels)), error(grads("bfloat16"))


def run_cli(capsys, main, *argv: str) -> tuple[int, str, list[str]]:
    """A command's `main` run in this process as its script runs it (gpt.errors.run_main): exit
    status, stdout, non-blank stderr lines. Same checks as a subprocess without its start-up."""
    import pytest

    from gpt.errors import run_main
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(main, list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, [ln for ln in err.splitlines() if ln.strip()]


def run_on_cpu_devices(script: str, n: int = 4, timeout: int = 120, as_users: bool = False) -> dict:
    """Run a script in a fresh process with `n` CPU devices (`as_users`: compiled with the user's
    XLA flags, not the tests'); return the JSON on its last output line."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(n, as_users), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_on_4_cpu_devices(script: str) -> dict:
    return run_on_cpu_devices(script, 4)


def random_params(cfg, seed: int = 0, std: dict[str, float] | None = None) -> dict:
    """Random parameters of `cfg` drawn on the host (norm scales near 1, the rest N(0, 0.02^2), or
    N(0, std[name]^2) for the leaves named in `std`): building a GPT eagerly compiles every
    initialiser op by op, seconds per model here."""
    import jax
    import numpy as np
    from flax import nnx

    from gpt.model import abstract_model
    rng, std = np.random.default_rng(seed), std or {}

    def draw(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        one = any(w in name for w in ("scale", "norm", "alpha"))
        sd = std.get(name, 0.1 if one else 0.02)
        return (float(one) + sd * rng.standard_normal(x.shape)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(nnx.state(abstract_model(cfg))))


def perturb_and_save(model, path):
    """Add noise to every parameter of a Hugging Face torch model (norm weights and biases too, so
    none is trivially 1 or 0), save it as safetensors and return it in eval mode."""
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def torch_logits(model, idx):
    """A Hugging Face torch model's float32 logits for token ids `idx` (numpy in, numpy out)."""
    import torch
    with torch.no_grad():
        return model(torch.tensor(idx)).logits.float().numpy()


def make_hf_tokenizer(model_dir: Path, vocab_size: int = 290, text: str | None = None) -> Path:
    """A Llama-style Hugging Face tokenizer.json in `model_dir`: byte-level BPE learned from
    Shakespeare, specials <unk>=0, <s>=1, </s>=2, and a template that starts each prompt with <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = text or (Path(__file__).resolve().parent.parent / "data" / "shakespeare.txt").read_text()[:50000]
    hf.train_from_iterator([corpus], trainer=trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    model_dir.mkdir(parents=True, exist_ok=True)
    hf.save(str(model_dir / "tokenizer.json"))
    return model_dir / "tokenizer.json"


CHARS = "".join(sorted(set((REPO / "data" / "shakespeare.txt").read_text()[:100_000])))


def save_checkpoint(out_dir, model, chars: str = CHARS) -> None:
    """`model` as a step-0 checkpoint with a char tokenizer (as gpt.convert writes one)."""
    import numpy as np
    from flax import nnx

    from gpt import checkpoint as ckpt
    from gpt.config import to_dict
    meta = {"format_version": ckpt.FORMAT_VERSION, "step": 0,
            "config": {"model": to_dict(model.cfg), "train": {}},
            "tokenizer": {"kind": "char", "chars": chars, "vocab_size": len(chars), "eot_id": None}}
    c = ckpt.Checkpointer(out_dir, keep=1, async_save=False)
    c.save(0, nnx.to_pure_dict(nnx.state(model)), {"none": np.zeros((), np.int32)}, meta, val_loss=None)
    c.close()
