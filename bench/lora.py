"""LoRA against full fine-tuning, from the same base, on a new domain of the bundled corpus.

    python bench/lora.py --out=DIR [--base_iters=2000] [--iters=500] [--rank=8] [--alpha=16]
                         [--lora_lr=4e-3] [--full_lr=1e-3] [--targets=attn,mlp] [--split=0.5]
                         [train.py settings for every run, e.g. --preset=default --dtype=float32]

The bundled Shakespeare is cut at --split (a fraction of its characters): the first part is the
"old" domain the base is pre-trained on (--base_iters steps), the rest, other plays, the "new" one.
Both are char-tokenized with one alphabet (the base's ids must mean the same characters), so the
few lines holding a character that occurs on one side only are dropped from both (counted in the
output). From that base, a LoRA run (rank --rank, alpha --alpha on --targets) and a full
fine-tuning run train --iters steps each on the new domain with the same batches, schedule shape
and seed; only the learning rate differs (--lora_lr, --full_lr: LoRA's update is scaled by
alpha / rank and usually wants a larger rate).

Reported per run: the final val loss of the training loop (random windows of the new domain's
val split), the loss over the whole val text (`gpt.evaluate`'s windows; also for the base, with
no fine-tuning), trainable parameters, params+optimizer bytes (the frozen base included for
LoRA), and the median step time (from metrics.jsonl, timed by train.py from the end of the first,
compiling step). The base in DIR/base is reused when it is there (delete it to retrain). The
last line printed is one JSON object. Small check: --base_iters=20 --iters=10 --eval_iters=2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpt.errors import UserError, run_main  # noqa: E402

CORPUS = REPO / "data" / "shakespeare.txt"


def split_domains(text: str, at: float) -> tuple[str, str, int]:
    """(old, new, lines dropped): `text` cut at fraction `at` on a line boundary, without the lines
    whose characters do not occur on both sides (repeated until both share one alphabet)."""
    cut = text.rfind("\n", 0, int(len(text) * at)) + 1
    old, new = text[:cut].splitlines(keepends=True), text[cut:].splitlines(keepends=True)
    dropped = 0
    while set("".join(old)) != set("".join(new)):
        common = set("".join(old)) & set("".join(new))
        keep_old = [ln for ln in old if set(ln) <= common]
        keep_new = [ln for ln in new if set(ln) <= common]
        dropped += len(old) + len(new) - len(keep_old) - len(keep_new)
        old, new = keep_old, keep_new
    return "".join(old), "".join(new), dropped


def train_run(argv: list[str]) -> dict:
    """One training run through train.py's own path (gpt.config + gpt.train)."""
    from gpt import train as T
    from gpt.config import build_train
    return T.train(T.prepare_setup(*build_train(argv)))


def step_ms(out: Path, tokens_per_step: int) -> float | None:
    """Median step time from metrics.jsonl's train records (train.py leaves the first step, which
    compiles, out of them)."""
    rates = [r["tokens_per_sec"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "train" and r.get("tokens_per_sec")]
    return 1e3 * tokens_per_step / statistics.median(rates) if rates else None


def whole_val_loss(out: Path, val_text: Path) -> float:
    from gpt.evaluate import evaluate_text
    return evaluate_text(str(out), [str(val_text)], dtype="float32")["loss"]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python bench/lora.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="working directory (data, base, runs)")
    p.add_argument("--base_iters", type=int, default=2000)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--lora_lr", type=float, default=4e-3)
    p.add_argument("--full_lr", type=float, default=1e-3)
    p.add_argument("--targets", default="attn,mlp")
    p.add_argument("--split", type=float, default=0.5)
    a, rest = p.parse_known_args(argv)
    if a.base_iters < 1 or a.iters < 1 or not 0.1 <= a.split <= 0.9:
        raise UserError("--base_iters and --iters must be positive, --split in [0.1, 0.9]")
    return a, rest


def main(argv: list[str]) -> int:
    a, common = parse(argv)
    out = Path(a.out).absolute()
    (out / "data").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPT_DATA_CACHE", str(out / "cache"))
    old, new, dropped = split_domains(CORPUS.read_text(encoding="utf-8"), a.split)
    for name, text in (("old.txt", old), ("new.txt", new)):
        (out / "data" / name).write_text(text, encoding="utf-8")
    val_text = out / "data" / "new_val.txt"  # the last 10%: the val split of new.txt (a .txt cut is exact)
    val_text.write_text(new.encode()[int(len(new.encode()) * 0.9):].decode(errors="ignore"), encoding="utf-8")
    common = ["--no_progress", "--tokenizer=char", "--seed=1337", *common]
    base = out / "base"
    from gpt import checkpoint as ckpt
    if not ckpt.list_steps(base):
        train_run([*common, f"--out_dir={base}", f"--input={out / 'data' / 'old.txt'}",
                   f"--max_iters={a.base_iters}"])
    tune = [*common, f"--init_from={base}", f"--input={out / 'data' / 'new.txt'}", f"--max_iters={a.iters}",
            f"--lr_decay_iters={a.iters}", f"--eval_interval={a.iters}",
            f"--warmup_iters={max(a.iters // 20, 1)}", "--overwrite"]
    variants = {"lora": [f"--lora_rank={a.rank}", f"--lora_alpha={a.alpha}", f"--lora_targets={a.targets}",
                         f"--learning_rate={a.lora_lr}", f"--min_lr={a.lora_lr / 10}"],
                "full": [f"--learning_rate={a.full_lr}", f"--min_lr={a.full_lr / 10}"]}
    results = {"base": {"whole_val_loss": whole_val_loss(base, val_text)}}
    for name, flags in variants.items():
        summary = train_run([*tune, *flags, f"--out_dir={out / name}"])
        _, meta = ckpt.read_meta(out / name)
        t, m = meta["config"]["train"], meta["config"]["model"]
        tokens_per_step = t["batch_size"] * t["gradient_accumulation_steps"] * m["block_size"]
        results[name] = {"val_loss": summary["val_loss"],
                         "whole_val_loss": whole_val_loss(out / name, val_text),
                         "trainable_params": summary["trainable_params"],
                         "state_bytes": summary["state_bytes"],
                         "step_ms": step_ms(out / name, tokens_per_step), "flags": flags}
    for name, r in results.items():
        cells = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k != "flags"]
        print(f"{name}: {', '.join(cells)}", file=sys.stderr)
    print(json.dumps({"results": results, "dropped_lines": dropped, "iters": a.iters,
                      "base_iters": a.base_iters, "rank": a.rank, "alpha": a.alpha, "common_flags": common}))
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
