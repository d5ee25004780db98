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
        analyze(ast.parse(path.read_text(encoding="utf-8")), str(path))


def test_this_repository_has_no_findings():
    for folder in ("linter", "gateway", "engine"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            assert analyze(ast.parse(path.read_text(encoding="utf-8")), str(path)) == (), path


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


def test_generators_and_clocks_kept_on_self_are_followed():
    source = (
        "import random, time\n"
        "class Tutor:\n"
        "    def __init__(self, seed=None):\n"
        "        self.rand = random.Random(seed)\n"
        "        self.fixed = random.Random(7)\n"
        "        self.clock = time.time\n"
        "    def system_prompt(self):\n"
        "        return 'You are {}.'.format(['a', 'b'][self.rand.randint(0, 1)])\n"
        "    def instructions(self):\n"
        "        return 'Started %d. Pick %d.' % (self.clock(), self.fixed.randint(0, 1))\n"
    )
    assert _codes(source) == [(8, "PS301"), (10, "PS301")]  # not the constant-seeded generator


def test_a_set_kept_on_self_reaches_a_tool_description_through_an_f_string():
    source = (
        "MODULES = {'billing', 'search'}\n"
        "class Router:\n"
        "    def __init__(self):\n"
        "        self.modules = list(set(MODULES))\n"
        "        self.names = sorted(MODULES)\n"
        "    def tools(self):\n"
        "        return [{'type': 'function', 'function': {'name': 'route', 'parameters': {},\n"
        "                 'description': f\"One of {', '.join(self.modules)} or {self.names}\"}}]\n"
    )
    assert _codes(source) == [(4, "PS303")]


def test_helpers_imported_from_sibling_modules_are_followed(tmp_path):
    (tmp_path / "helpers.py").write_text(
        "import time, uuid\n"
        "def stamp():\n    return time.strftime('%H:%M')\n"
        "def tag():\n    return 'id-%s' % uuid.uuid4().hex\n"
        "def fixed():\n    return 'Answer briefly.'\n"
    )
    agent = tmp_path / "agent.py"
    agent.write_text(
        "from helpers import fixed, stamp, tag\n"
        "def request(q):\n"
        "    system_prompt = f'At {stamp()}. {fixed()}'\n"
        "    instructions = 'Run {}. %s' .format(tag()) % system_prompt\n"
        "    return {'instructions': instructions, 'input': q}\n"
    )
    found = analyze(ast.parse(agent.read_text()), str(agent))
    assert [(r.cause.line, r.cause.code) for r in found] == [(3, "PS301"), (4, "PS301")]
    assert "helpers.py:3" in found[0].cause.what
    assert analyze(ast.parse(agent.read_text())) == ()  # without the file's path: one module only
