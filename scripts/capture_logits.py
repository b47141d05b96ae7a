"""Logits that real decoding meets, saved for `scripts/bench_sampler.py --captured DIR`.

    python scripts/capture_logits.py DIR [--sources qwen3-0.6b qwen3-8b smollm2] [--captures 16] [--rows 32]

Each source is an engine decoding a batch of prompts with sampling (T 1.0, so that sequences diverge; EOS
ignored): the Qwen3-0.6B and Qwen3-8B shapes with random weights (`load_format="dummy"`, random prompt ids) and the
embedded SmolLM2 with its real weights (`LLM()` with no model, text prompts). The sampler is wrapped where the
runner calls it; every `--every`-th call hands over the first `--rows` rows of its logits, spread over the run
(prefill and decode steps alike), until `--captures` calls are kept. Each source is saved as DIR/SOURCE.pt:
{"logits": [captures * rows, vocab] in the model's dtype, "source", "steps": the call index of each row}."""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers import sampler

SOURCES = {"qwen3-0.6b": dict(model="qwen3-0.6b", load_format="dummy"),
           "qwen3-8b": dict(model="qwen3-8b", load_format="dummy"),
           "smollm2": dict(model=None)}
TEXTS = ["The capital of France is", "Write a haiku about autumn.", "def fibonacci(n):", "Once upon a time,",
         "The three laws of thermodynamics state", "Translate to German: the weather is nice today.",
         "List five prime numbers:", "In 1969, the first humans", "A recipe for pancakes:", "Dear hiring manager,"]


class Recorder:
    """Wraps the sampler in every nanovllm module that imported it; keeps the logits of every `every`-th call."""

    def __init__(self, every: int, rows: int, captures: int):
        self.every, self.rows, self.captures = every, rows, captures
        self.calls = 0
        self.kept: list[torch.Tensor] = []
        self.steps: list[int] = []
        self.original = sampler.sample
        self.patched = [module for name, module in sys.modules.items()
                        if name.startswith("nanovllm") and getattr(module, "sample", None) is self.original]
        if not self.patched:
            sys.exit("no nanovllm module calls nanovllm.layers.sampler.sample: the capture hook has nothing to wrap")
        for module in self.patched:
            module.sample = self.record

    def record(self, logits: torch.Tensor, settings) -> torch.Tensor:
        if self.calls % self.every == 0 and len(self.kept) < self.captures:
            self.kept.append(logits[:self.rows].detach().cpu())
            self.steps += [self.calls] * len(self.kept[-1])
        self.calls += 1
        return self.original(logits, settings)

    def close(self) -> None:
        for module in self.patched:
            module.sample = self.original


def capture(source: str, args: argparse.Namespace) -> dict:
    llm = LLM(**SOURCES.get(source, dict(model=source, load_format="dummy")), max_num_seqs=args.num_seqs, seed=0)
    generator = random.Random(0)
    if source == "smollm2":
        prompts = [TEXTS[i % len(TEXTS)] for i in range(args.num_seqs)]
    else:  # ids below 10,000, as the bench's workload
        top = min(llm.info.vocab_size, 10000)
        prompts = [[generator.randrange(top) for _ in range(generator.randint(16, 256))] for _ in range(args.num_seqs)]
    recorder = Recorder(args.every, args.rows, args.captures)
    try:
        llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0))
    finally:
        recorder.close()
        llm.exit()
    if not recorder.kept:
        sys.exit(f"{source}: the sampler was never called")
    return {"logits": torch.cat(recorder.kept), "source": source, "steps": torch.tensor(recorder.steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for SOURCE.pt files")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES),
                        help=f"{', '.join(SOURCES)}, or any preset (random weights)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--every", type=int, default=10, help="keep every n-th sampler call")
    parser.add_argument("--rows", type=int, default=32, help="rows kept per call")
    parser.add_argument("--captures", type=int, default=16, help="calls kept per source")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for source in args.sources:
        saved = capture(source, args)
        torch.save(saved, args.out / f"{source}.pt")
        logits = saved["logits"].float()
        print(f"{source}: {tuple(saved['logits'].shape)} {saved['logits'].dtype}, logit std "
              f"{logits.std(dim=-1).mean():.3f}, max - median {(logits.max(-1).values - logits.median(-1).values).mean():.2f}",
              flush=True)


if __name__ == "__main__":
    main()
