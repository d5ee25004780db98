"""LlamaForward: the Llama family's forward written out, over a flattened batch.

The weights are the checkpoint's, loaded by transformers; this module only
re-arranges them once: q/k/v projections become one fused ``[q; k; v]`` matrix and
gate/up one ``[gate; up]`` matrix (the modules' weights are re-pointed to views of
the fused tensors, so no memory is duplicated and the transformers module graph
still computes with the same numbers). A forward is then, per layer, two RMSNorms,
four matrix products (weights packed once for oneDNN where that keeps the bits:
:mod:`engine.model.linear`), RoPE from the model's own rotary embedding, and
:func:`~engine.model.attention.paged_attention`; no module dispatch, no cache
object, no mask tensor.

Numerics follow transformers' ``LlamaDecoderLayer`` op for op (RMSNorm in float32,
residual adds in the model dtype, ``silu(gate) * up``).

Only plain Llama layers are accepted (:func:`supports`): no projection biases, SiLU
MLP, standard RMSNorm; anything else runs the generic transformers forward. The
language model of a vision-language model (LLaVA's ``language_model``, Idefics3's
``text_model``, both Llama) is accepted too (:func:`language_parts`): its forward
then takes some rows' input embeddings from outside (image features, ``embeds``),
exactly where transformers' ``masked_scatter`` puts them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.model import native
from engine.model.attention import ROW_MULTIPLE, AttentionBatch, paged_attention
from engine.model.gguf_decode import GGUFBlocks, GGUFDecodeLinear, PackedBlocks
from engine.model.linear import Int4Linear, PackedLinear
from engine.model.q4_weights import Q4Matrix, fuse_layer


def language_parts(model: Any) -> tuple[Any, Any, Any]:
    """The decoder stack, the LM head and the text config of a causal LM or of a
    vision-language model's language model."""
    inner = model.model
    for name in ("language_model", "text_model"):
        base = getattr(inner, name, None)
        if base is not None:
            return base, model.lm_head, model.config.get_text_config()
    return inner, model.lm_head, model.config


def supports(model: Any) -> bool:
    """True for a Llama model (causal LM or a VLM's language model) whose layers this
    forward computes exactly."""
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        return False
    base, _, config = language_parts(model)
    return (
        type(base).__name__ == "LlamaModel"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", "silu") == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
    )


Projection = PackedLinear | Int4Linear | GGUFDecodeLinear


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``, with torch's bits (:func:`engine.model.native.rms_norm`:
    torch's ``rms_norm`` then the weight, a few rows through the engine's C kernel)."""
    return native.rms_norm(x, weight, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' RoPE) for ``x`` ``[T, heads,
    head_dim]``, with ``signed_sin`` = ``sin`` negated on its first half: swapping the
    halves is one ``flip`` of a ``[.., 2, half]`` view, and ``(-a) * s == a * (-s)``
    exactly, so the bits are transformers'."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # a copy: multiplied in place
    return torch.mul(x, cos).add_(swapped.mul_(signed_sin))


class LlamaForward:
    """Computes hidden states and logits of a flattened batch with a Llama model's weights.

    ``row_multiple``: callers pad the flattened batch and the logit rows to a multiple
    of it. :data:`~engine.model.attention.ROW_MULTIPLE` unless every product (the
    projections and the LM head) gives a row the same bits at any row count
    (``any_rows``, probed when they are built), then 1: a lone decode row is computed
    alone (attention pads its own products; RMSNorm and the elementwise ops are
    row-independent at any count, measured at 1-32 rows on 1 and 2 threads)."""

    def __init__(self, model: Any, q4_layers: Sequence[Mapping[str, Q4Matrix]] | None = None,
                 gguf_decode: GGUFBlocks | None = None) -> None:
        """``q4_layers``: per layer, its projections (``q k v o gate up down``) as Q4_1
        blocks, multiplied with :class:`~engine.model.linear.Int4Linear` instead of the
        model's dense weights (ValueError if they do not fit the model). ``gguf_decode``:
        the GGUF's blocks (projections and LM head), read by the few-row products of the
        dense weights where they give the dense bits (:class:`~engine.model.gguf_decode.GGUFDecodeLinear`)."""
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a plain Llama model")
        base, lm_head, config = language_parts(model)
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.norm = base.norm.weight
        self.lm_head: PackedLinear | GGUFDecodeLinear = PackedLinear(lm_head.weight)
        if gguf_decode is not None and gguf_decode.output is not None:
            self.lm_head = GGUFDecodeLinear.wrap(self.lm_head, gguf_decode.output)
        layers = base.layers[: config.num_hidden_layers]
        for blocks in (q4_layers, None if gguf_decode is None else gguf_decode.layers):
            if blocks is not None and len(blocks) != len(layers):
                raise ValueError(f"{len(blocks)} layers of 4-bit weights for a model of {len(layers)}")
        self.layers = [self._fuse(layer, None if q4_layers is None else q4_layers[i],
                                  None if gguf_decode is None else gguf_decode.layers[i]) for i, layer in enumerate(layers)]
        products = [self.lm_head, *(p for x in self.layers for p in (x.qkv, x.o, x.gate_up, x.down))]
        self.row_multiple = 1 if all(p.any_rows for p in products) else ROW_MULTIPLE

    @staticmethod
    def _fuse(layer: Any, q4: Mapping[str, Q4Matrix] | None, decode: Mapping[str, PackedBlocks] | None) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _fuse_linears([mlp.gate_proj, mlp.up_proj])
        dense = {"qkv": qkv, "o": attn.o_proj.weight, "gate_up": gate_up, "down": mlp.down_proj.weight}
        projections: dict[str, Projection]
        if q4 is None:
            packed = {name: PackedLinear(weight) for name, weight in dense.items()}
            projections = dict(packed) if decode is None else {  # decode: already fused (GGUFBlocks)
                name: GGUFDecodeLinear.wrap(p, decode[name]) for name, p in packed.items()}
        else:
            blocks = fuse_layer(q4)
            for name, matrix in blocks.items():
                if tuple(matrix.codes.shape) != tuple(dense[name].shape):
                    raise ValueError(f"4-bit {name} is {tuple(matrix.codes.shape)}, the model's {tuple(dense[name].shape)}")
            projections = {name: Int4Linear(matrix, qkv.dtype) for name, matrix in blocks.items()}
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            **projections,
        )

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, logit_rows: torch.Tensor,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits (model dtype) of rows ``logit_rows`` of the flattened batch. ``embeds``
        = ``(rows, values)``: rows whose input embedding is ``values`` (``[len(rows),
        hidden]``, cast to the model dtype) instead of their token's."""
        hidden = F.embedding(input_ids, self.embed)
        if embeds is not None:
            embed_rows, values = embeds
            hidden[embed_rows] = values.to(hidden.dtype)
        cos, signed_sin = self._angles(hidden, positions)
        origin: torch.Tensor | None = None  # per row, its row in the batch (-1: padding), once rows were dropped
        for i, layer in enumerate(self.layers):
            self._attention(i, layer, hidden, cos, signed_sin, batch)
            dropped = self._survivors(i, batch, hidden.shape[0])
            if dropped is not None:
                keep, real = dropped
                hidden, cos, signed_sin = hidden[keep], cos[keep], signed_sin[keep]
                before = torch.arange(input_ids.shape[0]) if origin is None else origin
                origin = torch.cat([before[keep[:real]], keep.new_full((keep.numel() - real,), -1)])
            self._mlp(layer, hidden, batch.exact_rows)
        if origin is not None:  # a sampled row is the last of its chunk, which every layer keeps
            where = torch.zeros(input_ids.shape[0], dtype=torch.long)
            real_rows = origin >= 0
            where[origin[real_rows]] = torch.arange(origin.numel())[real_rows]
            logit_rows = where[logit_rows]
        last = _rms_norm(hidden[logit_rows], self.norm, self.eps)
        return self.lm_head(last)

    def _survivors(self, layer: int, batch: AttentionBatch, num_rows: int) -> tuple[torch.Tensor, int] | None:
        """The rows that go on to layer ``layer + 1`` and how many of them are real: all
        but the tokens layer-wise packed chunks dropped after this layer
        (:meth:`PackedChunk.survivors`), which are the batch's last rows before its
        padding; None when nothing is dropped. The chunks' rows are updated; the row
        count stays a multiple of :attr:`row_multiple` (padding rows repeat row 0: pad
        slot, attention output zero, unused)."""
        chunks = [c for c in batch.packed_chunks if c.layerwise]
        if not chunks:
            return None
        before = [(c.row, c.m) for c in chunks]
        end = before[0][0]
        for row, m in before:
            if row != end:
                raise ValueError("layer-wise chunks must be the batch's last rows")
            end += m
        if end + (-end % self.row_multiple) != num_rows:
            raise ValueError("layer-wise chunks must be the batch's last rows")
        kept = [c.survivors(layer) for c in chunks]
        if all(k is None for k in kept):
            return None
        row = before[0][0]
        parts = [torch.arange(row)]
        for chunk, k, (at, m) in zip(chunks, kept, before, strict=True):
            parts.append(torch.arange(at, at + m) if k is None else k + at)
            chunk.row = row
            row += chunk.m
        pad = -row % self.row_multiple
        return torch.cat([*parts, torch.zeros(pad, dtype=torch.long)]), row

    def _angles(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``cos`` and signed ``sin`` (see :func:`_rope`), ``[T, 1, head_dim]``."""
        cos, sin = self.rotary(hidden[None], positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]
        half = self.head_dim // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _qkv(self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
             exact_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's queries, keys (RoPE applied) and values of ``hidden``'s rows
        (``exact_rows``: see :meth:`~engine.model.linear.PackedLinear.__call__`)."""
        qk_heads = self.num_heads + self.kv_heads
        qkv = layer.qkv(_rms_norm(hidden, layer.input_norm, self.eps), exact_rows)
        qkv = qkv.view(hidden.shape[0], qk_heads + self.kv_heads, self.head_dim)
        # RoPE on queries and keys at once (elementwise: the same bits as one at a time).
        qk = _rope(qkv[:, :qk_heads], cos, signed_sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, qk_heads:]

    def _layer(self, i: int, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               batch: AttentionBatch) -> None:
        """Layer ``i`` on ``hidden``, in place; writes the layer's K/V into the batch's slots."""
        self._attention(i, layer, hidden, cos, signed_sin, batch)
        self._mlp(layer, hidden, batch.exact_rows)

    def _attention(self, i: int, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   batch: AttentionBatch) -> None:
        """Layer ``i``'s attention block on ``hidden``, in place (residual added); writes
        the layer's K/V."""
        exact = batch.exact_rows
        q, k, v = self._qkv(layer, hidden, cos, signed_sin, exact)
        hidden.add_(layer.o(paged_attention(i, q, k, v, batch, self.scale), exact))

    def _mlp(self, layer: _Layer, hidden: torch.Tensor, exact_rows: int | None = None) -> None:
        """A layer's MLP block on ``hidden``, in place (residual added)."""
        x = _rms_norm(hidden, layer.post_norm, self.eps)
        gate_up = layer.gate_up(x, exact_rows)
        half = gate_up.shape[1] // 2
        hidden.add_(layer.down(torch.mul(F.silu(gate_up[:, :half], inplace=True), gate_up[:, half:]), exact_rows))

    @torch.inference_mode()
    def probe(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
              keep: bool, depth: int = 1) -> torch.Tensor:
        """The KV deviation of layer ``depth``: runs layers ``0 .. depth - 1`` on the
        batch (writing their K/V: exact when the batch holds every token past the
        sequence's exact part, since layer 0's K/V depend only on token and position and
        each layer's then only on exact ones below), then computes layer ``depth``'s
        keys and values of every row and compares them with those stored at the rows'
        slots. Returns ``[T, 2]`` float32: per row, the squared L2 distance of its keys
        and of its values (all KV heads). ``keep``: also write the computed layer-``depth``
        K/V into the slots. Changes the KV storage of layers ``0 .. depth`` only."""
        if not 1 <= depth < len(self.layers):
            raise ValueError(f"probe depth {depth} needs a model of more than {depth} layers")
        hidden = F.embedding(input_ids, self.embed)
        cos, signed_sin = self._angles(hidden, positions)
        for i in range(depth):
            self._layer(i, self.layers[i], hidden, cos, signed_sin, batch)
        _, k, v = self._qkv(self.layers[depth], hidden, cos, signed_sin)
        old_k, old_v = batch.storage.read(depth, batch.slots)
        deviation = torch.stack([(k.float() - old_k.float()).square().sum((1, 2)),
                                 (v.float() - old_v.float()).square().sum((1, 2))], dim=1)
        if keep:
            batch.storage.write(depth, batch.slots, k, v)
        return deviation


def _fuse_linears(linears: list[Any]) -> torch.Tensor:
    """One weight matrix stacking ``linears``' rows; each module's weight becomes a view of it
    (done once per model: a second engine on the same model reuses the fused matrix)."""
    done = getattr(linears[0], "_prefixgate_fused", None)
    if done is not None and all(m.weight.untyped_storage().data_ptr() == done.untyped_storage().data_ptr() for m in linears):
        return done
    fused = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    offset = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[offset : offset + n], requires_grad=False)
        offset += n
    linears[0]._prefixgate_fused = fused
    return fused
