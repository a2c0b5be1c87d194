"""Tokenizers: GPT-2 BPE, characters, byte-level BPE trained on your own corpus, and Hugging Face
tokenizer.json files.

Four kinds, one interface (`Tokenizer`):

- ``gpt2``: OpenAI's GPT-2 byte-level BPE (50257 ids), built offline from the bundled
  ``data/gpt2.tiktoken`` ranks file. `tiktoken.get_encoding("gpt2")` would download that file;
  training must never need the network, so we build the same `tiktoken.Encoding` ourselves.
- ``char``: one id per character of the corpus, sorted (nanoGPT's shakespeare_char: 65 ids).
  No end-of-text token. The alphabet is stored in the spec itself.
- ``bpe:N``: a byte-level BPE with exactly N regular tokens trained with Hugging Face
  `tokenizers`, converted to a tiktoken ranks file (``tokenizer.tiktoken``) so that encoding
  runs through the same fast tiktoken code path as GPT-2, plus ``<|endoftext|>`` = N.
- ``hf:PATH``: a Hugging Face ``tokenizer.json`` (Llama, Mistral, Qwen, ...), run by `tokenizers`
  itself, since its normalizers, pre-tokenizers and templates vary by model. Its BOS/EOS ids come
  from the model's ``generation_config.json``/``config.json`` (or ``tokenizer_config.json``).

A tokenizer is described by a small JSON-serialisable `spec`; `load_tokenizer(spec, base_dir)`
rebuilds it, with any files the spec names (`Tokenizer.files()`) resolved relative to
``base_dir`` (a prepared data dir, or a checkpoint dir the files were copied into).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import tiktoken

from gpt.errors import UserError, read_json_object

REPO_ROOT = Path(__file__).resolve().parent.parent
GPT2_RANKS_FILE = REPO_ROOT / "data" / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenizer regex (tiktoken's r50k_base): contractions, letters, numbers, punctuation
# runs and whitespace, each optionally with one leading space. BPE never merges across pieces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
BPE_FILE = "tokenizer.tiktoken"
HF_FILE = "tokenizer.json"
NAMES = ("gpt2", "char", "bpe:N", "hf:PATH")
REPLACEMENT = "\ufffd"


class Tokenizer:
    """Text <-> token ids. Subclasses fill in the methods; this class documents the contract.

    Attributes:
        vocab_size: number of ids, specials included (ids are 0 .. vocab_size-1).
        eot_id: id of the end-of-text token that separates documents, or None (char, or a Hugging
            Face tokenizer whose model names no EOS).
        stop_ids: a model's other EOS ids, which end generation as eot_id does but never separate
            documents (Llama 3 Instruct's <|eot_id|>, Qwen's <|endoftext|> beside <|im_end|>).
        spec: JSON-serialisable description; `load_tokenizer(spec, base_dir)` rebuilds it.
    """

    vocab_size: int
    eot_id: int | None
    stop_ids: tuple[int, ...] = ()
    spec: dict

    def encode(self, text: str) -> list[int]:
        """Ids for plain text. Special-token strings in `text` are encoded as ordinary text."""
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        """Ids for a prompt to sample from: as `encode`, plus what the model's own tokenizer adds
        around a prompt (a Llama tokenizer's BOS)."""
        return self.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` for many texts (parallel where the implementation allows)."""
        return [self.encode(t) for t in texts]

    def encode_array(self, text: str, dtype: np.dtype | type = np.uint32) -> np.ndarray:
        """`encode` as a 1-D numpy array; data preparation appends these to the .bin files."""
        return np.asarray(self.encode(text), dtype=dtype)

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ids. Never raises for ids the model can emit: unknown ids and partial
        UTF-8 sequences decode to U+FFFD (the model's head may be padded beyond vocab_size)."""
        raise NotImplementedError

    def files(self) -> list[str]:
        """Names (relative to base_dir) of the files the spec refers to; copy them with it."""
        return []

    def settled(self, ids: list[int]) -> bool:
        """Whether tokens after `ids` leave the text of `ids` as it is, where that text ends in
        whole characters (`RowText`): true of byte-level and character tokenizers."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class TiktokenTokenizer(Tokenizer):
    """Byte-level BPE through tiktoken (GPT-2 and trained bpe:N): fast, Rust, releases the GIL."""

    def __init__(self, encoding: tiktoken.Encoding, spec: dict, files: Sequence[str] = ()):
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab
        self.eot_id = encoding.eot_token
        self.spec = spec
        self._files = list(files)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_array(self, text: str, dtype: np.dtype | type = np.uint32) -> np.ndarray:
        # Straight into a numpy buffer: no Python list of ints, so far less time holding the GIL
        # (data preparation runs this in a thread pool). Empty special set = ordinary encoding.
        try:
            ids = self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates: take tiktoken's repair path
            ids = np.asarray(self.encode(text), dtype=np.uint32)
        return ids.astype(dtype, copy=False)

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if all(0 <= i < self.vocab_size for i in ids):
            return self.encoding.decode(ids, errors="replace")
        # Ids outside the vocabulary (e.g. from a padded LM head) become U+FFFD; runs of valid
        # ids are decoded together so that multi-byte characters split across tokens survive.
        out, run = [], []
        for i in ids:
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                out.append(self.encoding.decode_bytes(run))
                out.append(REPLACEMENT.encode())
                run = []
        out.append(self.encoding.decode_bytes(run))
        return b"".join(out).decode("utf-8", errors="replace")

    def files(self) -> list[str]:
        return list(self._files)


class CharTokenizer(Tokenizer):
    """One id per character, in sorted order. Encoding a character outside the alphabet is a
    user error (typically a sampling prompt), reported with the offending characters."""

    def __init__(self, chars: str):
        if not chars or len(set(chars)) != len(chars) or list(chars) != sorted(chars):
            raise UserError("char tokenizer spec is corrupt (alphabet must be sorted unique characters); "
                            "re-run data preparation")
        self.chars = chars
        self.vocab_size = len(chars)
        self.eot_id = None
        self.spec = {"kind": "char", "chars": chars, "vocab_size": len(chars), "eot_id": None}
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)  # sorted

    def encode_array(self, text: str, dtype: np.dtype | type = np.uint32) -> np.ndarray:
        # Vectorised: code points -> position in the sorted alphabet (binary search), ~100x
        # faster than a Python dict lookup per character on a large corpus.
        cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
        idx = np.searchsorted(self._codepoints, cps)
        idx_clipped = np.minimum(idx, self.vocab_size - 1)
        bad = self._codepoints[idx_clipped] != cps
        if bad.any():
            unknown = sorted({chr(c) for c in cps[bad].tolist()})
            shown = ", ".join(repr(c) for c in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            raise UserError(f"text contains {len(unknown)} character(s) not in the char tokenizer's "
                            f"vocabulary: {shown}; remove them or prepare the data with a byte-level "
                            f"tokenizer (gpt2 or bpe:N), which can encode any text")
        return idx.astype(dtype)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        n = self.vocab_size
        return "".join(self.chars[i] if 0 <= i < n else REPLACEMENT for i in (int(j) for j in ids))


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` run by the `tokenizers` library.

    Training text is encoded as plain text (special-token strings in a corpus stay text, and no
    template tokens are added: documents are separated by `eot_id` as for the other kinds). A
    checkpoint converted from Hugging Face (spec ``prompt_template``) was trained with the
    tokenizer's template, so its prompts go through it, special tokens and BOS included, as
    ``AutoTokenizer(prompt)`` does; a model trained here on hf-prepared data gets plain prompts.
    """

    def __init__(self, text_hf, prompt_hf, spec: dict, files: Sequence[str] = ()):
        self.hf, self.prompt_hf = text_hf, prompt_hf
        self.spec = spec
        self.vocab_size, self.eot_id = spec["vocab_size"], spec.get("eot_id")
        self.bos_id, self.stop_ids = spec.get("bos_id"), tuple(spec.get("stop_ids", ()))
        self._files = list(files)

    def encode(self, text: str) -> list[int]:
        return self._run(self.hf.encode, text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        template = bool(self.spec.get("prompt_template"))
        return self._run(self.prompt_hf.encode, text, add_special_tokens=template).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._run(self.hf.encode_batch, texts, add_special_tokens=False)]

    def _run(self, encode, *args, **kw):
        """`encode(*args, **kw)`; what `tokenizers` refuses to encode is one line, not a traceback
        (a tokenizer.json whose unk token is missing from its vocabulary fails on unknown text)."""
        try:
            return encode(*args, **kw)
        except Exception as e:
            if type(e) is not Exception:  # tokenizers raises plain Exception; anything else is a bug
                raise
            first = str(e).splitlines()[0] if str(e) else "no reason given"
            raise UserError(f"the Hugging Face tokenizer {self.spec.get('file')} cannot encode the text "
                            f"({first}); its vocabulary lacks what that text needs: use a tokenizer.json "
                            f"that covers it") from None

    def decode(self, ids: Iterable[int]) -> str:
        return self.prompt_hf.decode(list(ids), skip_special_tokens=True)  # as HF prints text

    def files(self) -> list[str]:
        return list(self._files)

    def settled(self, ids: list[int]) -> bool:
        """A byte-fallback decoder (Llama 2's, Mistral's <0xE4>) takes a run of byte tokens as one,
        across the tokens it skips (specials, unknown ids), and turns every byte of a run that is
        not UTF-8 into U+FFFD, those before too: not final until a token of text."""
        if not ids:
            return True
        byte = re.fullmatch(r"<0x[0-9A-F]{2}>", self.prompt_hf.id_to_token(ids[-1]) or "") is not None
        return not byte and self.decode(ids[-1:]) != ""


# ----------------------------------------------------------------------------- decoding a stream


def continuation(tok: Tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text `new` adds after `prompt`, decoded together: tokenizers whose decoder strips a
    leading space (SentencePiece's) would lose the space between them if decoded apart."""
    head, whole = tok.decode(prompt), tok.decode(list(prompt) + list(new))
    return whole[len(head):] if whole.startswith(head) else tok.decode(new)


CONTEXT_TOKENS = 8  # decoded before new tokens: decoders change a text's first token or so (a space)


class RowText:
    """The text a sampled row's new tokens add after the prompt, decoded chunk by chunk: the
    tokens that decoded to whole characters keep their text, and only those after them are
    decoded again, behind the last CONTEXT_TOKENS tokens before them (`continuation`). Decoding
    the prompt and the whole row at every chunk made sampling quadratic in the sample's length
    and the prompt's."""

    def __init__(self, tok: Tokenizer, prompt: list[int]):
        self.tok = tok
        self.context = self._window(prompt)
        self.done, self.kept = 0, ""  # new tokens whose text is final, and that text

    def text(self, new: list[int]) -> str:
        """The text of `new`, which extends the tokens given before (sampled tokens stay)."""
        rest = new[self.done:]
        text = self.kept + continuation(self.tok, self.context, rest)
        if not text.endswith("\ufffd") and self.tok.settled(rest):  # final: later tokens keep it
            self.context = self._window(self.context + rest)
            self.done, self.kept = len(new), text
        return text

    def _window(self, ids: list[int]) -> list[int]:
        """The last CONTEXT_TOKENS of `ids`, from a token of settled text on: a window that began
        inside a byte-fallback run (the decoder turns the whole run, the new tokens' bytes too,
        into U+FFFD) or held only tokens that decode to nothing (the decoder strips the new text's
        leading space) decoded the new tokens otherwise than all the tokens as a whole."""
        start = max(0, len(ids) - CONTEXT_TOKENS)
        while start > 0 and not self.tok.settled(ids[start:start + 1]):
            start -= 1
        return list(ids[start:])


# ---------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode table (byte-level BPE vocabularies store bytes as printable characters)

@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the rest (control, space, ...) to U+0100 onwards.
    Hugging Face's ByteLevel pre-tokenizer uses the same table, so its vocabulary strings can be
    turned back into the raw bytes tiktoken wants.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def unicode_to_bytes(token: str) -> bytes:
    """Inverse of `bytes_to_unicode` for one vocabulary string."""
    table = _unicode_to_byte()
    return bytes(table[ch] for ch in token)


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


# ---------------------------------------------------------------------------------------------
# Ranks files

def load_ranks(path: Path, expected_sha256: str | None) -> dict[bytes, int]:
    """Read a tiktoken ranks file (`base64(token) rank` per line), checking its sha256.

    Same format and parsing as `tiktoken.load.load_tiktoken_bpe`, which we do not call because it
    also copies the file into a cache under /tmp keyed by the path and will serve that copy even
    after the file itself is gone: a missing file must be an error here, not silently fine.
    """
    if not path.is_file():
        raise UserError(f"tokenizer file {path} is missing; copy it next to the spec that names it "
                        f"or re-run data preparation (python -m gpt.data ...)")
    try:
        data = path.read_bytes()
    except OSError as e:  # unreadable (permissions, I/O error): one line, as for a tokenizer.json
        raise UserError(f"cannot read tokenizer file {path} ({e.strerror or e}); make it readable, "
                        f"or re-run data preparation") from None
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise UserError(f"tokenizer file {path} does not match its recorded sha256 (modified or "
                        f"corrupt); restore the original file or re-run data preparation")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise UserError(f"tokenizer file {path} line {lineno} is malformed ({e}); "
                            f"re-run data preparation") from None
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> str:
    """Write a tiktoken ranks file atomically; returns its sha256."""
    lines = b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n"
                     for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    atomic_write_bytes(path, lines)
    return hashlib.sha256(lines).hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so readers see either the old file or the complete new one:
    write a temporary file in the same directory, fsync, then `os.replace` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    # os.open with 0o666 (not mkstemp's 0o600) so the result has the usual umask permissions.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---------------------------------------------------------------------------------------------
# Building and loading

def _tiktoken_encoding(name: str, ranks: dict[bytes, int]) -> tiktoken.Encoding:
    eot = max(ranks.values()) + 1
    return tiktoken.Encoding(name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: eot})


@lru_cache(maxsize=1)
def _gpt2_encoding() -> tiktoken.Encoding:
    # Cached: the ranks file is 50k lines and every Batches/sampler/test would otherwise re-parse it.
    ranks = load_ranks(GPT2_RANKS_FILE, GPT2_RANKS_SHA256)
    if len(ranks) != 50256:
        raise UserError(f"{GPT2_RANKS_FILE} has {len(ranks)} tokens, expected 50256; restore the bundled file")
    return _tiktoken_encoding("gpt2", ranks)


def gpt2_tokenizer() -> TiktokenTokenizer:
    """GPT-2's tokenizer (r50k_base): 50256 BPE tokens + <|endoftext|> = 50256."""
    return TiktokenTokenizer(_gpt2_encoding(), {"kind": "gpt2", "vocab_size": 50257, "eot_id": 50256})


GPT2_PROBE = "Hello world, ROMEO: thou art  \n\n\t naïve 12,345 don't 😀 Ünïcödé\r\n"


def is_gpt2(hf) -> bool:
    """Whether a Hugging Face `tokenizers.Tokenizer` is GPT-2's own: every one of its 50,257 tokens
    at GPT-2's id, and a probe text encoded to the same ids (so its merges and pre-tokenizer too).
    A community GPT-2 trained from scratch often keeps the size, 50,257, with a BPE of its own.
    Special tokens added past GPT-2's (a pad token for batching) do not count: ordinary text never
    encodes to them (an added token that is not special, or a longer BPE, would)."""
    enc = _gpt2_encoding()
    if hf.get_vocab_size(with_added_tokens=True) < 50257 or hf.token_to_id(EOT) != enc.eot_token:
        return False
    if hf.get_vocab_size(with_added_tokens=False) > 50257 or not all(
            t.special for i, t in hf.get_added_tokens_decoder().items() if i != enc.eot_token):
        return False
    table = bytes_to_unicode()
    vocab = hf.get_vocab(with_added_tokens=True)
    as_text = lambda i: "".join(table[b] for b in enc.decode_single_token_bytes(i))
    if any(vocab.get(as_text(i)) != i for i in range(enc.eot_token)):
        return False
    return hf.encode(GPT2_PROBE, add_special_tokens=False).ids == enc.encode_ordinary(GPT2_PROBE)


def load_tokenizer(spec: dict, base_dir: str | Path) -> Tokenizer:
    """Rebuild a tokenizer from its spec; files it names are read from `base_dir`."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise UserError(f"tokenizer spec {spec!r} is not valid (expected a dict with 'kind'); "
                        f"re-run data preparation")
    kind = spec["kind"]
    if kind == "gpt2":
        return gpt2_tokenizer()
    if kind == "char":
        chars = spec.get("chars")
        if not isinstance(chars, str):
            raise UserError("char tokenizer spec has no 'chars' alphabet; re-run data preparation")
        return CharTokenizer(chars)
    if kind == "bpe":
        n, file, sha = spec.get("n_regular"), spec.get("file"), spec.get("sha256")
        if not isinstance(n, int) or isinstance(n, bool) or file is None:  # int(): Infinity overflowed
            raise UserError(f"bpe tokenizer spec {spec!r} is incomplete (needs n_regular, file); "
                            f"re-run data preparation")
        ranks = load_ranks(inside(base_dir, file), sha)
        if len(ranks) != n or sorted(ranks.values()) != list(range(n)):
            raise UserError(f"tokenizer file {Path(base_dir) / file} has {len(ranks)} tokens, spec says {n}; "
                            f"re-run data preparation")
        if any(bytes([b]) not in ranks for b in range(256)):  # tiktoken panics on a byte it lacks
            raise UserError(f"tokenizer file {Path(base_dir) / file} lacks some of the 256 single bytes a "
                            f"byte-level BPE starts from; re-run data preparation")
        return TiktokenTokenizer(_tiktoken_encoding(f"bpe{n}", ranks), dict(spec), files=[file])
    if kind == "hf":
        return load_hf_spec(spec, Path(base_dir))
    raise UserError(f"unknown tokenizer kind {kind!r} in spec; valid kinds: gpt2, char, bpe, hf")


# What a spec holds beside the ids a text is prepared with: its file's name, whether prompts take
# the template, and the extra ids that end generation.
NOT_IDS = ("file", "prompt_template", "stop_ids")


def ids_of(spec: dict) -> dict:
    """The part of a tokenizer spec that decides a prepared text's ids (the kind, the vocabulary,
    the file's sha256, the BOS/EOS ids)."""
    return {k: v for k, v in spec.items() if k not in NOT_IDS}


def check_data_tokenizer(model_spec: Any, data_spec: dict, model: str, fix: str) -> None:
    """Data tokenized otherwise than `model` was trained (every id would mean another token, or
    documents separated otherwise) is one line naming what differs, ending in `fix`; a model that
    records no tokenizer (a Hugging Face directory without tokenizer.json) is not checked. The
    run records the data's spec, so BOS/EOS ids that differ would also be lost from the model: a
    tokenizer.json read without the config files that name them (one in a checkpoint's folder)
    has none, and the fix is the Hugging Face folder's."""
    if not isinstance(model_spec, dict):
        return
    a, b = ids_of(model_spec), ids_of(data_spec)
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or a[k] != b[k])
    if not differ:
        return
    if set(differ) <= {"bos_id", "eot_id"}:
        fix = ("prepare it with --tokenizer=hf: of the Hugging Face folder the model came from, whose "
               "config files name its BOS/EOS ids")
    raise UserError(f"the data is tokenized with {describe(data_spec)} but {model} with {describe(model_spec)} "
                    f"(they differ in {', '.join(differ)}); {fix}")


def tokenizer_hint(spec: Any, src: str | Path) -> str:
    """How to prepare data with the tokenizer `spec` of the model in `src`."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    return {"gpt2": "--tokenizer=gpt2", "hf": f"--tokenizer=hf:{src}/tokenizer.json"}.get(
        kind, "the same tokenizer (a char alphabet must be the same characters)")


def describe(spec: dict) -> str:
    """A spec in a few words, for messages: kind, vocabulary (a char alphabet's size), BOS/EOS."""
    ids = "".join(f", {name} {spec[k]}" for k, name in (("bos_id", "BOS"), ("eot_id", "EOS"))
                  if spec.get(k) is not None)
    return f"{spec.get('kind')} ({spec.get('vocab_size')} tokens{ids})"


def fingerprint(tok: Tokenizer, base_dir: str | Path) -> str:
    """What makes two checkpoints' tokenizers the same (speculative decoding pairs models by it):
    the spec's ids (`ids_of`), and the content of the files it names, wherever they are."""
    spec = ids_of(tok.spec)
    files = [hashlib.sha256(inside(base_dir, f).read_bytes()).hexdigest() for f in tok.files()]
    return json.dumps({"spec": spec, "files": files}, sort_keys=True)


def inside(base_dir: str | Path, name: object) -> Path:
    """base_dir/name for a file name read from metadata, which must stay inside base_dir."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", "..") \
            or not _valid_file_name(name):
        raise UserError(f"tokenizer file name {name!r} in the metadata of {base_dir} is not a plain "
                        f"file name; the metadata is damaged, re-create it")
    return Path(base_dir) / name


def _valid_file_name(name: str) -> bool:
    """Whether the filesystem can take `name`: no NUL, encodable, at most 255 bytes (opening such a
    name raised ValueError or OSError, a traceback, where a missing file is one line)."""
    try:
        return "\x00" not in name and len(os.fsencode(name)) <= 255
    except UnicodeEncodeError:  # a lone surrogate from JSON's \ud800
        return False


def parse_name(name: str) -> tuple[str, int | None]:
    """'gpt2' | 'char' | 'bpe:N' | 'hf:PATH' -> (kind, N or None); anything else is a UserError
    (for hf:PATH, also a PATH that is not a readable tokenizer.json)."""
    if name in ("gpt2", "char"):
        return name, None
    if isinstance(name, str) and name.startswith("hf:"):
        read_hf_file(hf_path(name), PASS_HF)
        return "hf", None
    if isinstance(name, str) and name.startswith("bpe:"):
        try:
            n = int(name[4:])
        except ValueError:
            raise UserError(f"tokenizer {name!r}: N in bpe:N must be an integer, e.g. bpe:4096") from None
        if n < 256:
            raise UserError(f"tokenizer {name!r}: a byte-level BPE needs N >= 256 (one token per byte); "
                            f"use e.g. bpe:4096")
        if n >= 2**32 - 1:
            raise UserError(f"tokenizer {name!r}: N is too large; use e.g. bpe:4096")
        return "bpe", n
    raise UserError(f"unknown tokenizer {name!r}; valid names: {', '.join(NAMES)} (e.g. bpe:4096)")


def build_tokenizer(name: str, texts: Iterable[str] | None, out_dir: str | Path) -> Tokenizer:
    """Make the tokenizer `name` ("gpt2" | "char" | "bpe:N"), learning it from `texts` if needed.

    `texts` is any iterable of strings (chunks of the corpus; streamed, never joined), required
    for char and bpe:N. Files the tokenizer needs (bpe: ``tokenizer.tiktoken``) are written
    atomically into `out_dir`.
    """
    kind, n = parse_name(name)
    if kind == "gpt2":
        return gpt2_tokenizer()
    if kind == "hf":
        return hf_tokenizer_into(hf_path(name), Path(out_dir))
    if texts is None:
        raise UserError(f"tokenizer {name!r} is learned from the corpus, but no text was given")
    if kind == "char":
        chars: set[str] = set()
        for t in texts:
            chars.update(t)
        if not chars:
            raise UserError("the corpus is empty, so there are no characters for the char tokenizer; "
                            "pass non-empty text files")
        return CharTokenizer("".join(sorted(chars)))
    assert n is not None
    return train_bpe(texts, n, Path(out_dir))


def train_bpe(texts: Iterable[str], n: int, out_dir: Path) -> TiktokenTokenizer:
    """Train a byte-level BPE with exactly `n` regular tokens and save it as tiktoken ranks."""
    return tokenizer_from_hf(train_hf_bpe(texts, n), n, out_dir)


def train_hf_bpe(texts: Iterable[str], n: int):
    """Learn a byte-level BPE with Hugging Face `tokenizers` (fast, streaming, multi-threaded).

    The initial alphabet is all 256 bytes (as GPT-2's printable stand-ins), so any text can be
    encoded even if some bytes never occur in the corpus; the trainer adds merges until the
    vocabulary holds `n` tokens.
    """
    from tokenizers import models, pre_tokenizers, trainers

    hf = hf_bpe_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=n, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    return hf


def tokenizer_from_hf(hf, n: int, out_dir: Path) -> TiktokenTokenizer:
    """Convert a trained HF byte-level BPE to a tiktoken ranks file in `out_dir`.

    HF's ids are 0..255 for the byte alphabet, then one per new token in merge order, which is
    exactly the "rank" tiktoken merges by, so rank = HF id and both give the same ids for
    ordinary text. (They could differ where one token is reachable by two different merges:
    tiktoken merges by the rank of the concatenation, HF by the rank of the pair; the tests
    check they agree on held-out text.)
    """
    vocab = hf.get_vocab()
    if len(vocab) <= 256 and n > 256:  # nothing at all was learned
        raise UserError("the corpus is empty or has no repeated byte pairs, so no BPE merges can be "
                        "learned; pass more text")
    if len(vocab) != n:
        raise UserError(f"the corpus is too small to learn bpe:{n}: it yields only {len(vocab)} tokens; "
                        f"use bpe:{len(vocab)} or smaller, or more text")
    ranks = {unicode_to_bytes(tok): i for tok, i in vocab.items()}
    if len(ranks) != n or sorted(ranks.values()) != list(range(n)):
        raise RuntimeError("HF BPE vocabulary ids are not 0..n-1")  # a bug, not a user error
    out_dir.mkdir(parents=True, exist_ok=True)
    sha = write_ranks(ranks, out_dir / BPE_FILE)
    spec = {"kind": "bpe", "n_regular": n, "file": BPE_FILE, "sha256": sha, "vocab_size": n + 1, "eot_id": n}
    return TiktokenTokenizer(_tiktoken_encoding(f"bpe{n}", ranks), spec, files=[BPE_FILE])


def hf_bpe_tokenizer(model):
    """A Hugging Face tokenizer with GPT-2's byte-level pre-tokenizer around `model`
    (also used by the tests to check our tiktoken conversion against HF's own encoder)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, pre_tokenizers

    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    return hf


# ----------------------------------------------------------------------------- Hugging Face tokenizer.json


def identity(name: str) -> str:
    """What data prepared with tokenizer `name` depends on: the name, or for hf:PATH its spec (the
    file's content and the BOS/EOS ids read beside it; the same file elsewhere is the same
    tokenizer, an edited one or other ids are not)."""
    if isinstance(name, str) and name.startswith("hf:"):
        _, _, spec = hf_spec(hf_path(name), PASS_HF)
        return "hf:" + json.dumps({k: v for k, v in spec.items() if k != "file"}, sort_keys=True)
    return name


PASS_HF = "pass --tokenizer=hf:PATH/tokenizer.json of the model's Hugging Face directory"


def hf_path(name: str) -> Path:
    """The tokenizer.json named by 'hf:PATH' (PATH may also be the directory holding it)."""
    if not name[3:]:
        raise UserError("--tokenizer=hf: needs a path, e.g. --tokenizer=hf:./Llama-3.2-1B/tokenizer.json")
    path = Path(name[3:]).expanduser()
    return path / HF_FILE if path.is_dir() else path


def read_hf_file(path: Path, fix: str, sha256: str | None = None) -> tuple[bytes, object]:
    """(file bytes, `tokenizers.Tokenizer`) of a tokenizer.json, or one UserError line ending in `fix`."""
    from tokenizers import Tokenizer as HFTok

    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read tokenizer {path} ({e.strerror or e}); {fix}") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise UserError(f"tokenizer file {path} has changed since it was recorded (sha256 mismatch); "
                        f"{fix}")
    try:
        return data, HFTok.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exception for malformed files
        first = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise UserError(f"{path} is not a readable Hugging Face tokenizer.json ({first}); {fix}") from None


def _json_file(path: Path) -> dict:
    """A JSON object from `path`, {} if there is no such file, one UserError line if it is bad."""
    return read_json_object(path, "a Hugging Face config beside the tokenizer") if path.is_file() else {}


def _token_ids(value: object) -> list[int]:
    """A config's token id field (one id or a list of them) as a list; [] if it holds none."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


MAX_STOP_IDS = 64


def special_ids(model_dir: Path, hf) -> dict:
    """The model's BOS and EOS ids: generation_config.json, then config.json, then
    tokenizer_config.json's token strings; None where none says. Of a list of EOS ids the first
    separates documents (eot_id) and the others also end generation (stop_ids, only if any), as
    `transformers`' generate stops at every id of the list."""
    out: dict = {"bos_id": None, "eot_id": None}
    tok_cfg = _json_file(model_dir / "tokenizer_config.json")
    configs = (_json_file(model_dir / "generation_config.json"), _json_file(model_dir / "config.json"))
    for key, hf_key in (("bos_id", "bos"), ("eot_id", "eos")):
        ids = next((found for cfg in configs if (found := _token_ids(cfg.get(f"{hf_key}_token_id")))), [])
        if not ids:
            token = tok_cfg.get(f"{hf_key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            ids = _token_ids(hf.token_to_id(token)) if isinstance(token, str) else []
        out[key] = ids[0] if ids else None
        if key == "eot_id" and len(set(ids)) > 1:
            out["stop_ids"] = list(dict.fromkeys(i for i in ids if i != ids[0]))
    return out


def hf_vocab_size(hf) -> int:
    """The ids a `tokenizers.Tokenizer` can produce: its highest id plus one. A vocabulary with
    gaps between its ids has fewer entries than that (get_vocab_size), and sizing the model and
    the store's integers by the entries overflowed them or trained on ids past the embedding."""
    ids = hf.get_vocab(with_added_tokens=True).values()
    return max(max(ids, default=-1) + 1, hf.get_vocab_size(with_added_tokens=True))


def hf_spec(path: Path, fix: str) -> tuple[bytes, object, dict]:
    """(bytes, `tokenizers.Tokenizer`, spec) of the tokenizer.json at `path`, with the BOS/EOS ids
    of the model directory it sits in: its Hugging Face configs, or where it is one of our run
    directories (a converted model, a training run's copy), the ids its checkpoint recorded."""
    data, hf = read_hf_file(path, fix)
    sha = hashlib.sha256(data).hexdigest()
    ids = special_ids(path.parent, hf)
    n = hf_vocab_size(hf)
    if ids["bos_id"] is None and ids["eot_id"] is None:
        ids = recorded_ids(path.parent, sha, n) or ids
    spec = {"kind": "hf", "file": HF_FILE, "sha256": sha, "vocab_size": n, **ids}
    return data, hf, spec


def recorded_ids(run_dir: Path, sha256: str, vocab_size: int) -> dict | None:
    """The BOS/EOS ids the newest checkpoint in `run_dir` recorded for this very tokenizer.json
    (same sha256), checked like a config's; None if it is not one of our run directories (or its
    metadata is unreadable)."""
    if not (run_dir / "checkpoints").is_dir():  # before importing orbax and jax
        return None
    from gpt import checkpoint as ckpt
    try:
        step, meta = ckpt.read_meta(run_dir)
    except UserError:
        return None
    spec = meta.get("tokenizer")
    if not isinstance(spec, dict) or spec.get("kind") != "hf" or spec.get("sha256") != sha256:
        return None
    ids = {k: spec[k] for k in ("bos_id", "eot_id", "stop_ids") if k in spec}
    if bad_ids(ids, vocab_size):
        raise UserError(f"the BOS/EOS ids recorded for {run_dir / HF_FILE} in its checkpoint step {step} are not "
                        f"ids of its {vocab_size}-token vocabulary (the metadata was edited); pass the "
                        f"tokenizer.json of the model's Hugging Face folder instead")
    return ids


def bad_ids(spec: dict, n: int) -> tuple[str, str] | None:
    """(what, what is wrong with it) for a spec's BOS/EOS ids that are not ids of an n-token
    vocabulary (at most MAX_STOP_IDS extra EOS ids, beside an eot_id); None if they all are."""
    for key in ("bos_id", "eot_id"):
        v = spec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n):
            return f"{key}={v!r}", f"is not an id of its {n}-token vocabulary"
    stops = spec.get("stop_ids", [])
    valid = isinstance(stops, list) and _token_ids(stops) == stops and len(stops) <= MAX_STOP_IDS
    if not valid or not all(0 <= v < n for v in stops) or (stops and spec.get("eot_id") is None):
        shown = repr(stops) if len(repr(stops)) <= 80 else repr(stops)[:77] + "..."
        return (f"EOS ids {shown}",
                f"are not a list of at most {MAX_STOP_IDS} ids of its {n}-token vocabulary beside an eot_id")
    return None


def hf_tokenizer(data: bytes, hf, spec: dict, where: Path) -> HFTokenizer:
    """The HFTokenizer for a spec whose ids are checked to be inside the vocabulary."""
    from tokenizers import Tokenizer as HFTok

    if bad := bad_ids(spec, spec["vocab_size"]):
        raise UserError(f"{bad[0]} recorded for tokenizer {where} {bad[1]}; fix the config files beside it")
    hf.encode_special_tokens = True  # corpus text that looks like a special token stays text
    return HFTokenizer(hf, HFTok.from_str(data.decode("utf-8")), spec, files=[spec["file"]])


def warn_if_no_eos(tok: HFTokenizer, path: Path) -> None:
    if tok.eot_id is None:
        print(f"warning: no EOS id found beside {path} (generation_config.json, config.json or "
              f"tokenizer_config.json), so documents are not separated and sampling stops only at "
              f"max_new_tokens or --stop", file=sys.stderr)


def hf_tokenizer_into(path: Path, out_dir: Path, *, prompt_template: bool = False,
                      fix: str = PASS_HF) -> HFTokenizer:
    """The tokenizer.json at `path` (ids from the files beside it), copied into `out_dir`."""
    data, hf, spec = hf_spec(path, fix)
    tok = hf_tokenizer(data, hf, {**spec, "prompt_template": prompt_template}, path)
    warn_if_no_eos(tok, path)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / HF_FILE, data)
    return tok


def load_hf_spec(spec: dict, base_dir: Path) -> HFTokenizer:
    """Rebuild an hf tokenizer from its spec and its file in `base_dir`."""
    path = inside(base_dir, spec.get("file"))
    fix = f"restore it into {base_dir}, or re-create that directory"
    data, hf = read_hf_file(path, fix, spec.get("sha256"))
    n = hf_vocab_size(hf)
    if spec.get("vocab_size") == hf.get_vocab_size(with_added_tokens=True):
        n = spec["vocab_size"]  # counted by entries, as before hf_vocab_size: its data and model agree
    if spec.get("vocab_size") != n:
        raise UserError(f"tokenizer {path} has {n} tokens, its spec says {spec.get('vocab_size')!r}; {fix}")
    return hf_tokenizer(data, hf, dict(spec), path)
