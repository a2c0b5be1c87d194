"""gpt.errors: one-line user errors; the module CLIs' shared argument parser."""
from __future__ import annotations

import pytest

from gpt.errors import ArgParser, UserError, run_main


def test_path_lists_like_train_py():
    """Several values, comma-separated values and a repeated flag all accumulate, as in train.py."""
    p = ArgParser(prog="python -m gpt.x")
    p.add_paths("--input", required=True)
    assert p.parse_args(["--input", "a.txt,b/", "c.txt", "--input=d/*.txt"]).input == \
        ["a.txt", "b/", "c.txt", "d/*.txt"]


def test_mistakes_are_one_user_error_line():
    p = ArgParser(prog="python -m gpt.x")
    p.add_paths("--input", required=True)
    with pytest.raises(UserError, match=r"required: --input \(see python -m gpt.x --help\)"):
        p.parse_args([])


def test_device_out_of_memory_is_one_line(capsys):
    """XLA's out-of-memory RESOURCE_EXHAUSTED ends in one line with the size and the flags that
    make each device hold less; other errors, with that status or not, still show a traceback."""

    import jax

    def main(argv):  # XLA's own error, as a real allocation failure raises it
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4398046511104 bytes.")

    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "out of memory: an allocation of 4096.0 GiB failed" in err and "--mesh=fsdp:N" in err

    for other in (RuntimeError("INTERNAL: something else"), RuntimeError("RESOURCE_EXHAUSTED: quota"),
                  jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: too many RPCs")):
        def bug(argv, other=other):
            raise other
        with pytest.raises(type(other)):
            run_main(bug, [])
