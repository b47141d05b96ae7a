"""The sampler at one batch size on every kind of logits it meets, for every setting; JSON lines.

    python scripts/bench_sampler.py OUT.jsonl [--captured DIR] [--batch 256] [--vocab 151936] [--reps 20]
                                    [--settings ...] [--kinds ...] [--sweep]

Kinds: synthetic ones at --vocab (`normal`: N(0, 3^2); `zipf`: a real model's shape, a few likely tokens and a
long tail) and the adversarial ones (`equal`, `ties_bf16`, `peaked`, `flat`, `huge`, `few_finite`), `mixed`: a
batch whose rows cycle through all of those, and, with --captured DIR (`scripts/capture_logits.py DIR`), each
captured source (real decoding's logits, rows tiled to the batch, at the source's vocabulary). Logits are bf16 but
for `huge` and `flat` (float32: bf16 cannot hold them).

Settings time what a step runs for them: `sample()` on the logits (greedy, temperature, top-k 50, top-k 50 +
top-p 0.95, top-p 0.95 alone, T 0.7 + top-p 0.9, min-p 0.05, top-k 1000), the logit controls then `sample()` then
the history update (`penalties`: T 1.0 + min-p 0.05 + repetition 1.1, as real requests send them;
`presence_frequency`; `logit_bias`: ten tokens per row), or greedy + the logprobs of 5 tokens (`logprobs`). Rows
with controls hold histories of 100-1,024 prompt and 0-512 output tokens.

Each line: kind, setting, batch, vocab, `ms` (median of --reps CUDA-event timings), `agree` (the fraction of rows
whose token equals the torch reference path's on the same logits and seeds: 1.0 but for knife-edge rounding),
`rows_wide` / `rows_search` (rows the first kernel left to the wide kernel / whose bracket missed, finished by the
exact search).
Then one `summary` line per setting, over the kinds at --vocab: the typical time (median over the captured kinds,
else over normal and zipf), the worst kind and its time, worst / typical. --sweep also times the kernels at other
(block, num_warps)."""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from nanovllm_cli.roofline import median_cuda_ms

# name -> (temperature, top_k (0: off), top_p, min_p, controls)
SETTINGS = {
    "greedy": (0.0, 0, 1.0, 0.0, None),
    "temperature": (0.8, 0, 1.0, 0.0, None),
    "top_k": (0.8, 50, 1.0, 0.0, None),
    "top_k_top_p": (0.8, 50, 0.95, 0.0, None),
    "top_p": (0.8, 0, 0.95, 0.0, None),
    "top_p_0.9": (0.7, 0, 0.9, 0.0, None),
    "min_p": (1.0, 0, 1.0, 0.05, None),
    "top_k_1000": (0.8, 1000, 1.0, 0.0, None),
    "penalties": (1.0, 0, 1.0, 0.05, dict(repetition_penalty=1.1)),
    "presence_frequency": (0.8, 0, 1.0, 0.0, dict(presence_penalty=0.5, frequency_penalty=0.3)),
    "logit_bias": (0.8, 0, 1.0, 0.0, "bias"),
    "logprobs": (0.0, 0, 1.0, 0.0, "logprobs"),
}
SYNTHETIC = ["normal", "zipf", "equal", "ties_bf16", "peaked", "flat", "huge", "few_finite"]
SWEEP = [(4096, 8), (4096, 16), (8192, 16), (2048, 8)]


def logits_of_kind(kind: str, rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """float32 [rows, vocab] of one kind (the CPU tests sample the same kinds against the torch path)."""
    shape = (rows, vocab)
    if kind == "normal":
        return torch.randn(shape, generator=generator) * 3
    if kind == "equal":  # every token tied: the noise alone decides, every filter keeps the whole row
        return torch.full(shape, 1.5)
    if kind == "ties_bf16":  # few distinct values: hundreds tied at every threshold, the top 600 tied
        logits = torch.randint(-6, 6, shape, generator=generator).float()
        logits[:, torch.randperm(vocab, generator=generator)[:600]] = 6.0
        return logits
    if kind == "peaked":  # one token holds almost all the mass
        logits = torch.randn(shape, generator=generator)
        logits[:, 7] = 40.0
        return logits
    if kind == "flat":  # random weights: every token about as likely
        return torch.randn(shape, generator=generator) * 0.02
    if kind == "huge":  # magnitudes near the float range: x * inv_t overflows, exp underflows
        return (torch.rand(shape, generator=generator) * 2 - 1) * 3e38
    if kind == "few_finite":  # logit controls or a grammar left 1 to 40 tokens
        logits = torch.full(shape, float("-inf"))
        for row in range(rows):
            finite = torch.randperm(vocab, generator=generator)[:1 + row % 40]
            logits[row, finite] = torch.randn(len(finite), generator=generator)
        return logits
    if kind == "zipf":  # the shape of real decoding: a few likely tokens, a long tail
        ranks = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]).float() + 1
        return -1.1 * torch.log(ranks) + 0.3 * torch.randn(shape, generator=generator)
    raise ValueError(kind)


def kind_dtype(kind: str) -> torch.dtype:
    return torch.float32 if kind in ("huge", "flat") else torch.bfloat16


def mixed_logits(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Rows cycling through every synthetic kind, float32 (it holds them all)."""
    parts = [logits_of_kind(kind, -(-rows // len(SYNTHETIC)), vocab, generator) for kind in SYNTHETIC]
    return torch.stack([parts[i % len(SYNTHETIC)][i // len(SYNTHETIC)] for i in range(rows)])


def batches(args, device: torch.device):
    """(kind, logits [batch, vocab] on the device)."""
    generator = torch.Generator().manual_seed(0)
    for kind in args.kinds:
        if kind == "mixed":
            yield kind, mixed_logits(args.batch, args.vocab, generator).to(device)
        else:
            yield kind, logits_of_kind(kind, args.batch, args.vocab, generator).to(device, kind_dtype(kind))
    for path in sorted(Path(args.captured).glob("*.pt")) if args.captured else ():
        captured = torch.load(path)["logits"]
        rows = captured[torch.arange(args.batch) % len(captured)]
        yield f"captured:{path.stem}", rows.to(device)


class Step:
    """What the runner runs for one setting on one batch: controls, sampling, history update, logprobs."""

    def __init__(self, setting: str, logits: torch.Tensor, modules: dict, generator: np.random.Generator):
        temperature, top_k, top_p, min_p, controls = SETTINGS[setting]
        self.logits, self.modules, self.controls, self.penalty = logits, modules, None, None
        batch, vocab = logits.shape
        device = logits.device
        self.settings = modules["SamplingTensors"](
            temperatures=torch.full((batch,), temperature, device=device),
            top_k=torch.full((batch,), top_k if 0 < top_k < vocab else vocab, dtype=torch.int64, device=device),
            top_p=torch.full((batch,), top_p, device=device), min_p=torch.full((batch,), min_p, device=device),
            seeds=torch.arange(batch, dtype=torch.int64, device=device) * 7919,
            sample_positions=torch.arange(batch, dtype=torch.int64, device=device) % 512,
            all_greedy=temperature == 0, any_filter=top_k > 0 or top_p < 1 or min_p > 0)
        self.logprobs = controls == "logprobs"
        if controls in (None, "logprobs"):
            return
        params = modules["SamplingParams"](**(controls if isinstance(controls, dict) else {}))
        self.controls = modules["LogitControls"](batch, vocab, device, eos_token_ids=[])
        for row in range(batch):
            prompt = generator.integers(0, vocab, generator.integers(100, 1025)).tolist()
            output = generator.integers(0, vocab, generator.integers(0, 513)).tolist()
            if controls == "bias":
                params = modules["SamplingParams"](logit_bias={int(t): 2.0 for t in generator.integers(0, vocab, 10)})
            self.controls.fill(row, params, prompt + output, len(prompt), [])
        host = {name: np.zeros(batch, dtype=dtype) for name, dtype in (
            ("penalty_rows", np.int64), ("penalty_slots", np.int64), ("repetition_penalties", np.float32),
            ("presence_penalties", np.float32), ("frequency_penalties", np.float32))}
        rows = np.arange(batch)
        count = self.controls.stage(host, rows, [True] * batch)
        self.batch_rows = torch.from_numpy(rows).to(device)
        self.penalty = tuple(torch.from_numpy(host[name][:count]).to(device) for name in host) if count else None

    def scores(self) -> torch.Tensor:
        if self.controls is None:
            return self.logits
        return self.controls.apply(self.logits, self.batch_rows, self.settings.sample_positions, self.penalty)

    def __call__(self) -> torch.Tensor:
        sampled = self.modules["sampler"].sample(self.scores(), self.settings)
        if self.penalty is not None:
            self.controls.record(sampled, self.penalty[0], self.penalty[1])
        if self.logprobs:
            self.modules["compute_logprobs"](self.logits, sampled, 5)
        return sampled


def kernel_paths(logits: torch.Tensor, settings, kernels) -> tuple[int, int]:
    """(rows the first kernel left to the wide one, rows whose bracket missed and the exact search finished)."""
    batch, vocab = logits.shape
    slots = kernels.scratch_slots(vocab)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    scratch = torch.empty(batch, slots, dtype=torch.int64, device=logits.device)
    counters = torch.zeros(batch, 4, dtype=torch.int32, device=logits.device)
    args = (logits, logits.stride(0), out, settings.temperatures, settings.top_k, settings.top_p, settings.min_p,
            settings.seeds, settings.sample_positions, scratch, counters, vocab, slots)
    config = dict(BLOCK=kernels.DEFAULT_BLOCK, CHUNK=kernels.CHUNK, PIVOTS=kernels.PIVOTS,
                  num_warps=kernels.DEFAULT_WARPS)
    kernels._sample_kernel[(batch,)](*args, NARROW=min(kernels.NARROW_K, kernels.DEFAULT_BLOCK), **config)
    wide = int((out == kernels.WIDE.value).sum())
    kernels._sample_wide_kernel[(batch,)](*args, SEARCH_PIVOTS=kernels.PIVOTS_SEARCH, SEARCH_CAP=kernels.SEARCH_CAP,
                                          MAX_PASSES=kernels.MAX_PASSES, **config)
    return wide, int((counters[:, 3] == 1).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON lines output path")
    parser.add_argument("--captured", help="directory of scripts/capture_logits.py's files")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--kinds", nargs="+", default=SYNTHETIC + ["mixed"], choices=SYNTHETIC + ["mixed"])
    parser.add_argument("--sweep", action="store_true", help="also time the kernels at other (block, num_warps)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sampler needs a CUDA device")
    from nanovllm import SamplingParams
    from nanovllm.kernels import sampling as kernels
    from nanovllm.layers import sampler
    from nanovllm.layers.logprobs import compute_logprobs
    from nanovllm.runner.inputs import SamplingTensors
    from nanovllm.runner.logit_controls import LogitControls
    modules = dict(sampler=sampler, SamplingParams=SamplingParams, LogitControls=LogitControls,
                   SamplingTensors=SamplingTensors,
                   compute_logprobs=compute_logprobs)
    device = torch.device("cuda")
    sampler.warm_up_sampling(device, args.vocab, torch.bfloat16)  # compile outside the timings
    results: dict[str, dict[str, float]] = {setting: {} for setting in args.settings}
    with open(args.out, "w") as out:
        def emit(record):
            line = json.dumps(record)
            print(line, flush=True)
            out.write(line + "\n")

        emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": importlib.import_module("triton").__version__, "batch": args.batch})
        for kind, logits in batches(args, device):
            for setting in args.settings:
                step = Step(setting, logits, modules, np.random.default_rng(0))
                scores = step.scores()
                agree = (sampler.sample(scores, step.settings) == sampler.reference_sample(scores, step.settings))
                record = {"kind": kind, "setting": setting, "batch": args.batch, "vocab": logits.shape[1],
                          "dtype": str(logits.dtype).removeprefix("torch."), "ms": median_cuda_ms(step, args.reps),
                          "agree": agree.float().mean().item()}
                if not step.settings.all_greedy:
                    record["rows_wide"], record["rows_search"] = kernel_paths(scores, step.settings, kernels)
                emit(record)
                if logits.shape[1] == args.vocab:  # the summary compares kinds at one vocabulary
                    results[setting][kind] = record["ms"]
                for block, num_warps in SWEEP if args.sweep and not step.settings.all_greedy else ():
                    fused = functools.partial(kernels.fused_sample, scores, *(getattr(step.settings, name) for name in (
                        "temperatures", "top_k", "top_p", "min_p", "seeds", "sample_positions")), block=block,
                        num_warps=num_warps)
                    emit({**record, "path": "sweep", "block": block, "num_warps": num_warps,
                          "ms": median_cuda_ms(fused, args.reps)})
        for setting, by_kind in results.items():
            captured = [ms for kind, ms in by_kind.items() if kind.startswith("captured:")]
            typical = statistics.median(captured or [by_kind[k] for k in ("normal", "zipf") if k in by_kind]
                                        or list(by_kind.values()))
            worst = max(by_kind, key=by_kind.get)
            emit({"summary": setting, "batch": args.batch, "typical_ms": typical, "worst_kind": worst,
                  "worst_ms": by_kind[worst], "worst_over_typical": by_kind[worst] / typical})


if __name__ == "__main__":
    main()
