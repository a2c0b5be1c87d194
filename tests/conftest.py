"""Shared fixtures: a small prepared corpus and tiny configs; tests run on CPU in float32."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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


def tiny_model_config(**kw):
    from gpt.config import ModelConfig
    base = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                bias=True, dtype="float32")
    base.update(kw)
    return ModelConfig(**base)
