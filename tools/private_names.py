"""No module reaches into another module's private names (`make lint`).

A name that starts with one underscore is its module's own business; another module that imports
it, or reads it through an imported name, breaks the day the owner renames it, and nothing says
so. Flagged, in every Python file of the repository (tests and tools included):

- `from M import _x`: a private name imported from another module (ruff's PLC2701 checks this
  only across top-level packages, so `benchmarks.probe.command` importing `benchmarks.client.bench_serve`'s
  private name passed); `from a._m import x`, `import a._m`: a private module;
- `M._x`, `M.a._x`: a private attribute read through a name an import statement bound (a
  module, or a class from one): `torch.ops.mkldnn._reorder_linear_weight`, `linear._MKLDNN`;
- `getattr(obj, "_x")` / `hasattr` / `setattr` with a literal private name: the same reach, hidden
  in a string (how the OpenTelemetry SDK's `_batch_processor._queue` was read).

Not flagged: `obj._x` on an object rather than through an import (a test poking the worker it
built; ruff's SLF001 is that rule). Dunder names are public. A few underscored names are
documented public API and allowed (`os._exit`, `sys._getframe`, namedtuple's `_replace`,
`_asdict`, `_fields`, `_make`). Reaching into
another library's internals on purpose goes through one adapter module that guards it (torch's:
`engine/torch_compat.py`) and says so with `# private-ok: <why>`, on the line or the line above.

Usage: python tools/private_names.py [PATH ...]   (default: the repository); exit 1 on a finding.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", ".git", "build", "results", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
PUBLIC_UNDERSCORED = {"_exit", "_getframe", "_replace", "_asdict", "_fields", "_make", "_field_defaults"}
ALLOW_MARK = "# private-ok:"
ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_" and name not in PUBLIC_UNDERSCORED


def imported_names(tree: ast.AST) -> set[str]:
    """Every local name an import statement binds, anywhere in the file (function-level too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names if a.name != "*")
    return names


def attribute_root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def findings(path: Path, source: str) -> Iterator[tuple[int, str]]:
    tree = ast.parse(source, str(path))
    lines = source.splitlines()
    imported = imported_names(tree)
    for node in ast.walk(tree):
        found: str | None = None
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            private = [a.name for a in node.names if is_private(a.name)]
            if private:
                found = f"imports private {', '.join(private)} from {'.' * node.level}{node.module or ''}"
            elif any(is_private(part) for part in (node.module or "").split(".")):
                found = f"imports from the private module {node.module}"
        elif isinstance(node, ast.Import):
            private = [a.name for a in node.names if any(is_private(part) for part in a.name.split("."))]
            if private:
                found = f"imports the private module {', '.join(private)}"
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            root = attribute_root(node.value)
            if root in imported:
                found = f"reads private {ast.unparse(node)} through the import {root!r}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTR_FUNCS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)
        ):
            target = node.args[0]
            if not (isinstance(target, ast.Name) and target.id in ("self", "cls")):
                found = f"{node.func.id}() of private {node.args[1].value!r}"
        if found is not None:
            here_and_above = lines[max(0, node.lineno - 2) : node.lineno]
            if not any(ALLOW_MARK in line for line in here_and_above):
                yield node.lineno, found


def python_files(paths: list[Path]) -> Iterator[Path]:
    for p in paths:
        if p.is_file():
            yield p
            continue
        for d, subdirs, files in os.walk(p):
            subdirs[:] = sorted(s for s in subdirs if s not in SKIP_DIRS and not s.startswith("."))
            yield from (Path(d) / f for f in sorted(files) if f.endswith(".py"))


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or [ROOT]
    bad = 0
    for f in python_files(paths):
        for lineno, what in sorted(findings(f, f.read_text(encoding="utf-8"))):
            rel = f.resolve().relative_to(ROOT) if f.resolve().is_relative_to(ROOT) else f
            print(f"{rel}:{lineno}: {what}")
            bad += 1
    if bad:
        print(f"{bad} private name(s) reached across modules (tools/private_names.py says why and how to allow one)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
