"""Orbax checkpoints: asynchronous saves, last-N plus best-by-val-loss, fallback past damaged steps.

Layout: `OUT/checkpoints/<step>/{params,opt_state,meta}`; `params` and `opt_state` are Orbax
PyTrees (sharded arrays saved and restored by all processes together, onto any mesh), `meta` is
JSON (step, config, tokenizer spec, data-loader state, PRNG key, val loss). Orbax writes each step
into a temporary directory and renames it when complete, so a step directory that exists is
complete; a step that still fails to restore (truncated or deleted files) is reported and skipped.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from gpt.errors import UserError

FORMAT_VERSION = 1


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir).absolute() / "checkpoints"


def list_steps(out_dir: str | Path) -> list[int]:
    """Complete steps on disk (Orbax's temporary directories are not digits, so never listed)."""
    d = checkpoint_dir(out_dir)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit())


class Checkpointer:
    def __init__(self, out_dir: str | Path, keep: int = 3, *, read_only: bool = False,
                 async_save: bool = True):
        self.dir = checkpoint_dir(out_dir)
        policy = pp.AnyPreservationPolicy([
            pp.LatestN(n=keep),
            pp.BestN(get_metric_fn=lambda m: m["val_loss"], reverse=True, n=1,
                     keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, create=not read_only, read_only=read_only,
            enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only)
        self.manager = ocp.CheckpointManager(self.dir, options=options,
                                             item_names=("params", "opt_state", "meta"))

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any],
             val_loss: float | None) -> None:
        """Start an asynchronous save (the previous one is finished first)."""
        metrics = {"val_loss": float(val_loss)} if val_loss is not None else {"val_loss": 1e30}
        args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                                  opt_state=ocp.args.StandardSave(opt_state),
                                  meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, metrics=metrics, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore(self, abstract_params: Any, abstract_opt_state: Any | None = None,
                step: int | None = None) -> tuple[int, Any, Any, dict[str, Any]]:
        """Restore the newest complete step (or `step`); fall back past damaged ones with a warning.

        Returns (step, params, opt_state or None, meta).
        """
        steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise UserError(f"no checkpoint in {self.dir.parent}")
        for s in steps:
            items = dict(params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore())
            if abstract_opt_state is not None:
                items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
            try:
                out = self.manager.restore(s, args=ocp.args.Composite(**items))
                meta = dict(out["meta"])
                if meta.get("step") != s:
                    raise ValueError(f"meta.json says step {meta.get('step')}")
                return s, out["params"], out.get("opt_state") if abstract_opt_state else None, meta
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure here means a damaged checkpoint
                reason = " ".join(str(e).split())[:160] or type(e).__name__
                others = [t for t in steps if t < s]
                then = f"falling back to step {others[0]}" if others else "no older checkpoint left"
                if jax.process_index() == 0:
                    print(f"warning: checkpoint step {s} is damaged ({reason}); {then}",
                          file=sys.stderr, flush=True)
        raise UserError(f"every checkpoint in {self.dir} is damaged (steps {sorted(steps)}); "
                        f"restart with --init_from=scratch --overwrite")


def read_meta(out_dir: str | Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """The JSON metadata of the newest readable step, without touching arrays."""
    import json
    steps = list_steps(out_dir) if step is None else [step]
    for s in sorted(steps, reverse=True):
        path = checkpoint_dir(out_dir) / str(s) / "meta" / "metadata"
        try:
            return s, json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    raise UserError(describe_missing(out_dir))


def describe_missing(out_dir: str | Path) -> str:
    out = Path(out_dir)
    if not out.exists():
        there = "it does not exist"
    else:
        names = sorted(p.name for p in out.iterdir())[:8]
        there = f"it holds: {', '.join(names)}" if names else "it is empty"
    return (f"no checkpoint found in {out}/checkpoints ({there}); train one with "
            f"`python train.py --out_dir={out}` or pass --out_dir")


def remove_all(out_dir: str | Path) -> None:
    shutil.rmtree(checkpoint_dir(out_dir), ignore_errors=True)


def load_model(out_dir: str | Path, dtype: str = "auto", step: int | None = None):
    """(model, checkpoint meta, tokenizer) from the newest complete checkpoint of `out_dir`."""
    import dataclasses

    from flax import nnx

    from gpt.config import model_from_dict
    from gpt.model import GPT
    from gpt.tokenizer import load_tokenizer

    if not list_steps(out_dir):
        raise UserError(describe_missing(out_dir))
    _, meta = read_meta(out_dir, step)
    cfg = dataclasses.replace(model_from_dict(meta["config"]["model"]), dtype=dtype, dropout=0.0)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    sd = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sd),
                            nnx.to_pure_dict(shapes))
    s, params, _, meta = Checkpointer(out_dir, read_only=True).restore(abstract, step=step)
    if "tokenizer" not in meta:
        raise UserError(f"the checkpoint in {out_dir} records no tokenizer; re-create it with "
                        f"python -m gpt.convert or python train.py")
    return nnx.merge(graphdef, params), meta, load_tokenizer(meta["tokenizer"], out_dir)
