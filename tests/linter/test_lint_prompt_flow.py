"""The value-flow analysis behind PS301-PS305 (linter/prompt_flow.py) on code it was not written for."""

import ast
import sysconfig
from pathlib import Path

from linter.prompt_flow import analyze

ROOT = Path(__file__).resolve().parents[2]


def test_analysis_never_raises_on_real_modules():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "asyncio").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))
    files += sorted((ROOT / "linter").rglob("*.py")) + sorted((ROOT / "gateway").rglob("*.py"))
    assert len(files) > 80
    for path in files:
        analyze(ast.parse(path.read_text(encoding="utf-8")))


def test_this_repository_has_no_findings():
    for folder in ("linter", "gateway", "engine"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            assert analyze(ast.parse(path.read_text(encoding="utf-8"))) == (), path


def _codes(source: str) -> list[tuple[int, str]]:
    return [(r.cause.line, r.cause.code) for r in analyze(ast.parse(source))]


def test_one_finding_per_cause_however_many_sinks_it_reaches():
    source = (
        "from datetime import datetime\n"
        "def build():\n"
        "    stamp = datetime.now().strftime('%H:%M')\n"
        "    system_prompt = 'At ' + stamp\n"
        "    return [{'role': 'system', 'content': system_prompt}, {'role': 'developer', 'content': stamp}]\n"
    )
    assert _codes(source) == [(3, "PS301")]


def test_sorted_is_the_fix_and_order_free_uses_are_fine():
    source = (
        "NAMES = {'b', 'a'}\n"
        "def tools():\n"
        "    first = [n for n in NAMES]\n"
        "    second = [n for n in sorted(NAMES)]\n"
        "    return {'tools': None, 'system_prompt': f'{len(NAMES)} tools, a in names: {\"a\" in NAMES}, {max(NAMES)}'}\n"
        "def send(client):\n"
        "    client.create(tools=tools()['tools'], instructions='x')\n"
        "tools_list = [n for n in sorted(NAMES)]\n"
    )
    assert _codes(source) == []
