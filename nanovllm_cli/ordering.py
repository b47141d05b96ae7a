"""`run --ordered`: records written in INPUT's order, though rows finish in any order.

`OrderedWriter` holds a finished row's record until every row before it in INPUT has its record, then writes the
run of records that are ready. `OrderedEngine` bounds what is held: while it holds `window` records or more, the
job reads no new rows (the row they wait for is in the engine, so the job keeps stepping until it finishes). A
stopped job writes what it holds, in order, with gaps where rows did not finish; `--resume` adds those after.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from nanovllm_cli.rows import RowError, RowRequest
from nanovllm_cli.writers import Writer


class OrderedWriter:
    def __init__(self, writer: Writer, id_key: str):
        self.writer = writer
        self.id_key = id_key
        self.expected: deque[str] = deque()  # ids of the rows read, in INPUT order, whose record is not written
        self.held: dict[str, dict] = {}

    @property
    def records_kept(self) -> int:
        return self.writer.records_kept

    def rows(self, rows: Iterable[RowRequest | RowError], skip_ids: set[str]) -> Iterator[RowRequest | RowError]:
        """`rows`, noting the order of those the job answers (not those OUTPUT already has)."""
        for row in rows:
            if row.id not in skip_ids:
                self.expected.append(row.id)
            yield row

    def write(self, record: dict) -> None:
        self.held[str(record[self.id_key])] = record
        while self.expected and self.expected[0] in self.held:
            self.writer.write(self.held.pop(self.expected.popleft()))

    def sync_if_due(self) -> None:
        self.writer.sync_if_due()

    def close(self) -> None:
        """Write what is held, in INPUT order (a stopped job leaves gaps), then close."""
        try:
            for row_id in self.expected:
                if row_id in self.held:
                    self.writer.write(self.held.pop(row_id))
        finally:
            self.writer.close()


class OrderedEngine:
    """An engine (job.Engine) that takes no new rows while `writer` holds `window` records or more."""

    def __init__(self, engine, writer: OrderedWriter, window: int):
        self._engine = engine
        self._writer = writer
        self._window = window

    def wants_rows(self) -> bool:
        return len(self._writer.held) < self._window and self._engine.wants_rows()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
