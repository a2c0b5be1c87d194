"""Timing on the accelerator for the bench tools: the best of a few batches of asynchronous calls,
and a variants' check-then-time loop (bench/norm.py, gelu.py)."""
from __future__ import annotations

import time

import jax

GPU = jax.default_backend() == "gpu"


def seconds_per_call(fn, *args, reps: int, carry: bool = False) -> float:
    """Best of three batches of `reps` asynchronous calls (dispatch overlaps the device work).
    `carry`: each call takes the last one's output as its last argument (a state it donates)."""
    out = jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            args = (*args[:-1], out) if carry else args
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def check_and_time(variants: dict, args: tuple, difference, moved: int, reps: int, want=None) -> dict:
    """Each variant's values against `want` or else the first variant's (`difference(got, want)`,
    a dict with "passed") and, on a GPU, its microseconds a call and GB/s by `moved` bytes; a
    variant that fails (Triton out of resources, say) is its error's row, and the others still
    run. Prints a line a variant."""
    rows = {}
    for name, fn in variants.items():
        try:
            f = jax.jit(fn)
            got = jax.block_until_ready(f(*args))
            want = got if want is None else want
            row = difference(got, want)
            del got
            if GPU:
                us = 1e6 * seconds_per_call(f, *args, reps=reps)
                row.update(us=us, gbps=moved / us / 1e3)
        except Exception as e:  # one variant out of resources is its row; the others still run
            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        rows[name] = row
        print(f"{name:24s} {row}", flush=True)
    return rows
