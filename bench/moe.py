"""Mixture of experts against the dense model with the same active parameters, on the bundled corpus.

    python bench/moe.py --out=DIR [--seeds=1337,1338,1339] [--n_expert=8] [--n_expert_per_token=2]
                        [--expert_capacity_factor=F --moe_aux_loss_coef=A --moe_z_loss_coef=Z]
                        [train.py settings for every run, e.g. --preset=default --max_iters=2000]

Two models train with train.py's own path (gpt.config + gpt.train) on the bundled Shakespeare, once
per seed, with the same batches, schedule and steps: "moe", whose every block's MLP is a top-k
router over --n_expert experts of the preset's MLP width F, and "dense", whose MLP is k * F wide,
so that both have the same active parameters per token (up to the router's D x E per MoE layer;
both counts are reported) and the same FLOPs per token.

Reported per model (mean and standard deviation over the seeds): the final val loss of the training
loop (eval_iters random windows of the val split; evaluation never drops tokens), the median step
time (from metrics.jsonl's tokens/s, which train.py times from the end of the first, compiling step),
total and active parameters, and for the MoE model the load balance over the last 10% of the train
records: the busiest expert's share times E (1.0: perfectly even; the worst layer), the auxiliary
load-balancing loss (1.0 when uniform) and the share of token choices dropped by capacity. A
Markdown table goes to stderr and DIR/moe.md; the last line printed is one JSON object (also
DIR/moe.json). Small check: --preset=tiny --max_iters=4 --eval_interval=4 --eval_iters=1
--log_interval=1 --seeds=1,2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpt.errors import UserError, run_main  # noqa: E402

MOE_ONLY = ("moe_every", "expert_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python bench/moe.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="working directory (one output dir per run)")
    p.add_argument("--seeds", default="1337,1338,1339")
    p.add_argument("--n_expert", type=int, default=8)
    p.add_argument("--n_expert_per_token", type=int, default=2)
    for flag in MOE_ONLY:  # the MoE run's own settings, never given to the dense run
        p.add_argument(f"--{flag}")
    a, rest = p.parse_known_args(argv)
    if a.moe_every not in (None, "1"):
        raise UserError(f"--moe_every={a.moe_every}: bench/moe.py compares every-block MoE with a dense "
                        "model of the same active parameters, which needs --moe_every=1 (or leave it out)")
    try:
        a.seeds = [int(s) for s in a.seeds.split(",") if s]
    except ValueError:
        raise UserError(f"--seeds={a.seeds} must be comma-separated integers") from None
    if not a.seeds:
        raise UserError("--seeds needs at least one seed")
    return a, rest


def variants(a: argparse.Namespace, common: list[str]) -> dict[str, list[str]]:
    """The MoE model's flags, and the dense model's: the MLP k times as wide as one expert."""
    from gpt.config import build_train
    moe = [f"--n_expert={a.n_expert}", f"--n_expert_per_token={a.n_expert_per_token}",
           *(f"--{flag}={getattr(a, flag)}" for flag in MOE_ONLY if getattr(a, flag) is not None)]
    m, _, _, _ = build_train([*common, *moe])
    return {"moe": moe, "dense": [f"--ffn_dim={a.n_expert_per_token * m.ffn}"]}


def train_run(argv: list[str]) -> tuple[dict, object]:
    from gpt import train as T
    from gpt.config import build_train
    setup = T.prepare_setup(*build_train(argv))
    return T.train(setup), setup


def step_ms(records: list[dict], tokens_per_step: int) -> float | None:
    """Median step time from the train records' tokens/s (train.py leaves the first step, which
    compiles, out of them)."""
    rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    return 1e3 * tokens_per_step / statistics.median(rates) if rates else None


def load_balance(records: list[dict], n_expert: int) -> dict[str, float]:
    """Over the last 10% of the train records: the busiest expert's share x E in the worst layer,
    the auxiliary loss and the dropped share (means)."""
    last = records[-max(1, len(records) // 10):]
    busiest = [max(max(load) for load in r["moe_load"].values()) * n_expert for r in last]
    return {"load_max_x_E": statistics.mean(busiest),
            "aux_loss": statistics.mean(r["moe_aux_loss"] for r in last),
            "dropped_fraction": statistics.mean(r["moe_dropped_fraction"] for r in last)}


def one_run(name: str, flags: list[str], seed: int, common: list[str], out: Path) -> dict:
    from gpt.model import num_params
    run_dir = out / f"{name}-{seed}"
    summary, setup = train_run([*common, *flags, f"--seed={seed}", f"--out_dir={run_dir}", "--overwrite"])
    m, t = setup.model_cfg, setup.train_cfg
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    tokens_per_step = t.batch_size * t.gradient_accumulation_steps * m.block_size
    row = {"val_loss": summary["val_loss"], "step_ms": step_ms(train, tokens_per_step),
           "params": num_params(m), "active_params": num_params(m, active=True)}
    if m.n_expert:
        row.update(load_balance(train, m.n_expert))
    return row


def table(results: dict[str, list[dict]]) -> str:
    """Markdown: per model, each figure's mean ± standard deviation over the seeds."""
    keys = ["val_loss", "step_ms", "params", "active_params", "load_max_x_E", "aux_loss", "dropped_fraction"]
    lines = ["| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, rows in results.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rows if r.get(k) is not None]
            if not vals:
                cells.append("-")
            elif k.endswith("params"):
                cells.append(f"{vals[0] / 1e6:.3f}M")
            else:
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                cells.append(f"{statistics.mean(vals):.4g} ± {sd:.2g}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a, common = parse(argv)
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--no_progress", *common]
    results: dict[str, list[dict]] = {}
    for seed in a.seeds:  # seeds outermost: an interrupted bench still has both models per seed
        for name, flags in variants(a, common).items():
            results.setdefault(name, []).append({"seed": seed, **one_run(name, flags, seed, common, out)})
    md = table(results)
    print(md, file=sys.stderr)
    (out / "moe.md").write_text(md + "\n")
    report = {"results": results, "seeds": a.seeds, "n_expert": a.n_expert,
              "n_expert_per_token": a.n_expert_per_token, "common_flags": common,
              "flags": variants(a, common)}
    (out / "moe.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
