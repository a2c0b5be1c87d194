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


def test_a_collective_that_lost_its_peer_is_one_line(capsys):
    """Another process killed mid-step: gloo's collective fails at once in this one, as a
    ValueError jax raises (seen with two processes of one CPU device each). One line naming what
    happened and how to go on, exit status 1; a gloo error of another kind is still a traceback."""
    lost = ("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
            "Read error [127.0.0.1]:24742: Connection reset by peer")

    def main(argv):
        raise ValueError(lost)
    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: a collective with another process of the job failed (UNKNOWN: Gloo")
    assert "--init_from=resume" in err

    def other(argv):
        raise ValueError("UNKNOWN: Gloo all-reduce failed: mismatched sizes")
    with pytest.raises(ValueError):
        run_main(other, [])


def test_a_failure_handler_reports_instead(monkeypatch, capsys):
    """With a handler (a multi-host job's), run_main hands it the exit status, the one-line error
    and a `report` that prints what run_main would have printed (the line, or a bug's traceback);
    the handler decides when to print it. Without one, nothing changes."""
    from gpt import errors
    import errno

    calls = []

    def handler(status, line, report):
        calls.append((status, line))
        report()
    monkeypatch.setattr(errors, "_failure_handler", [])
    errors.on_failure(handler)
    cases = [(UserError("bad  --flag\nvalue"), 2, "bad --flag value", "error: bad --flag value\n"),
             (OSError(errno.ENOSPC, "No space left on device", "out/x"), 2,
              "No space left on device while writing out/x; free space on that disk or choose another "
              "output directory", None),
             (OSError(errno.EROFS, "Read-only file system", "out/m"), 2,
              "Read-only file system while writing out/m; make that disk writable or choose another "
              "output directory", None),
             (RuntimeError("a\nbug"), 1, "RuntimeError: a bug", "Traceback"),
             (KeyboardInterrupt(), 130, "interrupted", "interrupted\n")]
    for exc, status, line, printed in cases:
        def main(argv, exc=exc):
            raise exc
        with pytest.raises(SystemExit) as e:
            run_main(main, [])
        err = capsys.readouterr().err
        assert e.value.code == status and calls[-1] == (status, line)
        assert (printed or "error: " + line) in err
    monkeypatch.setattr(errors, "_failure_handler", [])
    with pytest.raises(RuntimeError):
        run_main(lambda argv: (_ for _ in ()).throw(RuntimeError("bug")), [])


def test_a_full_disk_is_one_line_whatever_the_file_name(capsys):
    import errno

    def main(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "out/a\nb  c")
    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == ("error: No space left on device while writing out/a b c; free space "
                                         "on that disk or choose another output directory\n")


def test_a_reader_that_goes_away_ends_the_command_quietly(capsys):
    """`sample.py | head`: when the reader of stdout closes the pipe, the command stops with status
    0 and no traceback, as cat does; a broken pipe anywhere else is not taken for it."""
    from gpt.errors import reader_may_leave

    def main(argv):
        with reader_may_leave():
            raise BrokenPipeError(32, "Broken pipe")
    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    assert e.value.code == 0 and capsys.readouterr().err == ""

    def elsewhere(argv):
        raise BrokenPipeError(32, "Broken pipe")  # a worker's pipe, say
    with pytest.raises(BrokenPipeError):
        run_main(elsewhere, [])


@pytest.mark.parametrize("cmd", [["train.py"], ["sample.py"], ["-m", "gpt.data"], ["bench/train.py"]])
def test_help_into_a_closed_pipe_is_quiet(cmd):
    """`train.py --help | true`: the reader is gone before the help is written (it printed a
    BrokenPipeError traceback and exit status 1)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    read, write = os.pipe()
    os.close(read)  # no reader at all: the first write fails
    try:
        proc = subprocess.run([sys.executable, *cmd, "--help"], cwd=Path(__file__).resolve().parent.parent,
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
