"""Every third-party module the runtime imports (gpt/, train.py, sample.py) is installed by
requirements.txt alone: after the README's install, every command works (a module only in
requirements-test.txt once broke `python -m gpt.convert`)."""
from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions

from helpers import REPO


def _imported(node) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    return set()


def _optional(tree) -> set[str]:
    """Imports inside `try: ... except ImportError:` (the code works without them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    names |= _imported(sub)
    return names


def runtime_imports() -> set[str]:
    """Top-level names of the modules the runtime code imports (lazy imports too; not the
    optional ones guarded by ImportError)."""
    files = [*(REPO / "gpt").rglob("*.py"), REPO / "train.py", REPO / "sample.py"]
    names, optional = set(), set()
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        optional |= _optional(tree)
        for node in ast.walk(tree):
            names |= _imported(node)
    return names - optional - set(sys.stdlib_module_names) - {"gpt", "__future__"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_runtime_imports_are_in_requirements_txt():
    required = set()
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            required.add(normalize(re.split(r"[<>=!~\[; ]", line)[0]))
    dists = packages_distributions()
    missing = {}
    for module in sorted(runtime_imports()):
        options = {normalize(d) for d in dists.get(module, [module])}
        if not options & required:
            missing[module] = sorted(options)
    assert not missing, f"imported by the runtime but not in requirements.txt: {missing}"
