"""``prefixgate lint`` exit codes, configuration, suppressions and baseline."""

import json
import subprocess
import sys

import pytest
from lint_cli_helpers import ROOT, parse, run_lint

REQUESTS = str(ROOT / "examples" / "requests.jsonl")
CLEAN = str(ROOT / "examples" / "clean")


@pytest.fixture
def empty_config(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text("[project]\nname = 'x'\n")
    return path


def write_config(tmp_path, body):
    path = tmp_path / "custom.toml"
    path.write_text("[tool.prefixgate.lint]\n" + body)
    return path


def test_clean_corpus_exits_0(empty_config, capsys):
    assert run_lint([CLEAN], empty_config) == 0
    assert "No findings" in capsys.readouterr().out


def test_findings_exit_1_and_show_the_gain_table(empty_config, capsys):
    assert run_lint([REQUESTS], empty_config) == 1
    out = capsys.readouterr().out
    assert "PS101" in out and "Prefix-cache hit rate" in out and "all fixes" in out


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--fail-on", "error"], 1),  # PS101 is an error
        (["--fail-on", "error", "--ignore", "PS101,PS201"], 0),
        (["--fail-on", "never"], 0),
        (["--select", "PS106", "--fail-on", "warning"], 0),  # only an info finding
        (["--select", "PS106", "--fail-on", "info"], 1),
    ],
)
def test_fail_on_thresholds(empty_config, capsys, argv, code):
    assert run_lint([REQUESTS, *argv], empty_config) == code


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--select", "PS999"], "matches no rule"),
        ([str(ROOT / "nope.jsonl")], "does not exist"),
        ([str(ROOT / "pyproject.toml")], "unsupported input"),
        (["--explain", "PS999"], "unknown rule code"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "does not exist"),
        (["--cache-blocks", "0"], "positive"),
        (["--update-baseline"], "needs --baseline"),
    ],
)
def test_usage_errors_exit_2(empty_config, capsys, argv, message):
    paths = [] if argv[0].startswith(str(ROOT)) or argv[0] == "--explain" else [REQUESTS]
    assert run_lint([*paths, *argv], empty_config) == 2
    assert message in capsys.readouterr().err


def test_no_input_exits_2(empty_config, capsys):
    assert run_lint([], empty_config) == 2


def test_bad_option_value_is_an_argparse_usage_error():
    with pytest.raises(SystemExit) as exc:
        parse(["--format", "xml", REQUESTS])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "body",
    ["select = 'PS1'\n", "bogus = 1\n", "fail-on = 'fatal'\n", "allowlist = ['(']\n", "[tool.prefixgate.lint.severity]\nPS1 = 'error'\n"],
)
def test_invalid_configuration_exits_2(tmp_path, capsys, body):
    assert run_lint([REQUESTS], write_config(tmp_path, body)) == 2
    assert "error:" in capsys.readouterr().err


def test_explain_and_list_rules(empty_config, capsys):
    assert run_lint(["--explain", "ps305"], empty_config) == 0
    out = capsys.readouterr().out
    assert out.startswith("PS305 history-sliced") and "Anti-pattern" in out and "Better" in out
    assert run_lint(["--list-rules"], empty_config) == 0
    listing = capsys.readouterr().out
    assert all(code in listing for code in ("PS101", "PS206", "PS305"))


def _codes(capsys):
    return [f["code"] for f in json.loads(capsys.readouterr().out)["findings"]]


def test_pyproject_select_ignore_severity_allowlist(tmp_path, capsys):
    config = write_config(
        tmp_path,
        'select = ["PS1"]\nignore = ["PS106"]\nallowlist = ["T09:0"]\nfail-on = "error"\n'
        '[tool.prefixgate.lint.severity]\nPS103 = "error"\n',
    )
    assert run_lint([REQUESTS, "--format", "json"], config) == 1
    out = json.loads(capsys.readouterr().out)
    codes = [f["code"] for f in out["findings"]]
    assert "PS101" not in codes  # both timestamps allowlisted
    assert "PS106" not in codes and all(c.startswith("PS1") for c in codes)
    assert [f["severity"] for f in out["findings"] if f["code"] == "PS103"] == ["error"]


def test_command_line_select_overrides_pyproject(tmp_path, capsys):
    config = write_config(tmp_path, 'select = ["PS1"]\n')
    run_lint([REQUESTS, "--format", "json", "--select", "PS2"], config)
    assert {c[:3] for c in _codes(capsys)} == {"PS2"}


def test_per_file_ignores(tmp_path, capsys):
    config = write_config(tmp_path, '[tool.prefixgate.lint.per-file-ignores]\n"*/prompt_builder.py" = ["PS30"]\n')
    run_lint([str(ROOT / "examples" / "prompt_builder.py"), "--format", "json"], config)
    assert _codes(capsys) == []


def test_config_is_discovered_from_the_working_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.prefixgate.lint]\nselect = ["PS103"]\n')
    monkeypatch.chdir(tmp_path)
    run_lint([REQUESTS, "--format", "json"], None)
    assert _codes(capsys) == ["PS103"]


def test_baseline_accepts_recorded_findings_only(tmp_path, empty_config, capsys):
    baseline = tmp_path / "baseline.json"
    assert run_lint([REQUESTS, "--baseline", str(baseline), "--update-baseline"], empty_config) == 0
    recorded = json.loads(baseline.read_text())["findings"]
    assert len(recorded) == 7
    capsys.readouterr()
    assert run_lint([REQUESTS, "--baseline", str(baseline)], empty_config) == 0
    assert "7 finding(s) accepted by the baseline" in capsys.readouterr().out
    # Drop one accepted finding: it is reported again.
    baseline.write_text(json.dumps({"version": 1, "findings": recorded[1:]}))
    assert run_lint([REQUESTS, "--baseline", str(baseline), "--format", "json"], empty_config) == 1
    assert _codes(capsys) == [recorded[0]["code"]]


def test_missing_or_corrupt_baseline_exits_2(tmp_path, empty_config, capsys):
    baseline = tmp_path / "baseline.json"
    assert run_lint([REQUESTS, "--baseline", str(baseline)], empty_config) == 2
    assert "--update-baseline" in capsys.readouterr().err
    baseline.write_text("[1, 2]")
    assert run_lint([REQUESTS, "--baseline", str(baseline)], empty_config) == 2


def test_unreadable_records_are_skipped_and_reported(tmp_path, empty_config, capsys):
    corpus = tmp_path / "mixed.jsonl"
    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    corpus.write_text(f"{good}\n{{not json\n{json.dumps({'x': 1})}\n")
    assert run_lint([str(corpus), "--format", "json"], empty_config) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["line"] for p in out["problems"]] == [2, 3]
    assert out["summary"]["requests"] == 1


def test_lint_imports_no_torch(tmp_path):
    script = (
        "import sys\n"
        "from gateway.cli import main\n"
        f"rc = main(['lint', {REQUESTS!r}, {str(ROOT / 'examples')!r}, '--format', 'json', '--output', {str(tmp_path / 'o.json')!r}])\n"
        "assert rc == 1, rc\n"
        "assert 'torch' not in sys.modules, 'prefixgate lint imported torch'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=300)
    assert json.loads((tmp_path / "o.json").read_text())["findings"]


def test_opt_in_rules_are_added_with_extend_select(tmp_path, empty_config, capsys):
    run_lint([REQUESTS, "--format", "json"], empty_config)
    default = set(_codes(capsys))
    assert default and not default & {"PS102", "PS103", "PS104", "PS105", "PS106"}
    run_lint([REQUESTS, "--format", "json", "--extend-select", "PS104,PS106"], empty_config)
    assert set(_codes(capsys)) == default | {"PS104", "PS106"}
    config = write_config(tmp_path, 'extend-select = ["PS105"]\n')
    run_lint([REQUESTS, "--format", "json"], config)
    assert set(_codes(capsys)) == default | {"PS105"}
    assert run_lint([REQUESTS, "--extend-select", "PS999"], empty_config) == 2


def test_test_files_are_excluded_unless_configured(tmp_path, empty_config, capsys):
    source = 'from datetime import datetime\n\n\ndef f():\n    return {"role": "system", "content": f"{datetime.now()}"}\n'
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.py").write_text(source)
    (tmp_path / "src" / "tests").mkdir()
    (tmp_path / "src" / "tests" / "test_app.py").write_text(source)
    (tmp_path / "src" / "conftest.py").write_text(source)
    run_lint([str(tmp_path / "src"), "--format", "json"], empty_config)
    assert [f["path"].rsplit("/", 1)[-1] for f in json.loads(capsys.readouterr().out)["findings"]] == ["app.py"]
    config = write_config(tmp_path, "exclude = []\n")
    run_lint([str(tmp_path / "src"), "--format", "json"], config)
    assert len(json.loads(capsys.readouterr().out)["findings"]) == 3
    run_lint([str(tmp_path / "src" / "tests" / "test_app.py"), "--format", "json"], empty_config)
    assert len(json.loads(capsys.readouterr().out)["findings"]) == 1  # named explicitly: always linted


def test_the_table_never_prints_a_bare_zero_gain(empty_config, capsys):
    run_lint([REQUESTS, "--select", "ALL", "--color", "never"], empty_config)
    table = capsys.readouterr().out.split("Prefix-cache hit rate", 1)[1].splitlines()[3:]
    assert any("no automatic fix" in row for row in table)
    for row in table:
        assert "+0" not in row.split() or "the fix applies, but" in row, row


@pytest.fixture
def default_recursion_limit():
    """Python's default recursion limit for one test (torch's inductor, run by earlier
    tests in the same process, raises it to 2,000 for good)."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(before)


def test_too_deeply_nested_sources_are_skipped_and_reported(tmp_path, empty_config, capsys, default_recursion_limit):
    for terms in (700, 5000):  # analysis, then the parser itself, run out of recursion
        path = tmp_path / f"deep{terms}.py"
        path.write_text("def f():\n    system_prompt = " + " + ".join(['"a"'] * terms) + "\n    return system_prompt\n")
        assert run_lint([str(path)], empty_config) == 0
        assert "too deeply nested" in capsys.readouterr().out
