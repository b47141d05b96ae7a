"""The streaming job: rows in through a bounded window, requests into the engine, records out as they finish.

Memory stays bounded whatever the input size: at most `window` tokenized rows wait for admission and at most
`max_num_seqs` requests are in the engine; beyond that only the set of ids met so far is kept (for resume and
duplicate checks). `BatchRunner` reads, checks and tokenizes the rows and writes every record; an `EngineFeeder`
drives one engine through its request-level API only (`add_request`, `step`, `has_unfinished_requests`). With
data parallelism (`replicas.ReplicaPool`) the same BatchRunner feeds several replica processes, each running an
EngineFeeder.

A step that fails aborts every request in the engine (StepFailedError). The feeder reruns the rows that were in
it in halves, alone in the engine, until the row that makes a step fail is alone in one: only that row gets an
error record. An engine that cannot run any more ends the job (EngineStepError).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

from nanovllm import LLM, PromptTokenizer, RequestOutput, SamplingParams, StepFailedError
from nanovllm_cli.admission import PrefixGroup, admission_groups
from nanovllm_cli.records import RecordBuilder
from nanovllm_cli.rows import RowError, RowRequest
from nanovllm_cli.tokenize import tokenize_row
from nanovllm_cli.writers import Writer


@dataclass(frozen=True)
class RowFailure:
    """Why the engine gave a row no output: 400 for a row it refused (too long), 500 for one it failed on."""

    message: str
    status_code: int


# A finished row: the engine's output, or why there is none.
Finished = tuple[RowRequest, RequestOutput | RowFailure]


@dataclass
class RunStats:
    rows_total: int  # rows in the input
    rows_skipped: int = 0  # already in OUTPUT (--resume)
    rows_ok: int = 0
    rows_failed: int = 0
    prompt_tokens: int = 0  # of the rows answered
    cached_tokens: int = 0  # of those, served by the prefix cache
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None

    @property
    def rows_done(self) -> int:
        """Rows answered or failed in this run."""
        return self.rows_ok + self.rows_failed

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    def add_result(self, output: RequestOutput) -> None:
        self.rows_ok += 1
        self.prompt_tokens += output.num_prompt_tokens
        self.cached_tokens += output.num_cached_tokens
        self.completion_tokens += len(output.token_ids)


class JobFailed(Exception):
    """The job cannot go on (exit 3); the message says why. What is written stays; --resume finishes the job."""


class EngineStepError(JobFailed):
    """The engine failed in a step and cannot run any more: the rows in it have error records."""


class EngineFailure(Exception):
    """Raised by an engine driver when a step failed: `requests` were in it and get error records saying
    `problem`; `message` is the job's error."""

    def __init__(self, message: str, problem: str, requests: list[RowRequest]):
        super().__init__(message)
        self.problem = problem
        self.requests = requests


class Engine(Protocol):
    """What BatchRunner drives: one engine in this process (`EngineFeeder`) or replicas (`replicas.ReplicaPool`)."""

    block_size: int
    prompts: PromptTokenizer

    def wants_rows(self) -> bool: ...  # room for another window of rows
    def add(self, groups: list[PrefixGroup]) -> None: ...
    def idle(self) -> bool: ...  # nothing added is unfinished
    def step(self) -> list[Finished]: ...  # advance; the rows that finished (raises EngineFailure)


class EngineFeeder:
    """Feeds prefix groups into one engine: at most `max_num_seqs` requests in it, a group's followers one step
    after its leader (so they hit the leader's cached prefix blocks), one engine step per `step()`.
    `on_admit(ids)`: called with the ids that entered the engine, before the step that first runs them (a
    replica tells its parent which rows a crash in that step would take down)."""

    def __init__(self, llm: LLM, on_admit: Callable[[list[str]], None] | None = None):
        self.llm = llm
        self.on_admit = on_admit
        info = llm.info
        self.max_in_flight = info.max_num_seqs
        self.block_size = info.block_size
        self.prompts = llm.prompts
        self.groups: list[PrefixGroup] = []
        self.in_flight: dict[str, RowRequest] = {}
        self.round = 0
        # Rows of failed steps, in groups to rerun alone (the last group next); see the module docstring.
        self.suspects: list[list[RowRequest]] = []
        self.isolating = False  # the rows in flight are a group of suspects

    def wants_rows(self) -> bool:
        return not self.groups

    def add(self, groups: list[PrefixGroup]) -> None:
        self.groups.extend(groups)

    def idle(self) -> bool:
        return not self.groups and not self.in_flight and not self.suspects

    def withdraw(self, most: int) -> list[list[RowRequest]]:
        """Give back up to about `most` queued rows: whole prefix groups of which no row entered the engine, the
        newest first (a replica hands them to an idle one)."""
        taken: list[PrefixGroup] = []
        for group in reversed(self.groups):
            if sum(len(g.requests) for g in taken) >= most:
                break
            if group.leader_round is None:
                taken.append(group)
        self.groups = [g for g in self.groups if all(g is not t for t in taken)]
        return [list(group.requests) for group in reversed(taken)]

    def step(self) -> list[Finished]:
        before = len(self.in_flight)
        finished = self._admit_suspects() if self.suspects or self.isolating else self._admit()
        if not self.in_flight:
            return finished
        if self.on_admit is not None and len(self.in_flight) > before:
            self.on_admit(list(self.in_flight)[before:])  # dicts keep insertion order: the rows just submitted
        try:
            outputs = self.llm.step()
        except StepFailedError as exc:
            if not exc.engine_usable:
                self._raise_failure(exc.__cause__ or exc)
            return finished + self._suspect_in_flight(exc)
        except Exception as exc:  # noqa: BLE001 (whatever it was, the rows in flight get records saying so)
            self._raise_failure(exc)
        finished += [(self.in_flight.pop(output.request_id), output) for output in outputs]
        if self.in_flight and not self.llm.has_unfinished_requests():
            # The engine is idle yet requests are unanswered: answer them with errors rather than wait forever.
            finished += [(request, RowFailure("the engine returned no result", 500))
                         for request in self.in_flight.values()]
            self.in_flight.clear()
        return finished

    def _raise_failure(self, exc: BaseException) -> NoReturn:
        """The engine cannot run any more: the rows in it, and those waiting to be rerun, get error records."""
        failed = list(self.in_flight.values()) + [request for group in self.suspects for request in group]
        self.in_flight.clear()
        self.suspects.clear()
        names = ", ".join(f"{r.where} (id {r.id!r})" for r in failed[:5]) + (" ..." if len(failed) > 5 else "")
        raise EngineFailure(
            f"the engine failed in a step running {names}: {type(exc).__name__}: {exc}; those rows have error "
            "records (rerun them with --retry-failed)",
            f"the engine failed while running this row (with {len(failed)} rows in its step): "
            f"{type(exc).__name__}: {exc}", failed) from exc

    def _suspect_in_flight(self, failure: StepFailedError) -> list[Finished]:
        """The engine aborted every request in it: rerun the rows in halves, or fail the row that was alone."""
        rows = list(self.in_flight.values())
        self.in_flight.clear()
        self.isolating = False
        if len(rows) == 1:
            cause = failure.__cause__ or failure
            return [(rows[0], RowFailure(f"the engine failed on this row alone: {type(cause).__name__}: {cause}",
                                         500))]
        half = len(rows) // 2
        self.suspects += [rows[half:], rows[:half]]
        return []

    def _admit_suspects(self) -> list[Finished]:
        """With nothing else in the engine, submit the next group of suspects whole."""
        refused: list[Finished] = []
        if self.in_flight:
            return refused
        self.isolating = bool(self.suspects)
        if self.suspects:
            for request in self.suspects.pop():
                self._submit(request, refused)
        return refused

    def _admit(self) -> list[Finished]:
        """Move requests into the engine up to `max_in_flight`; returns the requests the engine refused."""
        self.round += 1
        refused: list[Finished] = []
        for group in self.groups:
            while group.requests and len(self.in_flight) < self.max_in_flight:
                if group.leader_round == self.round:
                    break  # the followers wait one step for the leader's prefix blocks
                if self._submit(group.requests.popleft(), refused) and group.leader_round is None:
                    group.leader_round = self.round
        self.groups = [g for g in self.groups if g.requests]
        return refused

    def _submit(self, request: RowRequest, refused: list[Finished]) -> bool:
        try:
            if isinstance(request.payload, tuple):  # a score row (pooling_rows.py): a query and its documents
                self.llm.add_score_request(*request.payload, request_id=request.id, params=request.params)
            elif request.choices is not None:  # a row whose choices are scored (choices.py)
                self.llm.add_choices_request(None, request.choices, request.id, prompt_token_ids=request.token_ids)
            else:
                self.llm.add_request(None, request.params, request_id=request.id, prompt_token_ids=request.token_ids,
                                     lora_request=request.lora_request)
        except ValueError as exc:  # too long for max_model_len or for the whole KV cache, or an unusable adapter
            refused.append((request, RowFailure(str(exc), 400)))
            return False
        self.in_flight[request.id] = request
        return True


class RecordList:
    """A writer keeping the records in memory (a batch or part of rows, written out whole by the caller)."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def sync_if_due(self) -> None:
        pass


class BatchRunner:
    def __init__(self, engine: Engine, writer: Writer, records: RecordBuilder, stats: RunStats, *, window: int,
                 reorder: bool, skip_ids: set[str], on_step: Callable[[], None],
                 on_error: Callable[[str], None] = lambda message: None):
        self.engine = engine
        self.writer = writer
        self.records = records
        self.stats = stats
        self.window = window
        self.reorder = reorder
        self.skip_ids = skip_ids
        self.on_step = on_step
        self.on_error = on_error  # a row's error message, as its record is written
        self.seen: set[str] = set()
        self.rows_read = 0  # rows taken from the input (skipped and bad ones included)
        self.open: dict[str, int] = {}  # rows read and not yet answered -> their max_tokens

    def output_tokens_left(self, per_row: float, default_max_tokens: int) -> float:
        """The output tokens the unanswered rows will still produce, each at `per_row` (the mean of the rows
        answered) but never more than its max_tokens; rows not read yet at most `default_max_tokens` each. Less
        what the rows in the engine already produced is what remains (the caller knows that)."""
        unread = max(self.stats.rows_total - self.rows_read, 0)
        return sum(min(per_row, most) for most in self.open.values()) + unread * min(per_row, default_max_tokens)

    def run(self, rows: Iterable[RowRequest | RowError]) -> None:
        rows = iter(rows)
        exhausted = False
        while True:
            if not exhausted and self.engine.wants_rows():
                window, exhausted = self._read_window(rows)
                self.engine.add(admission_groups(window, self.reorder, self.engine.block_size))
                continue
            if self.engine.idle():
                return
            try:
                finished = self.engine.step()
            except EngineFailure as failure:
                for request in failure.requests:
                    self._write_error(RowError(request.id, request.where, failure.problem, request.endpoint,
                                               request.extra),
                                      len(request.token_ids), status_code=500)
                raise EngineStepError(str(failure)) from failure
            for request, result in finished:
                self.open.pop(request.id, None)
                if isinstance(result, RowFailure):
                    self._write_error(RowError(request.id, request.where, result.message, request.endpoint,
                                               request.extra),
                                      len(request.token_ids), result.status_code)
                else:
                    self._write_result(request, result)
            self.writer.sync_if_due()
            self.on_step()

    def _read_window(self, rows: Iterator[RowRequest | RowError]) -> tuple[list[RowRequest], bool]:
        """Up to `window` tokenized rows; skipped and bad rows are dealt with on the way. True: input exhausted."""
        requests: list[RowRequest] = []
        for row in rows:
            self.rows_read += 1
            if row.id in self.skip_ids:
                self.stats.rows_skipped += 1
                continue
            if row.id in self.seen:
                self._write_error(RowError(row.id, row.where, f"duplicate id {row.id!r}: an earlier row has it",
                                           row.endpoint, row.extra))
                continue
            self.seen.add(row.id)
            if isinstance(row, RowRequest):
                row = tokenize_row(row, self.engine.prompts)
            if isinstance(row, RowError):
                self._write_error(row)
                continue
            requests.append(row)
            self.open[row.id] = row.params.max_tokens if isinstance(row.params, SamplingParams) else 0  # pooling: 0
            if len(requests) == self.window:
                return requests, False
        return requests, True

    def _write_result(self, request: RowRequest, output: RequestOutput) -> None:
        record = self.records.result(request, output)
        self.writer.write(record)
        if output.error:
            self._count_failure(f"{request.where}: {output.error}")
        elif record["error"] is not None:  # a result OUTPUT cannot hold (pooling_records.py)
            self._count_failure(record["error"])
        else:
            self.stats.add_result(output)

    def _write_error(self, error: RowError, prompt_tokens: int = 0, status_code: int = 400) -> None:
        self.writer.write(self.records.error(error, prompt_tokens, status_code))
        self._count_failure(error.message)

    def _count_failure(self, message: str) -> None:
        self.stats.rows_failed += 1
        self.on_error(message)
