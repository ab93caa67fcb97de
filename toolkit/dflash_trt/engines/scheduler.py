"""Continuous batching for the torch engine: one thread steps a BatchDecoder for every request.

Requests wait in a bounded queue and join the running batch at a step boundary, up to the batch's
rows; a finished or cancelled request leaves at the next boundary and its slot is free at once.
A request that finds the queue full, or waits longer than the admission timeout, gets an error
(EngineBusy), never a hang. Each step's results go to the requests' own queues, so a slow
consumer never stalls the batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from dflash_trt.dflash.batch import BatchDecoder, Request
from dflash_trt.engines import cpu_threads
from dflash_trt.errors import DflashTrtError

_END = object()  # no more steps for this ticket


class EngineBusy(DflashTrtError):
    """The engine cannot take the request now (queue full, or no batch slot in time)."""


class Ticket:
    """One submitted request: iterate for its Steps; `cancel()` takes it out of the batch."""

    def __init__(self, request: Request):
        self.request = request
        self.submitted = time.monotonic()
        self.cancelled = False
        self._out: queue.Queue = queue.Queue()

    def put(self, item) -> None:
        self._out.put(item)

    def cancel(self) -> None:
        self.cancelled = True

    def __iter__(self):
        while True:
            item = self._out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    """Owns a BatchDecoder and the thread that steps it; `lock` guards the model it runs."""

    def __init__(self, decoder: BatchDecoder, lock: threading.Lock, *, max_queue: int,
                 queue_timeout_s: float, threads: int | None = None):
        self.decoder, self.lock = decoder, lock
        self.threads = threads  # torch CPU threads of the stepping thread (engines.cpu_threads)
        self.max_queue, self.queue_timeout_s = max_queue, queue_timeout_s
        self._waiting: deque[Ticket] = deque()
        self._tickets: dict[int, Ticket] = {}  # id(row) -> its ticket
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dflash-batch", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Ticket:
        ticket = Ticket(request)
        with self._wake:
            if self._closed:
                raise EngineBusy("the engine is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise EngineBusy(f"{len(self._waiting)} requests already wait for a batch slot "
                                 f"(engine.max_queue {self.max_queue}); retry later, or raise "
                                 "engine.max_batch_size or engine.max_queue")
            self._waiting.append(ticket)
            self._wake.notify()
        return ticket

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def active(self) -> int:
        return len(self.decoder.rows)

    def _admit(self) -> None:
        """Move waiting requests into free rows; fail those cancelled or waiting too long."""
        now = time.monotonic()
        with self._wake:
            for ticket in list(self._waiting):
                if ticket.cancelled:
                    self._waiting.remove(ticket)
                    ticket.put(_END)
                elif len(self.decoder.rows) < self.decoder.max_rows:
                    self._waiting.remove(ticket)
                    self._tickets[id(self.decoder.add(ticket.request))] = ticket
                elif now - ticket.submitted > self.queue_timeout_s:
                    self._waiting.remove(ticket)
                    ticket.put(EngineBusy(
                        f"no batch slot within {self.queue_timeout_s:g} s (all "
                        f"{self.decoder.max_rows} rows busy, engine.max_batch_size); retry "
                        "later, or raise engine.max_batch_size or engine.queue_timeout_s"))

    def _run(self) -> None:
        if self.threads is not None:
            cpu_threads.claim(self.threads)
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self.decoder.rows:
                    self._wake.wait()
                if self._closed:
                    break
            self._admit()
            try:
                with self.lock:
                    self.decoder.step(each=self._publish_one)
            except Exception as exc:  # a failed forward fails its batch, not the server
                for row in list(self.decoder.rows):
                    self._tickets.pop(id(row)).put(exc)
                    self.decoder.remove(row)
                continue
            for row in list(self.decoder.rows):
                ticket = self._tickets[id(row)]
                if row.finish is not None or ticket.cancelled:
                    self.decoder.remove(row)
                    del self._tickets[id(row)]
                    ticket.put(_END)
        for ticket in [*self._waiting, *self._tickets.values()]:
            ticket.put(EngineBusy("the engine shut down"))

    def _publish_one(self, row, step) -> None:
        ticket = self._tickets[id(row)]
        if not ticket.cancelled:
            ticket.put(step)
