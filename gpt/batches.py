"""Batches: random training windows, or document-aligned packed rows, from a prepared token store.

Batch i is a pure function of (seed, i), so the loader's state is two integers (saved in
checkpoints as JSON), a resumed run sees exactly the batches it would have seen, and each
process of a multi-host run computes only its own rows of the same global batch.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gpt import store
from gpt.data import SPLITS, check_int, check_split_sizes, load_meta
from gpt.errors import UserError

PACK_POOL = 64  # documents a row is packed from (best fit); more fit better and cost more


class Batches:
    """Random (x, y) windows from one split of a prepared data dir.

    Batch i uses ``np.random.default_rng([seed, i])`` to draw the offsets of the whole *global*
    batch, and this process keeps rows [process_index*B/P, (process_index+1)*B/P): every process
    agrees on the global batch without communicating, and the state is just {seed, index}. With
    `groups` G (gradient accumulation's micro-batches), the batch is G groups of B/G rows and the
    process keeps its block of each group, so that micro-batch g holds the same rows whatever the
    number of processes (a MoE load-balancing loss and dropout masks depend on the grouping). A
    window lies in one shard; the offsets are uniform over all windows of all shards (for one
    shard, as before shards existed: old data dirs give the same batches).

    align_documents: every row starts at a document start instead, packed best-fit as nanochat
    does: row r of batch i draws PACK_POOL documents with ``default_rng([seed, i, r])``; the first
    drawn opens the row (cut if longer than it), then the row repeatedly takes the longest that
    fits the space left, and when none fits, the shortest is cut to fill it. Opening with the first
    draw gives every document the same chance to start a row: best fit alone never chose one
    longer than a row while a shorter one remained. `cropped`/`drawn` count the tokens cut off
    and the tokens taken.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, block_size: int, batch_size: int, *,
                 seed: int, process_index: int = 0, process_count: int = 1, align_documents: bool = False,
                 meta: dict | None = None, groups: int = 1):
        if split not in SPLITS:
            raise UserError(f"split {split!r} is not valid; use train or val")
        self.block_size = check_int("block_size", block_size, 1)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.process_count = check_int("process_count", process_count, 1)
        self.process_index = check_int("process_index", process_index, 0)
        if self.process_index >= self.process_count:
            raise UserError(f"process_index={process_index} must be < process_count={process_count}")
        self.groups = check_int("groups", groups, 1)
        if self.batch_size % (self.groups * self.process_count):
            split = "" if self.groups == 1 else f"in {self.groups} groups of rows each "
            raise UserError(f"batch_size={batch_size} (global) is not divisible {split}by the "
                            f"{process_count} processes; use a multiple of {self.groups * process_count}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.meta = load_meta(self.data_dir) if meta is None else meta  # a run reads it once
        check_split_sizes(self.meta, self.block_size)
        self.tokens = store.open_split(self.data_dir, self.meta, split)
        self.shards = self.tokens.shards
        self.n_tokens = self.tokens.n_tokens
        windows = np.array([max(int(s.shape[0]) - self.block_size, 0) for s in self.shards], np.int64)
        self.window_ends = np.cumsum(windows)  # windows of shards 0..k
        self.docs = _document_table(self.tokens, self.data_dir) if align_documents else None
        self.local_batch_size = self.batch_size // self.process_count
        self.rows = self._my_rows()
        self.index = 0
        self.cropped = self.drawn = 0

    def offsets(self, index: int) -> np.ndarray:
        """Window starts of the global batch `index`, numbered across shards."""
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, int(self.window_ends[-1]), size=self.batch_size)

    def _my_rows(self) -> np.ndarray:
        """This process's rows of a global batch: its block of each of the `groups` groups."""
        group = self.batch_size // self.groups
        mine = group // self.process_count
        lo = self.process_index * mine
        return (np.arange(self.groups)[:, None] * group + np.arange(lo, lo + mine)[None, :]).reshape(-1)

    def _window(self, o: int) -> np.ndarray:
        k = int(np.searchsorted(self.window_ends, o, side="right"))
        local = o - (int(self.window_ends[k - 1]) if k else 0)
        return self.shards[k][local:local + self.block_size + 1]

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """This process's rows of the next batch: int32 x, y of shape [B_local, block_size]."""
        if self.docs is None:
            offs = self.offsets(self.index)[self.rows]
            windows = np.stack([self._window(int(o)) for o in offs]).astype(np.int32)
        else:
            windows = np.stack([self._packed_row(self.index, int(r)) for r in self.rows])
        self.index += 1
        return windows[:, :-1], windows[:, 1:]

    def _packed_row(self, index: int, row: int) -> np.ndarray:
        """Row `row` of batch `index`: whole documents packed best-fit, the last one cut to fit."""
        shard_of, start_of, length_of = self.docs
        rng = np.random.default_rng([self.seed, index, row])
        pool = rng.integers(0, len(length_of), size=PACK_POOL)
        lengths = length_of[pool].astype(np.int64)
        out, space = np.empty(self.block_size + 1, np.int32), self.block_size + 1
        while space:
            if not lengths.any():  # every document of the pool used: draw more
                pool = rng.integers(0, len(length_of), size=PACK_POOL)
                lengths = length_of[pool].astype(np.int64)
                continue
            fits = np.where(lengths <= space, lengths, 0)
            if space == self.block_size + 1 and lengths[0]:
                i = 0  # the first draw opens the row, whatever its length
            elif fits.max() > 0:
                i = int(np.argmax(fits))
            else:
                i = int(np.argmin(np.where(lengths > 0, lengths, 1 << 62)))
            take = min(int(lengths[i]), space)
            s, at = int(shard_of[pool[i]]), int(start_of[pool[i]])
            out[self.block_size + 1 - space:][:take] = self.shards[s][at:at + take]
            self.cropped += int(lengths[i]) - take
            self.drawn += take
            space -= take
            lengths[i] = 0  # used
        return out

    def waste(self, n_batches: int = 8) -> float:
        """The share of the tokens drawn that packing cuts off, over the next `n_batches` batches
        (without consuming them); 0 for unaligned windows."""
        if self.docs is None:
            return 0.0
        saved = self.cropped, self.drawn
        self.cropped = self.drawn = 0
        for i in range(self.index, self.index + n_batches):
            for r in self.rows:
                self._packed_row(i, int(r))
        share = self.cropped / max(self.cropped + self.drawn, 1)
        self.cropped, self.drawn = saved
        return share

    __next__ = next

    def __iter__(self) -> Batches:
        return self

    def state(self) -> dict:
        return {"seed": self.seed, "index": self.index}

    def restore(self, state: dict) -> None:
        if not isinstance(state, dict) or "seed" not in state or "index" not in state:
            raise UserError(f"data loader state {state!r} is malformed (needs seed and index); "
                            f"the checkpoint may be corrupt")
        self.seed = check_int("seed", state["seed"], 0)
        self.index = check_int("index", state["index"], 0)


def _document_table(tokens: store.SplitTokens, data_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every document of the split as (shard, start, length) arrays; a document ends at the next
    one's start or its shard's end. (Tokens before a shard's first start, the rest of a document
    that a shard cut inside, start no row.) The index is checked: it may have been edited."""
    if tokens.starts is None:
        raise UserError(f"{str(data_dir)!r} has no document index (a single-file data dir, format version 1), "
                        f"which --align_documents needs; prepare the data again with python -m gpt.data")
    shard_of, start_of, length_of = [], [], []
    for k, (shard, raw) in enumerate(zip(tokens.shards, tokens.starts)):
        starts = np.asarray(raw, np.int64)
        if starts.size and (np.any(np.diff(starts) < 0) or starts[0] < 0 or starts[-1] >= shard.shape[0]):
            raise UserError(f"the document index of shard {k} in {str(data_dir)!r} is not sorted or points past "
                            f"the shard; the data dir is corrupt, prepare it again")
        ends = np.append(starts[1:], shard.shape[0])
        shard_of.append(np.full(starts.size, k, np.int32))
        start_of.append(starts)
        length_of.append(ends - starts)
    lengths = np.concatenate(length_of)
    if not lengths.size or lengths.max() == 0:
        raise UserError(f"{str(data_dir)!r} has no documents in this split; --align_documents needs some")
    return np.concatenate(shard_of), np.concatenate(start_of), lengths
