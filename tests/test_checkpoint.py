"""gpt/checkpoint.py on its own (tiny pytrees, no training): round trip, retention of the last N
plus the best by val loss, fallback past a damaged step, metadata reads, clear messages.
Crash, signal and full-disk behaviour of whole training runs: tests/test_reliability.py."""
from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt import checkpoint as ckpt
from gpt.errors import UserError

PARAMS = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones((3,), jnp.float32)}
OPT = {"mu": jnp.zeros((2, 3), jnp.float32)}


def meta(step: int) -> dict:
    return {"format_version": ckpt.FORMAT_VERSION, "step": step, "config": {"model": {}}}


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def save_steps(out, losses: dict[int, float | None], keep: int = 2) -> None:
    c = ckpt.Checkpointer(out, keep=keep, async_save=True)
    for step, loss in losses.items():
        scaled = jax.tree.map(lambda a: a * step, PARAMS)
        c.save(step, scaled, OPT, meta(step), val_loss=loss)
    c.close()


def test_round_trip_params_only_and_with_optimizer(tmp_path):
    save_steps(tmp_path, {1: 2.0, 2: 1.5})
    c = ckpt.Checkpointer(tmp_path, read_only=True)
    step, params, opt, m = c.restore(abstract(PARAMS))
    assert step == 2 and opt is None and m["step"] == 2
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(PARAMS["w"]) * 2)
    step, _, opt, _ = c.restore(abstract(PARAMS), abstract(OPT), step=1)
    assert step == 1 and np.asarray(opt["mu"]).shape == (2, 3)


def test_keeps_last_n_and_the_best(tmp_path):
    save_steps(tmp_path, {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: None}, keep=2)
    assert ckpt.list_steps(tmp_path) == [2, 4, 5]  # the best (2) survives the last-2 window


def test_the_best_survives_a_resume(tmp_path):
    """A resumed run's manager reads the earlier steps' val losses back from disk (Orbax wrote
    them only with a best_fn): the best step was deleted at the first save after a resume."""
    save_steps(tmp_path, {1: 1.0, 2: 5.0}, keep=1)
    save_steps(tmp_path, {3: 6.0, 4: 7.0}, keep=1)
    assert ckpt.list_steps(tmp_path) == [1, 4]
    save_steps(tmp_path, {5: 0.5, 6: 2.0}, keep=1)
    assert ckpt.list_steps(tmp_path) == [5, 6]


def test_steps_without_a_readable_val_loss_file_take_their_metas(tmp_path):
    """Orbax's <step>/metrics: steps saved by earlier versions have none (they were never the best
    and were kept for good, past --keep_checkpoints), and a damaged one raised a traceback in
    every command that opened the run. Each step takes the val loss its meta recorded."""
    c = ckpt.Checkpointer(tmp_path, keep=1, async_save=False)
    for step, loss in {1: 3.0, 2: 1.0, 3: 2.0}.items():
        c.save(step, PARAMS, OPT, {**meta(step), "val_loss": loss}, val_loss=loss)
    c.close()
    assert ckpt.list_steps(tmp_path) == [2, 3]
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path) / "3" / "metrics")  # as an earlier version saved it
    (ckpt.checkpoint_dir(tmp_path) / "2" / "metrics" / "metrics").write_text("{torn")
    step, _, _, _ = ckpt.Checkpointer(tmp_path, read_only=True).restore(abstract(PARAMS))
    assert step == 3  # a reader reads no metrics
    save_steps(tmp_path, {4: 5.0, 5: 6.0}, keep=1)
    assert ckpt.list_steps(tmp_path) == [2, 5]  # 2 is still the best: its meta says 1.0


def test_damaged_newest_falls_back_and_is_moved_aside(tmp_path, capsys):
    save_steps(tmp_path, {1: 2.0, 2: 1.5})
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path) / "2" / "params")
    step, params, _, _ = ckpt.Checkpointer(tmp_path).restore(abstract(PARAMS))
    assert step == 1 and "checkpoint step 2 is damaged" in capsys.readouterr().err
    assert ckpt.list_steps(tmp_path) == [1] and (ckpt.checkpoint_dir(tmp_path) / "2.damaged").is_dir()


def test_a_step_deleted_by_a_running_training_is_not_damaged(tmp_path, capsys):
    """sample.py reading a run while it trains: the newest step it listed is deleted by the run's
    retention (after saving a newer one) while it reads. That step was reported damaged and the
    reader fell back to an older one (the best, often hundreds of steps older); it now reads the
    newest step there is, and says nothing."""
    save_steps(tmp_path, {1: 1.0, 2: 2.0}, keep=1)
    reader = ckpt.Checkpointer(tmp_path, read_only=True)
    restore = reader.manager.restore

    def training_saves_meanwhile(step, *a, **k):
        if step == 2 and ckpt.list_steps(tmp_path) == [1, 2]:
            save_steps(tmp_path, {3: 3.0}, keep=1)  # its retention deletes step 2 (1 is the best)
        return restore(step, *a, **k)
    reader.manager.restore = training_saves_meanwhile
    step, params, _, m = reader.restore(abstract(PARAMS))
    assert step == 3 and m["step"] == 3 and "damaged" not in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(PARAMS["w"]) * 3)


def test_every_step_damaged_and_missing_are_one_line(tmp_path):
    save_steps(tmp_path, {1: 2.0})
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path) / "1" / "params")
    with pytest.raises(UserError, match=r"every checkpoint .* is damaged \(steps \[1\]"):
        ckpt.Checkpointer(tmp_path, read_only=True).restore(abstract(PARAMS))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match=r"no checkpoint found .* \(it holds: notes.txt\)"):
        ckpt.read_meta(tmp_path / "other")
    assert "does not exist" in ckpt.describe_missing(tmp_path / "nowhere")


def test_arrays_of_other_shapes_are_not_called_damaged(tmp_path):
    """Arrays that do not fit the model the metadata describes (an edited n_embd, say) are named
    as such, and the message never suggests --overwrite, which would delete intact arrays."""
    out = tmp_path / "run"  # pytest's own folder is named after this test: "shapes" in its path
    save_steps(out, {1: 2.0})
    wider = {"w": jnp.zeros((3, 8), jnp.float32), "b": jnp.zeros((8,), jnp.float32)}
    with pytest.raises(UserError, match="arrays of other shapes than the model") as e:
        ckpt.Checkpointer(out, read_only=True).restore(abstract(wider))
    assert "--overwrite" not in str(e.value) and (ckpt.checkpoint_dir(out) / "1").is_dir()
    fewer = {"w": jnp.zeros((2, 3), jnp.float32)}
    with pytest.raises(UserError, match="arrays of other shapes than the model"):
        ckpt.Checkpointer(out, read_only=True).restore(abstract(fewer))
    # real damage under a path that says "shape" and "tree" is still damage
    damaged = tmp_path / "shapes-street"
    save_steps(damaged, {1: 2.0})
    shutil.rmtree(ckpt.checkpoint_dir(damaged) / "1" / "params")
    with pytest.raises(UserError, match=r"every checkpoint .* is damaged"):
        ckpt.Checkpointer(damaged, read_only=True).restore(abstract(PARAMS))


def test_read_meta_skips_a_step_whose_meta_is_damaged(tmp_path):
    save_steps(tmp_path, {1: 2.0, 2: 1.5})
    for torn in ("{torn", "[" * 100_000 + "]" * 100_000):  # the second: json's RecursionError
        (ckpt.checkpoint_dir(tmp_path) / "2" / "meta" / "metadata").write_text(torn)
        step, m = ckpt.read_meta(tmp_path)
        assert step == 1 and m == json.loads(json.dumps(meta(1)))


@pytest.mark.parametrize("edit, words", [
    ({"format_version": ckpt.FORMAT_VERSION + 1}, "newer version of this code"),
    ({"payload": "x"}, r"metadata keys this code never writes \(payload\)"),
])
def test_intact_but_incompatible_metadata_is_not_called_damaged(tmp_path, edit, words):
    """A readable checkpoint we cannot use (newer format, keys we never write) is named as such,
    never as damaged, and the message never suggests deleting it."""
    save_steps(tmp_path, {1: 2.0})
    path = ckpt.checkpoint_dir(tmp_path) / "1" / "meta" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(UserError, match=words) as e:
        ckpt.read_meta(tmp_path)
    assert "damaged" not in str(e.value) and "--overwrite" not in str(e.value)


def _asyncio_record(exc: BaseException) -> logging.LogRecord:
    """The record asyncio logs for a future whose exception nobody retrieved."""
    return logging.LogRecord("asyncio", logging.ERROR, "asyncio/base_events.py", 1,
                             "Future exception was never retrieved", None,
                             (type(exc), exc, exc.__traceback__))


@pytest.mark.parametrize("message, shown", [
    # a second failed write of an abandoned save, straight from TensorStore (no Python frames)
    ('RESOURCE_EXHAUSTED: Error writing "mu/0.0" in OCDBT database at local file '
     '"/o/checkpoints/4.orbax-checkpoint-tmp/opt_state": No space left on device '
     "[os_error_code='28']", False),
    ('NOT_FOUND: Error writing "mu/0.0": "/o/checkpoints/4.orbax-checkpoint-tmp/d/1"', False),
    ("No space left on device [os_error_code='28'] while writing /elsewhere/file", True),
    ("some unrelated bug", True),
])
def test_asyncio_log_drops_only_failed_checkpoint_writes(message, shown):
    """The save's first failure is reported as one line; its later failed writes, which asyncio
    logs at exit as never retrieved, must not add a traceback after it. Anything else shows."""
    record = _asyncio_record(ValueError(message))
    assert all(f.filter(record) for f in logging.getLogger("asyncio").filters) == shown


def test_asyncio_log_drops_the_other_failed_reads_of_a_reported_step(tmp_path, monkeypatch):
    """restore() reports a damaged step in one line; the step's other reads that fail too reach
    asyncio's "never retrieved" log when collected (even at exit), which must add nothing after it.
    A failed read of another step (not reported) still shows."""
    monkeypatch.setattr(ckpt, "_REPORTED_DAMAGED", set())
    d = ckpt.checkpoint_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "2").mkdir()
    (d / "2" / "meta").mkdir()
    (d / "2" / "meta" / "metadata").write_text("{torn")
    with pytest.raises(UserError, match="is damaged"):
        ckpt.Checkpointer(tmp_path, read_only=True).restore({})
    read = 'OUT_OF_RANGE: Error reading "blocks.w_qkv/0.0" in OCDBT database at local file "{}/{}/params/"'
    shown = lambda step: all(f.filter(_asyncio_record(ValueError(read.format(d.absolute(), step))))
                             for f in logging.getLogger("asyncio").filters)
    assert not shown(2) and shown(20)


def test_odd_out_dirs_are_one_line(tmp_path):
    """sample.py's --out_dir naming a file says so (it raised NotADirectoryError), and a folder in
    checkpoints/ whose name is a digit Python's int() does not take (²) is not a step."""
    from gpt import checkpoint as ck
    f = tmp_path / "run.sh"
    f.write_text("#!/bin/sh\n")
    assert "it is a file, not a folder" in ck.describe_missing(f)
    (tmp_path / "out" / "checkpoints" / "\u00b2").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / "7").mkdir()
    assert ck.list_steps(tmp_path / "out") == [7]
    for inside in ("checkpoints", "checkpoints/7"):  # copied from a listing: named the run's folder, not
        msg = ck.describe_missing(tmp_path / "out" / inside)  # `train one there`, which nests a run in it
        assert f"pass {tmp_path / 'out'} itself" in msg and "train.py" not in msg, msg


def test_overwrite_logs_come_back_even_from_a_set_aside_cut_short(tmp_path):
    """--overwrite moves the old run's logs aside with its checkpoints; a failed run's logs give
    way to them. A kill in the middle of the moves leaves some logs in out: those are the old
    run's too and must stay (they were taken for the failed run's and deleted)."""
    out = tmp_path / "run"
    (out / "checkpoints" / "4").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("old\n")
    (out / "events.out.tfevents.1").write_text("old events")
    (out / "tokenizer.tiktoken").write_text("old ranks")  # the old checkpoints' tokenizer (sha256 recorded)
    aside = ckpt.set_aside(out)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert "the run it replaced is kept in" in ckpt.describe_missing(out)  # sample.py meanwhile
    (out / "metrics.jsonl").write_text("failed run\n")  # a run that stops before its first save
    (out / "tokenizer.tiktoken").write_text("new ranks")
    ckpt.settle_aside(out, aside)
    assert (out / "metrics.jsonl").read_text() == "old\n" and (out / "events.out.tfevents.1").exists()
    assert (out / "tokenizer.tiktoken").read_text() == "old ranks"
    assert ckpt.list_steps(out) == [4] and not aside.exists()
    # killed after moving the checkpoints and one log: the next start puts everything back
    os.replace(out / "checkpoints", aside)
    (aside / ckpt.ASIDE_LOGS).mkdir()
    os.replace(out / "metrics.jsonl", aside / ckpt.ASIDE_LOGS / "metrics.jsonl")
    ckpt.settle_aside(out, aside)
    assert (out / "metrics.jsonl").read_text() == "old\n" and (out / "events.out.tfevents.1").read_text() == "old events"
    assert ckpt.list_steps(out) == [4] and not aside.exists()
