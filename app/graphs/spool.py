"""Spooling of an upload as it is received: hashed off the event loop, in memory when small, on disk (a named
file the import worker process can open, :mod:`app.graphs.importer`) when large."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import tempfile
from typing import IO

from starlette.concurrency import run_in_threadpool

from app.graphs.importer import WORKER_MIN_BYTES

IN_MEMORY_BYTES = WORKER_MIN_BYTES
"""An upload larger than this (8 MiB) is spooled to a file on disk, and imported in the worker process."""

BATCH_BYTES = 4 * 2**20
"""Received bytes handed to one worker-thread call that hashes and spools them."""


class Spool:
    """An upload's bytes as they arrive: hashed (sha256) and kept in memory up to 8 MiB, then in a named
    temporary file (removed on :meth:`close`), whose path the import worker process opens.

    Received chunks are handed over in batches of about 4 MiB, each hashed and written in a worker thread
    (hashlib and file writes release the GIL) while the event loop receives the next one: hashing overlaps the
    transfer instead of adding to it, and never runs on the event loop (0.3 s for 438 MB). At most two
    batches are held (the one being hashed, the one being received)."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.size = 0
        self.path: str | None = None
        self._memory: io.BytesIO | None = io.BytesIO()
        self._file: IO[bytes] = self._memory
        self._batch: list[bytes] = []
        self._batched = 0
        self._pending: asyncio.Future[None] | None = None

    async def add(self, chunk: bytes) -> None:
        """Take ``chunk`` (called on the event loop) (waits only when the previous batch is still being hashed)."""
        self._batch.append(chunk)
        self._batched += len(chunk)
        self.size += len(chunk)
        if self._batched >= BATCH_BYTES:
            await self._hand_over()

    async def _hand_over(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending
        if self._batch:
            batch, self._batch, self._batched = self._batch, [], 0
            self._pending = asyncio.ensure_future(run_in_threadpool(self._consume, batch))

    def _consume(self, batch: list[bytes]) -> None:
        for chunk in batch:
            self.digest.update(chunk)
        if self._memory is not None and self._memory.tell() + sum(map(len, batch)) > IN_MEMORY_BYTES:
            named = tempfile.NamedTemporaryFile(prefix="layercast-upload-")  # noqa: SIM115 (closed by close())
            named.write(self._memory.getbuffer())
            self._memory, self._file, self.path = None, named, named.name
        self._file.writelines(batch)

    async def finish(self) -> IO[bytes]:
        """Every byte hashed and written: the spool, flushed (its :attr:`path`, if any, is complete) and at 0."""
        await self._hand_over()  # the last (partial) batch
        await self._hand_over()  # ... written
        self._file.flush()
        self._file.seek(0)
        return self._file

    async def close(self) -> None:
        """Wait for a batch still being written (after an error mid-stream), then drop the bytes: a file on disk
        in a worker thread (unlinking 438 MB frees its page cache: 35 ms, on the event loop a stall of every
        other request)."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                await self._pending
            self._pending = None
        if self.path is None:
            self._file.close()
        else:
            await run_in_threadpool(self._file.close)
