"""One OpenMP thread team per process for the batching torch engine on CPU.

PyTorch's CPU kernels run on OpenMP (libgomp), which keeps a team of worker threads for each
thread that starts parallel work. Its workers spin between parallel regions, and only while the
process has no more OpenMP threads than cores; beyond that they sleep at once and every kernel
pays to wake them. So the thread that loads a model (Triton's `initialize`, a script's main thread)
and the scheduler thread that steps the batch must not both own a team: on the 2-core EPYC this
project measures on, the same plain decoding ran 29 tokens/s on the scheduler thread after the
model had loaded on the main thread with two threads, and 48 when it had loaded with one
(docs/benchmarks.md). `loading` keeps the calling thread from starting a team while it loads;
`claim` gives the stepping thread the threads back; `apart` runs other work of the loading thread
(measuring a cost model) on a thread of its own, whose team ends with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def loading(device: str | None) -> Iterator[int]:
    """Run the body on one CPU thread (no OpenMP team); yields the thread count to `claim` later.
    Off the CPU (or with device None) it changes nothing."""
    import torch

    threads = torch.get_num_threads()
    if device != "cpu" or threads == 1:
        yield threads
        return
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


def claim(threads: int) -> None:
    """Give the calling thread `threads` torch CPU threads (its own OpenMP team)."""
    import torch

    torch.set_num_threads(threads)


def apart(threads: int, fn: Callable[..., T], *args) -> T:
    """fn(*args) on a short-lived thread with `threads` torch threads, for the caller's result or
    exception: parallel work the loading thread must not do itself (its team would outlive it)."""
    outcome: dict[str, object] = {}

    def run() -> None:
        claim(threads)
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="dflash-apart")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
