"""Data: turn text, JSONL and Parquet files into a store of token shards for training.

Preparation (`prepare`, or ``python -m gpt.data``) writes a data dir: meta.json and a store dir of
token shards with document indexes and the tokenizer's files (layout and atomic publishing:
gpt/store.py). Reading the inputs (formats, UTF-8 pieces, the train/val split): gpt/corpus.py.
Sampling batches from a store: gpt/batches.py. Here:

- Jobs: the pieces of the corpus are grouped into jobs of ~1 MiB of text (`make_jobs`), so a
  corpus of small records does not cost a pool task per record.
- Parallelism: for corpora over 16 MiB, jobs are tokenized by a spawn process pool (spawn,
  not fork: the caller may have JAX threads running), results written in order. On the 2-core
  benchmark machine, idle, this gave 46 MB/s for gpt2 against 27 MB/s inline and only 13 MB/s
  for a thread pool: tiktoken releases the GIL, yet threads lost to the reader thread
  contending for it (BENCHMARKS.md). Small corpora are tokenized inline.
- Bounded memory: at most 2 jobs per worker are in flight, and tokens go to the current shard
  file as they come, so memory does not grow with the corpus.
- Resume: the staging dir is named by a hash of the inputs and settings, and after each shard
  is complete a progress file records the jobs done; a prepare that is killed or runs out of
  disk, run again with the same inputs and settings, re-reads the corpus (for the source hashes)
  but tokenizes only from the first incomplete shard on. After bad input it starts over.
- Append (`append=True`): inputs not yet in the store are tokenized with the store's tokenizer
  into new shards, and published the same atomic way.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from gpt import store
from gpt.corpus import (CHUNK_BYTES, DEFAULT_INCLUDE, Include, Pieces, Reading, Source, SplitRule, make_sources,
                        file_format, hash_file, include_patterns, iter_corpus, resolve_inputs, split_rule)
from gpt.errors import ArgParser, UserError, run_main
from gpt.tokenizer import (Tokenizer, atomic_write_bytes, build_tokenizer, identity, load_tokenizer,
                           parse_name)

FORMAT_VERSION = store.FORMAT_VERSION
SPLITS = store.SPLITS


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: uint16 up to 65536 ids (GPT-2), else uint32."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise UserError(f"vocab_size {vocab_size} does not fit in uint32; use a smaller tokenizer")


# ---------------------------------------------------------------------------------------------
# Preparation

_worker_tokenizer: Tokenizer | None = None


def _init_process_worker(spec: dict, base_dir: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(spec, base_dir)


def encode_job(tok: Tokenizer, texts: list[str], marks: list[int], dtype: np.dtype) -> tuple[np.ndarray, list[int]]:
    """One job's tokens and the offsets in them where documents start. marks[i]: 0 = the text
    continues a document, 1 = it starts one, 2 = it starts one after an end-of-text token."""
    parts, starts, n = [], [], 0
    for text, mark in zip(texts, marks):
        if mark:
            starts.append(n)
        if mark == 2:
            parts.append(np.array([tok.eot_id], dtype))
            n += 1
        arr = tok.encode_array(text, dtype)
        parts.append(arr)
        n += int(arr.size)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype)), starts


def _process_encode(texts: list[str], marks: list[int], dtype: str) -> tuple[np.ndarray, list[int]]:
    assert _worker_tokenizer is not None
    return encode_job(_worker_tokenizer, texts, marks, np.dtype(dtype))


BACKENDS = ("auto", "process", "thread")
MIN_PARALLEL_BYTES = 16 * CHUNK_BYTES  # below this, starting worker processes costs more than it saves


def _make_executor(backend: str, workers: int, total_bytes: int, tok: Tokenizer, base_dir: Path) -> Executor | None:
    """The pool that tokenizes jobs, or None to tokenize inline in this thread.

    "auto" (default): inline for small corpora or one worker, else a spawn process pool, which
    bench/data.py measured fastest (see BENCHMARKS.md). Workers rebuild the tokenizer from its
    spec and files in `base_dir`; a job's texts travel as strs and come back as a token array.
    """
    if backend not in BACKENDS:
        raise UserError(f"backend {backend!r} is not valid; use one of {', '.join(BACKENDS)}")
    if workers <= 1 or (backend == "auto" and total_bytes < MIN_PARALLEL_BYTES):
        return None
    if backend == "thread":
        return ThreadPoolExecutor(workers)
    import multiprocessing as mp
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                               initializer=_init_process_worker, initargs=(tok.spec, str(base_dir)))


# A job: (split, UTF-8 bytes of text, texts, marks as in `encode_job`).
Job = tuple[str, int, list[str], list[int]]


def make_jobs(pieces: Pieces, eot: bool) -> Iterator[Job]:
    """Group consecutive pieces of one split into jobs of about CHUNK_BYTES of text, so that a
    corpus of small records (JSONL lines, Parquet rows) does not cost a pool task per record.
    Where the tokenizer has an end-of-text token, it goes between documents (not before the
    first), in the split where the next document starts."""
    split, nbytes, texts, marks = None, 0, [], []
    seen = False
    for sp, n, text, new_doc in pieces:
        if texts and (sp != split or nbytes >= CHUNK_BYTES):
            yield split, nbytes, texts, marks
            nbytes, texts, marks = 0, [], []
        split = sp
        nbytes += n
        texts.append(text)
        marks.append(0 if not new_doc else 2 if eot and seen else 1)
        seen = True
    if texts:
        yield split, nbytes, texts, marks


def _tokenize_jobs(jobs: Iterator[Job], tok: Tokenizer, dtype: np.dtype, writer: store.ShardWriter,
                   executor: Executor | None, workers: int, skip: int) -> tuple[dict, int]:
    """Tokenize the jobs (in parallel, results written in order) into `writer`; the first `skip`
    are already in complete shards (a resumed prepare) and are only counted. Returns the text
    bytes of each split and the number of jobs."""
    nbytes = {s: 0 for s in SPLITS}
    in_flight: deque = deque()
    max_in_flight = 2 * workers if executor is not None else 0  # bounded: memory stays flat

    def drain(limit: int) -> None:
        while len(in_flight) > limit:
            j, split, item = in_flight.popleft()
            try:
                arr, starts = item if isinstance(item, tuple) else item.result()
            except BrokenProcessPool:
                raise UserError("tokenizer worker processes died (out of memory, or prepare() was called "
                                "from a script without an `if __name__ == '__main__':` guard, which "
                                "spawned workers need); fix that or pass workers=1") from None
            writer.write(split, j, arr, starts)

    j = -1
    for j, (split, n, texts, marks) in enumerate(jobs):
        nbytes[split] += n
        if j < skip:
            continue
        if executor is None:
            in_flight.append((j, split, encode_job(tok, texts, marks, dtype)))
        elif isinstance(executor, ProcessPoolExecutor):
            in_flight.append((j, split, executor.submit(_process_encode, texts, marks, dtype.name)))
        else:
            in_flight.append((j, split, executor.submit(encode_job, tok, texts, marks, dtype)))
        drain(max_in_flight)
    drain(0)
    return nbytes, j + 1


@dataclass(frozen=True)
class Settings:
    """What decides a prepared store besides its inputs (all in the cache key)."""
    tokenizer: str
    val_fraction: float = 0.1
    val_documents: int | None = None
    include: tuple[str, ...] = DEFAULT_INCLUDE
    errors: str = "strict"
    text_field: str = "text"
    skip_bad_records: bool = False
    shard_tokens: int = store.SHARD_TOKENS
    append_to: str = ""  # when appending: the store's name and shard counts (a resume must match them)


def prepare(inputs: Sequence[str | os.PathLike], tokenizer: str | None, out_dir: str | os.PathLike, *,
            val_fraction: float = 0.1, val_documents: int | None = None, include: Include = DEFAULT_INCLUDE,
            errors: str = "strict", workers: int | None = None, backend: str = "auto",
            text_field: str = "text", skip_bad_records: bool = False, shard_tokens: int = store.SHARD_TOKENS,
            append: bool = False, reuse: bool = False) -> dict:
    """Tokenize text, JSONL and Parquet files into a store of token shards in `out_dir`
    (layout: gpt/store.py); returns the meta dict.

    inputs: files, folders (recursive, files matching any `include` pattern) or glob patterns;
    .txt/.txt.gz files are one document each, .jsonl/.jsonl.gz lines and .parquet rows one
    document each, their text at `text_field` (a JSON key or dotted path, or a Parquet column).
    tokenizer: "gpt2" | "char" | "bpe:N" | "hf:PATH" (char and bpe:N are learned from this corpus
    first; hf:PATH is a Hugging Face tokenizer.json, copied into the store); with `append`, None
    (the store's own).
    val_fraction / val_documents: whole documents go to val, those past the last `val_fraction`
    of the bytes, or the last `val_documents` (see gpt/corpus.py SplitRule).
    errors: "strict" (invalid UTF-8 is an error) or "replace" (bad bytes become U+FFFD).
    skip_bad_records: skip (and count) records that are not JSON or lack a string text field.
    workers: tokenizer processes (default: all cores); backend: "auto" | "process" | "thread"
    (`_make_executor`). shard_tokens: tokens per shard. append: add the inputs not yet in the
    store in `out_dir` as new shards, with its tokenizer. An interrupted prepare resumes. reuse: a
    valid store found in out_dir once its lock is held is returned as it is (`ensure_prepared`,
    whose cache dir is named by its key: a run that waited for another's preparation finds it done).
    """
    out_dir = Path(out_dir)
    old = _store_to_append(out_dir, tokenizer) if append else None
    if old is None and not isinstance(tokenizer, str):
        raise UserError("no tokenizer given; pass --tokenizer gpt2 | char | bpe:N | hf:PATH")
    settings = Settings(_store_tokenizer_name(old) if old is not None else tokenizer, val_fraction,
                        val_documents, include_patterns(include), errors, text_field, bool(skip_bad_records),
                        shard_tokens, _append_id(old))
    _check_settings(settings, backend, appending=old is not None)
    workers = _check_workers(workers)
    files = resolve_inputs(inputs, settings.include)
    _check_out_dir_outside(inputs, files, out_dir)
    if old is not None:
        files = _new_files(files, old, out_dir)
    reading = Reading(errors, text_field, bool(skip_bad_records))
    sources = make_sources(files)
    if sum(s.size for s in sources) == 0:
        raise UserError(f"the corpus is empty ({len(sources)} file(s), 0 bytes); pass non-empty text files")
    key = cache_key(files, settings if old is not None else
                    dataclasses.replace(settings, tokenizer=identity(tokenizer)))
    created = _make_out_dir(out_dir)
    with _one_at_a_time(out_dir):
        if old is not None and _append_id(_store_to_append(out_dir, tokenizer)) != settings.append_to:
            raise UserError(f"{str(out_dir)!r} was replaced by another preparation while this --append waited "
                            f"for it; run the command again to add to the new store")
        if old is not None:
            store.drop_unlisted(out_dir, old)  # an earlier append killed before its commit
        done = _prepared(out_dir) if reuse else None
        return done or _prepare_locked(out_dir, created, key, sources, reading, settings, old, workers, backend)


def _prepared(out_dir: Path) -> dict | None:
    """out_dir's store if it holds a valid one, else None (none yet, stale or corrupt)."""
    if not (out_dir / "meta.json").is_file():
        return None
    try:
        return load_meta(out_dir)
    except UserError:
        return None


def _prepare_locked(out_dir: Path, created: bool, key: str, sources: list[Source], reading: Reading,
                    settings: Settings, old: dict | None, workers: int, backend: str) -> dict:
    """`prepare`'s work with out_dir's lock held (so a run that finds it done reads no corpus):
    the split rule, stage (or resume), tokenize, check, publish."""
    keep = False  # keep the staging dir for a resume: not after bad input, which must be fixed first
    stage = out_dir / f".prepare-{key[:16]}"
    try:
        rule = split_rule(sources, reading, settings.val_fraction, settings.val_documents)
        progress = _stage(out_dir, stage, key)
        meta = _prepare_in(stage, sources, reading, rule, settings, old, progress, workers, backend, out_dir)
        _check_splits(meta, settings)
        store.publish(stage, out_dir, meta, old, drop=[PROGRESS])
        return load_meta(out_dir)
    except OSError as e:
        keep = True
        raise UserError(f"cannot read or write {e.filename or str(out_dir)!r} ({e.strerror}); check "
                        f"permissions and free space, or choose another --out_dir (the complete shards are "
                        f"kept: the same command resumes)") from None
    except UserError:
        raise
    except BaseException:
        keep = True
        raise
    finally:
        _clean_up(stage, out_dir, created, keep)


def _prepare_in(stage: Path, sources: list[Source], reading: Reading, rule, settings: Settings, old: dict | None,
                progress: dict, workers: int, backend: str, out_dir: Path) -> dict:
    """Tokenize the corpus into shards in `stage`, resuming from `progress`; returns the meta."""
    tok = _stage_tokenizer(stage, sources, reading, rule, settings, old, progress, out_dir)
    dtype = token_dtype(tok.vocab_size)
    first = {s: len(old["shards"][s]) for s in SPLITS} if old is not None else None

    def saved(job: int) -> None:
        _save_progress(stage, {**progress, "jobs": job, "shards": writer.closed})

    writer = store.ShardWriter(stage, dtype, settings.shard_tokens, progress.get("shards"), first, saved)
    hashers = [hashlib.sha256() for _ in sources]
    stats = {"skipped": 0}
    executor = _make_executor(backend, workers, sum(s.size for s in sources), tok, stage)
    try:
        jobs = make_jobs(iter_corpus(sources, reading, rule, hashers=hashers, stats=stats), tok.eot_id is not None)
        nbytes, n_jobs = _tokenize_jobs(jobs, tok, dtype, writer, executor, workers, progress.get("jobs", 0))
        shards = writer.finish(n_jobs)
    finally:
        writer.abandon()
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    if sum(nbytes.values()) == 0:
        raise UserError(f"the corpus is empty ({len(sources)} file(s), {sum(s.size for s in sources)} bytes, "
                        f"but no text in any record); pass files with text, or check "
                        f"--text_field={settings.text_field}")
    new = _meta(tok, dtype, shards, nbytes, settings, stats["skipped"], sources, hashers)
    return new if old is None else _appended_meta(old, new)


def _check_splits(meta: dict, s: Settings) -> None:
    """Refuse, before anything is published, a store that training could not use: no train tokens
    (whole documents go to val, and the last ones can hold all the text), or no val tokens though
    a val split was asked for. Warn when val's share of the tokens is far from the one asked
    (documents much larger than the val share)."""
    tokens = {split: meta["splits"][split]["tokens"] for split in SPLITS}
    fix = ("prepare it with `python -m gpt.data ... --val_documents=N` to choose val by document (then "
           "train with --data_dir), or use more, smaller documents")
    if tokens["train"] == 0:
        raise UserError(f"the train split would be empty ({tokens['val']:,} val tokens): whole documents go "
                        f"to val, and those past the cut hold all the text; {fix}")
    if tokens["val"] == 0 and (s.val_fraction > 0 or s.val_documents):
        raise UserError(f"the val split would be empty: no document ends past the val cut; {fix}")
    if tokens["val"] == 0:
        print("warning: --val_fraction 0 leaves no val split, and train.py evaluates on it: this store is "
              "for reading its tokens, not for training (prepare again with --val_fraction 0.1 for that)",
              file=sys.stderr)
    share, asked = tokens["val"] / (tokens["train"] + tokens["val"]), s.val_fraction
    if s.val_documents is None and asked > 0 and not asked / 2 <= share <= 2 * asked:
        print(f"warning: val holds {share:.0%} of the tokens, not the {asked:.0%} asked (whole documents go "
              f"to val); {fix}", file=sys.stderr)


def _check_workers(workers: int | None) -> int:
    """The number of tokenizer processes: all cores by default, at most that many."""
    cores = os.cpu_count() or 1
    if workers is None:
        return cores
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= cores:
        raise UserError(f"--workers={workers} must be between 1 and this machine's {cores} core(s)")
    return workers


def _check_out_dir_outside(inputs, files: list[Path], out_dir: Path) -> None:
    """An out_dir inside an input folder, or a glob's files inside out_dir (--input 'corpus/**'
    with out_dir corpus/out), would read the store as its own input next time: refused."""
    out = out_dir.resolve()
    for raw in [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs:
        p = Path(raw)
        if p.is_dir() and (out == p.resolve() or p.resolve() in out.parents):
            raise UserError(f"--out_dir {str(out_dir)!r} is inside the input folder {str(p)!r}; choose an "
                            f"out_dir outside the inputs")
    inside = [f for f in files if out in f.resolve().parents]
    if inside:
        raise UserError(f"the input {str(inside[0])!r} lies inside --out_dir {str(out_dir)!r}; choose an "
                        f"out_dir outside the inputs, or a pattern that does not reach into it")


def _check_settings(s: Settings, backend: str, appending: bool) -> None:
    if not appending:
        parse_name(s.tokenizer)  # unknown tokenizer: fail before touching anything
    if backend not in BACKENDS:
        raise UserError(f"backend {backend!r} is not valid; use one of {', '.join(BACKENDS)}")
    if s.errors not in ("strict", "replace"):
        raise UserError(f"errors={s.errors!r} is not valid; use strict or replace")
    if isinstance(s.val_fraction, bool) or not isinstance(s.val_fraction, (int, float)) \
            or not 0.0 <= s.val_fraction < 1.0:
        raise UserError(f"val_fraction={s.val_fraction!r} must be in [0, 1), e.g. 0.1")
    if s.val_documents is not None:
        check_int("val_documents", s.val_documents, 1)
    check_int("shard_tokens", s.shard_tokens, 1)
    if not isinstance(s.text_field, str) or not s.text_field:
        raise UserError(f"text_field={s.text_field!r} must name a JSON key or Parquet column, e.g. text")


def _make_out_dir(out_dir: Path) -> bool:
    """Create out_dir if needed; returns whether it was created (and may go again on failure)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"out_dir {str(out_dir)!r} exists and is not a folder; choose another --out_dir")
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(out_dir, e) from None
    return created


def _unwritable(out_dir: Path, e: OSError) -> UserError:
    return UserError(f"cannot write to out_dir {str(out_dir)!r} ({e.strerror}); choose a writable --out_dir")


@contextmanager
def _one_at_a_time(out_dir: Path):
    """Hold out_dir's lock (an exclusive flock on the folder itself: no lock file is left behind)
    while preparing into it: a second preparation of the same out_dir (two train.py --input runs of
    one corpus share its cache) waits for the first, where it would delete the first's staging
    dir. No lock where the platform (Windows) or the filesystem has no flock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = _locked(out_dir, fcntl)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EBADF, errno.EOPNOTSUPP, errno.EINVAL)  # flock unsupported


def _locked(out_dir: Path, fcntl) -> int | None:
    """An open descriptor of out_dir holding its exclusive flock, or None (with a note) on a
    filesystem without flock (Lustre without -o flock, some NFS). A folder removed and made again
    while this waited (a failed first preparation removes the out_dir it made) is locked afresh:
    the lock must be on the folder that is there."""
    while True:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(out_dir, os.O_RDONLY)
        except FileNotFoundError:
            continue  # removed between making and opening it: make it again
        except OSError as e:
            raise _unwritable(out_dir, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(fd)
            if e.errno not in NO_LOCKS:
                raise
            print(f"note: {out_dir} has no file locks ({e.strerror}); do not prepare into it from two runs "
                  f"at once", file=sys.stderr)
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(out_dir)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _stage(out_dir: Path, stage: Path, key: str) -> dict:
    """Create this preparation's hidden staging dir in out_dir; returns the progress of an
    interrupted run with the same key to resume ({"key": key} if none). Staging dirs of other
    settings are stale and removed (out_dir's lock is held: no other preparation is running)."""
    try:
        for d in out_dir.glob(".prepare-*"):
            if d != stage:
                shutil.rmtree(d, ignore_errors=True)
        progress = _read_progress(stage, key)
        if not progress:
            shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(exist_ok=True)
    except OSError as e:
        raise _unwritable(out_dir, e) from None
    return progress or {"key": key}


def _read_progress(stage: Path, key: str) -> dict | None:
    """The progress file of an interrupted run, if it is for `key` and its shards are intact;
    anything else (edited, damaged, another preparation) is None: start over."""
    try:
        p = json.loads((stage / PROGRESS).read_text(encoding="utf-8"))
        ok = (isinstance(p, dict) and p.get("key") == key and isinstance(p.get("tokenizer"), dict)
              and isinstance(p.get("jobs", 0), int) and p.get("jobs", 0) >= 0)
        if ok and "shards" in p:
            size = token_dtype(int(p["tokenizer"]["vocab_size"])).itemsize
            for split in SPLITS:
                for sh in p["shards"][split]:
                    store.check_shard(stage, sh, size)
        return p if ok else None
    except (OSError, ValueError, KeyError, TypeError, RecursionError, UserError):
        return None


PROGRESS = "progress.json"


def _save_progress(stage: Path, progress: dict) -> None:
    atomic_write_bytes(stage / PROGRESS, json.dumps(progress).encode())


def _clean_up(stage: Path, out_dir: Path, created: bool, keep: bool) -> None:
    """After a prepare: drop the staging dir, unless an interrupted run can resume from it, and an
    out_dir we created that holds no store."""
    if keep and (stage / PROGRESS).is_file():
        return
    shutil.rmtree(stage, ignore_errors=True)
    if created and out_dir.is_dir() and not (out_dir / "meta.json").exists():
        shutil.rmtree(out_dir, ignore_errors=True)


def _stage_tokenizer(stage: Path, sources: list[Source], reading: Reading, rule: SplitRule, settings: Settings,
                     old: dict | None, progress: dict, out_dir: Path) -> Tokenizer:
    """The tokenizer, with its files in `stage`: the store's own when appending, the one an
    interrupted run learned, or a new one (char learns from all the text, bpe from the train
    split only: val stays unseen); recorded in the progress file so a resume never relearns."""
    if old is not None:
        src = store.files_dir(out_dir, old)
        tok = load_tokenizer(old["tokenizer"], src)
        for name in tok.files():
            shutil.copyfile(src / name, stage / name)
        progress["tokenizer"] = tok.spec
        _save_progress(stage, progress)
        return tok
    if progress.get("tokenizer"):
        return load_tokenizer(progress["tokenizer"], stage)
    name = settings.tokenizer
    if name == "gpt2" or name.startswith("hf:"):
        tok = build_tokenizer(name, None, stage)
    elif name == "char":
        tok = build_tokenizer(name, (t for _, _, t, _ in iter_corpus(sources, reading, rule)), stage)
    else:
        tok = build_tokenizer(name, (t for s, _, t, _ in iter_corpus(sources, reading, rule) if s == "train"), stage)
    progress["tokenizer"] = tok.spec
    _save_progress(stage, progress)
    return tok


def _meta(tok: Tokenizer, dtype: np.dtype, shards: dict, nbytes: dict, settings: Settings, skipped: int,
          sources: list[Source], hashers: list) -> dict:
    """meta.json's contents (the store dir's name is added when publishing). Split bytes are
    UTF-8 bytes of text (what bits per byte divides by); source bytes are on disk."""
    counts = store.split_counts(shards)
    splits = {s: {"tokens": counts[s]["tokens"], "bytes": nbytes[s], "documents": counts[s]["documents"]}
              for s in SPLITS}
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.spec,
        "tokenizer_name": identity(settings.tokenizer),
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "splits": splits,
        "shards": shards,
        "shard_tokens": settings.shard_tokens,
        "val_fraction": settings.val_fraction,
        "val_documents": settings.val_documents,
        "split_rule": SPLIT_RULE,
        "text_field": settings.text_field,
        "skipped_records": skipped,
        "sources": [{"path": str(s.path.resolve()), "format": file_format(s.path), "bytes": s.size,
                     "mtime_ns": s.mtime_ns, "sha256": h.hexdigest()}
                    for s, h in zip(sources, hashers)],
        "bytes_per_token": _bytes_per_token(splits),
    }


SPLIT_RULE = ("whole documents go to val: the last val_documents, or those ending past the last "
              "val_fraction of the concatenated input bytes on disk (a one-document corpus is cut inside "
              "it; for .gz and .parquet by the position read so far)")


def _bytes_per_token(splits: dict) -> dict:
    return {s: (round(splits[s]["bytes"] / splits[s]["tokens"], 4) if splits[s]["tokens"] else None)
            for s in SPLITS}


def _appended_meta(old: dict, new: dict) -> dict:
    """The meta of the store after appending `new`'s shards to `old`'s."""
    shards = {s: old["shards"][s] + new["shards"][s] for s in SPLITS}
    splits = {s: {k: old["splits"][s][k] + new["splits"][s][k] for k in ("tokens", "bytes", "documents")}
              for s in SPLITS}
    return {**old, "splits": splits, "shards": shards, "sources": old["sources"] + new["sources"],
            "skipped_records": old["skipped_records"] + new["skipped_records"],
            "bytes_per_token": _bytes_per_token(splits)}


def _store_to_append(out_dir: Path, tokenizer: str | None) -> dict:
    """The current meta of the store to append to; it must be a version 2 store, and a given
    tokenizer must be the one it was prepared with."""
    if not (out_dir / "meta.json").is_file():
        raise UserError(f"--append adds to a prepared data dir, and {str(out_dir)!r} holds none; prepare it "
                        f"first without --append")
    meta = load_meta(out_dir)
    if meta["format_version"] < 2:
        raise UserError(f"{str(out_dir)!r} is a single-file data dir (format version 1), which cannot be "
                        f"appended to; prepare all its inputs again into a new --out_dir")
    if tokenizer is not None and identity(tokenizer) != meta.get("tokenizer_name"):
        raise UserError(f"--tokenizer={tokenizer} is not the tokenizer {str(out_dir)!r} was prepared with "
                        f"({_store_tokenizer_name(meta)}); drop --tokenizer to use the store's")
    return meta


def _append_id(old: dict | None) -> str:
    """What an append depends on besides its inputs: the store it adds to, as it is now."""
    if old is None:
        return ""
    return json.dumps([old["store"], {s: len(old["shards"][s]) for s in SPLITS}], sort_keys=True)


def _store_tokenizer_name(meta: dict) -> str:
    """The store's tokenizer as `identity` names it (for hf:PATH, its spec)."""
    name = meta.get("tokenizer_name")
    if not isinstance(name, str) or not name:
        raise UserError("the data dir's meta.json has no tokenizer_name; re-prepare it without --append")
    return name


def _new_files(files: list[Path], old: dict, out_dir: Path) -> list[Path]:
    """The inputs not already in the store; none is an error. One the store holds (its resolved
    path) must be as it was prepared, in size and sha256 (read again only where its mtime has
    changed): an edited file went in a second time, or with its size unchanged not at all."""
    have = {str(Path(s["path"]).resolve()): s for s in old["sources"]}
    new = []
    for f in files:
        src, st = have.get(str(f.resolve())), f.stat()
        if src is None:
            new.append(f)
        elif st.st_size != src["bytes"] or (src.get("mtime_ns") != st.st_mtime_ns and "sha256" in src
                                            and hash_file(f, hashlib.sha256()).hexdigest() != src["sha256"]):
            raise UserError(f"{str(f)!r} has changed since it was prepared into {str(out_dir)!r}; prepare "
                            f"the store again without --append, or leave that file out")
        else:
            src["mtime_ns"] = st.st_mtime_ns  # the same content: not read again next time
    if not new:
        raise UserError(f"every input is already in {str(out_dir)!r}; pass new files to --append")
    return new


# What meta.json may hold (format versions 1 and 2).
META_KEYS = frozenset({"format_version", "store", "tokenizer", "tokenizer_name", "vocab_size", "dtype", "splits",
                       "shards", "shard_tokens", "val_fraction", "val_documents", "split_rule", "text_field",
                       "skipped_records", "sources", "bytes_per_token"})


def load_meta(data_dir: str | os.PathLike) -> dict:
    """Read and check a prepared data dir's meta.json: its format version, fields and types (it
    is a file a user may edit), and that every shard it names exists with the recorded size."""
    d = Path(data_dir)
    how = f"prepare it with: python -m gpt.data --input YOUR_TEXT_FILES --tokenizer gpt2 --out_dir {d}"
    if not d.is_dir():
        raise UserError(f"data dir {str(d)!r} does not exist; {how}")
    path = d / "meta.json"
    if not path.is_file():
        raise UserError(f"{str(d)!r} is not a prepared data dir (no meta.json); {how}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"{str(path)!r} is unreadable ({str(e) or type(e).__name__}); {how}") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version not in store.READS:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise UserError(f"{str(d)!r} was prepared with data format version {version!r}, this code reads "
                        f"versions {', '.join(map(str, store.READS))}; "
                        + ("update this code (git pull)" if newer else f"re-prepare it ({how})"))
    unknown = sorted(set(meta) - META_KEYS)
    if unknown:
        raise UserError(f"{str(path)!r} has keys this code never writes ({', '.join(unknown[:5])}): it was "
                        f"written by other code or edited; remove them or re-prepare it ({how})")
    try:
        counts = [meta["vocab_size"]] + [meta["splits"][s][k] for s in SPLITS for k in ("tokens", "bytes")]
        if meta["dtype"] not in ("uint16", "uint32") or not isinstance(meta["tokenizer"], dict) \
                or not all(_is_count(c) for c in counts) or meta["vocab_size"] < 1:
            raise ValueError("a field has the wrong type")
        store.check_index(d, meta, how)
        _check_bytes_per_token(meta.get("bytes_per_token", {}))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"{str(path)!r} is incomplete or malformed; re-prepare it ({how})") from None
    if meta["tokenizer"].get("vocab_size", meta["vocab_size"]) != meta["vocab_size"]:  # a model sized by it
        raise UserError(f"{str(path)!r} gives vocab_size {meta['vocab_size']}, its tokenizer "
                        f"{meta['tokenizer'].get('vocab_size')!r}: it was edited; re-prepare it ({how})")
    return meta


def _check_bytes_per_token(bpt) -> None:
    """meta.json's bytes_per_token: a positive number or null for each split (what evaluation
    divides by for bits per byte); anything else is ValueError."""
    if not isinstance(bpt, dict) or set(bpt) - set(SPLITS):
        raise ValueError("bytes_per_token is not {split: number}")
    for v in bpt.values():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ValueError("bytes_per_token holds a value that is not a positive number")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_split_sizes(meta: dict, block_size: int) -> None:
    """Some shard of each split needs at least block_size+1 tokens to cut one (input, target)
    window from (windows never straddle shards)."""
    need = int(block_size) + 1
    for split in SPLITS:
        shards = store.shard_index(meta, split)
        have = max((int(sh["tokens"]) for sh in shards), default=0)
        if have < need:
            hint = "a larger --val_fraction when preparing" if split == "val" else "more text"
            where = " in its largest shard" if len(shards) > 1 else ""
            raise UserError(f"the {split} split has {have} tokens{where}, but block_size={block_size} needs at "
                            f"least {need}; use a smaller --block_size or {hint}")


# How inputs are read and split (gpt/corpus.py): a change re-prepares cached stores and never resumes
# an interrupted preparation made by the old reading. 2: .json as JSON lines, .gz split by its text
READER_VERSION = 2


def cache_key(files: list[Path], settings: Settings) -> str:
    """Hash of everything that determines a prepared data dir (files by path, size and mtime)."""
    items = []
    for f in files:
        st = f.stat()
        items.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format_version": FORMAT_VERSION, "reader": READER_VERSION,
                       **dataclasses.asdict(settings), "sources": items}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def ensure_prepared(input_paths: Sequence[str | os.PathLike], tokenizer: str, cache_root: str | os.PathLike,
                    prepare_missing: bool = True, **kw) -> Path:
    """Prepare `input_paths` into a cache dir named by a hash of inputs and settings, or reuse it.

    The key covers each file's resolved path, size and mtime, the tokenizer (for hf:PATH its
    content), every setting of `Settings` and FORMAT_VERSION, so editing a file or changing a
    setting re-prepares; a second call with the same inputs returns at once without
    re-tokenizing; an interrupted one resumes. With prepare_missing=False (the other processes
    of a multi-host job, after process 0 prepared it), a missing dir is an error instead.
    """
    include = include_patterns(kw.get("include", DEFAULT_INCLUDE))
    kind, _ = parse_name(tokenizer)
    files = resolve_inputs(input_paths, include)
    fields = {f.name for f in dataclasses.fields(Settings)}
    settings = Settings(identity(tokenizer), **{k: v for k, v in {**kw, "include": include}.items() if k in fields})
    key = cache_key(files, settings)
    warn_unused_text_field(settings.text_field, [file_format(f) for f in files])  # train.py's --text_field
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in files[0].stem)[:40]
    label = kind if kind == "hf" else tokenizer.replace(":", "")
    name = f"{stem}{'-etc' if len(files) > 1 else ''}-{label}-{key[:12]}"
    d = Path(cache_root) / name
    if _prepared(d) is not None:
        return d
    if not prepare_missing:
        raise UserError(f"process 0 prepared the data into {d}, which this process cannot read; the cache "
                        f"must be on a filesystem every host shares (set GPT_DATA_CACHE=DIR)")
    print(f"preparing {len(files)} file(s) with tokenizer {label} into {d} (once: later runs reuse it)",
          flush=True)
    prepare(files, tokenizer, d, reuse=True, **kw)  # another run may prepare it while this one waits
    return d


def check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise UserError(f"{name}={value!r} must be an integer >= {lo}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# Command line

def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m gpt.data", description="Tokenize text, JSONL and Parquet files into a store "
                  "of token shards + meta.json for training.")
    p.add_paths("--input", required=True, help="files (.txt, .txt.gz, .jsonl, .jsonl.gz, .parquet; .json "
                "and .json.gz are JSON lines too), folders (searched recursively) or glob patterns")
    p.add_argument("--tokenizer", default=None, help="gpt2 | char | bpe:N (train a byte-level BPE with N tokens) | "
                   "hf:PATH (a Hugging Face tokenizer.json, or the directory holding it); required unless --append")
    p.add_argument("--out_dir", required=True, help="data dir to write")
    p.add_argument("--val_fraction", type=float, default=None,
                   help="whole documents past the last fraction of the bytes go to validation (default 0.1)")
    p.add_argument("--val_documents", type=int, default=None,
                   help="instead: the last N documents (files, JSONL lines, Parquet rows) go to validation")
    p.add_argument("--include", default=",".join(DEFAULT_INCLUDE),
                   help="file name patterns for folders, comma-separated (default: %(default)s)")
    p.add_argument("--text_field", default="text",
                   help="JSONL key (dotted path for nested objects, e.g. meta.body) or Parquet column "
                        "holding each record's text (default: text)")
    p.add_argument("--skip_bad_records", action="store_true",
                   help="skip (and count) JSONL lines / Parquet rows that are not JSON or lack a string "
                        "text field, instead of stopping")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="invalid UTF-8: strict = error, replace = U+FFFD")
    p.add_argument("--shard_tokens", type=int, default=store.SHARD_TOKENS,
                   help="tokens per shard file (default %(default)s)")
    p.add_argument("--append", action="store_true",
                   help="add the inputs not already in --out_dir's store to it, as new shards")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    args = p.parse_args(argv)
    if args.val_fraction is not None and args.val_documents is not None:  # one would be ignored
        raise UserError("--val_fraction and --val_documents both choose the validation split; pass one of them")
    args.val_fraction = 0.1 if args.val_fraction is None else args.val_fraction
    before = _source_count(args.out_dir) if args.append else 0
    t0 = time.perf_counter()
    meta = prepare(args.input, args.tokenizer, args.out_dir, val_fraction=args.val_fraction,
                   val_documents=args.val_documents, include=args.include, errors=args.errors,
                   workers=args.workers, text_field=args.text_field, skip_bad_records=args.skip_bad_records,
                   shard_tokens=args.shard_tokens, append=args.append)
    print(_summary(args, meta, time.perf_counter() - t0, before))
    warn_unused_text_field(args.text_field, [src["format"] for src in meta["sources"]])
    return 0


def warn_unused_text_field(text_field: str, formats: Sequence[str]) -> None:
    """A --text_field other than the default names a record field, which plain text has none of."""
    if text_field != "text" and all(f in ("txt", "txt.gz") for f in formats):
        print(f"warning: --text_field={text_field} was not used: every input is plain text (it names the "
              f"field of .jsonl/.json records or a .parquet column)", file=sys.stderr)


def _source_count(out_dir: str) -> int:
    """How many inputs out_dir's store holds before an --append (0 where none: prepare says why)."""
    try:
        return len(json.loads((Path(out_dir) / "meta.json").read_text(encoding="utf-8"))["sources"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return 0


def _val_documents(val: dict) -> str:
    """The val split's documents for the summary: a one-document corpus is cut inside (SPLIT_RULE),
    which "0 document(s)" beside its val tokens misdescribed."""
    n = val.get("documents", "?")
    return "the end of the one document" if n == 0 and val["tokens"] else f"{n} document(s)"


def _summary(args, meta: dict, seconds: float, before: int = 0) -> str:
    """One line: the files read (with --append, those appended: they follow the store's earlier
    sources), their MB and speed, then the store's vocabulary, tokens and shards."""
    new = meta["sources"][before:]
    total = sum(s["bytes"] for s in new)
    sp, n_shards = meta["splits"], sum(len(store.shard_index(meta, s)) for s in SPLITS)
    now = f"; now {len(meta['sources'])} file(s)" if args.append else ""
    return (f"{'appended to' if args.append else 'prepared'} {args.out_dir}: {len(new)} file(s), "
            f"{total / 1e6:.1f} MB in {seconds:.1f}s ({total / 1e6 / max(seconds, 1e-9):.1f} MB/s){now}; "
            f"vocab {meta['vocab_size']} ({meta['dtype']}); "
            f"train {sp['train']['tokens']:,} tokens, val {sp['val']['tokens']:,} tokens "
            f"({_val_documents(sp['val'])}), {n_shards} shard(s)"
            + (f"; skipped {meta['skipped_records']:,} bad record(s)" if args.skip_bad_records else ""))


if __name__ == "__main__":
    run_main(main)
