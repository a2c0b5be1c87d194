"""Batches: shifted windows across shards, exact loader state, process slices, document-aligned rows."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gpt.batches import Batches
from gpt.data import prepare
from gpt.errors import UserError
from test_data import SHAKESPEARE, read_bin, write


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("char")
    src = write(d / "src" / "input.txt", SHAKESPEARE[:20_000])
    prepare([src], "char", d / "out", val_fraction=0.1)
    return d / "out"


def test_batches_are_shifted_windows(char_dir):
    b = Batches(char_dir, "train", block_size=32, batch_size=6, seed=3)
    mm = read_bin(char_dir, "train")
    offsets = b.offsets(0)
    x, y = b.next()
    assert x.shape == y.shape == (6, 32) and x.dtype == y.dtype == np.int32
    for row, o in enumerate(offsets):
        assert (x[row] == mm[o:o + 32]).all() and (y[row] == mm[o + 1:o + 33]).all()
    assert b.state() == {"seed": 3, "index": 1}


def test_batch_offsets_stay_in_range(tmp_path):
    src = write(tmp_path / "a.txt", "abcdefghij" * 2)
    prepare([src], "char", tmp_path / "out", val_fraction=0.5)  # 10 tokens per split
    b = Batches(tmp_path / "out", "val", block_size=9, batch_size=16, seed=0)
    x, y = b.next()  # n_tokens == block_size + 1: the only window starts at 0
    assert (x == x[0]).all() and (y[:, :-1] == x[:, 1:]).all()
    b = Batches(tmp_path / "out", "train", block_size=5, batch_size=64, seed=0)
    assert {int(o) for i in range(20) for o in b.offsets(i)} == set(range(5))  # 0 .. n - block_size - 1
    with pytest.raises(UserError, match="at least 11"):
        Batches(tmp_path / "out", "train", block_size=10, batch_size=1, seed=0)


def test_state_round_trip(char_dir):
    a = Batches(char_dir, "train", 16, 4, seed=7)
    for _ in range(3):
        a.next()
    state = json.loads(json.dumps(a.state()))
    want = [a.next() for _ in range(2)]
    b = Batches(char_dir, "train", 16, 4, seed=0)
    b.restore(state)
    for (x1, y1), (x2, y2) in zip(want, [b.next() for _ in range(2)]):
        assert (x1 == x2).all() and (y1 == y2).all()
    with pytest.raises(UserError, match="malformed"):
        b.restore({"index": 1})


def test_process_slices_partition_the_global_batch(char_dir):
    single = [Batches(char_dir, "train", 16, 8, seed=1).next() for _ in range(1)][0]
    parts = [Batches(char_dir, "train", 16, 8, seed=1, process_index=i, process_count=4) for i in range(4)]
    xs = [p.next()[0] for p in parts]
    assert all(x.shape == (2, 16) for x in xs)
    assert (np.concatenate(xs) == single[0]).all()
    rows = [set(range(i * 2, i * 2 + 2)) for i in range(4)]  # rows each process owns: disjoint
    assert sum(len(r) for r in rows) == len(set().union(*rows)) == 8
    with pytest.raises(UserError, match="not divisible"):
        Batches(char_dir, "train", 16, 6, seed=1, process_count=4)
    with pytest.raises(UserError, match="split"):
        Batches(char_dir, "test", 16, 8, seed=1)


@pytest.mark.parametrize("aligned", [False, True])
def test_micro_batches_hold_the_same_rows_on_any_number_of_processes(sharded, aligned):
    """With gradient accumulation's A groups, each process keeps its block of every micro-batch:
    the processes' micro-batch g, side by side, is the single process's micro-batch g (a MoE
    load-balancing loss is taken per micro-batch; contiguous process blocks regrouped the rows)."""
    A, B = 3, 8
    one = Batches(sharded, "train", 16, A * B, seed=2, groups=A, align_documents=aligned)
    want = one.next()[0].reshape(A, B, 16)
    parts = [Batches(sharded, "train", 16, A * B, seed=2, groups=A, process_index=i, process_count=4,
                     align_documents=aligned) for i in range(4)]
    got = [p.next()[0].reshape(A, B // 4, 16) for p in parts]
    assert (np.concatenate(got, axis=1) == want).all()
    assert (Batches(sharded, "train", 16, A * B, seed=2, align_documents=aligned).next()[0]
            == want.reshape(A * B, 16)).all()  # one process: groups change nothing
    if aligned:
        assert sum(p.waste() for p in parts) > 0
    with pytest.raises(UserError, match="in 3 groups of rows each by the 4 processes; use a multiple of 12"):
        Batches(sharded, "train", 16, 3 * 4 * 2 + 3, seed=2, groups=3, process_count=4)


def test_iter(char_dir):
    it = iter(Batches(char_dir, "val", 8, 2, seed=0))
    x, y = next(it)
    assert x.shape == (2, 8)




@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A gpt2 store of 60 documents of very different lengths in several shards."""
    import gpt.data as data
    d = tmp_path_factory.mktemp("sharded")
    docs = [SHAKESPEARE[i * 900:i * 900 + 20 + (i * 37) % 600] for i in range(60)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "CHUNK_BYTES", 1500)
        src = d / "docs.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        prepare([src], "gpt2", d / "out", shard_tokens=300, val_documents=5)
    return d / "out"


def test_windows_never_straddle_shards_and_cover_every_start(sharded):
    b = Batches(sharded, "train", 16, 64, seed=0)
    assert len(b.shards) >= 4
    sizes = [int(s.shape[0]) for s in b.shards]
    assert int(b.window_ends[-1]) == sum(n - 16 for n in sizes)
    seen = set()
    for i in range(40):
        offs = b.offsets(i)
        x, y = b.next()
        for row, o in enumerate(offs):
            k = int(np.searchsorted(b.window_ends, o, side="right"))
            local = int(o) - (int(b.window_ends[k - 1]) if k else 0)
            assert local + 17 <= sizes[k] and (x[row] == b.shards[k][local:local + 16]).all()
            seen.add(int(o))
    seen.update(int(o) for i in range(40, 400) for o in b.offsets(i))
    assert len(seen) > 0.98 * int(b.window_ends[-1])  # uniform over all windows of all shards


def test_aligned_rows_start_at_documents_and_pack_whole_ones(sharded):
    T = 48
    b = Batches(sharded, "train", T, 8, seed=5, align_documents=True)
    shard_of, start_of, length_of = b.docs
    doc_at = {(int(s), int(a)): int(n) for s, a, n in zip(shard_of, start_of, length_of)}
    heads = {tuple(b.shards[s][a:a + 4].tolist()) for s, a in doc_at}
    rows = np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for x, y in (b.next() for _ in range(5))])
    assert all(tuple(r[:4].tolist()) in heads for r in rows)  # every row opens a document
    again = Batches(sharded, "train", T, 8, seed=5, align_documents=True)
    assert all((p == q).all() for p, q in zip(again.next(), Batches(sharded, "train", T, 8, seed=5,
                                                                    align_documents=True).next()))
    parts = [Batches(sharded, "train", T, 8, seed=5, align_documents=True, process_index=i, process_count=2)
             for i in range(2)]
    assert (np.concatenate([p.next()[0] for p in parts]) == rows[:8, :-1]).all()
    assert 0 < b.waste() < 1 and b.cropped + b.drawn == 5 * 8 * (T + 1) + b.cropped


def test_best_fit_takes_the_longest_document_that_fits(tmp_path):
    """Documents of known lengths: a row is filled by the longest fitting one first, then the
    shortest is cut when nothing fits."""
    import gpt.batches as batches
    b = Batches.__new__(Batches)
    b.block_size, b.seed, b.cropped, b.drawn = 9, 0, 0, 0
    b.shards = [np.arange(100, dtype=np.uint16)]
    lengths = np.array([7, 4, 2, 30])
    starts = np.array([0, 10, 20, 40])
    b.docs = (np.zeros(4, np.int32), starts, lengths)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches, "PACK_POOL", 4)
        mp.setattr(np.random, "default_rng", lambda *_: type("R", (), {"integers": lambda *a, **k: np.arange(4)})())
        row = b._packed_row(0, 0)
    assert row.tolist() == list(range(0, 7)) + [20, 21] + [10]  # 7 fits, then 2, then 4 is cut to 1
    assert (b.cropped, b.drawn) == (3, 10)
    # the first document drawn opens the row even when it is longer than the row (best fit alone
    # never took one while a shorter one remained: a corpus's long documents were never trained on)
    b.docs, b.cropped, b.drawn = (np.zeros(4, np.int32), starts[[3, 0, 1, 2]], lengths[[3, 0, 1, 2]]), 0, 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches, "PACK_POOL", 4)
        mp.setattr(np.random, "default_rng", lambda *_: type("R", (), {"integers": lambda *a, **k: np.arange(4)})())
        row = b._packed_row(0, 0)
    assert row.tolist() == list(range(40, 50)) and (b.cropped, b.drawn) == (20, 10)


def test_aligned_rows_use_documents_longer_than_a_row(sharded):
    """Documents longer than a row open rows about as often as their share of the documents."""
    T = 48
    b = Batches(sharded, "train", T, 8, seed=3, align_documents=True)
    shard_of, start_of, length_of = b.docs
    long_heads = {tuple(b.shards[s][a:a + T + 1].tolist()) for s, a, n in zip(shard_of, start_of, length_of)
                  if n > T + 1}
    share = len(long_heads) / len(length_of)
    rows = [np.concatenate([x, y[:, -1:]], axis=1) for x, y in (b.next() for _ in range(50))]
    opened = np.mean([tuple(r.tolist()) in long_heads for batch in rows for r in batch])
    assert 0.2 < share < 0.8 and abs(opened - share) < 0.15, (share, opened)
