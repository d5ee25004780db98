"""ModelRunner: one forward over a flattened batch of sequences, K/V read and written in blocks.

The engine loop hands the runner, for every scheduled sequence, the tokens to
compute this step (a prefill chunk or one decode token), the position of the first
one and the sequence's block table. The runner flattens them into one batch
(``[T]`` token ids, positions and slots), runs the model once, and returns the
float32 logits of the last token of every sequence that asked for them. New K/V
are written into their block slots inside the forward, before attention reads them,
so a sequence may read blocks another sequence of the same batch is writing.

Two forwards: :class:`~engine.model.llama.LlamaForward` (the Llama family, written
out with fused projections) and the model's own transformers module graph with
:func:`~engine.model.attention.transformers_attention` registered (any other
architecture whose attention is plain causal attention).

Batch invariance: a CPU matrix product's row results depend on how many rows it
has (oneDNN's float32 kernel rounds a lone row differently; AMX bfloat16 and MKL
float32 kernels change their blocking with the count), so the flattened batch and
the rows whose logits are computed are padded to a multiple of
:data:`~engine.model.attention.ROW_MULTIPLE` (of 1 where the Llama forward's
products were probed row-invariant at any count: ``LlamaForward.row_multiple``), and
the projections run in tiles of at most :data:`~engine.model.linear.ROW_TILE` rows (:mod:`engine.model.linear`). Attention is computed per
sequence (prefill chunks) or per group of single-token sequences with equally long
block tables (decodes), with the same per-sequence shapes either way, so a token
gets the same bits alone, in any batch, cached or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.model import attention, linear, llama
from engine.model.attention import (
    ROW_MULTIPLE,
    AttentionBatch,
    DecodeGroup,
    SequenceSlice,
    padded_length,
)
from engine.model.gguf_decode import GGUFBlocks
from engine.model.kv_mirror import MIN_TOKENS, KVMirrors, MirrorUse
from engine.model.kv_storage import KVStorage
from engine.model.packed_attention import PackedChunk, PackedDecodes
from engine.model.packed_kv import PackedKV
from engine.model.packed_mirror import PackedMirrors
from engine.model.pyramid import AttentionCapture, PyramidSchedule
from engine.model.q4_weights import Q4Matrix


def padded_table(block_ids: Sequence[int], end: int, storage: KVStorage) -> list[int]:
    """The block table attention reads for positions ``0 .. end - 1``: the blocks that
    hold them, then the storage's pad block up to ``padded_length(end)`` positions."""
    bs = storage.layout.block_size
    used = -(-end // bs)
    return [*block_ids[:used]] + [storage.pad_block] * (-(-padded_length(end) // bs) - used)


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's work in a step: compute ``token_ids`` at positions ``start ..``.

    ``block_ids`` is its block table and covers every position up to ``start +
    len(token_ids)``; positions before ``start`` already have their K/V in those
    blocks. ``sample``: return logits for its last token. ``embeds``: pairs ``(rows,
    values)``, the input embeddings of some of its tokens (``rows`` index
    ``token_ids``; image features), used instead of the tokens' embeddings.
    ``prompt_rows``: also return the logits of its first ``prompt_rows`` tokens
    (:attr:`ModelRunner.prompt_logits`; for prompt log-probabilities). ``capture``:
    collect its last tokens' attention per layer (:mod:`engine.model.pyramid`).
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    sample: bool
    embeds: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    prompt_rows: int = 0
    capture: AttentionCapture | None = None
    packed: PackedKV | None = None
    """A compressed request's tokens (``block_ids`` unused): they attend its packed pages
    (:mod:`engine.model.packed_attention`), which have room for them; one token is a
    decode, more a prefill chunk (``capture`` applies to it)."""
    layerwise: PyramidSchedule | None = None
    """A packed prefill chunk with a capture and no prompt rows may drop, after each
    layer, the tokens that layer's selection drops (:meth:`PackedChunk.survivors`, the
    Llama forward only); such chunks get the batch's last rows."""
    mirror: str | None = None
    """The request's id when its K/V at a position depend only on its tokens up to
    there (exact, not assembled from modules): a long one is then read from its mirror
    (:mod:`engine.model.kv_mirror`); a compressed one's decodes from its packed mirror
    (:mod:`engine.model.packed_mirror`); None: always gathered."""
    as_decodes: bool = False
    """Its tokens are attended as decode rows, each over the positions up to its own (a
    decode and its draft tokens, speculative decoding): batched with the step's other
    decodes, with the bits of decoding them one at a time. A long request (padded
    length from :data:`~engine.model.kv_mirror.MIN_TOKENS`) is attended as one slice
    instead, over its mirror or one gather (a decode row gathers its whole context:
    five rows, five gathers); the same bits too."""
    joins: bool = False
    """Attended as one slice with the previous sequence (the same request and block
    table, later positions, which did not sample): a segmented request's runs, whose
    keys are then gathered once per layer, not once per run. Each token still attends
    to every position up to its own; no embeds, captures or prompt rows."""


@dataclass
class _Joined:
    """A slice being built from a sequence and the ones that join it (:attr:`SequenceInput.joins`)."""

    row: int
    positions: list[int]
    block_ids: Sequence[int]
    capture: AttentionCapture | None
    sample: bool
    mirror: str | None = None
    index: int = 0
    """The sequence (of the step's) that ends it: its logit row's place in the output."""
    as_decodes: bool = False


class ModelRunner:
    """Executes batched forwards of a causal LM against a :class:`KVStorage`."""

    def __init__(self, model: Any, storage: KVStorage, *, lean: bool | None = None,
                 q4_layers: Sequence[Mapping[str, Q4Matrix]] | None = None, mirror_bytes: int = 0,
                 gguf_decode: GGUFBlocks | None = None) -> None:
        """``q4_layers``: the model's projections as Q4_1 blocks (the Llama forward then
        multiplies with them; ValueError for another forward). ``gguf_decode``: the
        GGUF's blocks, read by the Llama forward's few-row products with the dense bits
        (ignored by the generic forward). ``mirror_bytes``: the budget of :attr:`mirrors`."""
        attention.check_supported(model.config.get_text_config())
        self.model = model
        self.storage = storage
        self.mirrors = KVMirrors(storage, mirror_bytes)
        """Long requests' K/V, contiguous (:mod:`engine.model.kv_mirror`)."""
        self.packed_mirrors = PackedMirrors(storage, self.mirrors)
        """Compressed requests' packed K/V, side by side for their decodes
        (:mod:`engine.model.packed_mirror`), within the same budget. The engine forgets
        a request's mirrors (:meth:`forget`) when it finishes or is preempted."""
        self.lean = llama.supports(model) if lean is None else lean
        self._llama: llama.LlamaForward | None = None
        self._linears: linear.TiledLinears | None = None
        self.prompt_logits: list[torch.Tensor | None] = []
        """Set by each :meth:`execute`: per sequence, the logits (model dtype, ``[prompt_rows,
        vocab]``) of its first ``prompt_rows`` tokens, None where it asked for none."""
        if q4_layers is not None and not self.lean:
            raise ValueError("4-bit weights need the Llama forward")
        if self.lean:
            self._llama = llama.LlamaForward(model, q4_layers, gguf_decode)
        else:
            attention.install(model)
            self._linears = linear.TiledLinears(model)

    def forget(self, request_id: str) -> None:
        """Drop the request's mirrors (it finished, was preempted, or changed form)."""
        self.mirrors.forget(request_id)
        self.packed_mirrors.forget(request_id)

    def execute(self, sequences: Sequence[SequenceInput]) -> torch.Tensor:
        """Run one forward over ``sequences``; returns ``[n, vocab]`` float32 logits, one
        row per sequence with ``sample`` set, in order."""
        storage = self.storage
        bs = storage.layout.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SequenceSlice] = []
        decodes: dict[int, list[tuple[int, int, list[int]]]] = {}
        groups: list[DecodeGroup] = []
        mirrors: list[MirrorUse] = []
        embed_rows: list[torch.Tensor] = []
        embed_values: list[torch.Tensor] = []
        packed_rows: list[int] = []
        packed: list[PackedKV] = []
        packed_keys: list[str] | None = []
        packed_chunks: list[PackedChunk] = []
        joined: _Joined | None = None  # the slice being built, closed by the next sequence that does not join it
        sampled: list[tuple[int, int]] = []  # (sequence index, logit row): rows in sequence order at the end
        starts: list[int] = [0] * len(sequences)  # each sequence's first row

        def close() -> None:
            if joined is None:
                return
            row, n, start, end = joined.row, len(joined.positions), joined.positions[0], joined.positions[-1] + 1
            table = padded_table(joined.block_ids, end, storage)
            spread = joined.positions[-1] - start + 1 != n
            mirror = (None if joined.mirror is None or spread else
                      self.mirrors.use(joined.mirror, joined.block_ids, row, start, end, len(table) * bs))
            if mirror is not None:
                mirrors.append(mirror)
            if n == 1 and mirror is not None:
                groups.append(DecodeGroup.build([row], [start], [table], storage, mirror))
            elif n == 1:
                decodes.setdefault(len(table), []).append((row, start, table))
            elif joined.as_decodes and mirror is None and not spread and len(table) * bs < MIN_TOKENS:
                for i in range(n):  # each row over its own positions, as a decode
                    own = padded_table(joined.block_ids, start + i + 1, storage)
                    decodes.setdefault(len(own), []).append((row + i, start + i, own))
            else:
                slices.append(SequenceSlice(row, n, start, storage.rows(table), capture=joined.capture,
                                            positions=torch.tensor(joined.positions) if spread else None,
                                            mirror=mirror))
            if joined.sample:
                sampled.append((joined.index, row + n - 1))

        layerwise = [seq.packed is not None and len(seq.token_ids) > 1 and seq.layerwise is not None
                     and seq.capture is not None and not seq.prompt_rows and self._llama is not None
                     for seq in sequences]
        # compressed prefill chunks last (layer-wise ones at the very end: they drop rows
        # as layers go): the products may then compute their rows untiled
        # (AttentionBatch.exact_rows)
        is_chunk = [seq.packed is not None and len(seq.token_ids) > 1 for seq in sequences]
        order = sorted(range(len(sequences)), key=lambda i: (is_chunk[i], layerwise[i]))
        for index in order:
            seq = sequences[index]
            n, end = len(seq.token_ids), seq.start + len(seq.token_ids)
            if n < 1:
                raise ValueError("a scheduled sequence must compute at least one token")
            row = len(ids)
            starts[index] = row
            if seq.joins:
                if (joined is None or joined.sample or seq.start <= joined.positions[-1] or seq.packed is not None
                        or seq.embeds or seq.prompt_rows or seq.capture is not None or seq.as_decodes
                        or joined.as_decodes):
                    raise ValueError("a joining sequence continues a non-sampling sequence at later positions")
                ids.extend(seq.token_ids)
                positions.extend(range(seq.start, end))
                slots.extend(storage.slot_ids(seq.block_ids, seq.start, end))
                joined.positions.extend(range(seq.start, end))
                joined.sample = seq.sample
                joined.index = index
                joined.mirror = None
                continue
            close()
            joined = None
            for rows_in_seq, values in seq.embeds:
                embed_rows.append(rows_in_seq + row)
                embed_values.append(values)
            ids.extend(seq.token_ids)
            positions.extend(range(seq.start, end))
            if seq.packed is not None:
                slots.extend([storage.pad_slot] * n)
                if n == 1:
                    packed_rows.append(row)
                    packed.append(seq.packed)
                    if packed_keys is not None and seq.mirror is not None:
                        packed_keys.append(seq.mirror)
                    else:
                        packed_keys = None
                else:
                    packed_chunks.append(PackedChunk(row, n, seq.packed, seq.capture,
                                                     seq.layerwise if layerwise[index] else None, end))
                if seq.sample:
                    sampled.append((index, row + n - 1))
                continue
            slots.extend(storage.slot_ids(seq.block_ids, seq.start, end))
            joined = _Joined(row, list(range(seq.start, end)), seq.block_ids, seq.capture, seq.sample, seq.mirror,
                             index, seq.as_decodes)
        close()
        logit_rows = [row for _, row in sorted(sampled)]
        groups += [
            DecodeGroup.build([r for r, _, _ in members], [p for _, p, _ in members],
                              [t for _, _, t in members], storage)
            for members in decodes.values()
        ]
        num_logits = len(logit_rows)
        multiple = self._llama.row_multiple if self._llama is not None else ROW_MULTIPLE
        pad = -len(ids) % multiple
        ids.extend([0] * pad)
        positions.extend([0] * pad)
        slots.extend([storage.pad_slot] * pad)
        logit_rows.extend([logit_rows[0] if logit_rows else 0] * (-len(logit_rows) % multiple))
        if not logit_rows:
            logit_rows = [0] * multiple
        prompt_at = self._add_prompt_rows(sequences, starts, logit_rows)
        batch = AttentionBatch(storage, torch.tensor(slots, dtype=torch.long), slices, groups,
                               PackedDecodes(packed_rows, packed, self.packed_mirrors, packed_keys) if packed else None, packed_chunks)
        input_ids = torch.tensor(ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.tensor(logit_rows, dtype=torch.long)
        embeds = (torch.cat(embed_rows), torch.cat(embed_values)) if embed_rows else None
        with torch.inference_mode():
            if self._llama is not None:
                logits = self._llama(input_ids, pos, batch, rows, embeds)
            else:
                if embeds is not None:
                    raise ValueError("input embeddings need the Llama forward")
                assert self._linears is not None
                with self._linears.installed():
                    out = self.model(
                        input_ids=input_ids[None], position_ids=pos[None], use_cache=False,
                        logits_to_keep=rows, paged_batch=batch,
                    )
                logits = out.logits[0]
            self.prompt_logits = [None if at is None else logits[at[0] : at[1]] for at in prompt_at]
            for mirror in mirrors:
                mirror.done()
            if batch.packed is not None:
                batch.packed.advance()
            for chunk in packed_chunks:
                chunk.advance()
            return logits[:num_logits].float()

    def probe(self, token_ids: Sequence[int], start: int, block_ids: Sequence[int], keep: bool,
              depth: int = 1) -> torch.Tensor | None:
        """The layer-``depth`` KV deviation of a sequence's tokens ``token_ids`` at
        positions ``start ..`` whose K/V (reused, approximate) are in ``block_ids``:
        ``[n, 2]`` float32 (:meth:`LlamaForward.probe`, which writes the K/V of layers
        ``0 .. depth - 1``, and layer ``depth``'s with ``keep``); None where this forward
        cannot probe (the generic forward, a model of at most ``depth`` layers), having
        changed nothing."""
        if self._llama is None or len(self._llama.layers) <= depth:
            return None
        storage = self.storage
        n, end = len(token_ids), start + len(token_ids)
        if n < 1:
            raise ValueError("a probe must cover at least one token")
        table = padded_table(block_ids, end, storage)
        pad = -n % self._llama.row_multiple
        ids = [*token_ids, *[0] * pad]
        positions = [*range(start, end), *[0] * pad]
        slots = [*storage.slot_ids(block_ids, start, end), *[storage.pad_slot] * pad]
        batch = AttentionBatch(storage, torch.tensor(slots, dtype=torch.long),
                               [SequenceSlice(0, n, start, storage.rows(table))])
        deviation = self._llama.probe(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                                      batch, keep, depth)
        return deviation[:n]

    @staticmethod
    def _add_prompt_rows(sequences: Sequence[SequenceInput], starts: Sequence[int], logit_rows: list[int],
                         ) -> list[tuple[int, int] | None]:
        """Append the rows whose logits sequences asked for beyond their last token to
        ``logit_rows`` (after the sampled rows, padded to a multiple of ROW_MULTIPLE: the
        LM head's tiles then keep the sampled rows' bits); each sequence's range of them
        (``starts``: each sequence's first row)."""
        spans: list[tuple[int, int] | None] = []
        for seq, row in zip(sequences, starts, strict=True):
            if seq.prompt_rows > len(seq.token_ids):
                raise ValueError(f"prompt_rows {seq.prompt_rows} exceeds the {len(seq.token_ids)} tokens computed")
            if seq.prompt_rows:
                spans.append((len(logit_rows), len(logit_rows) + seq.prompt_rows))
                logit_rows.extend(range(row, row + seq.prompt_rows))
            else:
                spans.append(None)
        if len(logit_rows) % ROW_MULTIPLE:
            logit_rows.extend([logit_rows[-1]] * (-len(logit_rows) % ROW_MULTIPLE))
        return spans
