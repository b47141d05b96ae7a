"""Honest timing (docs/ARCHITECTURE.md): host phases by the host clock, device time by CUDA events on the executing stream,
throughput over the wall clock of the steps — never over an interval that leaves out device work.

Every step is also kept as one entry of a `StepTrace` (compact arrays), from which come the steps by kind
(decode only, mixed, prefill only), eager against graph-replayed steps, the batch's occupancy and the time series
that `nanovllm bench --plot` draws."""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import numpy as np

STEP_KINDS = ("decode_only", "mixed", "prefill_only")


@dataclass
class StepTrace:
    """One entry per completed step, in completion order: when it completed (host clock), its rows (decoding
    and prefilling), its prompt tokens, its decoding rows (one token each), its device time (NaN where none is
    measured: the CPU) and whether it replayed a CUDA graph."""

    ended_at: array = field(default_factory=lambda: array("d"))
    rows: array = field(default_factory=lambda: array("q"))
    prefill_tokens: array = field(default_factory=lambda: array("q"))
    decode_rows: array = field(default_factory=lambda: array("q"))
    device_s: array = field(default_factory=lambda: array("d"))
    graph: array = field(default_factory=lambda: array("b"))

    def append(self, ended_at: float, rows: int, prefill_tokens: int, decode_rows: int, device_s: float | None,
               graph: bool) -> None:
        self.ended_at.append(ended_at)
        self.rows.append(rows)
        self.prefill_tokens.append(prefill_tokens)
        self.decode_rows.append(decode_rows)
        self.device_s.append(np.nan if device_s is None else device_s)
        self.graph.append(graph)

    def __len__(self) -> int:
        return len(self.rows)

    def kinds(self) -> np.ndarray:
        """Each step's index into STEP_KINDS: decode only (no prompt token), prefill only (no decoding row), or
        mixed (both)."""
        prefill = np.array(self.prefill_tokens, dtype=np.int64) > 0
        decode = np.array(self.decode_rows, dtype=np.int64) > 0
        return np.where(~prefill, 0, np.where(decode, 1, 2))

    def step_seconds(self, started_at: float | None) -> np.ndarray:
        """Each step's time: its device time where measured, else the host time since the previous step
        completed (the first one: since `started_at`)."""
        ended = np.array(self.ended_at, dtype=np.float64)
        device = np.array(self.device_s, dtype=np.float64)
        if not len(ended) or not np.isnan(device).any():
            return device
        return np.diff(ended, prepend=ended[0] if started_at is None else started_at)


def step_counts(trace: StepTrace) -> dict:
    """Steps by kind and eager against graph-replayed."""
    kinds = np.bincount(trace.kinds(), minlength=len(STEP_KINDS))
    graphs = int(np.count_nonzero(np.array(trace.graph, dtype=np.int8)))
    return {**{f"steps_{kind}": int(n) for kind, n in zip(STEP_KINDS, kinds)},
            "steps_graph": graphs, "steps_eager": len(trace) - graphs}


def batch_occupancy(trace: StepTrace, batch_limit: int, started_at: float | None) -> dict:
    """How full the batch of `batch_limit` rows was: the mean rows of a step (decoding and prefilling), the share
    of the decoding steps (decode only or mixed) that ran the full batch, and the tail: the steps after the last
    one with at least half the batch, and the time they took (from the end of that step to the end of the last;
    the whole run when no step reached half)."""
    rows = np.array(trace.rows, dtype=np.int64)
    if not len(rows):
        return {"mean_running_rows": None, "full_batch_decode_share": None, "tail_below_half_steps": None,
                "tail_below_half_s": None}
    ended = np.array(trace.ended_at, dtype=np.float64)
    decoding = np.array(trace.decode_rows, dtype=np.int64) > 0
    at_half = np.flatnonzero(2 * rows >= batch_limit)
    if len(at_half):
        tail_steps, tail_s = len(rows) - 1 - int(at_half[-1]), float(ended[-1] - ended[at_half[-1]])
    else:
        tail_steps, tail_s = len(rows), float(ended[-1] - (started_at if started_at is not None else ended[0]))
    return {"mean_running_rows": float(rows.mean()),
            "full_batch_decode_share": float((rows[decoding] >= batch_limit).mean()) if decoding.any() else None,
            "tail_below_half_steps": tail_steps, "tail_below_half_s": tail_s}


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
    trace: StepTrace = field(default_factory=StepTrace)

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
                    batch_size: int, graph: bool = False) -> None:
        """A step completed now: its host phases, device time, tokens (a decoding row has one decode token),
        rows, and whether it replayed a CUDA graph."""
        self.trace.append(time.perf_counter(), batch_size, prefill_tokens, decode_tokens, device_s, graph)
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

    def occupancy(self, batch_limit: int) -> dict:
        """`batch_occupancy` of the steps so far against a batch of `batch_limit` rows (the engine's max_num_seqs)."""
        return batch_occupancy(self.trace, batch_limit, self.started_at)

    def timeline(self) -> dict[str, np.ndarray]:
        """The steps as arrays (a plot's data): "t" (each step's end, seconds from the first step's start),
        "rows", "decode_rows", "prefill_tokens", "kind" (index into STEP_KINDS), "step_s" (`StepTrace.step_seconds`)
        and "graph"."""
        trace = self.trace
        ended = np.array(trace.ended_at, dtype=np.float64)
        origin = self.started_at if self.started_at is not None else (ended[0] if len(ended) else 0.0)
        return {"t": ended - origin, "rows": np.array(trace.rows, dtype=np.int64),
                "decode_rows": np.array(trace.decode_rows, dtype=np.int64),
                "prefill_tokens": np.array(trace.prefill_tokens, dtype=np.int64),
                "kind": trace.kinds(), "step_s": trace.step_seconds(self.started_at),
                "graph": np.array(trace.graph, dtype=np.int8).astype(bool)}

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
            **step_counts(self.trace),
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
