"""LLMEngine: the engine loop thread that turns GenerationRequests into StepOutputs.

Flow of one request: :meth:`LLMEngine.submit` validates it and queues it (any
thread); every loop iteration the :class:`~engine.core.scheduler.Scheduler` picks
the step's work (decode tokens of running requests, prefill chunks of new ones,
under a token budget), reserving blocks in the
:class:`~engine.kvcache.kv_cache_manager.KVCacheManager` it owns; the
:class:`~engine.model.runner.ModelRunner` computes all of it in one forward,
reading and writing K/V in the block pool; each request whose forward reached its
last token samples (:mod:`engine.core.sampler`), detokenizes
(:class:`~engine.core.detokenizer.Detokenizer`) and gets a :class:`StepOutput` in
its :class:`OutputStream`.

Invariants:

* only the loop thread touches the model, the KV storage, the scheduler and the
  KV cache manager; other threads talk to it through ``_inbox`` and ``_aborts``
  under ``_cond``;
* a vision-language model's requests carry their images' pixels
  (``mm_inputs``); image features are computed in the loop thread, just before
  the forward that needs them, through the encoder cache
  (:class:`~engine.multimodal.embedder.ImageEmbedder`), never for positions
  reused from the prefix cache;
* a request's blocks are freed exactly once, when it finishes for any reason
  (stop, length, abort, error), before its finished output is put in its
  stream; after a failed forward, the blocks it was computing lose their hash
  first (for every request of the batch), so no one can hit them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from engine.config import KV_COMPRESSIONS, EngineConfig
from engine.core import assembly
from engine.core.detokenizer import eos_token_ids
from engine.core.engine_request import EngineRequest
from engine.core.engine_stats import EngineStats
from engine.core.output_stream import GenerationRequest, OutputStream, StepOutput, TokenLogprobs
from engine.core.sampler import sample, token_logprobs
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ModuleProbe, ScheduledSequence, Scheduler, SchedulerOutput
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.model.gguf_decode import GGUFBlocks
from engine.model.kv_offload import KVOffload, model_fingerprint
from engine.model.kv_shift import KVShifter
from engine.model.kv_storage import GIB, KVLayout, KVStorage
from engine.model.llama import language_parts
from engine.model.packed_kv import PackedKV
from engine.model.pyramid import (
    DEFAULT_CHUNK,
    LAYERWISE_CHUNK,
    AttentionCapture,
    PyramidSchedule,
    gather,
    reselect,
    select,
)
from engine.model.runner import ModelRunner, SequenceInput
from engine.multimodal.embedder import ImageEmbedder
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.processor import ImageInput, ImagePromptProcessor
from engine.multimodal.vlm import VisionEncoder, is_vlm

T = TypeVar("T")
logger = logging.getLogger(__name__)

__all__ = [
    "EngineStats",
    "GenerationRequest",
    "LLMEngine",
    "OutputStream",
    "SamplingParams",
    "StepOutput",
]


class LLMEngine:
    """A causal LM served with block-level prefix caching, one loop thread."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, *, processor: Any = None) -> None:
        """``processor``: the checkpoint's processor, required for (and only for) a
        vision-language model (:mod:`engine.multimodal.vlm`)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        mc = model.config.get_text_config()
        self.layout = KVLayout(
            num_layers=mc.num_hidden_layers,
            kv_heads=mc.num_key_value_heads,
            head_dim=getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads,
            block_size=config.block_size,
            dtype=next(model.parameters()).dtype,
        )
        self.storage = KVStorage.from_memory(self.layout, config.kv_cache_memory_gib)
        self.block_size = config.block_size
        q4_layers = None
        if config.weights == "q4_1":
            from engine.model.q4_weights import gguf_file, read_q4_layers

            if self.layout.dtype != torch.bfloat16:
                raise ValueError(f"weights='q4_1' needs bfloat16, the model is {self.layout.dtype}")
            q4_layers = read_q4_layers(gguf_file(config.model))
        self.runner = ModelRunner(model, self.storage, q4_layers=q4_layers,
                                  mirror_bytes=int(config.kv_mirror_memory_gib * GIB),
                                  gguf_decode=self._gguf_decode_blocks())
        model_len = config.max_model_len or mc.max_position_embeddings
        kv_tokens = self.storage.num_blocks * config.block_size
        if model_len > kv_tokens:
            logger.warning("max_model_len %d capped to the KV cache's %d tokens", model_len, kv_tokens)
        self.max_model_len = min(model_len, kv_tokens)
        self.model_id = config.served_model_name or str(getattr(model.config, "name_or_path", "") or "model")
        self.image_processor: ImagePromptProcessor | None = None
        self.embedder: ImageEmbedder | None = None
        if is_vlm(model):
            if processor is None:
                raise ValueError(f"{type(model).__name__} needs its processor")
            if not self.runner.lean:
                raise ValueError("the language model of a vision-language model must be a plain Llama")
            self.image_processor = ImagePromptProcessor(processor)
            cache_bytes = int(config.encoder_cache_memory_gib * GIB)
            self.embedder = ImageEmbedder(VisionEncoder(model), EncoderCache(cache_bytes))
        self.supports_images = self.embedder is not None
        self.vocab_size = int(mc.vocab_size)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.kv_cache_manager = KVCacheManager(
            self.storage.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            model=self.model_id,
            speculative_tokens=config.speculative_tokens,
        )
        rotary = getattr(language_parts(model)[0], "rotary_emb", None) if hasattr(model, "model") else None
        self.shifter = None if rotary is None else KVShifter(self.storage, rotary)
        self.offload: KVOffload | None = None
        if config.kv_offload_dir is not None:
            pool = self.kv_cache_manager.block_pool
            self.offload = KVOffload(self.storage, config.kv_offload_dir, config.kv_offload_size_gib,
                                     model_fingerprint(model), event_sink=lambda: pool.event_sink)
            self.scheduler.block_loader = self.offload
        self.scheduler.num_layers = self.layout.num_layers
        self.pyramid = PyramidSchedule(config.kv_min_retention, config.kv_window,
                                       progressive=config.kv_progressive or config.kv_layerwise,
                                       layerwise=config.kv_layerwise,
                                       chunk=LAYERWISE_CHUNK if config.kv_layerwise else DEFAULT_CHUNK)
        self.scheduler.new_packed = lambda: PackedKV(self.storage, [0] * self.layout.num_layers)
        self.num_compressed = 0
        self.num_reselections = 0
        self.reselect_blocks_freed = 0
        self.compressed_tokens = 0
        self.retained_tokens = 0.0
        """Summed over compressions: the tokens requests had, and kept (averaged over layers)."""
        self.ttft_observers: list[Callable[[float], None]] = []
        self.first_logits_observer: Callable[[str, torch.Tensor], None] | None = None
        self._rng = random.Random(config.seed)
        self._cond = threading.Condition()
        self._inbox: list[EngineRequest] = []
        self._aborts: set[str] = set()
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._active: set[str] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._num_finished = 0
        self._finish_counts: dict[str, int] = {}
        self._ttft = (0, 0.0)
        self._prompt_tokens_computed = 0
        self._generation_tokens = 0
        self._drafted = 0
        self._accepted_drafts = 0

    def _gguf_decode_blocks(self) -> GGUFBlocks | None:
        """The GGUF's blocks for the few-row products (``EngineConfig.gguf_decode``): None
        for another setting, another dtype, a checkpoint directory or a GGUF whose
        projections are not all Q4_1 (the dense products then serve every row)."""
        config = self.config
        if not config.gguf_decode or config.weights != "dense" or self.layout.dtype != torch.bfloat16:
            return None
        from engine.model.gguf_decode import read_gguf_blocks
        from engine.model.q4_weights import gguf_file

        try:
            return read_gguf_blocks(gguf_file(config.model))
        except (ValueError, FileNotFoundError) as exc:
            logger.info("GGUF decode products off: %s", exc)
            return None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from engine.model.loader import load_model

        loaded = load_model(config)
        return cls(loaded.model, loaded.tokenizer, dataclasses.replace(config, served_model_name=loaded.model_id),
                   processor=loaded.processor)

    @classmethod
    def launch(cls, config: EngineConfig) -> LLMEngine:
        """Load the model from ``config`` on a new thread and run the loop on that same
        thread; returns the started engine once loaded (raises what loading raised).

        Prefer this to ``from_config(...).start()``: torch's OpenMP runtime keeps one
        pool of worker threads per thread that ever ran parallel work, and once the
        process holds more of those threads than there are cores it stops spinning
        between parallel regions and puts its workers to sleep, so each of the
        forward's few hundred regions pays a wake-up. Measured on the bundled model
        (2 cores): a decode step of 1 / 8 requests took 55-63 / 73-83 ms when the model
        was loaded on one thread and run on another, 31-42 / 39-63 ms when one thread
        did both. Here one thread does all of it.
        """
        loaded: queue.Queue[LLMEngine | BaseException] = queue.Queue(maxsize=1)

        def boot() -> None:
            try:
                engine = cls.from_config(config)
            except BaseException as exc:  # handed to the caller, who re-raises it
                loaded.put(exc)
                return
            engine._thread = threading.current_thread()
            loaded.put(engine)
            engine._loop()

        threading.Thread(target=boot, name="prefixgate-engine", daemon=True).start()
        result = loaded.get()
        if isinstance(result, BaseException):
            raise result
        return result

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="prefixgate-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests finish with ``abort``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.offload is not None:
            self.offload.close()  # queued block writes land before the process exits

    def submit(self, request: GenerationRequest) -> OutputStream:
        """Queue a request; raises ValueError when it can never run."""
        req = self._validate(request)
        stream = OutputStream(request.request_id, self.abort)
        req.stream = stream
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            if request.request_id in self._active:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._active.add(request.request_id)
            self._inbox.append(req)
            self._cond.notify_all()
        return stream

    def abort(self, request_id: str) -> None:
        """Finish the request with ``abort`` and free its blocks (no-op when finished)."""
        with self._cond:
            if request_id in self._active:
                self._aborts.add(request_id)
                self._cond.notify_all()

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the loop thread between two steps and return what it returned
        (or raise what it raised). For benchmarks and diagnostics whose torch work must
        share the loop thread's OpenMP pool (see :meth:`launch`). Raises RuntimeError
        when the loop is not running or stops first; does not change the cache itself
        (``fn`` may)."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[T] = Future()
        with self._cond:
            if self._stopping or self._thread is None:
                raise RuntimeError("the engine loop is not running")
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout)

    def add_ttft_observer(self, observer: Callable[[float], None]) -> None:
        """``observer(seconds)`` is called from the loop thread at each first token."""
        self.ttft_observers.append(observer)

    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        cache = kv.stats
        free = kv.num_free_blocks
        return EngineStats(
            prefix_cache_requests=cache.requests,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            evictions=cache.evictions,
            num_blocks=kv.num_blocks,
            num_used_blocks=kv.num_blocks - free,
            num_free_blocks=free,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            num_finished=self._num_finished,
            num_aborted=self._finish_counts.get("abort", 0),
            num_failed=self._finish_counts.get("error", 0),
            num_preemptions=self.scheduler.num_preemptions,
            ttft_count=self._ttft[0],
            ttft_sum_s=self._ttft[1],
            prompt_tokens_computed=self._prompt_tokens_computed,
            generation_tokens=self._generation_tokens,
            spec_draft_tokens=self._drafted,
            spec_accepted_tokens=self._accepted_drafts,
            module_blocks=self.scheduler.modules.num_module_blocks,
            module_tokens_reused=self.scheduler.modules.module_tokens_reused,
            module_tokens_encoded=self.scheduler.modules.module_tokens_encoded,
            kv_compressed=self.num_compressed,
            kv_compressed_tokens=self.compressed_tokens,
            kv_retained_tokens=self.retained_tokens,
            kv_reselections=self.num_reselections,
            kv_reselect_freed_blocks=self.reselect_blocks_freed,
            **self._encoder_cache_stats(),
            **self._disk_stats(),
        )

    def _disk_stats(self) -> dict[str, Any]:
        if self.offload is None:
            return {}
        d, store = self.offload.stats, self.offload.store
        return {"disk_hits": d.hits, "disk_misses": d.misses, "disk_bytes_read": d.bytes_read,
                "disk_bytes_written": d.bytes_written, "disk_corrupt": d.corrupt, "disk_dropped": d.dropped,
                "disk_load_count": d.load_count, "disk_load_seconds": d.load_seconds,
                "disk_blocks": len(store), "disk_bytes": store.total_bytes}

    def _encoder_cache_stats(self) -> dict[str, int]:
        if self.embedder is None:
            return {}
        cache = self.embedder.cache
        return {"encoder_cache_hits": cache.hits, "encoder_cache_misses": cache.misses,
                "encoder_cache_entries": len(cache), "encoder_cache_bytes": cache.bytes}

    def _validate(self, request: GenerationRequest) -> EngineRequest:
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt) > self.max_model_len - 1:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(prompt)} tokens and at least one token must be generated"
            )
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary of {self.vocab_size}")
        if request.mm_items and not self.supports_images:
            raise ValueError("model does not accept images")
        if request.segmented is not None and (request.mm_items or self.shifter is None):
            raise ValueError("prompt modules need a text-only request to a model with rotary position embeddings")
        if self.image_processor is not None:
            self._validate_images(request)
        if not isinstance(request.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(request.params).__name__}")
        mode = request.kv_compression or self.config.kv_compression
        if mode not in KV_COMPRESSIONS:
            raise ValueError(f"kv_compression must be one of {KV_COMPRESSIONS}, got {request.kv_compression!r}")
        if request.segmented is not None:  # assembled KV is computed in runs, not one exact prefill
            if request.kv_compression == "pyramid":
                raise ValueError("kv_compression 'pyramid' cannot be combined with prompt modules or segment_reuse")
            if request.params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be combined with prompt modules or segment_reuse")
            mode = "none"
        req = EngineRequest(
            request,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            fallback_seed=self._next_seed(),
        )
        req.compress = mode == "pyramid"
        if req.compress:
            req.capture_tail = self.pyramid.window
            req.layerwise = self.pyramid.layerwise and req.prompt_logprobs is None and self.runner.lean
        return req

    def _validate_images(self, request: GenerationRequest) -> None:
        """Every image item has its pixels, and the image token appears exactly at the
        images' feature positions (a prompt cannot smuggle in an image token)."""
        items, inputs = request.mm_items, request.mm_inputs
        if len(items) != len(inputs) or any(
            not isinstance(inp, ImageInput) or inp.item != item for item, inp in zip(items, inputs, strict=False)
        ):
            raise ValueError(f"{len(items)} image items need as many matching image inputs, got {len(inputs)}")
        assert self.image_processor is not None
        token = self.image_processor.image_token_id
        expected = sorted(int(p) for inp in inputs for p in inp.positions)
        found = [i for i, t in enumerate(request.prompt_token_ids) if t == token]
        if found != expected:
            raise ValueError(
                f"the prompt has {len(found)} image tokens (id {token}) where its images take {len(expected)}"
            )

    def _next_seed(self) -> int:
        with self._cond:
            return self._rng.getrandbits(63)

    # ------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._aborts or self._calls):
                    if not self.scheduler.has_work():
                        self._cond.wait()
                    elif (hold := self.scheduler.hold_s()) > 0:  # anticipating a light tenant's request
                        self._cond.wait(hold)
                    else:
                        break
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
                calls, self._calls = self._calls, []
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # the caller re-raises it
                        future.set_exception(exc)
            for req in inbox:
                self.scheduler.add(req)
            for rid in aborts:
                self._abort_now(rid)
            try:
                self.step()
            except Exception:  # a bug outside any one request: fail them all, keep serving
                logger.exception("engine step failed")
                for req in self.scheduler.all_requests():
                    self._finish(req, "error", error="internal engine error")
        for req in [*self.scheduler.all_requests(), *self._inbox]:
            self._finish(req, "abort")
        with self._cond:
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(RuntimeError("the engine loop stopped"))

    def step(self) -> None:
        """Run one scheduler step: one forward over every scheduled token, then sample."""
        work = self.scheduler.schedule()
        for req in work.preempted:  # its blocks were freed
            self.runner.forget(req.request_id)
        if work.copies:  # module K/V into segmented requests' blocks, before the forward reads them
            assert self.shifter is not None
            self.shifter.apply(work.copies)
        for probe in work.probes:  # cacheblend: the copied KV's deviation chooses the tokens to recompute
            try:
                self._probe(probe)
            except Exception as exc:  # its request has nothing else in this step
                logger.exception("probe of %s failed", probe.request.request_id)
                self._finish(probe.request, "error", error=f"{type(exc).__name__}: {exc}")
        if not work.scheduled and not work.encodes:
            return
        kvm = self.kv_cache_manager
        captures = [self._capture(s.request, s.start, s.end) for s in work.scheduled]
        try:
            inputs = [
                SequenceInput(
                    token_ids=[*s.request.kv.all_token_ids[s.start : s.end], *s.drafts],
                    start=s.start,
                    block_ids=kvm.get_block_ids(s.request.request_id) if s.request.packed is None else [],
                    sample=s.samples,
                    embeds=self._embeds(s.request, s.start, s.end),
                    # a draft is verified by the logits of the row before it
                    prompt_rows=len(s.drafts) if s.drafts else self._prompt_rows(s.request, s.start, s.end),
                    capture=capture,
                    packed=s.request.packed,
                    layerwise=self.pyramid if s.request.packed is not None and s.request.layerwise else None,
                    joins=i > 0 and work.scheduled[i - 1].request is s.request,  # a segmented request's runs
                    as_decodes=bool(s.drafts),
                    mirror=s.request.request_id if s.request.assembly is None else None,
                )
                for i, (s, capture) in enumerate(zip(work.scheduled, captures, strict=True))
            ]
            modules = [SequenceInput(e.token_ids, e.start, e.block_ids, sample=False) for e in work.encodes]
            logits = self.runner.execute([*inputs, *modules])
            # one entry per input, the module encodes' after the scheduled sequences'
            for s, prompt_logits in zip(work.scheduled, self.runner.prompt_logits[: len(inputs)], strict=True):
                if prompt_logits is not None and s.request.prompt_logprobs is not None:
                    s.request.prompt_logprobs.add(s.start, prompt_logits)
        except Exception as exc:
            logger.exception("forward over %d requests failed", len(work.scheduled))
            self.scheduler.forget_unwritten(work)
            failed = {id(r): r for r in [*(s.request for s in work.scheduled), *(e.request for e in work.encodes)]}
            for req in failed.values():  # a module encode's blocks were never cached: nothing to forget
                self._finish(req, "error", error=f"{type(exc).__name__}: {exc}")
            return
        row = 0
        for i, s in enumerate(work.scheduled):
            self._prompt_tokens_computed += max(0, min(s.end, s.request.num_prompt_tokens) - s.start)
            s.request.advance(s.end)
            if s.samples:
                if s.drafts:
                    self._verify(s, self.runner.prompt_logits[i], logits[row])
                else:
                    self._sample(s.request, logits[row])
                row += 1
        if self.offload is not None:  # after sampling: first tokens do not wait for the copies
            self._offload(work, inputs)
        for s, capture in zip(work.scheduled, captures, strict=True):
            req, packed = s.request, s.request.packed
            if req not in self.scheduler.running:
                continue
            if capture is not None and packed is None:
                self._compress(req, capture)
            elif capture is not None or (packed is not None and self.pyramid.reselect
                                         and packed.since_selection >= self.pyramid.window):
                self._reselect(req, capture)
                if capture is not None and req.packed_from_start and s.start < req.num_prompt_tokens <= s.end:
                    self._count_compression(req, req.num_prompt_tokens)

    def _verify(self, s: ScheduledSequence, draft_logits: torch.Tensor | None, last: torch.Tensor) -> None:
        """Sample a decode's token and then, while each sampled token equals the next
        draft, the token after it from the draft's row: the logits of a row depend only
        on the tokens up to it (row-invariant products, length-invariant attention), so
        these are the tokens decoding one at a time samples, with the same generator
        draws. The accepted drafts' K/V become the request's; the scheduler gives the
        rejected ones' slots back."""
        req = s.request
        assert draft_logits is not None
        rows = [*draft_logits.float(), last]
        kept = 0
        for n, logits in enumerate(rows):
            self._sample(req, logits)
            if n == len(s.drafts) or req not in self.scheduler.running or req.kv.all_token_ids[-1] != s.drafts[n]:
                break
            req.advance(req.num_computed_tokens + 1)  # the draft was right: its K/V stand
            kept += 1
        self._drafted += len(s.drafts)
        self._accepted_drafts += kept
        if req.draft is not None:
            req.draft.record(len(s.drafts), kept)
        self.scheduler.settle(req)

    def _probe(self, probe: ModuleProbe) -> None:
        """Run ``probe`` (:meth:`ModelRunner.probe`) and hand its deviations to the scheduler."""
        req = probe.request
        tokens = req.kv.all_token_ids[probe.start : probe.end]
        block_ids = self.kv_cache_manager.get_block_ids(req.request_id)
        deviation = self.runner.probe(tokens, probe.start, block_ids, keep=assembly.KEEP_PROBED_KV,
                                      depth=assembly.PROBE_DEPTH)
        self.scheduler.probed(req, probe.start,
                              None if deviation is None else [(float(k), float(v)) for k, v in deviation.tolist()])

    def _capture(self, req: EngineRequest, start: int, end: int) -> AttentionCapture | None:
        """An attention capture for the chunk that ends a compressed request's prefill, or
        with progressive compression for every prefill chunk from ``min_tokens`` on."""
        if not req.compress or req.stays_exact or end - start < 2:
            return None
        if req.packed is not None:  # a chunk over packed pages: selects again
            return AttentionCapture(self.pyramid.window)
        last = end == req.kv.num_tokens or self.pyramid.progressive
        return AttentionCapture(self.pyramid.window) if last and end >= self.pyramid.min_tokens else None

    @property
    def pyramid(self) -> PyramidSchedule:
        """The compression schedule (the scheduler reserves by it too)."""
        schedule = self.scheduler.pyramid
        assert schedule is not None
        return schedule

    @pyramid.setter
    def pyramid(self, schedule: PyramidSchedule) -> None:
        self.scheduler.pyramid = schedule

    def _compress(self, req: EngineRequest, capture: AttentionCapture) -> None:
        """Keep each layer's selected tokens in packed pages and give the exact blocks
        back (between steps; the request stays exact when the pool cannot give the
        packed blocks)."""
        n = req.num_computed_tokens
        keep = select(capture, self.pyramid, n, self.layout.num_layers)
        packed = PackedKV(self.storage, [k.numel() for k in keep])
        data: list[tuple[torch.Tensor, torch.Tensor]] = []

        def read(old: list[int]) -> None:
            data.extend(gather(self.storage, old, keep))

        try:
            done = self.scheduler.compress(req, packed, read, lambda _new: packed.load(data))
        except Exception:  # an optimisation: the request goes on exact (or recomputes, if preempted)
            logger.exception("KV compression of %s failed", req.request_id)
            return
        if done:
            self.runner.forget(req.request_id)
            self._count_compression(req, n)

    def _count_compression(self, req: EngineRequest, tokens: int) -> None:
        """``req`` was compressed with ``tokens`` tokens (once packed, or a layer-wise one
        packed from admission once its prompt is computed)."""
        if req.packed is None:
            return
        self.num_compressed += 1
        self.compressed_tokens += tokens
        self.retained_tokens += req.packed.num_tokens / self.layout.num_layers

    def _reselect(self, req: EngineRequest, capture: AttentionCapture | None = None) -> None:
        """Select a packed request's tokens again from its recent decode queries'
        attention (or its last prefill chunk's, ``capture``); the blocks that frees go
        back to the pool (between steps)."""
        assert req.packed is not None
        layers = self.layout.num_layers
        chosen = None  # the selection a layer-wise chunk made inside its forward, applied as it is
        if capture is not None and len(capture.keep) == layers:
            chosen = [capture.keep[layer] for layer in range(layers)]
        if capture is not None and chosen is None:
            scores = torch.zeros((layers, max(c.numel() for c in capture.scores.values())))
            for layer, values in capture.scores.items():
                scores[layer, : values.numel()] = values
            req.packed.scores = scores
        try:
            keep = chosen if chosen is not None else reselect(req.packed, self.pyramid, req.num_computed_tokens)
            self.reselect_blocks_freed += self.scheduler.reselect(req, keep)
        except Exception:  # the scheduler preempted it if its pages were touched
            logger.exception("KV re-selection of %s failed", req.request_id)
            return
        self.num_reselections += 1

    def _offload(self, work: SchedulerOutput, inputs: list[SequenceInput]) -> None:
        """Hand the blocks this forward filled to the disk tier. Their K/V are in place
        and no forward has run since, so freed blocks among them still hold them."""
        assert self.offload is not None
        try:
            self.offload.save([(s.request.kv, s.start, s.request.num_computed_tokens if s.drafts else s.end,
                                x.block_ids)
                               for s, x in zip(work.scheduled, inputs, strict=True) if x.packed is None])
        except Exception:  # the disk tier is an optimisation: never fail requests for it
            logger.exception("KV offload: saving blocks failed")

    @staticmethod
    def _prompt_rows(req: EngineRequest, start: int, end: int) -> int:
        """Rows of the chunk ``[start, end)`` whose logits score prompt tokens (0 unless asked)."""
        return 0 if req.prompt_logprobs is None else req.prompt_logprobs.rows_for(start, end)

    def _embeds(self, req: EngineRequest, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Image features for the chunk ``[start, end)`` of ``req`` (none past its prompt)."""
        if self.embedder is None or not req.mm_inputs or start >= req.num_prompt_tokens:
            return []
        return self.embedder.embeds(req.mm_inputs, req.kv.cache_salt, start, end)

    def _sample(self, req: EngineRequest, logits: torch.Tensor) -> None:
        self._generation_tokens += 1  # before the token reaches its consumer
        first = not req.kv.output_token_ids
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs.entries, None
        try:
            if first and self.first_logits_observer is not None:
                self.first_logits_observer(req.request_id, logits)
            token = sample(logits, req.params, req.generator)
            top = req.params.logprobs
            logprobs = None if top is None else [token_logprobs(logits, token, top)]
            reason = req.append_token(token)
        except Exception as exc:
            logger.exception("request %s failed", req.request_id)
            self._finish(req, "error", error=f"{type(exc).__name__}: {exc}")
            return
        if first:
            ttft = time.monotonic() - req.arrival_time
            self._ttft = (self._ttft[0] + 1, self._ttft[1] + ttft)
            for observer in self.ttft_observers:
                observer(ttft)
        finished = reason is not None
        if finished:
            self._release(req)
        self._emit(req, [token], req.detokenizer.take_new_text(finished), reason, logprobs=logprobs,
                   prompt_logprobs=prompt_logprobs)

    def _abort_now(self, request_id: str) -> None:
        req = self.scheduler.remove(request_id)
        if req is not None:
            self._finish(req, "abort")

    def _finish(self, req: EngineRequest, reason: str, error: str | None = None) -> None:
        text = req.detokenizer.take_new_text(True) if reason != "error" else ""
        self._finish_counts[reason] = self._finish_counts.get(reason, 0) + 1
        self._release(req)
        self._emit(req, [], text, reason, error)

    def _emit(
        self, req: EngineRequest, tokens: list[int], text: str, reason: str | None, error: str | None = None,
        logprobs: list[TokenLogprobs] | None = None, prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> None:
        output = StepOutput(
            new_token_ids=tokens,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=error,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        assert req.stream is not None
        if not req.stream.put(output) and reason is None:
            self.abort(req.request_id)  # the consumer's event loop is gone

    def _release(self, req: EngineRequest) -> None:
        """Take the request out of the scheduler and free its blocks and mirror (idempotent)."""
        self.scheduler.finish(req)
        self.runner.forget(req.request_id)
        self._num_finished += 1
        with self._cond:
            self._active.discard(req.request_id)
            self._aborts.discard(req.request_id)
