"""Shared fixtures: a small prepared corpus; tests run on CPU in float32 (helpers: tests/helpers.py)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers import REPO, TEST_XLA_FLAGS, USER_XLA_FLAGS_ENV, takes_silently

_PINNED_TO_CPU = "JAX_PLATFORMS" not in os.environ  # the tests run on CPU unless told otherwise
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# --dtype=auto is bfloat16 on CPUs with native bf16; the tests' tolerances are for float32, and the
# same on every machine class, so auto means float32 here (subprocesses inherit it).
os.environ.setdefault("GPT_CPU_BF16", "0")


def _test_xla_flags() -> None:
    """helpers.TEST_XLA_FLAGS added to the developer's XLA_FLAGS and inherited by every test
    process (pytest-xdist workers and subprocesses find them set and add nothing), the XLA:CPU
    ones only if this XLA takes them silently; an optimisation level the developer set wins."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ.setdefault(USER_XLA_FLAGS_ENV, flags)  # before ours: what a user's run compiles with
    if "xla_backend_optimization_level" in flags:
        return
    ours = TEST_XLA_FLAGS if takes_silently(f"{flags} {TEST_XLA_FLAGS}") else TEST_XLA_FLAGS.split()[0]
    os.environ["XLA_FLAGS"] = f"{flags} {ours}".strip()


_test_xla_flags()


def _session_compilation_cache() -> None:
    """One persistent XLA cache for the whole session, here and in every subprocess (they inherit
    the environment): the many train.py / sample.py runs of the same tiny models compile the same
    programs, and loading one costs a fraction of compiling it. Fresh each session, so never stale;
    a cache the developer set is used as it is. Exactness tests are unaffected: every run, the
    reference included, executes the same compiled programs."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    d = tempfile.mkdtemp(prefix="gpt-jax-tests-xla-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=d, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    atexit.register(shutil.rmtree, d, ignore_errors=True)


_session_compilation_cache()


def _selects_only_gpu_checks(marks: str) -> bool:
    """Whether a `-m` expression selects only tests marked gpu ("gpu", "gpu and not slow"; not
    "slow or gpu", "not gpu"), read with pytest's own parser."""
    if not marks.strip():
        return False
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest moved it: the plain case only
        return marks.strip() == "gpu"
    e = Expression.compile(marks)
    return e.evaluate(lambda name, **_: name == "gpu") and not e.evaluate(lambda name, **_: name != "gpu")


def pytest_configure(config) -> None:
    """`pytest -m gpu` selects the checks that need the GPU: they see it (the CPU pin above is
    lifted; before, run by hand they all skipped, and only bench/gpu.py, which sets the platforms
    itself, ran them). Their workers (pytest-xdist) share the one GPU, so none takes most of its
    memory up front. Nothing has imported jax yet here, so the environment is all it reads."""
    if _selects_only_gpu_checks(config.getoption("markexpr") or ""):
        if _PINNED_TO_CPU:
            os.environ.pop("JAX_PLATFORMS", None)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
