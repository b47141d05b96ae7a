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
    the order they were launched. Both orders use the same scheduler, runner and postprocess.

    A step with structured-output rows is launched in two halves: the forward, then (once the matchers have
    accepted every earlier step's token) the masks are filled and sampling is launched. The accepts run between
    the halves, while the device runs the forward: postprocess defers those of the rows that go on, and the async
    loop also completes the step in flight there. Steps without such rows are launched whole, as before
    (docs/STRUCTURED_OUTPUTS.md)."""

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
        finished: list[Sequence] = []
        launched = self._launch(finished)
        if self.overlap:
            done, self.in_flight = self.in_flight, launched
        else:
            done = launched
        return finished + self._complete(done) if done else finished

    def abort_all(self) -> list[Sequence]:
        """Forget the step in flight (its tokens are never committed) and drop every unfinished sequence."""
        self.in_flight = None
        return self.scheduler.abort_all()

    def _launch(self, finished: list[Sequence]) -> LaunchedStep | None:
        """Schedule, prepare and launch a step; a step completed on the way (see the class) adds its finished
        sequences to `finished`."""
        t0 = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        self.stats.preemptions += self.scheduler.num_preemptions - preemptions_before
        t1 = time.perf_counter()
        if not batch:
            # Requests finished while scheduling (a constraint that failed its compile) leave with this step: no
            # step's postprocess would take them.
            finished += self.scheduler.take_finished()
            if self.in_flight is None:  # only constraints still compiling could be waiting: no spinning
                self.scheduler.wait_for_compile()
            return None
        inputs = self.runner.prepare(batch)
        t2 = time.perf_counter()
        if not batch.grammars:
            handle = self.runner.execute(inputs)
            t3 = time.perf_counter()
            return LaunchedStep(batch, handle, t1 - t0, t2 - t1, t3 - t2)
        forward = self.runner.launch_forward(inputs)
        forward_s = time.perf_counter() - t2
        if self.in_flight is not None:  # its tokens are what the masks of this step depend on
            finished += self._complete(self.in_flight)
            self.in_flight = None
        t3 = time.perf_counter()
        self.scheduler.accept_deferred()
        handle = self.runner.launch_sample(forward, self.runner.fill_masks(batch))
        return LaunchedStep(batch, handle, t1 - t0, t2 - t1, forward_s + time.perf_counter() - t3)

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
