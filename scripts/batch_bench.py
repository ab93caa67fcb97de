"""The batching engine without a server: N concurrent requests, DFlash vs no drafting.

    .venv/bin/python scripts/batch_bench.py ENGINE_DIR --concurrency 8 --requests 16 \
        [--prompts builtin:chat] [--max-tokens 48] [--modes dflash,plain,dflash,plain]

Each mode sends --requests requests (the prompt set cycled, chat template) from --concurrency
threads through the engine's `stream`, as Triton's worker threads do; `plain` asks for
num_draft_tokens=0; `dflash-padded` and `plain-padded` run the batch as before packed forwards
(TorchEngine.packed = False: every row padded to the widest and the chooser pricing that, each
prompt in a forward of its own);
`dflash-separate` and `plain-separate` pack verify forwards but run each prompt in a forward of
its own (fuse_prompts=False); `-noreuse` keeps no prompts for later ones that start the same way
(engine.prefix_cache_tokens 0, dflash.prefix). Suffixes combine (`dflash-padded-noreuse`).
Every run starts a fresh batch (its gates and online costs learn anew). Prints output tokens/s
per mode, and for the decode steps with every row taken (steps that also ran prompt chunks
included): how many ran the drafter, their mean milliseconds and tokens, and the same for the
others.
It separates the engine from the server and its client (`dflash-trt bench`, AIPerf).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from dflash_trt.dflash import batch
from dflash_trt.engines import load_engine
from dflash_trt.engines.base import SamplingParams
from dflash_trt.prompts import all_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompts", default="builtin:chat")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--modes", default="dflash,plain,dflash,plain")
    args = parser.parse_args()

    engine = load_engine(args.engine_dir)
    kept = engine.prefix_cache_tokens
    prompts = all_prompts(args.prompts)
    ids = [engine.tokenize(prompts[i % len(prompts)], chat=True) for i in range(args.requests)]
    steps = []  # (rows, drafter ran, seconds, tokens) of each decode step
    decode = batch.BatchDecoder.decode

    def timed(self):
        began = time.perf_counter()
        out = decode(self)
        if out:
            steps.append((len(self.rows), any(s.draft_source == "dflash" for _, s in out),
                          time.perf_counter() - began, sum(len(s.token_ids) for _, s in out)))
        return out

    batch.BatchDecoder.decode = timed
    try:
        for mode in args.modes.split(","):
            steps.clear()
            engine.close()  # a fresh scheduler and decoder for every run
            base, *suffixes = mode.split("-")
            engine.packed = "padded" not in suffixes
            engine.prefix_cache_tokens = 0 if "noreuse" in suffixes else kept
            decoder = engine._batch().decoder
            decoder.fuse_prompts = decoder.packed and "separate" not in suffixes
            tokens = run(engine, ids, args.concurrency, args.max_tokens,
                         0 if base == "plain" else None)
            full = [s for s in steps if s[0] == args.concurrency]
            print(f"{mode}: {tokens[0] / tokens[1]:.1f} tok/s ({tokens[0]} in {tokens[1]:.1f} s); "
                  f"steps with {args.concurrency} rows: drafter {_mean(full, True)}; "
                  f"others {_mean(full, False)}", flush=True)
    finally:
        engine.close()


def run(engine, ids, concurrency: int, max_tokens: int, num_draft_tokens) -> tuple[int, float]:
    pending, lock, count = iter(range(len(ids))), threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            params = SamplingParams(max_new_tokens=max_tokens, num_draft_tokens=num_draft_tokens)
            for step in engine.stream(ids[i], params):
                with lock:
                    count[0] += len(step.token_ids)

    began = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return count[0], time.perf_counter() - began


def _mean(steps, drafter: bool) -> str:
    mine = [s for s in steps if s[1] == drafter]
    if not mine:
        return "none"
    return (f"{len(mine)} steps, {1000 * sum(s[2] for s in mine) / len(mine):.0f} ms, "
            f"{sum(s[3] for s in mine) / len(mine):.2f} tokens")


if __name__ == "__main__":
    main()
