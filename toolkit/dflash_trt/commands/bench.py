"""`dflash-trt bench` (served, over Triton) and `dflash-trt bench-offline` (engine level).

Heavy imports (tritonclient, torch, transformers, matplotlib) happen inside the commands.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import click

from dflash_trt.errors import DflashTrtError, UsageError


class ConcurrencyList(click.ParamType):
    """A comma-separated list of positive integers: 1,2,4,8."""

    name = "LIST"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            levels = tuple(int(v) for v in str(value).split(",") if v.strip())
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers (e.g. 1,2,4,8)",
                      param, ctx)
        if not levels or any(v < 1 for v in levels):
            self.fail(f"{value!r}: every concurrency must be >= 1 (e.g. 1,2,4,8)", param, ctx)
        if len(set(levels)) != len(levels):
            self.fail(f"{value!r}: concurrency levels repeat", param, ctx)
        return levels


def _url(value: str) -> str:
    if "://" in value or ":" not in value:
        raise UsageError(f"--url {value!r}: expected HOST:PORT (e.g. localhost:8001 for gRPC, "
                         "localhost:8000 for HTTP), without a scheme")
    return value


def _progress():
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=False)


@click.command("bench")
@click.option("--url", required=True, help="Triton endpoint HOST:PORT (gRPC or HTTP port).")
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--model-name", default="dflash", show_default=True, help="Triton model name.")
@click.option("--prompts", "prompt_spec", required=True, metavar="FILE|builtin:humaneval|builtin:chat",
              help="Prompt set: a .txt/.jsonl file or a builtin set.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Use only the first N prompts (default: all, cycled).")
@click.option("--concurrency", type=ConcurrencyList(), default="1,2,4,8", show_default=True,
              help="Concurrency levels to sweep (closed loop).")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=32,
              show_default=True, help="Requests per level (and per mode with --baseline).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--baseline", is_flag=True,
              help="Also run every level with num_draft_tokens=0 and report the speedup.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per level and mode, back to back in alternating order; the speedups "
                   "are medians over them.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Unmeasured requests per mode before the sweep.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=600.0,
              show_default=True, help="Seconds without a response before a request counts as timed out.")
@click.option("--output", "output_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True)
def bench_command(url, protocol, model_name, prompt_spec, num_prompts, concurrency, num_requests,
                  max_tokens, temperature, baseline, repeats, warmup, timeout_s, output_dir):
    """Load-test a served DFlash model: TTFT, ITL, latency, throughput, acceptance."""
    from dflash_trt.bench import served as bench
    from dflash_trt.prompts import load_prompts

    url = _url(url)
    prompts = load_prompts(prompt_spec, num_prompts)
    config = bench.BenchConfig(concurrency=concurrency, num_requests=num_requests,
                               max_tokens=max_tokens, warmup=warmup, baseline=baseline,
                               temperature=temperature, timeout_s=timeout_s, repeats=repeats)
    meta = {"url": url, "protocol": protocol, "model": model_name, "prompts": prompt_spec,
            "num_prompts": len(prompts), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": platform.node(), "machine": platform.machine()}
    make_sender = bench.triton_sender_factory(url, protocol, model_name)

    with _progress() as progress:
        current = {}

        def on_level(mode, level, total):
            label = mode if level == 0 else f"{mode} c={level}"
            current["task"] = progress.add_task(label, total=total)

        def on_done(_timeline):
            progress.advance(current["task"])

        result = bench.run_benchmark(make_sender, prompts, config, meta, on_level=on_level,
                                     on_done=on_done)
    paths = bench.write_outputs(result, output_dir)
    click.echo(bench.markdown(result))
    click.echo("wrote " + ", ".join(str(p) for p in paths))
    if result.num_errors:
        raise DflashTrtError(f"{result.num_errors} requests failed or timed out (counted in the "
                             f"results); see {paths[1]}")


@click.command("bench-offline")
@click.option("--target", required=True, metavar="SRC",
              help="Target checkpoint: a HF directory, a .gguf file or pkg:<package>/<file>.")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False),
              help="DFlash drafter directory (e.g. build/<name>/resolved/drafter).")
@click.option("--prompts", "prompt_spec", required=True, metavar="FILE|builtin:humaneval|builtin:chat")
@click.option("--num-prompts", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved repeats; the report takes medians over them.")
@click.option("--chat", is_flag=True, help="Wrap prompts in the target's chat template.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="Drafting block size (default: the drafter's).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch CPU threads (default: torch's choice). On a shared CPU, 1 avoids "
                   "thread contention that can slow every contender by an order of magnitude.")
@click.option("--profile", is_flag=True,
              help="Also profile DFlash and plain decoding (cProfile) and write profile.md: "
                   "drafting, target forwards, LM head, acceptance, cache crops, detokenizing.")
@click.option("--prompt-lookup-num-tokens", type=click.IntRange(min=1), default=10,
              show_default=True, help="Draft length of the transformers prompt-lookup contender.")
@click.option("--prompt-lookup", is_flag=True,
              help="Add `dflash+lookup`: DFlash with prompt-lookup drafts where they match.")
@click.option("--adaptive", is_flag=True,
              help="Add `dflash-adaptive`: DFlash verifying per step only the drafts worth their "
                   "cost (step costs measured here first), next to `dflash` (the whole block).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --adaptive, also `dflash-calibrated`: the drafter's confidences mapped "
              "to measured acceptance by the acceptance profile in FILE (an `eval --report` or "
              "a build's reports/verify.json; measure it on other prompts than these).")
@click.option("--output", "output_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True)
def bench_offline_command(target, drafter, prompt_spec, num_prompts, max_new_tokens, repeats,
                          chat, device, dtype, block_size, threads, profile,
                          prompt_lookup_num_tokens, prompt_lookup, adaptive, calibration,
                          output_dir):
    """DFlash vs plain decoding vs transformers generate (greedy, prompt lookup), no server."""
    import torch

    from dflash_trt.bench import offline as off
    from dflash_trt.prompts import load_prompts

    if threads is not None:
        torch.set_num_threads(threads)
    prompts = load_prompts(prompt_spec, num_prompts)
    points = None
    if calibration is not None:
        from dflash_trt.dflash.acceptance import read_calibration

        if not adaptive:
            raise UsageError("--calibration calibrates the adaptive contender; add --adaptive")
        points = read_calibration(calibration)
    loaded = off.load_contenders(target, Path(drafter), device=device, dtype=dtype,
                                 block_size=block_size,
                                 prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                                 prompt_lookup=prompt_lookup, adaptive=adaptive,
                                 calibration=points)
    prompt_ids = [loaded.tokenize(p, chat) for p in prompts]
    with _progress() as progress:
        task = progress.add_task("bench-offline",
                                 total=repeats * len(prompt_ids) * len(loaded.contenders))
        report = off.run_offline(loaded.contenders, prompt_ids, max_new_tokens=max_new_tokens,
                                 repeats=repeats, reference=off.HF_GREEDY,
                                 on_run=lambda *_: progress.advance(task))
    meta = {"target": target, "drafter": str(drafter), "prompts": prompt_spec, "chat": chat,
            "device": loaded.device, "dtype": dtype, "torch_threads": torch.get_num_threads(),
            "block_size": loaded.block_size,
            "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
            "step_costs_ms": loaded.step_costs_ms,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node()}
    paths = off.write_outputs(report, output_dir, meta)
    click.echo(off.markdown(report))
    if profile:
        paths += _write_profile(off, loaded, prompt_ids, max_new_tokens, output_dir)
    click.echo("wrote " + ", ".join(str(p) for p in paths))
    if not report.identical:
        raise DflashTrtError(f"{len(report.mismatches)} greedy outputs differ from "
                             f"{report.reference}; the speed numbers are not comparable "
                             f"(details in {paths[1]})")


def _write_profile(off, loaded, prompt_ids, max_new_tokens, output_dir: Path) -> list[Path]:
    import json

    by_name = {c.name: c for c in loaded.contenders}
    rows = {name: off.profile_breakdown(by_name[name], prompt_ids, max_new_tokens)
            for name in (off.DFLASH, off.DFLASH_ADAPTIVE, off.DFLASH_LOOKUP, off.PLAIN)
            if name in by_name}
    text = "\n".join(off.profile_markdown(r, name) for name, r in rows.items())
    click.echo(text)
    md, js = output_dir / "profile.md", output_dir / "profile.json"
    md.write_text(text)
    js.write_text(json.dumps(rows, indent=2))
    return [md, js]


COMMANDS = [bench_command, bench_offline_command]
