"""CPU time of nanovllm against HF transformers' `generate` on the embedded SmolLM2, in one run; prints JSON.

16 chat prompts (the samples' chat rows, repeated with numbered questions), greedy, 64 new tokens each. HF runs
them as one left-padded batch; nanovllm as one `chat` call. Both report wall time and whether the texts agree.

    python scripts/cpu_vs_hf.py
"""
from __future__ import annotations

import json
import time

import torch

from nanovllm import LLM, SamplingParams

NEW_TOKENS = 64
TOPICS = ["the water cycle", "binary search", "photosynthesis", "the French revolution", "prime numbers",
          "how vaccines work", "TCP handshakes", "black holes", "supply and demand", "the Pythagorean theorem",
          "plate tectonics", "hash tables", "the immune system", "compound interest", "volcanoes", "recursion"]
SYSTEM = "You are a concise assistant. Answer in two or three sentences."


def main() -> None:
    from transformers import AutoModelForCausalLM

    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Explain {t}."}]
                     for t in TOPICS]
    llm = LLM(None)
    prompts = [llm.apply_chat_template(c) for c in conversations]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    ours = llm.generate(prompts, params)
    ours_s = time.perf_counter() - start

    from nanovllm.loaders.gguf import gguf_to_hf_dir
    from nanovllm.loaders.resolve import default_model_path

    hf = AutoModelForCausalLM.from_pretrained(str(gguf_to_hf_dir(default_model_path())), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = llm.tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        generated = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=pad)
        hf_s = time.perf_counter() - start
    hf_tokens = [row[width:].tolist() for row in generated]
    same = sum(o.token_ids == t for o, t in zip(ours, hf_tokens))
    print(json.dumps({
        "prompts": len(prompts), "new_tokens_each": NEW_TOKENS, "torch_threads": torch.get_num_threads(),
        "nanovllm_s": ours_s, "hf_generate_s": hf_s, "speedup": hf_s / ours_s,
        "identical_sequences": same, "nanovllm_stats": llm.get_stats(),
    }))


if __name__ == "__main__":
    main()
