"""The engine's layout: subpackages import in one direction and no module imports itself back.

Reads the import statements of every module under engine/ (module level and inside
functions, ``TYPE_CHECKING`` blocks included) with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
ALLOWED = {  # subpackage -> subpackages it may import (besides itself)
    "kvcache": set(),
    # what engine, gateway and linter share byte for byte: torch-free (see the test below)
    "contract": {"kvcache"},
    "model": {"kvcache", "config", "model_store", "multimodal"},
    "core": {"model", "kvcache", "config", "multimodal", "promptcache"},
    "server": {"core", "kvcache", "config", "structured", "contract", "multimodal", "promptcache"},
    "multimodal": {"kvcache", "contract"},  # processor, vision tower, encoder cache: torch + transformers
    "structured": set(),  # grammar-constrained decoding: llguidance + torch, nothing of ours
    # PML and the SegmentedPrompt contract: torch-free
    "promptcache": {"contract"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "engine":
                found.update(f"engine.{alias.name}" for alias in node.names)
            elif node.module.startswith("engine."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("engine."))
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ENGINE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in engine_imports(path):
            # "from engine.model import attention" names a module; "from engine.x import y" a symbol
            targets.add(imported if imported in modules else imported.rsplit(".", 1)[0])
        edges[name] = {t for t in targets if t in modules and t != name}
    return edges


def subpackage(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_subpackages_import_in_one_direction():
    for module, targets in graph().items():
        own = subpackage(module)
        if own not in ALLOWED:
            continue
        for target in targets:
            other = subpackage(target)
            assert other == own or other in ALLOWED[own], f"{module} imports {target}"


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            if nxt.startswith(node + ".") or node == "engine":
                continue  # a package importing its own submodules is not a cycle
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [])


def test_the_contract_imports_no_torch():
    """The gateway and the linter import engine.contract: importing all of it loads
    neither torch nor transformers (nor anything of the engine's server, core or model)."""
    contract = sorted(module_name(p) for p in (ENGINE / "contract").glob("*.py"))
    assert len(contract) >= 10, contract
    code = (f"import sys; import {', '.join(contract)}; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith(('engine.server', 'engine.core', 'engine.model.', 'engine.multimodal', "
            "'engine.structured', 'engine.model_store'))); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ENGINE.parent)
    assert out.stdout.strip() == "[]", out.stdout
