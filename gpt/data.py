"""Data: turn text, JSONL and Parquet files into token files, and sample training batches from them.

Preparation (`prepare`, or ``python -m gpt.data``) writes, into a data dir:

    train.bin, val.bin   the token stream of each split, flat np.uint16 (uint32 if vocab > 65536)
    meta.json            format version, tokenizer spec, dtype, token/byte counts, source hashes
    tokenizer files      e.g. tokenizer.tiktoken for bpe:N (see Tokenizer.files())

Reading the inputs (formats, the train/val split, documents, pieces): gpt/corpus.py. Here:

- Parallelism: for corpora over 16 MiB, pieces are tokenized by a spawn process pool (spawn,
  not fork: the caller may have JAX threads running). On the 2-core benchmark machine, idle,
  this gave 46 MB/s for gpt2 against 27 MB/s inline and only 13 MB/s for a thread pool: tiktoken
  releases the GIL, yet threads lost to the reader thread contending for it (BENCHMARKS.md).
  Small corpora are tokenized inline, where starting workers would cost more than it saves.
- Atomicity: everything is written into a hidden staging dir inside out_dir and renamed into
  place at the end, meta.json last; an interrupted or failed prepare leaves no meta.json for
  the new data (the previous data dir, if any, stays intact until the final renames).

Batches are windows at random offsets of the memory-mapped split. The randomness of batch i is
``np.random.default_rng([seed, i])``, so the sampler state is two integers and is saved in
checkpoints as JSON; each process of a multi-host run takes its rows of the same global batch.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from gpt.corpus import (CHUNK_BYTES, DEFAULT_INCLUDE, Include, Reading, Source, make_sources, file_format,
                        include_patterns, iter_corpus, resolve_inputs, val_cut)
from gpt.errors import ArgParser, UserError, run_main
from gpt.tokenizer import (Tokenizer, atomic_write_bytes, build_tokenizer, identity, load_tokenizer,
                           parse_name)

FORMAT_VERSION = 1
SPLITS = ("train", "val")


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


def _process_encode(text: str, dtype: str) -> np.ndarray:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_array(text, dtype)


BACKENDS = ("auto", "process", "thread")
MIN_PARALLEL_BYTES = 16 * CHUNK_BYTES  # below this, starting worker processes costs more than it saves


def _make_executor(backend: str, workers: int, total_bytes: int, tok: Tokenizer, base_dir: Path) -> Executor | None:
    """The pool that tokenizes pieces, or None to tokenize inline in this thread.

    "auto" (default): inline for small corpora or one worker, else a spawn process pool, which
    bench/data.py measured fastest (see BENCHMARKS.md). Workers rebuild the tokenizer from its
    spec and files in `base_dir`; each piece travels as a str and comes back as a token array.
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


def _tokenize_to_files(stream: Iterator[tuple[str, int, str | None]], tok: Tokenizer, dtype: np.dtype,
                       outs: dict, executor: Executor | None, workers: int) -> dict:
    """Tokenize the pieces of `stream` (in parallel, results kept in order) and append them to
    the open split files `outs`; returns per-split token and byte counts."""
    counts = {s: {"tokens": 0, "bytes": 0} for s in SPLITS}
    in_flight: deque = deque()
    max_in_flight = 2 * workers if executor is not None else 0  # bounded: memory stays flat

    def drain(limit: int) -> None:
        while len(in_flight) > limit:
            split, item = in_flight.popleft()
            try:
                arr = item if isinstance(item, np.ndarray) else item.result()
            except BrokenProcessPool:
                raise UserError("tokenizer worker processes died (out of memory, or prepare() was called "
                                "from a script without an `if __name__ == '__main__':` guard, which "
                                "spawned workers need); fix that or pass workers=1") from None
            arr.tofile(outs[split])
            counts[split]["tokens"] += int(arr.size)

    eot = np.array([tok.eot_id if tok.eot_id is not None else 0], dtype=dtype)
    for split, nbytes, text in stream:
        counts[split]["bytes"] += nbytes
        if text is None:
            in_flight.append((split, eot))
        elif executor is None:
            in_flight.append((split, tok.encode_array(text, dtype)))
        elif isinstance(executor, ProcessPoolExecutor):
            in_flight.append((split, executor.submit(_process_encode, text, dtype.name)))
        else:
            in_flight.append((split, executor.submit(tok.encode_array, text, dtype)))
        drain(max_in_flight)
    drain(0)
    return counts


def _staging_dir(out_dir: Path) -> tuple[Path, bool]:
    """Create out_dir (if needed) and a hidden staging dir in it; unwritable is a UserError."""
    created = not out_dir.exists()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"out_dir {str(out_dir)!r} exists and is not a folder; choose another --out_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    except OSError as e:
        raise UserError(f"cannot write to out_dir {str(out_dir)!r} ({e.strerror}); choose a writable "
                        f"--out_dir") from None
    return stage, created


def prepare(inputs: Sequence[str | os.PathLike], tokenizer: str, out_dir: str | os.PathLike, *,
            val_fraction: float = 0.1, include: Include = DEFAULT_INCLUDE, errors: str = "strict",
            workers: int | None = None, backend: str = "auto", text_field: str = "text",
            skip_bad_records: bool = False) -> dict:
    """Tokenize text, JSONL and Parquet files into ``out_dir/{train,val}.bin`` + meta.json;
    returns the meta dict.

    inputs: files, folders (recursive, files matching any `include` pattern) or glob patterns;
    .txt/.txt.gz files are one document each, .jsonl/.jsonl.gz lines and .parquet rows one
    document each, their text at `text_field` (a JSON key or dotted path, or a Parquet column).
    tokenizer: "gpt2" | "char" | "bpe:N" | "hf:PATH" (char and bpe:N are learned from this corpus
    first; hf:PATH is a Hugging Face tokenizer.json, copied into out_dir).
    errors: "strict" (invalid UTF-8 is an error) or "replace" (bad bytes become U+FFFD).
    skip_bad_records: skip (and count) records that are not JSON or lack a string text field,
    instead of stopping with an error.
    workers: parallel tokenizer workers (default: all cores); backend: "auto" | "process" |
    "thread" (see `_make_executor`).
    """
    _check_prepare_args(tokenizer, backend, errors, val_fraction, text_field)
    reading = Reading(errors, text_field, bool(skip_bad_records))
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    sources = make_sources(resolve_inputs(inputs, include))
    total = sum(s.size for s in sources)
    if total == 0:
        raise UserError(f"the corpus is empty ({len(sources)} file(s), 0 bytes); pass non-empty text files")
    cut = val_cut(total, val_fraction)
    out_dir = Path(out_dir)
    stage, created = _staging_dir(out_dir)
    try:
        tok = _learn_tokenizer(tokenizer, sources, reading, cut, stage)
        dtype = token_dtype(tok.vocab_size)
        hashers = [hashlib.sha256() for _ in sources]
        stats = {"skipped": 0}
        stream = iter_corpus(sources, reading, cut, eot=tok.eot_id is not None, hashers=hashers, stats=stats)
        counts = _write_splits(stream, tok, dtype, stage, backend, workers, total)
        if counts["train"]["bytes"] + counts["val"]["bytes"] == 0:
            raise UserError(f"the corpus is empty ({len(sources)} file(s), {total} bytes, but no text in any "
                            f"record); pass files with text, or check --text_field={text_field}")
        meta = _meta(tok, dtype, counts, val_fraction, reading, stats["skipped"], sources, hashers)
        _publish(stage, out_dir, ["train.bin", "val.bin", *tok.files()], meta)
        return meta
    except OSError as e:
        raise UserError(f"cannot read or write {e.filename or str(out_dir)!r} ({e.strerror}); check "
                        f"permissions and free space, or choose another --out_dir") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if created and out_dir.is_dir() and not (out_dir / "meta.json").exists():
            shutil.rmtree(out_dir, ignore_errors=True)


def _meta(tok: Tokenizer, dtype: np.dtype, counts: dict, val_fraction: float, reading: Reading,
          skipped: int, sources: list[Source], hashers: list) -> dict:
    """meta.json's contents. Split bytes are UTF-8 bytes of text (what bits per byte divides by);
    source bytes are on disk."""
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.spec,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "splits": counts,
        "val_fraction": val_fraction,
        "split_rule": "last val_fraction of the concatenated input bytes on disk is val (whole records "
                      "for .jsonl/.parquet; by compressed position for .gz)",
        "text_field": reading.text_field,
        "skipped_records": skipped,
        "sources": [{"path": str(s.path), "format": file_format(s.path), "bytes": s.size,
                     "sha256": h.hexdigest()} for s, h in zip(sources, hashers)],
        "bytes_per_token": {s: (round(counts[s]["bytes"] / counts[s]["tokens"], 4)
                                if counts[s]["tokens"] else None) for s in SPLITS},
    }


def _check_prepare_args(tokenizer: str, backend: str, errors: str, val_fraction: float,
                        text_field: str = "text") -> None:
    parse_name(tokenizer)  # unknown tokenizer: fail before touching anything
    if backend not in BACKENDS:
        raise UserError(f"backend {backend!r} is not valid; use one of {', '.join(BACKENDS)}")
    if errors not in ("strict", "replace"):
        raise UserError(f"errors={errors!r} is not valid; use strict or replace")
    if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction={val_fraction!r} must be in [0, 1), e.g. 0.1")
    if not isinstance(text_field, str) or not text_field:
        raise UserError(f"text_field={text_field!r} must name a JSON key or Parquet column, e.g. text")


def _learn_tokenizer(tokenizer: str, sources, reading: Reading, cut: int, stage: Path):
    """The tokenizer; char learns from all the text, bpe from the train split only (val unseen)."""
    if tokenizer == "gpt2" or tokenizer.startswith("hf:"):
        return build_tokenizer(tokenizer, None, stage)
    if tokenizer == "char":
        return build_tokenizer(tokenizer, (t for _, _, t in iter_corpus(sources, reading, cut) if t), stage)
    train_texts = (t for split, _, t in iter_corpus(sources, reading, cut) if split == "train" and t)
    return build_tokenizer(tokenizer, train_texts, stage)


def _write_splits(stream, tok, dtype, stage: Path, backend: str, workers: int, total: int) -> dict:
    """Tokenize the stream into stage/{train,val}.bin (fsynced); returns the per-split counts."""
    executor = _make_executor(backend, workers, total, tok, stage)
    try:
        with open(stage / "train.bin", "wb") as ftrain, open(stage / "val.bin", "wb") as fval:
            counts = _tokenize_to_files(stream, tok, dtype, {"train": ftrain, "val": fval}, executor,
                                        workers)
            for f in (ftrain, fval):
                f.flush()
                os.fsync(f.fileno())
        return counts
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)


def _publish(stage: Path, out_dir: Path, names: list[str], meta: dict) -> None:
    """Drop any old meta.json first so old meta never describes new files, move the data and
    tokenizer files into place, and write meta.json last."""
    (out_dir / "meta.json").unlink(missing_ok=True)
    for name in names:
        os.replace(stage / name, out_dir / name)
    atomic_write_bytes(out_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())


def load_meta(data_dir: str | os.PathLike) -> dict:
    """Read and check a prepared data dir's meta.json (and that the .bin files match it)."""
    d = Path(data_dir)
    how = f"prepare it with: python -m gpt.data --input YOUR_TEXT_FILES --tokenizer gpt2 --out_dir {d}"
    if not d.is_dir():
        raise UserError(f"data dir {str(d)!r} does not exist; {how}")
    path = d / "meta.json"
    if not path.is_file():
        raise UserError(f"{str(d)!r} is not a prepared data dir (no meta.json); {how}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{str(path)!r} is unreadable ({e}); {how}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise UserError(f"{str(d)!r} was prepared with data format version {got!r}, this code reads "
                        f"version {FORMAT_VERSION}; re-prepare it ({how})")
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in SPLITS:
            want = int(meta["splits"][split]["tokens"]) * itemsize
            f = d / f"{split}.bin"
            if not f.is_file() or f.stat().st_size != want:
                raise UserError(f"{str(f)!r} is missing or does not match meta.json ({want} bytes expected); "
                                f"the data dir is corrupt, re-prepare it ({how})")
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{str(path)!r} is incomplete or malformed; re-prepare it ({how})") from None
    return meta


def check_split_sizes(meta: dict, block_size: int) -> None:
    """Each split needs at least block_size+1 tokens to cut one (input, target) window from."""
    need = int(block_size) + 1
    for split in SPLITS:
        have = int(meta["splits"][split]["tokens"])
        if have < need:
            hint = "a larger --val_fraction when preparing" if split == "val" else "more text"
            raise UserError(f"the {split} split has {have} tokens, but block_size={block_size} needs at "
                            f"least {need}; use a smaller --block_size or {hint}")


def cache_key(files: list[Path], tokenizer: str, *, val_fraction: float, include: Include, errors: str,
              text_field: str = "text", skip_bad_records: bool = False) -> str:
    """Hash of everything that determines a prepared data dir (files by path, size and mtime)."""
    items = []
    for f in files:
        st = f.stat()
        items.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format_version": FORMAT_VERSION, "tokenizer": tokenizer, "val_fraction": val_fraction,
                       "include": list(include_patterns(include)), "errors": errors, "text_field": text_field,
                       "skip_bad_records": bool(skip_bad_records), "sources": items}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def ensure_prepared(input_paths: Sequence[str | os.PathLike], tokenizer: str, cache_root: str | os.PathLike,
                    **kw) -> Path:
    """Prepare `input_paths` into a cache dir named by a hash of inputs and settings, or reuse it.

    The key covers each file's resolved path, size and mtime, the tokenizer, val_fraction,
    include, errors, text_field, skip_bad_records and FORMAT_VERSION, so editing a file or
    changing a setting re-prepares; a second call with the same inputs returns at once without
    re-tokenizing.
    """
    include = kw.get("include", DEFAULT_INCLUDE)
    kind, _ = parse_name(tokenizer)
    files = resolve_inputs(input_paths, include)
    key = cache_key(files, identity(tokenizer), val_fraction=kw.get("val_fraction", 0.1), include=include,
                    errors=kw.get("errors", "strict"), text_field=kw.get("text_field", "text"),
                    skip_bad_records=kw.get("skip_bad_records", False))
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in files[0].stem)[:40]
    label = kind if kind == "hf" else tokenizer.replace(":", "")
    name = f"{stem}{'-etc' if len(files) > 1 else ''}-{label}-{key[:12]}"
    d = Path(cache_root) / name
    if (d / "meta.json").is_file():
        try:
            load_meta(d)
            return d
        except UserError:
            pass  # stale or corrupt: prepare again below
    prepare(files, tokenizer, d, **kw)
    return d


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise UserError(f"{name}={value!r} must be an integer >= {lo}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# Batches

class Batches:
    """Random (x, y) windows from one split of a prepared data dir.

    Batch i uses ``np.random.default_rng([seed, i])`` to draw the offsets of the whole *global*
    batch, and this process keeps rows [process_index*B/P, (process_index+1)*B/P): every process
    agrees on the global batch without communicating, and the state is just {seed, index}.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, block_size: int, batch_size: int, *,
                 seed: int, process_index: int = 0, process_count: int = 1):
        if split not in SPLITS:
            raise UserError(f"split {split!r} is not valid; use train or val")
        self.block_size = _check_int("block_size", block_size, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.process_count = _check_int("process_count", process_count, 1)
        self.process_index = _check_int("process_index", process_index, 0)
        if self.process_index >= self.process_count:
            raise UserError(f"process_index={process_index} must be < process_count={process_count}")
        if self.batch_size % self.process_count:
            raise UserError(f"batch_size={batch_size} (global) is not divisible by the {process_count} "
                            f"processes; use a multiple of {process_count}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.meta = load_meta(self.data_dir)
        check_split_sizes(self.meta, self.block_size)
        # Opened once: re-creating the memmap per batch (as nanoGPT does) leaks memory.
        self.data = np.memmap(self.data_dir / f"{split}.bin", dtype=np.dtype(self.meta["dtype"]), mode="r")
        self.n_tokens = int(self.data.shape[0])
        self.local_batch_size = self.batch_size // self.process_count
        self.index = 0

    def offsets(self, index: int) -> np.ndarray:
        """Start offsets of the global batch `index`, in [0, n_tokens - block_size - 1]."""
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, self.n_tokens - self.block_size, size=self.batch_size)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """This process's rows of the next batch: int32 x, y of shape [B_local, block_size]."""
        lo = self.process_index * self.local_batch_size
        offs = self.offsets(self.index)[lo:lo + self.local_batch_size]
        self.index += 1
        windows = np.stack([self.data[o:o + self.block_size + 1] for o in offs]).astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    __next__ = next

    def __iter__(self) -> Batches:
        return self

    def state(self) -> dict:
        return {"seed": self.seed, "index": self.index}

    def restore(self, state: dict) -> None:
        if not isinstance(state, dict) or "seed" not in state or "index" not in state:
            raise UserError(f"data loader state {state!r} is malformed (needs seed and index); "
                            f"the checkpoint may be corrupt")
        self.seed = _check_int("seed", state["seed"], 0)
        self.index = _check_int("index", state["index"], 0)


# ---------------------------------------------------------------------------------------------
# Command line

def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m gpt.data", description="Tokenize text, JSONL and Parquet files into "
                  "train.bin/val.bin + meta.json for training.")
    p.add_paths("--input", required=True, help="files (.txt, .txt.gz, .jsonl, .jsonl.gz, .parquet), "
                "folders (searched recursively) or glob patterns")
    p.add_argument("--tokenizer", required=True, help="gpt2 | char | bpe:N (train a byte-level BPE with N tokens) | "
                   "hf:PATH (a Hugging Face tokenizer.json, or the directory holding it)")
    p.add_argument("--out_dir", required=True, help="data dir to write")
    p.add_argument("--val_fraction", type=float, default=0.1, help="last fraction of the bytes used for validation")
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
    p.add_argument("--workers", type=int, default=None, help="tokenizer threads (default: all cores)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    meta = prepare(args.input, args.tokenizer, args.out_dir, val_fraction=args.val_fraction,
                   include=args.include, errors=args.errors, workers=args.workers,
                   text_field=args.text_field, skip_bad_records=args.skip_bad_records)
    dt = time.perf_counter() - t0
    total = sum(s["bytes"] for s in meta["sources"])
    sp = meta["splits"]
    print(f"prepared {args.out_dir}: {len(meta['sources'])} file(s), {total / 1e6:.1f} MB in {dt:.1f}s "
          f"({total / 1e6 / max(dt, 1e-9):.1f} MB/s); tokenizer {args.tokenizer} (vocab {meta['vocab_size']}, "
          f"{meta['dtype']}); train {sp['train']['tokens']:,} tokens, val {sp['val']['tokens']:,} tokens"
          + (f"; skipped {meta['skipped_records']:,} bad record(s)" if args.skip_bad_records else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
