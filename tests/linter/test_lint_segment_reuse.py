"""The estimate's "segment reuse" row: documents that move between requests, past the prefix hit."""

from __future__ import annotations

from linter.estimate import estimate
from linter.segment_reuse import segment_reuse_tokens
from linter.tokenizer import ApproxTokenizer

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(4)]


def _body(order, question="Which one?"):
    return {"model": "m", "messages": [{"role": "system", "content": "Answer from the documents."},
                                       {"role": "user", "content": [{"type": "text", "text": DOCS[i]} for i in order]},
                                       {"role": "user", "content": question}]}


def test_moved_documents_are_counted_once_seen_and_past_the_hit():
    tok = ApproxTokenizer()
    bodies = [_body([0, 1, 2, 3]), _body([3, 1, 0, 2])]
    est = estimate(bodies, {}, tok, block_size=16)
    assert est.segment_reuse_tokens > 0
    assert est.segment_reuse_tokens % 16 == 0
    assert est.hit_rate_with_segment_reuse > est.hit_rate
    # every document of the second request was seen; none was hit (the order broke after the system text)
    per_doc = len(tok.encode(DOCS[0]))
    assert est.segment_reuse_tokens >= 4 * (per_doc // 16 - 1) * 16


def test_nothing_to_win_when_the_prefix_already_hits_or_nothing_repeats():
    tok = ApproxTokenizer()
    same = [_body([0, 1, 2, 3]), _body([0, 1, 2, 3], "Another question?")]
    assert estimate(same, {}, tok, block_size=16).segment_reuse_tokens == 0
    fresh = [_body([0, 1]), _body([2, 3])]
    assert segment_reuse_tokens(fresh, [0, 0], tok, 16) == 0
    first = [_body([0, 1])]
    assert segment_reuse_tokens(first, [0], tok, 16) == 0
