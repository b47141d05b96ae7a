"""A model directory with a preset's shape and the embedded SmolLM2's tokenizer, for benchmarks that need text
(structured outputs compile against a tokenizer) at a real model's step cost: `nanovllm bench --model DIR
--load-format dummy`. The model's vocabulary (e.g. Qwen3's 151,936) may exceed the tokenizer's (49,152): the extra
ids are never allowed by a grammar, and EOS is set to the tokenizer's so rows end as the grammar says.

usage: python scripts/tokenized_preset.py qwen3-0.6b DIR"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from nanovllm.loaders.default_model import default_model_path
from nanovllm.loaders.gguf import gguf_to_hf_dir


def main(preset: str, directory: Path) -> None:
    config = json.loads((Path(__file__).resolve().parent.parent / "core" / "presets" / f"{preset}.json").read_text())
    smollm = gguf_to_hf_dir(default_model_path())
    tokenizer_config = json.loads((smollm / "config.json").read_text())
    config["bos_token_id"], config["eos_token_id"] = tokenizer_config["bos_token_id"], tokenizer_config["eos_token_id"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm / name).exists():
            shutil.copy(smollm / name, directory / name)
    print(directory)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
