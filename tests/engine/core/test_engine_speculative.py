"""Speculative decoding (prompt-lookup drafts): the same tokens, bit for bit, in fewer forwards.

Each scenario runs on two tiny engines, one drafting (``speculative_tokens``) and one
not, and compares every token and log-probability; the engine fixtures check that
all blocks are free afterwards, and each engine's ``check_integrity`` runs after
every step through a spy.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import ClassVar

import pytest

from engine.core.forced_tokens import ForcedTokens
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.core.scheduler import SPECULATIVE_ROWS

_ids = itertools.count()
LOOP = [300, 301, 302, 303, 304, 305] * 6  # a prompt that repeats: drafts find matches


@pytest.fixture
def checked_steps(monkeypatch):
    """Counts forwards and checks the KV cache manager's integrity after every step."""
    counts: dict[int, int] = {}
    real = LLMEngine.step

    def step(self):
        before = self.stats().num_running
        real(self)
        self.kv_cache_manager.check_integrity()
        if before:
            counts[id(self)] = counts.get(id(self), 0) + 1

    monkeypatch.setattr(LLMEngine, "step", step)
    return counts


def run(engine, prompts, **params):
    """Submit all prompts at once; per request its tokens and (token, logprob, top) triples."""
    params.setdefault("max_tokens", 40)
    params.setdefault("temperature", 0.0)

    async def go():
        streams = [engine.submit(GenerationRequest(f"s-{next(_ids)}", list(p), SamplingParams(**params)))
                   for p in prompts]

        async def collect(stream):
            return [o async for o in stream]

        return await asyncio.gather(*(collect(s) for s in streams))

    results = []
    for outputs in asyncio.run(go()):
        assert outputs[-1].finished
        results.append(([t for o in outputs for t in o.new_token_ids],
                        [(x.token_id, x.logprob, x.top) for o in outputs for x in (o.logprobs or [])],
                        outputs[-1].finish_reason))
    return results


def both(make_tiny_engine, prompts, k=4, **params):
    plain = run(make_tiny_engine(speculative_tokens=0), prompts, **params)
    drafting = make_tiny_engine(speculative_tokens=k)
    return plain, run(drafting, prompts, **params), drafting.stats()


def test_greedy_tokens_and_logprobs_are_the_same_with_drafts(make_tiny_engine, checked_steps):
    prompts = [LOOP, [7, 8, 9, 7, 8, 9, 7, 8], list(range(500, 540))]
    plain, drafting, stats = both(make_tiny_engine, [prompts[0]], logprobs=3, ignore_eos=True)
    assert drafting == plain
    assert stats.spec_draft_tokens > 0  # the random model's tokens rarely match: rejected drafts
    plain, drafting, _ = both(make_tiny_engine, prompts[1:], logprobs=2, ignore_eos=True)
    assert drafting == plain


@pytest.fixture
def oracle_drafts(monkeypatch):
    """Fault injection: drafts from a reference run (``oracle.runs``: prompt -> the
    tokens decoding produced), every third one with a wrong token at a varying place,
    so drafts are kept whole, in part and not at all."""
    from engine.core.ngram_draft import NgramDraft

    class Oracle:
        runs: ClassVar[dict[tuple[int, ...], list[int]]] = {}
        calls = 0

    def propose(self, tokens, k):
        for prompt, ref in Oracle.runs.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                j = len(tokens) - len(prompt)
                draft = list(ref[j : j + k])
                Oracle.calls += 1
                if Oracle.calls % 3 == 0 and draft:
                    draft[Oracle.calls % len(draft)] += 1
                return draft
        return []

    monkeypatch.setattr(NgramDraft, "propose", propose)
    return Oracle


def test_seeded_sampling_draws_the_same_tokens(make_tiny_engine, checked_steps, oracle_drafts):
    """A draft is kept only when the token drawn from the row before it (with the
    request's generator, one draw per token) equals it: the draws are decoding's own."""
    prompts = [LOOP, [*LOOP[3:], 9]]
    sampling = dict(temperature=0.7, seed=11, top_k=5, logprobs=1, ignore_eos=True, max_tokens=48)
    plain = run(make_tiny_engine(speculative_tokens=0), prompts, **sampling)
    oracle_drafts.runs = {tuple(p): r[0] for p, r in zip(prompts, plain, strict=True)}
    drafting = make_tiny_engine(speculative_tokens=5)
    assert run(drafting, prompts, **sampling) == plain
    stats = drafting.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_greedy_batches_keep_the_same_tokens_with_drafts_kept_in_part(make_tiny_engine, checked_steps,
                                                                      oracle_drafts):
    prompts = [LOOP, list(range(700, 760)), [5] * 20]
    plain = run(make_tiny_engine(speculative_tokens=0), prompts, logprobs=2, ignore_eos=True)
    oracle_drafts.runs = {tuple(p): r[0] for p, r in zip(prompts, plain, strict=True)}
    drafting = make_tiny_engine(speculative_tokens=4, max_num_batched_tokens=32)
    assert run(drafting, prompts, logprobs=2, ignore_eos=True) == plain
    assert drafting.stats().spec_accepted_tokens > 20


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
def test_max_tokens_and_stop_tokens_end_where_decoding_ends(make_tiny_engine, checked_steps, max_tokens):
    plain, drafting, _ = both(make_tiny_engine, [LOOP], max_tokens=max_tokens, ignore_eos=True)
    assert drafting == plain and len(drafting[0][0]) == max_tokens
    tokens = run(make_tiny_engine(speculative_tokens=0), [LOOP], max_tokens=30, ignore_eos=True)[0][0]
    stop = tokens[7]
    plain, drafting, _ = both(make_tiny_engine, [LOOP], max_tokens=30, ignore_eos=True, stop_token_ids=(stop,))
    assert drafting == plain and drafting[0][2] == "stop"


def test_a_constraint_advances_once_per_kept_token(make_tiny_engine, checked_steps):
    """Teacher forcing (a constraint that admits one sequence) through drafts: the
    constraint sees exactly the kept tokens, in order."""
    forced = ([301, 302, 303, 304, 305, 300] * 4)[:20]

    def go(k):
        engine = make_tiny_engine(speculative_tokens=k)
        stream = engine.submit(GenerationRequest(
            f"f-{next(_ids)}", LOOP,
            SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, constraint=ForcedTokens(forced))))
        outputs = stream.result(timeout=120)
        return [t for o in outputs for t in o.new_token_ids], [x.logprob for o in outputs for x in o.logprobs or []]

    plain, drafting = go(0), go(4)
    assert drafting == plain and drafting[0] == forced
    # the forced tokens repeat the prompt: drafts are kept, and the same tokens took fewer forwards
    plain_engine, drafting_engine = make_tiny_engine.engines
    assert drafting_engine.stats().spec_accepted_tokens >= 10
    assert checked_steps[id(drafting_engine)] <= checked_steps[id(plain_engine)] / 2


def test_a_batch_with_prefill_and_drafts_matches_one_at_a_time(make_tiny_engine, checked_steps):
    prompts = [LOOP, [9, 10, 11] * 9, list(range(1000, 1300)), [*LOOP[2:], 40, 41]]
    engine = make_tiny_engine(speculative_tokens=0, max_num_batched_tokens=64)
    alone = [run(engine, [p], max_tokens=24, ignore_eos=True)[0] for p in prompts]
    drafting = make_tiny_engine(speculative_tokens=6, max_num_batched_tokens=64)
    assert run(drafting, prompts, max_tokens=24, ignore_eos=True) == alone
    assert drafting.stats().spec_accepted_tokens > 0


def test_many_decodes_draft_within_the_row_budget(make_tiny_engine, monkeypatch, oracle_drafts):
    rows = []
    from engine.model.runner import ModelRunner

    real = ModelRunner.execute

    def spy(self, sequences):
        decodes = [s for s in sequences if s.start > 0 and s.sample and s.prompt_rows == len(s.token_ids) - 1]
        rows.append((len(decodes), sum(len(s.token_ids) for s in decodes)))
        return real(self, sequences)

    prompts = [LOOP[i:] for i in range(6)]
    plain = run(make_tiny_engine(speculative_tokens=0), prompts, max_tokens=16, ignore_eos=True)
    oracle_drafts.runs = {tuple(p): r[0] for p, r in zip(prompts, plain, strict=True)}
    monkeypatch.setattr(ModelRunner, "execute", spy)
    engine = make_tiny_engine(speculative_tokens=8)
    assert run(engine, prompts, max_tokens=16, ignore_eos=True) == plain
    assert engine.stats().spec_draft_tokens > 0
    assert all(total <= max(SPECULATIVE_ROWS, n) for n, total in rows)
    assert any(total > n for n, total in rows)


def test_prompt_logprobs_are_the_same_with_drafts(make_tiny_engine, oracle_drafts):
    """A prompt whose last chunk is its last token alone (a 16-token budget) decodes
    that token like a decode: it must not draft while its prompt log-probabilities
    are pending; later decodes do."""
    prompt = [*LOOP[:32], 77]

    def go(k):
        engine = make_tiny_engine(speculative_tokens=k, max_num_batched_tokens=16)
        stream = engine.submit(GenerationRequest(f"p-{next(_ids)}", prompt, SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=2)))
        outputs = stream.result(timeout=120)
        return ([t for o in outputs for t in o.new_token_ids],
                [(x.token_id, x.logprob, x.top, x.rank) if x else None for o in outputs for x in o.prompt_logprobs or []],
                [x.logprob for o in outputs for x in o.logprobs or []]), engine

    plain, _ = go(0)
    oracle_drafts.runs = {tuple(prompt): plain[0]}
    drafting, engine = go(4)
    assert drafting == plain and len(plain[1]) == len(prompt)
    assert engine.stats().spec_accepted_tokens > 0


def test_speculative_tokens_is_validated():
    from engine.config import EngineConfig

    for bad in (-1, 33, 2.0, True):
        with pytest.raises(ValueError, match="speculative_tokens"):
            EngineConfig(speculative_tokens=bad)


def test_a_long_request_verifies_drafts_as_one_slice(make_engine, oracle_drafts, monkeypatch):
    """Past 1k tokens a request's K/V are read from its mirror (engine.model.kv_mirror),
    or gathered once: its draft rows are one slice over them, and a rejected draft's
    K/V are overwritten by the next forward; tokens and log-probabilities stay decoding's."""
    from engine.model.kv_mirror import KVMirrors

    uses = []
    real_use = KVMirrors.use

    def use(self, *args, **kwargs):
        mirror = real_use(self, *args, **kwargs)
        uses.append(mirror is not None)
        return mirror

    monkeypatch.setattr(KVMirrors, "use", use)
    prompt = [100 + (i * 37) % 3000 for i in range(1100)]
    settings = dict(kv_compression="none", kv_cache_memory_gib=0.02)
    plain = run(make_engine(speculative_tokens=0, **settings), [prompt], max_tokens=40, logprobs=2, ignore_eos=True)
    oracle_drafts.runs = {tuple(prompt): plain[0][0]}
    for mirrors in (0.5, 0):  # over the mirror; without mirrors, over one gather
        uses.clear()
        drafting = make_engine(speculative_tokens=4, kv_mirror_memory_gib=mirrors, **settings)
        assert run(drafting, [prompt], max_tokens=40, logprobs=2, ignore_eos=True) == plain
        stats = drafting.stats()
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
        assert any(uses) == bool(mirrors)


@pytest.mark.parametrize("bad", ["-1", "33", "2.5", "many"])
def test_the_cli_refuses_a_bad_draft_count_in_one_line(bad, capsys):
    from gateway.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["engine", "--speculative-tokens", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-tokens" in err and "Traceback" not in err


def test_the_cli_passes_the_draft_count_to_the_engine():
    from gateway.cli import build_parser

    args = build_parser().parse_args(["engine", "--speculative-tokens", "0"])
    assert args.speculative_tokens == 0
    assert build_parser().parse_args(["engine"]).speculative_tokens == 4


def test_a_failed_forward_with_drafts_frees_every_slot(make_tiny_engine, oracle_drafts, monkeypatch):
    """Fault injection: the forward that verifies drafts raises. The request finishes
    with an error, its lookahead slots go back with its blocks (the fixture checks that
    every block is free), and the next request runs normally."""
    from engine.model.runner import ModelRunner

    plain = run(make_tiny_engine(speculative_tokens=0), [LOOP], max_tokens=12, ignore_eos=True)
    oracle_drafts.runs = {tuple(LOOP): plain[0][0]}
    real = ModelRunner.execute
    failed = []

    def execute(self, sequences):
        if any(s.as_decodes for s in sequences) and not failed:
            failed.append(True)
            raise RuntimeError("injected")
        return real(self, sequences)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    engine = make_tiny_engine(speculative_tokens=4)
    stream = engine.submit(GenerationRequest(f"x-{next(_ids)}", LOOP, SamplingParams(max_tokens=12, temperature=0.0,
                                                                                        ignore_eos=True)))
    outputs = stream.result(timeout=120)
    assert failed and outputs[-1].finish_reason == "error" and "injected" in (outputs[-1].error or "")
    engine.kv_cache_manager.check_integrity()
    assert run(engine, [LOOP], max_tokens=12, ignore_eos=True) == plain
