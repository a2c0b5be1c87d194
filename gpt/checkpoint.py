"""Orbax checkpoints: asynchronous saves, last-N plus best-by-val-loss, fallback past damaged steps.

Layout: `OUT/checkpoints/<step>/{params,opt_state,meta}`; `params` and `opt_state` are Orbax
PyTrees (sharded arrays saved and restored by all processes together, onto any mesh), `meta` is
JSON (step, config, tokenizer spec, data-loader state, PRNG key, val loss). Orbax writes each step
into a temporary directory (`<step>.orbax-checkpoint-tmp...`) and renames it when complete, so a
step directory that exists is complete; a writable manager deletes leftover temporary directories
(from a killed save) when it starts. A step that still fails to restore (truncated or deleted files)
is reported by number and skipped; a training run then moves it aside to `<step>.damaged`, so the
steps it saves next never collide with it. A failed write (full disk, no permission) surfaces at
the next save or at close as a one-line UserError naming the step; see RELIABILITY.md.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from gpt.errors import UserError, finite_number

FORMAT_VERSION = 1
TMP_MARKER = ".orbax-checkpoint-tmp"  # Orbax's temporary step directories contain this

# OS errors that mean "this disk cannot take the checkpoint", not a bug: reported as UserError.
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO,
                   errno.EFBIG)


class _DropOrbaxLogs(logging.Filter):
    """Orbax logs every failed background save with a traceback; we report it as one line.

    The same failure can also reach asyncio's "exception was never retrieved" log (when several
    of a save's write tasks fail, Orbax retrieves only the first): see _DropOrbaxStorageErrors.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        files = [record.pathname]
        tb = record.exc_info[2] if record.exc_info else None
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        return not (any("orbax" in f for f in files) or str(record.msg).startswith("[process="))


class _DropOrbaxStorageErrors(_DropOrbaxLogs):
    """For asyncio's log: only Orbax's storage failures (reported as one line) and the writes that
    fail after them into the abandoned save's temporary directory (Orbax removes it: NOT_FOUND);
    anything else shows.

    A failed TensorStore write reaches its future with no Python traceback, so "Orbax's" is told
    either by the frames or by the path of Orbax's temporary directory in the message.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        if TMP_MARKER in str(exc) or any(step in str(exc) for step in _REPORTED_DAMAGED):
            return False
        return super().filter(record) or storage_errno(exc) is None


# Step folders restore() has reported as damaged: the other reads of such a step that fail too
# ("Future exception was never retrieved", once the future is collected, even at exit) say nothing more.
_REPORTED_DAMAGED: set[str] = set()


logging.getLogger("absl").addFilter(_DropOrbaxLogs())
logging.getLogger("asyncio").addFilter(_DropOrbaxStorageErrors())
# The write tasks of an abandoned save that never ran are reported at exit as never awaited.
warnings.filterwarnings("ignore", message="coroutine 'async_serialize_from_host", category=RuntimeWarning)


def storage_errno(e: BaseException) -> int | None:
    """The errno if `e` is a storage failure (OSError, or TensorStore's ValueError wrapping one)."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        m = re.search(r"os_error_code='?(\d+)", str(e))
        code = int(m.group(1)) if m else None
    if code is None:
        code = next((c for c in _STORAGE_ERRNOS if os.strerror(c) in str(e)), None)
    return code if code in _STORAGE_ERRNOS else None


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir).absolute() / "checkpoints"


def list_steps(out_dir: str | Path) -> list[int]:
    """Complete steps on disk (Orbax's temporary directories are not digits, so never listed)."""
    d = checkpoint_dir(out_dir)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir()
                  if p.is_dir() and p.name.isascii() and p.name.isdigit())  # int("²") fails


NO_VAL_LOSS = 1e30  # a step saved without an evaluation: never the best


def _val_loss_in(path: Path) -> float | None:
    """The finite `val_loss` number of the JSON object in `path`, else None."""
    import json
    try:
        v = json.loads(path.read_text()).get("val_loss")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return float(v) if finite_number(v) else None


def _metrics_of_every_step(d: Path) -> None:
    """Give every step a readable <step>/metrics/metrics, from its own meta's val loss: steps
    saved by earlier versions had none (they were never the best, and kept for good), and Orbax
    raised a traceback on a damaged one. Atomic and the same on every process of a job."""
    import json

    from gpt.tokenizer import atomic_write_bytes
    for s in list_steps(d.parent):
        path = d / str(s) / "metrics" / "metrics"
        if _val_loss_in(path) is not None:
            continue
        loss = _val_loss_in(d / str(s) / "meta" / "metadata")
        try:
            path.parent.mkdir(exist_ok=True)
            atomic_write_bytes(path, json.dumps({"val_loss": NO_VAL_LOSS if loss is None else loss}).encode())
        except OSError:
            pass  # an unwritable step: Orbax reports it as it may


class Checkpointer:
    def __init__(self, out_dir: str | Path, keep: int = 3, *, read_only: bool = False,
                 async_save: bool = True):
        self.dir = checkpoint_dir(out_dir)
        # The last `keep` steps and the best by val loss. Orbax writes a step's val loss to disk
        # (<step>/metrics) only with a best_fn, and a restarted manager that found none deleted the
        # best step at its first save after a resume. A reader deletes nothing: it reads no metrics.
        policy = pp.AnyPreservationPolicy([
            pp.LatestN(n=keep),
            pp.BestN(get_metric_fn=lambda m: m["val_loss"], reverse=True, n=1,
                     keep_checkpoints_without_metrics=False),
        ])
        if not read_only:
            _metrics_of_every_step(self.dir)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, create=not read_only, read_only=read_only,
            enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only,
            best_fn=None if read_only else (lambda m: m["val_loss"]), best_mode="min",
            lightweight_initialize=read_only)
        self.read_only = read_only
        _quiet_abandoned_reads()  # a failed save or restore leaves Orbax reads/writes that complain
        self._pending: int | None = None  # the step whose asynchronous save may still be running
        try:
            self.manager = ocp.CheckpointManager(self.dir, options=options,
                                                 item_names=("params", "opt_state", "meta"))
        except Exception as e:  # noqa: BLE001
            if storage_errno(e) is None:
                raise
            raise UserError(f"cannot use checkpoint directory {self.dir}: "
                            f"{os.strerror(storage_errno(e))}") from None

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any],
             val_loss: float | None) -> None:
        """Start an asynchronous save (the previous one is finished first, and its error raised)."""
        self._finish()
        metrics = {"val_loss": float(val_loss) if val_loss is not None else NO_VAL_LOSS}
        args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                                  opt_state=ocp.args.StandardSave(opt_state),
                                  meta=ocp.args.JsonSave(meta))
        self._pending = step
        try:
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as e:  # noqa: BLE001
            self._raise_write_error(e)

    def _finish(self) -> None:
        """Wait for the save in flight; a failed write becomes a UserError naming its step."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._raise_write_error(e)
        self._pending = None

    def _raise_write_error(self, e: BaseException) -> None:
        step, self._pending = self._pending, None
        code = storage_errno(e)
        if code is None:
            raise e  # not a storage problem: a bug, keep the traceback
        if step is not None and jax.process_index() == 0:  # free what the failed write took
            for tmp in self.dir.glob(f"{step}{TMP_MARKER}*"):
                shutil.rmtree(tmp, ignore_errors=True)
        kept = [s for s in list_steps(self.dir.parent) if s != step]
        hint = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space within your quota"
                }.get(code, "make it writable")
        raise UserError(f"could not write checkpoint step {step} in {self.dir}: {os.strerror(code)}; "
                        f"{hint} (or choose another --out_dir) and continue with --init_from=resume; "
                        f"the previous checkpoints are intact (steps {kept})") from None

    def wait(self) -> None:
        """Block until the save in flight is on disk (its error raised)."""
        self._finish()

    def close(self) -> None:
        try:
            self._finish()
        finally:
            self.manager.close()

    def _move_aside(self, steps: list[int]) -> None:
        """Rename damaged step dirs to `<step>.damaged` so new saves and retention ignore them."""
        if self.read_only or not steps:
            return
        if jax.process_index() == 0:
            for s in steps:
                src, dst = self.dir / str(s), self.dir / f"{s}.damaged"
                n = 1
                while dst.exists():
                    dst, n = self.dir / f"{s}.damaged.{n}", n + 1
                try:
                    src.rename(dst)
                except OSError:
                    pass
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("gpt_checkpoint_moved_damaged_steps")
        self.manager.reload()

    def restore(self, abstract_params: Any, abstract_opt_state: Any | None = None,
                step: int | None = None) -> tuple[int, Any, Any, dict[str, Any]]:
        """Restore the newest complete step (or `step`); fall back past damaged ones with a warning.

        Returns (step, params, opt_state or None, meta).
        """
        steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
        for tries_left in reversed(range(READS_BESIDE_A_RUN)):
            if not steps:
                raise UserError(f"no checkpoint in {self.dir.parent}")
            out = self._restore_from(steps, abstract_params, abstract_opt_state, step is None and tries_left > 0)
            if out is not None:
                return out
            _collect_quietly()
            steps = sorted(list_steps(self.dir.parent), reverse=True)
        raise AssertionError("unreachable: the last try returns or raises")

    def _newer_saved(self, newest: int) -> bool:
        """Whether a step newer than `newest` was saved since the steps were listed: a reader
        (sample.py) beside a training run, whose retention deletes older steps once it has saved a
        newer one, so a step that vanished while read is not damaged (it was reported so, and the
        reader fell back to an older step, the best: often far older)."""
        return max(list_steps(self.dir.parent), default=-1) > newest

    def _restore_from(self, steps: list[int], abstract_params: Any, abstract_opt_state: Any | None,
                      may_list_again: bool) -> tuple[int, Any, Any, dict[str, Any]] | None:
        """The first of `steps` (newest first) that restores, the damaged ones before it reported;
        None (with `may_list_again`) if a newer step was saved meanwhile: list the steps again."""
        damaged: list[tuple[int, str]] = []  # (step, why); reported once we know the outcome
        _quiet_abandoned_reads()
        for s in steps:
            items = dict(params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore())
            if abstract_opt_state is not None:
                items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
            try:
                out = self.manager.restore(s, args=ocp.args.Composite(**items))
                meta = dict(out["meta"])
                if meta.get("step") != s:
                    raise ValueError(f"its meta says step {meta.get('step')}")
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure here means a damaged checkpoint
                if (stop := _interrupt_in(e)) is not None:  # ... but a signal's: the read was cut short
                    raise stop from None
                if may_list_again and self._newer_saved(steps[0]):
                    return None  # a running training saved, and its retention deleted s
                damaged.append((s, _root_cause(e)))
                folder = self.dir / str(s)
                _REPORTED_DAMAGED.update(str(p) + os.sep for p in (folder.absolute(), folder.resolve()))
            if damaged and damaged[-1][0] == s:
                _collect_quietly()
                continue
            if jax.process_index() == 0:
                for d, why in damaged:
                    print(f"warning: checkpoint step {d} is damaged ({why}); falling back to step {s}",
                          file=sys.stderr, flush=True)
            self._move_aside([d for d, _ in damaged])
            return s, out["params"], out.get("opt_state") if abstract_opt_state else None, meta
        if all(_mismatch(why) for _, why in damaged):
            raise UserError(f"the checkpoints in {self.dir} hold arrays of other shapes than the model "
                            f"their metadata describes (newest: {damaged[0][1]}): the metadata was edited, "
                            f"or it was written by code that builds the model differently; restore the "
                            f"metadata or use that code (the arrays are intact; nothing was moved or deleted)")
        raise UserError(damaged_message(self.dir.parent, steps, damaged[0][1]))


READS_BESIDE_A_RUN = 5  # tries of a reader whose newest step a running training deleted meanwhile


# Orbax's own words for arrays that do not fit the requested tree ("... is not compatible with the
# stored shape", "... metadata tree structures do not match"): phrases, not words, since the cause's
# text also holds the checkpoint's path, which may hold "shape" or "tree"
_MISMATCH = re.compile(r"stored shape|structures do not match|structure mismatch", re.IGNORECASE)


def _mismatch(why: str) -> bool:
    """Whether a failed restore's cause is arrays that do not fit the model built from the
    metadata (shapes, the tree's structure), not a damaged or missing file."""
    return _MISMATCH.search(why) is not None


def _quiet_abandoned_reads() -> None:
    """A failed Orbax restore leaves reads in flight; when they finish or are garbage-collected
    (even at exit) Python prints their errors ("Exception ignored in: <coroutine ...>", "Event loop
    is closed") with tracebacks. restore() reports the damaged step in one line instead, so such
    reports from Orbax's reads are dropped; any other is still printed."""
    if getattr(sys.unraisablehook, "__name__", "") == "_drop_orbax_unraisable":
        return
    previous = sys.unraisablehook

    def _drop_orbax_unraisable(u) -> None:
        code = getattr(u.object, "cr_code", None)
        files = [code.co_filename] if code is not None else []
        tb = u.exc_traceback
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        closed_loop = isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)
        if not (closed_loop or any("orbax" in f for f in files)):
            previous(u)
    sys.unraisablehook = _drop_orbax_unraisable


def _collect_quietly() -> None:
    import gc
    _quiet_abandoned_reads()
    gc.collect()


def _interrupt_in(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt (Ctrl-C), or any other exception that is not an Exception, in `e`'s
    chain of causes: Orbax wraps what a read raises, even these, in a plain Exception ("Encountered
    error while reading array index"), which must not make an intact step count as damaged (moved
    aside, the interrupt lost)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if not isinstance(e, Exception):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _root_cause(e: BaseException) -> str:
    """The innermost error's message (TensorStore's names the file and what is wrong), one line."""
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return " ".join(str(e).split())[:200] or type(e).__name__


def damaged_message(out_dir: str | Path, steps: list[int], why: str = "") -> str:
    why = f"; newest: {why}" if why else ""
    return (f"every checkpoint in {checkpoint_dir(out_dir)} is damaged (steps {sorted(steps)}{why}); "
            f"nothing to resume or sample from: train again with --init_from=scratch --overwrite")


# What our checkpoints' metadata may hold: training runs, conversions (source, hf_model_type), LoRA
# runs (lora) and their merges (merged_from).
META_KEYS = frozenset({"format_version", "step", "config", "tokenizer", "data_dir", "val_loss", "best_val_loss",
                       "source", "hf_model_type", "lora", "merged_from"})


def check_meta(meta: dict[str, Any], out_dir: str | Path, step: int) -> None:
    """A readable checkpoint's metadata is one this code wrote and can read: its format version
    is not newer, and it has no keys we never write. Such a checkpoint is intact but
    incompatible, so the message never suggests deleting it (--overwrite)."""
    where = f"checkpoint step {step} in {checkpoint_dir(out_dir)}"
    v = meta.get("format_version")
    if isinstance(v, int) and not isinstance(v, bool) and v > FORMAT_VERSION:
        raise UserError(f"{where} was written by a newer version of this code (checkpoint format {v}; this code "
                        f"reads {FORMAT_VERSION}); update this code (git pull); the checkpoint is intact")
    unknown = sorted(set(meta) - META_KEYS)
    if unknown:
        raise UserError(f"{where} has metadata keys this code never writes ({', '.join(map(str, unknown[:5]))}): it "
                        f"was written by other code or edited; its arrays are untouched: remove those keys from "
                        f"meta/metadata, or use another --out_dir")


def read_meta(out_dir: str | Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """The JSON metadata of the newest readable step, without touching arrays."""
    import json
    steps = list_steps(out_dir) if step is None else [step]
    for s in sorted(steps, reverse=True):
        path = checkpoint_dir(out_dir) / str(s) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            continue  # damaged: restore() reports it by step when it falls back past it
        if isinstance(meta, dict):
            check_meta(meta, out_dir, s)  # readable but not ours to read: incompatible, not damaged
        if isinstance(meta, dict) and meta.get("step") == s and isinstance(meta.get("config"), dict):
            return s, meta
    raise UserError(damaged_message(out_dir, steps) if steps else describe_missing(out_dir))


def describe_missing(out_dir: str | Path, other: str = "pass --out_dir") -> str:
    """Why `out_dir` has no checkpoint, ending in `other`: what else the user may pass (the flag
    that named the folder, which is not --out_dir for train.py --init_from)."""
    out = Path(out_dir)
    run = _run_above(out)
    if run is not None:  # `train one there` would nest a new run inside it
        return (f"no checkpoint found in {out}/checkpoints: {out} is part of the checkpoints of {run}; pass "
                f"{run} itself, the training output dir that holds checkpoints/")
    if not out.exists():
        there = "it does not exist"
    elif not out.is_dir():
        there = "it is a file, not a folder"
    else:
        names = sorted(p.name for p in out.iterdir())[:8]
        there = f"it holds: {', '.join(names)}" if names else "it is empty"
    if (out / ASIDE).is_dir():  # settle_aside puts it back when train.py next starts there
        return (f"no checkpoint found in {out}/checkpoints: an --overwrite run has not saved yet (it "
                f"stopped, or is still running), and the run it replaced is kept in {out / ASIDE}; once "
                f"that run has ended, `python train.py --out_dir={out} --init_from=resume` puts it back "
                f"and resumes it")
    return (f"no checkpoint found in {out}/checkpoints ({there}); train one with "
            f"`python train.py --out_dir={out}` or {other}")


def _run_above(out: Path) -> Path | None:
    """The training output dir whose checkpoints/ is `out`, or holds it (a step's folder), if any:
    the path a user copies from a listing of the checkpoints."""
    for run in (out.parent, out.parent.parent):
        if list_steps(run) and out.absolute().is_relative_to(checkpoint_dir(run)):
            return run
    return None


_HELD: dict[str, int] = {}  # out_dirs whose lock this process holds: resolved path -> descriptor


class OutDirInUse(UserError):
    """Another run holds out_dir's lock: this one must leave out_dir as it found it."""


def hold_out_dir(out_dir: str | Path) -> None:
    """Take out_dir's exclusive lock (a flock on the folder itself, held until `release_out_dir` or
    exit) for a process that writes checkpoints there, or refuse with one line if another holds it:
    a resume started beside an --overwrite run put the old run back under it (deleting its
    checkpoints dir), and the two then saved into one folder. Re-entrant; nothing to lock if
    out_dir does not exist yet (take it again once made); no lock where flock is unsupported."""
    try:
        import fcntl
    except ImportError:
        return
    key = str(Path(out_dir).resolve())
    if key in _HELD or not Path(key).is_dir():
        return
    fd = os.open(key, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise OutDirInUse(f"--out_dir={out_dir} is in use by another run (train.py or python -m gpt.convert "
                              f"holds its lock); wait for it to end, or pick another --out_dir") from None
        return  # a filesystem without flock (the same errors as gpt/data.py's NO_LOCKS)
    _HELD[key] = fd


def holds_out_dir(out_dir: str | Path) -> bool:
    """Whether this process holds out_dir's lock already (from an earlier `hold_out_dir`): a caller
    that fails must then leave it held, as it did not take it."""
    return str(Path(out_dir).resolve()) in _HELD


def release_out_dir(out_dir: str | Path) -> None:
    fd = _HELD.pop(str(Path(out_dir).resolve()), None)
    if fd is not None:
        os.close(fd)


def remove_all(out_dir: str | Path) -> None:
    shutil.rmtree(checkpoint_dir(out_dir), ignore_errors=True)


ASIDE = ".checkpoints.replaced"  # --overwrite's old checkpoints until the new run has saved one
_OURS = re.compile(r"^\d+(\.damaged(\.\d+)?)?$")


def foreign_entries(out_dir: str | Path) -> list[str]:
    """Names in out_dir/checkpoints that our runs never write (a directory --overwrite must not
    replace: it is not a training output of ours)."""
    d = checkpoint_dir(out_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if not _OURS.match(p.name) and TMP_MARKER not in p.name)


# A run's files beside its checkpoints: its logs, and the tokenizer files sampling reads (a new
# run writes its own before its first save: a failed one had left the old checkpoints unreadable)
RUN_FILES = ("metrics.jsonl", "loss.png", "events.out.tfevents.*", "tokenizer.tiktoken", "tokenizer.json")
ASIDE_LOGS = "logs"  # inside ASIDE: the old run's RUN_FILES
LOGS_MOVED = ".all-moved"  # in ASIDE_LOGS once set_aside has moved every log (a kill may stop it midway)


def _run_files(out: Path) -> list[Path]:
    return [p for pattern in RUN_FILES for p in sorted(out.glob(pattern)) if p.is_file()]


def set_aside(out_dir: str | Path) -> Path | None:
    """--overwrite: move the old checkpoints, and the logs and tokenizer files that go with them,
    aside instead of deleting them; `settle_aside` deletes them once the new run has a checkpoint,
    or puts them back if it has none. A leftover from a run that died first is put back (or
    dropped if that run did save)."""
    out, d = Path(out_dir).absolute(), checkpoint_dir(out_dir)
    aside = out / ASIDE
    settle_aside(out, aside)
    if not d.exists():
        return None
    os.replace(d, aside)
    (aside / ASIDE_LOGS).mkdir()
    for p in _run_files(out):
        os.replace(p, aside / ASIDE_LOGS / p.name)
    (aside / ASIDE_LOGS / LOGS_MOVED).touch()  # every log is aside: the ones in out are the new run's
    return aside


def drop_aside_once_saved(out_dir: str | Path, aside: Path | None) -> Path | None:
    """During a run (process 0): delete --overwrite's old checkpoints as soon as a new step is
    complete on disk (an asynchronous save is listed once it has finished); None once gone."""
    if aside is None or jax.process_index() != 0 or not list_steps(out_dir):
        return aside
    shutil.rmtree(aside, ignore_errors=True)
    return None


def settle_aside(out_dir: str | Path, aside: Path | None) -> None:
    if aside is None or not aside.exists():
        return
    if list_steps(out_dir):
        shutil.rmtree(aside, ignore_errors=True)
        return
    remove_all(out_dir)
    logs = aside / ASIDE_LOGS
    if logs.is_dir():  # the failed run's logs give way to the old run's
        if (logs / LOGS_MOVED).exists():  # else set_aside was cut short: out's logs are the old run's too
            for p in _run_files(Path(out_dir)):
                p.unlink()
        (logs / LOGS_MOVED).unlink(missing_ok=True)
        for p in logs.iterdir():
            os.replace(p, Path(out_dir) / p.name)
        logs.rmdir()
    os.replace(aside, checkpoint_dir(out_dir))


def load_tokenizer_of(out_dir: str | Path, step: int | None = None) -> Any:
    """The tokenizer recorded with `out_dir`'s checkpoints (the same in every step; that of `step`
    where given), checked against the model's vocabulary (and a LoRA run's base to be there), read
    without touching arrays: a caller that tokenizes its input can reject it before loading
    gigabytes of weights."""
    from gpt.config import model_from_dict
    from gpt.tokenizer import load_tokenizer

    if not list_steps(out_dir):
        raise UserError(describe_missing(out_dir))
    _, meta = read_meta(out_dir, step)
    if "tokenizer" not in meta:
        raise UserError(f"the checkpoint in {out_dir} records no tokenizer; re-create it with "
                        f"python -m gpt.convert or python train.py")
    if isinstance(meta.get("lora"), dict):  # a LoRA run's base that is gone is told as early
        from gpt.lora import base_of
        base_of(meta["lora"].get("base"), out_dir)
    tok = load_tokenizer(meta["tokenizer"], out_dir)
    try:
        vocab_size = model_from_dict(meta["config"]["model"]).vocab_size
    except (KeyError, TypeError) as e:
        raise UserError(f"the checkpoint in {out_dir} has no model config ({e}); it is damaged") from None
    if tok.vocab_size > vocab_size:  # its ids would index past the embedding
        raise UserError(f"the tokenizer recorded in {out_dir} has {tok.vocab_size} tokens but the model "
                        f"only {vocab_size}; the checkpoint's metadata is inconsistent, re-create it")
    return tok


def load_model(out_dir: str | Path, dtype: str = "auto", step: int | None = None, tok: Any = None):
    """(model, checkpoint meta, tokenizer) from the newest complete checkpoint of `out_dir`; a LoRA
    run's adapters are merged into its base once, here (`gpt.lora.restore_params`). `tok`: the
    tokenizer already read by `load_tokenizer_of`."""
    from flax import nnx

    from gpt.config import ComputeConfig
    from gpt.lora import restore_params
    from gpt.model import abstract_model
    from gpt.runtime import resolve

    tok = tok or load_tokenizer_of(out_dir, step)
    s, cfg, params, meta = restore_params(out_dir, step)
    graphdef = nnx.graphdef(abstract_model(cfg, runtime=resolve(cfg, ComputeConfig(dtype=dtype))))
    return nnx.merge(graphdef, params), meta, tok
