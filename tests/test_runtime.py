"""gpt/runtime.py: what --dtype/--attention=auto resolve to on each backend and CPU class, chosen
by argument (the backend) and by the GPT_CPU_BF16 override, never by patching the module."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from helpers import tiny_model_config
from gpt.config import ComputeConfig
from gpt.runtime import compute_dtype, cpu_flags, cpu_native_bf16, dtype_note, resolve


@pytest.mark.parametrize("forced,want", [("1", jnp.bfloat16), ("0", jnp.float32)])
def test_auto_dtype_follows_native_bf16_on_cpu(monkeypatch, forced, want):
    monkeypatch.setenv("GPT_CPU_BF16", forced)
    assert cpu_native_bf16() == (forced == "1")
    assert compute_dtype("auto", "cpu") == want
    assert resolve(tiny_model_config(), ComputeConfig(dtype="auto"), "cpu").dtype == want
    assert compute_dtype("auto", "gpu") == jnp.bfloat16 and compute_dtype("auto", "tpu") == jnp.bfloat16
    assert compute_dtype("float32", "gpu") == jnp.float32  # an explicit choice is kept
    warned = dtype_note(jnp.bfloat16, "cpu")
    assert ("emulated" in warned) == (forced == "0") and dtype_note(jnp.float32, "cpu") == ""


def test_detection_reads_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("GPT_CPU_BF16", raising=False)
    flags = cpu_flags()
    assert cpu_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_attention_choice_per_backend():
    cfg = tiny_model_config()
    assert resolve(cfg, ComputeConfig(dtype="float32"), "cpu").attention == "blocked"
    gpu = resolve(cfg, ComputeConfig(dtype="bfloat16"), "gpu")
    assert gpu.attention == "cudnn" and not gpu.cpu_layouts
    assert resolve(cfg, ComputeConfig(dtype="float32"), "gpu").attention == "xla"  # cuDNN needs 16-bit
    assert resolve(cfg, ComputeConfig(attention="einsum"), "cpu").attention == "reference"
