"""Tiny randomly initialised vision-language checkpoints (LLaVA, Idefics3) saved to a directory.

Each checkpoint is complete as a user's would be: config, safetensors weights, the
bundled SmolLM2 tokenizer with the model's image tokens added, an image processor
and a chat template on the processor. Weights are random: exactness and caching do
not depend on them. Sizes are tiny (hidden 64, 2 text layers, 1 vision layer,
32x32 images) so a forward takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ image_token }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _text_config(tokenizer: Any) -> dict[str, Any]:
    return {
        "model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id, "tie_word_embeddings": False,
    }


def build_tiny_llava(tokenizer_dir: str, out: Path, *, seed: int = 0) -> Path:
    """A LLaVA checkpoint (CLIP vision tower, 32x32 images, 16 image tokens) in ``out``."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaConfig(
        text_config=_text_config(tokenizer),
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                       "projection_dim": 32},
        image_token_id=image_token_id, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_seq_length=16,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE.replace(
                                   "{{ image_token }}", "<image>"))
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def build_tiny_idefics3(tokenizer_dir: str, out: Path, *, seed: int = 0) -> Path:
    """An Idefics3 checkpoint (SigLIP-style vision, 16px tiles of 8px patches, scale factor 2:
    1 image token per tile... see image_seq_len) in ``out``; larger images are split in tiles."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    extra = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    extra += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    tile, patch, scale = 32, 8, 2
    seq_len = (tile // patch) ** 2 // scale**2
    config = Idefics3Config(
        text_config=_text_config(tokenizer),
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": tile, "patch_size": patch},
        image_token_id=image_token_id, scale_factor=scale,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile}, do_image_splitting=True)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len,
                                  chat_template=CHAT_TEMPLATE.replace("{{ image_token }}", "<image>"))
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
