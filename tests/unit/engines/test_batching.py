"""The torch engine's continuous batching (engines.scheduler): concurrent requests share steps,
leave when done or cancelled, and a full queue or a long wait is an error, never a hang."""

from __future__ import annotations

import threading
import time

import pytest
from dflash_fixtures import write_tiny_checkpoint, write_tiny_drafter

from dflash_trt.dflash.prefix import common_prefix
from dflash_trt.engines.base import SamplingParams, collect
from dflash_trt.engines.scheduler import EngineBusy

PROMPTS = ["hello", "The quick brown fox jumps", "a", "élan 中文 and more text here", "xyz",
           "def f(x):\n    return"]
LENGTHS = [30, 12, 45, 8, 25, 33]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    target = write_tiny_checkpoint(root / "target")
    return target, write_tiny_drafter(target, root / "drafter")


def wait_idle(engine, timeout_s: float = 10) -> int:
    """Rows still in the batch once it settles (a row leaves just after its last step)."""
    deadline = time.monotonic() + timeout_s
    while engine._scheduler.active and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine._scheduler.active


def load(dirs, **kwargs):
    from dflash_trt.engines.torch_engine import TorchEngine

    return TorchEngine.load(dirs[0], dirs[1], dtype="float64", max_seq_len=256, **kwargs)


@pytest.fixture(scope="module")
def serial(dirs):
    return load(dirs)


@pytest.fixture(scope="module")
def references(serial):
    """Each prompt's own plain greedy output from the batch-1 engine."""
    ids = [serial.tokenize(p, chat=True) for p in PROMPTS]
    return ids, [collect(serial.stream(i, SamplingParams(max_new_tokens=n, num_draft_tokens=0)))
                 for i, n in zip(ids, LENGTHS, strict=True)]


def test_concurrent_streams_equal_each_requests_plain_greedy(dirs, references):
    ids, refs = references
    engine = load(dirs, max_batch_size=4)
    results = [None] * len(ids)

    def one(i):
        time.sleep(0.05 * i)  # staggered arrivals: rows join a running batch
        results[i] = collect(engine.stream(ids[i], SamplingParams(max_new_tokens=LENGTHS[i])))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert [r.token_ids for r in results] == [r.token_ids for r in refs]
        assert [r.text for r in results] == [r.text for r in refs]
        assert sum(r.total_draft_tokens for r in results) > 0
        assert wait_idle(engine) == 0  # every row left when its request finished
    finally:
        engine.close()


def test_prompts_that_start_alike_reuse_the_kept_start_and_stay_exact(dirs, serial):
    """With engine.prefix_cache_tokens, a later prompt copies the keys and values of the start it
    shares with an earlier one (here 20 bytes and the chat template's); every output is still
    its own plain greedy output."""
    prompts = ["The quick brown fox jumps", "The quick brown fox sleeps", "The quick brown fox"]
    ids = [serial.tokenize(p, chat=True) for p in prompts]
    plain = SamplingParams(max_new_tokens=12, num_draft_tokens=0)
    refs = [collect(serial.stream(i, plain)).token_ids for i in ids]
    engine = load(dirs, max_batch_size=2, prefix_cache_tokens=4096)
    try:
        steps = [list(engine.stream(i, SamplingParams(max_new_tokens=12))) for i in ids]
        assert [[t for s in mine for t in s.token_ids] for mine in steps] == refs
        shared = [0, common_prefix(ids[0], ids[1]),
                  max(common_prefix(ids[2], ids[0]), common_prefix(ids[2], ids[1]))]
        assert min(shared[1:]) >= 20 and engine._scheduler.decoder.prefixes.reused == sum(shared)
        # each stream's first step says how many of its prompt tokens were reused; no other does
        assert [[s.cached_tokens for s in mine[:2]] for mine in steps] == [[n, 0] for n in shared]
    finally:
        engine.close()


def test_cancelled_stream_frees_its_row_and_others_finish(dirs, references):
    ids, refs = references
    engine = load(dirs, max_batch_size=2)
    try:
        quitter = engine.stream(ids[2], SamplingParams(max_new_tokens=200))
        next(quitter)
        next(quitter)
        other = engine.stream(ids[0], SamplingParams(max_new_tokens=LENGTHS[0]))
        first = next(other)
        quitter.close()  # the client went away mid-batch
        rest = collect(other)
        assert list(first.token_ids) + rest.token_ids == refs[0].token_ids
        assert wait_idle(engine) == 0
    finally:
        engine.close()


def test_a_full_queue_and_a_long_wait_are_errors(dirs, references):
    ids, _ = references
    engine = load(dirs, max_batch_size=2, max_queue=1, queue_timeout_s=0.3)
    try:
        busy = [engine.stream(ids[0], SamplingParams(max_new_tokens=200)) for _ in range(2)]
        for stream in busy:
            next(stream)  # both rows taken, for longer than the timeout
        errors = []

        def wait():
            try:
                collect(engine.stream(ids[1], SamplingParams(max_new_tokens=5)))
            except EngineBusy as exc:
                errors.append(str(exc))

        decoder = engine._scheduler.decoder
        step = decoder.decode  # slowed, so the busy rows outlast the timeout on any CPU (on a
        decoder.decode = lambda: (time.sleep(0.02), step())[1]  # fast one they ended in 0.15 s)
        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.1)  # the waiter holds the only queue place
        with pytest.raises(EngineBusy, match="engine.max_queue 1"):
            next(engine.stream(ids[1], SamplingParams(max_new_tokens=5)))
        waiter.join(timeout=30)
        assert len(errors) == 1 and "no batch slot within 0.3 s" in errors[0]
        for stream in busy:
            stream.close()
    finally:
        engine.close()


def test_sampled_requests_in_a_batch_are_reproducible_by_seed(dirs, references):
    ids, _ = references
    engine = load(dirs, max_batch_size=3)
    params = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=s) for s in (1, 2, 3)]
    try:
        def batch():
            out = [None] * 3
            threads = [threading.Thread(target=lambda i=i: out.__setitem__(
                i, collect(engine.stream(ids[i], params[i])).token_ids)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            return out

        first = batch()
        assert first == [collect(engine.stream(ids[i], params[i])).token_ids for i in range(3)]
        assert len({tuple(t) for t in first}) == 3
    finally:
        engine.close()


def test_half_precision_refuses_batching(dirs):
    from dflash_trt.errors import UsageError

    with pytest.raises(UsageError, match="row-wise attention.*max_batch_size: 1"):
        from dflash_trt.engines.torch_engine import TorchEngine

        TorchEngine.load(dirs[0], dirs[1], dtype="bfloat16", max_batch_size=2)


def test_a_batching_engine_loads_on_one_thread_and_steps_on_all(dirs, monkeypatch):
    """On CPU the loading thread must not own an OpenMP team beside the scheduler's
    (engines.cpu_threads): the model loads on one torch thread, the caller gets its thread count
    back, and the scheduler's thread claims that count before its first step."""
    import torch

    from dflash_trt.engines import cpu_threads
    from dflash_trt.formats import load as formats_load

    at_start = torch.get_num_threads()
    torch.set_num_threads(max(2, at_start))  # so that one thread differs from all of them
    before = torch.get_num_threads()
    seen, claimed = [], []
    real_load, real_claim = formats_load.load_target, cpu_threads.claim

    def load_target(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_load(*args, **kwargs)

    def claim(threads):
        claimed.append((threading.current_thread().name, threads))
        real_claim(threads)

    monkeypatch.setattr(formats_load, "load_target", load_target)
    monkeypatch.setattr(cpu_threads, "claim", claim)
    engine = load(dirs, max_batch_size=2)
    try:
        assert seen == [1] and torch.get_num_threads() == before == engine.threads
        collect(engine.stream(engine.tokenize("hi"), SamplingParams(max_new_tokens=3)))
        assert claimed == [("dflash-batch", before)]
        serial = load(dirs)  # batch 1 computes on the caller's thread: loading leaves it alone
        assert seen == [1, before] and serial.threads == before
    finally:
        engine.close()
        torch.set_num_threads(at_start)


def test_loading_threads_change_nothing_off_the_cpu():
    import torch

    from dflash_trt.engines import cpu_threads

    before = torch.get_num_threads()
    for device in ("cuda:0", None):
        with cpu_threads.loading(device) as threads:
            assert threads == before == torch.get_num_threads()
    with cpu_threads.loading("cpu") as threads:
        assert threads == before and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
