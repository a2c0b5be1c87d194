"""Train-step benchmark: compile time, steady-state step time, tokens/s, model TFLOP/s and MFU.

    python bench/train.py --preset=shakespeare-char [--key=value ...] [--steps=N] [--warmup=N]
                          [--chain=K] [--dtypes=float32,bfloat16] [--ceiling_n=N] [--ceiling_reps=N]
                          [--runtime=KEY=VALUE,...]

Settings are parsed exactly like train.py's (gpt.config.build: preset, --config file, overrides),
so the gpt2 preset's step accumulates 40 micro-batches (nanoGPT's setting; the model line says
"accum 40"): `--gradient_accumulation_steps=1` times one batch's step, as bench/gpu.py does.
Batches are random tokens (no data dir needed); with a char-tokenizer preset and no --vocab_size the
vocabulary is 65 (tiny Shakespeare's). The step is the training step itself: gpt.train's
make_train_step + make_optimizer, jitted with the parameters and optimizer state donated.

Step time is the median of --steps measurements after --warmup warm-up ones, each one synchronised
(block_until_ready). A measurement is one step, or with --chain=K the mean of K steps dispatched
back to back and synchronised once, as train.py's loop runs them: the host then prepares the next
step while the device runs this one, where a synchronised step leaves the device idle for that
time. The matmul ceiling is measured in the same run and dtype (gpt.metrics.measure_matmul_tflops);
MFU is given against it and against the vendor peak where known. --dtypes times several compute
dtypes (e.g. float32 vs bfloat16) interleaved, one measurement of each per round (the order
alternating between rounds), and reports the speedup of each over the first (of the medians, and
per round). --runtime overrides resolved choices of gpt.runtime.Runtime (RUNTIME_KNOBS: e.g.
`lse_one_pass=false,mlp_recompute=false`), to time one choice against the default on a GPU.
The last line printed is one JSON object (the last dtype's figures at
the top level, all under "runs"). All variants are alive at once: memory is their sum.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gpt import metrics as metrics_lib  # noqa: E402
from gpt.config import (TRAIN_CLASSES, ComputeConfig, ModelConfig, TrainConfig, build_train,  # noqa: E402
                        help_text, parse_value, validate_compute)
from gpt.errors import ReaderGone, UserError, reader_may_leave  # noqa: E402
from gpt.model import GPT, abstract_model, flops_per_token, num_params  # noqa: E402
from gpt.runtime import (PALLAS_MODES, compiler_options, cpu_native_bf16, dtype_note,  # noqa: E402
                         loss_chunks_for, resolve, run_cpu_programs_inline)
from gpt.train import make_optimizer, make_train_step, moe_training  # noqa: E402

CHAR_VOCAB = 65  # tiny Shakespeare's character vocabulary
BENCH_KEYS = {"steps": int, "warmup": int, "chain": int, "dtypes": str, "ceiling_n": int,
              "ceiling_reps": int, "runtime": str}
# Runtime choices --runtime may override, for an A/B of one choice (on a GPU, in one device
# call), with their values' types: the cross-entropy's one-pass logsumexp (GPU only), the MLP
# activation's recomputation, the dense layers' hand-written backward (every backend) and the
# Pallas kernels of the MLP's activation and of the norms' backward (gpt/ops/gelu_kernel.py,
# norm_kernel.py: triton, a GPU's default; interpret elsewhere; empty for XLA's fusions) and of the
# loss (xent_kernel.py, off by default), and XLA:GPU's CUDA graphs in the step (command_buffers);
# the attention kernel is train.py's own --attention
RUNTIME_KNOBS = {"lse_one_pass": bool, "mlp_recompute": bool, "dense_vjp": bool,
                 "gelu_kernel": str, "norm_kernel": str, "xent_kernel": str, "command_buffers": bool}
BENCH_DEFAULTS = {"steps": 5, "warmup": 2, "chain": 1, "dtypes": "", "ceiling_n": 0, "ceiling_reps": 10,
                  "runtime": ""}


def split_bench_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Pull the bench's own --key=value options out; the rest goes to gpt.config.build."""
    opts = dict(BENCH_DEFAULTS)
    rest = []
    i = 0
    while i < len(argv):
        a = argv[i]
        key = a[2:].split("=", 1)[0].replace("-", "_") if a.startswith("--") else ""
        if key in BENCH_KEYS:
            if "=" in a:
                raw = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                raw, i = argv[i + 1], i + 1
            else:
                raise UserError(f"--{key} needs a value")
            try:
                opts[key] = BENCH_KEYS[key](raw)
            except ValueError:
                raise UserError(f"--{key} expects {BENCH_KEYS[key].__name__}, got {raw!r}") from None
        else:
            rest.append(a)
        i += 1
    for key, least in (("steps", 1), ("chain", 1), ("warmup", 0), ("ceiling_n", 0), ("ceiling_reps", 1)):
        if opts[key] < least:
            raise UserError(f"--{key}={opts[key]} must be at least {least}")
    return opts, rest


def runtime_override(text: str) -> dict:
    """--runtime=KEY=VALUE,... as fields replacing the resolved Runtime's (RUNTIME_KNOBS)."""
    out: dict = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, raw = item.partition("=")
        if key not in RUNTIME_KNOBS or not sep:
            raise UserError(f"--runtime={text}: {item!r} is not KEY=VALUE with KEY one of "
                            f"{', '.join(RUNTIME_KNOBS)}")
        out[key] = parse_value(f"runtime {key}", raw, RUNTIME_KNOBS[key])
        if RUNTIME_KNOBS[key] is str and out[key] not in PALLAS_MODES:
            raise UserError(f"--runtime={text}: {key} is one of {', '.join(map(repr, PALLAS_MODES))}")
    return out


def runs_here(override: dict) -> dict:
    """`override`, if this backend can run it: Triton kernels need a GPU (kernel_count compiles
    them for a described one from any host, so it does not check; the runs here and in
    kernel_time do)."""
    for key, value in override.items():
        if value == "triton" and jax.default_backend() != "gpu":
            raise UserError(f"--runtime={key}=triton needs a GPU; use {key}=interpret off one")
    return override


def runtime_only(argv: list[str]) -> tuple[dict, list[str]]:
    """(--runtime's override, the rest) for the tools that build bench/train.py's step without
    timing it (kernel_time, kernel_count); its other options would be ignored there, so refused."""
    opts, rest = split_bench_args(argv)
    unused = [k for k, v in opts.items() if k != "runtime" and v != BENCH_DEFAULTS[k]]
    if unused:
        raise UserError(f"--{unused[0]} is bench/train.py's timing option; not used here (drop it)")
    return runtime_override(opts["runtime"]), rest


class Variant:
    """One compiled train step (one compute dtype) with its own parameters, optimizer and batches."""

    def __init__(self, m: ModelConfig, c: ComputeConfig, t: TrainConfig, override: dict | None = None):
        self.m, self.t = m, t
        self.rt = rt = resolve(m, c, **(override or {}))
        A, B, T = t.gradient_accumulation_steps, t.batch_size, m.block_size
        self.tokens_per_step = A * B * T
        graphdef = nnx.graphdef(abstract_model(m, t.seed, rt))
        self.params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(GPT(m, rngs=nnx.Rngs(t.seed),
                                                                     runtime=rt))))()
        tx = make_optimizer(t)
        self.opt_state = jax.jit(tx.init)(self.params)
        step_fn = jax.jit(make_train_step(graphdef, tx, t.seed, train_mode=rt.dropout > 0,
                                          moe=moe_training(t)),
                          donate_argnums=(0, 1), compiler_options=compiler_options(rt))
        rng = np.random.default_rng(t.seed)
        # Alternate two batches so no step sees a cached input.
        self.batches = [(jnp.asarray(rng.integers(0, m.vocab_size, (A, B, T), dtype=np.int32)),
                         jnp.asarray(rng.integers(0, m.vocab_size, (A, B, T), dtype=np.int32)))
                        for _ in range(2)]
        self.step = jnp.asarray(0, jnp.int32)
        t0 = time.perf_counter()
        self.compiled = step_fn.lower(self.params, self.opt_state, self.step, *self.batches[0]).compile()
        self.compile_sec = time.perf_counter() - t0
        self.times: list[float] = []
        self.losses: list[float] = []

    def run_steps(self, k: int, timed: bool) -> None:
        """`k` steps dispatched back to back, then one synchronisation; records their mean time.
        The losses are read afterwards: reading one is a synchronisation of its own."""
        losses = []
        t0 = time.perf_counter()
        for j in range(len(self.losses), len(self.losses) + k):
            x, y = self.batches[j % 2]
            self.params, self.opt_state, self.step, met = self.compiled(
                self.params, self.opt_state, self.step, x, y)
            losses.append(met["loss"])
        jax.block_until_ready((self.params, self.opt_state, self.step, losses))
        dt = (time.perf_counter() - t0) / k
        self.losses += [float(v) for v in losses]
        if timed:
            self.times.append(dt)

    def result(self, opts: dict) -> dict:
        dtype = self.rt.dtype
        dtype_name = jnp.dtype(dtype).name
        step_sec = statistics.median(self.times)
        # The ceiling is measured after the steps, on a warm machine, in the compute dtype.
        ceiling = metrics_lib.measure_matmul_tflops(dtype, n=opts["ceiling_n"] or None,
                                                    reps=opts["ceiling_reps"])
        vendor = metrics_lib.vendor_peak_tflops(dtype_name)
        fpt = flops_per_token(self.m, self.m.block_size)
        rate = metrics_lib.Throughput(fpt, ceiling, vendor, 1)(self.tokens_per_step, step_sec)
        if not all(np.isfinite(self.losses)):
            raise UserError(f"non-finite loss in the benchmark: {self.losses}")
        return {
            "dtype": dtype_name,
            "residual_dtype": jnp.dtype(self.rt.residual).name,
            "step_ms": 1e3 * step_sec,
            "step_ms_min": 1e3 * min(self.times),
            "step_ms_max": 1e3 * max(self.times),
            "step_ms_all": [round(1e3 * s, 2) for s in self.times],
            "tokens_per_sec": rate["tokens_per_sec"],
            "model_tflops": rate["model_tflops"],
            "ceiling_tflops": ceiling,
            "mfu_measured": rate["mfu"],
            "mfu_vendor": rate["mfu_vendor"],
            "vendor_peak_tflops": vendor,
            "compile_sec": self.compile_sec,
            "flops_per_token": fpt,
            "tokens_per_step": self.tokens_per_step,
            "loss_first": self.losses[0],
            "loss_last": self.losses[-1],
        }


def bench(variants: list[Variant], opts: dict) -> list[dict]:
    """Time every variant; with several, round-robin one step of each per round, so that all of
    them see the same machine load (on a shared or throttling machine separate runs can differ
    by more than the effect being measured)."""
    for i in range(opts["warmup"] + opts["steps"]):
        order = variants if i % 2 == 0 else variants[::-1]  # no variant always goes first
        for v in order:
            v.run_steps(opts["chain"], timed=i >= opts["warmup"])
    runs = [v.result(opts) for v in variants]
    for v, r in zip(variants[1:], runs[1:]):
        r["speedup_vs_" + runs[0]["dtype"]] = runs[0]["step_ms"] / r["step_ms"]
        # Per-round ratios: robust to load that changes between rounds.
        r["speedup_per_round"] = [round(a / b, 3) for a, b in zip(variants[0].times, v.times)]
    return runs


def _settings_only(argv: list[str]) -> list[str]:
    """argv without this tool's own options (for --help's listing of train.py's settings)."""
    try:
        return split_bench_args(argv)[1]
    except UserError:
        return argv


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:  # this tool's options, then train.py's settings
        try:
            with reader_may_leave():  # `--help | head`
                print(__doc__.strip() + "\n\nThis tool's defaults: "
                      + " ".join(f"--{k}={v}" for k, v in BENCH_DEFAULTS.items())
                      + "\n\ntrain.py's settings, which this tool takes too:\n"
                      + help_text(TRAIN_CLASSES, _settings_only(argv), default_preset="default"))
        except ReaderGone:
            pass
        return 0
    try:
        opts, rest = split_bench_args(argv)
        run_cpu_programs_inline()  # as train.py runs
        m, c, t, explicit = build_train(rest)
        if "vocab_size" not in explicit and t.tokenizer == "char":
            m = dataclasses.replace(m, vocab_size=CHAR_VOCAB)
        override = runs_here(runtime_override(opts["runtime"]))
        dtypes = [d for d in opts["dtypes"].split(",") if d] or [c.dtype]
        device = metrics_lib.device_name()
        native = jax.default_backend() != "cpu" or cpu_native_bf16()
        print(f"device: {device}; jax {jax.__version__}; bf16 matmuls "
              f"{'native' if native else 'emulated (no AVX512_BF16/AMX): auto picks float32'}")
        chunks = loss_chunks_for(resolve(m, c, **override).loss_chunks, t.batch_size, m.block_size,
                                 m.padded_vocab_size)
        print(f"model: {num_params(m) / 1e6:.2f}M params, L={m.n_layer} H={m.n_head} D={m.n_embd} "
              f"T={m.block_size} V={m.vocab_size}; batch {t.batch_size} x accum "
              f"{t.gradient_accumulation_steps}; dropout {c.dropout}; attention {c.attention}; "
              f"remat {c.remat}; residual stream {c.residual_dtype}; loss in {chunks} slice(s) of T"
              + "".join(f"; {k}={v}" for k, v in override.items()))
        variants = [Variant(m, validate_compute(dataclasses.replace(c, dtype=d)), t, override)
                    for d in dtypes]
        runs = bench(variants, opts)
        per_sync = f" chains of {opts['chain']} steps" if opts["chain"] > 1 else ""
        for r in runs:
            vend = f"{100 * r['mfu_vendor']:.1f}%" if r["mfu_vendor"] is not None else "n/a"
            print(f"[{r['dtype']}] compile {r['compile_sec']:.1f} s | step {r['step_ms']:.1f} ms "
                  f"(median of {opts['steps']}{per_sync}, min {r['step_ms_min']:.1f}, max "
                  f"{r['step_ms_max']:.1f}) | {r['tokens_per_sec']:,.0f} tok/s | "
                  f"{r['model_tflops']:.3f} model TFLOP/s | matmul ceiling "
                  f"{r['ceiling_tflops']:.3f} TFLOP/s | MFU {100 * r['mfu_measured']:.1f}% of "
                  f"measured, {vend} of vendor | loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
                  f"{dtype_note(jnp.dtype(r['dtype']))}")
        for r in runs[1:]:
            key = "speedup_vs_" + runs[0]["dtype"]
            print(f"  {r['dtype']} vs {runs[0]['dtype']}: {r[key]:.2f}x faster step (medians; "
                  f"per interleaved round: {', '.join(f'{x:.2f}' for x in r['speedup_per_round'])})")
        out = dict(runs[-1])
        out.update(device=device, preset=next((a.split("=", 1)[1] for a in rest
                                               if a.startswith("--preset=")), "default"),
                   batch_size=t.batch_size, block_size=m.block_size, n_params=num_params(m),
                   jax=jax.__version__, bf16_native=native, runs=runs, steps=opts["steps"],
                   warmup=opts["warmup"], chain=opts["chain"], runtime=override)
        print(json.dumps(out))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
