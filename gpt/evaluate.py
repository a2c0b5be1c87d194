"""Evaluate a checkpoint on any text: `python -m gpt.evaluate --out_dir=OUT --input=FILE`.

Reports the mean next-token loss (nats), perplexity and bits per byte. The inputs are read as the
data preparation reads them (a text file is one document, a JSON line or Parquet row one), tokenized
with the checkpoint's tokenizer and joined as training joins documents: each after an end-of-text
token, which is context only (it has no bytes), or for a tokenizer without one (char) run together.
The stream is scored in consecutive non-overlapping windows of `block_size + 1` tokens, so every
token is predicted once (the stream's very first one, without an end-of-text token, is not). Bits
per byte divide the total bits by the UTF-8 bytes of the text they predict, which makes models with
different tokenizers comparable.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Sequence

import numpy as np

from gpt.errors import ArgParser, UserError, run_main

LOGITS_BUDGET = 256 << 20  # bytes of float32 logits a batch of windows may hold


def read_documents(paths: Sequence[str], reading, include) -> tuple[list[str], int]:
    """The inputs' documents, by `gpt.corpus`, and the UTF-8 bytes of their text (as read: after
    --errors=replace, without a byte-order mark; the same for every format)."""
    from gpt.corpus import iter_corpus, make_sources, resolve_inputs
    try:
        sources = make_sources(resolve_inputs(paths, include))
        docs: list[list[str]] = []
        n_bytes = 0
        for _, _, text, first in iter_corpus(sources, reading, sum(s.size for s in sources) + 1):
            if first or not docs:
                docs.append([])
            docs[-1].append(text)
            n_bytes += len(text.encode("utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {e.filename or ', '.join(map(str, paths))} ({e.strerror}); check "
                        f"the path and its permissions") from None
    return ["".join(d) for d in docs], n_bytes


def token_stream(docs: list[str], tok) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids as one stream, and which of them are scored: each document's own (after
    an end-of-text token where the tokenizer has one, as training separates documents)."""
    ids, scored = [], []
    for d in docs:
        if tok.eot_id is not None:
            ids.append(np.array([tok.eot_id]))
            scored.append(np.zeros(1, bool))
        ids.append(np.asarray(tok.encode(d), np.int64))
        scored.append(np.ones(len(ids[-1]), bool))
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate(ids), np.concatenate(scored)


def score_tokens(model, ids: np.ndarray, scored: np.ndarray | None = None) -> tuple[float, int]:
    """(sum of next-token losses in nats, number of predicted tokens) over windows of the ids;
    `scored` [N] says which ids count as targets (default: all). The windows are padded to one
    shape (the padding unscored), so that one program is compiled."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    T, V = model.cfg.block_size, model.cfg.padded_vocab_size
    scored = np.ones(len(ids), bool) if scored is None else scored
    n_windows = -(-max(len(ids) - 1, 0) // T)
    rows = max(1, min(8, LOGITS_BUDGET // (T * V * 4)))
    n_rows = -(-n_windows // rows) * rows
    x, y = np.zeros((n_rows * T + 1,), np.int32), np.zeros((n_rows * T + 1,), bool)
    x[:len(ids)], y[:len(ids)] = ids, scored
    y[0] = False  # the first id is never predicted
    graphdef, params = nnx.split(model)

    @jax.jit
    def nats(params, x_BT, y_BT, w_BT):
        logits_BTV = nnx.merge(graphdef, params)(x_BT)[0].astype(jnp.float32)
        target_BT = jnp.take_along_axis(logits_BTV, y_BT[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(w_BT, jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT, 0.0))

    inputs, targets, weights = (a.reshape(n_rows, T) for a in (x[:-1], x[1:], y[1:]))
    total = 0.0
    for b in range(0, n_rows, rows):
        total += float(nats(params, *(jnp.asarray(a[b:b + rows]) for a in (inputs, targets, weights))))
    return total, int(weights.sum())


def evaluate_text(out_dir: str, paths: Sequence[str], dtype: str = "auto", errors: str = "strict",
                  include=None, text_field: str = "text", skip_bad_records: bool = False) -> dict[str, float]:
    from gpt.checkpoint import load_model
    from gpt.corpus import DEFAULT_INCLUDE, Reading

    docs, n_bytes = read_documents(paths, Reading(errors, text_field, skip_bad_records),
                                   include or DEFAULT_INCLUDE)
    model, meta, tok = load_model(out_dir, dtype)
    ids, scored = token_stream(docs, tok)
    if len(ids) and scored[0]:  # no end-of-text token before it: its bytes are not predicted
        n_bytes -= len(tok.decode([int(ids[0])]).encode("utf-8"))
    loss_sum, n_pred = score_tokens(model, ids, scored)
    if n_pred == 0:
        raise UserError(f"{', '.join(map(str, paths))} holds fewer than 2 tokens; nothing to evaluate")
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
