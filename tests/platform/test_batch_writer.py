"""The batch writer under the usage recorder and the request log, on a real SQLite database:
a row the database refuses is dropped alone (the rows behind it are written), while rows an
unreachable database could not take stay queued, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from loraplex.platform.batch_writer import BatchWriter

pytestmark = pytest.mark.anyio

SCHEMA = "CREATE TABLE t (seq INTEGER NOT NULL, v INTEGER NOT NULL CHECK (v >= 0))"


class TableWriter(BatchWriter[tuple[int, int]]):
    """Writes (seq, v) rows into table ``t`` of the SQLite file at ``path``."""

    def __init__(self, path: Path) -> None:
        super().__init__("test rows", max_pending=100, batch_size=10, flush_interval=0.01,
                         drop_oldest=False)  # fmt: skip
        self.engine = sa.create_engine(f"sqlite:///{path}")

    async def _write_batch(self, batch: list[tuple[int, int]]) -> int:
        with self.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO t (seq, v) VALUES (:seq, :v)"),
                         [{"seq": s, "v": v} for s, v in batch])  # fmt: skip
        return len(batch)

    def rows(self) -> list[tuple[int, int]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text("SELECT seq, v FROM t ORDER BY seq"))]


def make_table(path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(sa.text(SCHEMA))
    engine.dispose()


async def test_a_row_the_database_refuses_is_dropped_and_the_rows_behind_it_are_written(
    tmp_path: Path,
) -> None:
    make_table(tmp_path / "db.sqlite")
    writer = TableWriter(tmp_path / "db.sqlite")
    for row in [(1, 10), (2, -1), (3, 30), (4, -2), (5, 50)]:  # v < 0 breaks the CHECK
        writer.push(row)
    await writer.close()
    assert writer.rows() == [(1, 10), (3, 30), (5, 50)]
    assert (writer.written, writer.rejected, writer.dropped, writer.pending) == (3, 2, 2, 0)
    writer.push((6, 60))  # the writer goes on
    await writer.flush()
    assert writer.rows()[-1] == (6, 60)


async def test_rows_an_unreachable_database_could_not_take_stay_queued_in_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "not-yet" / "db.sqlite"  # its folder is missing: SQLite cannot open it
    writer = TableWriter(path)
    for row in [(1, 10), (2, 20), (3, 30)]:
        writer.push(row)
    with pytest.raises(sa.exc.OperationalError):
        await writer.flush()
    assert (writer.pending, writer.rejected, writer.written) == (3, 0, 0)
    path.parent.mkdir()
    make_table(path)
    assert await writer.flush() == 3
    assert writer.rows() == [(1, 10), (2, 20), (3, 30)]
    await writer.close()
