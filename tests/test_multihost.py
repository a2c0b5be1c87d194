"""Multi-host jobs on one machine: two `train.py` processes with four CPU devices each, joined by
`jax.distributed` (gloo collectives on CPU), must train exactly like one process with eight devices;
a coordinator that cannot be reached gives a one-line error within the timeout."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gpt.runtime import CPU_BF16_ENV
from helpers import xla_flags

REPO = Path(__file__).resolve().parent.parent
STEPS = 4
COMMON = ["--preset=tiny", "--batch_size=8", f"--max_iters={STEPS}", "--log_interval=1",
          f"--eval_interval={STEPS}", "--eval_iters=1", "--progress=false", "--seed=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with(devices: int, **extra) -> dict:
    return dict(os.environ, XLA_FLAGS=xla_flags(devices),
                JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)


def start(args: list[str], devices: int, **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=env_with(devices, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Wait for all (killing every one if any runs past the deadline); (returncode, output) each."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out + err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[1][-3000:] for p in procs]
        pytest.fail(f"processes still running after {timeout}s:\n" + "\n---\n".join(outs))
    return results


def train_losses(out_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["loss"]) for r in recs if r.get("kind") == "train"]


# a fragment may also end a line mid-message ("5 is connected to ") and the next begin with the rest
GLOO = re.compile(r"\[Gloo\] Rank |\d*\s*is connected to( \d+( peer ranks\.)?)?\s*|\d*\s*peer ranks\.|"
                  r"\s*Expected number of connected peer ranks is : \d+")


def our_lines(output: str) -> list[str]:
    """What the program printed, without gloo's connection messages. Its threads may write them in
    fragments that interleave ("[Gloo] Rank [Gloo] Rank 6[Gloo] Rank 5 is connected to 7 peer
    ranks.  is connected to ..."), so each fragment goes, and what is left of a line is dropped
    if only rank digits remain."""
    return [ln for ln in (GLOO.sub("", line) for line in output.splitlines())
            if ln.strip() and not ln.replace(" ", "").isdigit()]


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_eight_devices(char_data, tmp_path):
    """A MoE model with dropout and two accumulated micro-batches: each micro-batch must hold the
    same rows on two processes as on one (the load-balancing loss is a per-micro-batch product)."""
    port = free_port()
    multi, single = tmp_path / "multi", tmp_path / "single"
    data = [f"--data_dir={char_data}", "--n_expert=4", "--gradient_accumulation_steps=2", "--dropout=0.1"]
    # --overwrite: the out_dir set-up (process 0) is followed by a barrier every process must reach.
    procs = [start([*COMMON, *data, f"--out_dir={multi}", "--overwrite", "--distributed", "--mesh=data:8",
                    f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                    f"--process_id={i}"], devices=4, GPT_DISTRIBUTED_TIMEOUT="120")
             for i in (0, 1)]
    (rc0, out0), (rc1, out1) = finish(procs, timeout=400)
    assert rc0 == 0 and rc1 == 0, f"process 0:\n{out0[-3000:]}\nprocess 1:\n{out1[-3000:]}"
    (rc, out), = finish([start([*COMMON, *data, f"--out_dir={single}", "--mesh=data:8"], devices=8)],
                        timeout=300)
    assert rc == 0, out[-3000:]

    got, want = train_losses(multi), train_losses(single)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)) == [s for s, _ in want]
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: two processes {a}, one process {b}"

    # Only process 0 talks and writes metrics/plots; both wrote the checkpoint together.
    assert any("mesh {'data': 8" in ln for ln in our_lines(out0))
    assert any(ln.startswith("done: step") for ln in our_lines(out0))
    assert our_lines(out1) == [], out1[-2000:]
    assert (multi / "metrics.jsonl").is_file() and (multi / "loss.png").is_file()
    step_dir = multi / "checkpoints" / str(STEPS)
    assert (step_dir / "params").is_dir() and (step_dir / "opt_state").is_dir()

    # The two-process checkpoint holds what the single process computed (same mesh, same math; Adam
    # turns rounding-level gradient differences of near-zero entries into ~1e-7 absolute ones).
    from gpt import checkpoint as ckpt
    a_model, a_meta, _ = ckpt.load_model(multi)
    b_model, b_meta, _ = ckpt.load_model(single)
    from flax import nnx
    a, b = nnx.to_pure_dict(nnx.state(a_model)), nnx.to_pure_dict(nnx.state(b_model))
    import jax
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert a_meta["step"] == b_meta["step"] == STEPS


def test_unreachable_coordinator_fails_in_bounded_time(char_data, tmp_path):
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    (rc, out), = finish([start([*COMMON, f"--data_dir={char_data}", f"--out_dir={tmp_path}",
                                "--distributed", f"--coordinator_address=127.0.0.1:{port}",
                                "--num_processes=2", "--process_id=1"], devices=4,
                               GPT_DISTRIBUTED_TIMEOUT="3")], timeout=90)
    elapsed = time.monotonic() - t0
    lines = our_lines(out)
    assert rc == 2 and len(lines) == 1, out[-3000:]
    assert lines[0].startswith("error: could not join the distributed job at 127.0.0.1:")
    assert "within 3s" in lines[0] and "Traceback" not in out
    assert elapsed < 60


@pytest.mark.parametrize("args, words", [
    (["--num_processes=2", "--process_id=0", "--distributed"], "need --coordinator_address"),
    (["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2"],
     "--process_id=2 must be in [0, 2)"),
    (["--coordinator_address=127.0.0.1:1"], "needs --num_processes=N (at least 1) and --process_id=I"),
    # alone, they trained a run of their own into what may be the job's shared out_dir
    (["--num_processes=2", "--process_id=1"], "need --coordinator_address"),
    # jax's coordination service segfaulted on the port
    (["--coordinator_address=127.0.0.1:abc", "--num_processes=2", "--process_id=0"], "must be HOST:PORT"),
])
def test_bad_distributed_flags(char_data, tmp_path, args, words):
    (rc, out), = finish([start([*COMMON, f"--data_dir={char_data}", f"--out_dir={tmp_path}", *args],
                               devices=1)], timeout=60)
    lines = our_lines(out)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), out[-2000:]
    assert words in lines[0]


@pytest.mark.slow
def test_only_process_0_prepares_the_input(tmp_path):
    """Two processes given the same --input: process 0 prepares it into the shared cache while
    process 1 waits, then both train on it; if process 0's preparation fails, both stop with
    one line."""
    text = (REPO / "data" / "shakespeare.txt").read_text()[:40_000]
    (tmp_path / "corpus.txt").write_text(text)
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\n" * 100)
    for name, want_rc in [("corpus.txt", 0), ("bad.txt", 2)]:
        port = free_port()
        procs = [start([*COMMON, f"--input={tmp_path / name}", f"--out_dir={tmp_path / ('out_' + name)}",
                        "--distributed", "--mesh=data:8", f"--coordinator_address=127.0.0.1:{port}",
                        "--num_processes=2", f"--process_id={i}"], devices=4,
                       GPT_DISTRIBUTED_TIMEOUT="120", GPT_DATA_CACHE=str(tmp_path / "cache"))
                 for i in (0, 1)]
        (rc0, out0), (rc1, out1) = finish(procs, timeout=400)
        assert rc0 == rc1 == want_rc, f"process 0:\n{out0[-3000:]}\nprocess 1:\n{out1[-3000:]}"
        if want_rc == 0:
            assert sum(ln.startswith("preparing ") for ln in our_lines(out0)) == 1 and our_lines(out1) == []
        else:
            assert "not valid UTF-8" in our_lines(out0)[-1] and "Traceback" not in out0 + out1
            assert our_lines(out1) == ["error: process(es) 0 stopped at start-up (their own error says why); "
                                       "fix that and start every process again"]
    assert len(list((tmp_path / "cache").iterdir())) == 1


@pytest.mark.slow
@pytest.mark.parametrize("what", ["settings", "out_dir", "compute"])
def test_processes_that_disagree_stop_with_one_line(char_data, tmp_path, what):
    """A process with another setting, another (unshared) out_dir, or a host where --dtype=auto
    resolves otherwise (one CPU with native bf16, one without) is found at start-up: every process
    prints the same line and exits 2, nothing hangs and nothing is deleted."""
    port = free_port()
    args = [[*COMMON, f"--data_dir={char_data}", "--distributed", "--mesh=data:8",
             f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
             f"--out_dir={tmp_path / ('out1' if what == 'out_dir' and i else 'out0')}"] for i in (0, 1)]
    if what == "settings":
        args[1].append("--learning_rate=3e-4")
    bf16 = [{CPU_BF16_ENV: flag} if what == "compute" else {} for flag in ("1", "0")]
    procs = [start(a, devices=4, GPT_DISTRIBUTED_TIMEOUT="120", **env) for a, env in zip(args, bf16)]
    results = finish(procs, timeout=300)
    lines = [our_lines(out) for _, out in results]
    assert [rc for rc, _ in results] == [2, 2], lines
    name = {"settings": "settings", "out_dir": "out_dir", "compute": "compute as resolved"}[what]
    for (_, out), ls in zip(results, lines):  # (gloo's connection messages may come in fragments)
        errors = [ln for ln in ls if ln.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: process(es) 1 disagree with process 0 on {name}")
        assert "Traceback" not in out, ls
    assert not (tmp_path / "out0" / ".gpt-process0-token").exists()


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_step(char_data, tmp_path):
    """A signal reaches one process of the job: all stop after the same step, save it together
    and exit 0; the checkpoint is complete."""
    port = free_port()
    out = tmp_path / "out"
    procs = [start([*COMMON, f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=400", "--distributed",
                    "--mesh=data:8", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                    f"--process_id={i}"], devices=4, GPT_DISTRIBUTED_TIMEOUT="120") for i in (0, 1)]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(train_losses(out) if (out / "metrics.jsonl").exists() else []) < 3:
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    (rc0, out0), (rc1, out1) = finish(procs, timeout=300)
    assert rc0 == rc1 == 0, f"process 0:\n{out0[-3000:]}\nprocess 1:\n{out1[-3000:]}"
    saved = [ln for ln in our_lines(out0) if "saved step" in ln]
    assert len(saved) == 1 and "received SIGTERM" in saved[0], out0[-2000:]
    step = int(saved[0].split("saved step ")[1].split(";")[0])
    from gpt import checkpoint as ckpt
    assert 3 <= step < 400 and ckpt.list_steps(out)[-1] == step


FAIL_MID_RUN = '''"""train.py, failing mid-run: the FAIL_AT-th metrics write meets a full disk ("disk", process 0
writes them) or the FAIL_AT-th step's metrics raise a bug ("bug")."""
import errno, os, runpy, sys
from gpt import metrics, train
kind, at, count = os.environ["FAIL_KIND"], int(os.environ["FAIL_AT"]), [0]
patched, name = (metrics.MetricsLog, "write") if kind == "disk" else (train, "host_metrics")
original = getattr(patched, name)
def failing(*args):
    count[0] += 1
    if count[0] == at:
        if kind == "disk":
            raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")
        raise RuntimeError("injected bug")
    return original(*args)
setattr(patched, name, failing)
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
'''


@pytest.mark.parametrize("kind", ["disk", pytest.param("bug", marks=pytest.mark.slow)])
def test_a_process_failing_mid_run_stops_the_others_at_once(char_data, tmp_path, kind):
    """One process stops with an error mid-run (process 0's disk fills while writing metrics; a bug
    on process 1): it prints its error, every other process prints one line naming it and exits
    with the same status within seconds, not after jax's 5-minute exit barrier and C++ aborts;
    the checkpoint saved before is complete."""
    script = tmp_path / "fail_mid_run.py"
    script.write_text(FAIL_MID_RUN)
    port, out = free_port(), tmp_path / "out"
    failing = 0 if kind == "disk" else 1
    procs = []
    for i in (0, 1):
        args = [*COMMON, f"--data_dir={char_data}", f"--out_dir={out}", "--max_iters=1000", "--log_interval=2",
                "--eval_interval=4", "--distributed", "--mesh=data:8", f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2", f"--process_id={i}"]
        cmd = [sys.executable, str(script) if i == failing else "train.py", *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env_with(4, GPT_DISTRIBUTED_TIMEOUT="120", PYTHONPATH=str(REPO),
                                                   FAIL_KIND=kind, FAIL_AT="4")))
    t0 = time.monotonic()
    results = finish(procs, timeout=240)
    status = 2 if kind == "disk" else 1
    assert [rc for rc, _ in results] == [status, status], results
    assert time.monotonic() - t0 < 150
    (_, mine), (_, other) = results[failing], results[1 - failing]
    want = ("No space left on device while writing metrics.jsonl" if kind == "disk"
            else "RuntimeError: injected bug")
    assert want in our_lines(mine)[-1] and (("Traceback" in mine) == (kind == "bug")), mine[-2000:]
    errors = [ln for ln in our_lines(other) if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == our_lines(other)[-1], other[-2000:]
    assert errors[0].startswith(f"error: process {failing} stopped ({want}")
    assert errors[0].endswith("); this process stops too")
    assert "Traceback" not in other and "Check failure" not in mine + other
    from gpt import checkpoint as ckpt
    assert ckpt.list_steps(out) == [4]
    # Process 0's TensorBoard events (buffered for 30 s) were written out whichever process failed.
    assert [f.stat().st_size > 0 for f in out.glob("events.out.tfevents.*")] == [True]
