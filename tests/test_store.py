"""Token store: shards close at document starts, publishing is atomic at every step, meta.json
cannot point outside its store, and version 1 data dirs still load."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import gpt.data as data
import gpt.store as store
from gpt.batches import Batches
from gpt.data import load_meta, prepare
from gpt.errors import UserError
from test_data import SHAKESPEARE, read_bin, tree, write


def test_shard_writer_closes_at_document_starts(tmp_path):
    w = store.ShardWriter(tmp_path, np.uint16, shard_tokens=10)
    w.write("train", 0, np.arange(6), [0, 4])
    w.write("train", 1, np.arange(6), [3])  # 12 tokens: the shard closes at the next job's document start
    w.write("train", 2, np.arange(5), [0])
    w.write("train", 3, np.arange(50), [])  # one long document: cut only past 4x shard_tokens
    w.write("train", 4, np.arange(3), [])
    w.write("val", 5, np.arange(4), [0])
    shards = w.finish(6)
    assert [(s["file"], s["tokens"], s["documents"]) for s in shards["train"]] == \
        [("train-00000.bin", 12, 3), ("train-00001.bin", 55, 1), ("train-00002.bin", 3, 0)]
    assert [s["tokens"] for s in shards["val"]] == [4]
    assert np.fromfile(tmp_path / "train-00000.docs", "<u8").tolist() == [0, 4, 9]
    assert np.fromfile(tmp_path / "train-00000.bin", np.uint16).tolist() == list(range(6)) * 2


def _store(tmp_path: Path, text: str, name: str = "out") -> tuple[Path, dict]:
    src = write(tmp_path / f"{name}.txt", text)
    return tmp_path / name, prepare([src], "char", tmp_path / name)


@pytest.mark.parametrize("fail", ["rename_store", "write_meta", "remove_old"])
def test_publish_is_atomic_at_every_step(tmp_path, monkeypatch, fail):
    """A crash at any step of publishing leaves either the old store or the new one, complete."""
    out, old = _store(tmp_path, SHAKESPEARE[:3000])
    before = tree(out)
    src = write(tmp_path / "new.txt", SHAKESPEARE[3000:9000])
    real_replace, real_rmtree, real_remove_old = os.replace, store.shutil.rmtree, store._remove_old

    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    if fail == "rename_store":
        monkeypatch.setattr(store.os, "replace", lambda a, b: crash() if Path(b).name.startswith("store-")
                            else real_replace(a, b))
    elif fail == "write_meta":
        monkeypatch.setattr(store, "atomic_write_bytes", crash)
    else:
        monkeypatch.setattr(store.shutil, "rmtree", crash)
        with pytest.raises(OSError):  # the commit happened; removing the old store failed
            store._remove_old(out, None, keep="none")
        monkeypatch.setattr(store.shutil, "rmtree", real_rmtree)
        monkeypatch.setattr(store, "_remove_old", lambda *a, **k: None)  # as if killed right after the commit
    if fail == "remove_old":
        new = prepare([src], "char", out)
        assert load_meta(out) == new and read_bin(out, "train").size == new["splits"]["train"]["tokens"]
        assert len(list(out.glob("store-*"))) == 2  # the old one is left over, harmlessly
        monkeypatch.setattr(store, "_remove_old", real_remove_old)
        prepare([src], "char", out, val_fraction=0.2)  # the next publish removes leftovers
        assert len(list(out.glob("store-*"))) == 1
        return
    with pytest.raises(UserError, match="No space left"):
        prepare([src], "char", out)
    assert load_meta(out) == old and tree(out) == before


def test_meta_json_cannot_point_outside_the_store(tmp_path):
    out, meta = _store(tmp_path, SHAKESPEARE[:3000])
    secret = write(tmp_path / "secret.bin", b"\x00" * 8)
    for store_name, shard in [("..", None), ("/tmp", None), (meta["store"], "../../secret.bin"),
                              (meta["store"], str(secret)), (meta["store"], "train-00000.docs")]:
        bad = json.loads(json.dumps(meta))
        bad["store"] = store_name
        if shard:
            bad["shards"]["train"][0]["file"] = shard
        (out / "meta.json").write_text(json.dumps(bad))
        with pytest.raises(UserError, match="not a store dir of ours|not a shard of ours"):
            load_meta(out)
    for field, value in [("tokens", -1), ("tokens", "12"), ("documents", True)]:
        bad = json.loads(json.dumps(meta))
        bad["shards"]["train"][0][field] = value
        (out / "meta.json").write_text(json.dumps(bad))
        with pytest.raises(UserError, match="not a count"):
            load_meta(out)
    (out / "meta.json").write_text(json.dumps({**meta, "format_version": 3}))
    with pytest.raises(UserError, match="update this code"):
        load_meta(out)
    (out / "meta.json").write_text(json.dumps({**meta, "exec": "rm -rf /"}))
    with pytest.raises(UserError, match=r"keys this code never writes \(exec\)"):
        load_meta(out)


def test_version_1_data_dir_still_loads_with_the_same_batches(tmp_path):
    out, meta = _store(tmp_path, SHAKESPEARE[:6000])
    v1 = tmp_path / "v1"
    v1.mkdir()
    for split in ("train", "val"):
        read_bin(out, split).tofile(v1 / f"{split}.bin")
    old = {k: meta[k] for k in ("tokenizer", "vocab_size", "dtype", "sources", "val_fraction")}
    old["splits"] = {s: {k: meta["splits"][s][k] for k in ("tokens", "bytes")} for s in ("train", "val")}
    (v1 / "meta.json").write_text(json.dumps({"format_version": 1, **old}))
    a, b = Batches(out, "train", 16, 8, seed=3), Batches(v1, "train", 16, 8, seed=3)
    for _ in range(3):
        assert all((p == q).all() for p, q in zip(a.next(), b.next()))
    with pytest.raises(UserError, match="no document index"):
        Batches(v1, "train", 16, 8, seed=3, align_documents=True)
    new = prepare([tmp_path / "out.txt"], "char", v1)  # re-preparing a version 1 dir replaces its files
    assert sorted(p.name for p in v1.iterdir()) == ["meta.json", new["store"]]


def test_failed_commit_puts_the_stage_back_and_a_rerun_resumes(tmp_path, monkeypatch):
    src = write(tmp_path / "a.txt", SHAKESPEARE[:3000])
    real = store.atomic_write_bytes
    monkeypatch.setattr(store, "atomic_write_bytes", lambda *a: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(UserError, match="No space"):
        prepare([src], "char", tmp_path / "out")
    assert [p.name.startswith(".prepare-") for p in (tmp_path / "out").iterdir()] == [True]
    monkeypatch.setattr(store, "atomic_write_bytes", real)
    meta = prepare([src], "char", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", meta["store"]]
    assert sorted(p.name for p in (tmp_path / "out" / meta["store"]).iterdir()) == \
        ["train-00000.bin", "train-00000.docs", "val-00000.bin", "val-00000.docs"]


def test_failed_append_commit_moves_the_shards_back_and_a_rerun_appends(tmp_path, monkeypatch):
    """An append whose meta.json cannot be written (a full disk) leaves the store as it was: the
    new shards go back to the stage, so the same command, rerun, appends them (they used to stay
    in the store unlisted, and every rerun refused to overwrite them)."""
    out = tmp_path / "out"
    first = prepare([write(tmp_path / "in/a.txt", SHAKESPEARE[:3000])], "gpt2", out)
    before = sorted(p.name for p in store.files_dir(out, first).iterdir())
    write(tmp_path / "in/b.txt", SHAKESPEARE[3000:6000])
    real = store.atomic_write_bytes
    monkeypatch.setattr(store, "atomic_write_bytes", lambda *a: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(UserError, match="No space"):
        prepare([tmp_path / "in"], None, out, append=True)
    assert load_meta(out) == first and sorted(p.name for p in store.files_dir(out, first).iterdir()) == before
    monkeypatch.setattr(store, "atomic_write_bytes", real)
    meta = prepare([tmp_path / "in"], None, out, append=True)
    assert len(meta["sources"]) == 2 and meta["splits"]["train"]["tokens"] > first["splits"]["train"]["tokens"]


def test_an_append_killed_before_its_commit_is_appended_by_a_rerun(tmp_path):
    """An append killed after moving its shards into the store and before replacing meta.json (no
    clean-up runs) leaves them there unlisted: readers see the old store, but every rerun of the
    append was refused ("appending would overwrite train-00001.bin ...; run the append again"). A
    rerun appends, the same as an append never killed."""
    import subprocess
    import sys

    from test_data import REPO
    out, ref = tmp_path / "out", tmp_path / "ref"
    first = prepare([write(tmp_path / "in/a.txt", SHAKESPEARE[:3000])], "gpt2", out)
    shutil.copytree(out, ref)
    write(tmp_path / "in/b.txt", SHAKESPEARE[3000:6000])
    killed = ("import os, sys; import gpt.store as s; s._write_meta = lambda *a: os._exit(137); "
              "from gpt.data import main; main(sys.argv[1:])")  # a kill at the commit
    r = subprocess.run([sys.executable, "-c", killed, "--input", str(tmp_path / "in"), "--out_dir", str(out),
                        "--append"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 137 and load_meta(out) == first, r.stderr
    assert len(list(store.files_dir(out, first).iterdir())) > len(list(store.files_dir(ref, first).iterdir()))
    meta = prepare([tmp_path / "in"], None, out, append=True)
    want = prepare([tmp_path / "in"], None, ref, append=True)
    assert meta["shards"] == want["shards"] and meta["splits"] == want["splits"]
    assert sorted(p.name for p in store.files_dir(out, meta).iterdir()) == \
        sorted(p.name for p in store.files_dir(ref, want).iterdir())


def test_a_second_prepare_of_one_out_dir_waits_for_the_first(tmp_path):
    """Two preparations into one out_dir (two train.py --input runs of one corpus share its cache)
    run one after the other: the second waits for out_dir's lock, where it used to delete the
    first's staging dir."""
    src = write(tmp_path / "a.txt", SHAKESPEARE[:3000])
    out = tmp_path / "out"
    out.mkdir()
    release = _hold_lock(out)
    second, done = _in_thread(lambda: prepare([src], "char", out))
    second.join(1.0)
    assert second.is_alive() and not done and not (out / "meta.json").exists()  # waiting for the lock
    release.set()
    second.join(60)
    assert done and load_meta(out) == done[0]


def _hold_lock(out: Path):
    """A thread holding out_dir's preparation lock until the returned event is set."""
    import threading
    held, release = threading.Event(), threading.Event()

    def holder():
        with data._one_at_a_time(out):
            held.set()
            release.wait(30)

    threading.Thread(target=holder).start()
    held.wait(30)
    return release


def _in_thread(fn):
    import threading
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def _waiting_on_lock(monkeypatch):
    """An event set when a thread is about to wait for a held preparation lock: the tests act
    while the run is waiting, not before it got that far."""
    import fcntl
    import threading
    waiting, real = threading.Event(), fcntl.flock

    def flock(fd, op):
        waiting.set()
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    return waiting


def test_a_run_that_waited_finds_the_cache_prepared_and_a_removed_folder_is_locked_afresh(tmp_path, monkeypatch):
    """`reuse` (ensure_prepared's cache): a run that waited for another's preparation returns its
    store instead of preparing (and replacing) it again. A folder removed while a run waited (a
    failed first preparation removes the out_dir it made) is made and locked again."""
    src = write(tmp_path / "a.txt", SHAKESPEARE[:3000])
    out = tmp_path / "out"
    first = prepare([src], "char", out)
    release = _hold_lock(out)
    waiting = _waiting_on_lock(monkeypatch)
    t, done = _in_thread(lambda: prepare([src], "char", out, reuse=True))
    assert waiting.wait(60)
    release.set()
    t.join(60)
    assert done == [first]  # the same store: not prepared again
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.undo()
    release = _hold_lock(gone)
    waiting = _waiting_on_lock(monkeypatch)
    t, done = _in_thread(lambda: prepare([src], "char", gone))
    assert waiting.wait(60)
    shutil.rmtree(gone)  # while the lock is held and the second run waits on it
    release.set()
    t.join(60)
    assert done and load_meta(gone) == done[0]


def test_a_folder_removed_between_making_and_opening_it_is_made_again(tmp_path, monkeypatch):
    """_locked makes out_dir, then opens it to lock: a folder removed in between (another run's
    failed preparation cleaning up) is made again, not reported as unwritable."""
    out, real, calls = tmp_path / "out", os.open, []

    def open_(path, *a, **k):
        if Path(path) == out and not calls:
            calls.append(path)
            out.rmdir()
        return real(path, *a, **k)
    monkeypatch.setattr(os, "open", open_)
    with data._one_at_a_time(out):
        assert out.is_dir() and calls


def test_a_filesystem_without_locks_prepares_with_a_note(tmp_path, monkeypatch, capsys):
    """Lustre without -o flock or some NFS mounts refuse flock (ENOSYS, ENOLCK, ...): the
    preparation goes on without the lock, and says so."""
    import errno
    import fcntl
    monkeypatch.setattr(fcntl, "flock", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSYS, "Not supported")))
    meta = prepare([write(tmp_path / "a.txt", SHAKESPEARE[:3000])], "char", tmp_path / "out")
    assert load_meta(tmp_path / "out") == meta and "has no file locks" in capsys.readouterr().err


def test_edited_indexes_cannot_delete_or_hang(tmp_path):
    """A version 1 meta.json naming meta.json as its tokenizer file deletes nothing of ours; an
    unsorted document index is an error, not an endless packing loop."""
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "meta.json").write_text(json.dumps({"format_version": 1, "tokenizer": {"kind": "bpe", "file": "meta.json"}}))
    (v1 / "notes.txt").write_text("mine")
    src = write(tmp_path / "a.txt", SHAKESPEARE[:3000])
    prepare([src], "char", v1)
    assert load_meta(v1) and (v1 / "notes.txt").read_text() == "mine"
    out, meta = _store(tmp_path, "\n".join(SHAKESPEARE[i * 100:(i + 1) * 100] for i in range(40)), "docs")
    docs = store.files_dir(out, meta) / "train-00000.docs"
    docs.write_bytes(np.array([0, 500, 100], "<u8").tobytes())
    bad = json.loads((out / "meta.json").read_text())
    bad["shards"]["train"][0]["documents"] = 3
    (out / "meta.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="not sorted"):
        Batches(out, "train", 16, 4, seed=0, align_documents=True)


def test_a_split_is_mapped_once_while_in_use(tmp_path, monkeypatch):
    """Training's batches and each evaluation's batches of the train split share one mapping of
    its shards, and the document starts are read, not mapped: every mapped file holds a
    descriptor, and a store of a few hundred shards mapped twice ran out of them (limit 1,024)."""
    import gc
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} of some text to fill a few shards"}) + "\n"
                           for i in range(3000)))
    monkeypatch.setattr(data, "CHUNK_BYTES", 1500)  # shards close between chunks of the input
    prepare([src], "char", tmp_path / "d", shard_tokens=20_000)
    a = Batches(tmp_path / "d", "train", 16, 4, seed=0)
    b = Batches(tmp_path / "d", "train", 16, 4, seed=1)
    assert a.tokens is b.tokens and len(a.shards) > 2
    assert all(isinstance(s, np.ndarray) and not isinstance(s, np.memmap) for s in a.tokens.starts)
    key_count = len(store._OPEN)
    del a, b
    gc.collect()
    assert len(store._OPEN) < key_count  # released with its last holder
