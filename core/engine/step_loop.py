from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import EngineStats
from nanovllm.step_types import ScheduledBatch, StepHandle, StepRunner

if TYPE_CHECKING:
    from nanovllm.structured import GrammarManager, StepGrammars


@dataclass
class LaunchedStep:
    """A step on the device: its batch, and either its handle (sampling launched) or, for a step with constrained
    rows (`grammars`), its launched forward, whose sampling waits for the mask (`handle` None until then)."""

    batch: ScheduledBatch
    handle: StepHandle | None
    forward: Any
    grammars: StepGrammars | None
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

    A step with structured-output rows is launched in two halves: the forward, then the mask and sampling. The
    mask of a row depends on every earlier token of it: as soon as a step's tokens reach the host, the grammar
    manager accepts them and fills the next step's lines on its worker thread, while this thread postprocesses
    the step (and, in the sync loop, schedules and launches the next forward); the second half waits for that
    work. In the async loop the step in flight is finished between the halves, so the device runs the forward
    meanwhile. Steps without such rows are launched whole (docs/STRUCTURED_OUTPUTS.md)."""

    def __init__(self, scheduler: Scheduler, runner: StepRunner, stats: EngineStats, overlap: bool,
                 grammars: GrammarManager | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.grammars = grammars
        self.stats = stats
        self.overlap = overlap
        self.in_flight: LaunchedStep | None = None

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> list[Sequence]:
        """One iteration; returns the sequences that finished in it. The last in-flight step drains on the
        iteration after the scheduler runs dry."""
        batch, schedule_s = self._schedule()
        launched = self._launch(batch, schedule_s) if batch else None
        # Requests finished while scheduling (a constraint that failed its compile) leave with a step's
        # postprocess; with no step scheduled, nothing else would take them.
        finished: list[Sequence] = self.scheduler.take_finished() if launched is None else []
        if launched is not None and launched.handle is None:
            if self.in_flight is not None:  # its tokens are what this step's masks depend on
                finished += self._finish(self.in_flight)
                self.in_flight = None
            self._fill_masks_and_sample(launched)
        if self.overlap:
            previous, self.in_flight = self.in_flight, launched
        else:
            previous = launched
        if previous is not None:
            finished += self._finish(previous)
        return finished

    def abort_all(self) -> list[Sequence]:
        """Forget the step in flight (its tokens are never committed) and drop every unfinished sequence."""
        self.in_flight = None
        return self.scheduler.abort_all()

    def _schedule(self) -> tuple[ScheduledBatch | None, float]:
        started = time.perf_counter()
        preemptions_before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        self.stats.preemptions += self.scheduler.num_preemptions - preemptions_before
        if not batch and self.in_flight is None:  # only constraints still compiling could be waiting: no spinning
            self.scheduler.wait_for_compile()
        return batch or None, time.perf_counter() - started

    def _launch(self, batch: ScheduledBatch, schedule_s: float) -> LaunchedStep:
        """Prepare the step's inputs and launch it: whole, or only its forward when it has constrained rows."""
        started = time.perf_counter()
        inputs = self.runner.prepare(batch)
        prepared = time.perf_counter()
        grammars = (self.grammars.plan(batch.seqs, batch.samples, batch.epochs) if self.grammars is not None
                    else None)
        if grammars is not None:
            handle, forward = None, self.runner.launch_forward(inputs)
        else:
            handle, forward = self.runner.execute(inputs), None
        return LaunchedStep(batch, handle, forward, grammars, schedule_s, prepared - started,
                            time.perf_counter() - prepared)

    def _fill_masks_and_sample(self, step: LaunchedStep) -> None:
        """The second half of a step with constrained rows: its mask (the grammar manager's lines, once every
        earlier token is accepted), then sampling."""
        started = time.perf_counter()
        step.handle = self.runner.launch_sample(step.forward, self.grammars.step_mask(step.grammars))
        step.forward = None
        step.execute_s += time.perf_counter() - started

    def _finish(self, step: LaunchedStep) -> list[Sequence]:
        """Wait for a step's tokens and postprocess it; returns the sequences that finished."""
        started = time.perf_counter()
        tokens, device_s = self.runner.wait(step.handle)
        if step.grammars is not None:  # the grammars take these tokens on a worker while this thread postprocesses
            self.grammars.start_accepts(step.grammars, tokens)
        waited = time.perf_counter()
        self.scheduler.postprocess(step.batch, tokens, step.handle.logprobs)
        finished = self.scheduler.take_finished()
        batch = step.batch
        self.stats.record_step(
            schedule_s=step.schedule_s, prepare_s=step.prepare_s, execute_s=step.execute_s,
            wait_s=waited - started, postprocess_s=time.perf_counter() - waited, device_s=device_s,
            prefill_tokens=batch.num_prefill_tokens, decode_tokens=batch.num_tokens - batch.num_prefill_tokens,
            batch_size=len(batch), graph=step.handle.graph)
        return finished
