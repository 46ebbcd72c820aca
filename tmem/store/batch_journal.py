"""DuckDB journal of Batch API submissions (tables of ``m005_llm_batches``).

:class:`~tmem.ports.BatchJournal` on ``llm_batches`` / ``llm_batch_requests``: a build
killed while a batch is in flight finds the batch here on its next run and re-attaches to it.
Statements are serialised on fresh cursors, as in :mod:`tmem.store.llm_cache`.
"""

from __future__ import annotations

from datetime import datetime

from tmem.store.llm_cache import _Serialised


class DuckBatchJournal(_Serialised):
    def in_flight(self, digest: str) -> tuple[str, str] | None:
        with self._cursor() as cur:
            row = cur.execute(
                "SELECT r.batch_id, r.custom_id FROM llm_batch_requests r JOIN llm_batches b USING (batch_id) "
                "WHERE r.digest = ? AND b.status = 'submitted' ORDER BY b.submitted_at DESC LIMIT 1",
                [digest],
            ).fetchone()
        return (str(row[0]), str(row[1])) if row else None

    def submitted(
        self, batch_id: str, input_file_id: str, model: str, requests: list[tuple[str, str, str, str | None]],
        at: datetime,
    ) -> None:
        with self._cursor() as cur:
            cur.execute("BEGIN TRANSACTION")
            try:
                cur.execute(
                    "INSERT INTO llm_batches (batch_id, input_file_id, model, requests, status, submitted_at) "
                    "VALUES (?, ?, ?, ?, 'submitted', ?)",
                    [batch_id, input_file_id, model, len(requests), at],
                )
                cur.executemany(
                    "INSERT INTO llm_batch_requests (digest, batch_id, custom_id, operation, conversation_id) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [[digest, batch_id, custom_id, operation, owner] for digest, custom_id, operation, owner in requests],
                )
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    def finished(self, batch_id: str, status: str, at: datetime) -> None:
        with self._cursor() as cur:
            cur.execute("UPDATE llm_batches SET status = ?, finished_at = ? WHERE batch_id = ?", [status, at, batch_id])

    def batches(self) -> list[tuple[str, str, int]]:
        """(batch id, status, requests) of every recorded batch, oldest first."""
        with self._cursor() as cur:
            rows = cur.execute("SELECT batch_id, status, requests FROM llm_batches ORDER BY submitted_at").fetchall()
        return [(str(b), str(s), int(n)) for b, s, n in rows]
