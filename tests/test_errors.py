"""gpt.errors: one-line user errors; the module CLIs' shared argument parser."""
from __future__ import annotations

import pytest

from gpt.errors import ArgParser, UserError


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
