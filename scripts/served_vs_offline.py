"""The same engine served and offline, interleaved, so a drifting machine hits both.

    .venv/bin/python scripts/served_vs_offline.py ENGINE_DIR --url 127.0.0.1:18001 \
        [--prompts builtin:chat] [--num-prompts 8] [--max-tokens 48] [--repeats 2] \
        [--concurrency 1]

A server of ENGINE_DIR's Triton repository must be up (`dflash-trt serve`, gRPC port in --url).
At --concurrency 1, for every repeat, prompt and mode (plain = num_draft_tokens 0, then dflash)
one request goes to the server and then the same one to the engine loaded here (while the server
idles), each timed from send to its last token. At --concurrency N > 1 the unit is the whole
prompt set instead: N client threads (one gRPC client each) share the prompts, served, then N
threads send the same prompts to the engine here; each timed from the first send to the last
token. Prints tokens/s per place and mode (all tokens / all seconds, per repeat, then the median)
and whether the served tokens equal the offline ones (with N > 1 rows batch differently in the
two places, so float32 ties may differ).

With --watch PID (repeatable: tritonserver, the Python backend stub) it also prints, per mode,
how many cores each watched process and this one kept busy while requests were served: CPU
seconds from /proc over served wall seconds, with the busiest threads of each. This process is
the client then, and the offline engine's threads, idle but for libgomp's spin after a request.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_trt.engines import load_engine
from dflash_trt.engines.base import SamplingParams
from dflash_trt.prompts import all_prompts
from dflash_trt.serving.client import GenerateRequest, GrpcClient

MODES = {"plain": 0, "dflash": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompts", default="builtin:chat")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight in each place (> 1: the prompt set is the unit)")
    parser.add_argument("--watch", type=int, action="append", default=[],
                        help="a process whose CPU use while serving to report (repeatable)")
    args = parser.parse_args()

    engine = load_engine(args.engine_dir)
    chat = engine_chat(args.engine_dir)
    clients = [GrpcClient(args.url) for _ in range(args.concurrency)]  # one stream each
    prompts = all_prompts(args.prompts)[:args.num_prompts]
    units = [[p] for p in prompts] if args.concurrency == 1 else [prompts]
    totals = {(where, mode): [] for where in ("served", "offline") for mode in MODES}
    cpu = {mode: collections.Counter() for mode in MODES}  # (pid, tid) -> CPU s; "wall" -> s
    per_forward = {key: [0, 0] for key in totals}  # tokens, forwards over all repeats

    # Each returns a request's tokens per target forward (a streamed response carries one's).
    def send_served(client, prompt, drafts):
        return [chunk.token_ids for chunk in client.stream(GenerateRequest(
            prompt, max_tokens=args.max_tokens, temperature=0.0, num_draft_tokens=drafts))
            if chunk.token_ids]

    def send_offline(_, prompt, drafts):
        return [step.token_ids for step in engine.stream(
            engine.tokenize(prompt, chat=chat),
            SamplingParams(max_new_tokens=args.max_tokens, num_draft_tokens=drafts))
            if step.token_ids]

    same = True
    try:
        for _ in range(args.repeats):
            run = {key: [0, 0.0, 0] for key in totals}  # tokens, seconds, forwards
            for unit in units:
                for mode, drafts in MODES.items():
                    before = _cpu_seconds(args.watch)
                    began = time.perf_counter()
                    served_out = _run(send_served, clients, unit, drafts)
                    _add(run["served", mode], served_out, began)
                    for key, value in _cpu_seconds(args.watch).items():
                        cpu[mode][key] += value - before.get(key, 0.0)  # a new thread: all of it
                    cpu[mode]["wall"] += time.perf_counter() - began
                    began = time.perf_counter()
                    offline_out = _run(send_offline, clients, unit, drafts)
                    _add(run["offline", mode], offline_out, began)
                    same &= _flat(served_out) == _flat(offline_out)
            for key, (tokens, seconds, forwards) in run.items():
                totals[key].append(tokens / seconds)
                per_forward[key][0] += tokens
                per_forward[key][1] += forwards
    finally:
        engine.close()
        for client in clients:
            client.close()
    for mode in MODES:
        served, offline = (statistics.median(totals[w, mode]) for w in ("served", "offline"))
        runs = ", ".join(f"{s:.1f}/{o:.1f}" for s, o in zip(totals["served", mode],
                                                            totals["offline", mode], strict=True))
        print(f"{mode}: served {served:.1f} tok/s, offline {offline:.1f} tok/s, served/offline "
              f"{served / offline:.3f} (per repeat served/offline: {runs}); tokens per forward "
              + ", ".join(f"{where} {t / max(f, 1):.3f}" for where in ("served", "offline")
                          for t, f in [per_forward[where, mode]]))
        if args.watch:
            print(_cpu_report(cpu[mode]))
    print("served tokens equal offline tokens:", same)


def engine_chat(engine_dir: Path) -> bool:
    from dflash_trt.engines.spec import EngineSpec

    return bool(EngineSpec.read(engine_dir).chat_template)


def _cpu_seconds(pids: list[int]) -> collections.Counter:
    """CPU seconds so far of each process in `pids` and of this one ((pid, None): the whole
    process, threads that ended included) and of each of their threads ((pid, tid))."""
    seconds = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")

    def read(path: str) -> float | None:
        try:
            with open(path) as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            return None
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    for pid in [*pids, os.getpid()]:
        seconds[pid, None] = read(f"/proc/{pid}/stat") or 0.0
        for tid in os.listdir(f"/proc/{pid}/task"):
            value = read(f"/proc/{pid}/task/{tid}/stat")
            if value is not None:
                seconds[pid, int(tid)] = value
    return seconds


def _cpu_report(cpu: collections.Counter) -> str:
    """Cores each process kept busy while serving, and its three busiest threads."""
    wall, lines = cpu["wall"], []
    for pid in sorted({key[0] for key in cpu if key != "wall"}):
        threads = sorted((s for key, s in cpu.items()
                          if key != "wall" and key[0] == pid and key[1] is not None), reverse=True)
        name = ("this process (the client, beside the idle offline engine)"
                if pid == os.getpid() else f"pid {pid}")
        lines.append(f"  {name}: {cpu[pid, None] / wall:.3f} cores; busiest threads "
                     + ", ".join(f"{s / wall:.3f}" for s in threads[:3]))
    return "\n".join(lines)


def _run(send, clients: list, prompts: list[str], drafts: int | None) -> list:
    """Each prompt's output from `send(client, prompt, drafts)`, len(clients) at a time."""
    if len(clients) == 1:
        return [send(clients[0], prompt, drafts) for prompt in prompts]
    free: queue.Queue = queue.Queue()
    for client in clients:
        free.put(client)

    def one(prompt):
        client = free.get()
        try:
            return send(client, prompt, drafts)
        finally:
            free.put(client)

    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        return list(pool.map(one, prompts))


def _flat(outputs: list[list[tuple[int, ...]]]) -> list[list[int]]:
    return [[t for step in steps for t in step] for steps in outputs]


def _add(acc: list, outputs: list[list[tuple[int, ...]]], began: float) -> None:
    acc[0] += sum(len(step) for steps in outputs for step in steps)
    acc[1] += time.perf_counter() - began
    acc[2] += sum(len(steps) for steps in outputs)


if __name__ == "__main__":
    main()
