"""`nanovllm run --ray`: the job on a Ray cluster: input files cut into parts (`ray_inputs.py`), engine actors
answering them (`ray_scheduler.py`, `ray_engine.py`), a folder of shards, each committed with a manifest
(`shards.py`), so that a rerun with --resume answers only what is missing.

Before Ray is reached, the driver checks OUTPUT: what an earlier run left (with --resume: partial shards cut,
--retry-failed's and --sync's shards listed) and that it can write it; a cluster address with nothing behind it
is an error naming it within seconds. OUTPUT is a directory of shards in the format its name ends with
(`results.parquet/`, `results.jsonl/`), one per part, with their manifests.
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from nanovllm_cli import options as o
from nanovllm_cli.options import EngineOptions, ExitCode
from nanovllm_cli.ray_inputs import InputFile, first_row_is_openai, list_input_files, plan_parts
from nanovllm_cli.records import RecordLayout
from nanovllm_cli.shards import OutputState, ShardFolder, part_key, probe_output

OUTPUT_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
CONNECT_TIMEOUT_S = 10.0  # to reach a cluster's address before Ray is asked to join it
GCS_PORT, CLIENT_PORT = 6379, 10001  # Ray's defaults: `ray start --head`, and Ray Client (ray://)


@dataclass(frozen=True)
class RayJob:
    input: str
    output: str
    input_format: str | None
    engine: EngineOptions
    sampling: dict
    seed: int
    include_token_ids: bool
    reorder: bool
    window: int  # rows per part (a task for one engine)
    replicas: int
    address: str | None
    overwrite: bool
    quiet: bool
    resume: bool = False
    retry_failed: bool = False
    sync: bool = False
    log_interval: float = 10.0
    metrics_file: Path | None = None
    metrics_interval: float = 10.0
    max_restarts: int = 3
    pooling: dict | None = None  # a pooling job's defaults (PoolingParams fields)


def output_format(output: str) -> str:
    fmt = OUTPUT_FORMATS.get(posixpath.splitext(output.rstrip("/"))[1].lower())
    if fmt is None:
        raise ValueError(f"OUTPUT must be a directory named *.parquet or *.jsonl (its shards' format), not {output!r}")
    return fmt




def check_output(output: str, input_uri: str) -> None:
    """OUTPUT is a directory (or nothing yet), and not inside a directory INPUT (a later run would read its shards
    as input)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(output)
    if fs.isfile(path):
        raise ValueError(f"OUTPUT {output} is a file; with --ray OUTPUT is a directory of shards")
    in_fs, in_path = fsspec.core.url_to_fs(input_uri)
    if type(in_fs) is type(fs) and in_fs.isdir(in_path) and (path.rstrip("/") + "/").startswith(
            in_path.rstrip("/") + "/"):
        raise ValueError(f"OUTPUT {output} lies inside INPUT {input_uri}: its shards would be read as input by a "
                         "later run; write it elsewhere")


@dataclass
class ResumePlan:
    kept: list[dict]  # the manifests of earlier runs that stay
    tasks: list[dict]  # reruns of failed rows (--retry-failed)


def plan_resume(job: RayJob, folder: ShardFolder, state: OutputState, files: list[InputFile], layout: RecordLayout,
                fmt: str) -> ResumePlan:
    """What an earlier run left in OUTPUT, repaired: shards without a manifest and _tmp cut, replaced and
    doubled manifests dropped, with --sync the shards of input files changed or gone since; the rows --retry-failed
    reruns. Raises ValueError saying what to pass when OUTPUT is not this job's to resume."""
    if not state.empty and not job.resume:
        raise ValueError(f"OUTPUT {job.output} already holds files: add --resume to answer only the rows it lacks, "
                         "or --overwrite to replace it")
    if state.foreign:
        raise ValueError(f"OUTPUT {job.output} holds files no `nanovllm run --ray` commits (e.g. {state.foreign[0]}): "
                         "choose another OUTPUT, or --overwrite to replace it")
    wanted = {"openai": layout.openai, "include_token_ids": layout.include_token_ids}
    for manifest in state.manifests.values():
        if manifest["output_format"] != fmt or manifest["layout"] != wanted:
            raise ValueError(f"OUTPUT {job.output} holds shards of another job ({manifest['shard']}: "
                             f"{manifest['output_format']}, {manifest['layout']}; this one writes {fmt}, {wanted}): "
                             "choose another OUTPUT or --overwrite")
    dropped, cut = state.superfluous()
    versions = {f.url: f.version for f in files}
    kept = [m for m in state.manifests.values() if m not in dropped]
    gone = [m for m in kept if m["part"]["url"] not in versions]
    changed = [m for m in kept if m["part"]["url"] in versions and m["file"]["version"] != versions[m["part"]["url"]]]
    if (gone or changed) and not job.sync:
        parts = [f"{len(ms)} shards answer {what} (e.g. {ms[0]['part']['url']})" for ms, what in (
            (changed, "input files changed since"), (gone, "files no longer in INPUT")) if ms]
        raise ValueError(f"OUTPUT {job.output} does not match INPUT: {' and '.join(parts)}. Add --sync to rerun the "
                         "changed files and drop the shards of removed ones, or choose another OUTPUT")
    for manifest in [*dropped, *gone, *changed]:
        folder.remove_manifest(manifest)
    folder.remove(cut)
    kept = [m for m in kept if m not in gone and m not in changed]
    tasks = [{"key": part_key(m["part"]["url"], m["part"]["first"]), "part": m["part"], "file": m["file"],
              "numbers": [number for _, number in m["failed"]],
              "replaces": {k: m[k] for k in ("key", "shard", "failed", "prompt_tokens", "cached_tokens",
                                             "completion_tokens")}}
             for m in kept if job.retry_failed and m["failed"]]
    return ResumePlan(kept, tasks)


def connect(address: str | None, quiet: bool) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS; neither: start a local one). An address with nothing behind
    it fails within CONNECT_TIMEOUT_S naming it, where Ray would retry for minutes."""
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if target and target not in ("auto", "local"):
        client = target.startswith("ray://")
        host, _, port = target.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            host, port = target.removeprefix("ray://"), str(CLIENT_PORT if client else GCS_PORT)
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise o.fail(f"no Ray cluster at {target}: cannot reach {host}:{port} ({exc.strerror or exc}). Start one "
                         "(`ray start --head`) or pass the address of its head node to --ray-address "
                         "(RAY_ADDRESS)") from None
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=not quiet)
    except ConnectionError as exc:
        raise o.fail(f"no Ray cluster at {target or 'auto'}: {exc}") from None


def ray_job(input_path: str, output: str | None, input_format: str | None, engine: EngineOptions, sampling: dict,
            seed: int, unsupported: dict[str, bool], **settings) -> dict:
    """`nanovllm run --ray`'s options checked (`unsupported`: option name -> whether it was given), then the job
    run; returns its summary (exit code included). `settings`: the other fields of `RayJob`."""
    from nanovllm import SamplingParams

    given = [name for name, value in unsupported.items() if value]
    if given:
        raise o.fail(f"not supported with --ray: {', '.join(given)}")
    if output is None:
        raise o.fail("--ray needs -o OUTPUT: a directory named *.parquet or *.jsonl (the format of its shards)")
    try:
        SamplingParams(**sampling)
    except ValueError as exc:
        raise o.fail(f"invalid sampling option: {exc}") from None
    try:
        import ray  # noqa: F401
    except ImportError:
        raise o.fail("--ray needs Ray: pip install 'nanovllm[ray]'") from None
    return run_on_ray(RayJob(input_path, output, input_format, engine, sampling, seed, **settings))


def run_on_ray(job: RayJob) -> dict:
    """Run the job; returns its summary, with the exit code of `nanovllm run`'s rules."""
    from nanovllm_cli.metrics import check_writable

    started = time.perf_counter()
    try:
        out_format = output_format(job.output)
        files = list_input_files(job.input, job.input_format)
        check_output(job.output, job.input)
        engine_args = job.engine.args(job.seed)
        chat_template = job.engine.chat_template_text()
        source = o.model_source(job.engine)  # None where this machine cannot resolve the model: the nodes say why
        spec = source.pooling if source is not None else None
        # The rows' own fields are not carried: a Parquet shard's columns are fixed before its rows are read.
        layout = RecordLayout(openai=first_row_is_openai(files), include_token_ids=job.include_token_ids,
                              task=spec.task if spec else None, drop_columns=True)
        folder = ShardFolder(job.output)
        if job.overwrite:
            folder.clear()
        plan = plan_resume(job, folder, folder.read_state(), files, layout, out_format)
        probe_output(job.output, "this machine (the driver)")
        check_writable(job.metrics_file)
    except (ValueError, OSError) as exc:
        raise o.fail(str(exc)) from None
    # Ray prints what it has to say on the driver (a worker that died, ...) to stdout: keep stdout for --json.
    with contextlib.redirect_stdout(sys.stderr):
        return run_on_cluster(job, files, engine_args, chat_template, layout, out_format, folder, plan, started)


def run_on_cluster(job: RayJob, files: list[InputFile], engine_args: dict, chat_template: str | None,
                   layout: RecordLayout, out_format: str, folder: ShardFolder, plan: ResumePlan, started: float) -> dict:
    """The job's parts planned on the cluster and answered by the engine actors; then what committed is read
    back, doubles dropped (an actor of a killed run that committed after this run looked), and summed up."""
    from rich.console import Console

    from nanovllm_cli.display import notice

    connect(job.address, job.quiet)
    covered: dict[str, list[tuple[int, int]]] = {}
    for manifest in plan.kept:
        covered.setdefault(manifest["part"]["url"], []).append((manifest["part"]["first"], manifest["part"]["count"]))
    versions = {f.url: f.version for f in files}
    tasks = plan.tasks + [{"key": part_key(p.url, p.first), "part": vars(p), "file": {"version": versions[p.url]}}
                          for p in plan_parts(files, job.window, covered)]
    progress = RayProgress(job, plan, tasks, started, pooling=layout.task is not None)
    console = Console(stderr=True)
    code, scheduler = ExitCode.OK, None
    if tasks:
        code, scheduler = run_tasks(job, tasks, engine_args, chat_template, layout, out_format, progress,
                                    on_event=lambda message: notice(console, message), console=console)
    final = folder.read_state()
    dropped, cut = final.superfluous()
    for manifest in dropped:
        folder.remove_manifest(manifest)
    folder.remove(cut)
    folder.tidy()
    final = [m for m in final.manifests.values() if m not in dropped]
    return progress.summary(final, files, layout, scheduler, code)


def run_tasks(job: RayJob, tasks: list[dict], engine_args: dict, chat_template: str | None, layout: RecordLayout,
              out_format: str, progress: RayProgress, on_event, console) -> tuple[ExitCode, object]:
    """The tasks through the engine actors, with the progress display and the metrics file."""
    import ray

    from nanovllm_cli.display import ProgressDisplay
    from nanovllm_cli.job import JobFailed
    from nanovllm_cli.metrics import MetricsLog
    from nanovllm_cli.ray_engine import ActorSettings, EngineActor
    from nanovllm_cli.ray_scheduler import RayScheduler

    model = job.engine.model
    if model is not None and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())  # the same path on every node
    settings = ActorSettings(model, engine_args, job.sampling, job.seed, layout, job.reorder, job.window, job.output,
                             out_format, job.max_restarts, chat_template, job.pooling or {})
    gpus = ray.cluster_resources().get("GPU", 0) > 0 and job.engine.device != "cpu"
    actor_class = ray.remote(EngineActor).options(
        num_cpus=1, num_gpus=(job.engine.tensor_parallel_size or 1) if gpus else 0, max_concurrency=2,
        max_restarts=0)
    display = ProgressDisplay(progress.snapshot, quiet=job.quiet, log_interval=job.log_interval, console=console)
    metrics = MetricsLog(job.metrics_file, job.metrics_interval, progress.snapshot)

    def on_tick() -> None:
        display.tick()
        metrics.tick()

    scheduler = RayScheduler(lambda: actor_class.remote(settings), tasks, job.replicas, job.max_restarts,
                             ShardFolder(job.output), on_event, on_tick)
    progress.scheduler = scheduler
    code = ExitCode.OK
    try:
        with display, metrics:
            scheduler.run()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (interrupts.py)
        code = ExitCode.INTERRUPTED
    except JobFailed as exc:
        typer.echo(f"error: the Ray job failed: {exc}", err=True)
        code = ExitCode.INTERNAL
    if code != ExitCode.OK:
        typer.echo(f"the shards committed so far are in {job.output}; run again with --resume to finish", err=True)
    return code, scheduler


class RayProgress:
    """The job's figures for the display, the metrics file and the summary: what earlier runs answered, the parts
    committed by this one, and the parts in the actors' hands."""

    def __init__(self, job: RayJob, plan: ResumePlan, tasks: list[dict], started: float, pooling: bool):
        self.job = job
        self.pooling = pooling  # a pooling job generates nothing: its ETA goes by its row rate
        self.started = started
        self.scheduler = None
        rerun = sum(len(t["numbers"]) for t in tasks if "numbers" in t)
        self.rows_before = sum(m["rows"] for m in plan.kept) - rerun  # answered by earlier runs, and staying
        self.rows_planned = sum(len(t["numbers"]) if "numbers" in t else t["part"]["count"] for t in tasks)
        self.failed_before = sum(m["rows_failed"] for m in plan.kept) - rerun

    def this_run(self) -> dict:
        """Rows and tokens of this run: the committed parts' and the running ones'."""
        totals = dict.fromkeys(("rows_ok", "rows_failed", "prompt_tokens", "cached_tokens", "completion_tokens"), 0)
        for result in self.scheduler.results if self.scheduler else ():
            for name in totals:
                totals[name] += result["run"][name]
        return totals

    def snapshot(self):
        from nanovllm_cli.display import ReplicaProgress, Snapshot, eta_seconds

        elapsed = time.perf_counter() - self.started
        run = self.this_run()
        hand = self.scheduler.in_hand()
        done = run["rows_ok"] + run["rows_failed"] + hand["rows"]
        completion = run["completion_tokens"] + hand["completion_tokens"]
        generated = hand["generated_tokens"]
        answered = run["rows_ok"] + hand["rows"] - hand["rows_failed"]
        per_row = completion / answered if answered else None
        left = None if per_row is None else max(self.rows_planned - done, 0) * min(per_row, self.job.sampling["max_tokens"])
        eta = eta_seconds(left, generated - completion, generated / elapsed)
        if self.pooling and done:
            eta = max(self.rows_planned - done, 0) * elapsed / done
        replicas = []
        for s in self.scheduler.slots:
            part_rows = s.figures.get("part", {}).get("rows", 0) if s.task is not None else 0
            held = 0 if s.task is None else len(s.task["numbers"]) if "numbers" in s.task else s.task["part"]["count"]
            replicas.append(ReplicaProgress(s.index, s.info and s.info["pid"], s.state, s.totals["rows"] + part_rows,
                                            max(held - part_rows, 0), s.generated_tokens(),
                                            s.generated_tokens() / elapsed, s.restarts))
        busy = [s.figures for s in self.scheduler.slots if s.figures]
        return Snapshot(
            rows_done=self.rows_before + done, rows_total=self.rows_before + self.rows_planned,
            rows_failed=run["rows_failed"] + hand["rows_failed"], rows_per_s=done / elapsed,
            output_tok_s=generated / elapsed, prefill_tok_s=hand["prefill_tokens"] / elapsed,
            kv_cache_usage=sum(f["kv_cache_usage"] for f in busy) / len(busy) if busy else None,
            prefix_hit_rate=None, elapsed_s=elapsed, eta_s=eta,
            generated_tokens=generated, completion_tokens=completion, replicas=replicas,
            retries=self.scheduler.retries())

    def summary(self, manifests: list[dict], files: list[InputFile], layout: RecordLayout, scheduler,
                code: ExitCode) -> dict:
        """The job's summary: every row OUTPUT answers (from the manifests), this run's share and figures."""
        elapsed = time.perf_counter() - self.started
        run = self.this_run()
        failed_total = sum(m["rows_failed"] for m in manifests)
        if code == ExitCode.OK and failed_total:
            code = ExitCode.ROWS_FAILED
        replicas = [] if scheduler is None else [
            {"index": s.index, "node": s.info["node"] if s.info else None, "pid": s.info["pid"] if s.info else None,
             "state": s.state, "restarts": s.restarts, "start_s": s.info["start_s"] if s.info else None,
             "parts": s.parts, **s.totals, "output_tok_s": s.totals["completion_tokens"] / elapsed}
            for s in scheduler.slots]
        return {"input": self.job.input, "output": self.job.output,
                "output_format": "openai" if layout.openai else "plain", "model": self.job.engine.model or "default",
                "input_files": len(files), "ray_replicas": self.job.replicas, "parts": len(manifests),
                "rows_total": sum(m["rows"] for m in manifests), "rows_ok": run["rows_ok"],
                "rows_failed": run["rows_failed"], "rows_skipped": self.rows_before,
                "rows_failed_before": self.failed_before,
                **{n: run[n] for n in ("prompt_tokens", "cached_tokens", "completion_tokens")},
                "prefix_hit_rate": run["cached_tokens"] / run["prompt_tokens"] if run["prompt_tokens"] else 0.0,
                "elapsed_s": elapsed, "rows_per_s": (run["rows_ok"] + run["rows_failed"]) / elapsed,
                "output_tok_s": None if self.pooling else run["completion_tokens"] / elapsed,
                "prefill_tok_s": run["prompt_tokens"] / elapsed,
                "retries": None if scheduler is None else scheduler.retries(), "replicas": replicas,
                "exit_code": int(code)}
