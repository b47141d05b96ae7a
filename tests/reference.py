"""Independent references: HF transformers' own model implementations."""
from __future__ import annotations

from pathlib import Path

import torch


def load_hf_model(directory: Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  attn_implementation: str | None = None):
    """`attn_implementation="eager"` for models whose soft-capping or sliding windows SDPA would not apply."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype,
                                                attn_implementation=attn_implementation).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by the HF model, ignoring EOS (one prompt at a time, no padding)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        generated = []
        past = None
        next_input = ids
        for _ in range(max_new_tokens):
            out = model(input_ids=next_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            next_input = torch.tensor([[token]], device=model.device)
        outputs.append(generated)
    return outputs
