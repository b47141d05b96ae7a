"""Each distinct constraint compiled once, in the background, for one tokenizer and model vocabulary.

xgrammar releases the GIL while it compiles, so a compile does not stall the step loop's thread. Results are kept
by canonical key (`StructuredOutputsParams.canonical_key`); an invalid constraint's error is kept the same way, so
rows sharing it get the same error without a second compile, and no other key is affected.

A compile cannot be stopped once xgrammar runs it, so none is waited for beyond need: `max_workers` slots each run
one compile at a time on a thread of its own and wait at most `compile_time_limit_s` for it; past that the
constraint's future fails with an error naming the limit and the slot takes the next constraint, leaving the
compile to finish on its own and its result to be dropped (the size limits of `bounds` keep that bounded). At most
`max_overdue` such compiles run on beside the slots: past that a slot waits for one to end before it starts
another, so hostile constraints cannot pile up threads and memory. Every thread is a daemon, and `shutdown` cancels
the queued compiles and returns at once: an engine, and a process, stop promptly in the middle of a compile.
"""
from __future__ import annotations

import json as jsonlib
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass

import torch
import xgrammar as xgr

from nanovllm.structured.grammar_check import accepts_some_output
from nanovllm.structured.params import StructuredOutputsParams
from nanovllm.structured.row_grammar import RowGrammar, clear_bits_past

COMPILE_TIME_LIMIT_S = 20.0  # the most a constraint may take to compile (seconds)

_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
         "grammar": "EBNF grammar"}
# xgrammar's messages start with a timestamp and a C++ source location, and checks with "Check failed: (...) is false:".
_NOISE = re.compile(r"\[[0-9:]+\] \S+?:\d+: |Check failed: \(.*?\) is false: ")


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the field and says why."""


@dataclass(frozen=True)
class CompiledConstraint:
    key: tuple[str, str]
    grammar: xgr.CompiledGrammar

    def new_row(self, stop_token_ids: Sequence[int]) -> RowGrammar:
        """A fresh matcher for one output row; `stop_token_ids` (EOS and the row's stop ids) end it."""
        return RowGrammar(self.grammar, stop_token_ids)


class CompileFuture:
    """One key's compile, shared by every row that asks for it."""

    def __init__(self, future: Future):
        self._future = future

    def ready(self) -> bool:
        """Whether the compile has finished (with a grammar or an error); never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the compile has finished (with a grammar or an error), or `timeout` seconds."""
        wait_for_futures([self._future], timeout)

    def result(self, timeout: float | None = None) -> CompiledConstraint:
        """The compiled constraint; raises ConstraintError if it is invalid. Blocks until ready."""
        return self._future.result(timeout)

    def error(self) -> ConstraintError | None:
        """The error of a finished compile, or None (also None while it runs)."""
        return self._future.exception() if self._future.done() else None


def _choice_grammar(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals (same escapes, \uXXXX included).
    return "root ::= " + " | ".join(jsonlib.dumps(c) for c in choices)


def mask_vocab_size(tokenizer, vocab_size: int) -> int:
    """The ids a grammar's bitmask covers: the tokenizer's (up to its largest id), at most the model's `vocab_size`.
    A model's vocabulary is often padded past its tokenizer's (Qwen3: 151,936 for 151,669 ids), and xgrammar's
    fills and accepts cost several times more per padded id (SmolLM2's 49,152 ids in a 151,936 vocabulary: a
    row's fill inside a JSON string 38 µs against 291, an accept 4 against 33); the ids past it are never allowed
    (the mask rule of nanovllm.kernels.token_bitmask)."""
    return min(vocab_size, max(tokenizer.get_vocab().values()) + 1)


@dataclass
class _Job:
    params: StructuredOutputsParams
    key: tuple[str, str]
    future: Future
    done: bool = False  # the compile returned
    overdue: bool = False  # given up at the time limit while still running


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Complete `future` unless it already is (timed out, or cancelled by a shutdown)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


class GrammarCompileCache:
    """Compiles constraints for one tokenizer. `vocab_size` is the MODEL's (its logits' width), which may exceed
    the tokenizer's; grammars cover `mask_vocab_size` ids, and the ones past them are never allowed. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, max_workers: int = 2, threads_per_compile: int = 2,
                 max_entries: int = 4096, json_max_whitespace: int | None = 32,
                 compile_time_limit_s: float = COMPILE_TIME_LIMIT_S, max_overdue: int | None = None):
        self.vocab_size = vocab_size
        self.mask_vocab_size = mask_vocab_size(tokenizer, vocab_size)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.mask_vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads_per_compile,
                                             cache_enabled=False)  # this class is the cache
        self.compile_time_limit_s = compile_time_limit_s
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._max_overdue = 2 * max_workers if max_overdue is None else max_overdue
        self._overdue = 0  # compiles given up at the time limit and still running
        self._overdue_ended = threading.Condition()
        self._slots = [threading.Thread(target=self._serve, name=f"grammar-compile-{i}", daemon=True)
                       for i in range(max_workers)]
        for slot in self._slots:
            slot.start()
        self._futures: OrderedDict[tuple[str, str], CompileFuture] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        # JSON may be formatted freely, but a run of whitespace between two elements is bounded: a weak model
        # (or noise) could otherwise emit blank space until max_tokens.
        self.json_max_whitespace = json_max_whitespace
        self.num_compiles = 0  # compiles started: one per distinct key while it stays cached

    def request(self, params: StructuredOutputsParams) -> CompileFuture:
        """The compile of `params`' constraint: queued now if its key is new, else the shared one."""
        key = params.canonical_key()
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile cache is shut down")
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            job = _Job(params, key, Future())
            self._queue.put(job)
            future = CompileFuture(job.future)
            self._futures[key] = future
            self.num_compiles += 1
            self._evict_finished()
            return future

    def _serve(self) -> None:
        """A slot: run the queued compiles one at a time, each on its own daemon thread, for at most the limit."""
        while (job := self._queue.get()) is not None:
            with self._overdue_ended:
                self._overdue_ended.wait_for(lambda: self._overdue < self._max_overdue)
            if self._closed:
                job.future.cancel()
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled by shutdown
            compiling = threading.Thread(target=self._run, args=(job,), name="grammar-compile-job", daemon=True)
            compiling.start()
            compiling.join(self.compile_time_limit_s)
            with self._overdue_ended:
                job.overdue = not job.done  # left to finish on its own; its result is dropped
                self._overdue += job.overdue
            if job.overdue:
                kind = job.key[0]
                _settle(job.future, error=ConstraintError(
                    f"structured_outputs.{kind}: the {_WHAT[kind]} took longer than the compile time limit of "
                    f"{self.compile_time_limit_s:g} s; make it smaller or simpler"))

    def _run(self, job: _Job) -> None:
        try:
            _settle(job.future, self._compile(job.params, job.key))
        except BaseException as exc:  # noqa: BLE001 (whatever it is, it is this constraint's error)
            _settle(job.future, error=exc)
        finally:
            with self._overdue_ended:
                job.done = True
                if job.overdue:
                    self._overdue -= 1
                    self._overdue_ended.notify_all()

    def _evict_finished(self) -> None:
        """Drop the least recently requested finished entries past `max_entries` (rows keep their grammars)."""
        excess = len(self._futures) - self.max_entries
        for key in [k for k, f in self._futures.items() if f.ready()][:max(excess, 0)]:
            del self._futures[key]

    def _compile(self, params: StructuredOutputsParams, key: tuple[str, str]) -> CompiledConstraint:
        kind = key[0]
        try:
            if kind in ("json", "json_object"):
                schema = key[1] if kind == "json" else '{"type": "object"}'
                grammar = self._compiler.compile_json_schema(schema, max_whitespace_cnt=self.json_max_whitespace)
            elif kind == "regex":
                grammar = self._compiler.compile_regex(params.regex)
            elif kind == "choice":
                grammar = self._compiler.compile_grammar(_choice_grammar(params.choice))
            else:
                grammar = self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:  # xgrammar reports bad input as either
            reason = (_NOISE.sub("", str(e)).strip().splitlines() or [type(e).__name__])[0]
            raise ConstraintError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {reason}") from None
        if not self._accepts_some_output(grammar):
            raise ConstraintError(f"structured_outputs.{kind}: the {_WHAT[kind]} accepts no output at all (no finite "
                                  "text matches it: e.g. a $ref that refers only to itself, or an object that "
                                  "requires itself)")
        return CompiledConstraint(key, grammar)

    def _accepts_some_output(self, grammar: xgr.CompiledGrammar) -> bool:
        """Some finite text matches: the grammar has a finite match, and some token can start one."""
        if not accepts_some_output(str(grammar.grammar)):
            return False
        matcher = xgr.GrammarMatcher(grammar)
        if matcher.is_completed():
            return True
        bitmask = xgr.allocate_token_bitmask(1, self.mask_vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        clear_bits_past(bitmask, self.mask_vocab_size)
        return bool(torch.any(bitmask != 0))

    def shutdown(self) -> None:
        """Cancel the queued compiles and return at once (a running compile finishes on its own, unawaited)."""
        with self._lock:
            self._closed = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        for _ in self._slots:
            self._queue.put(None)
