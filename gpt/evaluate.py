"""Evaluate a checkpoint on any text: `python -m gpt.evaluate --out_dir=OUT --input=FILE`.

Reports the mean next-token loss (nats), perplexity and bits per byte. The inputs are read as the
data preparation reads them (a text file is one document, a JSON line or Parquet row one), tokenized
with the checkpoint's tokenizer and joined as training joins documents: each after an end-of-text
token, which is context only (it has no bytes), or for a tokenizer without one (char) run together.
The stream is scored in consecutive non-overlapping windows of `block_size + 1` tokens, so every
token is predicted once (the stream's very first one, without an end-of-text token, is not). Bits
per byte divide the total bits by the UTF-8 bytes of the text they predict, which makes models with
different tokenizers comparable. The input streams through (a piece of text, its ids and a batch of
windows at a time), so an input of any size fits in memory.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from gpt.errors import ArgParser, UserError, run_main

LOGITS_BUDGET = 256 << 20  # bytes of float32 logits a batch of windows may hold
WINDOW_TOKENS = 8192  # and tokens, at most (the earlier 8 windows at T = 1,024; fewer windows at longer T)


def input_sources(paths: Sequence[str], include: Any) -> list:
    """The inputs' files (`gpt.corpus`), found before the model is loaded: a wrong path, or an
    --include that names no pattern (as `gpt.data` refuses it), is told at once."""
    from gpt.corpus import include_patterns, make_sources, resolve_inputs
    try:
        return make_sources(resolve_inputs(paths, include_patterns(include)))
    except OSError as e:
        raise _unreadable(paths, e) from None


def _unreadable(paths: Sequence[str], e: OSError) -> UserError:
    """One line for an input that cannot be read (it may vanish or fail while streamed)."""
    return UserError(f"cannot read {e.filename or ', '.join(map(str, paths))} ({e.strerror}); check "
                     f"the path and its permissions")


def token_pieces(sources: list, reading: Any, tok: Any, paths: Sequence[str] = ()
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(ids, scored, n_bytes) for each piece of the sources, read by `gpt.corpus` and tokenized piece
    by piece as `gpt.data` tokenizes a corpus, so that memory stays bounded on any input. Pieces
    (about 1 MiB of a long document) are cut where GPT-2's pre-tokenizer cuts, which changes no
    token of gpt2, char or bpe:N; a Hugging Face tokenizer may differ from encoding the document
    whole by a token or so per MiB, as the training data it was prepared with does. `scored` says
    which ids count as targets: a document's own, not the end-of-text token put before it where the
    tokenizer has one (as training separates documents). n_bytes: the piece's UTF-8 bytes as read
    (after --errors=replace, without a byte-order mark; the same for every format)."""
    from gpt.corpus import iter_corpus
    try:
        for _, _, text, first in iter_corpus(sources, reading, sum(s.size for s in sources) + 1):
            ids = tok.encode_array(text, np.int64)
            scored = np.ones(len(ids), bool)
            if first and tok.eot_id is not None:
                ids, scored = np.concatenate([[tok.eot_id], ids]), np.concatenate([[False], scored])
            yield ids, scored, len(text.encode("utf-8"))
    except OSError as e:
        raise _unreadable(paths, e) from None


def score_stream(model: Any, pieces: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int]:
    """(sum of next-token losses in nats, number of predicted tokens) over consecutive windows of
    `block_size + 1` tokens of the pieces' ids run together, each window's last id the next one's
    first; `scored` [N] of each piece says which of its ids count as targets. Batches of windows
    are scored as the stream arrives (at most a batch and a piece are held), padded to one shape
    (the padding unscored), so that one program is compiled."""
    T, V = model.cfg.block_size, model.cfg.padded_vocab_size
    rows = max(1, min(WINDOW_TOKENS // T, LOGITS_BUDGET // (T * V * 4)))
    nats = _window_loss(model)
    total, n_pred, span = 0.0, 0, rows * T + 1
    ids, scored = np.zeros(0, np.int64), np.zeros(0, bool)
    for piece_ids, piece_scored in pieces:
        ids, scored = np.concatenate([ids, piece_ids]), np.concatenate([scored, piece_scored])
        while len(ids) >= span:  # a whole batch: score it, keep its last id as the next one's context
            total, n_pred = _add(nats, rows, T, ids[:span], scored[:span], total, n_pred)
            ids, scored = ids[span - 1:], scored[span - 1:]
    if len(ids) > 1:
        total, n_pred = _add(nats, rows, T, ids, scored, total, n_pred)
    return total, n_pred


def _window_loss(model: Any) -> Callable[..., Any]:
    """(x_BT, y_BT, w_BT) -> the summed nats of the w_BT targets: one jitted program, the model's
    parameters bound."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    graphdef, params = nnx.split(model)

    @jax.jit
    def nats(params, x_BT, y_BT, w_BT):
        logits_BTV = nnx.merge(graphdef, params)(x_BT)[0].astype(jnp.float32)
        target_BT = jnp.take_along_axis(logits_BTV, y_BT[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(w_BT, jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT, 0.0))

    return lambda *a: nats(params, *a)


def _add(nats: Callable[..., Any], rows: int, T: int, ids: np.ndarray, scored: np.ndarray,
         total: float, n_pred: int) -> tuple[float, int]:
    """`total` and `n_pred` with the windows of ids[:rows*T+1] added (the rest padded, unscored)."""
    x, y = np.zeros((rows * T + 1,), np.int32), np.zeros((rows * T + 1,), bool)
    x[:len(ids)], y[:len(ids)] = ids, scored
    inputs, targets, weights = (a.reshape(rows, T) for a in (x[:-1], x[1:], y[1:]))
    return total + float(nats(inputs, targets, weights)), n_pred + int(weights.sum())


def score_tokens(model: Any, ids: np.ndarray, scored: np.ndarray | None = None) -> tuple[float, int]:
    """`score_stream` of one array of ids (`scored` default: all)."""
    return score_stream(model, [(ids, np.ones(len(ids), bool) if scored is None else scored)])


def evaluate_text(out_dir: str, paths: Sequence[str], dtype: str = "auto", errors: str = "strict",
                  include: str | None = None, text_field: str = "text", skip_bad_records: bool = False
                  ) -> dict[str, float]:
    """The checkpoint's loss, perplexity and bits per byte on the inputs (module docstring). The
    inputs are read and tokenized once before the weights are loaded, ids not kept: what cannot be
    read or tokenized (invalid UTF-8, a bad record, a character outside a char vocabulary) is told
    at once, not after loading the model or when the scoring reaches it."""
    from gpt.checkpoint import load_model, load_tokenizer_of
    from gpt.corpus import DEFAULT_INCLUDE, Reading

    sources = input_sources(paths, DEFAULT_INCLUDE if include is None else include)
    tok = load_tokenizer_of(out_dir)
    reading = Reading(errors, text_field, skip_bad_records)
    n_bytes, n_scored, first = 0, 0, None  # the stream's first id, and whether it is scored
    for ids, scored, piece_bytes in token_pieces(sources, reading, tok, paths):
        n_bytes, n_scored = n_bytes + piece_bytes, n_scored + int(scored.sum())
        first = first or ((int(ids[0]), bool(scored[0])) if len(ids) else None)
    if first is not None and first[1]:  # no end-of-text token before it: its bytes are not predicted
        n_bytes -= len(tok.decode([first[0]]).encode("utf-8"))
        n_scored -= 1  # nor is it a target
    if n_scored == 0:  # told before the weights are read, as a text that cannot be tokenized is
        raise UserError(f"{', '.join(map(str, paths))} holds fewer than 2 tokens; nothing to evaluate")
    model, meta, _ = load_model(out_dir, dtype, tok=tok)
    pieces = ((ids, scored) for ids, scored, _ in token_pieces(sources, reading, tok, paths))
    loss_sum, n_pred = score_stream(model, pieces)
    loss = loss_sum / n_pred
    return {"step": meta["step"], "loss": loss, "perplexity": math.exp(min(loss, 50)),
            "bpb": loss_sum / math.log(2) / max(n_bytes, 1), "tokens": n_pred, "bytes": n_bytes}


def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m gpt.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default="out", help="training output dir holding checkpoints/")
    p.add_paths("--input", required=True, help="text, JSONL or Parquet file(s), folder(s) or glob(s)")
    p.add_argument("--include", default=None, help="file name patterns for folders, comma-separated "
                   "(default: gpt.data's, *.txt,*.txt.gz,*.jsonl,*.jsonl.gz,*.parquet)")
    p.add_argument("--text_field", default="text", help="a JSONL record's text key, or Parquet column")
    p.add_argument("--skip_bad_records", action="store_true", help="skip records without text")
    p.add_argument("--errors", default="strict", choices=["strict", "replace"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    a = p.parse_args(argv)
    from gpt.runtime import prepare_process
    prepare_process()
    res = evaluate_text(a.out_dir, a.input, a.dtype, a.errors, a.include, a.text_field, a.skip_bad_records)
    print(f"step {res['step']}: loss {res['loss']:.4f}, perplexity {res['perplexity']:.2f}, "
          f"bits per byte {res['bpb']:.4f} ({res['tokens']} tokens, {res['bytes']} bytes)",
          file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
