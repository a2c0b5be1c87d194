"""Data: turn text, JSONL and Parquet files into token files, and sample training batches from them.

Preparation (`prepare`, or ``python -m gpt.data``) writes, into a data dir:

    train.bin, val.bin   the token stream of each split, flat np.uint16 (uint32 if vocab > 65536)
    meta.json            format version, tokenizer spec, dtype, token/byte counts, source hashes
    tokenizer files      e.g. tokenizer.tiktoken for bpe:N (see Tokenizer.files())

Choices, and why:

- Formats, by suffix (`file_format`): .txt (and any unknown suffix) and .txt.gz are one
  document each; each line of .jsonl/.jsonl.gz and each row of .parquet is one document, its
  text at `text_field` (a JSON key, or a dotted path into nested objects; a Parquet column, of
  which only that one is read, in batches of rows through pyarrow). gzip and JSON use the
  standard library, streaming. A record that is not JSON, lacks the field or holds no string
  there is a UserError naming file and line/row, or with `skip_bad_records` is skipped and
  counted (meta.json's skipped_records). Folders take every supported suffix by default.
- Split: the corpus is the concatenation of the input files, in order; the last `val_fraction`
  of its *bytes on disk* is the validation split (nanoGPT's ``data[:int(n*0.9)]``; for the
  bundled Shakespeare with the char tokenizer this gives nanoGPT's exact 1,003,854 / 111,540
  tokens). In .txt files the cut is exact, moved back to the nearest character boundary.
  Compressed and record files do not tell their text size before they are read, so there a
  piece or record is val once the file's on-disk position (compressed bytes read, a line's end,
  rows read as a share of the file) passes the cut: records go to val whole, and the split is
  an estimate (see `_source_pieces`). Cutting by bytes lets us decide the split before
  tokenizing, so everything streams in one pass. The split byte counts in meta.json are bytes of
  UTF-8 text (what bits per byte divide by); the source sizes are on disk.
- Documents: files and records are documents; where the tokenizer has an end-of-text token it is
  written *between* non-empty documents (not after the last), in the split where the next one
  starts.
- Streaming: files are read in ~1 MiB pieces (64 KiB for .txt.gz, which bounds how far its
  split can miss; a record is a piece of its own, cut the same way if over 1 MiB) and never
  held whole in memory. A piece ends where
  tokenization cannot see the difference: before a whitespace character that follows a printable
  ASCII character ("word|\\n", "word| next"), where GPT-2's pre-tokenizer regex always ends a
  piece, so the tokens equal encoding each file in one call (tested). Only a 256 KiB stretch
  without any ASCII word boundary (e.g. unspaced CJK) is cut at a character boundary instead,
  which may change a token or two at that cut. Char tokenizers are exact anywhere. Hugging Face
  tokenizers (hf:PATH) have their own pre-tokenizers (Llama 3's joins punctuation with the newline
  after it; SentencePiece's adds a word marker at the start of each call), so for them a piece
  boundary may change a token or two: once per MiB of text.
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

import glob
import gzip
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
import zlib
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, Union

import numpy as np

from gpt.errors import ArgParser, UserError, run_main
from gpt.tokenizer import (Tokenizer, atomic_write_bytes, build_tokenizer, identity, load_tokenizer,
                           parse_name)

FORMAT_VERSION = 1
CHUNK_BYTES = 1 << 20  # bytes read per piece; big enough to amortise overhead, small for memory
SPLITS = ("train", "val")
# Folder search default: every supported format (see `file_format`).
DEFAULT_INCLUDE = ("*.txt", "*.txt.gz", "*.jsonl", "*.jsonl.gz", "*.parquet")
Include = Union[str, Sequence[str]]
_PRINTABLE = frozenset(range(0x21, 0x7F))  # ASCII characters that are neither space nor control


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: uint16 up to 65536 ids (GPT-2), else uint32."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise UserError(f"vocab_size {vocab_size} does not fit in uint32; use a smaller tokenizer")


# ---------------------------------------------------------------------------------------------
# Inputs

def include_patterns(include: Include) -> tuple[str, ...]:
    """`include` as a tuple of patterns: one pattern, comma-separated patterns, or a list."""
    items = include.split(",") if isinstance(include, str) else list(include)
    patterns = tuple(x.strip() for x in items if x.strip())
    if not patterns:
        raise UserError(f"--include {include!r} names no pattern; pass e.g. --include '*.txt,*.jsonl'")
    return patterns


def resolve_inputs(inputs: Sequence[str | os.PathLike], include: Include = DEFAULT_INCLUDE) -> list[Path]:
    """Expand files, folders and glob patterns to a deterministic list of files.

    Inputs keep the order given; a folder contributes its files matching any `include` pattern
    (searched recursively, hidden files and folders skipped) in sorted order; a glob pattern its
    matches in sorted order. Duplicates are dropped. Files named explicitly are taken whatever
    their suffix (an unknown suffix is read as plain text).
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise UserError("no inputs given; pass text files, folders or glob patterns with --input")
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = _folder_files(p, include)
            if not found:
                raise UserError(f"folder {str(p)!r} has no files matching --include "
                                f"{','.join(include_patterns(include))!r}; "
                                f"pass another --include pattern or other inputs")
            files.extend(found)
        elif glob.has_magic(str(raw)):
            matches = sorted(glob.glob(str(raw), recursive=True))
            found = []
            for m in map(Path, matches):
                if m.is_file():
                    found.append(m)
                elif m.is_dir():
                    found.extend(_folder_files(m, include))
            if not found:
                raise UserError(f"no files match the pattern {str(raw)!r}; check the path")
            files.extend(found)
        elif p.exists():
            raise UserError(f"input {str(p)!r} is not a regular file or folder; pass text files or folders")
        else:
            raise UserError(f"input {str(p)!r} does not exist; check the path")
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def _folder_files(folder: Path, include: Include) -> list[Path]:
    """Files under `folder` matching any `include` pattern, sorted; hidden files and folders are
    skipped (.git, editor backups, and prepare's own staging dirs)."""
    found = {f for pattern in include_patterns(include) for f in folder.rglob(pattern)}
    return sorted(f for f in found
                  if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts))


def file_format(path: Path) -> str:
    """How a file is read, by suffix: "parquet" | "jsonl" | "jsonl.gz" | "txt.gz" | "txt".

    Any other ``.gz`` is gzipped text; any other suffix is plain text, so an explicit
    ``--include '*.md'`` or a file named on the command line reads as it always did."""
    name = path.name.lower()
    for suffix in ("parquet", "jsonl.gz", "jsonl"):
        if name.endswith("." + suffix):
            return suffix
    return "txt.gz" if name.endswith(".gz") else "txt"


def _char_boundary(buf: bytes, n: int) -> int:
    """Move cut position n back (at most 3 bytes) so that buf[:n] does not end inside a UTF-8
    sequence, whether or not the rest of the sequence is in `buf` yet (n may be len(buf))."""
    lead = n - 1
    while lead > 0 and n - lead < 4 and (buf[lead] & 0xC0) == 0x80:  # continuation bytes
        lead -= 1
    if lead < 0:
        return n
    b = buf[lead]
    length = 1 if b < 0x80 else 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else \
        4 if 0xF0 <= b < 0xF8 else 1  # an invalid lead byte: leave it to the decoder
    return lead if lead + length > n else n


def find_cut(buf: bytes) -> int:
    """Where to end a piece of `buf` so that tokenizing the pieces separately changes nothing.

    Preferred: just before an ASCII whitespace character (newline, CR, space, tab) that follows a
    printable non-space ASCII character, as in "word|\n" or "word| next". GPT-2's pre-tokenizer
    regex always ends a piece at such a place, and what it does after it does not depend on the
    text before it (no look-behind), so BPE pieces, and hence tokens, are identical; this holds
    for CRLF line ends too. Searched in the last quarter of the buffer so pieces stay large.
    Fallback, for a quarter-MiB without any such place: the last character boundary (inexact).
    """
    lo = len(buf) - len(buf) // 4
    for sep in (b"\n", b" ", b"\r", b"\t"):
        pos = buf.rfind(sep, max(lo, 1))
        for _ in range(64):  # a few tries per separator; "x\n" is found at once in normal text
            if pos <= 0:
                break
            if buf[pos - 1] in _PRINTABLE:
                return pos
            pos = buf.rfind(sep, max(lo, 1), pos)
    return _char_boundary(buf, len(buf))


def iter_file_pieces(path: Path, errors: str, cut: int | None = None, hasher=None,
                     chunk_bytes: int | None = None) -> Iterator[tuple[int, int, str]]:
    """Yield (start, end, text) for consecutive byte ranges of a file, decoded as UTF-8.

    If `cut` is given, a piece boundary falls at that byte offset (moved back to a character
    boundary), so the caller can assign pieces to the train/val split. NUL bytes ("binary") and,
    with errors="strict", invalid UTF-8 are user errors naming the file and byte offset.
    """
    with open(path, "rb") as f:
        yield from _iter_stream_pieces(f, path, errors, cut, hasher, chunk_bytes)


def _iter_stream_pieces(f, path: Path, errors: str, cut: int | None, hasher,
                        chunk_bytes: int | None) -> Iterator[tuple[int, int, str]]:
    """`iter_file_pieces` over an open binary stream (a file, or a gzip reader's output)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    carry, offset = b"", 0
    while True:
        want = chunk_bytes
        if cut is not None and offset + len(carry) < cut:
            want = min(want, cut - offset - len(carry))
        block = f.read(want)
        if hasher is not None:
            hasher.update(block)
        buf = carry + block
        if not buf:
            return
        nul = block.find(b"\x00")
        if nul >= 0:
            at = offset + len(carry) + nul
            raise UserError(f"{str(path)!r} looks binary (NUL byte at offset {at}); pass only text "
                            f"files (use --include to filter folders)")
        if not block:
            n = len(buf)
        elif cut is not None and offset + len(buf) == cut:
            n = _char_boundary(buf, len(buf))
        else:
            n = find_cut(buf)
        piece, carry = buf[:n], buf[n:]
        try:
            text = piece.decode("utf-8", errors=errors)
        except UnicodeDecodeError as e:
            raise UserError(f"{str(path)!r} is not valid UTF-8 (byte 0x{piece[e.start]:02x} at offset "
                            f"{offset + e.start}); convert it to UTF-8 or pass --errors=replace to "
                            f"substitute U+FFFD for bad bytes") from None
        if text:
            yield offset, offset + n, text
        offset += n


@dataclass
class Source:
    path: Path
    size: int  # on disk (compressed, for .gz and .parquet): what the train/val split is cut by


def _sources(files: list[Path]) -> list[Source]:
    return [Source(f, f.stat().st_size) for f in files]


def val_cut(total_bytes: int, val_fraction: float) -> int:
    """Byte offset in the concatenated corpus where the validation split begins."""
    return int(total_bytes * (1.0 - val_fraction))


@dataclass(frozen=True)
class Reading:
    """How inputs are read: invalid UTF-8 (`errors`), the text of a record (`text_field`, a JSON
    key or dotted path, or a Parquet column), and whether a bad record is skipped or an error."""
    errors: str = "strict"
    text_field: str = "text"
    skip_bad_records: bool = False


# A file's pieces: (split, n_bytes, text, starts_a_document); text is never empty.
Pieces = Iterator[tuple[str, int, str, bool]]


def iter_corpus(sources: list[Source], reading: Reading | str, cut: int, eot: bool = False,
                hashers: list | None = None,
                stats: dict | None = None) -> Iterator[tuple[str, int, str | None]]:
    """Yield (split, n_bytes, text) over the whole corpus; text None marks an end-of-text token
    between two non-empty documents (only if `eot`). A .txt file is one document, cut exactly at
    byte `cut` of the concatenated files; records (JSONL lines, Parquet rows) are one document
    each and go to val whole, once the file's on-disk position passes `cut` (see
    `_source_pieces`). `stats["skipped"]` counts the bad records skipped."""
    reading = Reading(errors=reading) if isinstance(reading, str) else reading
    stats = {"skipped": 0} if stats is None else stats
    start = 0  # offset of the current file in the concatenated corpus
    any_before = False
    for i, src in enumerate(sources):
        hasher = hashers[i] if hashers else None
        for split, n, text, new_doc in _source_pieces(src, start, cut, reading, hasher, stats):
            if new_doc and any_before and eot:
                yield split, 0, None
            any_before = True
            yield split, n, text
        start += src.size


def _source_pieces(src: Source, start: int, cut: int, reading: Reading, hasher, stats: dict) -> Pieces:
    """One file's pieces, by format. Plain text is split exactly at the cut; for compressed and
    record files the text size is not known before reading, so the split follows the on-disk
    position instead: a JSONL line's end; for .gz the compressed bytes read so far (ahead of the
    text returned by at most one 8 KiB read plus the reader's buffer, ~128 KiB of text); for
    Parquet the share of rows read times the file size. So the split is an estimate, off by at
    most about that much (a small .gz file falls wholly on one side)."""
    fmt = file_format(src.path)
    if fmt == "txt":
        local_cut = cut - start if start < cut < start + src.size else None
        first = True
        for s, e, text in iter_file_pieces(src.path, reading.errors, local_cut, hasher):
            yield ("train" if start + e <= cut else "val"), e - s, text, first
            first = False
        return
    if fmt == "txt.gz":
        yield from _gzip_text_pieces(src.path, start, cut, reading.errors, hasher)
        return
    records = _parquet_records(src.path, reading, hasher) if fmt == "parquet" else \
        _jsonl_records(src.path, fmt.endswith(".gz"), reading, hasher)
    yield from _record_pieces(src.path, records, start, cut, reading, stats)


GZIP_READ_BYTES = 8192  # compressed bytes per raw read: the gzip reader's position stays this exact


class _Tracked(io.RawIOBase):
    """A raw binary reader that counts the bytes read from the file (its on-disk position, for
    the split) and feeds them to the source hasher, so a compressed file is hashed and read in
    one pass. Reads are capped at GZIP_READ_BYTES (short reads are legal for raw files), so the
    gzip reader cannot run far ahead of the text it has returned."""

    def __init__(self, f, hasher):
        self.f, self.hasher, self.pos = f, hasher, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(memoryview(b)[:GZIP_READ_BYTES]) or 0
        if n and self.hasher is not None:
            self.hasher.update(memoryview(b)[:n])
        self.pos += n
        return n


@contextmanager
def _gzip_errors(path: Path):
    """A broken .gz file as one UserError (gzip raises BadGzipFile, EOFError or zlib.error)."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{str(path)!r} is not a valid gzip file, or is truncated or corrupt ({e}); "
                        f"re-download or re-compress it, or leave it out") from None


def _gzip_text_pieces(path: Path, start: int, cut: int, errors: str, hasher) -> Pieces:
    """A .txt.gz file: one document, decompressed as it streams; a piece is train while the
    compressed bytes read so far end at or before the cut. Pieces are 1/16 of the usual size
    (64 KiB of text), which bounds how far past the cut the split can fall."""
    with open(path, "rb") as raw, _gzip_errors(path):
        tracked = _Tracked(raw, hasher)
        with gzip.GzipFile(fileobj=tracked, mode="rb") as gz:
            first = True
            for s, e, text in _iter_stream_pieces(gz, path, errors, None, None, max(CHUNK_BYTES // 16, 4)):
                yield ("train" if start + tracked.pos <= cut else "val"), e - s, text, first
                first = False


# A record: (on-disk position after it, "line 3" or "row 3", its text, or None and what is wrong).
Records = Iterator[tuple[int, str, str | None, str | None]]


def _record_pieces(path: Path, records: Records, start: int, cut: int, reading: Reading,
                   stats: dict) -> Pieces:
    """Records as pieces: each record is a document, wholly train or wholly val; a bad record is
    a UserError naming the file and line/row, or (skip_bad_records) skipped and counted."""
    for pos, where, text, problem in records:
        if text is not None:
            text, problem = _clean_text(text, reading.errors)
        if problem is not None:
            if not reading.skip_bad_records:
                raise UserError(f"{str(path)!r} {where} {problem}; fix the file, or pass --skip_bad_records "
                                f"to skip such records")
            stats["skipped"] = stats.get("skipped", 0) + 1
            continue
        split = "train" if start + pos <= cut else "val"
        first = True
        for n, piece in _text_pieces(text):
            yield split, n, piece, first
            first = False


def _clean_text(text: str, errors: str) -> tuple[str, str | None]:
    """JSON may hold unpaired surrogates (\\ud800), which are not UTF-8 and no tokenizer takes:
    a bad record, or U+FFFD with errors="replace"."""
    try:
        text.encode("utf-8")
        return text, None
    except UnicodeEncodeError:
        if errors == "replace":
            return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), None
        return text, "holds an unpaired surrogate (not UTF-8; pass --errors=replace to substitute U+FFFD)"


def _text_pieces(text: str) -> Iterator[tuple[int, str]]:
    """(n_bytes, piece) for one record's text: whole if it fits a piece (the usual case), else
    cut where `find_cut` would cut a file, so a huge record still travels in bounded pieces."""
    raw = text.encode("utf-8")
    if len(raw) <= CHUNK_BYTES:
        if raw:
            yield len(raw), text
        return
    size, pos = max(CHUNK_BYTES, 4), 0  # a window of >= 4 bytes always holds a whole character
    while pos < len(raw):
        window = raw[pos:pos + size]
        n = len(window) if pos + len(window) == len(raw) else find_cut(window)
        yield n, window[:n].decode("utf-8")
        pos += n


def _field(obj, field: str) -> tuple[str | None, str | None]:
    """The record's text at `field` (a key, or a dotted path into nested objects): (text, None),
    or (None, what is wrong)."""
    if not isinstance(obj, dict):
        return None, f"is a JSON {type(obj).__name__}, not an object with a {field!r} field"
    value = obj
    if field in obj:
        value = obj[field]
    else:
        for part in field.split("."):
            if not isinstance(value, dict) or part not in value:
                keys = ", ".join(map(str, obj)) or "none"
                return None, f"has no field {field!r} (top-level keys: {keys}; pass --text_field=NAME)"
            value = value[part]
    if not isinstance(value, str):
        return None, f"has {_kind(value)} in field {field!r}, not a string"
    return value, None


def _kind(value) -> str:
    """A JSON-ish name for a value's type, for error messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _jsonl_records(path: Path, gzipped: bool, reading: Reading, hasher) -> Records:
    """A JSON-lines file (optionally gzipped), streamed line by line; blank lines are ignored.
    The position is the line's end, or for .gz the compressed bytes read so far."""
    with open(path, "rb") as raw, _gzip_errors(path):
        tracked = _Tracked(raw, hasher)
        f = gzip.GzipFile(fileobj=tracked, mode="rb") if gzipped else io.BufferedReader(tracked, CHUNK_BYTES)
        with f:
            offset = 0
            for lineno, line in enumerate(f, 1):
                offset += len(line)
                if not line.strip():
                    continue
                pos = tracked.pos if gzipped else offset
                try:
                    obj = json.loads(line.decode("utf-8", reading.errors))
                except UnicodeDecodeError:
                    yield pos, f"line {lineno}", None, ("is not valid UTF-8 (pass --errors=replace to "
                                                        "substitute U+FFFD)")
                    continue
                except json.JSONDecodeError as e:
                    yield pos, f"line {lineno}", None, f"is not valid JSON ({e.msg} at column {e.colno})"
                    continue
                text, problem = _field(obj, reading.text_field)
                yield pos, f"line {lineno}", text, problem


def _parquet_records(path: Path, reading: Reading, hasher) -> Records:
    """A Parquet file's `text_field` column, streamed in batches of rows (only that column is
    read). The position is the share of rows read times the file size."""
    pq, arrow_error = _pyarrow()
    field, size = reading.text_field, path.stat().st_size
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if field not in names:
            raise UserError(f"{str(path)!r} has no column {field!r} (columns: {', '.join(names) or 'none'}); "
                            f"pass --text_field=NAME with the column that holds the text")
        total, row = max(pf.metadata.num_rows, 1), 0
        for batch in pf.iter_batches(batch_size=1024, columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                ok = isinstance(value, str)
                yield (size * row // total, f"row {row}", value if ok else None,
                       None if ok else f"has {_kind(value)} in column {field!r}, not a string")
    except arrow_error as e:
        raise UserError(f"{str(path)!r} is not a readable Parquet file ({e}); check that it is Parquet "
                        f"and complete, or leave it out") from None
    if hasher is not None:
        _hash_file(path, hasher)


def _pyarrow():
    """pyarrow.parquet and the base of its exceptions, imported only when a .parquet is read."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading .parquet files needs pyarrow; pip install pyarrow "
                        "(it is in requirements.txt)") from None
    return pq, pyarrow.ArrowException


def _hash_file(path: Path, hasher) -> None:
    """Feed a whole file to `hasher` (Parquet is read by pyarrow, out of order)."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            hasher.update(block)


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
    sources = _sources(resolve_inputs(inputs, include))
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
