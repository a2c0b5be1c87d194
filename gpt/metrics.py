"""Throughput and MFU, metrics.jsonl, TensorBoard events and the loss plot.

MFU is reported against two ceilings: a matmul ceiling *measured on this device, in this dtype, in
this run* (honest on any hardware, CPUs included) and the vendor's peak where we know it. The same
functions serve `train.py` and `bench/train.py`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt.tokenizer import atomic_write_bytes

# Dense bf16 peak TFLOP/s by device kind (substring match on jax's device_kind).
VENDOR_PEAK_BF16 = {  # dense; the first name found in the device kind wins: a variant before its family
    "H200 NVL": 835.0, "H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0,
    "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10G": 125.0, "RTX 4090": 165.2,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6": 918.0,
}


def device_name() -> str:
    d = jax.devices()[0]
    if d.platform == "cpu":
        model = ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"cpu: {model or 'unknown'} ({os.cpu_count()} cores)"
    return f"{d.platform}: {d.device_kind}"


def vendor_peak_tflops(dtype: str) -> float | None:
    """The vendor's dense peak for this device, or None (CPUs, unknown chips, float32)."""
    d = jax.devices()[0]
    if d.platform == "cpu" or dtype != "bfloat16":
        return None
    kind = d.device_kind
    for name, peak in VENDOR_PEAK_BF16.items():
        if name.lower() in kind.lower():
            return peak
    return None


def _best_seconds(f, args: tuple, reps: int, feed: bool = False) -> float:
    """The best wall time of `f(*args)` over `reps` calls after a warm-up (compilation). `feed`: f
    donates its one argument, so each call takes the previous call's output."""
    out = f(*args).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        args = (out,) if feed else args
        t0 = time.perf_counter()
        out = f(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_tflops(dtype, n: int | None = None, reps: int = 10) -> float:
    """Best achieved TFLOP/s of an n x n `a @ b` with float32 accumulation on one device."""
    cpu = jax.default_backend() == "cpu"
    if n is None:
        n = 1024 if cpu else 8192
    if cpu:  # the CPU's speed does not depend on the values; random ones would cost a compilation
        # of the random-number generator (0.3 s) at every training start
        a = jnp.full((n, n), 0.5, dtype)
        b = jnp.full((n, n), 0.25, dtype)
    else:  # a GPU's does: unchanging bits draw less power and clock higher (an inflated ceiling)
        a = jnp.sin(jnp.arange(n * n, dtype=jnp.float32)).reshape(n, n).astype(dtype)
        b = jnp.cos(0.7 * jnp.arange(n * n, dtype=jnp.float32)).reshape(n, n).astype(dtype)
    f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / _best_seconds(f, (a, b), reps) / 1e12


def _bandwidth_bytes(n_bytes: int | None) -> int:
    """1 GiB on accelerators (far past any cache), 256 MiB on CPU."""
    if n_bytes is not None:
        return n_bytes
    return (256 << 20) if jax.default_backend() == "cpu" else (1 << 30)


def measure_copy_gbps(n_bytes: int | None = None, reps: int = 10) -> float:
    """Best achieved memory bandwidth (GB/s, bytes read + bytes written) of an elementwise pass
    over a float32 array on one device: the ceiling that memory-bound work such as batch-1 decoding
    is held to."""
    n_bytes = _bandwidth_bytes(n_bytes)
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    # A real pass (XLA cannot elide a scaling), in place: a fresh output would be mapped and
    # page-faulted in by the host allocator on every call, which on CPU measured a quarter of the
    # bandwidth that the same pass over memory already mapped reaches.
    f = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    return 2 * n_bytes / _best_seconds(f, (x,), reps, feed=True) / 1e9


def measure_read_gbps(n_bytes: int | None = None, reps: int = 10) -> float:
    """Best achieved bandwidth (GB/s) of a read-only pass over a float32 array on one device (the
    sizes of `measure_copy_gbps`): the better of a sum and a matrix-vector product, the op batch-1
    decoding reads its weights with (XLA:CPU may run a sum on one thread). A read stream need not
    reach the copy figure, which counts reads and writes together."""
    n_bytes = _bandwidth_bytes(n_bytes)
    x = jnp.ones((n_bytes // 4 // 1024, 1024), jnp.float32)
    v = jnp.ones((1024,), jnp.float32)
    best = min(_best_seconds(jax.jit(jnp.sum), (x,), reps), _best_seconds(jax.jit(jnp.matmul), (x, v), reps))
    return n_bytes / best / 1e9


class Throughput:
    """Tokens/s, achieved TFLOP/s and MFU from a FLOPs-per-token figure and measured ceilings."""

    def __init__(self, flops_per_token: float, ceiling_tflops: float | None,
                 vendor_tflops: float | None, n_devices: int = 1):
        self.flops_per_token = flops_per_token
        self.ceiling = ceiling_tflops
        self.vendor = vendor_tflops
        self.n_devices = n_devices

    def __call__(self, tokens: int, seconds: float) -> dict[str, float | None]:
        tps = tokens / max(seconds, 1e-9)
        tflops = tps * self.flops_per_token / 1e12
        per_device = tflops / self.n_devices
        return {
            "tokens_per_sec": tps,
            "model_tflops": tflops,
            "mfu": per_device / self.ceiling if self.ceiling else None,
            "mfu_vendor": per_device / self.vendor if self.vendor else None,
        }


def _parse_line(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl record, or None for a blank line or one torn by a crash mid-write."""
    try:
        r = json.loads(line) if line.strip() else None
    except (ValueError, RecursionError):
        return None
    return r if isinstance(r, dict) else None


class MetricsLog:
    """metrics.jsonl (one object per line), TensorBoard events and loss.png, on process 0 only."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None, enabled: bool = True,
                 tensorboard: bool = True):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / "metrics.jsonl"
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            # Drop lines from after the checkpoint we resume from: they will be recomputed exactly.
            # (A line torn by a crash mid-write is dropped too.)
            kept = [ln for ln in self.path.read_text().splitlines()
                    if (r := _parse_line(ln)) is not None and r.get("step", 0) <= resume_step]
            atomic_write_bytes(self.path, "".join(ln + "\n" for ln in kept).encode())
        elif resume_step is None:  # a fresh run: no old records or TensorBoard events to mix with
            self.path.unlink(missing_ok=True)
            for events in self.out_dir.glob("events.out.tfevents.*"):
                events.unlink()
        if tensorboard:  # on resume, TensorBoard drops the old files' events after the checkpoint
            self.writer = _tensorboard_writer(self.out_dir, None if resume_step is None else resume_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = _finite_or_null(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            kind = record.get("kind", "eval")
            for tag, v in _scalars(record, kind):
                self.writer.add_scalar(tag, v, record["step"])

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [r for ln in self.path.read_text().splitlines() if (r := _parse_line(ln)) is not None]

    def plot(self) -> None:
        """Redraw loss.png from metrics.jsonl (train loss per log step, train/val loss per eval)."""
        if not self.enabled:
            return
        from matplotlib.figure import Figure  # not pyplot: no global state, no GUI backend
        recs = self.records()
        train = [(r["step"], r["loss"]) for r in recs if r.get("kind") == "train"]
        evals = [r for r in recs if r.get("kind", "eval") == "eval"]
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        if train:
            ax.plot(*zip(*train), color="0.7", lw=1, label="train (batch)")
        if evals:
            steps = [r["step"] for r in evals]
            ax.plot(steps, [r["train_loss"] for r in evals], "o-", label="train (eval)")
            ax.plot(steps, [r["val_loss"] for r in evals], "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = self.out_dir / ".loss.png.tmp"
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, self.out_dir / "loss.png")

    def flush(self) -> None:
        """The TensorBoard events buffered since the last flush, to disk (metrics.jsonl is
        written record by record)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(out_dir: Path, purge_step: int | None = None) -> Any:
    """tensorboardX's SummaryWriter (None without tensorboardX). Where torch is installed,
    tensorboardX imports it at import time, only to accept torch tensors (we log floats): 1.3-1.7 s
    of every training start on a 2-core CPU. So torch is hidden while tensorboardX loads (an import
    of it fails there and tensorboardX goes on without it), and visible again right after.
    `purge_step` (a resumed run's first step) has TensorBoard discard the events of earlier files
    from that step on, which a crash after the checkpoint left and the run now recomputes."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" raises ImportError
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: training works without it
        return None
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter(str(out_dir), flush_secs=30, purge_step=purge_step)


def _finite_or_null(v: Any) -> Any:
    """`v` with NaN and infinities as None (null): strict JSON readers (jq, JavaScript) refuse the
    NaN and Infinity tokens Python would write, and a diverging step's grad norm can be one."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_or_null(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite_or_null(x) for x in v]
    return v


def _scalars(record: dict[str, Any], prefix: str):
    """(TensorBoard tag, number) of a record's numbers, nested dicts and lists included
    (moe_load/layer1/0 is expert 0's load in layer 1); the step is the x axis, not a scalar."""
    for k, v in record.items():
        if k == "step" or v is None or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            yield f"{prefix}/{k}", v
        elif isinstance(v, (dict, list)):
            yield from _scalars(dict(enumerate(v)) if isinstance(v, list) else v, f"{prefix}/{k}")


def to_host(tree: Any) -> Any:
    """Device scalars to Python floats, arrays to (nested) lists of them (the only place training
    reads values back)."""
    def host(x):
        a = np.asarray(x)
        return a.tolist() if a.ndim else float(a)
    return jax.tree.map(host, tree)
