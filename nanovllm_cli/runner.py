"""The streaming loop: rows in through a bounded window, requests into the engine, records out as they finish.

Memory stays bounded whatever the input size: at most `window` tokenized rows wait for admission and at most
`max_num_seqs` requests are in the engine; beyond that only the set of ids met so far is kept (for resume and
duplicate checks). The engine is driven through its request-level API only: `add_request`, `step`,
`has_unfinished_requests`.

A step that fails aborts every request in the engine (StepFailedError). The rows that were in it are rerun in
halves, alone in the engine, until the row that makes a step fail is alone in one: only that row gets an error
record. An engine that cannot run any more ends the job (EngineStepError).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn

from nanovllm import LLM, RequestOutput, StepFailedError
from nanovllm_cli.admission import PrefixGroup, admission_groups
from nanovllm_cli.records import RecordBuilder
from nanovllm_cli.rows import RowError, RowRequest
from nanovllm_cli.tokenize import tokenize_row
from nanovllm_cli.writers import Writer


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


class EngineStepError(Exception):
    """The engine failed in a step and cannot run any more: the rows in it have error records."""


class BatchRunner:
    def __init__(self, llm: LLM, writer: Writer, records: RecordBuilder, stats: RunStats, *, window: int,
                 reorder: bool, skip_ids: set[str], on_step: Callable[[], None],
                 on_error: Callable[[str], None] = lambda message: None):
        self.llm = llm
        self.writer = writer
        self.records = records
        self.stats = stats
        self.window = window
        self.reorder = reorder
        self.skip_ids = skip_ids
        self.on_step = on_step
        self.on_error = on_error  # a row's error message, as its record is written
        info = llm.info
        self.max_in_flight = info.max_num_seqs
        self.block_size = info.block_size
        self.seen: set[str] = set()
        self.in_flight: dict[str, RowRequest] = {}
        self.round = 0
        # Rows of failed steps, in groups to rerun alone (the last group next); see the module docstring.
        self.suspects: list[list[RowRequest]] = []
        self.isolating = False  # the rows in flight are a group of suspects

    def run(self, rows: Iterable[RowRequest | RowError]) -> None:
        rows = iter(rows)
        groups: list[PrefixGroup] = []
        exhausted = False
        while True:
            if not groups and not exhausted:
                window, exhausted = self._read_window(rows)
                groups = admission_groups(window, self.reorder, self.block_size)
            if self.suspects or self.isolating:
                self._admit_suspects()
            else:
                groups = self._admit(groups)
            if not self.in_flight:
                if exhausted and not groups and not self.suspects:
                    return
                continue
            for output in self._step():
                self._write_result(self.in_flight.pop(output.request_id), output)
            if self.in_flight and not self.llm.has_unfinished_requests():
                self._fail_lost_requests()
            self.writer.sync_if_due()
            self.on_step()

    def _step(self) -> list[RequestOutput]:
        try:
            return self.llm.step()
        except StepFailedError as exc:
            if not exc.engine_usable:
                self._fail_engine(exc.__cause__ or exc)
            self._suspect_in_flight(exc)
            return []
        except Exception as exc:  # noqa: BLE001 (whatever it was, the rows in flight get records saying so)
            self._fail_engine(exc)

    def _fail_engine(self, exc: BaseException) -> NoReturn:
        """The engine cannot run any more: the rows in it, and those waiting to be rerun, get error records."""
        for group in self.suspects:
            self.in_flight.update((request.id, request) for request in group)
        self.suspects.clear()
        failed = list(self.in_flight.values())
        self._fail_in_flight(f"the engine failed while running this row (with {len(failed)} rows in its "
                             f"step): {type(exc).__name__}: {exc}")
        names = ", ".join(f"{r.where} (id {r.id!r})" for r in failed[:5]) + (" ..." if len(failed) > 5 else "")
        raise EngineStepError(f"the engine failed in a step running {names}: {type(exc).__name__}: {exc}; "
                              "those rows have error records (rerun them with --retry-failed)") from exc

    def _suspect_in_flight(self, failure: StepFailedError) -> None:
        """The engine aborted every request in it: rerun the rows in halves, or fail the row that was alone."""
        rows = list(self.in_flight.values())
        self.in_flight.clear()
        self.isolating = False
        if len(rows) == 1:
            cause = failure.__cause__ or failure
            self._write_error(RowError(rows[0].id, rows[0].where, "the engine failed on this row alone: "
                                       f"{type(cause).__name__}: {cause}", rows[0].endpoint),
                              len(rows[0].token_ids), status_code=500)
            return
        half = len(rows) // 2
        self.suspects += [rows[half:], rows[:half]]

    def _admit_suspects(self) -> None:
        """With nothing else in the engine, submit the next group of suspects whole."""
        if self.in_flight:
            return
        self.isolating = bool(self.suspects)
        if self.suspects:
            for request in self.suspects.pop():
                self._submit(request)

    def _read_window(self, rows: Iterator[RowRequest | RowError]) -> tuple[list[RowRequest], bool]:
        """Up to `window` tokenized rows; skipped and bad rows are dealt with on the way. True: input exhausted."""
        requests: list[RowRequest] = []
        for row in rows:
            if row.id in self.skip_ids:
                self.stats.rows_skipped += 1
                continue
            if row.id in self.seen:
                self._write_error(RowError(row.id, row.where, f"duplicate id {row.id!r}: an earlier row has it",
                                           row.endpoint))
                continue
            self.seen.add(row.id)
            if isinstance(row, RowRequest):
                row = tokenize_row(row, self.llm.prompts)
            if isinstance(row, RowError):
                self._write_error(row)
                continue
            requests.append(row)
            if len(requests) == self.window:
                return requests, False
        return requests, True

    def _admit(self, groups: list[PrefixGroup]) -> list[PrefixGroup]:
        """Move requests into the engine up to `max_in_flight`; returns the groups with requests left."""
        self.round += 1
        for group in groups:
            while group.requests and len(self.in_flight) < self.max_in_flight:
                if group.leader_round == self.round:
                    break  # the followers wait one step for the leader's prefix blocks
                if self._submit(group.requests.popleft()) and group.leader_round is None:
                    group.leader_round = self.round
        return [g for g in groups if g.requests]

    def _submit(self, request: RowRequest) -> bool:
        try:
            self.llm.add_request(None, request.params, request_id=request.id, prompt_token_ids=request.token_ids)
        except ValueError as exc:  # too long for max_model_len or for the whole KV cache
            self._write_error(RowError(request.id, request.where, str(exc), request.endpoint),
                              len(request.token_ids))
            return False
        self.in_flight[request.id] = request
        return True

    def _write_result(self, request: RowRequest, output: RequestOutput) -> None:
        self.writer.write(self.records.result(request, output))
        if output.error:
            self._count_failure(f"{request.where}: {output.error}")
        else:
            self.stats.add_result(output)

    def _write_error(self, error: RowError, prompt_tokens: int = 0, status_code: int = 400) -> None:
        self.writer.write(self.records.error(error, prompt_tokens, status_code))
        self._count_failure(error.message)

    def _count_failure(self, message: str) -> None:
        self.stats.rows_failed += 1
        self.on_error(message)

    def _fail_in_flight(self, problem: str) -> None:
        for request in self.in_flight.values():
            self._write_error(RowError(request.id, request.where, problem, request.endpoint),
                              len(request.token_ids), status_code=500)
        self.in_flight.clear()

    def _fail_lost_requests(self) -> None:
        """The engine is idle yet requests are unanswered: answer them with errors rather than wait forever."""
        self._fail_in_flight("the engine returned no result")
