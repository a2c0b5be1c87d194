"""Train a GPT: `python train.py [--preset=NAME] [--key=value ...]` (see README.md)."""
from __future__ import annotations

import sys
from typing import Sequence

from gpt.errors import reader_may_leave, run_main


def main(argv: Sequence[str]) -> int:
    from gpt.config import TRAIN_CLASSES, build_train, help_text
    if "-h" in argv or "--help" in argv:
        with reader_may_leave():  # `--help | head`
            print(help_text(TRAIN_CLASSES, argv, default_preset="default"))
        return 0
    model_cfg, compute_cfg, train_cfg, explicit = build_train(argv)
    from gpt.runtime import prepare_process
    prepare_process()  # before jax.distributed makes the CPU client
    from gpt import distributed, sharding
    t = train_cfg
    if t.distributed or t.coordinator_address or t.num_processes or t.process_id != -1:
        distributed.init_distributed(t.coordinator_address, t.num_processes, t.process_id)
    from gpt import train
    setup = train.prepare_setup(model_cfg, compute_cfg, train_cfg, explicit)
    summary = train.train(setup)
    if "val_loss" in summary:
        at = f" (at step {summary['val_step']})" if summary.get("val_step") != summary["step"] else ""
        sharding.log(f"done: step {summary['step']}, val loss {summary['val_loss']:.4f}{at}, "
                     f"best {summary['best_val_loss']:.4f}, {summary['elapsed_sec']:.0f}s; "
                     f"checkpoints in {train_cfg.out_dir}/checkpoints")
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
