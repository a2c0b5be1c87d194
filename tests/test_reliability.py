"""Fault injection: kill -9 (also mid-save), SIGTERM/SIGINT, damaged checkpoints and a full disk.

Each test states one promise of RELIABILITY.md. Training runs are real `python train.py`
subprocesses (tiny preset, CPU) where the fault is about the process, and in-process `train()`
calls where it is about the files. Exactness is checked against one uninterrupted reference run:
the per-step train losses in metrics.jsonl, the final evaluation and the final parameters must be
bit-identical.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, ci_first, xla_flags
from gpt import checkpoint as ckpt
from gpt.errors import UserError

N = 100  # steps of the kill -9 runs (room for 30 kills); checkpoints every 2 steps, one evaluation at the end
N_SHORT = 40  # steps of the signal and full-disk runs (CI runs these; margin for the signal)
ARGS = ["--preset=tiny", "--no_progress", "--log_interval=1", "--ckpt_interval=2",
        "--dropout=0.1"]  # dropout: the RNG must resume too
TMP = ckpt.TMP_MARKER


# ----------------------------------------------------------------------------- helpers


def _env() -> dict[str, str]:
    """The training subprocesses' environment (with tests/conftest.py's session-wide XLA cache,
    the restarts skip compiling)."""
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                XLA_FLAGS=xla_flags())  # one CPU device, like the reference run


def start(out: Path, data: Path, *extra: str, script: str = "train.py",
          steps: int = N) -> tuple[subprocess.Popen, Path]:
    """A training subprocess of `steps` steps; its stderr goes to a numbered log file next to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    n = len(list(out.parent.glob(f"{out.name}.*.log")))
    log = out.parent / f"{out.name}.{n}.log"
    cmd = [sys.executable, script, *ARGS, f"--max_iters={steps}", f"--eval_interval={steps}",
           f"--out_dir={out}", f"--data_dir={data}", *extra]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f, env=_env())
    return p, log


def finish(p: subprocess.Popen, log: Path, timeout: float = 240) -> str:
    p.wait(timeout=timeout)
    return log.read_text()


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    recs = []
    for ln in path.read_text().splitlines():
        try:
            recs.append(json.loads(ln))
        except ValueError:
            pass  # a line being written right now
    return recs


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if r["kind"] == "train"}


def last_step(out: Path) -> int:
    return max(train_losses(out), default=0)


def final_params(out: Path) -> tuple[int, dict[str, np.ndarray]]:
    import jax
    from flax import nnx
    model, meta, _ = ckpt.load_model(out, "float32")
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
    return meta["step"], {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def tmp_dirs(out: Path) -> list[str]:
    d = ckpt.checkpoint_dir(out)
    return sorted(p.name for p in d.iterdir() if TMP in p.name) if d.is_dir() else []


def wait_for(pred, p: subprocess.Popen, timeout: float, poll: float = 0.002) -> bool:
    """Poll `pred` until it holds (True), or the process exits or time runs out (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if p.poll() is not None:
            return False
        time.sleep(poll)
    return False


def assert_same_as_reference(out: Path, ref: Path, steps: int = N) -> None:
    got, want = train_losses(out), train_losses(ref)
    assert sorted(got) == list(range(1, steps + 1)), sorted(got)
    assert got == want, {s: (got[s], want[s]) for s in want if got.get(s) != want[s]}
    ev = [r for r in records(out) if r["kind"] == "eval"]
    ev_ref = [r for r in records(ref) if r["kind"] == "eval"]
    assert [(e["step"], e["val_loss"]) for e in ev] == [(e["step"], e["val_loss"]) for e in ev_ref]
    s1, p1 = final_params(out)
    s2, p2 = final_params(ref)
    assert s1 == s2 == steps
    assert p1.keys() == p2.keys()
    for k in p1:
        assert np.array_equal(p1[k], p2[k]), k  # bit-identical


class References:
    """The uninterrupted runs, one per length, each started once in the background (the short one
    at once, for CI's tests) and awaited when first needed."""

    def __init__(self, root: Path, data: Path):
        self.root, self.data, self.runs = root, data, {}
        self.start(N_SHORT)

    def start(self, steps: int) -> None:
        if steps not in self.runs:
            out = self.root / str(steps) / "o"
            self.runs[steps] = (out, *start(out, self.data, steps=steps))

    def get(self, steps: int = N) -> Path:
        self.start(steps)
        out, p, log = self.runs[steps]
        err = finish(p, log)
        assert p.returncode == 0, err
        return out

    def kill(self) -> None:
        for _, p, _ in self.runs.values():
            if p.poll() is None:
                p.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, char_data) -> References:
    refs = References(tmp_path_factory.mktemp("reference"), char_data)
    yield refs
    refs.kill()


# ----------------------------------------------------------------------------- kill -9


def _kill_loop(out: Path, data: Path, n_kills: int, seed: int) -> dict[str, int]:
    """Start, kill -9 at a random moment, resume, ... n_kills times; then let it finish."""
    rng = random.Random(seed)
    stats = {"kills": 0, "mid_save": 0, "early": 0, "progress": 0, "torn_saves_left": 0}
    resumed_from: list[int] = []
    while stats["kills"] < n_kills:
        before = ckpt.list_steps(out)
        extra = ["--init_from=resume"] if before else []
        p, log = start(out, data, *extra)
        newest = max(before, default=0)
        mode = ("early", "mid_save", "progress")[stats["kills"] % 3]
        if mode == "early":  # anywhere in start-up: imports, restore, tmp clean-up, first steps
            time.sleep(rng.uniform(0.3, 3.0))
            hit = p.poll() is None
        elif mode == "mid_save":  # while Orbax writes a new step's temporary directory
            skip = rng.randint(0, 1)  # sometimes let a save complete first

            def saving():
                fresh = [t for t in tmp_dirs(out) if int(t.split(".")[0]) > newest]
                return len(fresh) > 0 and max(int(t.split(".")[0]) for t in fresh) > newest + 2 * skip
            hit = wait_for(saving, p, timeout=60)
            time.sleep(rng.uniform(0, 0.02))
        else:  # at a random step, wherever in the step the process happens to be
            target = newest + rng.randint(1, 5)
            hit = wait_for(lambda: last_step(out) >= target, p, timeout=60)
            time.sleep(rng.uniform(0, 0.05))
        if p.poll() is not None:
            err = log.read_text()
            pytest.fail(f"run ended before the kill ({mode}, rc {p.returncode}): {err[-2000:]}")
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        stats["kills"] += 1
        stats[mode] += int(hit)
        stats["torn_saves_left"] += int(bool([t for t in tmp_dirs(out) if int(t.split(".")[0]) > newest]))
        err = log.read_text()
        assert "damaged" not in err and "Traceback" not in err, err
        if before and "resuming from step" in err:
            got = int(err.split("resuming from step ")[1].split()[0])
            assert got == newest, (got, before, err)  # the newest complete step, never a tmp dir
            resumed_from.append(got)
    assert resumed_from == sorted(resumed_from)  # progress never goes backwards
    # On a loaded machine every kill may come before the first save: then the run starts afresh.
    p, log = start(out, data, *(["--init_from=resume"] if ckpt.list_steps(out) else []))
    err = finish(p, log)
    assert p.returncode == 0, err
    assert "damaged" not in err, err
    assert tmp_dirs(out) == []  # leftovers of killed saves are cleaned up, never restored
    return stats


@pytest.mark.slow  # 50 s; the signal, full-disk and damaged-checkpoint tests cover resume in CI
def test_kill9_at_random_moments_resumes_exactly(tmp_path, char_data, reference):
    """6 kill -9s (start-up, mid-save, mid-step); the resumed run equals the uninterrupted one
    (30 of them in the slow test below)."""
    stats = _kill_loop(tmp_path / "o", char_data, n_kills=6, seed=1234)
    print(stats)
    assert stats["mid_save"] >= 1, stats
    assert_same_as_reference(tmp_path / "o", reference.get())


@pytest.mark.slow
def test_kill9_many_times_resumes_exactly(tmp_path, char_data, reference):
    stats = _kill_loop(tmp_path / "o", char_data, n_kills=30, seed=98765)
    print(stats)
    assert stats["mid_save"] >= 6 and stats["torn_saves_left"] >= 1, stats
    assert_same_as_reference(tmp_path / "o", reference.get())


# ----------------------------------------------------------------------------- SIGTERM / SIGINT


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_saves_within_one_step_exits_zero_and_resumes_exactly(tmp_path, char_data, reference, sig):
    """A signal finishes the step, saves (printing "saved" once it is on disk) and exits 0."""
    out = tmp_path / "o"
    p, log = start(out, char_data, steps=N_SHORT)
    assert wait_for(lambda: last_step(out) >= 5, p, timeout=120), log.read_text()
    p.send_signal(sig)
    t0 = time.monotonic()
    err = finish(p, log, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 0, err
    assert f"received {sig.name}" in err and "Traceback" not in err, err
    steps = ckpt.list_steps(out)
    stopped = last_step(out)
    assert steps and steps[-1] == stopped < N_SHORT, (steps, stopped)  # saved the step it was in, no more
    assert took < 60, took
    p, log = start(out, char_data, "--init_from=resume", steps=N_SHORT)
    err = finish(p, log)
    assert p.returncode == 0 and f"resuming from step {stopped}" in err, err
    assert_same_as_reference(out, reference.get(N_SHORT), N_SHORT)


def test_second_signal_is_reported_and_third_aborts(capsys):
    """Schedulers repeat SIGTERM: the second signal must not cut the final save short (it is
    reported), the third aborts at once."""
    from gpt.train import StopFlag
    flag = StopFlag()
    try:
        flag._handle(signal.SIGTERM, None)
        assert flag.signal == signal.SIGTERM and flag.agreed()
        flag._handle(signal.SIGINT, None)  # no exception: the save goes on
        assert "received SIGINT again: finishing the save first" in capsys.readouterr().err
        assert flag.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            flag._handle(signal.SIGTERM, None)
    finally:
        flag.restore()


# ----------------------------------------------------------------------------- damaged checkpoints


from test_train import run as run_inproc  # noqa: E402


SHORT = ["--max_iters=8", "--ckpt_interval=2", "--eval_interval=8", "--keep_checkpoints=3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, char_data):
    """An uninterrupted 8-step run (checkpoints 4, 6, 8 kept) and its per-step losses."""
    out = tmp_path_factory.mktemp("trained") / "o"
    summary = run_inproc(out, char_data, *SHORT)
    assert ckpt.list_steps(out) == [4, 6, 8]
    return out, dict(summary["train_losses"])


def _data_files(step_dir: Path, item: str) -> list[Path]:
    return sorted((p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: -p.stat().st_size)


def damage(out: Path, step: int, how: str) -> int:
    """Damage a step; returns the step number that is now damaged."""
    d = ckpt.checkpoint_dir(out) / str(step)
    if how == "truncate_array":
        f = _data_files(d, "params")[0]
        os.truncate(f, f.stat().st_size // 2)
    elif how == "delete_array":
        _data_files(d, "opt_state")[0].unlink()
    elif how == "delete_manifest":
        (d / "params" / "manifest.ocdbt").unlink()
    elif how == "truncate_meta":
        os.truncate(d / "meta" / "metadata", 10)
    elif how == "torn_newer_step":  # a step directory that is only half there
        torn = ckpt.checkpoint_dir(out) / str(step + 2)
        shutil.copytree(d, torn)
        for f in _data_files(torn, "params")[::2]:
            f.unlink()
        return step + 2
    else:
        raise ValueError(how)
    return step


# CI: a damaged array and a torn newer step (the other kinds take the same fall-back path)
@pytest.mark.parametrize("how", ci_first(["truncate_array", "delete_array", "delete_manifest", "truncate_meta",
                                          "torn_newer_step"], {"truncate_array", "torn_newer_step"}))
def test_damaged_newest_checkpoint_falls_back_with_warning(tmp_path, char_data, trained, capsys, how):
    src, want = trained
    out = tmp_path / "o"
    shutil.copytree(src, out)
    bad = damage(out, 8, how)
    previous = 6 if bad == 8 else 8
    capsys.readouterr()
    summary = run_inproc(out, char_data, *SHORT, "--init_from=resume", "--max_iters=10")
    err = capsys.readouterr().err
    assert f"warning: checkpoint step {bad} is damaged" in err, err
    assert f"falling back to step {previous}" in err and f"resuming from step {previous}" in err, err
    assert summary["start_step"] == previous  # never silently from step 0
    # The damaged step was moved aside, and the run saved good steps past it.
    assert (ckpt.checkpoint_dir(out) / f"{bad}.damaged").is_dir()
    assert ckpt.list_steps(out)[-1] == 10
    got = dict(summary["train_losses"])
    for s in range(previous + 1, 9):
        assert got[s] == want[s], (s, got[s], want[s])  # exact after the fallback


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path, char_data, trained):
    src, _ = trained
    out = tmp_path / "o"
    shutil.copytree(src, out)
    for s in ckpt.list_steps(out):
        damage(out, s, "truncate_array")
    with pytest.raises(UserError, match=r"every checkpoint in .* is damaged \(steps \[4, 6, 8\]; newest: "):
        run_inproc(out, char_data, *SHORT, "--init_from=resume", "--max_iters=10")
    assert ckpt.list_steps(out) == [4, 6, 8]  # nothing moved or deleted when nothing restores


def test_signal_while_a_step_is_read_stops_and_damages_nothing(tmp_path, char_data, trained, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) arriving while Orbax reads the newest step, which wraps it in a
    plain Exception: the run stops there, and the intact step is neither moved aside as damaged
    nor fallen back from (the interrupt was lost and training went on from an older step)."""
    from orbax.checkpoint._src.serialization import serialization
    src, _ = trained
    out = tmp_path / "o"
    shutil.copytree(src, out)

    read, calls = serialization._read_shard, []

    async def signalled(**kw):  # the signal arrives once, during the first read
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return await read(**kw)
    monkeypatch.setattr(serialization, "_read_shard", signalled)
    with pytest.raises(KeyboardInterrupt):
        run_inproc(out, char_data, *SHORT, "--init_from=resume", "--max_iters=10")
    assert sorted(p.name for p in ckpt.checkpoint_dir(out).iterdir()) == ["4", "6", "8"]


def test_load_model_of_a_step_reads_that_steps_metadata_only(tmp_path, trained):
    """load_model(step=s) reads the tokenizer of step s, as it reads its arrays: a newer step it
    was not asked for (here one a newer version of the code wrote) is not read."""
    src, _ = trained
    out = tmp_path / "o"
    shutil.copytree(src, out)
    path = ckpt.checkpoint_dir(out) / "8" / "meta" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": ckpt.FORMAT_VERSION + 1}))
    with pytest.raises(UserError, match="written by a newer version"):
        ckpt.load_model(out, "float32")
    _, meta, tok = ckpt.load_model(out, "float32", step=6)
    assert meta["step"] == 6 and tok.decode(tok.encode("ROMEO:")) == "ROMEO:"


# ----------------------------------------------------------------------------- full disk

_INJECT = '''
import errno, os, runpy, sys
sys.path.insert(0, os.getcwd())  # the repository (the subprocess runs there)
from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh
orig = jh.JsonCheckpointHandler._save_fn
async def full_disk(self, x, directory):  # the disk fills up while step FAIL_STEP is written
    if x.get("step") == int(os.environ["FAIL_STEP"]):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))
    return await orig(self, x, directory)
jh.JsonCheckpointHandler._save_fn = full_disk
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
'''


def _one_error_line(err: str) -> str:
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err and "ERROR:absl" not in err and "Exception" not in err, err
    assert err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


def test_disk_full_during_async_save_is_one_line_and_keeps_previous(tmp_path, char_data, reference):
    """The write error of step 4 surfaces at the next save as one line; step 2 stays restorable."""
    wrapper = tmp_path / "inject.py"
    wrapper.write_text(_INJECT)
    out = tmp_path / "o"
    os.environ["FAIL_STEP"] = "4"
    try:
        p, log = start(out, char_data, script=str(wrapper), steps=N_SHORT)
    finally:
        del os.environ["FAIL_STEP"]
    err = finish(p, log)
    assert p.returncode == 2, err
    line = _one_error_line(err)
    assert "could not write checkpoint step 4" in line and "No space left on device" in line, line
    assert "free space" in line and "steps [2]" in line, line
    assert ckpt.list_steps(out) == [2]  # the failed step's tmp dir is removed, now or at the next start
    p, log = start(out, char_data, "--init_from=resume", steps=N_SHORT)
    err = finish(p, log)
    assert p.returncode == 0 and "resuming from step 2" in err, err
    assert tmp_dirs(out) == []
    assert_same_as_reference(out, reference.get(N_SHORT), N_SHORT)


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.slow  # 21 s; the simulated full disk above covers the same path in CI
def test_real_full_disk_tmpfs(tmp_path, char_data, reference):
    """A real ENOSPC from TensorStore on a small tmpfs (skipped where tmpfs cannot be mounted)."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root and mount rights)")
    try:
        out = disk / "o"
        out.mkdir()
        free = shutil.disk_usage(disk).free
        ballast = disk / "ballast"
        with open(ballast, "wb") as f:  # leave room for about one checkpoint (~0.5 MB) only
            f.write(b"\0" * (free - 800_000))
        p, log = start(out, char_data)
        err = finish(p, log)
        assert p.returncode == 2, err
        line = _one_error_line(err)
        assert "No space left on device" in line, line
        steps = ckpt.list_steps(out)
        assert steps and steps[-1] < N, steps
        ballast.unlink()
        p, log = start(out, char_data, "--init_from=resume")
        err = finish(p, log)
        assert p.returncode == 0 and f"resuming from step {steps[-1]}" in err, err
        assert "damaged" not in err, err
        assert_same_as_reference(out, reference.get())
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
