"""Plain decoding through the batching decoder, on the thread that loaded the model or another.

    .venv/bin/python scripts/thread_teams_bench.py ENGINE_DIR MODE [--prompts builtin:chat]

MODE is where the model loads and where it decodes (torch CPU threads in brackets):
  main       loads and decodes on the main thread (all threads), as a script does
  one        the same on one thread
  thread     loads on the main thread (all threads), decodes on another (all threads): how the
             batching engine ran before engines.cpu_threads
  load-one   loads on the main thread (one thread), decodes on another (all threads): how the
             batching engine runs now
  main-work  as load-one, but the main thread runs parallel work (200 matmuls, all threads)
             before decoding starts: how a cost model measured at load ran before
             engines.cpu_threads.apart
  apart-work as main-work, the work on a short-lived thread (cpu_threads.apart): how it runs now
Each mode decodes 8 prompts x 48 tokens at 1 and then 4 rows, twice, and prints tokens/s. Run one
mode per process: libgomp's thread teams live as long as the threads that started them.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch

MODES = ("main", "one", "thread", "load-one", "main-work", "apart-work")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--prompts", default="builtin:chat")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    if args.mode in ("one", "load-one", "main-work", "apart-work"):
        torch.set_num_threads(1)

    from dflash_trt.dflash.batch import BatchDecoder, Request
    from dflash_trt.engines.spec import EngineSpec
    from dflash_trt.engines.torch_engine import TorchEngine
    from dflash_trt.prompts import all_prompts

    spec = EngineSpec.read(args.engine_dir)  # max_batch_size 1: the loading thread is left alone
    engine = TorchEngine.load(spec.checkpoint(args.engine_dir, "target"),
                              spec.checkpoint(args.engine_dir, "drafter"), dtype=spec.dtype)
    ids = [engine.tokenize(p, chat=True) for p in all_prompts(args.prompts)[:8]]
    decoder = BatchDecoder(engine.target, engine.drafter, block_size=engine.block_size,
                           max_rows=4, max_seq_len=spec.max_seq_len)

    def tokens_per_s(rows: int) -> float:
        began, tokens = time.perf_counter(), 0
        for start in range(0, len(ids), rows):
            batch = [decoder.add(Request(i, 48, num_draft_tokens=0)) for i in ids[start:start + rows]]
            while any(row.finish is None for row in batch):
                tokens += sum(len(step.token_ids) for _, step in decoder.step())
            for row in batch:
                decoder.remove(row)
        return tokens / (time.perf_counter() - began)

    def work() -> None:
        x, w = torch.randn(256, 576), torch.randn(1536, 576)
        for _ in range(200):
            x @ w.T

    if args.mode == "main-work":
        torch.set_num_threads(threads)
        work()
    elif args.mode == "apart-work":
        from dflash_trt.engines import cpu_threads

        cpu_threads.apart(threads, work)

    def run() -> None:
        if args.mode in ("load-one", "main-work", "apart-work"):
            torch.set_num_threads(threads)
        for rows in (1, 4, 1, 4):
            print(f"{args.mode}: {rows} rows, {tokens_per_s(rows):.1f} tok/s "
                  f"({threading.current_thread().name}, {torch.get_num_threads()} threads)",
                  flush=True)

    if args.mode in ("main", "one"):
        run()
    else:
        worker = threading.Thread(target=run, name="decoder")
        worker.start()
        worker.join()


if __name__ == "__main__":
    main()
