"""Corpus: the documents of text, gzip, JSONL and Parquet files as a stream of UTF-8 pieces,
each assigned to the train or validation split (gpt/data.py tokenizes and stores them).

Choices, and why:

- Formats, by suffix (`file_format`): .txt (and any unknown suffix) and .txt.gz are one
  document each; each line of .jsonl/.jsonl.gz and each row of .parquet is one document, its
  text at `text_field` (a JSON key, or a dotted path into nested objects; a Parquet column, of
  which only that one is read, in batches of rows through pyarrow). gzip and JSON use the
  standard library, streaming. A record that is not JSON, lacks the field or holds no string
  there is a UserError naming file and line/row, or with `skip_bad_records` is skipped and
  counted (meta.json's skipped_records). Folders take every supported suffix by default.
- Split (`SplitRule`): whole documents go to val. The corpus is the concatenation of the input
  files, in order; with --val_fraction the documents that end past its last `val_fraction` of
  *bytes on disk* are val, with --val_documents=N the last N documents. Cutting by bytes or
  counts decides the split before tokenizing, so everything streams in one pass (counting
  documents for --val_documents is a cheap pre-pass: Parquet footers, JSONL lines). A corpus
  of one text document (the bundled Shakespeare) cannot be split by document, so there the cut
  falls inside it, exactly at the byte for .txt (moved back to a character boundary): nanoGPT's
  ``data[:int(n*0.9)]``, which for Shakespeare with the char tokenizer gives nanoGPT's exact
  1,003,854 / 111,540 tokens. Records know only their on-disk position (a line's end, the
  compressed bytes read, the share of Parquet rows read), so their split is an estimate of the
  fraction. The split byte counts in meta.json are bytes of UTF-8 text (what bits per byte
  divide by); the source sizes are on disk.
- Documents: files and records are documents; each piece says whether it starts one, and
  gpt/data.py writes the end-of-text token between documents.
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
"""
from __future__ import annotations

import codecs
import fnmatch
import functools
import glob
import gzip
import io
import json
import os
import re
import sys
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

from gpt.errors import UserError

CHUNK_BYTES = 1 << 20  # bytes read per piece; big enough to amortise overhead, small for memory
# Folder search default: every supported format (see `file_format`).
DEFAULT_INCLUDE = ("*.txt", "*.txt.gz", "*.jsonl", "*.jsonl.gz", "*.parquet")
Include = Union[str, Sequence[str]]
_PRINTABLE = frozenset(range(0x21, 0x7F))  # ASCII characters that are neither space nor control


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
            found = []
            for m in _glob(str(raw)):
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
    """Files under `folder` matching any `include` pattern (as rglob matches it), sorted."""
    matches = _include_matcher(include)
    return sorted(f for f in _walk(folder) if matches(f.relative_to(folder)) and f.is_file())


def _include_matcher(include: Include) -> Callable[[Path], bool]:
    """Whether a path relative to a folder matches a pattern as `Path.rglob(pattern)` finds it: a
    pattern without "/" by the file's name (one regex for all of them), others part by part."""
    split = [[x for x in p.split("/") if x not in ("", ".")] for p in include_patterns(include)]  # ./*.txt
    names = [fnmatch.translate(parts[0]) for parts in split if len(parts) == 1]
    name_re = re.compile("|".join(names)) if names else None
    nested = [["**", *parts] for parts in split if len(parts) > 1]
    return lambda rel: bool(name_re and name_re.match(rel.name)) or any(_match_parts(n, rel.parts)
                                                                        for n in nested)


def _match_parts(pattern: Sequence[str], parts: Sequence[str]) -> bool:
    """Whether path `parts` match glob `pattern` parts: `**` any number of parts (none too), any
    other one part, by fnmatch's rules (case-sensitive, as glob is on Linux). Memoised on the
    positions, so that several `**` cost (pattern x path) steps, not a power of the depth."""
    pattern = [p for i, p in enumerate(pattern) if not (p == "**" and i and pattern[i - 1] == "**")]

    @functools.lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if i == len(pattern):
            return j == len(parts)
        if pattern[i] == "**":
            return match(i + 1, j) or (j < len(parts) and match(i, j + 1))
        return j < len(parts) and fnmatch.fnmatchcase(parts[j], pattern[i]) and match(i + 1, j + 1)
    return match(0, 0)


def _walk(folder: Path) -> Iterator[Path]:
    """Every path under `folder`, folders included, in sorted order: hidden files and folders
    skipped (.git, editor backups, prepare's own staging dirs), symlinked folders followed (a
    link back to a folder it lies in ends there: a cycle; a folder reached by two names is walked
    under both, and `resolve_inputs` keeps the first). A folder that cannot be listed (lost+found
    on a disk's root) is left out with a warning: its files were left out silently."""
    def failed(e: OSError):
        print(f"warning: cannot read the folder {e.filename} ({e.strerror}); its files are left out",
              file=sys.stderr)
    above: dict[str, frozenset] = {}  # each folder walked: the folders it lies in, itself too
    for root, dirs, names in os.walk(folder, followlinks=True, onerror=failed):
        try:
            st = os.stat(root)
        except OSError as e:  # removed while walked
            failed(e)
            dirs[:] = []
            continue
        chain = above.get(os.path.dirname(root), frozenset()) if root != str(folder) else frozenset()
        if (st.st_dev, st.st_ino) in chain:  # a link back to a folder it lies in: a cycle
            dirs[:] = []
            continue
        above[root] = chain | {(st.st_dev, st.st_ino)}
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield from (Path(root) / n for n in [*dirs, *sorted(names)] if not n.startswith("."))


def _glob(pattern: str) -> list[Path]:
    """glob.glob's matches, sorted; a `**` pattern's found by `_walk` from the folder before its
    first wildcard (glob followed a symlink cycle under `**` without end); a pattern ending in
    "/" matches folders only, as glob's does."""
    if "**" not in pattern:
        return sorted(map(Path, glob.glob(pattern)))
    parts = Path(pattern).parts
    k = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base = Path(*parts[:k]) if k else Path(".")
    if not base.is_dir():
        return []
    folders_only = pattern.endswith(("/", os.sep))
    rest = parts[k:]
    files = [*rest[:-1], "**", "*"] if rest[-1] == "**" else rest  # a last ** takes a part or more
    pattern_of = lambda p: files if not folders_only and p.is_file() else rest  # noqa: E731
    found = [p for p in [base, *_walk(base)] if _match_parts(pattern_of(p), p.relative_to(base).parts)]
    return sorted(p for p in found if not folders_only or p.is_dir())


def file_format(path: Path) -> str:
    """How a file is read, by suffix: "parquet" | "jsonl" | "jsonl.gz" | "txt.gz" | "txt".

    ``.json`` (and ``.json.gz``) is JSON lines too, as Hugging Face datasets reads it (a file that
    is one JSON array fails at its first line, which is not a record). Any other ``.gz`` is
    gzipped text; any other suffix is plain text, so an explicit ``--include '*.md'`` or a file
    named on the command line reads as it always did."""
    name = path.name.lower()
    for suffix, fmt in (("parquet", "parquet"), ("jsonl.gz", "jsonl.gz"), ("jsonl", "jsonl"),
                        ("json.gz", "jsonl.gz"), ("json", "jsonl")):
        if name.endswith("." + suffix):
            return fmt
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
        if offset == 0 and buf.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            raise UserError(f"{str(path)!r} is UTF-16 text (it starts with UTF-16's byte-order mark); "
                            f"convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8")
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
        if offset == 0 and text.startswith("\ufeff"):  # an editor's UTF-8 byte-order mark: not text
            text = text[1:]
        if text:
            yield offset, offset + n, text
        offset += n


@dataclass
class Source:
    path: Path
    size: int  # on disk (compressed, for .gz and .parquet): what the train/val split is cut by
    mtime_ns: int = 0  # as the size, before the file is read (--append compares it)


def make_sources(files: list[Path]) -> list[Source]:
    return [Source(f, st.st_size, st.st_mtime_ns) for f, st in ((f, f.stat()) for f in files)]


def val_cut(total_bytes: int, val_fraction: float) -> int:
    """Byte offset in the concatenated corpus where the validation split begins."""
    return int(total_bytes * (1.0 - val_fraction))


@dataclass(frozen=True)
class SplitRule:
    """Which split a document goes to. Documents go to val whole: those that end past byte `cut`
    of the concatenated files on disk (--val_fraction), or with --val_documents=N the last N
    (`first_val_doc` = their count minus N). A corpus of one text document cannot be split by
    document, so there the cut falls inside it (`inside_document`: nanoGPT's split), at a byte of
    its text (for a .txt.gz, of the decompressed text)."""
    cut: int
    first_val_doc: int | None = None
    inside_document: bool = False

    def split(self, doc: int, end: int) -> str:
        """The split of document number `doc` (0-based over the corpus) ending at byte `end`."""
        if self.first_val_doc is not None:
            return "val" if doc >= self.first_val_doc else "train"
        return "val" if end > self.cut else "train"


def split_rule(sources: list[Source], reading: Reading, val_fraction: float,
               val_documents: int | None = None) -> SplitRule:
    """The rule for this corpus: the last `val_documents` documents, or whole documents past the
    `val_fraction` byte cut (inside the document if the corpus is one text file)."""
    cut = val_cut(sum(s.size for s in sources), val_fraction)
    single = len(sources) == 1 and file_format(sources[0].path) in ("txt", "txt.gz")
    if val_documents is None:
        if single and file_format(sources[0].path) == "txt.gz":
            cut = val_cut(gzip_text_bytes(sources[0].path), val_fraction)
        return SplitRule(cut, inside_document=single)
    n = count_documents(sources, reading)
    if val_documents >= n:
        raise UserError(f"--val_documents={val_documents} leaves no training text: the corpus has {n} "
                        f"document(s) (a text file is one, a JSONL line or Parquet row one); pass fewer, "
                        f"or use --val_fraction")
    return SplitRule(cut, first_val_doc=n - val_documents)


def count_documents(sources: list[Source], reading: Reading) -> int:
    """Documents in the corpus, read cheaply: a text file is one, a Parquet file its row count (from
    the footer), a JSONL file its non-blank lines (a streaming pass; bad lines count too)."""
    n = 0
    for src in sources:
        fmt = file_format(src.path)
        if fmt == "parquet":
            pq, arrow_error = _pyarrow()
            try:
                n += pq.ParquetFile(src.path).metadata.num_rows
            except arrow_error as e:
                raise UserError(f"{str(src.path)!r} is not a readable Parquet file ({e}); check that it is "
                                f"Parquet and complete, or leave it out") from None
        elif fmt.startswith("jsonl"):
            with open(src.path, "rb") as raw, _gzip_errors(src.path):
                f = gzip.GzipFile(fileobj=raw, mode="rb") if fmt.endswith(".gz") else raw
                n += sum(1 for line in f if line.strip())
        else:
            n += 1
    return n


@dataclass(frozen=True)
class Reading:
    """How inputs are read: invalid UTF-8 (`errors`), the text of a record (`text_field`, a JSON
    key or dotted path, or a Parquet column), and whether a bad record is skipped or an error."""
    errors: str = "strict"
    text_field: str = "text"
    skip_bad_records: bool = False


# The corpus as pieces: (split, n_bytes, text, starts_a_document); text is never empty.
Pieces = Iterator[tuple[str, int, str, bool]]


def iter_corpus(sources: list[Source], reading: Reading | str, rule: SplitRule | int,
                hashers: list | None = None, stats: dict | None = None) -> Pieces:
    """Yield (split, n_bytes, text, starts_a_document) over the whole corpus. A text file is one
    document, a JSONL line or Parquet row one (see `SplitRule` for the split, `_source_pieces`
    for how positions are known). `stats["skipped"]` counts the bad records skipped; an int
    `rule` is a byte cut (`SplitRule(cut)`)."""
    reading = Reading(errors=reading) if isinstance(reading, str) else reading
    rule = SplitRule(rule) if isinstance(rule, int) else rule
    stats = {"skipped": 0} if stats is None else stats
    start, doc = 0, 0  # offset of the current file in the concatenated corpus; documents before it
    for i, src in enumerate(sources):
        hasher = hashers[i] if hashers else None
        counter = [doc]
        yield from _source_pieces(src, start, rule, reading, hasher, stats, counter)
        doc = counter[0]
        start += src.size


def _source_pieces(src: Source, start: int, rule: SplitRule, reading: Reading, hasher, stats: dict,
                   doc: list[int]) -> Pieces:
    """One file's pieces, by format; `doc[0]` counts documents (advanced past this file's).
    Only a one-document corpus is cut inside its document, exactly at the cut's byte of its text
    (decompressed, for .gz). Records go to val by their on-disk position: a JSONL line's end (for
    .gz, its end in the decompressed text scaled to the file's size), for Parquet the share of rows
    read times the file size, so the split is an estimate."""
    fmt = file_format(src.path)
    if fmt in ("txt", "txt.gz"):
        whole = None if rule.inside_document else rule.split(doc[0], start + src.size)
        doc[0] += 1
        if fmt == "txt":
            local_cut = rule.cut - start if rule.inside_document and start < rule.cut < start + src.size \
                else None
            first = True
            for s, e, text in iter_file_pieces(src.path, reading.errors, local_cut, hasher):
                yield whole or ("train" if start + e <= rule.cut else "val"), e - s, text, first
                first = False
            return
        yield from _gzip_text_pieces(src.path, start, rule.cut, reading.errors, hasher, whole)
        return
    straddles = rule.first_val_doc is None and start < rule.cut < start + src.size  # positions matter
    records = _parquet_records(src.path, reading, hasher) if fmt == "parquet" else \
        _jsonl_records(src.path, fmt.endswith(".gz"), reading, hasher, straddles)
    yield from _record_pieces(src.path, records, start, rule, reading, stats, doc)


class _Tracked(io.RawIOBase):
    """A raw binary reader that feeds the bytes read from the file to the source hasher, so a
    compressed file is hashed and read in one pass."""

    def __init__(self, f, hasher):
        self.f, self.hasher = f, hasher

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b) or 0
        if n and self.hasher is not None:
            self.hasher.update(memoryview(b)[:n])
        return n


@contextmanager
def _gzip_errors(path: Path):
    """A broken .gz file as one UserError (gzip raises BadGzipFile, EOFError or zlib.error)."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{str(path)!r} is not a valid gzip file, or is truncated or corrupt ({e}); "
                        f"re-download or re-compress it, or leave it out") from None


def _gzip_text_pieces(path: Path, start: int, cut: int, errors: str, hasher, whole: str | None) -> Pieces:
    """A .txt.gz file: one document, decompressed as it streams, wholly in split `whole`, or if
    that is None (the corpus is this one file: `start` is 0) cut at byte `cut` of its text."""
    with open(path, "rb") as raw, _gzip_errors(path):
        tracked = _Tracked(raw, hasher)
        with gzip.GzipFile(fileobj=tracked, mode="rb") as gz:
            first = True
            for s, e, text in _iter_stream_pieces(gz, path, errors, None if whole else cut - start, None,
                                                  max(CHUNK_BYTES // 16, 4)):
                yield whole or ("train" if start + e <= cut else "val"), e - s, text, first
                first = False


def gzip_text_bytes(path: Path) -> int:
    """The decompressed size of a .gz file, from a pass over it: where its text ends, for a split
    by the text's bytes (a gzip reader reads ahead, up to a whole small file, so the compressed
    bytes read so far say little of where the text returned so far ends; the trailer's size is
    its last member's, modulo 4 GiB). Once per file and version of it (a preparation reads its
    corpus in several passes)."""
    st = path.stat()
    return _gzip_text_bytes(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _gzip_text_bytes(path: str, size: int, mtime_ns: int) -> int:
    n = 0
    with open(path, "rb") as raw, _gzip_errors(path), gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        for block in iter(lambda: gz.read(CHUNK_BYTES), b""):
            n += len(block)
    return n


# A record: (on-disk position after it, "line 3" or "row 3", its text, or None and what is wrong).
Records = Iterator[tuple[int, str, str | None, str | None]]


def _record_pieces(path: Path, records: Records, start: int, rule: SplitRule, reading: Reading,
                   stats: dict, doc: list[int]) -> Pieces:
    """Records as pieces: each record is a document, wholly train or wholly val; a bad record is
    a UserError naming the file and line/row, or (skip_bad_records) skipped and counted (it
    still counts as a document for --val_documents, as `count_documents` counts it)."""
    for pos, where, text, problem in records:
        doc[0] += 1
        if text is not None:
            text, problem = _clean_text(text, reading.errors)
        if problem is not None:
            if not reading.skip_bad_records:
                raise UserError(f"{str(path)!r} {where} {problem}; fix the file, or pass --skip_bad_records "
                                f"to skip such records")
            stats["skipped"] = stats.get("skipped", 0) + 1
            continue
        split = rule.split(doc[0] - 1, start + pos)
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
        return None, f"is {_kind(obj)}, not an object with a {field!r} field"
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
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object",
             str: "a string"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _jsonl_records(path: Path, gzipped: bool, reading: Reading, hasher, straddles: bool = True) -> Records:
    """A JSON-lines file (optionally gzipped), streamed line by line; blank lines are ignored.
    The position is the line's end, for .gz in the decompressed text scaled to the file's size
    (`gzip_text_bytes`: a first pass, made only for a file the val cut `straddles`; any other's
    records all sit at its end)."""
    size = path.stat().st_size
    unzipped = max(gzip_text_bytes(path), 1) if gzipped and straddles else None
    with open(path, "rb") as raw, _gzip_errors(path):
        tracked = _Tracked(raw, hasher)
        f = gzip.GzipFile(fileobj=tracked, mode="rb") if gzipped else io.BufferedReader(tracked, CHUNK_BYTES)
        with f:
            offset, first, held = 0, True, None
            for lineno, line in enumerate(f, 1):
                offset += len(line)
                if lineno == 1 and line.startswith(codecs.BOM_UTF8):  # an editor's byte-order mark
                    line = line[len(codecs.BOM_UTF8):]
                if not line.strip():
                    continue
                array, first = first and line.lstrip().startswith(b"["), False
                pos = offset if not gzipped else size if unzipped is None else offset * size // unzipped
                obj, problem = _json_line(line, reading, array, path)
                if held is not None:  # line 1 was an array of objects, but more lines follow
                    yield held
                    held = None
                text, problem = (None, problem) if problem else _field(obj, reading.text_field)
                if array and isinstance(obj, list) and obj and all(isinstance(o, dict) for o in obj):
                    held = pos, f"line {lineno}", text, problem  # a file of one array, if alone
                    continue
                yield pos, f"line {lineno}", text, problem
            if held is not None:  # skipping it as one bad record would skip every document
                raise _one_array(path)


def _json_line(line: bytes, reading: Reading, array: bool, path: Path) -> tuple[object, str | None]:
    """A JSONL line's value, or None and what is wrong with it."""
    try:
        return json.loads(line.decode("utf-8", reading.errors)), None
    except UnicodeDecodeError:
        return None, NOT_UTF8
    except json.JSONDecodeError as e:
        if array:  # the whole file is one value: skipping bad records would skip it all
            raise _one_array(path) from None
        return None, f"is not valid JSON ({e.msg} at column {e.colno})"
    except ValueError:  # Python's limit on int() digits
        return None, "holds a number too long to read (over 4,300 digits)"
    except RecursionError:
        return None, "is JSON nested too deeply to read"


def _one_array(path: Path) -> UserError:
    return UserError(f"{str(path)!r} is one JSON array, not JSON lines (an object a line); convert it, "
                     f"e.g. jq -c '.[]' FILE > FILE.jsonl")


def _parquet_records(path: Path, reading: Reading, hasher) -> Records:
    """A Parquet file's `text_field` column, streamed in batches of rows (only that column is
    read). The position is the share of rows read times the file size."""
    pq, arrow_error = _pyarrow()
    field, size = reading.text_field, path.stat().st_size
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if field not in names:
            nested = " (a field inside a struct column is not read: flatten it first)" if "." in field else ""
            raise UserError(f"{str(path)!r} has no column {field!r}{nested} (columns: "
                            f"{', '.join(names) or 'none'}); pass --text_field=NAME with the column that "
                            f"holds the text")
        total, row = max(pf.metadata.num_rows, 1), 0
        for batch in pf.iter_batches(batch_size=1024, columns=[field]):
            for value in _column_values(batch.column(0), reading.errors):
                row += 1
                ok = isinstance(value, str)
                problem = NOT_UTF8 if value is _NOT_UTF8 else \
                    f"has {_kind(value)} in column {field!r}, not a string"
                yield size * row // total, f"row {row}", value if ok else None, None if ok else problem
    except arrow_error as e:
        raise UserError(f"{str(path)!r} is not a readable Parquet file ({e}); check that it is Parquet "
                        f"and complete, or leave it out") from None
    if hasher is not None:
        hash_file(path, hasher)


_NOT_UTF8 = object()  # a string column's value whose bytes are not UTF-8
NOT_UTF8 = "is not valid UTF-8 (pass --errors=replace to substitute U+FFFD)"


def _column_values(column, errors: str) -> list:
    """A batch's text column as Python values, a string column's decoded from its bytes with
    `errors` (Arrow does not check UTF-8 when it reads a file: to_pylist raised on a bad byte);
    a value strict decoding refuses is _NOT_UTF8."""
    import pyarrow as pa
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return column.to_pylist()
    binary = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()

    def decode(raw: bytes | None):
        try:
            return None if raw is None else raw.decode("utf-8", errors)
        except UnicodeDecodeError:
            return _NOT_UTF8
    return [decode(v) for v in column.cast(binary).to_pylist()]


def _pyarrow():
    """pyarrow.parquet and the base of its exceptions, imported only when a .parquet is read."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading .parquet files needs pyarrow; pip install pyarrow "
                        "(it is in requirements.txt)") from None
    return pq, pyarrow.ArrowException


def hash_file(path: Path, hasher):
    """Feed a whole file to `hasher`, and return it (Parquet is read by pyarrow, out of order)."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            hasher.update(block)
    return hasher
