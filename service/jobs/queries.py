"""SQL and argument checks shared by the job and the batch halves of the store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from service.jobs.db import Row, Tx

# Queued jobs end at once; a running job's owner sees the request and finishes it as cancelled.
# Completed with "id = ?" or "batch_id = ?".
CANCEL_JOBS_WHERE = """
UPDATE jobs SET cancel_requested = TRUE,
    finished_at = CASE WHEN status = 'queued' THEN {now} ELSE finished_at END,
    status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END
WHERE status IN ('queued', 'running') AND """


def select_page(
    tx: Tx, table: str, columns: str, *, limit: int, after: str | None, equals: Mapping[str, str | None]
) -> list[Row]:
    """Newest rows first, after the row with id `after`; `equals` filters on columns (None: no filter).
    `table`, `columns` and the keys of `equals` are constants of the caller, never request data."""
    check_limit(limit)
    where = ["TRUE"]
    params: list[Any] = []
    for column, value in equals.items():
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if after is not None:
        where.append(f"num < (SELECT num FROM {table} WHERE id = ?)")
        params.append(after)
    sql = f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} ORDER BY num DESC LIMIT ?"
    return tx.all(sql, (*params, limit))


def check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")


def check_one_of(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(sorted(allowed))}; got {value!r}")
