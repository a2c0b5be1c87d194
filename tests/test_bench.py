"""Benchmark scripts run end to end (no timing asserts), and the custom-VJP dense matches the einsum."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_train_smoke():
    out = _run("train.py", "--preset=tiny", "--steps=2", "--warmup=1", "--chain=2", "--ceiling_n=128",
               "--ceiling_reps=2", "--dtypes=float32,bfloat16", "--residual_dtype=compute",
               "--runtime=mlp_recompute=false,command_buffers=false")
    for k in ("tokens_per_sec", "model_tflops", "ceiling_tflops", "mfu_measured", "mfu_vendor",
              "compile_sec", "device", "dtype", "step_ms"):
        assert k in out
    assert out["dtype"] == "bfloat16" and [r["dtype"] for r in out["runs"]] == ["float32", "bfloat16"]
    # the residual stream in the compute dtype: float32 when that is float32
    assert [r["residual_dtype"] for r in out["runs"]] == ["float32", "bfloat16"]
    assert "speedup_vs_float32" in out and len(out["speedup_per_round"]) == 2  # interleaved rounds
    assert out["chain"] == 2 and len(out["step_ms_all"]) == 2  # a measurement per chain of 2 steps
    assert out["runtime"] == {"mlp_recompute": False, "command_buffers": False}


def test_bench_train_help():
    """--help prints the tool's own options and train.py's settings, not an error."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "train.py"), "--help"], cwd=REPO,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--chain=K" in r.stdout and "  --n_layer=4" in r.stdout and "presets:" in r.stdout and "--steps=5" in r.stdout


def test_bench_runtime_override():
    """--runtime replaces resolved Runtime choices (a GPU A/B of one choice); anything but a known
    KEY=true|false (the kernels: triton|interpret|"") is one line naming it."""
    from bench.train import Variant, runs_here, runtime_only, runtime_override
    from gpt.config import ComputeConfig, TrainConfig
    from gpt.errors import UserError
    from helpers import tiny_model_config
    assert runtime_override("lse_one_pass=false, mlp_recompute=true") == {
        "lse_one_pass": False, "mlp_recompute": True}
    assert runtime_override("") == {}
    assert runtime_override("dense_vjp=0") == {"dense_vjp": False}  # train.py's spellings of a bool
    assert runtime_override("gelu_kernel=interpret,norm_kernel=interpret,xent_kernel=interpret") == {
        "gelu_kernel": "interpret", "norm_kernel": "interpret", "xent_kernel": "interpret"}
    assert runtime_override("norm_kernel=triton") == {"norm_kernel": "triton"}  # compiled for a GPU anywhere
    assert runtime_override("gelu_kernel=,norm_kernel=") == {"gelu_kernel": "", "norm_kernel": ""}  # XLA's
    assert runtime_override("command_buffers=false") == {"command_buffers": False}
    with pytest.raises(UserError, match="norm_kernel=triton needs a GPU"):  # timed only on one
        runs_here({"norm_kernel": "triton", "dense_vjp": False})
    for bad, says in (("foo=1", "foo"), ("dense_vjp", "dense_vjp"), ("dense_vjp=maybe", "true or false"),
                      ("dtype=true", "dtype"), ("xent_kernel=cuda", "triton"), ("norm_kernel=cuda", "triton"),
                      ("gelu_kernel=cuda", "gelu_kernel is one of")):
        with pytest.raises(UserError, match=says):
            runtime_override(bad)
    assert runtime_only(["--runtime=mlp_recompute=false", "--preset=tiny"]) == (
        {"mlp_recompute": False}, ["--preset=tiny"])
    with pytest.raises(UserError, match="--chain is bench/train.py's"):  # timing options: not used there
        runtime_only(["--chain=5", "--preset=tiny"])
    m, c, t = tiny_model_config(), ComputeConfig(), TrainConfig(batch_size=2)
    assert not Variant(m, c, t, {"dense_vjp": False}).rt.dense_vjp and Variant(m, c, t).rt.dense_vjp


@pytest.mark.parametrize("arg", ["--chain=0", "--steps=0", "--warmup=-1", "--chain=x"])
def test_bench_train_options_are_checked(arg):
    from bench.train import split_bench_args
    from gpt.errors import UserError
    with pytest.raises(UserError, match=arg.split("=")[0]):
        split_bench_args([arg, "--preset=tiny"])


@pytest.mark.slow  # 26 s (it also times transformers); bench/gpu.py --size=tiny runs it too
def test_bench_sample_smoke():
    out = _run("sample.py", "--configs=tiny", "--batches=1,2", "--new_tokens=4", "--reps=1", "--transformers")
    rows = out["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    for k in ("prefill_ms", "decode_tokens_per_sec", "baseline_tokens_per_sec", "speedup", "read_util"):
        assert k in rows[0]
    assert all(r["transformers_tokens_per_sec"] > 0 and r["vs_transformers"] > 0 for r in rows)
    assert rows[0]["baseline_tokens_per_sec"] > 0 and rows[1]["baseline_tokens_per_sec"] is None


@pytest.mark.slow  # 10 s; the benchmark's draft training data, not the product's
def test_distillation_text_is_the_targets_greedy_text_then_the_corpus(tmp_path):
    """bench/sample.py's distilled draft trains on the target's greedy continuations of windows of
    the training split, then the whole corpus (its validation split stays the corpus's end); the
    file is built once and reused."""
    import jax
    from flax import nnx
    from helpers import CHARS, save_checkpoint, tiny_model_config
    from bench import sample as bs
    from gpt.model import GPT
    from gpt.sampling import Sampler, SamplingSettings
    from gpt.tokenizer import CharTokenizer
    target = GPT(tiny_model_config(vocab_size=len(CHARS), block_size=64), rngs=nnx.Rngs(3))
    save_checkpoint(tmp_path / "target", target)
    path = bs.distillation_text(tmp_path / "target", 3, tmp_path, batch=2)
    corpus = (REPO / "data" / "shakespeare.txt").read_text()
    text = path.read_text()
    assert text.endswith(corpus) and len(text) == 3 * (64 + 2) + len(corpus)
    pieces = [text[i * 66:i * 66 + 64] for i in range(3)]  # prompt 16 + 48 new chars, then a blank line
    assert all(p[:16] in corpus[:int(0.9 * len(corpus))] for p in pieces)
    tok = CharTokenizer(CHARS)
    again = Sampler(target, SamplingSettings(max_new_tokens=48, temperature=0.0), chunk=48).generate(
        [tok.encode(p[:16]) for p in pieces[:2]], jax.random.key(0))  # the first batch of two rows
    assert [tok.decode(o) for o in again] == [p[16:] for p in pieces[:2]]
    before = path.stat().st_mtime_ns
    assert bs.distillation_text(tmp_path / "target", 3, tmp_path, batch=2) == path
    assert path.stat().st_mtime_ns == before


@pytest.mark.parametrize("flag", ["--draft_iters=-1", "--distill_rows=-3"])
def test_bench_sample_refuses_negative_pair_settings(flag):
    """One line naming the option, exit status 2, before anything is trained or timed."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "sample.py"), "--speculative", "--configs=", flag],
                       cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and flag.split("=")[0] in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def test_train_pair_trains_the_draft_for_draft_iters(tmp_path, monkeypatch):
    """--draft_iters trains the pair's draft (distilled or not) for its own number of steps and the
    target for --pair_iters; without it both take --pair_iters."""
    from bench import sample as bs
    calls = []
    monkeypatch.setattr(bs, "train_cached", lambda flags, iters, root: calls.append((flags, iters)) or
                        root / str(len(calls)))
    monkeypatch.setattr(bs, "distillation_text", lambda target, rows, root: root / f"distill-{rows}.txt")
    target_flags, draft_flags = bs.PAIRS["tiny"]
    assert bs.train_pair("tiny", 20, tmp_path, 4, draft_iters=60) == (tmp_path / "1", tmp_path / "2")
    assert calls == [(target_flags, 20), (draft_flags + [f"--input={tmp_path / 'distill-4.txt'}"], 60)]
    calls.clear()
    bs.train_pair("tiny", 20, tmp_path)
    assert calls == [(target_flags, 20), (draft_flags, 20)]


@pytest.mark.slow  # minutes on 2 cores; a session with a GPU runs bench/gpu.py itself
def test_gpu_suite_runs_at_tiny_size(tmp_path):
    """bench/gpu.py end to end on CPU with tiny models: every part runs and lands in gpu.json,
    gpu.md and loss.png (the GPU tests are skipped off a GPU)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), f"--out={tmp_path}",
                        "--size=tiny"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu.json").read_text())["parts"]
    assert res["tests"]["exit"] == 0 and res["tests"]["skipped"] > 0
    assert all("error" not in v and v["tokens_per_sec"] > 0 for v in res["train"].values())
    assert res["train"]["b4-scan"]["flags"][-1] == "--scan_layers"
    rows = [row for w in ("compute", "float32") for row in res["sample"][w]["results"]]
    assert len(rows) == 4 and all(0 < row["bw_util"] for row in rows)
    assert res["curve"]["exit"] == 0 and [s for s, *_ in res["curve"]["eval"]] == [10, 20]
    spec = res["speculative"]
    assert list(spec) == ["K=2", "K=4", "distilled K=4", "distilled K=6"]
    assert all(x["same_tokens"] and x["speedup"] > 0 for x in spec.values())
    assert (tmp_path / "loss.png").stat().st_size > 0
    md = (tmp_path / "gpu.md").read_text()
    assert "## Training step" in md and "## Speculative decoding" in md


@pytest.mark.slow  # six tiny runs and two that XLA refuses
def test_gpu_suite_compares_xla_flags_with_a_baseline(tmp_path):
    """bench/gpu.py --parts=xla: each setting runs the training step and batch-1 decoding in its
    own processes beside a baseline without it; a flag this XLA does not know is recorded as an
    error of its own row, a retired one (a warning, no effect) as a note, and the other rows stand."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    settings = "--xla_gpu_enable_cublaslt=true; --xla_no_such_flag=1; --xla_cpu_use_thunk_runtime=true"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), f"--out={tmp_path}", "--size=tiny",
                        "--parts=xla", f"--xla_flags={settings}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())["parts"]["xla"]
    assert list(rows) == ["baseline", *[x.strip() for x in settings.split(";")]]
    assert rows["baseline"]["train"]["vs_baseline"] == rows["baseline"]["decode"]["vs_baseline"] == 1.0
    known = rows["--xla_gpu_enable_cublaslt=true"]
    assert all(known[k]["ms"] > 0 and known[k]["vs_baseline"] > 0 and "warning" not in known[k]
               for k in ("train", "decode"))
    unknown = rows["--xla_no_such_flag=1"]
    assert "ms" not in unknown["train"] and "--xla_no_such_flag" in unknown["train"]["error"]
    assert unknown["decode"]["error"] == unknown["train"]["error"]  # XLA's own line, without its log prefix
    retired = rows["--xla_cpu_use_thunk_runtime=true"]
    assert retired["train"]["ms"] > 0 and "no longer supported" in retired["train"]["warning"]
    md = (tmp_path / "gpu.md").read_text()
    assert "## XLA flags" in md and "no longer supported" in md


@pytest.mark.slow  # two tiny decoding runs
def test_gpu_suite_times_xla_flags_on_decoding_alone(tmp_path):
    """--xla_programs=decode: each setting times batch-1 decoding only (the training step is the
    slow half of the part and a decoding flag needs none of it); train's cells say so."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), f"--out={tmp_path}", "--size=tiny",
                        "--parts=xla", "--xla_programs=decode", "--xla_flags=--xla_cpu_enable_fast_math=false"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())["parts"]["xla"]
    assert list(rows) == ["baseline", "--xla_cpu_enable_fast_math=false"]
    assert all(x["decode"]["ms"] > 0 and "not run" in x["train"]["error"] for x in rows.values())
    assert "bench/train.py" not in (tmp_path / "gpu.log").read_text()
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), f"--out={tmp_path}", "--size=tiny",
                          "--parts=xla", "--xla_programs=eval"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--xla_programs=eval" in bad.stderr


@pytest.mark.slow
def test_bench_lora_smoke(tmp_path):
    """bench/lora.py end to end at a tiny size: base, LoRA and full fine-tuning, all figures there."""
    out = _run("lora.py", f"--out={tmp_path}", "--preset=tiny", "--base_iters=4", "--iters=4",
               "--eval_iters=1", "--rank=2")
    res = out["results"]
    assert res["base"]["whole_val_loss"] > 0
    for name in ("lora", "full"):
        for k in ("val_loss", "whole_val_loss", "trainable_params", "state_bytes", "step_ms"):
            assert k in res[name]
    assert res["lora"]["trainable_params"] < res["full"]["trainable_params"]
    assert res["lora"]["state_bytes"] < res["full"]["state_bytes"]


@pytest.mark.slow
def test_bench_moe_smoke(tmp_path):
    """bench/moe.py at a tiny size: both models per seed, the MoE-only flags reach the MoE run only."""
    out = _run("moe.py", f"--out={tmp_path}", "--preset=tiny", "--max_iters=4", "--eval_interval=4",
               "--eval_iters=1", "--log_interval=1", "--seeds=1,2", "--expert_capacity_factor=2.0")
    assert [len(out["results"][m]) for m in ("moe", "dense")] == [2, 2]
    assert "--expert_capacity_factor=2.0" in out["flags"]["moe"]
    assert not any("expert" in f for f in out["flags"]["dense"] + out["common_flags"])
    moe, dense = out["results"]["moe"][0], out["results"]["dense"][0]
    assert moe["active_params"] < moe["params"] and dense["active_params"] == dense["params"]
    assert 0 <= moe["dropped_fraction"] <= 1 and moe["load_max_x_E"] >= 1


@pytest.mark.slow  # a developer's tool; 13 s
def test_profile_reports_device_time():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "kernel_time.py"), "train", "--preset=tiny",
                        "--steps=2", "--top=5"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train: per step" in r.stdout and " ms/step" in r.stdout


@pytest.mark.slow  # a developer's tool; 13 s
def test_profile_of_a_decoding_step():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "kernel_time.py"), "decode", "--config=tiny",
                        "--new_tokens=8", "--steps=1", "--top=5"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "decode: per decoded token" in r.stdout


def test_profile_summary_per_step():
    """kernel_time.summarise: busy time and span per step, time by group, the top names with how
    many times a step each ran; long names lose their numeric suffix, so one op's copies add up."""
    from bench import kernel_time as kt
    long = "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT_with_a_long_enough_name_to_be_grouped"
    evs = [(f"{long}.1", 0, 3_000_000), (f"{long}.2", 4_000_000, 1_000_000),
           ("input_reduce_fusion.7", 6_000_000, 2_000_000)]  # two steps: 6 ms busy in an 8 ms span
    x = kt.summarise("XLA Ops", evs, steps=2, top=5)
    assert (x["busy_ms"], x["span_ms"], x["events_per_step"]) == (3.0, 4.0, 1.5)
    assert x["groups"] == {"matmul": 2.0, "fusion": 1.0}
    assert [(k["name"], k["ms"], k["per_step"]) for k in x["top"]] == [
        (long, 2.0, 1.0), ("input_reduce_fusion.7", 1.0, 0.5)]


@pytest.mark.slow  # three tiny profiles, 15 s
def test_gpu_suite_profiles_where_the_time_goes(tmp_path):
    """bench/gpu.py --parts=profile: the training step, with a bf16 stream, and batch-1 decoding,
    each with its device time by group and top names in gpu.json and gpu.md."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), f"--out={tmp_path}", "--size=tiny",
                        "--parts=profile"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())["parts"]["profile"]
    assert list(rows) == ["train", "train, bf16 stream", "decode, batch 1"]
    for x in rows.values():
        assert x["lines"] and all(t["busy_ms"] > 0 and t["top"] for t in x["lines"])
    log = (tmp_path / "gpu.log").read_text()
    commands = [ln for ln in log.splitlines() if ln.startswith("$ ")]
    assert all("--gradient_accumulation_steps=1" in c for c in commands[:2])
    assert ["--residual_dtype=compute" in c for c in commands] == [False, True, False]
    assert "## Profiles" in (tmp_path / "gpu.md").read_text()
    assert all(set(x["plan"]) == {"none"} for x in rows.values())  # XLA:CPU dumps no GPU plan
    assert "XLA's plan: none dumped" in (tmp_path / "gpu.md").read_text()


def test_profile_groups_kernels_by_kind():
    """cuBLAS's Hopper GEMMs (nvjet) are matmuls; cuDNN's flash kernels (which also name wgmma) are
    attention; XLA's fusions and copies keep their groups."""
    from bench import kernel_time as kt
    assert kt.group("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT") == "matmul"
    assert kt.group("gemm_fusion_dot_75") == "matmul"
    assert kt.group("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert kt.group("input_reduce_fusion_53") == "fusion" and kt.group("Memset 3") == "copy"


@pytest.mark.slow  # a developer's tool (its timings need a GPU); 15 s of Pallas's interpreter
def test_matvec_kernels_are_checked_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "matvec.py")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["max_rel_err"] < 1e-5 and "shapes" not in out  # bf16 inputs, float32 sums; no timings


def test_decode_layer_kernels_match_xlas_blocks():
    """bench/decode_layer.py's one-kernel blocks (Pallas's interpreter here) compute what XLA's do:
    the MLP block to float32 summation order (partial rows or atomic adds), the attention block to
    bf16's rounding of its probabilities (an online softmax rounds them unnormalised), the key and
    value written at the position as XLA's. A variant that changes the cache elsewhere, or leaves
    the next block's zeros (`Flow`) not zeros, is an error row."""
    import jax
    from bench import decode_layer as dl
    mlp = dl.check_mlp(jax.random.key(3), d=256, f=512)
    assert {"xla", "rows BF16 BK256 w4", "atomic BF16 BK256 w4", "rows BF8 BK256 w4"} <= set(mlp)
    assert all(e["vs_xla"] < 1e-5 and 1e-4 < e["vs_float64"] < 1e-2 for n, e in mlp.items() if n != "xla")
    for pos in (300, 0, 256, 511):  # past two blocks of 256, no earlier position, a block's first, the last
        attn = dl.check_attention(jax.random.key(4), d=256, h=4, s=512, pos=pos)
        assert len(attn) == 1 + len(dl.ATTENTION_PALLAS) + len(dl.ATTENTION_SPLIT)
        for name, e in attn.items():  # the key and value written are XLA's, bit for bit
            assert e["vs_float64"] < 2e-2 and e["vs_xla"] < 1e-2 and e["cache"] == 0, (pos, name, e)
    x = jax.numpy.ones(4)
    assert dl._attempt(lambda: dl._outputs(dl.Flow(x, x, 0 * x))) == {
        "error": "AssertionError: the next block's zeros are not zeros"}


@pytest.mark.slow  # 33 s of Pallas's interpreter; a GPU runs these paths in bench/gpu.py's kernels part
def test_decode_layer_timing_paths_run_on_cpu(monkeypatch):
    """decode_layer.py's timed programs (chains in a loop, donated caches and flows, the whole
    token with the fastest pair of each block) run and report every variant."""
    import jax
    from bench import decode_layer as dl
    from gpt import metrics
    monkeypatch.setattr(metrics, "measure_copy_gbps", lambda: 10.0)
    key = jax.random.key(0)
    blocks = {"mlp": dl.time_mlp(key, 1, 2, 1), "attention": dl.time_attention(key, 1, 2, 1, 256, 60)}
    assert set(blocks["mlp"]) == set(dl.mlp_variants()) and set(blocks["attention"]) == set(dl.attention_variants())
    assert all(r["us"] > 0 and r["read_gbps"] > 0 for rows in blocks.values() for r in rows.values())
    ok = {b: {n: {"vs_float64": 0.0, "vs_xla": 0.0} for n in rows} for b, rows in blocks.items()}
    token = dl.time_token(key, blocks, ok, 1, 2, 1, 256, 60, v=256)
    assert token["xla"]["mlp"] == "xla" and token["pallas"]["mlp"] == dl._fastest(blocks["mlp"], ok["mlp"])
    assert all(token[w]["of_copy_bound"] > 0 for w in ("xla", "pallas"))


def test_topk_in_two_stages_is_exactly_lax_top_k(monkeypatch):
    """bench/topk.py's two-stage and threshold top-k return lax.top_k's values and indices, ties
    included (at the top, across chunks and at the k-th place), also when the vocabulary is not a
    multiple of the chunk, and with more candidates than the threshold's cap (its fallback); the
    check sees a variant that loses one of the tied entries."""
    import jax
    import jax.numpy as jnp
    from bench import topk
    for vocab in (50304, 50257):
        exact = topk.check(jax.random.key(1), 200, vocab)
        assert len(exact) == 1 + len(topk.CHUNKS) + len(topk.THRESHOLDS) and all(exact.values())
    broken = {"lax.top_k": lambda x: jax.lax.top_k(x, 200),
              "drops a tie": lambda x: jax.lax.top_k(x.at[7].set(-jnp.inf), 200)}  # 7 ties the largest
    us = topk.time_rows(jax.random.key(1), 200, 4096, 2, 1)  # the GPU's timing path, here on CPU
    assert set(us) == {"lax.top_k", "two-stage C1024", "two-stage C2048"} and min(us.values()) > 0
    monkeypatch.setattr(topk, "variants", lambda k, vocab: broken)
    assert topk.check(jax.random.key(1), 200, 50304) == {"lax.top_k": True, "drops a tie": False}


def test_gpu_suite_train_variant_flags_come_last():
    """A train variant's flags follow the size's timing options, so a variant can replace them
    (b64-res-chain20's chains of 20); bench/train.py takes the last of a repeated option."""
    from bench import gpu as suite
    from bench.train import split_bench_args
    cmd = suite.train_cmd(suite.sizes("full"), suite.TRAIN_FULL["b64-res-chain20"])
    opts, _ = split_bench_args(cmd[2:])
    assert (opts["chain"], opts["steps"], opts["warmup"]) == (20, 4, 1)


def test_gpu_suite_every_train_variant_parses():
    """Each train variant of both sizes is a command bench/train.py takes: its timing options, its
    --runtime overrides and train.py's settings parse and build here, so a GPU call spends no time
    on a variant that a typo would end at once."""
    from bench import gpu as suite
    from bench.train import runtime_override, split_bench_args
    from gpt.config import build_train
    for size in ("full", "tiny"):
        sz = suite.sizes(size)
        for name, flags in sz["train_variants"].items():
            opts, rest = split_bench_args(suite.train_cmd(sz, flags)[2:])
            runtime_override(opts["runtime"])
            m, _, t, _ = build_train(rest)
            batch = [int(f.split("=")[1]) for f in flags if f.startswith("--batch_size=")]
            assert [t.batch_size] == batch, name  # the variant's own batch, on the size's model
            assert size == "tiny" or (m.n_layer, m.block_size) == (12, 1024), name  # GPT-2 at T=1024


def test_gpu_suite_train_order_and_logged_xla_flags(tmp_path):
    """Named variants run in the order named (the deciding ones first when time is short), all of
    them in the table's order; a setting added to XLA_FLAGS (the part "xla") shows in gpu.log."""
    from bench import gpu as suite
    seen = []

    class Runner(suite.Runner):
        def run(self, cmd, timeout=None, env=None):
            seen.append(cmd[-1])
            return super().run([sys.executable, "-c", "pass"], timeout, env)

        def save(self, part, rows):
            pass

    r = Runner(tmp_path, 60, dict(os.environ, XLA_FLAGS="--xla_dump_to=x"))
    sz = dict(suite.sizes("full"), train_variants={"a": ["--batch_size=1"], "b": ["--flag"]})
    suite.part_train(r, sz, [])
    suite.part_train(r, sz, ["b", "a"])
    assert seen == ["--batch_size=1", "--flag", "--flag", "--batch_size=1"]
    assert "XLA_FLAGS=" not in (tmp_path / "gpu.log").read_text()  # the suite's own flags alone
    r.run(["x"], env=suite.with_xla_flags(r.env, "--f=1"))
    assert (tmp_path / "gpu.log").read_text().count("XLA_FLAGS='--xla_dump_to=x --f=1'") == 1
    assert suite.with_xla_flags({}, "--f=1") == {"XLA_FLAGS": "--f=1"}


def test_gpu_suite_kernel_tools_are_checked(tmp_path, capsys):
    """--kernel_tools names some of the part's tools; anything else is argparse's error (exit 2),
    before the suite starts anything."""
    from bench import gpu as suite
    with pytest.raises(SystemExit) as e:
        suite.main([f"--out={tmp_path}", "--parts=kernels", "--kernel_tools=norm,bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kernel_tools=norm,bogus: some of norm, gelu, decode_layer" in err


def test_gpu_suite_train_variants_are_checked(tmp_path, capsys):
    """--train_variants names variants of the size's table, each once, in the order given;
    another name is argparse's error before the suite starts anything."""
    from bench import gpu as suite
    with pytest.raises(SystemExit) as e:  # a variant of the other size's, or none at all
        suite.main([f"--out={tmp_path}", "--parts=train", "--train_variants=b64-res,b4"])
    assert e.value.code == 2 and "no variant b4 at --size=full" in capsys.readouterr().err
    assert suite.parse_args(["--out=x", "--train_variants=b64-res-xla, b64-res,b64-res-xla"]
                            ).train_variants == ["b64-res-xla", "b64-res"]


@pytest.mark.parametrize("argv, words", [
    (["--parts="], "--parts names none"), (["--timeout=0"], "--timeout=0: seconds per process"),
    (["--out={file}"], "is a file; pass a folder"), (["--out={file}/sub"], "is a file; pass a folder")])
def test_gpu_suite_refuses_settings_that_run_nothing(tmp_path, capsys, argv, words):
    """No part, no time, or an --out under a file: argparse's one line (it ran nothing and exited
    0, timed every part out, or ended in a FileExistsError traceback)."""
    from bench import gpu as suite
    (tmp_path / "f").write_text("a file")
    argv = [a.replace("{file}", str(tmp_path / "f")) for a in argv]
    with pytest.raises(SystemExit) as e:
        suite.parse_args([f"--out={tmp_path / 'o'}", *argv] if not argv[0].startswith("--out") else argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_norm_bench_checks_every_variant_against_xla(monkeypatch, capsys):
    """bench/norm.py off a GPU: every kernel variant's gradients checked against XLA's backward of
    the model's norm (the kernels in the interpreter), no timings; one whose sums are off fails
    the run."""
    from bench import norm
    assert norm.main(["--rows=64", "--dim=96", "--reps=1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["variants"]) == 1 + len(norm.TILES)
    assert all(v["passed"] and "us" not in v for v in out["variants"].values())
    good = norm.variants
    monkeypatch.setattr(norm, "variants", lambda: {
        **good(), "sums off": lambda *a: (lambda r: (r[0], r[1] * 1.01))(good()["xla"](*a)),
        "dx off": lambda *a: (lambda r: (r[0] * 1.05, r[1]))(good()["xla"](*a))})
    assert norm.main(["--rows=64", "--dim=96", "--reps=1"]) == 1
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["variants"]
    assert not rows["sums off"]["passed"] and not rows["dx off"]["passed"] and rows["dx off"]["sums"] == 0


def test_gelu_bench_checks_every_variant_against_float32(monkeypatch, capsys):
    """bench/gelu.py off a GPU: every kernel variant's activation and gradients checked against the
    same math in float32 (the kernels in the interpreter), XLA's path shown but not held to it, no
    timings; a kernel whose bias gradient is off fails the run."""
    from bench import gelu
    assert gelu.main(["--rows=32", "--ffn=256", "--reps=1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["variants"]) == 1 + len(gelu.TILES) and out["variants"]["xla"]["dfc"] > 1e-2
    assert all(v["passed"] and "us" not in v for v in out["variants"].values())
    good = gelu.variants
    monkeypatch.setattr(gelu, "variants", lambda: {
        **good(), "off": lambda *a: (lambda r: (r[0], r[1], r[2] * 1.01))(good()["kernel 32/256 w8"](*a))})
    assert gelu.main(["--rows=32", "--ffn=256", "--reps=1"]) == 1
    assert not json.loads(capsys.readouterr().out.strip().splitlines()[-1])["variants"]["off"]["passed"]


def test_decode_layer_fastest_needs_passing_values():
    from bench import decode_layer as dl
    rows = {"xla": {"us": 1.0}, "a": {"us": 2.0}, "b": {"us": 3.0}, "c": {"error": "x"}, "d": {"us": 4.0}}
    errors = {"a": {"vs_float64": 1e-3, "vs_xla": 2e-2}, "b": {"vs_float64": 1e-3, "vs_xla": 5e-3},
              "c": {"vs_float64": 1e-3, "vs_xla": 1e-4}, "d": {"error": "changed the cache"}}
    assert dl._fastest(rows, errors) == "b"  # a's values are too far from XLA's, c failed, d is off
    errors["a"]["vs_xla"] = 5e-3  # bf16's rounding where XLA's kept float32 (3.2e-3 on the H200)
    assert dl._fastest(rows, errors) == "a"
    assert dl._fastest({"xla": {"us": 1.0}}, {}) is None


@pytest.mark.slow  # 17 s of Pallas's interpreter; the blocks alone are checked by default (above)
def test_decode_layer_mixed_chains_match_xlas():
    """Layers of mixed blocks (XLA's, partial rows, atomic adds into the rotating zeros, one- and
    two-kernel attention), three layers as timed: the stream after them, the caches and a greedy
    token match the all-XLA model's, and the next block's zeros are zeros. (The rotation cannot
    change values, the arrays being values: a wrong one costs copies, which only a compilation for
    a GPU shows; BENCHMARKS.md.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench import decode_layer as dl
    d, f, h, s, pos, n = 256, 512, 4, 256, 70, 3
    key = jax.random.key(5)
    ps = [(dl.random_attention(jax.random.fold_in(key, i), d), dl.random_mlp(jax.random.fold_in(key, 9 + i), d, f))
          for i in range(n)]
    caches = [dl.random_cache(jax.random.fold_in(key, 20 + i), h, d // h, s) for i in range(n)]
    head = (dl._small(jax.random.fold_in(key, 30), (64, d), dl.BF16), jnp.ones((d,)), jnp.zeros((d,)))
    x, at = jax.random.normal(key, (d,)), jnp.int32(pos)
    attention, mlp = dl.attention_variants(), dl.mlp_variants()

    def run(a: str, m: str):
        (la, ba), (lm, bm) = attention[a], mlp[m]
        qs = [(la(pa), lm(pm)) for pa, pm in ps]
        flow, new = jax.jit(lambda qs, fl, c: dl._layers([(ba, bm)] * n, qs, at, fl, c))(qs, dl._test_flow(x), caches)
        token, _ = dl._token_step([(ba, bm)] * n, qs, head, at, (dl._test_flow(x), caches), loops=1)
        assert not np.any(np.asarray(flow.zero)), (a, m)  # the next block's zeros
        return np.asarray(flow.x, np.float64), [np.asarray(c, np.float64) for kv in new for c in kv], np.asarray(token.x)

    want = run("xla", "xla")
    for a, m in [("xla", "atomic BF16 BK256 w4"), ("pallas BK256 BS256 w8", "rows BF16 BK256 w4 early"),
                 ("split BQ16 BK256 BS128 w8 early out3", "rows BF8 BK256 w4"),
                 ("split BQ16 BK128 BS256 w8 early out6", "atomic BF16 BK256 w4")]:
        got = run(a, m)
        assert np.linalg.norm(got[0] - want[0]) / np.linalg.norm(want[0]) < 1e-2, (a, m)
        assert all(np.abs(g - w).max() <= 2 ** -6 * np.abs(w).max() for g, w in zip(got[1], want[1])), (a, m)
        np.testing.assert_array_equal(got[2], want[2])  # the same greedy token


@pytest.mark.slow  # 20 s: both tools in Pallas's interpreter
def test_gpu_suite_checks_the_decoding_kernels(tmp_path):
    """bench/gpu.py --parts=kernels: the sampler with and without the decoding kernels, and
    norm.py, gelu.py, decode_layer.py, topk.py and matvec.py run, their values are checked and gpu.md
    tables them (no timings of the kernels' variants off a GPU)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), f"--out={tmp_path}", "--size=tiny",
                        "--parts=kernels"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())["parts"]["kernels"]
    assert rows["decode_layer"]["exit"] == 0 and rows["matvec"]["exit"] == 0 and rows["topk"]["exit"] == 0
    assert all(rows["topk"]["exact"].values()) and "us" not in rows["topk"]
    assert "mlp" not in rows["decode_layer"] and "shapes" not in rows["matvec"]
    assert all(e["passed"] for block in rows["decode_layer"]["errors"].values() for e in block.values())
    md = (tmp_path / "gpu.md").read_text()
    assert "| mlp | xla | - | - |" in md and "| attention | xla | - | - |" in md
    assert "One-row products (bench/matvec.py): exit 0" in md
    assert [r["decode_kernels"] for r in rows["sampler"]["results"]] == [False, True]
    assert "| compute | tiny, kernels | 1 |" in md
    for tool in ("norm", "gelu"):
        assert rows[tool]["exit"] == 0
        assert all(v["passed"] and "us" not in v for v in rows[tool]["variants"].values())
    assert "| kernel 2/16/256 w8 | - | - |" in md
    assert "| kernel 32/256 w8 | - | - |" in md


def test_gpu_suite_tables_kernel_timings():
    """gpu.md's kernels section: a GPU's timings per variant with a layer's best against XLA's, a
    variant that failed as its error, and a tool that failed as its reason."""
    from bench import gpu as suite
    e = {"vs_float64": 3e-3, "vs_xla": 1e-6}
    t = lambda us: {"us": us, "read_gbps": 1.0}  # noqa: E731
    off = {"vs_float64": 3e-3, "vs_xla": 5e-3, "passed": False}  # fast but off: not the best
    errors = {"mlp": {"xla": e, "atomic BF16 BK256 w4": e, "atomic BF32 BK256 w8": {"error": "OutOfResources"}},
              "attention": {"xla": e, "pallas a": e, "pallas b": off}}
    layer = {"errors": errors, "exit": 1, "seq": 1024, "pos": 512,
             "mlp": {"xla": t(11.5), "atomic BF16 BK256 w4": t(4.25), "atomic BF32 BK256 w8": {"error": "x"}},
             "attention": {"xla": t(16.0), "pallas a": t(5.5), "pallas b": t(2.0)},
             "token": {"read_bytes": 2.6e8, "copy_gbps": 3400.0,
                       "xla": dict(t(390.0), of_copy_bound=0.2, attention="xla", mlp="xla"),
                       "pallas": {"error": "OutOfResources", "attention": "pallas a", "mlp": "atomic BF16 BK256 w4"}}}
    topk = {"k": 200, "vocab": 50304, "exact": {"lax.top_k": True, "two-stage C1024": False}, "exit": 1,
            "us": {"lax.top_k": 35.0, "two-stage C1024": 12.5}}
    norm = {"rows": 65536, "dim": 768, "gb": 0.4, "exit": 1, "variants": {
        "xla": {"dx": 0.0, "sums": 0.0, "passed": True, "us": 367.0, "gbps": 1098.0},
        "kernel 2/16/256 w8": {"dx": 1.4e-2, "sums": 0.2, "passed": False, "us": 147.0, "gbps": 2741.0},
        "kernel 8/4/256 w8": {"error": "OutOfResources: shared memory"}}}
    kernels = {"norm": norm, "decode_layer": layer, "topk": topk, "matvec": {"error": "timed out"}}
    md = suite.markdown({"started": "", "parts": {"kernels": kernels}})
    assert "[65536, 768] rows (bench/norm.py, 0.40 GB read and written once): exit 1" in md
    assert "| xla | 367 | 1098 | 0.0e+00 | 0.0e+00 |" in md
    assert "| kernel 2/16/256 w8 | 147 | 2741 | 1.4e-02 | 2.0e-01 **off** |" in md
    assert "| kernel 8/4/256 w8 | OutOfResources: shared memory | | | |" in md
    assert "| mlp | atomic BF16 BK256 w4 | 4.25 | 1 | 3.0e-03 | 1.0e-06 |" in md
    assert "| mlp | atomic BF32 BK256 w8 | x | | | |" in md and "exit 1 (a variant failed" in md
    assert "Per layer: XLA 27.50 us; the fastest Pallas blocks (of those whose values passed) 9.75 us." in md
    assert "- whole greedy token, xla blocks (xla; xla): 390.0 us a token, 20% of the copy bound" in md
    assert "- whole greedy token, pallas blocks (pallas a; atomic BF16 BK256 w4): OutOfResources" in md
    assert "One-row products (bench/matvec.py): timed out" in md
    assert "| lax.top_k | yes | 35.00 |" in md and "| two-stage C1024 | **no** | 12.50 |" in md
    failed = suite.markdown({"started": "", "parts": {"kernels": {"decode_layer": {"error": "timed out"}}}})
    assert "per block): timed out" in failed and "Cache position" not in failed


@pytest.mark.parametrize("device,flagged", [("gpu: NVIDIA H200", True), ("cpu", False)])
def test_gpu_suite_flags_gpu_checks_skipped_on_a_gpu(device, flagged):
    """On a GPU, a skipped GPU check never saw it (run by hand they all once skipped, pinned to the
    CPU): the suite reports it as an error; on CPU (--size=tiny) skipping is expected."""
    from bench import gpu as suite

    class FakeRunner:
        results = {"device": device}

        def run(self, cmd):
            self.cmd = cmd
            return 0, "sssss\n5 skipped in 1.95s", 2.0

    runner = FakeRunner()
    res = suite.part_tests(runner, {"test_workers": ["-n", "4"]})  # xdist's workers, as on a device
    assert runner.cmd[runner.cmd.index("-n"):][:3] == ["-n", "4", "-m"]
    assert res["skipped"] == 5 and ("error" in res) == flagged
    assert ("5 GPU checks skipped on a GPU" in suite.markdown({"started": "", "parts": {"tests": res}})) == flagged


# An XLA module as the compilers print it, cut down: a loop whose body launches a cuBLAS call and
# two fusions (the last one on the ROOT line), calls a computation with one fusion and an inner
# loop of 3 trips (one fusion a trip, a condition of one), and holds a conditional (one kernel, or
# two); the loop's condition is one fusion, and a copy runs before it.
_HLO = """HloModule jit_decode, is_scheduled=true

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%then (t: f32[4]) -> f32[4] {
  %t = f32[4]{0} parameter(0)
  ROOT %f1 = f32[4]{0} fusion(%t), kind=kLoop, calls=%fused_a
}

%else (e: f32[4]) -> f32[4] {
  %e = f32[4]{0} parameter(0)
  %f2 = f32[4]{0} fusion(%e), kind=kLoop, calls=%fused_a
  ROOT %f3 = f32[4]{0} fusion(%f2), kind=kInput, calls=%fused_a
}

%ibody (ib: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ib = (s32[], f32[4]{0}) parameter(0)
  %ii = s32[] get-tuple-element(%ib), index=0
  %ix = f32[4]{0} get-tuple-element(%ib), index=1
  %iy = f32[4]{0} fusion(%ix), kind=kLoop, calls=%fused_a
  ROOT %ir = (s32[], f32[4]{0}) tuple(%ii, %iy)
}

%icond (ic: (s32[], f32[4])) -> pred[] {
  %ic = (s32[], f32[4]{0}) parameter(0)
  ROOT %ilt = pred[] fusion(%ic), kind=kLoop, calls=%fused_a
}

%small (s: f32[4]) -> (s32[], f32[4]) {
  %s = f32[4]{0} parameter(0)
  %sf = f32[4]{0} fusion(%s), kind=kLoop, calls=%fused_a
  %zero = s32[] constant(0)
  %st = (s32[], f32[4]{0}) tuple(%zero, %sf)
  ROOT %sw = (s32[], f32[4]) while(%st), condition=%icond, body=%ibody, THREE_TRIPS
}

%body (b: (s32[], f32[4])) -> (s32[], f32[4]) {
  %b = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[4]{0} get-tuple-element(%b), index=1
  %g = f32[4]{0} custom-call(%x), custom_call_target="__cublas$gemm", operand_layout_constraints={f32[4]{0}}, backend_config={"k":"v"}
  %y = f32[4]{0} fusion(%g), kind=kLoop, calls=%fused_a
  %c = pred[] constant(true)
  %z = f32[4]{0} conditional(%c, %y, %y), true_computation=%then, false_computation=%else
  %cl = (s32[], f32[4]{0}) call(%z), to_apply=%small, frontend_attributes={xla_cpu_small_call="true"}
  %cz = f32[4]{0} get-tuple-element(%cl), index=1
  %w = f32[4]{0} fusion(%cz), kind=kInput, calls=%fused_a
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %w)
}

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] fusion(%c), kind=kLoop, calls=%fused_a
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %copy = f32[4]{0} copy(%a)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[4]{0}) tuple(%zero, %copy)
  %loop = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body
  ROOT %out = f32[4]{0} get-tuple-element(%loop), index=1
}
""".replace("THREE_TRIPS", 'backend_config={"known_trip_count":{"n":"3"}}')


def test_kernel_count_reads_loops_calls_and_branches():
    """bench/kernel_count.py counts what each computation launches (a fusion is one kernel, its
    own computation is not followed; a ROOT kernel keeps its name), inlines calls, counts inner
    loops by their trip counts (the condition once more) and a conditional as its fewest or most."""
    from bench import kernel_count as kc
    comps = kc.computations(_HLO)
    entry = kc.kernels(comps, "ENTRY")
    assert entry.launched == [("copy", "copy")] and len(entry.loops) == 1
    body, cond, trips = entry.loops[0]
    assert trips is None and cond.count() == (1, 1, 0)
    assert body.launched == [("g", "__cublas$gemm"), ("y", "kLoop"), ("sf", "kLoop"), ("w", "kInput")]
    assert kc.summary(body) == {"kLoop": 2, "__cublas$gemm": 1, "kInput": 1}
    # 4 of its own, the inner loop 3 x 1 + 4 x 1, one branch of 1 or 2
    assert body.count() == (4 + 7 + 1, 4 + 7 + 2, 0)
    assert entry.count() == (1, 1, 1)  # the outer loop's length is unknown: left out, counted apart
    # bytes: a f32[4] operand and result are 32; the gemm reads the loop's tuple element x
    # a custom call's operand types (operand_layout_constraints) are not part of what its users read
    assert body.moved == [32, 32, 32, 32] and kc.shape_bytes("(s32[], bf16[2,3]{1,0})") == 16
    assert len(body.flat()) == 4 + 7 + 2 and len(entry.flat()) == 1  # the largest branch


_FEW = """
%fused_few (p.1: bf16[8,100], p.12: s32[8,2], p.2: f32[8,100], p.3: f32[8,100], p.4: s32[]) -> (...) {
  %p.1 = bf16[8,100]{1,0} parameter(0)
  %p.12 = s32[8,2]{1,0} parameter(1)
  %p.2 = f32[8,100]{1,0} parameter(2)
  %p.3 = f32[8,100]{1,0} parameter(3)
  %p.4 = s32[] parameter(4)
  %cv = f32[8,100]{1,0} convert(%p.1)
  %zero = f32[] constant(0)
  %z = f32[8,100]{1,0} broadcast(%zero), dimensions={}
  %m = pred[8,100]{1,0} compare(%cv, %z), direction=GT
  %sel = f32[8,100]{1,0} select(%m, %cv, %z)
  %s0 = f32[8,1]{1,0} slice(%cv), slice={[0:8], [0:1]}
  %g = f32[8]{0} gather(%sel, %p.12), start_index_map={0,1}, index_vector_dim=1, slice_sizes={1,1}
  %e = f32[8,100]{1,0} exponential(%p.2)
  %s3 = f32[8,1]{1,0} slice(%p.3), slice={[0:8], [0:1]}
  %r3 = f32[8]{0} reduce(%p.3, %zero), dimensions={1}, to_apply=%add
  %ds = f32[8,4]{1,0} dynamic-slice(%e, %p.4, %p.4), dynamic_slice_sizes={8,4}
  ROOT %t = (f32[8,1], f32[8], f32[8,100], f32[8], f32[8,4]) tuple(%s0, %g, %e, %r3, %ds)
}

ENTRY %main (a: bf16[8,100], i: s32[8,2], b: f32[8,100], c: f32[8,100], k: s32[]) -> (...) {
  %a = bf16[8,100]{1,0} parameter(0)
  %i = s32[8,2]{1,0} parameter(1)
  %b = f32[8,100]{1,0} parameter(2)
  %c = f32[8,100]{1,0} parameter(3)
  %k = s32[] parameter(4)
  ROOT %f = (f32[8,1], f32[8], f32[8,100], f32[8], f32[8,4]) fusion(%a, %i, %b, %c, %k), calls=%fused_few
}
"""


def test_kernel_count_bytes_of_few_entry_reads():
    """A fusion that reads an operand only through slices and gathers (after element-by-element
    ops: a convert, a compare, a select) moves the entries it takes, in the operand's dtype: of
    bf16 `a`, the slice's 8 and the gather's 8. A gather's indices, a dynamic slice's start, an
    operand also reduced (`c`) or one whose every entry is computed (`b`: the exponential, a
    result) move all of theirs."""
    from bench import kernel_count as kc
    entry = kc.kernels(kc.computations(_FEW), "ENTRY")
    result = 8 * 4 + 8 * 4 + 800 * 4 + 8 * 4 + 32 * 4
    a, i, b, c, k = (8 + 8) * 2, 16 * 4, 800 * 4, 800 * 4, 4
    assert entry.moved == [result + a + i + b + c + k]


# XLA:GPU's thunk plan as it dumps it (trimmed from a GPT-2 decode loop's, with a nested loop and
# an attention call added): a loop's "condition:" label at the loop's own indentation.
_PLAN = """000: kCommandBuffer [source       | next=003 (1)]
    001: kCopy [source | sink] kCopy
    002: kCopy [source | sink] kCopy
003: kWhile         [prev=000 (1) | next=012 (1)]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | next=008 (1)]
        005: kCustomKernel [source | next=006 (1) ] input_reduce_fusion grid: [768, 1, 1]
        006: kCustomKernel [prev=005 (1) | next=007 (1) ] fusion_94 grid: [48, 1, 1]
        007: kCopy         [prev=006 (1) | sink ] kCopy
    008: kCuDnn [prev=000 (1) | next=009 (1)] kCuDnn
    009: kWhile [prev=008 (1) | sink]
    condition:
        010: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
      body:
        011: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1]
012: kCustomKernel [prev=003 (1) | sink] loop_select_fusion grid: [393, 1, 1]
"""


def test_plan_reads_the_runtime_plan():
    """bench/plan.py (kernel_count's --plan, gpu.py's profiles): per run of the program and per iteration of each loop's body, the CUDA
    graphs (command buffers) and what they hold, and what runs outside them (a cuDNN call, a
    nested loop, a kernel after the loop); a loop's condition is counted apart from its body."""
    from bench import plan as bp
    plan = bp.plan_summary(bp.parse_plan(_PLAN))
    inner = {"graphs": 0, "in_graphs": 0, "outside": {"kCustomKernel": 1}, "loops": [],
             "captured": False, "condition": 1}
    body = {"graphs": 1, "in_graphs": 3, "outside": {"kCuDnn": 1, "kWhile": 1}, "loops": [inner],
            "captured": False, "condition": 1}
    assert plan == {"graphs": 1, "in_graphs": 2, "outside": {"kWhile": 1, "kCustomKernel": 1},
                    "loops": [body]}


# A conditional driven from the host whose first branch holds a loop (the second branch's label
# belongs to the conditional, not to that loop), then a graph that captured a loop.
_PLAN_BRANCHES = """000: kConditional [source | next=006 (1)]
  branch_0:
    001: kWhile [source | sink]
    condition:
        002: kCustomKernel [source | sink] loop_compare_fusion
      body:
        003: kCustomKernel [source | sink] loop_add_fusion
  branch_1:
    004: kCustomKernel [source | sink] loop_select_fusion
    005: kCopy [source | sink] kCopy
006: kCommandBuffer [prev=000 (1) | sink]
    007: kCustomKernel [source | next=008 (1)] loop_add_fusion
    008: kWhile [prev=007 (1) | sink]
    condition:
        009: kCustomKernel [source | sink] loop_compare_fusion
      body:
        010: kCustomKernel [source | sink] loop_add_fusion
        011: kCustomKernel [source | sink] loop_add_fusion
"""


def test_plan_of_branches_and_captured_loops(capsys):
    """A conditional outside graphs is driven from the host and counts all its branches; a label
    opens a part of the loop or conditional at its indentation, not of a loop nested deeper; a
    loop inside a graph is captured, its body's kernels in the graph. An empty plan and a label
    with no loop above it are read without error; print_plan shows every loop."""
    from bench import plan as bp
    plan = bp.plan_summary(bp.parse_plan(_PLAN_BRANCHES))
    assert plan["outside"] == {"kConditional": 1, "kWhile": 1, "kCustomKernel": 1, "kCopy": 1}
    assert plan["graphs"] == 1 and plan["in_graphs"] == 1
    host_loop, captured = plan["loops"]
    assert host_loop == {"graphs": 0, "in_graphs": 0, "outside": {"kCustomKernel": 1}, "loops": [],
                         "captured": False, "condition": 1}
    assert captured == {"graphs": 0, "in_graphs": 2, "outside": {}, "loops": [], "captured": True,
                        "condition": 1}
    empty = {"graphs": 0, "in_graphs": 0, "outside": {}, "loops": []}
    assert bp.plan_summary(bp.parse_plan("")) == empty
    stray = bp.plan_summary(bp.parse_plan("body:\n    001: kCopy [source | sink]\n"))
    assert stray == dict(empty, outside={"kCopy": 1})
    bp.print_plan(plan)
    shown = capsys.readouterr().out
    assert "1 CUDA graph(s) with 1 kernels" in shown and "inside a graph" in shown
    assert "driven from the host" in shown


def test_plan_missing_is_one_line(tmp_path):
    """No plan in the dump folder (a CPU compile, an XLA that names the file otherwise): a
    UserError naming the file it looked for, or for gpu.py a note saying what was dumped; with
    plans, the one of the named jitted function, else the largest; a dump folder XLA_FLAGS cannot
    name (white space) is refused."""
    from bench import plan as bp
    from gpt.errors import UserError
    with pytest.raises(UserError, match="thunk_sequence_after_thunk_passes.txt, or \\*.thunk_sequence.txt"):
        bp.read_plan(str(tmp_path))
    (tmp_path / "module_0000.jit_f.cpu_after_optimizations.txt").write_text("HloModule f")
    note = bp.plan_or_note(str(tmp_path))
    assert set(note) == {"none"} and "1 dumped files" in note["none"]
    assert bp.plan_lines(note) == [f"none dumped: {note['none']}"]
    (tmp_path / "module_0001.jit_step_fn.thunk_sequence_after_thunk_passes.txt").write_text(_PLAN)
    (tmp_path / "module_0002.jit_init.thunk_sequence_after_thunk_passes.txt").write_text(_PLAN * 2)
    named = bp.plan_or_note(str(tmp_path), "jit_step_fn")  # the named one, though smaller
    assert named["module"].startswith("module_0001") and named["loops"][0]["in_graphs"] == 3
    assert bp.plan_or_note(str(tmp_path))["module"].startswith("module_0002")  # else the largest
    # a module compiled without command buffers has only the sequence before the passes, which is
    # its plan; one with both reads the sequence after them
    (tmp_path / "module_0003.jit_nographs.thunk_sequence.txt").write_text(
        "000: kCustomKernel [source | next=001 (1)] a grid: [1, 1, 1]\n001: kCuDnn [prev=000 (1) | sink] kCuDnn\n")
    (tmp_path / "module_0001.jit_step_fn.thunk_sequence.txt").write_text("not read: the passes ran")
    nographs = bp.read_plan(str(tmp_path), "jit_nographs")
    assert nographs["graphs"] == 0 and nographs["outside"] == {"kCustomKernel": 1, "kCuDnn": 1}
    assert bp.read_plan(str(tmp_path), "jit_step_fn")["module"].endswith("after_thunk_passes.txt")
    with pytest.raises(UserError, match="white space"):
        bp.dump_env({}, str(tmp_path / "a b"))


def test_gpu_suite_shows_each_profiles_plan():
    """gpu.md's profile section gives XLA's plan of a run on one line (a row from before plans were
    recorded shows none)."""
    from bench import gpu as suite
    from bench import plan as bp
    plan = bp.plan_summary(bp.parse_plan(_PLAN))
    line = {"line": "gpu", "busy_ms": 1.0, "span_ms": 2.0, "events_per_step": 3, "groups": {}, "top": []}
    rows = {"decode, batch 1": {"lines": [line], "plan": plan}, "train": {"lines": [line]}}
    md = suite.markdown({"started": "", "parts": {"profile": rows}})
    shown = [ln for ln in md.splitlines() if ln.startswith("XLA's plan: ")]
    assert shown == ["XLA's plan: " + bp.plan_text(plan)]
    assert "while loop 0 (driven from the host" in shown[0] and "1 CUDA graph(s) with 3" in shown[0]


def test_kernel_count_plan_needs_a_gpu_target():
    """--plan with --target=cpu (XLA:CPU has no such plan): one line, exit status 2."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "kernel_count.py"), "--target=cpu", "--plan"],
                       cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--plan" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def _kernel_count(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """bench/kernel_count.py for this CPU: the finished process and the counts it wrote."""
    cmd = [sys.executable, str(REPO / "bench" / "kernel_count.py"), "--target=cpu", *args,
           f"--json={tmp_path / 'out.json'}"]
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads((tmp_path / "out.json").read_text())


def test_kernel_count_of_the_decode_loop_on_cpu(tmp_path):
    """The tool compiles the sampler's decode loop from shapes alone (no CUDA plugin needed for
    the host's CPU) and counts its body's kernels, by kind."""
    r, out = _kernel_count(tmp_path, "--config=tiny", "--new_tokens=4", "--list")
    assert out["kernels_per_token"] > 0 and out["dtype"] == "float32" and out["target"] == "cpu"
    own = sum(out["by_kind"].values())  # the body's own; XLA:CPU draws random bits in inner loops
    assert 0 < own <= out["kernels_per_token"] and out["inner_loops_of_unknown_length"] == 0
    assert f"{out['kernels_per_token']} kernels per token" in r.stdout
    assert len(r.stdout.strip().splitlines()) == 1 + own  # --list: one line per kernel of the body
    # --decode_kernels: the layers as gpt/ops/decode_kernels.py's (here in Pallas's interpreter:
    # its loops over the programs; on a GPU each kernel is one, BENCHMARKS.md); its products are not dots
    _, kernels = _kernel_count(tmp_path, "--config=tiny", "--new_tokens=4", "--decode_kernels")
    assert kernels["by_kind"].get("dot", 0) < out["by_kind"]["dot"]


def test_kernel_count_of_a_training_step_on_cpu(tmp_path):
    """--program=train compiles bench/train.py's step with train.py's settings and reports its
    kernels and bytes by group (the CPU's matmuls are dots)."""
    r, out = _kernel_count(tmp_path, "--program=train", "--preset=tiny", "--batch_size=2")
    assert out["kernels_per_step"] == sum(out["kernels"].values()) > 0 and out["program"] == "train"
    assert out["gb"]["other"] > 0 and f"{out['kernels_per_step']} kernels" in r.stdout


def test_kernel_count_of_a_training_step_takes_runtime_and_dtype(tmp_path):
    """--program=train passes --runtime and --dtype on to the step it compiles: the MLP activation
    kept compiles to other kernels than recomputed; bf16 is named; bench/train.py's timing options and bad
    values are one line, exit status 2."""
    common = ("--program=train", "--preset=tiny", "--batch_size=2")
    _, kept = _kernel_count(tmp_path, *common, "--runtime=mlp_recompute=false")
    _, recomputed = _kernel_count(tmp_path, *common)
    assert kept["kernels_per_step"] != recomputed["kernels_per_step"]
    r, _ = _kernel_count(tmp_path, *common, "--dtype=bfloat16")
    assert "bfloat16" in r.stdout
    for bad in ("--chain=2", "--runtime=nope=1"):
        r = subprocess.run([sys.executable, str(REPO / "bench" / "kernel_count.py"), "--target=cpu", *common,
                            bad], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]


def test_kernel_count_refuses_a_gpu_target_without_a_compiler_for_it():
    """Without JAX's CUDA plugin a GPU target is one line naming the fix, exit status 2; so is an
    unknown preset."""
    import importlib.util
    if importlib.util.find_spec("jax_cuda12_plugin") or importlib.util.find_spec("jax_cuda13_plugin"):
        pytest.skip("a CUDA plugin is installed here")
    for flag, says in (("--target=h200", "CUDA plugin"), ("--config=nope", "--config=nope")):
        r = subprocess.run([sys.executable, str(REPO / "bench" / "kernel_count.py"), flag], cwd=REPO,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and says in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
        assert "Traceback" not in r.stderr


def test_sample_bench_models_and_bound_are_the_presets():
    """bench/sample.py built a GPT-2-shaped model from any preset (a Llama preset's RoPE, RMSNorm,
    SwiGLU and grouped-query heads dropped), counted keys/values past the cache's window, and the
    whole position table where a step reads one row of it."""
    import jax
    from flax import nnx
    from bench import sample as bs
    smol = bs.preset_model("smollm-135m")
    assert (smol.kv_heads, smol.ffn, smol.mlp, smol.pos_embedding) == (3, 1536, "swiglu", "rope")
    tiny = bs.preset_model("tiny")
    row = bs.bandwidth_bound(tiny, 1, 116, 0, 4, 1.0, 1.0)
    assert row["kv_bytes"] == 2 * tiny.n_layer * tiny.block_size * tiny.kv_heads * tiny.head_dim * 4
    cfg, model = bs.build_model("tiny", "float32")
    params = nnx.split(model)[1]
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    assert bs.step_weight_bytes(cfg, params) == whole - (cfg.block_size - 1) * cfg.n_embd * 4


@pytest.mark.parametrize("argv", [["--batches=abc"], ["--batches=1,0"], ["--batches=00"], ["--new_tokens=0"], ["--reps=0"],
                                  ["--prompt_len=0"]])
def test_sample_bench_refuses_sizes_it_cannot_time(argv, capsys):
    """They ended in a ValueError, ZeroDivisionError or StatisticsError traceback."""
    from bench import sample as bs
    with pytest.raises(SystemExit) as e:
        bs.parse_args(["--configs=tiny", *argv])
    assert e.value.code == 2 and "at least 1" in capsys.readouterr().err


def test_train_bench_refuses_an_empty_ceiling():
    from bench.train import split_bench_args
    from gpt.errors import UserError
    for argv, words in ((["--ceiling_n=-5"], "--ceiling_n=-5 must be at least 0"),
                        (["--ceiling_reps=0"], "--ceiling_reps=0 must be at least 1")):
        with pytest.raises(UserError, match=words):
            split_bench_args(argv)
