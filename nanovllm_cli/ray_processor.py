"""`LLMProcessor`: one engine per Ray actor, for `ray.data.Dataset.map_batches`.

    ds.map_batches(LLMProcessor, fn_constructor_kwargs={"model": "Qwen/Qwen3-0.6B"},
                   compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1, batch_size=256, batch_format="pyarrow")

(Arrow batches only: numpy and pandas ones turn integers that some rows lack into floats.)
A batch's rows are `nanovllm run`'s rows (prompt / messages / prompt_token_ids / an OpenAI batch line, sampling
fields, an id), parsed by its `RowParser` and run by its `BatchRunner` (prefix-aware admission within the batch);
the batch returned holds `nanovllm run`'s records, in the rows' order, built by its `RecordBuilder`. A bad row
gets an error record; only an engine failure fails the Ray task. The nested record fields (`logprobs`,
`prompt_logprobs`, `completions`; an OpenAI record's `response` and `error`) are JSON text, so that every batch
has one Arrow schema (`record_from_arrow` turns such a row back into `nanovllm run`'s record; `nanovllm run
--ray` writes its Parquet shards in this schema too).

A row of a dataset may lack an id: it still runs, its record's id is null (Ray keeps a batch's rows in order)
and, without its own seed, it samples with one derived from its content.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from nanovllm_cli.pooling_rows import PoolingRowParser
from nanovllm_cli.readers import drop_nulls
from nanovllm_cli.records import RecordLayout
from nanovllm_cli.rows import RowError, RowParser, RowRequest, row_fingerprint

if TYPE_CHECKING:
    import pyarrow as pa

JSON_TEXT_FIELDS = ("logprobs", "prompt_logprobs", "completions")  # plain records' nested fields


class ModelNotOnNode(ValueError):
    """A local model path that this Ray node lacks."""


def check_model_on_node(model: str | None) -> None:
    """A model given as a path must exist on every node; say which node lacks it. (Presets and Hub ids
    resolve on the node itself.)"""
    if model is None or not (os.path.isabs(model) or model.startswith((".", "~")) or model.endswith(".gguf")):
        return
    if Path(model).expanduser().exists():
        return
    import ray

    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "none: Ray is not initialized"
    raise ModelNotOnNode(f"model path {model} does not exist on node {socket.gethostname()} (Ray node id {node_id}): "
                         "put it at the same path on every node (or on shared storage), or use a Hugging Face Hub "
                         "id, which each node fetches into its own cache")


def record_schema(layout: RecordLayout) -> pa.Schema:
    import pyarrow as pa

    schema = layout.arrow_schema()
    if layout.openai or layout.task:  # a pooling job's records have no nested fields
        return schema
    return pa.schema(list(schema) + [pa.field(name, pa.string()) for name in JSON_TEXT_FIELDS])


def arrow_row(layout: RecordLayout, record: dict) -> dict:
    """A record as a row of `record_schema`: nested fields as JSON text."""
    if layout.openai or layout.task:
        return layout.parquet_row(record)
    extra = {k: None if record.get(k) is None else json.dumps(record[k], ensure_ascii=False) for k in JSON_TEXT_FIELDS}
    return {**record, **extra}


def record_from_arrow(layout: RecordLayout, row: dict) -> dict:
    """The inverse of `arrow_row`: the record as `nanovllm run` writes it to JSONL."""
    nested = ("response", "error") if layout.openai else JSON_TEXT_FIELDS
    record = {k: json.loads(v) if k in nested and isinstance(v, str) else v for k, v in row.items()}
    if not layout.openai and not layout.task:  # a plain record has its nested fields only where the row asked
        record = {k: v for k, v in record.items() if k not in JSON_TEXT_FIELDS or v is not None}
    return record


class LLMProcessor:
    """A callable class for `map_batches`: each actor builds one engine, `LLM(model, **engine_args)`.

    `sampling`: the default sampling fields a row's own override (as `nanovllm run`'s options; greedy with 64
    tokens when not given, except that an OpenAI line takes OpenAI's default temperature, 1, unless `sampling`
    names one); `seed`: the engine seed, from which a row without a seed derives its own (as in
    `nanovllm run`); `openai`: the rows are OpenAI batch lines and the records OpenAI batch output;
    `include_token_ids`: add prompt_token_ids and token_ids; `reorder`: prefix-aware admission within a batch;
    `chat_template`: a Jinja chat template (its text) for 'messages' rows instead of the model's. A pooling model's
    rows and records are a pooling job's (`nanovllm run --task`), `pooling` its defaults (PoolingParams fields).
    A model path must exist on every node (ModelNotOnNode names the node lacking it). A row's fields that nanovllm
    does not read are not carried into its record here (one Arrow schema for every batch)."""

    def __init__(self, model: str | None = None, *, engine_args: dict | None = None, sampling: dict | None = None,
                 seed: int = 0, openai: bool = False, include_token_ids: bool = False, reorder: bool = True,
                 chat_template: str | None = None, pooling: dict | None = None):
        from nanovllm import LLM, SamplingParams

        self.defaults = {"max_tokens": 64, **(sampling or {})}  # the row parser adds the temperatures
        SamplingParams(**{"temperature": 0.0, **self.defaults})  # a bad default fails the actor at once, not every row
        check_model_on_node(model)
        self.llm = LLM(model, **{**(engine_args or {}), "seed": seed})
        if chat_template is not None:
            self.llm.prompts.use_chat_template(chat_template)
        self.seed = seed
        spec = self.llm.info.pooling
        self.layout = RecordLayout(openai=openai, include_token_ids=include_token_ids,
                                   task=spec.task if spec is not None else None)
        self.pooling = pooling or {}
        self.schema = record_schema(self.layout)
        self.reorder = reorder
        self.parsers: dict[str, RowParser] = {}

    def __call__(self, batch) -> pa.Table:
        import pyarrow as pa

        from nanovllm_cli.job import BatchRunner, EngineFeeder, RecordList, RunStats
        from nanovllm_cli.records import RecordBuilder

        rows: list[tuple[RowRequest | RowError, str]] = []  # each row parsed, and its fingerprint
        anonymous: set[str] = set()  # the ids given to rows without one (their records' id is null)
        for index, row in enumerate(_batch_rows(batch)):
            parsed, fingerprint = self._parse(index, row, anonymous)
            rows.append((parsed, fingerprint))
        written = RecordList()
        builder = RecordBuilder(self.layout, self.llm.info.model, {row.id: fp for row, fp in rows}, self.llm.prompts)
        runner = BatchRunner(EngineFeeder(self.llm), written, builder, RunStats(rows_total=len(rows)),
                             window=max(len(rows), 1), reorder=self.reorder, skip_ids=set(), on_step=lambda: None)
        runner.run(row for row, _ in rows)
        by_id: dict[str, list[dict]] = {}
        for record in written.records:  # a repeated id's records (a result, duplicate errors) keep their order
            by_id.setdefault(str(record[self.layout.id_key]), []).append(record)
        records = []
        for row, _ in rows:
            record = by_id[row.id].pop(0)
            if row.id in anonymous:
                record[self.layout.id_key] = None
            records.append(arrow_row(self.layout, record))
        return pa.Table.from_pylist(records, schema=self.schema)

    def _parse(self, index: int, row: dict, anonymous: set[str]) -> tuple[RowRequest | RowError, str]:
        """A dataset row -> the parsed row and its fingerprint. A row without an id gets one here, from its
        content (so its derived seed does not depend on batching), added to `anonymous`."""
        value = drop_nulls(row)
        fingerprint = row_fingerprint(value)
        key = self.layout.id_key
        if value.get(key) is not None:  # its place in error messages: "row with id 'a'"
            return self._parser("row with id").parse(repr(value[key]), value), fingerprint
        row_id = fingerprint
        while row_id in anonymous:  # the same row twice in a batch
            row_id += "+"
        anonymous.add(row_id)
        return self._parser("batch row").parse(index + 1, {**value, key: row_id}), fingerprint

    def _parser(self, label: str) -> RowParser:
        if label not in self.parsers:
            self.parsers[label] = RowParser(self.defaults, self.seed, label) if self.layout.task is None \
                else PoolingRowParser(self.seed, label, self.layout.task, self.pooling)
        return self.parsers[label]

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.exit()


def _batch_rows(batch) -> list[dict]:
    """The rows of a batch, which must be Arrow: numpy and pandas batches turn an integer field that some rows
    lack (`max_tokens`, `seed`) into floats, which the row parser would rightly refuse."""
    import pyarrow as pa

    if not isinstance(batch, pa.Table):
        raise TypeError(f"LLMProcessor takes Arrow batches, not {type(batch).__name__}: pass batch_format=\"pyarrow\" "
                        "to map_batches (numpy and pandas batches turn integers that some rows lack into floats)")
    return batch.to_pylist()
