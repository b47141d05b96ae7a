"""Each distinct constraint compiled once, on background threads, for one tokenizer and model vocabulary.

The engine's `GrammarVocabulary` (xgrammar's tokenizer tables) is built on a thread of its own from construction
on, so the first constrained request does not pay for it inside the step loop; compiles queued behind it start
once it is there. xgrammar releases the GIL while it compiles, so compiles run in parallel with each other and with
the step loop's thread. Results are kept by canonical key (`StructuredOutputsParams.canonical_key`); an invalid
constraint's error is kept the same way, so rows sharing it get the same error without a second compile, and no
other key is affected.

A compile cannot be stopped once xgrammar runs it, so none is waited for beyond need: `max_workers` slots each run
one compile at a time on a thread of its own and wait at most `compile_time_limit_s` for it; past that the
constraint's future fails with an error naming the limit and the slot takes the next constraint, leaving the
compile to finish on its own and its result to be dropped (the size limits of `bounds` keep that bounded). At most
`max_overdue` such compiles run on beside the slots: past that a slot waits for one to end before it starts
another, so hostile constraints cannot pile up threads and memory. Every compile thread is a daemon, and `shutdown`
cancels the queued compiles and returns at once: an engine, and a process, stop promptly in the middle of a compile. This
module imports xgrammar only on its threads (importing it takes a second or more)."""
from __future__ import annotations

import json as jsonlib
import os
import queue
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanovllm.structured.grammar_check import accepts_some_output
from nanovllm.structured.json_pattern import splice_patterns
from nanovllm.structured.json_schema import fix_string_class, prepare_schema
from nanovllm.structured.params import StructuredOutputsParams
from nanovllm.structured.regex import python_regex

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from nanovllm.structured.vocabulary import GrammarVocabulary

COMPILE_TIME_LIMIT_S = 20.0  # the most a constraint may take to compile (seconds)

_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
         "grammar": "EBNF grammar"}
# xgrammar's messages start with a timestamp and a C++ source location, and checks with "Check failed: (...) is false:".
_NOISE = re.compile(r"\[[0-9:]+\] \S+?:\d+: |Check failed: \(.*?\) is false: ")


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the field and says why."""


def host_cpus() -> int:
    """The CPUs this process may run on (its affinity, which containers set), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class CompiledConstraint:
    key: tuple[str, str]
    grammar: xgr.CompiledGrammar
    vocabulary: GrammarVocabulary
    # The mask of a fresh row, per set of stop ids: every row of this constraint starts there (GrammarManager).
    start_masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)


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


class GrammarSetupError(RuntimeError):
    """The engine could not build its grammar vocabulary: every constrained request fails with it, and the fault
    is the engine's (or its tokenizer's), not the request's."""


class GrammarCompileCache:
    """Compiles constraints for one tokenizer. `vocab_size` is the MODEL's (its logits' width), which may exceed
    the tokenizer's; grammars cover `mask_vocab_size` ids, and the ones past them are never allowed. Thread-safe.

    `max_workers` compiles run at once, each on `threads_per_compile` of xgrammar's threads; the default fills the
    CPUs this process may use (half of them compiling, two threads each), so many distinct schemas compile in
    parallel while one schema still gets two threads."""

    def __init__(self, tokenizer, vocab_size: int, max_workers: int | None = None, threads_per_compile: int = 2,
                 max_entries: int = 4096, json_max_whitespace: int | None = 32,
                 compile_time_limit_s: float = COMPILE_TIME_LIMIT_S, max_overdue: int | None = None):
        self.vocab_size = vocab_size
        workers = max_workers or max(2, host_cpus() // 2)
        self._setup: Future = Future()
        # Not a daemon: a process that exits in the middle of the (short) build aborts inside xgrammar, so the
        # interpreter's exit waits for it.
        threading.Thread(target=self._build, args=(tokenizer, vocab_size, threads_per_compile),
                         name="grammar-vocabulary").start()
        self.compile_time_limit_s = compile_time_limit_s
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._max_overdue = 2 * workers if max_overdue is None else max_overdue
        self._overdue = 0  # compiles given up at the time limit and still running
        self._overdue_ended = threading.Condition()
        self._slots = [threading.Thread(target=self._serve, name=f"grammar-compile-{i}", daemon=True)
                       for i in range(workers)]
        for slot in self._slots:
            slot.start()
        self._futures: OrderedDict[tuple[str, str], CompileFuture] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        # JSON may be formatted freely, but a run of whitespace between two elements is bounded: a weak model
        # (or noise) could otherwise emit blank space until max_tokens.
        self.json_max_whitespace = json_max_whitespace
        self.num_compiles = 0  # compiles started: one per distinct key while it stays cached

    def _build(self, tokenizer, vocab_size: int, threads: int) -> None:
        try:
            import xgrammar as xgr

            from nanovllm.structured.vocabulary import build_vocabulary

            vocabulary = build_vocabulary(tokenizer, vocab_size)
            # this class is the cache
            compiler = xgr.GrammarCompiler(vocabulary.tokenizer_info, max_threads=threads, cache_enabled=False)
            _settle(self._setup, (vocabulary, compiler))
        except BaseException as exc:  # noqa: BLE001 (every compile reports it)
            error = GrammarSetupError(f"the grammar vocabulary could not be built from the model's tokenizer: "
                                      f"{type(exc).__name__}: {exc}")
            error.__cause__ = exc
            _settle(self._setup, error=error)

    def vocabulary(self) -> GrammarVocabulary:
        """The engine's grammar vocabulary; blocks until the background build is done."""
        return self._setup.result()[0]

    @property
    def mask_vocab_size(self) -> int:
        return self.vocabulary().mask_vocab_size

    def ready(self) -> bool:
        """Whether the vocabulary is built (compiles need it); never blocks."""
        return self._setup.done()

    def request(self, params: StructuredOutputsParams) -> CompileFuture:
        """The compile of `params`' constraint: queued now if its key is new, else the shared one. Never blocks: a
        compile queued before the vocabulary is built waits for it on its slot."""
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
        """A slot: run the queued compiles one at a time, each on its own daemon thread, for at most the limit
        (counted once the vocabulary is built)."""
        while (job := self._queue.get()) is not None:
            self._setup.exception()  # wait for the vocabulary; a failed build is each compile's error
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
        vocabulary, compiler = self._setup.result()
        kind = key[0]
        try:
            grammar = self._compile_kind(compiler, params, kind, key[1])
        except (RuntimeError, ValueError) as e:  # xgrammar reports bad input as either
            reason = (_NOISE.sub("", str(e)).strip().splitlines() or [type(e).__name__])[0]
            raise ConstraintError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {reason}") from None
        if not _accepts_some_output(grammar, vocabulary.mask_vocab_size):
            raise ConstraintError(f"structured_outputs.{kind}: the {_WHAT[kind]} accepts no output at all (no finite "
                                  "text matches it: e.g. a $ref that refers only to itself, or an object that "
                                  "requires itself)")
        return CompiledConstraint(key, grammar, vocabulary)

    def _compile_kind(self, compiler: xgr.GrammarCompiler, params: StructuredOutputsParams, kind: str,
                      text: str) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        if kind == "json":
            prepared = prepare_schema(jsonlib.loads(text))
            schema_text = jsonlib.dumps(prepared.schema)
            if not prepared.needs_grammar_text:
                return compiler.compile_json_schema(schema_text, max_whitespace_cnt=self.json_max_whitespace)
            grammar = str(xgr.Grammar.from_json_schema(schema_text, max_whitespace_cnt=self.json_max_whitespace))
            if prepared.long_strings:
                grammar = fix_string_class(grammar)
            return compiler.compile_grammar(splice_patterns(grammar, prepared.patterns))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=self.json_max_whitespace)
        if kind == "regex":
            return compiler.compile_regex(python_regex(params.regex))
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)

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


def _accepts_some_output(grammar: xgr.CompiledGrammar, mask_vocab_size: int) -> bool:
    """Some finite text matches: the grammar has a finite match, and some token can start one."""
    import torch
    import xgrammar as xgr

    from nanovllm.structured.vocabulary import clear_bits_past

    if not accepts_some_output(str(grammar.grammar)):
        return False
    matcher = xgr.GrammarMatcher(grammar)
    if matcher.is_completed():
        return True
    bitmask = xgr.allocate_token_bitmask(1, mask_vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    clear_bits_past(bitmask, mask_vocab_size)
    return bool(torch.any(bitmask != 0))
