"""`EngineActor`: one engine of `nanovllm run --ray`, a Ray actor that answers input parts and commits each as a
shard with its manifest (`shards.py`).

The actor does what `nanovllm run --data-parallel-size 1` does on one host: it reads a part's rows with `run`'s
reader and parser, tokenizes them and runs them through `job.BatchRunner` into a `replicas.ReplicaPool` of one
replica: the engine runs in a child process. So an engine that crashes takes down the child, not the actor: the
actor restarts it and reruns its rows, and a row that crashes the engine again when rerun without the other
suspects gets an error record (see replicas.py), while the part goes on. An actor that dies (its node lost) is
the driver's to handle (`ray_scheduler.py`). Before loading the model, `start` checks that this node can write
OUTPUT and has the model (a local path), so a node that cannot fails in seconds, naming itself.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from nanovllm_cli.records import RecordLayout

PROGRESS_INTERVAL_S = 0.5  # how often the figures `progress` returns are refreshed


@dataclass(frozen=True)
class ActorSettings:
    model: str | None
    engine_args: dict  # LLM(model, **engine_args), the seed included
    sampling: dict  # the sampling defaults a row's own fields override
    seed: int
    layout: RecordLayout
    reorder: bool
    window: int
    output: str  # OUTPUT's URI
    output_format: str  # "jsonl" | "parquet"
    max_restarts: int  # of the engine's child process
    chat_template: str | None  # for 'messages' rows instead of the model's (--chat-template)
    pooling: dict  # a pooling job's defaults (PoolingParams fields)


def node_name() -> str:
    """This node in messages: its host name and Ray node id."""
    import ray

    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "none: Ray is not initialized"
    return f"node {socket.gethostname()} (Ray node id {node_id})"


class EngineActor:
    """Create with `ray.remote(...)(EngineActor).options(max_concurrency=2)`: `progress` answers while `run` works.
    Call `start` once, then `run` for each task; `stop` at the end."""

    def __init__(self, settings: ActorSettings):
        self.settings = settings
        self.pool = None
        self.done = {"rows": 0, "rows_failed": 0, "completion_tokens": 0}  # of the parts answered
        self.figures: dict = {}  # the latest `progress`, replaced whole (read by the other thread)
        self.last_tick = 0.0

    def start(self) -> dict:
        """Check OUTPUT and the model on this node, then start the engine; returns where it runs and how long it
        took to start. Raises OutputNotWritable, ModelNotOnNode or the engine's start error."""
        from nanovllm_cli.ray_processor import check_model_on_node
        from nanovllm_cli.replica_start import start_replicas
        from nanovllm_cli.shards import probe_output

        started = time.monotonic()
        probe_output(self.settings.output, node_name())
        check_model_on_node(self.settings.model)
        self.pool = start_replicas(self.settings.model, self.settings.engine_args, 1,
                                   max_restarts=self.settings.max_restarts)
        if self.settings.chat_template is not None:
            self.pool.prompts.use_chat_template(self.settings.chat_template)
        spec = self.pool.info.pooling
        task = spec.task if spec is not None else None
        if task != self.settings.layout.task:  # the driver could not read the model's config: it planned generation
            self.stop()
            raise ValueError(f"the model runs task {task or 'generate'} on {node_name()}, but the driver planned "
                             f"task {self.settings.layout.task or 'generate'} without its config: make the model "
                             "readable where `nanovllm run --ray` runs too")
        self._refresh(None)
        return {"node": socket.gethostname(), "pid": os.getpid(), "start_s": time.monotonic() - started}

    def run(self, task: dict) -> dict:
        """Answer a task's rows and commit their shard and manifest; returns the manifest (without its ids), this
        run's figures and the actor's (as `progress`). `task`: {"key", "part", "file"} and, to rerun a shard's
        failed rows, "numbers" (the rows to run) and "replaces" (the shard's manifest)."""
        import fsspec

        from nanovllm_cli.job import BatchRunner, RecordList, RunStats
        from nanovllm_cli.pooling_rows import PoolingRowParser
        from nanovllm_cli.ray_inputs import part_values
        from nanovllm_cli.records import RecordBuilder
        from nanovllm_cli.rows import RowParser, row_fingerprint
        from nanovllm_cli.shards import MANIFEST_VERSION, ShardFolder

        s, part = self.settings, task["part"]
        numbers = set(task["numbers"]) if "numbers" in task else None
        label, source = "row" if part["format"] == "parquet" else "line", part["source"] or None
        parser = RowParser(s.sampling, s.seed, label, source) if s.layout.task is None \
            else PoolingRowParser(s.seed, label, s.layout.task, s.pooling, source)
        fingerprints: dict[str, str] = {}
        number_of: dict[str, int] = {}

        def rows():
            with fsspec.open(part["url"], "rb") as f:
                for number, value in part_values(f, part):
                    if numbers is None or number in numbers:
                        row = parser.parse(number, value)
                        fingerprints[row.id] = row_fingerprint(value)
                        number_of[row.id] = number
                        yield row

        retries_before = self.pool.retries()
        stats = RunStats(rows_total=len(numbers) if numbers is not None else part["count"])
        written = RecordList()
        records = RecordBuilder(s.layout, self.pool.info.model, fingerprints, self.pool.prompts)
        runner = BatchRunner(self.pool, written, records, stats, window=s.window, reorder=s.reorder, skip_ids=set(),
                             on_step=lambda: self._refresh(stats))
        runner.run(rows())
        records, key = written.records, s.layout.id_key
        counts = {name: getattr(stats, name) for name in ("prompt_tokens", "cached_tokens", "completion_tokens")}
        replaced = task.get("replaces")
        folder = ShardFolder(s.output)
        if replaced is not None:  # the shard's other records stay; its counts cover only answered rows
            rerun = {str(rid) for rid, _ in replaced["failed"]}
            kept = [r for r in folder.read_records(replaced["shard"], s.output_format, s.layout)
                    if str(r[key]) not in rerun]
            records = kept + records
            counts = {name: value + replaced[name] for name, value in counts.items()}
            number_of.update((str(rid), number) for rid, number in replaced["failed"])
        failed = [[r[key], number_of.get(str(r[key]))] for r in records if r["error"] is not None]
        retries = self.pool.retries()
        manifest = {
            "version": MANIFEST_VERSION, "key": task["key"], "output_format": s.output_format,
            "layout": {"openai": s.layout.openai, "include_token_ids": s.layout.include_token_ids},
            "part": part, "file": task["file"], "ids": [r[key] for r in records], "failed": failed,
            "rows": len(records), "rows_failed": len(failed), **counts,
            "replaces": None if replaced is None else replaced["key"],
            "engine": {"node": socket.gethostname(), "pid": os.getpid()}, "committed": time.time(),
            "retries": {name: retries[name] - retries_before[name] for name in retries if name != "events"}}
        manifest["shard"] = folder.write_shard(task["key"], s.output_format, s.layout, records)
        folder.write_manifest(manifest)
        if replaced is not None:
            folder.remove_manifest(replaced)
        for name, value in (("rows", stats.rows_done), ("rows_failed", stats.rows_failed),
                            ("completion_tokens", stats.completion_tokens)):
            self.done[name] += value
        self._refresh(None)
        this_run = {"rows_ok": stats.rows_ok, "rows_failed": stats.rows_failed, **{
            name: getattr(stats, name) for name in ("prompt_tokens", "cached_tokens", "completion_tokens")}}
        return {"manifest": {k: v for k, v in manifest.items() if k != "ids"}, "run": this_run,
                "figures": self.figures}

    def _refresh(self, stats) -> None:
        """Renew the figures `progress` returns (at most every PROGRESS_INTERVAL_S while a part runs)."""
        now = time.monotonic()
        if stats is not None and now - self.last_tick < PROGRESS_INTERVAL_S:
            return
        self.last_tick = now
        report = self.pool.report()
        cache = report["kv_cache"]
        part = {"rows": 0, "rows_failed": 0, "completion_tokens": 0} if stats is None else {
            "rows": stats.rows_done, "rows_failed": stats.rows_failed, "completion_tokens": stats.completion_tokens}
        self.figures = {
            "part": part, "done": dict(self.done), "generated_tokens": report["tokens"]["generated"],
            "prefill_tokens": report["tokens"]["prefill"], "kv_cache_usage": cache["kv_cache_usage"],
            "prefix_hit_rate": cache["prefix_cache"]["hit_rate"], "retries": report["retries"],
            "engine_state": report["replicas"][0]["state"]}

    def progress(self) -> dict:
        """The latest figures: the part in hand and those done, tokens, cache, the engine's deaths and restarts."""
        return self.figures

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
