"""The gateway's layout: wings import in one direction and no module imports itself back.

Reads every import statement under gateway/ (module level, inside functions and
``TYPE_CHECKING`` blocks alike) with ``ast``; nothing is imported. A module-level
circle would fail at import time, but one closed by an import inside a function only
hides until the function runs; both count here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"
# Lowest first: a wing may import the wings listed before it, never those after.
ORDER = ("ground", "config", "policy", "stats", "responses", "upstream", "routing", "proxy", "server",
         "commands")
GROUND = {"errors", "request_record"}  # plain data at the package's root
ROOT_MODULES = {"__init__", "cli", *GROUND}
MAX_ROOMS = 14


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in GATEWAY.rglob("*.py") if "migrations" not in p.parts}


def imports_of(path: Path, known: set[str], prefix: str = "gateway") -> set[str]:
    """The modules of ``known`` that ``path`` imports (``from pkg import module`` names the
    module, ``from pkg.module import symbol`` the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != prefix and not node.module.startswith(prefix + "."):
                continue
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == prefix or a.name.startswith(prefix + "."))
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: {t for t in imports_of(path, known) if t in known and t != name} for name, path in mods.items()}


def wing(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return "ground" if parts[1] in GROUND else ("root" if parts[1] == "cli" else parts[1])


def test_rooms_are_few_and_wings_documented():
    rooms = sorted(p.stem for p in GATEWAY.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    assert len(rooms) <= MAX_ROOMS, rooms
    for room in rooms:
        if (GATEWAY / room).is_dir() and room != "migrations":
            assert room in ORDER, f"gateway/{room}/ has no place in the layout's ORDER"
            doc = ast.get_docstring(ast.parse((GATEWAY / room / "__init__.py").read_text()))
            assert doc and len(doc) > 80, f"gateway/{room}/__init__.py needs a paragraph saying what it holds"
        elif (GATEWAY / room).is_file() or room.endswith(".py"):
            assert room in ROOT_MODULES, f"gateway/{room}.py belongs in a wing"


def test_wings_import_downwards():
    for module, targets in graph().items():
        own = wing(module)
        if own == "root":
            continue
        for target in targets:
            other = wing(target)
            assert other != "root", f"{module} imports {target}"
            if own == "ground":
                assert other == "ground", f"the ground imports a wing: {module} -> {target}"
                continue
            assert other == own or ORDER.index(other) < ORDER.index(own), f"{module} imports upwards: {target}"


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_the_checker_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from gateway.config import runtime_dir\n    import gateway.errors\n")
    assert imports_of(sample, {"gateway.config.runtime_dir", "gateway.errors"}) == {
        "gateway.config.runtime_dir", "gateway.errors"}


FORBIDDEN = ("engine.server", "engine.core", "engine.model", "engine.multimodal", "engine.structured",
             "engine.model_store")


def engine_imports(path: Path) -> set[str]:
    """Every ``engine...`` module or name ``path`` imports, at module level or in a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "engine":
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "engine")
    return found


def test_gateway_and_linter_use_only_the_engine_contract():
    """The engine's torch-free contract (and its pure-Python block hashes) only; the root
    command may name ``engine.cli`` as a string to dispatch to it."""
    bad = []
    for package in ("gateway", "linter"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in engine_imports(path):
                if name.startswith(FORBIDDEN):
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert bad == []


def test_the_wheel_lists_every_package():
    """pyproject.toml names its packages (to map the top-level migrations/ into the
    wheel): a new subpackage missing from that list would be missing from the wheel."""
    import tomllib

    from setuptools import find_packages

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(str(ROOT), include=["engine*", "linter*", "gateway*"]))
    assert set(setuptools["packages"]) == found | {"gateway.migrations", "gateway.migrations.versions"}
    assert setuptools["package-dir"] == {"gateway.migrations": "migrations"}
    assert (ROOT / "migrations" / "env.py").is_file() and not (GATEWAY / "migrations").exists()
