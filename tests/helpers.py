"""Helpers shared by the tests (importable from any test module: pyproject's pytest pythonpath)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tiny_model_config(**kw):
    from gpt.config import ModelConfig
    base = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                bias=True, dtype="float32")
    base.update(kw)
    return ModelConfig(**base)


def run_on_4_cpu_devices(script: str) -> dict:
    """Run a script in a fresh 4-CPU-device process; return the JSON on its last output line."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
