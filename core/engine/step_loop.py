from __future__ import annotations

import time
from dataclasses import dataclass

from nanovllm.batch import ScheduledBatch
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import EngineStats
from nanovllm.runner.inputs import StepHandle
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.tp_workers import TPRunner


@dataclass
class LaunchedStep:
    batch: ScheduledBatch
    handle: StepHandle
    schedule_s: float
    prepare_s: float
    execute_s: float


class StepLoop:
    """The only place that orders schedule -> execute -> postprocess (docs/ARCHITECTURE.md).

    Sync: each step is scheduled, launched, awaited and postprocessed before the next one.
    Async (`overlap`): step N+1 is scheduled and launched before step N's tokens are awaited, so the host
    postprocesses N and prepares N+2 while the device runs N+1. The scheduler plans from committed + in-flight
    state, in-flight decodes feed their sampled ids to the next step on the device, and steps are committed in
    the order they were launched. Both orders use the same scheduler, runner and postprocess."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner | TPRunner, stats: EngineStats, overlap: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.stats = stats
        self.overlap = overlap
        self.in_flight: LaunchedStep | None = None

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> list[Sequence]:
        """One iteration; returns the sequences that finished in it. The last in-flight step drains on the
        iteration after the scheduler runs dry."""
        launched = self._launch()
        if self.overlap:
            done, self.in_flight = self.in_flight, launched
        else:
            done = launched
        return self._complete(done) if done else []

    def _launch(self) -> LaunchedStep | None:
        t0 = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        self.stats.preemptions += self.scheduler.num_preemptions - preemptions_before
        t1 = time.perf_counter()
        if not batch:
            return None
        inputs = self.runner.prepare(batch)
        t2 = time.perf_counter()
        handle = self.runner.execute(inputs)
        t3 = time.perf_counter()
        return LaunchedStep(batch, handle, t1 - t0, t2 - t1, t3 - t2)

    def _complete(self, step: LaunchedStep) -> list[Sequence]:
        t0 = time.perf_counter()
        tokens, device_s = self.runner.wait(step.handle)
        t1 = time.perf_counter()
        self.scheduler.postprocess(step.batch, tokens, step.handle.logprobs)
        finished = self.scheduler.take_finished()
        t2 = time.perf_counter()
        batch = step.batch
        self.stats.record_step(
            schedule_s=step.schedule_s, prepare_s=step.prepare_s, execute_s=step.execute_s,
            wait_s=t1 - t0, postprocess_s=t2 - t1, device_s=device_s, prefill_tokens=batch.num_prefill_tokens,
            decode_tokens=batch.num_tokens - batch.num_prefill_tokens, batch_size=len(batch))
        return finished
