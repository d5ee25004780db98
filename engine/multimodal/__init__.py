"""Vision-language models: what turns an image into the input embeddings of its placeholder tokens.

* :mod:`engine.multimodal.vlm`: which checkpoints are vision-language models
  (LLaVA, Idefics3/SmolVLM), loading them, and their vision tower as a
  :class:`~engine.multimodal.vlm.VisionEncoder`;
* :mod:`engine.multimodal.processor`: the checkpoint's processor turning a rendered
  chat and its images into token ids, placeholder ranges and per-image pixels;
* :mod:`engine.multimodal.encoder_cache`: image features by image content hash,
  bounded, LRU.

Torch and transformers are imported here; ``import engine`` and
:mod:`engine.kvcache` never import this package.
"""
