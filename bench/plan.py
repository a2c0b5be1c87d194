"""XLA:GPU's runtime plan of a compiled program, read from an `--xla_dump_to` folder.

XLA's GPU runtime executes a sequence of thunks: kernels, library calls (cuBLAS, cuDNN), copies,
host-driven loops and conditionals, and command buffers, which launch the thunks they hold as one
CUDA graph. After its passes XLA dumps that sequence (`*.thunk_sequence_after_thunk_passes.txt`);
a program compiled without command buffers has none, and its `*.thunk_sequence.txt` is the plan.
Counting kernels says how many there are; the plan says which run inside graphs and what the host
drives itself (a loop of unknown trip count reads its condition back every iteration), which is
what decides launch overhead when a step is many small kernels (BENCHMARKS.md: batch-1 decoding).
Used by `bench/kernel_count.py --plan` (compiled for a described GPU) and `bench/gpu.py`'s profile
part (compiled on the device). No jax here: it only reads text.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from gpt.errors import UserError

PLAN_FILE = "*.thunk_sequence_after_thunk_passes.txt"  # what XLA:GPU's runtime executes
PLAN_BEFORE_PASSES = "*.thunk_sequence.txt"  # the same where no pass ran (no command buffers)


def plan_files(folder: str) -> list[Path]:
    """Each dumped module's plan: the sequence after XLA's thunk passes, else before them."""
    def by_module(pattern: str) -> dict[str, Path]:
        return {f.name.removesuffix(pattern[1:]): f for f in Path(folder).glob(pattern)}
    return list({**by_module(PLAN_BEFORE_PASSES), **by_module(PLAN_FILE)}.values())


@dataclasses.dataclass
class Thunk:
    """One line of the plan and the lines nested under it."""
    kind: str  # kCustomKernel, kCommandBuffer, kWhile, ... or a label: "body", "condition"
    children: list["Thunk"] = dataclasses.field(default_factory=list)


def parse_plan(text: str) -> Thunk:
    """XLA:GPU's thunk sequence as dumped (`--xla_dump_to`): "NNN: kKind [...]" lines nested by
    indentation, and labels ("condition:", "body:", a conditional's branches) that open a part of
    the loop or conditional above them at their indentation or less (XLA prints a loop's
    "condition:" at the loop's own indentation, "body:" deeper, their thunks deeper still)."""
    root = Thunk("program")
    stack: list[tuple[int, Thunk]] = [(-1, root)]
    for line in text.splitlines():
        thunk = re.match(r"^(\s*)\d+: (k\w+)", line)
        label = re.match(r"^(\s*)([A-Za-z_][\w ]*):\s*$", line)
        if not (thunk or label):
            continue
        indent = len((thunk or label).group(1))
        if thunk:
            while stack[-1][0] >= indent:
                stack.pop()
        else:
            while len(stack) > 1 and not (stack[-1][1].kind in ("kWhile", "kConditional")
                                          and stack[-1][0] <= indent):
                stack.pop()
        node = Thunk(thunk.group(2) if thunk else label.group(2))
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return root


def plan_summary(node: Thunk, captured: bool = False) -> dict:
    """What one run of `node`'s thunks launches: CUDA graphs (command buffers) and the kernels and
    copies inside them, what runs outside any graph by kind (a loop or a conditional outside one
    is driven from the host), and per while loop the same for one iteration of its body, with its
    condition's kernel count (a loop of known trip count skips its condition; a loop inside a graph
    is `captured`). A conditional counts all its branches. `captured`: `node` runs in a graph."""
    out = {"graphs": 0, "in_graphs": 0, "outside": collections.Counter(), "loops": []}
    for t in node.children:
        if t.kind == "kWhile":
            part = {c.kind: c for c in t.children}
            loop = plan_summary(part.get("body", Thunk("body")), captured)
            loop.update(captured=captured, condition=_count_leaves(part.get("condition", Thunk(""))))
            out["loops"].append(loop)
            if not captured:
                out["outside"]["kWhile"] += 1
            continue
        if t.kind == "kConditional" and not captured:
            out["outside"]["kConditional"] += 1
        if t.children:  # a graph, a sequence, a conditional, a label
            inner = plan_summary(t, captured or t.kind == "kCommandBuffer")
            out["graphs"] += inner["graphs"] + (t.kind == "kCommandBuffer" and not captured)
            out["in_graphs"] += inner["in_graphs"]
            out["outside"] += inner["outside"]
            out["loops"] += inner["loops"]
        elif captured:
            out["in_graphs"] += 1
        else:
            out["outside"][t.kind] += 1
    out["outside"] = dict(out["outside"].most_common())
    return out


def _count_leaves(t: Thunk) -> int:
    """The thunks under `t` that hold no others (kernels, copies, library calls)."""
    return sum(_count_leaves(c) if c.children else 1 for c in t.children)


def dump_env(env: Mapping[str, str], folder: str) -> dict[str, str]:
    """`env` with XLA dumping what it compiles into `folder` (for a process about to start, or
    this one before its backend starts: flags are read then), and compiling afresh: a program
    taken from JAX's compilation cache is not compiled, so not dumped."""
    if re.search(r"\s", folder):  # XLA_FLAGS splits at white space
        raise UserError(f"XLA cannot dump into {folder!r} (white space in the path); set TMPDIR to "
                        f"a folder without it")
    return dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_dump_to={folder}".strip(),
                JAX_ENABLE_COMPILATION_CACHE="false")


def plan_or_note(folder: str, module: str = "") -> dict:
    """`read_plan`, or {"none": why} where XLA dumped no plan (a CPU compilation, a run that
    failed early, an XLA that names the file otherwise): with how many files it did dump, so a
    missing plan on a GPU says so instead of passing for a CPU's."""
    try:
        return read_plan(folder, module)
    except UserError:
        files = list(Path(folder).glob("*"))  # none if the folder was never made
        kinds = sorted({f.name.split(".")[-2] for f in files if f.name.count(".") >= 2})
        return {"none": f"no {PLAN_FILE} or {PLAN_BEFORE_PASSES} among {len(files)} dumped files"
                        + (f" (kinds: {', '.join(kinds[:8])})" if kinds else "")}


def read_plan(folder: str, module: str = "") -> dict:
    """The plan of the program compiled, summarised, with its file's name ("module"): of the plans
    XLA dumped into `folder`, the largest of those whose name has `module` in it (the jitted
    function's name, e.g. "jit_step_fn"), else the largest of all (the others are JAX's helpers;
    a prefill can be as large as the decode loop, so callers name theirs)."""
    files = sorted(plan_files(folder), key=lambda f: f.stat().st_size)
    if not files:
        raise UserError(f"XLA dumped no thunk plan (--plan reads a GPU compilation's {PLAN_FILE}, or "
                        f"{PLAN_BEFORE_PASSES} where no pass ran; this jax's XLA may name it otherwise)")
    chosen = ([f for f in files if module and module in f.name] or files)[-1]
    return dict(plan_summary(parse_plan(chosen.read_text())), module=chosen.name)


def plan_lines(plan: dict, indent: str = "") -> list[str]:
    """`plan_summary`'s result as lines of text, each loop's body indented under it."""
    if "none" in plan:
        return [f"{indent}none dumped: {plan['none']}"]
    lines = [f"{indent}{plan['graphs']} CUDA graph(s) with {plan['in_graphs']} kernels and copies; "
             f"outside graphs: {plan['outside'] or 'nothing'}"]
    for i, loop in enumerate(plan["loops"]):
        where = "inside a graph" if loop["captured"] else "driven from the host"
        lines.append(f"{indent}  while loop {i} ({where}; its condition {loop['condition']} "
                     f"kernel(s), not run when the trip count is known), one iteration of its body:")
        lines += plan_lines(loop, indent + "    ")
    return lines


def print_plan(plan: dict) -> None:
    print("\n".join(plan_lines(plan)))


def plan_text(plan: dict) -> str:
    """The plan on one line (gpu.md)."""
    return " ".join(line.strip() for line in plan_lines(plan))
