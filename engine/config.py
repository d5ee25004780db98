"""EngineConfig: everything that shapes one engine instance, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.limits import BLOCK_SIZE

DTYPES = ("auto", "float32", "bfloat16")
WEIGHTS = ("dense", "q4_1")
DEFAULT_KV_CACHE_MEMORY_GIB = 1.0
DEFAULT_BLOCK_SIZE = BLOCK_SIZE
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_ENCODER_CACHE_MEMORY_GIB = 0.25
DEFAULT_KV_OFFLOAD_SIZE_GIB = 10.0
DEFAULT_KV_MIRROR_MEMORY_GIB = 0.5
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_SPECULATIVE_TOKENS = 32
KV_COMPRESSIONS = ("none", "pyramid")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; ``__post_init__`` raises ValueError naming the bad field.

    ``model`` is a local Hugging Face checkpoint directory, a GGUF file, or None
    for the bundled SmolLM2-135M-Instruct. ``dtype="auto"`` means bfloat16 where the
    CPU computes it natively, float32 otherwise. Each engine step runs one forward
    over at most ``max_num_batched_tokens`` tokens (decode tokens plus prefill
    chunks) of at most ``max_num_seqs`` running requests. A vision-language model
    keeps image features in an encoder cache of ``encoder_cache_memory_gib`` GiB.
    With ``kv_offload_dir`` set, full KV blocks are also kept in that directory, at
    most ``kv_offload_size_gib`` GiB of files (:mod:`engine.model.kv_offload`); it
    needs prefix caching.
    ``weights="q4_1"`` (opt-in, a Llama GGUF in bfloat16) multiplies the projections
    with the file's Q4_1 blocks (:class:`~engine.model.linear.Int4Linear`) instead of
    the dense checkpoint: faster decoding, other numbers than ``"dense"``.
    ``gguf_decode`` (with ``"dense"``, bfloat16, a GGUF of Q4_1 projections such as the
    bundled one): products of a few rows (decodes, drafts) read the file's 4-bit blocks
    instead of the bfloat16 weights, with the same bits (:mod:`engine.model.gguf_decode`;
    probed at load, off where they would differ): outputs are the same either way.
    ``kv_compression="pyramid"`` (opt-in; a request may choose either way) keeps a
    share of each layer's KV after prefill, falling with depth to
    ``kv_min_retention``, plus the last ``kv_window`` tokens (:mod:`engine.model.pyramid`),
    and selects again every ``kv_window`` decoded tokens; ``kv_progressive`` compresses
    a long prompt after its first chunk and computes the rest over the kept KV;
    ``kv_layerwise`` (implies ``kv_progressive``) computes each of those chunks' tokens
    only in the layers up to the last one that keeps it (PyramidInfer's prefill).
    ``kv_mirror_memory_gib``: at most this much memory for contiguous copies of long
    requests' K/V and of compressed requests' kept K/V, read by attention instead of
    gathering them from the pool each step (:mod:`engine.model.kv_mirror`,
    :mod:`engine.model.packed_mirror`; 0 turns them off; outputs are the same either way).
    ``speculative_tokens``: a decoding request's next forward may also verify up to
    this many draft tokens looked up in its own text (:mod:`engine.core.ngram_draft`);
    only drafts equal to what it samples are kept, so outputs are the same bit for bit
    with any value (0 turns drafting off).
    """

    model: str | None = None
    dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_gib: float = DEFAULT_KV_CACHE_MEMORY_GIB
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    served_model_name: str | None = None
    seed: int | None = None
    num_threads: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    encoder_cache_memory_gib: float = DEFAULT_ENCODER_CACHE_MEMORY_GIB
    kv_offload_dir: str | None = None
    kv_offload_size_gib: float = DEFAULT_KV_OFFLOAD_SIZE_GIB
    weights: str = "dense"
    kv_compression: str = "none"
    kv_min_retention: float = 0.2
    kv_window: int = 32
    kv_progressive: bool = False
    kv_layerwise: bool = False
    kv_mirror_memory_gib: float = DEFAULT_KV_MIRROR_MEMORY_GIB
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    gguf_decode: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_compression not in KV_COMPRESSIONS:
            raise ValueError(f"kv_compression must be one of {KV_COMPRESSIONS}, got {self.kv_compression!r}")
        if not isinstance(self.kv_min_retention, int | float) or not 0 < self.kv_min_retention <= 1:
            raise ValueError(f"kv_min_retention must be in (0, 1], got {self.kv_min_retention!r}")
        if not isinstance(self.kv_window, int) or isinstance(self.kv_window, bool) or self.kv_window < 1:
            raise ValueError(f"kv_window must be a positive int, got {self.kv_window!r}")
        if not isinstance(self.gguf_decode, bool):
            raise ValueError(f"gguf_decode must be a bool, got {self.gguf_decode!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.kv_cache_memory_gib, int | float) or not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}")
        if (not isinstance(self.kv_mirror_memory_gib, int | float) or isinstance(self.kv_mirror_memory_gib, bool)
                or not 0 <= self.kv_mirror_memory_gib < float("inf")):
            raise ValueError(f"kv_mirror_memory_gib must be a finite number >= 0, got {self.kv_mirror_memory_gib!r}")
        if (not isinstance(self.speculative_tokens, int) or isinstance(self.speculative_tokens, bool)
                or not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.speculative_tokens!r}")
        if not isinstance(self.encoder_cache_memory_gib, int | float) or self.encoder_cache_memory_gib < 0:
            raise ValueError(f"encoder_cache_memory_gib must be >= 0, got {self.encoder_cache_memory_gib!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.kv_offload_size_gib, int | float) or not self.kv_offload_size_gib > 0:
            raise ValueError(f"kv_offload_size_gib must be > 0, got {self.kv_offload_size_gib!r}")
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir):
            raise ValueError(f"kv_offload_dir must be a non-empty path, got {self.kv_offload_dir!r}")
        if self.kv_offload_dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir needs prefix caching (do not combine it with --no-prefix-caching)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads!r}")
