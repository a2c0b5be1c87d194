"""Token store: the token shards of a prepared data dir, how they are written, published and read.

Layout (format version 2):

    meta.json                       the commit point: tokenizer, dtype, counts, and the shard index
    store-<id>/train-00000.bin      tokens, flat, np.uint16 (uint32 if the vocabulary is larger)
    store-<id>/train-00000.docs     where each document starts in that shard (little-endian uint64)
    store-<id>/val-00000.bin ...    and the tokenizer's files (e.g. tokenizer.tiktoken for bpe:N)

Why shards: a corpus larger than memory is written as it streams, a shard at a time, and a
prepare that dies resumes from its last complete shard (gpt/data.py). A shard closes once it
holds `shard_tokens` tokens, at the next document start (so documents rarely straddle shards;
only one over 4x that size is cut), and only between the tokenizer's jobs (about 1 MB of text
each, so that a resumed prepare restarts at a job): a shard holds `shard_tokens` tokens and
up to a job's more, the last one the rest.

Why a store dir: publishing writes the new store under a fresh name and then replaces meta.json
atomically, so a crash at any point leaves either the old complete store or the new one (never
an old meta.json over new files); the old store dir is deleted after. Appending moves the new
shards into the current store dir under new names first, then replaces meta.json.

Version 1 (train.bin, val.bin and the tokenizer files beside meta.json, no document index)
still loads.
"""
from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shutil
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from gpt.errors import UserError
from gpt.tokenizer import atomic_write_bytes

FORMAT_VERSION = 2
READS = (1, 2)  # format versions this code loads
SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 27  # ~134M tokens, 256 MiB of uint16 per shard
_SHARD_NAME = re.compile(r"(train|val)-\d{5,}\.bin")
_STORE_NAME = re.compile(r"store-[0-9a-f]{12}")


# ---------------------------------------------------------------------------------------------
# Writing

class ShardWriter:
    """Appends token arrays to the current shard of each split (in `folder`) and records where
    documents start. `closed` lists the complete shards, as meta.json's index records them;
    `on_close(job)` is called after each shard is durable, with the index of the next job."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS,
                 closed: dict | None = None, first: dict | None = None, on_close=None):
        self.folder, self.dtype, self.shard_tokens = folder, np.dtype(dtype), int(shard_tokens)
        self.closed = {s: list((closed or {}).get(s, [])) for s in SPLITS}
        self.first = {s: int((first or {}).get(s, 0)) for s in SPLITS}  # numbering (appending)
        self.on_close = on_close
        self.file: dict[str, Any] = {}
        self.tokens = {s: 0 for s in SPLITS}
        self.starts: dict[str, list[int]] = {s: [] for s in SPLITS}

    def write(self, split: str, job: int, arr: np.ndarray, starts: list[int]) -> None:
        """Append job number `job`'s tokens; `starts` are the offsets in `arr` of documents.
        Shards close only between jobs, so that a resumed prepare restarts at a job."""
        other = "val" if split == "train" else "train"
        if other in self.file:
            self._close(other, job)  # the splits come in order: the other one is complete
        n = self.tokens[split]
        if split in self.file and ((starts[:1] == [0] and n >= self.shard_tokens) or n >= 4 * self.shard_tokens):
            self._close(split, job)
        if split not in self.file:
            name = f"{split}-{self.first[split] + len(self.closed[split]):05d}.bin"
            self.file[split] = open(self.folder / name, "wb")
        self.starts[split].extend(self.tokens[split] + s for s in starts)
        self.file[split].write(np.ascontiguousarray(arr, self.dtype).tobytes())
        self.tokens[split] += int(arr.size)

    def finish(self, job: int) -> dict:
        """Close the open shards; returns the index of every shard, by split."""
        for split in SPLITS:
            if split in self.file:
                self._close(split, job)
        return self.closed

    def _close(self, split: str, job: int) -> None:
        f = self.file.pop(split)
        f.flush()
        os.fsync(f.fileno())
        f.close()
        name = Path(f.name).name
        docs = np.asarray(self.starts[split], dtype="<u8")
        _write_durable(self.folder / name.replace(".bin", ".docs"), docs.tobytes())
        self.closed[split].append({"file": name, "tokens": self.tokens[split], "documents": int(docs.size)})
        self.tokens[split], self.starts[split] = 0, []
        if self.on_close is not None:
            self.on_close(job)

    def abandon(self) -> None:
        for f in self.file.values():
            f.close()
        self.file.clear()


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def split_counts(shards: dict) -> dict:
    """Tokens and documents of each split, summed over its shards."""
    return {s: {"tokens": sum(x["tokens"] for x in shards[s]), "documents": sum(x["documents"] for x in shards[s])}
            for s in SPLITS}


# ---------------------------------------------------------------------------------------------
# Publishing

def publish(stage: Path, out_dir: Path, meta: dict, old: dict | None, drop: list[str] = ()) -> None:
    """Make the staged shards and tokenizer files the data dir's store, atomically; the staged
    files named in `drop` (the progress file) go once the store is committed.

    New store: `stage` is renamed to a fresh store-<id>, then meta.json is replaced (the commit),
    then the previous store (either version) is deleted; if the commit fails, the stage is put
    back (a rerun resumes). Appending (`old` is the current meta of a version 2 store): the new
    shards move into its store dir under names it does not use (never over a file), then
    meta.json is replaced; if that fails, they move back. Until meta.json is replaced, readers see
    the old store, complete."""
    if old is not None:
        folder = out_dir / old["store"]
        moving = [f for f in sorted(stage.iterdir()) if _SHARD_NAME.fullmatch(f.name) or f.name.endswith(".docs")]
        taken = [f.name for f in moving if (folder / f.name).exists()]
        if taken:
            raise UserError(f"appending would overwrite {taken[0]} in {folder}; the store changed while this "
                            f"append ran, so run the append again")
        moved = []
        try:
            for f in moving:
                os.replace(f, folder / f.name)
                moved.append(f)
            _write_meta(out_dir, {**meta, "store": old["store"]})
        except BaseException:
            for f in moved:  # never referenced: back in the stage, where a rerun resumes from
                os.replace(folder / f.name, f)
            raise
        return
    name = f"store-{secrets.token_hex(6)}"
    previous = _read_meta_quietly(out_dir)
    os.replace(stage, out_dir / name)
    try:
        _write_meta(out_dir, {**meta, "store": name})
    except BaseException:
        os.replace(out_dir / name, stage)  # never referenced; back where a rerun resumes from
        raise
    for n in drop:
        (out_dir / name / n).unlink(missing_ok=True)
    _remove_old(out_dir, previous, keep=name)


def drop_unlisted(out_dir: Path, meta: dict) -> None:
    """Delete the shard files in the store dir that meta.json does not list: an append killed
    between moving its shards in and replacing meta.json leaves them (no reader opens them), and
    every later append was refused for the names they hold. Called with out_dir's lock held, so no
    other append is publishing."""
    listed = {sh["file"] for split in SPLITS for sh in meta["shards"][split]}
    listed |= {n.replace(".bin", ".docs") for n in listed}
    for f in (out_dir / meta["store"]).iterdir():
        ours = _SHARD_NAME.fullmatch(f.name.replace(".docs", ".bin"))
        if ours and f.name not in listed and f.is_file():
            f.unlink()


def _write_meta(out_dir: Path, meta: dict) -> None:
    atomic_write_bytes(out_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())


def _read_meta_quietly(out_dir: Path) -> dict | None:
    try:
        meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def _remove_old(out_dir: Path, previous: dict | None, keep: str) -> None:
    """Delete what the previous store used, after the commit: version 1's top-level split files
    and tokenizer files, and every store dir other than `keep` (a leftover of an interrupted
    publish too). Errors are ignored: a leftover wastes space but misleads no reader."""
    for d in out_dir.iterdir():
        if _STORE_NAME.fullmatch(d.name) and d.name != keep and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    if previous is not None and previous.get("format_version") == 1:
        names = ["train.bin", "val.bin"]
        spec = previous.get("tokenizer")
        if isinstance(spec, dict) and spec.get("file") in V1_TOKENIZER_FILES:  # never another file
            names.append(spec["file"])
        for n in names:
            try:
                (out_dir / n).unlink(missing_ok=True)
            except OSError:
                pass


V1_TOKENIZER_FILES = ("tokenizer.tiktoken", "tokenizer.json")  # what a version 1 data dir held


# ---------------------------------------------------------------------------------------------
# Reading

def files_dir(data_dir: Path, meta: dict) -> Path:
    """Where the store's shards and tokenizer files are (the data dir itself for version 1)."""
    return Path(data_dir) / meta["store"] if meta["format_version"] >= 2 else Path(data_dir)


def shard_index(meta: dict, split: str) -> list[dict]:
    """The split's shards as {"file", "tokens", "documents"} (documents None for version 1)."""
    if meta["format_version"] == 1:
        return [{"file": f"{split}.bin", "tokens": int(meta["splits"][split]["tokens"]), "documents": None}]
    return meta["shards"][split]


def check_index(data_dir: Path, meta: dict, how: str) -> None:
    """Every shard named in meta.json exists, stays inside the store, and has its recorded size;
    a store dir name or file name that could point elsewhere is refused (meta.json may be edited)."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    if meta["format_version"] >= 2 and not (isinstance(meta.get("store"), str)
                                             and _STORE_NAME.fullmatch(meta["store"])):
        raise UserError(f"{str(Path(data_dir) / 'meta.json')!r} names store {meta.get('store')!r}, which is "
                        f"not a store dir of ours; re-prepare it ({how})")
    folder = files_dir(data_dir, meta)
    for split in SPLITS:
        shards = shard_index(meta, split)
        if not isinstance(shards, list):
            raise ValueError(split)
        for sh in shards:
            if meta["format_version"] >= 2:
                check_shard(folder, sh, itemsize, how)
            else:
                _check_file(folder / sh["file"], int(sh["tokens"]) * itemsize, how)


def check_shard(folder: Path, sh: dict, itemsize: int, how: str = "re-prepare it") -> None:
    """A shard entry names a shard file of ours (never a path elsewhere), with its recorded token
    and document counts (non-negative integers) matching the files' sizes."""
    if not isinstance(sh, dict) or not isinstance(sh.get("file"), str) or not _SHARD_NAME.fullmatch(sh["file"]):
        raise UserError(f"meta.json names shard {sh!r}, which is not a shard of ours; the data dir is "
                        f"corrupt, re-prepare it ({how})")
    for k in ("tokens", "documents"):
        if isinstance(sh.get(k), bool) or not isinstance(sh.get(k), int) or sh[k] < 0:
            raise UserError(f"meta.json's shard {sh['file']} has {k}={sh.get(k)!r}, not a count; the data "
                            f"dir is corrupt, re-prepare it ({how})")
    _check_file(folder / sh["file"], sh["tokens"] * itemsize, how)
    _check_file(folder / sh["file"].replace(".bin", ".docs"), 8 * sh["documents"], how)


def _check_file(f: Path, want: int, how: str) -> None:
    if not f.is_file() or f.stat().st_size != want:
        raise UserError(f"{str(f)!r} is missing or does not match meta.json ({want} bytes expected); "
                        f"the data dir is corrupt, re-prepare it ({how})")


class SplitTokens:
    """One split of a store, memory-mapped: `shards` (token arrays) and `starts` (where each
    document starts in its shard; None for a version 1 store). Opened once: re-creating a memmap
    per batch (as nanoGPT does) leaks memory. Each mapped shard holds a file descriptor, so
    `starts` is read into memory when first asked for (--align_documents), not mapped."""

    def __init__(self, data_dir: Path, meta: dict, split: str):
        self.folder, dtype = files_dir(data_dir, meta), np.dtype(meta["dtype"])
        self.index = shard_index(meta, split)
        self.shards = [np.memmap(self.folder / sh["file"], dtype=dtype, mode="r") if sh["tokens"] else
                       np.zeros(0, dtype) for sh in self.index]
        self.n_tokens = sum(int(s.shape[0]) for s in self.shards)

    @functools.cached_property
    def starts(self) -> list[np.ndarray] | None:
        if any(sh["documents"] is None for sh in self.index):
            return None
        return [np.fromfile(self.folder / sh["file"].replace(".bin", ".docs"), dtype="<u8") if sh["documents"]
                else np.zeros(0, "<u8") for sh in self.index]


_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def open_split(data_dir: Path, meta: dict, split: str) -> SplitTokens:
    """The split's SplitTokens, shared while any holder lives: a run's training batches and its
    evaluations of the train split map its shards once (a store of a few hundred shards mapped
    twice ran out of file descriptors at the usual limit of 1,024)."""
    key = (str(Path(data_dir).resolve()), split, json.dumps([meta.get("store"), meta["dtype"],
                                                             shard_index(meta, split)], sort_keys=True))
    tokens = _OPEN.get(key)
    if tokens is None:
        tokens = _OPEN[key] = SplitTokens(Path(data_dir), meta, split)
    return tokens
