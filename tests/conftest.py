"""Shared fixtures: a small prepared corpus; tests run on CPU in float32 (helpers: tests/helpers.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import REPO

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# --dtype=auto is bfloat16 on CPUs with native bf16; the tests' tolerances are for float32, and the
# same on every machine class, so auto means float32 here (subprocesses inherit it).
os.environ.setdefault("GPT_CPU_BF16", "0")


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> Path:
    """The first 200 kB of the bundled Shakespeare, prepared with the char tokenizer."""
    from gpt.data import prepare
    root = tmp_path_factory.mktemp("corpus")
    text = (REPO / "data" / "shakespeare.txt").read_text()[:200_000]
    (root / "input.txt").write_text(text)
    out = root / "prepared"
    prepare([str(root / "input.txt")], "char", out)
    return out
