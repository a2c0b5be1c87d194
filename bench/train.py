"""Train-step benchmark: compile time, steady-state step time, tokens/s, model TFLOP/s and MFU.

    python bench/train.py --preset=shakespeare-char [--key=value ...] [--steps=N] [--warmup=N]
                          [--dtypes=float32,bfloat16] [--ceiling_n=N]

Settings are parsed exactly like train.py's (gpt.config.build: preset, --config file, overrides).
Batches are random tokens (no data dir needed); with a char-tokenizer preset and no --vocab_size the
vocabulary is 65 (tiny Shakespeare's). The step is the training step itself: gpt.train's
make_train_step + make_optimizer, jitted with the parameters and optimizer state donated.

Step time is the median of --steps steps after --warmup warm-up steps, each one synchronised
(block_until_ready). The matmul ceiling is measured in the same run and dtype
(gpt.metrics.measure_matmul_tflops); MFU is given against it and against the vendor peak where known.
--dtypes runs several compute dtypes one after the other (e.g. float32 vs bfloat16) and reports the
speedup of each over the first. The last line printed is one JSON object (the last dtype's figures at
the top level, all of them under "runs").
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
from gpt.config import ModelConfig, TrainConfig, build, validate_model, validate_train  # noqa: E402
from gpt.errors import UserError  # noqa: E402
from gpt.model import GPT, compute_dtype, flops_per_token, num_params  # noqa: E402
from gpt.train import make_optimizer, make_train_step  # noqa: E402

CHAR_VOCAB = 65  # tiny Shakespeare's character vocabulary
BENCH_KEYS = {"steps": int, "warmup": int, "dtypes": str, "ceiling_n": int, "ceiling_reps": int}


def split_bench_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Pull the bench's own --key=value options out; the rest goes to gpt.config.build."""
    opts = {"steps": 5, "warmup": 2, "dtypes": "", "ceiling_n": 0, "ceiling_reps": 10}
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
    if opts["steps"] < 1 or opts["warmup"] < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    return opts, rest


def bench_one(m: ModelConfig, t: TrainConfig, opts: dict) -> dict:
    dtype = compute_dtype(m)
    dtype_name = jnp.dtype(dtype).name
    A, B, T = t.gradient_accumulation_steps, t.batch_size, m.block_size
    tokens_per_step = A * B * T

    graphdef, params_shape = nnx.split(nnx.eval_shape(lambda: GPT(m, rngs=nnx.Rngs(t.seed))))
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(GPT(m, rngs=nnx.Rngs(t.seed)))))()
    tx = make_optimizer(t)
    opt_state = jax.jit(tx.init)(params)
    step_fn = jax.jit(make_train_step(graphdef, tx, t.seed, train_mode=m.dropout > 0),
                      donate_argnums=(0, 1))

    rng = np.random.default_rng(t.seed)
    n_batches = 2  # alternate two batches so no step sees a cached input
    batches = [(jnp.asarray(rng.integers(0, m.vocab_size, (A, B, T), dtype=np.int32)),
                jnp.asarray(rng.integers(0, m.vocab_size, (A, B, T), dtype=np.int32)))
               for _ in range(n_batches)]
    step = jnp.asarray(0, jnp.int32)

    t0 = time.perf_counter()
    compiled = step_fn.lower(params, opt_state, step, *batches[0]).compile()
    compile_sec = time.perf_counter() - t0

    times, losses = [], []
    for i in range(opts["warmup"] + opts["steps"]):
        x, y = batches[i % n_batches]
        t0 = time.perf_counter()
        params, opt_state, step, met = compiled(params, opt_state, step, x, y)
        jax.block_until_ready((params, opt_state, step, met))
        dt = time.perf_counter() - t0
        losses.append(float(met["loss"]))
        if i >= opts["warmup"]:
            times.append(dt)
    step_sec = statistics.median(times)

    # The ceiling is measured after the steps, on a warm machine, in the compute dtype.
    ceiling = metrics_lib.measure_matmul_tflops(dtype, n=opts["ceiling_n"] or None,
                                                reps=opts["ceiling_reps"])
    vendor = metrics_lib.vendor_peak_tflops(dtype_name)
    fpt = flops_per_token(m, T)
    rate = metrics_lib.Throughput(fpt, ceiling, vendor, 1)(tokens_per_step, step_sec)
    if not all(np.isfinite(losses)):
        raise UserError(f"non-finite loss in the benchmark: {losses}")
    return {
        "dtype": dtype_name,
        "step_ms": 1e3 * step_sec,
        "step_ms_min": 1e3 * min(times),
        "step_ms_max": 1e3 * max(times),
        "step_ms_all": [round(1e3 * s, 2) for s in times],
        "tokens_per_sec": rate["tokens_per_sec"],
        "model_tflops": rate["model_tflops"],
        "ceiling_tflops": ceiling,
        "mfu_measured": rate["mfu"],
        "mfu_vendor": rate["mfu_vendor"],
        "vendor_peak_tflops": vendor,
        "compile_sec": compile_sec,
        "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def main(argv: list[str]) -> int:
    try:
        opts, rest = split_bench_args(argv)
        (m, t), explicit = build([ModelConfig, TrainConfig], rest, default_preset="default")
        if "vocab_size" not in explicit and t.tokenizer == "char":
            m = dataclasses.replace(m, vocab_size=CHAR_VOCAB)
        m, t = validate_model(m), validate_train(t)
        dtypes = [d for d in opts["dtypes"].split(",") if d] or [m.dtype]
        runs = []
        device = metrics_lib.device_name()
        print(f"device: {device}; jax {jax.__version__}")
        print(f"model: {num_params(m) / 1e6:.2f}M params, L={m.n_layer} H={m.n_head} D={m.n_embd} "
              f"T={m.block_size} V={m.vocab_size}; batch {t.batch_size} x accum "
              f"{t.gradient_accumulation_steps}; dropout {m.dropout}; attention {m.attention}; "
              f"remat {m.remat}")
        for d in dtypes:
            md = validate_model(dataclasses.replace(m, dtype=d))
            r = bench_one(md, t, opts)
            if runs:
                r["speedup_vs_" + runs[0]["dtype"]] = runs[0]["step_ms"] / r["step_ms"]
            runs.append(r)
            vend = f"{100 * r['mfu_vendor']:.1f}%" if r["mfu_vendor"] is not None else "n/a"
            print(f"[{r['dtype']}] compile {r['compile_sec']:.1f} s | step {r['step_ms']:.1f} ms "
                  f"(median of {opts['steps']}, min {r['step_ms_min']:.1f}, max "
                  f"{r['step_ms_max']:.1f}) | {r['tokens_per_sec']:,.0f} tok/s | "
                  f"{r['model_tflops']:.3f} model TFLOP/s | matmul ceiling "
                  f"{r['ceiling_tflops']:.3f} TFLOP/s | MFU {100 * r['mfu_measured']:.1f}% of "
                  f"measured, {vend} of vendor | loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
            if len(runs) > 1:
                print(f"  {r['dtype']} vs {runs[0]['dtype']}: "
                      f"{r['speedup_vs_' + runs[0]['dtype']]:.2f}x faster step")
        out = dict(runs[-1])
        out.update(device=device, preset=next((a.split("=", 1)[1] for a in rest
                                               if a.startswith("--preset=")), "default"),
                   batch_size=t.batch_size, block_size=m.block_size, n_params=num_params(m),
                   jax=jax.__version__, runs=runs)
        print(json.dumps(out))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
