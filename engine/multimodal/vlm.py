"""Vision-language checkpoints: which are supported, loading them, their vision tower.

Supported: ``LlavaForConditionalGeneration`` (a CLIP-style vision tower, features of
``vision_feature_layer`` selected by ``vision_feature_select_strategy``, an MLP
projector) and ``Idefics3ForConditionalGeneration`` (Idefics3 and SmolVLM: a
SigLIP-style vision tower over image tiles, a pixel-shuffle connector). In both the
language model is Llama, run by :class:`~engine.model.llama.LlamaForward`; the vision
side runs through transformers' own ``get_image_features``, so features are the bits
transformers' ``generate`` computes for the same pixels.

Any other checkpoint that looks multimodal (a ``vision_config``, or an architecture
named ``...ForConditionalGeneration``), or one of these two whose language model is
not Llama, is refused with a ValueError naming what is supported; text-only causal
LMs are not this module's business.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration")


def vlm_architecture(model_dir: Path) -> str | None:
    """The supported VLM architecture named by ``model_dir/config.json``; None for a
    text-only model; ValueError (naming the architecture) for other multimodal ones."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {str(model_dir / 'config.json')!r}: {exc}") from exc
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            text_config = config.get("text_config") or {}
            text_type = text_config.get("model_type", "llama") if isinstance(text_config, dict) else None
            if text_type != "llama":
                raise ValueError(
                    f"{arch} with a {text_type!r} language model is not supported; only Llama language "
                    f"models are (text_config.model_type 'llama')"
                )
            return str(arch)
    if "vision_config" in config or any(str(a).endswith("ForConditionalGeneration") for a in archs):
        raise ValueError(
            f"model architecture {archs!r} is not supported; vision-language models must be one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return None


def is_vlm(model: Any) -> bool:
    """True for a loaded model of a supported VLM architecture."""
    return type(model).__name__ in SUPPORTED_ARCHITECTURES


def load_vlm(model_dir: Path, arch: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model (eval mode) and its processor, local files only. The processor's image
    processor is the PIL one when torchvision is missing (transformers picks it)."""
    import transformers
    from transformers import AutoProcessor

    cls = getattr(transformers, arch)
    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    model = cls.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True, attn_implementation="eager")
    model.eval()
    return model, processor


class VisionEncoder:
    """Image features of one image: ``encode(pixels) -> [num_image_tokens, hidden]``.

    ``pixels`` is what the processor returned for that image alone (pixel values, and
    Idefics3's pixel attention mask), batch dimension 1. Rows are in the order of the
    image's placeholder tokens in the prompt (transformers' ``masked_scatter`` order),
    in the language model's dtype.
    """

    def __init__(self, model: Any) -> None:
        if not is_vlm(model):
            raise ValueError(f"{type(model).__name__} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.model = model
        self.arch = type(model).__name__
        self.dtype = model.get_input_embeddings().weight.dtype

    @torch.inference_mode()
    def encode(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        config = self.model.config
        if self.arch == "LlavaForConditionalGeneration":
            out = self.model.model.get_image_features(
                pixel_values=pixels["pixel_values"],
                vision_feature_layer=config.vision_feature_layer,
                vision_feature_select_strategy=config.vision_feature_select_strategy,
                image_sizes=pixels.get("image_sizes"),
                return_dict=True,
            )
        else:
            out = self.model.model.get_image_features(
                pixel_values=pixels["pixel_values"], pixel_attention_mask=pixels.get("pixel_attention_mask"),
                return_dict=True,
            )
        features = torch.cat(list(out.pooler_output), dim=0)
        return features.to(self.dtype)
