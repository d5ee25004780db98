"""Tokenizers for the estimate: the approximation, a tokenizer.json, and the bundled model's."""

import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from linter.config import LintConfig
from linter.divergence import common_prefix_len
from linter.render import render
from linter.runner import lint_paths
from linter.tokenizer import ApproxTokenizer, load_tokenizer


def crc(piece):
    return zlib.crc32(piece.encode())


def test_approximation_is_deterministic_word_pieces():
    assert ApproxTokenizer().encode("<|im_start|>Hello wonderful_world, 1234!\n") == [
        crc("<|im_start|>"), crc("Hello"), crc(" wonderfu"), crc("l"), crc("_"), crc("world"), crc(","),
        crc(" "), crc("1"), crc("2"), crc("3"), crc("4"), crc("!"), crc("\n"),
    ]
    text = "You are a helpful assistant.\n" * 10
    assert ApproxTokenizer().encode(text) == ApproxTokenizer().encode(text)
    assert 0.15 < len(ApproxTokenizer().encode(text)) / len(text) < 0.35


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12), max_size=6), st.lists(st.sampled_from(["system", "user", "assistant"]), max_size=6))
def test_segment_memo_equals_whole_text_tokenization(contents, roles):
    body = {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]}
    if contents:
        body["messages"].append({"role": "user", "content": [{"type": "text", "text": contents[0]}, {"type": "text", "text": contents[-1]}]})
    rendered = render(body)
    tokenizer = ApproxTokenizer()
    assert tokenizer.encode_parts(rendered.parts) == tokenizer.encode(rendered.text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=3000), st.integers(0, 3000), st.integers(0, 3))
def test_common_prefix_len(a, cut, extra):
    cut = min(cut, len(a))
    b = [*a[:cut], 9, *a[cut:]]
    assert common_prefix_len(a, b) == cut
    assert common_prefix_len(a, [*a, extra]) == len(a)
    text = "".join(map(str, a))
    assert common_prefix_len(text, text[:cut] + "x") == cut


def _write_word_level(path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<": 3, "|": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def test_tokenizer_json_gives_exact_ids(tmp_path):
    path = tmp_path / "tokenizer.json"
    _write_word_level(path)
    assert load_tokenizer(str(path)).encode("hello world zzz") == [1, 2, 0]


def test_bundled_tokenizer_is_read_from_the_converted_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="prefixgate engine"):
        load_tokenizer("bundled")
    model_dir = tmp_path / "models" / "SmolLM2-135M-Instruct"
    model_dir.mkdir(parents=True)
    _write_word_level(model_dir / "tokenizer.json")
    assert load_tokenizer("bundled").encode("world hello") == [2, 1]


def test_missing_or_broken_tokenizer_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(str(bad))


@pytest.mark.real_model
def test_estimate_with_the_real_bundled_tokenizer(tmp_path):
    from engine.model_store import ensure_converted_model

    model_dir = ensure_converted_model()
    path = model_dir / "tokenizer.json"
    tok = load_tokenizer(str(path))
    real = Tokenizer.from_file(str(path))
    example = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]}
    text = render(example).text
    assert tok.encode(text) == real.encode(text, add_special_tokens=False).ids
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi!"}]}\n')
    report = lint_paths([corpus], LintConfig(), tok)
    assert report.estimate.prompt_tokens == len(real.encode(text, add_special_tokens=False).ids)
    examples = Path(__file__).resolve().parents[2] / "examples" / "requests.jsonl"
    exact = lint_paths([examples], LintConfig(), tok).estimate
    approx = lint_paths([examples], LintConfig(), ApproxTokenizer()).estimate
    assert 0.8 < approx.prompt_tokens / exact.prompt_tokens < 1.25
    assert abs(approx.hit_rate - exact.hit_rate) < 0.05
