"""Honest timing (docs/ARCHITECTURE.md): host phases by the host clock, device time by CUDA events on the executing stream,
throughput over the wall clock of the steps — never over an interval that leaves out device work."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class EngineStats:
    device: str  # "cuda" or "cpu"; on the CPU the device is the CPU and no GPU figure exists
    overlap: bool  # the async loop overlaps host and device work
    steps: int = 0
    decode_steps: int = 0
    # The measured interval: from the start of the first step to the end of the last one, on the host clock. It
    # includes whatever the caller does between steps (writing results, a progress bar): the device keeps working
    # then in the async loop, so an interval without it would credit the device with time it was not measured in.
    started_at: float | None = None
    ended_at: float | None = None
    schedule_s: float = 0.0
    prepare_s: float = 0.0  # input building and host-to-device copies
    execute_s: float = 0.0  # host time inside the launch (on the CPU: the whole forward and sampling)
    wait_s: float = 0.0  # host blocked on the device's sampled ids
    postprocess_s: float = 0.0  # commit tokens, stop checks, stop-string detokenization
    detokenize_s: float = 0.0  # final text of finished requests
    device_s: float | None = None  # sum of device step times (CUDA events); None on the CPU
    prefill_tokens: int = 0
    decode_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    preemptions: int = 0
    decode_host_s: list[tuple[int, float]] = field(default_factory=list)  # (batch size, schedule + prepare)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.ended_at - self.started_at if self.started_at is not None else 0.0

    def record_interval(self, started: float, ended: float) -> None:
        """One engine step ran from `started` to `ended` (host clock)."""
        if self.started_at is None:
            self.started_at = started
        self.ended_at = ended

    def record_step(self, *, schedule_s: float, prepare_s: float, execute_s: float, wait_s: float,
                    postprocess_s: float, device_s: float | None, prefill_tokens: int, decode_tokens: int,
                    batch_size: int) -> None:
        self.steps += 1
        self.schedule_s += schedule_s
        self.prepare_s += prepare_s
        self.execute_s += execute_s
        self.wait_s += wait_s
        self.postprocess_s += postprocess_s
        if device_s is not None:
            self.device_s = (self.device_s or 0.0) + device_s
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        if batch_size and prefill_tokens == 0:
            self.decode_steps += 1
            self.decode_host_s.append((batch_size, schedule_s + prepare_s))

    def record_finished(self, num_prompt_tokens: int, num_output_tokens: int, arrival: float,
                        first_token: float | None, finish: float) -> None:
        self.requests += 1
        self.prompt_tokens += num_prompt_tokens
        self.output_tokens += num_output_tokens
        if first_token is not None:
            self.ttft_s.append(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot_s.append((finish - first_token) / (num_output_tokens - 1))

    def summary(self) -> dict:
        wall = self.wall_s

        def share(x: float) -> float | None:
            return x / wall if wall else None

        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        on_gpu = self.device == "cuda"
        host_per_decode = [t for _, t in self.decode_host_s]
        largest_batch = max((b for b, _ in self.decode_host_s), default=None)
        return {
            "device": self.device,
            "loop": "async" if self.overlap else "sync",
            "overlap": self.overlap and on_gpu,  # on the CPU the async loop runs but cannot overlap anything
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "preemptions": self.preemptions,
            "wall_s": wall,
            "output_tok_s": self.output_tokens / wall if wall else None,
            "total_tok_s": (self.prefill_tokens + self.decode_tokens) / wall if wall else None,
            "prefill_tok_s": self.prefill_tokens / wall if wall else None,
            "cpu_schedule_s": self.schedule_s,
            "cpu_prepare_s": self.prepare_s,
            "cpu_execute_s": self.execute_s,
            "cpu_wait_s": self.wait_s,
            "cpu_postprocess_s": self.postprocess_s + self.detokenize_s,
            "cpu_schedule_share": share(self.schedule_s),
            "cpu_prepare_share": share(self.prepare_s),
            "cpu_postprocess_share": share(self.postprocess_s + self.detokenize_s),
            "gpu_busy_s": self.device_s if on_gpu else None,
            "gpu_busy_frac": share(self.device_s) if on_gpu and self.device_s is not None else None,
            "gpu_idle_frac": 1 - share(self.device_s) if on_gpu and self.device_s is not None and wall else None,
            "host_ms_per_decode_step": 1000 * float(np.mean(host_per_decode)) if host_per_decode else None,
            # schedule + prepare of the decode steps at the largest batch (the full one, where it is costliest)
            "largest_decode_batch": largest_batch,
            "host_ms_per_largest_decode_step": 1000 * float(np.median(
                [t for b, t in self.decode_host_s if b == largest_batch])) if host_per_decode else None,
            "ttft_p50_s": pct(self.ttft_s, 50),
            "ttft_p99_s": pct(self.ttft_s, 99),
            "tpot_p50_s": pct(self.tpot_s, 50),
            "tpot_p99_s": pct(self.tpot_s, 99),
        }
