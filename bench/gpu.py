"""The GPU suite in one command: GPU tests, training and decoding benchmarks, a short training run.

    python bench/gpu.py --out=DIR [--size=full|tiny] [--parts=tests,sample,curve,speculative,train]
                        [--train_variants=NAME,...] [--timeout=SEC] [--xla_flags="FLAGS;FLAGS..."]
                        [--kernel_tools=norm,gelu,decode_layer,topk,matvec]

Parts (each runs in its own process, so an out-of-memory variant or a crash is recorded and the
suite goes on):
- tests: `pytest -m gpu` over every module (cuDNN attention == reference with gradients, bf16
  training tracks float32, cached decoding == full recompute, the decoding kernels as Triton
  kernels against float64 and the full recompute).
- train: `bench/train.py` on GPT-2 124M at T=1024 in bfloat16: batch sizes 16 to 128 (one that
  does not fit is recorded as out of memory), remat variants, the residual stream in bf16, and the compile time with and without
  --scan_layers; tokens/s and MFU against the measured matmul ceiling and the vendor peak (steps
  timed in chains of 5 synchronised once, as train.py's loop runs them).
- sample: `bench/sample.py` decoding GPT-2 at batch 1/16/64 with the memory-bandwidth utilisation.
- curve: a 300-step shakespeare-char run of `train.py` (its loss curve and loss.png).
- speculative: `bench/sample.py --speculative`, greedy, batch 1, K=2 and K=4 drafted tokens: the
  `shakespeare` pair (shakespeare-char's 10.7M target, a 25x smaller draft) trained here for 5,000
  steps each, plain against speculative decoding with the acceptance and the predicted speedup;
  then K=4 and K=6 with the same target and a draft distilled from it (`--distill_rows`).
- xla (not run unless named in --parts): XLA flags that might lift the two GPU targets, each
  setting (--xla_flags, ";" between settings; default XLA_CANDIDATES) added to the environment's
  XLA_FLAGS in its own processes after a baseline with those alone: the headline training step
  (batch 64) and batch-1 decoding (--xla_programs: one or both), each against the baseline. A
  flag this XLA does not know ends only its own runs, and one it has retired (a warning, no
  effect) is noted in its row.
- profile (not run unless named in --parts): `bench/kernel_time.py`'s device time per kernel
  group and its top kernels, for the headline training step (batch 64, one batch a step), the same
  with the residual stream in bf16, and batch-1 decoding: where the time goes when a target is missed;
  with each, the plan XLA's GPU runtime executes (bench/plan.py: CUDA graphs, what runs outside).
- kernels (not run unless named in --parts): hand-written decoding kernels against XLA's: first
  the sampler at batch 1 with XLA's layers and with gpt/ops/decode_kernels.py's (`bench/sample.py
  --decode_kernels`), then, each checked against float64 first, `bench/decode_layer.py` (a
  decoding step's MLP and attention blocks in their variants, and a whole greedy token against the
  copy bound), `bench/topk.py` (the sampler's top-k, exact variants) and `bench/matvec.py`
  (one-row products): whether fewer, fused kernels bring batch-1 decoding near the bandwidth bound.
  Before them bench/norm.py and bench/gelu.py time the norms' and the MLP activation's training
  kernels; --kernel_tools picks which run.
`--size=tiny` runs every part with tiny models (for CPU and CI: it checks the suite, not the GPU).
DIR receives gpu.json (everything), gpu.md (the tables), gpu.log (every process's output) and
loss.png; both summaries are rewritten after each part, so a suite cut short still leaves what ran.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import plan as plan_lib  # noqa: E402  (reads text only: no jax in this process)
PARTS = ("tests", "sample", "curve", "speculative", "train")  # the longest last: a cut-short run keeps the rest
EXTRA_PARTS = ("xla", "profile", "kernels")  # run only when named

# name -> bench/train.py flags. The first is the headline configuration; "scan" measures compile
# time with --scan_layers; the larger batches and remat policies look for the fastest that fits.
TRAIN_FULL = {
    "b16": ["--batch_size=16"],
    "b16-scan": ["--batch_size=16", "--scan_layers"],
    "b64-dots": ["--batch_size=64", "--remat=dots"],
    "b32": ["--batch_size=32"],
    "b64-block": ["--batch_size=64", "--remat=block"],
    "b64": ["--batch_size=64"],
    "b64-res": ["--batch_size=64", "--residual_dtype=compute"],  # the residual stream in bf16
    # a choice of the step undone, one at a time (bench/train.py --runtime): none of the three
    # had been A/B-timed on a GPU when the bf16 stream measured 45.2% (BENCHMARKS.md)
    "b64-res-lse2": ["--batch_size=64", "--residual_dtype=compute", "--runtime=lse_one_pass=false"],
    "b64-res-keep": ["--batch_size=64", "--residual_dtype=compute", "--runtime=mlp_recompute=false"],
    "b64-res-autodiff": ["--batch_size=64", "--residual_dtype=compute", "--runtime=dense_vjp=false"],
    # the loss in 8 slices of T (--loss_chunks): 21.2 instead of 26.9 GB of temporaries (H200 compile)
    "b64-res-ce8": ["--batch_size=64", "--residual_dtype=compute", "--loss_chunks=8"],
    "b128-res": ["--batch_size=128", "--residual_dtype=compute"],  # 53.5 GB of temporaries (H200 compile)
    # b64-res timed in chains of 20 steps, not 5, for the host's dispatch of a chain's first step:
    # 128.0 against 128.4 ms on the H200 (thirty-fifth session), so it is not the step's lost time
    "b64-res-chain20": ["--batch_size=64", "--residual_dtype=compute", "--chain=20", "--steps=4", "--warmup=1"],
    # b64-res runs the GPU's default training kernels (gpt/ops/gelu_kernel.py's MLP activation and
    # gpt/ops/norm_kernel.py's norms' backward, `gpt.runtime.resolve`); here with XLA's fusions instead,
    # and with one kernel at a time
    "b64-res-xla": ["--batch_size=64", "--residual_dtype=compute", "--runtime=gelu_kernel=,norm_kernel="],
    "b64-res-norm": ["--batch_size=64", "--residual_dtype=compute", "--runtime=gelu_kernel="],
    "b64-res-gelu": ["--batch_size=64", "--residual_dtype=compute", "--runtime=norm_kernel="],
    # the defaults with the loss as gpt/ops/xent_kernel.py's kernel inside the whole-logits loss
    # (`cross_entropy_rows`: 5.6 ms against XLA's 8.1 alone on the H200; through the sliced loss,
    # the thirty-fifth session's b64-res-xent, the step was 2.5 ms slower)
    "b64-res-xent": ["--batch_size=64", "--residual_dtype=compute", "--runtime=xent_kernel=triton"],
    "b128-res-xent": ["--batch_size=128", "--residual_dtype=compute", "--runtime=xent_kernel=triton"],
    # b64-res without CUDA graphs (Runtime.command_buffers): 129.9 against 128.4 ms on the H200
    # (thirty-fifth session), so they stay on
    "b64-res-nographs": ["--batch_size=64", "--residual_dtype=compute", "--runtime=command_buffers=false"],
}
TRAIN_TINY = {"b4": ["--batch_size=4"], "b4-scan": ["--batch_size=4", "--scan_layers"]}
# XLA:GPU settings for the part "xla", aimed at what the H200 profile showed (BENCHMARKS.md): the
# fusions around the GEMMs (bias, GELU), the cross-entropy's softmax over the [B*T, V] logits
# (normalisation fusions as Triton block-level kernels), LayerNorm, and top-k 200's radix sort in
# every decoded token, and while loops and conditionals added to XLA's default command buffers
# (CUDA graphs), which might launch the decode loop's body as one graph per token (not measured).
# All five start on jax 0.10.2.
XLA_CANDIDATES = ("--xla_gpu_enable_cublaslt=true",
                  "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
                  "--xla_gpu_enable_cudnn_layer_norm=true",
                  "--xla_gpu_experimental_use_raft_select_k=true",
                  "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL")


def sizes(size: str) -> dict:
    """The models and lengths of each part for --size."""
    if size == "tiny":
        return dict(train_preset="tiny", train_variants=TRAIN_TINY, steps=["--steps=2", "--warmup=1",
                    "--chain=2", "--ceiling_n=256", "--ceiling_reps=2"], sample_config="tiny",
                    sample_batches="1,4", new_tokens=8, curve_steps=20,
                    curve_flags=["--preset=tiny", "--eval_interval=10", "--eval_iters=2",
                                 "--log_interval=5"],
                    spec=["--pair=tiny", "--pair_iters=20", "--spec_tokens=16"], distill_rows=16,
                    xla_train=["--batch_size=4"], profile_decode=["--config=tiny", "--new_tokens=8"],
                    kernels=["--chain=3", "--reps=1"],
                    norm=["--rows=64", "--dim=96", "--reps=1"], gelu=["--rows=64", "--ffn=512", "--reps=1"],
                    test_workers=[])
    # chains of 5 steps synchronised once, as train.py runs them (bench/train.py --chain)
    return dict(train_preset="gpt2", train_variants=TRAIN_FULL,
                steps=["--steps=10", "--warmup=3", "--chain=5"],
                sample_config="gpt2", sample_batches="1,16,64", new_tokens=256, curve_steps=300,
                curve_flags=["--preset=shakespeare-char", "--eval_interval=50", "--eval_iters=20",
                             "--log_interval=10"],
                spec=["--pair=shakespeare", "--pair_iters=5000", "--spec_tokens=200"], distill_rows=2560,
                xla_train=["--batch_size=64"], profile_decode=["--config=gpt2", "--new_tokens=64"],
                kernels=[], norm=[], gelu=[], test_workers=gpu_check_workers())


class Runner:
    """Runs the parts' processes, appends their output to gpu.log and keeps the results."""

    def __init__(self, out: Path, timeout: int, env: dict):
        self.out, self.timeout, self.env = out, timeout, env
        self.results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "parts": {}}
        self.log_path = out / "gpu.log"

    def run(self, cmd: list[str], timeout: int | None = None, env: dict | None = None
            ) -> tuple[int, str, float]:
        """(exit status, stdout + stderr, seconds); a timeout is status 124."""
        t0 = time.perf_counter()
        # its own process group: a timeout also ends what it started (sample.py's train.py runs)
        p = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            text, _ = p.communicate(timeout=timeout or self.timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text, rc = (p.communicate()[0] or "") + "\n[timed out]", 124
        sec = time.perf_counter() - t0
        with open(self.log_path, "a") as f:
            flags = (env or self.env).get("XLA_FLAGS", "")
            prefix = f"XLA_FLAGS='{flags}' " if flags != self.env.get("XLA_FLAGS", "") else ""
            f.write(f"\n$ {prefix}{' '.join(cmd)}\n[exit {rc}, {sec:.1f} s]\n{text}\n")
        print(f"  {' '.join(cmd[1:3])} ... exit {rc} in {sec:.0f} s", flush=True)
        return rc, text, sec

    def save(self, name: str, result) -> None:
        self.results["parts"][name] = result
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1))
        (self.out / "gpu.md").write_text(markdown(self.results))


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def why_failed(rc: int, text: str) -> str:
    if rc == 124:
        return "timed out"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "out of memory"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return log_message(lines[-1]) if lines else f"exit {rc}"


def log_message(line: str) -> str:
    """The message of an XLA/absl log line ("F1126 06:40:45.522738 27463 file.cc:234] message"; any
    other line as it is), at most 300 characters."""
    return re.sub(r"^[FEWI]\d{4} [\d:.]+\s+\d+ \S+\] ", "", line)[:300]


def gpu_check_workers() -> list[str]:
    """pytest-xdist's options for the GPU checks (--size=full): 4 workers sharing the GPU where xdist
    is installed (the device image has it), else none. The checks' time is mostly Triton's and
    XLA's compilers on the host: one at a time, 17 checks took about 280 s of a 15-minute device
    lease on the H200; the tests' conftest keeps each worker from taking the GPU's memory up front."""
    return ["-n", "4"] if importlib.util.find_spec("xdist") else []


def part_tests(r: Runner, sz: dict) -> dict:
    # addopts emptied (the project's -n 2 is for 2-core CPUs): the workers are sz["test_workers"].
    # Every module's GPU checks (tests/test_gpu.py's, and the kernels' own beside their CPU tests)
    rc, text, sec = r.run([sys.executable, "-m", "pytest", "-o", "addopts=", *sz["test_workers"], "-m", "gpu",
                           "-p", "no:cacheprovider", "tests"])
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    res = {"exit": rc, "seconds": sec, **counts, "failures": re.findall(r"^FAILED (.*)$", text, flags=re.M)}
    if counts.get("skipped") and r.results.get("device", "").startswith("gpu"):
        # on a GPU a skipped check did not see it (as when the tests' CPU pin was not lifted)
        res["error"] = f"{counts['skipped']} GPU checks skipped on a GPU"
    return res


def train_cmd(sz: dict, flags: list[str]) -> list[str]:
    """bench/train.py in bfloat16 on the size's preset, with `flags` (a variant's, last: they may
    replace the size's timing options)."""
    return [sys.executable, "bench/train.py", f"--preset={sz['train_preset']}", "--dtypes=bfloat16",
            "--gradient_accumulation_steps=1", *sz["steps"], *flags]


def sample_cmd(sz: dict, batches: str, weights: str = "compute") -> list[str]:
    """bench/sample.py decoding the size's config at `batches` (no full-recompute baseline)."""
    return [sys.executable, "bench/sample.py", f"--configs={sz['sample_config']}", f"--batches={batches}",
            f"--new_tokens={sz['new_tokens']}", "--baseline_batches=", f"--weights={weights}"]


def with_xla_flags(env: dict, setting: str) -> dict:
    """`env` with `setting` added to its XLA_FLAGS."""
    return dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} {setting}".strip())


def part_train(r: Runner, sz: dict, only: list[str]) -> dict:
    """The train variants, those of `only` in its order (the first run first when time is short),
    else all."""
    rows = {}
    for name in only or sz["train_variants"]:
        flags = sz["train_variants"][name]
        rc, text, sec = r.run(train_cmd(sz, flags))
        res = last_json(text) if rc == 0 else None
        rows[name] = {"flags": flags, "wall_sec": sec, **(res or {"error": why_failed(rc, text)})}
        r.save("train", rows)
    return rows


def part_sample(r: Runner, sz: dict) -> dict:
    rows = {}
    for weights in ("compute", "float32"):
        rc, text, sec = r.run(sample_cmd(sz, sz["sample_batches"], weights))
        res = last_json(text) if rc == 0 else None
        rows[weights] = res or {"error": why_failed(rc, text)}
        r.save("sample", rows)
    return rows


def part_speculative(r: Runner, sz: dict) -> dict:
    """Plain against speculative decoding; the first run trains the pair (cached for the second)."""
    rows = {}
    env = dict(r.env, GPT_BENCH_CACHE=tempfile.mkdtemp(prefix="gpu-pair-"))
    runs = [(f"K={k}", [f"--num_draft_tokens={k}"]) for k in (2, 4)]
    runs += [(f"distilled K={k}", [f"--num_draft_tokens={k}", f"--distill_rows={sz['distill_rows']}"])
             for k in (4, 6)]
    for name, flags in runs:
        cmd = [sys.executable, "bench/sample.py", "--speculative", "--configs=", *sz["spec"], *flags]
        rc, text, sec = r.run(cmd, timeout=2 * r.timeout, env=env)
        res = last_json(text) if rc == 0 else None
        rows[name] = (res or {}).get("speculative") or {"error": why_failed(rc, text)}
        r.save("speculative", rows)
    shutil.rmtree(env["GPT_BENCH_CACHE"], ignore_errors=True)
    return rows


def _figures(rc: int, text: str, read) -> dict:
    """`read(result JSON)` of a run that succeeded, else {"error": why}; a flag XLA only warns
    about (retired: it does nothing) is noted, so its row does not pass for a measurement."""
    res = last_json(text) if rc == 0 else None
    try:
        row = read(res) if res else {"error": why_failed(rc, text)}
    except (KeyError, IndexError, TypeError):
        row = {"error": "no figures in the output"}
    retired = [ln for ln in text.splitlines() if "no longer supported" in ln]
    return {**row, **({"warning": log_message(retired[0])} if retired else {})}


def part_xla(r: Runner, sz: dict, settings: list[str], programs: list[str]) -> dict:
    """The headline training step and batch-1 decoding (those of `programs`) under each XLA flags
    setting, added to the environment's XLA_FLAGS (the baseline: those alone); ratios are against
    the baseline (below 1: faster). A program left out is recorded as not run."""
    rows: dict = {}
    r.results["xla_flags_baseline"] = r.env.get("XLA_FLAGS", "")
    skipped = {"error": "not run (--xla_programs)"}
    for setting in ["", *settings]:
        env = with_xla_flags(r.env, setting)
        train, decode = dict(skipped), dict(skipped)
        if "train" in programs:
            rc, text, _ = r.run(train_cmd(sz, sz["xla_train"]), env=env)
            train = _figures(rc, text, lambda res: {"ms": res["step_ms"], "mfu_vendor": res["mfu_vendor"]})
        if "decode" in programs:
            rc, text, _ = r.run(sample_cmd(sz, "1"), env=env)
            decode = _figures(rc, text, lambda res: {"ms": res["results"][0]["ms_per_step"]})
        base = rows.get("baseline", {"train": train, "decode": decode})
        for name, now in (("train", train), ("decode", decode)):
            if "ms" in now and "ms" in base[name]:
                now["vs_baseline"] = now["ms"] / base[name]["ms"]
        rows[setting or "baseline"] = {"train": train, "decode": decode}
        r.save("xla", rows)
    return rows


def part_profile(r: Runner, sz: dict) -> dict:
    """bench/kernel_time.py on the headline training step, with a bf16 residual stream, and on
    batch-1 decoding; each row keeps the profile's JSON (per timeline: busy ms, groups, top names)."""
    train = [sys.executable, "bench/kernel_time.py", "train", f"--preset={sz['train_preset']}",
             "--dtype=bfloat16", "--gradient_accumulation_steps=1", *sz["xla_train"], "--top=12"]
    runs = {"train": train, "train, bf16 stream": [*train, "--residual_dtype=compute"],
            "decode, batch 1": [sys.executable, "bench/kernel_time.py", "decode", "--batch=1",
                                *sz["profile_decode"], "--top=12"]}
    modules = {"train": "jit_step_fn", "train, bf16 stream": "jit_step_fn",  # the jitted functions
               "decode, batch 1": "jit_decode_tokens"}
    rows = {}
    with tempfile.TemporaryDirectory(prefix="gpu-plan-") as dumps:
        for i, (name, cmd) in enumerate(runs.items()):
            dump = str(Path(dumps) / str(i))  # XLA's dump: the runtime's plan (bench/plan.py)
            rc, text, _ = r.run(cmd, env=plan_lib.dump_env(r.env, dump))
            res = last_json(text) if rc == 0 else None
            rows[name] = {"lines": res["lines"]} if res else {"error": why_failed(rc, text)}
            rows[name]["plan"] = plan_lib.plan_or_note(dump, modules[name])  # none on a CPU
            r.save("profile", rows)
    return rows


# the part "kernels": bench/<tool>.py
KERNEL_TOOLS = ("norm", "gelu", "decode_layer", "topk", "matvec")


def part_kernels(r: Runner, sz: dict, tools: list[str]) -> dict:
    """The sampler at batch 1 with XLA's layers and with gpt/ops/decode_kernels.py's (`bench/sample.py
    --decode_kernels`), then `tools` of KERNEL_TOOLS: bench/norm.py (a block norm's backward), bench/gelu.py (the MLP's activation),
    bench/decode_layer.py, bench/topk.py and bench/matvec.py. Each row is the tool's
    JSON (its values' errors and, on a GPU, its timings) with its exit status (1: a variant's
    values were off)."""
    rc, text, _ = r.run(sample_cmd(sz, "1") + ["--decode_kernels"])
    rows = {"sampler": (last_json(text) if rc == 0 else None) or {"error": why_failed(rc, text)}}
    r.save("kernels", rows)
    for tool in tools:
        rc, text, _ = r.run([sys.executable, f"bench/{tool}.py", *sz.get(tool, sz["kernels"])])
        res = last_json(text)
        rows[tool] = dict(res, exit=rc) if res else {"error": why_failed(rc, text)}
        r.save("kernels", rows)
    return rows


def part_curve(r: Runner, sz: dict) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-curve-"))
    n = sz["curve_steps"]
    cmd = [sys.executable, "train.py", *sz["curve_flags"], f"--max_iters={n}", f"--lr_decay_iters={n}",
           f"--out_dir={run_dir}", "--progress=false"]
    rc, text, sec = r.run(cmd)
    recs = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    if (run_dir / "loss.png").exists():
        shutil.copy(run_dir / "loss.png", r.out / "loss.png")
    shutil.rmtree(run_dir, ignore_errors=True)
    train = [(x["step"], round(x["loss"], 4)) for x in recs if x.get("kind") == "train"]
    evals = [(x["step"], round(x["train_loss"], 4), round(x["val_loss"], 4))
             for x in recs if x.get("kind") == "eval"]
    tps = [x["tokens_per_sec"] for x in recs if x.get("kind") == "train" and x.get("tokens_per_sec")]
    return {"exit": rc, "wall_sec": sec, "train_loss": train, "eval": evals,
            "tokens_per_sec_median": sorted(tps)[len(tps) // 2] if tps else None,
            **({} if rc == 0 else {"error": why_failed(rc, text)})}


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def _train_table(rows: dict) -> list[str]:
    lines = ["| variant | flags | step ms | tokens/s | model TFLOP/s | MFU (measured ceiling) | "
             "MFU (vendor peak) | compile s |", "|---|---|---|---|---|---|---|---|"]
    for name, x in rows.items():
        if "error" in x:
            lines.append(f"| {name} | {' '.join(x['flags'])} | {x['error']} | | | | | |")
            continue
        chained = f" (chains of {x['chain']})" if x.get("chain", 1) > 1 else ""
        lines.append(f"| {name} | {' '.join(x['flags'])} | {x['step_ms']:.1f}{chained} | "
                     f"{x['tokens_per_sec']:,.0f} | {x['model_tflops']:.3g} | "
                     f"{_pct(x['mfu_measured'])} of {x['ceiling_tflops']:.3g} TFLOP/s | "
                     f"{_pct(x['mfu_vendor'])} | {x['compile_sec']:.1f} |")
    return lines


def _sample_table(rows: dict) -> list[str]:
    lines = ["| weights | config | batch | tokens/s | ms/step | bound ms | bandwidth used |",
             "|---|---|---|---|---|---|---|"]
    for weights, x in rows.items():
        if "error" in x:
            lines.append(f"| {weights} | {x['error']} | | | | | |")
            continue
        for row in x["results"]:
            config = row["config"] + (", kernels" if row.get("decode_kernels") else "")
            lines.append(f"| {weights} | {config} | {row['batch']} | "
                         f"{row['decode_tokens_per_sec']:,.0f} | {row['ms_per_step']:.2f} | "
                         f"{row['bound_ms']:.2f} | {_pct(row['bw_util'])} of "
                         f"{row['copy_gbps']:,.0f} GB/s |")
    return lines


def _spec_table(rows: dict) -> list[str]:
    lines = ["| K | plain tok/s | speculative tok/s | speedup | predicted | per-token acceptance | "
             "target / draft / verify ms | same tokens |", "|---|---|---|---|---|---|---|---|"]
    for k, x in rows.items():
        if "error" in x:
            lines.append(f"| {k} | {x['error']} | | | | | | |")
            continue
        lines.append(f"| {k} | {x['plain_tokens_per_sec']:,.0f} | {x['speculative_tokens_per_sec']:,.0f} | "
                     f"{x['speedup']:.2f}x | {x['predicted_speedup']:.2f}x | "
                     f"{_pct(x['per_token_acceptance'])} | {x['target_step_ms']:.2f} / "
                     f"{x['draft_step_ms']:.2f} / {x['verify_ms']:.2f} | {x['same_tokens']} |")
    return lines


def _xla_table(rows: dict, baseline_flags: str) -> list[str]:
    lines = [f"Baseline XLA_FLAGS: `{baseline_flags or '(none)'}`", "",
             "| XLA flags | train step ms | vs baseline | MFU (vendor peak) | decode ms/token, batch 1 | "
             "vs baseline | note |", "|---|---|---|---|---|---|---|"]
    ratio = lambda x: f"{x:.3f}" if isinstance(x, float) else "-"  # noqa: E731
    for name, x in rows.items():
        t, d = x["train"], x["decode"]
        note = "; ".join(dict.fromkeys(y for y in (t.get("warning"), d.get("warning")) if y))
        cells = [name, f"{t['ms']:.1f}" if "ms" in t else t.get("error", "-"), ratio(t.get("vs_baseline")),
                 _pct(t.get("mfu_vendor")), f"{d['ms']:.3f}" if "ms" in d else d.get("error", "-"),
                 ratio(d.get("vs_baseline")), note]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return lines


def _profile_table(rows: dict) -> list[str]:
    lines = []
    for name, x in rows.items():
        lines.append(f"### {name}")
        if x.get("plan"):
            lines += ["", "XLA's plan: " + plan_lib.plan_text(x["plan"])]
        if "error" in x:
            lines += ["", x["error"], ""]
            continue
        for t in x["lines"]:
            groups = ", ".join(f"{g} {v:.2f}" for g, v in t["groups"].items())
            lines += ["", f"`{t['line']}`: busy {t['busy_ms']:.2f} ms of a {t['span_ms']:.2f} ms span, "
                      f"{t['events_per_step']:.0f} events; by group (ms): {groups}", "",
                      "| ms | per step | group | name |", "|---|---|---|---|",
                      *[f"| {k['ms']:.3f} | {k['per_step']:.1f} | {k['group']} | `{k['name'][:90]}` |"
                        for k in t["top"]]]
        lines.append("")
    return lines


def _status(row: dict) -> str:
    rc = row.get("exit")
    return row.get("error") or (f"exit {rc}" + (" (a variant failed or its values were off)" if rc else ""))


def _cells(e: dict, t: dict | None) -> str:
    """One variant's timing and errors as table cells (a failed variant: its error)."""
    if "error" in e or (t and "error" in t):
        return f"{(t or {}).get('error') or e['error']} | | | |"
    timing = f"{t['us']:.2f} | {t['read_gbps']:.0f}" if t else "- | -"
    return f"{timing} | {e['vs_float64']:.1e} | {e['vs_xla']:.1e} |"


def _layer_table(layer: dict) -> list[str]:
    """decode_layer.py's variants per block, and a layer's best (its two blocks' fastest) against XLA's."""
    lines = [f"A decoding step's layer (bench/decode_layer.py, GPT-2's sizes, per block): {_status(layer)}", ""]
    if "errors" not in layer:
        return lines
    lines += [f"Cache position {layer['pos']} of {layer['seq']}; read GB/s counts the weights and the cache up "
              "to that position (XLA's block reads all of it under a mask, as the sampler does).", "",
              "| block | variant | us | read GB/s | rel. error vs float64 | vs XLA's block |",
              "|---|---|---|---|---|---|"]
    best = {}
    for block, errors in layer["errors"].items():
        for name, e in errors.items():
            t = layer.get(block, {}).get(name)
            lines.append(f"| {block} | {name} | {_cells(e, t)}")
            if t and "us" in t and name != "xla" and e.get("passed", True):
                best[block] = min(best.get(block, float("inf")), t["us"])
    if len(best) == 2 and all("us" in layer[b].get("xla", {}) for b in best):
        xla = sum(layer[b]["xla"]["us"] for b in best)
        lines += ["", f"Per layer: XLA {xla:.2f} us; the fastest Pallas blocks (of those whose values passed) "
                  f"{sum(best.values()):.2f} us."]
    return lines + ["", *_token_lines(layer.get("token", {}))]


def _token_lines(token: dict) -> list[str]:
    """decode_layer.py's whole greedy token with XLA's blocks and with the fastest Pallas pair."""
    lines = []
    for which in ("xla", "pallas"):
        if which in token:
            t = token[which]
            got = (f"{t['us']:.1f} us a token, {100 * t['of_copy_bound']:.0f}% of the copy bound"
                   if "us" in t else t.get("error", "-"))
            lines.append(f"- whole greedy token, {which} blocks ({t['attention']}; {t['mlp']}): {got}")
    if lines:
        lines = [f"Copy bandwidth {token['copy_gbps']:.0f} GB/s, {token['read_bytes'] / 1e6:.0f} MB a token "
                 "(the layers' weights, the head, the cache up to the position):", "", *lines, ""]
    return lines


def _topk_lines(row: dict) -> list[str]:
    """bench/topk.py: whether each variant is exact, and its time per row on a GPU."""
    lines = [f"Top-k of a row of logits (bench/topk.py, k {row.get('k')} of {row.get('vocab')}): {_status(row)}", ""]
    if "exact" in row:
        us = row.get("us", {})
        lines += ["| variant | exact (values and indices) | us a row |", "|---|---|---|"]
        for name, ok in row["exact"].items():
            timing = f"{us[name]:.2f}" if name in us else "-"
            lines.append(f"| {name} | {'yes' if ok else '**no**'} | {timing} |")
        lines.append("")
    return lines


def _variant_lines(title: str, row: dict, checks: dict[str, str]) -> list[str]:
    """A kernel tool's variants (bench/norm.py, bench/gelu.py): each one's time on a GPU and its
    differences from XLA's (`checks`: the row's key -> its column's heading), or its error."""
    lines = [f"{title}: {_status(row)}", ""]
    if "variants" in row:
        lines += ["| variant | us | GB/s | " + " | ".join(checks.values()) + " |",
                  "|---|---|---|" + "---|" * len(checks)]
        for name, v in row["variants"].items():
            if "error" in v:
                lines.append(f"| {name} | {v['error'][:80]} |" + " |" * (len(checks) + 1))
                continue
            timing = f"| {v['us']:.0f} | {v['gbps']:.0f} " if "us" in v else "| - | - "
            diffs = " | ".join(f"{v[k]:.1e}" for k in checks)
            lines.append(f"| {name} {timing}| {diffs}{'' if v.get('passed') else ' **off**'} |")
        lines.append("")
    return lines


def _norm_lines(row: dict) -> list[str]:
    """bench/norm.py: each variant's difference from XLA's and, on a GPU, its time."""
    title = (f"A block norm's backward over [{row.get('rows')}, {row.get('dim')}] rows (bench/norm.py, "
             f"{row.get('gb', float('nan')):.2f} GB read and written once)")
    return _variant_lines(title, row, {"dx": "x's gradient vs xla", "sums": "sums vs xla"})


def _gelu_lines(row: dict) -> list[str]:
    """bench/gelu.py: each variant's difference from float32 math and, on a GPU, its time."""
    title = (f"The MLP's bias and GELU, forward and backward, over [{row.get('rows')}, {row.get('ffn')}] "
             f"(bench/gelu.py, {row.get('gb', float('nan')):.1f} GB)")
    return _variant_lines(title, row, {"y": "activation vs float32", "dfc": "fc's gradient vs float32",
                                       "db": "bias's gradient vs float32"})


def _kernels_table(rows: dict) -> list[str]:
    lines = []
    if "sampler" in rows:
        lines += ["The sampler at batch 1 (bench/sample.py --decode_kernels): XLA's layers, then the "
                  "decoding kernels' (`kernels`):", "", *_sample_table({"compute": rows["sampler"]}), ""]
    lines += _norm_lines(rows["norm"]) if "norm" in rows else []
    lines += _gelu_lines(rows["gelu"]) if "gelu" in rows else []
    lines += _layer_table(rows["decode_layer"]) if "decode_layer" in rows else []
    lines += _topk_lines(rows["topk"]) if "topk" in rows else []
    if "matvec" in rows:
        mv = rows["matvec"]
        lines += [f"One-row products (bench/matvec.py): {_status(mv)}, largest relative error "
                  f"{mv.get('max_rel_err', float('nan')):.1e}", ""]
        for shape, variants in mv.get("shapes", {}).items():
            lines += [f"| {shape}: variant | us | read GB/s |", "|---|---|---|",
                      *[f"| {n} | {t['us']:.2f} | {t['read_gbps']:.0f} |" for n, t in variants.items()], ""]
    return lines


def markdown(results: dict) -> str:
    p = results["parts"]
    out = [f"# GPU suite ({results.get('device', '?')}, jax {results.get('jax', '?')}, "
           f"{results['started']})", ""]
    if "tests" in p:
        t = p["tests"]
        out += ["## pytest -m gpu", "", f"exit {t['exit']}: {t.get('passed', 0)} passed, "
                f"{t.get('failed', 0)} failed, {t.get('skipped', 0)} skipped"
                + (f"; failed: {', '.join(t['failures'])}" if t["failures"] else "")
                + (f"; **{t['error']}**" if "error" in t else ""), ""]
    if "train" in p:
        out += ["## Training step (bench/train.py, bfloat16)", "", *_train_table(p["train"]), ""]
    if "sample" in p:
        out += ["## Decoding (bench/sample.py)", "", *_sample_table(p["sample"]), ""]
    if "speculative" in p:
        out += ["## Speculative decoding (bench/sample.py --speculative, greedy, batch 1)", "",
                *_spec_table(p["speculative"]), ""]
    if "xla" in p:
        out += ["## XLA flags (training step and batch-1 decoding against the baseline)", "",
                *_xla_table(p["xla"], results.get("xla_flags_baseline", "")), ""]
    if "profile" in p:
        out += ["## Profiles (bench/kernel_time.py, per step or decoded token)", "",
                *_profile_table(p["profile"])]
    if "kernels" in p:
        out += ["## Decoding kernels (XLA against Pallas)", "", *_kernels_table(p["kernels"])]
    if "curve" in p:
        c = p["curve"]
        rate = c["tokens_per_sec_median"]
        out += ["## Short training run (train.py)", "", f"exit {c['exit']}, {c['wall_sec']:.0f} s wall, "
                + (f"median {rate:,.0f} tokens/s" if rate is not None else c.get("error", "no tokens/s")), "",
                "| step | train loss | val loss |", "|---|---|---|",
                *[f"| {s} | {tr} | {va} |" for s, tr, va in c["eval"]], ""]
    return "\n".join(out)


def device_info(env: dict) -> tuple[str, str]:
    code = "import jax; from gpt import metrics; print(metrics.device_name()); print(jax.__version__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    lines = r.stdout.strip().splitlines()
    return (lines[0], lines[1]) if r.returncode == 0 and len(lines) >= 2 else ("unknown", "unknown")


def _listed(text: str, sep: str = ",") -> list[str]:
    return [x.strip() for x in text.split(sep) if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, every list checked before the suite starts anything (argparse's exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu.json, gpu.md, gpu.log, loss.png")
    ap.add_argument("--size", default="full", choices=("full", "tiny"))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--train_variants", default="",
                    help="comma list of variant names, run in that order (default all)")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per process")
    ap.add_argument("--xla_flags", default=";".join(XLA_CANDIDATES),
                    help='the part "xla": settings to compare with the baseline, ";" between them')
    ap.add_argument("--xla_programs", default="train,decode",
                    help='the part "xla": which of the training step and batch-1 decoding to time')
    ap.add_argument("--kernel_tools", default=",".join(KERNEL_TOOLS),
                    help='the part "kernels": which bench/<tool>.py to run after the sampler')
    args = ap.parse_args(argv)
    args.kernel_tools, args.parts = _listed(args.kernel_tools), _listed(args.parts)
    args.xla_programs, args.xla_flags = _listed(args.xla_programs), _listed(args.xla_flags, ";")
    args.train_variants = list(dict.fromkeys(_listed(args.train_variants)))  # each once, in order
    if set(args.kernel_tools) - set(KERNEL_TOOLS):
        ap.error(f"--kernel_tools={','.join(args.kernel_tools)}: some of {', '.join(KERNEL_TOOLS)}")
    if bad := [x for x in args.parts if x not in PARTS + EXTRA_PARTS]:
        ap.error(f"unknown part(s) {', '.join(bad)} (choose from {', '.join(PARTS + EXTRA_PARTS)})")
    variants = sizes(args.size)["train_variants"]
    if unknown := [x for x in args.train_variants if x not in variants]:
        ap.error(f"--train_variants: no variant {', '.join(unknown)} at --size={args.size} "
                 f"(choose from {', '.join(variants)})")
    if not args.xla_programs or set(args.xla_programs) - {"train", "decode"}:
        ap.error(f"--xla_programs={','.join(args.xla_programs)}: train, decode or both")
    if not args.parts:
        ap.error(f"--parts names none (choose from {', '.join(PARTS + EXTRA_PARTS)})")
    if args.timeout < 1:
        ap.error(f"--timeout={args.timeout}: seconds per process, at least 1")
    if (there := next((p for p in (Path(args.out), *Path(args.out).parents) if p.exists()), None)) is not None \
            and not there.is_dir():
        ap.error(f"--out={args.out}: {there} is a file; pass a folder")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # No compilation cache: the curve's wall time includes its compiles, as on a first run.
    env = dict(os.environ, PYTHONUNBUFFERED="1", GPT_DATA_CACHE=tempfile.mkdtemp(prefix="gpu-data-"),
               GPT_COMPILATION_CACHE="0")
    if args.size == "full":
        env["JAX_PLATFORMS"] = ""  # every platform (the tests' conftest pins unset ones to the CPU)
    try:
        r = Runner(out, args.timeout, env)
        r.results["device"], r.results["jax"] = device_info(env)
        r.results["size"] = args.size
        print(f"GPU suite on {r.results['device']} (jax {r.results['jax']}), parts {', '.join(args.parts)}")
        sz = sizes(args.size)
        for part in args.parts:
            res = {"tests": lambda: part_tests(r, sz), "train": lambda: part_train(r, sz, args.train_variants),
                   "sample": lambda: part_sample(r, sz), "curve": lambda: part_curve(r, sz),
                   "speculative": lambda: part_speculative(r, sz),
                   "xla": lambda: part_xla(r, sz, args.xla_flags, args.xla_programs),
                   "profile": lambda: part_profile(r, sz),
                   "kernels": lambda: part_kernels(r, sz, args.kernel_tools)}[part]()
            r.save(part, res)
        print(markdown(r.results))
    finally:  # the data the parts prepared (hundreds of these were left in /tmp)
        shutil.rmtree(env["GPT_DATA_CACHE"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
