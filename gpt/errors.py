"""User-facing errors: one line, exit status 2, no traceback.

Every command's `main` goes through `run_main`, so a mistake in the user's input never shows a
Python traceback, while a genuine bug (any other exception) still does.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Sequence


class UserError(Exception):
    """A problem with the user's input; the message names it and how to fix it."""


def quiet_library_logs() -> None:
    """Orbax and absl log warnings (e.g. about read-only managers) that are noise for our users."""
    import logging
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass


def finite_number(v) -> bool:
    """Whether a value read back from a file a user may edit is a finite number (not a boolean,
    NaN or infinity): what a float setting or a loss must be."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_json_object(path, what: str) -> dict:
    """The JSON object in `path` (metadata or config a user may have edited), or one UserError
    line naming the file; `what` says what it should be."""
    import json
    try:
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # deep nesting: the last
        raise UserError(f"{path} is not valid JSON ({' '.join(str(e).split())}); it should be {what}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object ({what})")
    return data


Report = Callable[[], None]  # prints a command's error (its line, or a bug's traceback)
FailureHandler = Callable[[int, str, Report], None]  # (exit status, one-line error, report)
_failure_handler: list[FailureHandler] = []  # at most one


def run_main(main: Callable[[Sequence[str]], int | None], argv: Sequence[str] | None = None) -> None:
    """Run a command's main; what the user can fix (`failure_line`) ends in one stderr line and its
    exit status, a bug in Python's traceback. A registered failure handler (`on_failure`) is
    handed either, and prints it itself."""
    quiet_library_logs()
    try:
        code = main(list(sys.argv[1:] if argv is None else argv))
    except SystemExit:
        raise
    except ReaderGone:  # `sample.py | head`: stop quietly, as cat does
        sys.exit(0)
    except BaseException as e:  # noqa: BLE001 - each is reported (or re-raised) below
        status, line = failure_line(e)
        if line is None and not _failure_handler:
            raise  # a bug: Python's own traceback

        def report() -> None:
            if line is None:
                traceback.print_exception(e)
            else:
                print(line, file=sys.stderr, flush=True)
        message = line or f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if _failure_handler:
            _failure_handler[0](status, message.removeprefix("error: "), report)  # may exit
        else:
            report()
        sys.exit(status)
    sys.exit(code or 0)


class ReaderGone(Exception):
    """The reader of stdout closed it (`sample.py | head`): `run_main` ends the command quietly."""


@contextmanager
def reader_may_leave():
    """Around a command's writes to stdout: a BrokenPipeError there means its reader went away,
    which `run_main` takes as the end of the command (status 0, no message), as cat does. Only
    here: a broken pipe anywhere else in a program is an error like any other."""
    try:
        yield
    except BrokenPipeError:
        try:  # stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture)
            pass
        raise ReaderGone from None


def on_failure(handler: FailureHandler) -> None:
    """Hand a command's failure to `handler(exit status, one-line error, report)` instead of
    printing it: a multi-host job tells its other processes (gpt/distributed.py). The handler
    calls `report()` to print the error (or not, when the process stops for another reason
    first), and may exit the process itself."""
    _failure_handler[:] = [handler]


_DISK_FIXES = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space on that disk",
               errno.EROFS: "make that disk writable"}


def failure_line(e: BaseException) -> tuple[int, str | None]:
    """(exit status, the one line to print) for what the user can fix; (1, None) for a bug. A full
    disk is the user's to fix wherever it strikes, and so is device memory exhaustion."""
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    status = 2
    if isinstance(e, UserError):
        message = str(e)
    elif isinstance(e, OSError) and e.errno in _DISK_FIXES:  # full, or remounted read-only mid-run
        where = f" while writing {e.filename}" if e.filename else ""
        message = f"{e.strerror}{where}; {_DISK_FIXES[e.errno]} or choose another output directory"
    elif is_out_of_memory(e):
        message = out_of_memory_message(e)
    elif is_lost_peer(e):  # not this process's bug, nor the user's input
        status, message = 1, lost_peer_message(e)
    else:
        return 1, None
    return status, "error: " + " ".join(message.split())


def is_out_of_memory(e: BaseException) -> bool:
    """XLA running out of device memory (not any error that mentions RESOURCE_EXHAUSTED: storage
    quotas and RPC limits use that status too, and are bugs or other faults)."""
    runtime_error = type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
    text = str(e)
    return runtime_error and "RESOURCE_EXHAUSTED" in text and "out of memory" in text.lower()


def is_lost_peer(e: BaseException) -> bool:
    """A collective that failed because another process's connection dropped (gloo, the CPU's
    collectives: that process was killed or its host went down). Not a bug of this process, and
    its traceback says nothing more."""
    text = str(e)
    return "Gloo" in text and ("Connection reset by peer" in text or "Connection closed by peer" in text)


def lost_peer_message(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0][:200]
    return (f"a collective with another process of the job failed ({first}): that process has "
            f"stopped (killed, out of memory, or its host down); see its log, and restart the job "
            f"with --init_from=resume to go on from the last checkpoint")


def out_of_memory_message(e: BaseException) -> str:
    """One line for XLA's RESOURCE_EXHAUSTED (a model, batch or cache that does not fit a device):
    how much it tried to allocate, and the flags that make each device hold less."""
    sizes = [int(n) for n in re.findall(r"allocat\w* (\d+) bytes", str(e))]
    need = f"an allocation of {max(sizes) / 2**30:.1f} GiB failed on one device" if sizes else "a device ran out"
    return (f"out of memory: {need} (XLA: {str(e).strip().splitlines()[0][:160]}); training: lower "
            f"--batch_size (raise --gradient_accumulation_steps to keep the tokens per step), "
            f"--remat=block, shard with --mesh=fsdp:N, --dtype=bfloat16, or a smaller model; "
            f"sampling: lower --num_samples or --max_new_tokens")


class ArgParser(argparse.ArgumentParser):
    """argparse for the module CLIs (gpt.data, gpt.convert, gpt.evaluate): a mistake is one
    UserError line (exit status 2 through `run_main`), and path lists are taken as `train.py`
    takes them: several values after the flag, comma-separated values, or the flag repeated."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")

    def print_help(self, file=None) -> None:
        with reader_may_leave():  # `--help | head`
            super().print_help(file)

    def add_paths(self, flag: str, **kw) -> None:
        self.add_argument(flag, nargs="+", action=_ExtendSplit, metavar="PATH", **kw)


class _ExtendSplit(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items += [x for v in values for x in v.split(",") if x]
        setattr(namespace, self.dest, items)
