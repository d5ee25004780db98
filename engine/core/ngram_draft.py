"""NgramDraft: draft tokens for speculative decoding, looked up in a request's own text.

Prompt lookup (n-gram) drafting, as vLLM's ``ngram`` speculator: the last ``n``
tokens of the request (prompt and output so far) are looked up among its earlier
tokens, longest ``n`` first (``max_n`` down to ``min_n``); where they occurred
before, the tokens that followed that occurrence (its most recent one) are the
draft. No draft model, no extra weights: it pays off where the output repeats its
input or itself (quoting a document, editing code, a list, a small model's loops)
and drafts nothing, costing nothing, where no n-gram repeats.

The engine verifies a draft in the request's next forward (the draft's rows beside
its last token) and keeps the drafted tokens only while each equals the token
sampled from the logits before it, so drafting changes how many forwards a request
takes, never its tokens: see :mod:`engine.core.llm_engine` (``speculative_tokens``).

How many tokens to draft adapts per request (Hugging Face's assisted generation's
heuristic): a draft kept whole lets the next one grow by two, a draft cut short
makes it one shorter, never under one (:meth:`NgramDraft.record`). A request whose
drafts keep failing then verifies one token a step, where a fixed length would
spend rows of every forward on them. On the bundled model's chat answers (8
questions, 128 greedy tokens each, simulated) this kept the forwards saved (796
against 785 forwards for 1,024 tokens) with a quarter fewer draft rows (380
against 496); on its looping continuations of English-like text, 374 against 361
forwards with 896 against 972 rows.

An index per request maps every n-gram (``min_n <= n <= max_n``) to the position
after its latest occurrence, extended as tokens are appended: a lookup costs
``max_n`` dictionary probes whatever the request's length (a scan of an 8k-token
context would cost about a millisecond of Python per step). Memory: at most
``max_n - min_n + 1`` entries per token of the request.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramDraft:
    """The drafting state of one request. Changes nothing but itself."""

    def __init__(self, max_n: int = 3, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._after: dict[tuple[int, ...], int] = {}
        """n-gram -> the position right after its latest indexed occurrence."""
        self._indexed = 0
        """Occurrences ending before this position are indexed."""
        self.length: int | None = None
        """Most tokens the next draft may have (None: no draft judged yet, no limit)."""

    def record(self, drafted: int, kept: int) -> None:
        """A draft of ``drafted`` tokens was verified and its first ``kept`` were right:
        the next may have ``drafted + 2`` tokens if all were, else ``drafted - 1`` (at least 1)."""
        if not 0 <= kept <= drafted:
            raise ValueError(f"kept {kept} of {drafted} draft tokens")
        if drafted:
            self.length = drafted + 2 if kept == drafted else max(1, drafted - 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens (and :attr:`length`) that followed the latest earlier
        occurrence of the longest suffix of ``tokens`` (``max_n`` .. ``min_n`` tokens);
        where those run out (the occurrence is near the end: a loop), the same lookup
        continues after the tokens drafted so far. [] when no suffix repeats. ``tokens``
        must extend the tokens of the previous call (a request's tokens only grow)."""
        if self.length is not None:
            k = min(k, self.length)
        if k < 1:
            return []
        end = len(tokens)
        if end < self._indexed:
            raise ValueError(f"tokens shrank from {self._indexed} to {end}")
        # index every occurrence ending before ``end`` (the suffix itself is not "before")
        for stop in range(max(self._indexed, self.min_n), end):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self._after[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)
        draft: list[int] = []
        while len(draft) < k:  # a continuation that runs into the end: look up again after it
            tail = [*tokens[max(0, end - self.max_n) :], *draft][-self.max_n :]
            at = self._lookup(tail)
            if at is None:
                break
            draft.extend(tokens[at : at + k - len(draft)])
        return draft

    def _lookup(self, tail: list[int]) -> int | None:
        """Where the continuation of the longest indexed suffix of ``tail`` starts."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            at = self._after.get(tuple(tail[len(tail) - n :]))
            if at is not None:
                return at
        return None
