"""Evaluate a checkpoint on any text: `python -m gpt.evaluate --out_dir=OUT --input=FILE`.

Reports the mean next-token loss (nats), perplexity and bits per byte. The text is tokenized with
the checkpoint's tokenizer and scored in consecutive non-overlapping windows of `block_size + 1`
tokens, so every token after the first of each window is predicted once. Bits per byte divide the
total bits by the UTF-8 bytes of the text, which makes models with different tokenizers comparable.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from gpt.errors import ArgParser, UserError, run_main


def score_tokens(model, ids: np.ndarray, batch_size: int = 8) -> tuple[float, int]:
    """(sum of next-token losses in nats, number of predicted tokens) over windows of the ids."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    T = model.cfg.block_size
    n_windows = max((len(ids) - 1) // T, 0)
    graphdef, params = nnx.split(model)

    @jax.jit
    def window_loss(params, x_BT, y_BT):
        return nnx.merge(graphdef, params).loss(x_BT, y_BT)[0] * x_BT.size

    total, count = 0.0, 0
    windows = [ids[i * T:i * T + T + 1] for i in range(n_windows)]
    for b in range(0, len(windows), batch_size):
        chunk = np.stack(windows[b:b + batch_size]).astype(np.int32)
        total += float(window_loss(params, jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])))
        count += chunk[:, 1:].size
    rest = ids[n_windows * T:]
    if len(rest) > 1:  # the tail, shorter than a window
        x, y = jnp.asarray(rest[None, :-1].astype(np.int32)), jnp.asarray(rest[None, 1:].astype(np.int32))
        total += float(window_loss(params, x, y))
        count += len(rest) - 1
    return total, count


def evaluate_text(out_dir: str, paths: Sequence[str], dtype: str = "auto", errors: str = "strict",
                  include: str = "*.txt") -> dict[str, float]:
    from gpt.checkpoint import load_model
    from gpt.corpus import iter_file_pieces, resolve_inputs

    files = resolve_inputs(paths, include)
    model, meta, tok = load_model(out_dir, dtype)
    loss_sum, n_pred, n_bytes = 0.0, 0, 0
    for f in files:
        text = "".join(piece for _, _, piece in iter_file_pieces(Path(f), errors))
        ids = np.asarray(tok.encode(text), np.int64)
        s, c = score_tokens(model, ids)
        loss_sum, n_pred = loss_sum + s, n_pred + c
        n_bytes += len(text.encode("utf-8"))
    if n_pred == 0:
        raise UserError(f"{', '.join(map(str, paths))} holds fewer than 2 tokens; nothing to evaluate")
    loss = loss_sum / n_pred
    return {"step": meta["step"], "loss": loss, "perplexity": math.exp(min(loss, 50)),
            "bpb": loss_sum / math.log(2) / n_bytes, "tokens": n_pred, "bytes": n_bytes}


def main(argv: Sequence[str]) -> int:
    p = ArgParser(prog="python -m gpt.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default="out", help="training output dir holding checkpoints/")
    p.add_paths("--input", required=True, help="text file(s), folder(s) or glob(s)")
    p.add_argument("--include", default="*.txt", help="file pattern inside folders")
    p.add_argument("--errors", default="strict", choices=["strict", "replace"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    a = p.parse_args(argv)
    from gpt.runtime import prepare_process
    prepare_process()
    res = evaluate_text(a.out_dir, a.input, a.dtype, a.errors, a.include)
    print(f"step {res['step']}: loss {res['loss']:.4f}, perplexity {res['perplexity']:.2f}, "
          f"bits per byte {res['bpb']:.4f} ({res['tokens']} tokens, {res['bytes']} bytes)",
          file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
