"""`dflash-trt serve` (a real tritonserver on a model repository) and `dflash-trt query`.

tritonclient and the server module are imported inside the commands.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import click

from dflash_trt.errors import DflashTrtError, UsageError

DEMO_PORT = 0  # 0 = pick a free port


def _url(value: str) -> str:
    if "://" in value or ":" not in value:
        raise UsageError(f"--url {value!r}: expected HOST:PORT (e.g. localhost:8001 for gRPC, "
                         "localhost:8000 for HTTP), without a scheme")
    return value


class _Stop(Exception):
    """Raised from the SIGTERM handler so `finally` stops the server."""


def _on_sigterm(signum, frame):
    raise _Stop()


@click.command("serve")
@click.argument("repo", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--http-port", type=click.IntRange(0, 65535), default=None,
              help="HTTP port (default 8000; 0 = any free port).")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=None,
              help="gRPC port (default 8001; 0 = any free port).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Prometheus metrics port (default 8002; 0 = any free port).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (0.0.0.0 to accept remote clients).")
@click.option("--tritonserver", "tritonserver", type=click.Path(dir_okay=False), default=None,
              help="tritonserver binary (default: PATH, else the one in nvidia-pytriton).")
@click.option("--model-name", default="dflash", show_default=True,
              help="Model to query with --query.")
@click.option("--query", "query_text", default=None, metavar="PROMPT",
              help="Start, stream one answer to PROMPT with its stats, stop (for demos). "
                   "Ports default to free ones.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="max_tokens for --query.")
def serve(repo: Path, http_port, grpc_port, metrics_port, host, tritonserver, model_name,
          query_text, max_tokens) -> None:
    """Serve a Triton model repository (from `dflash-trt build`) until Ctrl-C or SIGTERM."""
    from dflash_trt.serving.server import TritonServer

    default = DEMO_PORT if query_text is not None else None

    def port(value, standard):
        value = value if value is not None else (standard if default is None else default)
        return value or None  # None: TritonServer picks a free port

    server = TritonServer(repo, http_port=port(http_port, 8000), grpc_port=port(grpc_port, 8001),
                          metrics_port=port(metrics_port, 8002), tritonserver=tritonserver,
                          host=host)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        click.echo(f"starting tritonserver on {repo} ...", err=True)
        server.start()
        click.echo(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  "
                   f"metrics {server.metrics_url}", err=True)
        if query_text is not None:
            _demo_query(server.grpc_url, model_name, query_text, max_tokens)
            return
        click.echo("Ctrl-C to stop", err=True)
        while server.is_running():
            time.sleep(0.5)
        raise DflashTrtError(f"tritonserver exited unexpectedly; its log ends:\n"
                             f"{server.log_tail()}")
    except (KeyboardInterrupt, _Stop):
        click.echo("stopping ...", err=True)
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def _demo_query(url: str, model_name: str, prompt: str, max_tokens: int | None) -> None:
    from dflash_trt.serving.client import GenerateRequest, GenerateResult, GrpcClient

    client = GrpcClient(url, model_name)
    try:
        click.echo(f"> {prompt}", err=True)
        result = GenerateResult()
        for chunk in client.stream(GenerateRequest(prompt=prompt, max_tokens=max_tokens)):
            result.add(chunk)
            click.echo(chunk.text, nl=False)
        click.echo()
        click.echo(_stats_line(result), err=True)
    finally:
        client.close()


def _stats_line(result) -> str:
    accepted = result.total_accepted_draft_tokens
    drafted = result.total_draft_tokens
    rate = f" ({accepted / drafted:.0%})" if drafted else ""
    length = result.acceptance_length or 0.0
    return (f"[{len(result.token_ids)} tokens in {result.num_responses} responses, "
            f"acceptance length {length:.2f}, accepted drafts {accepted}/{drafted}{rate}]")


@click.command("query")
@click.option("--url", required=True, callback=lambda c, p, v: _url(v),
              help="Triton endpoint HOST:PORT (the gRPC or HTTP port).")
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--model-name", default="dflash", show_default=True, help="Triton model name.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompts-file", default=None,
              help="A .txt (one prompt per line) or .jsonl (field `prompt`) file, or builtin:chat.")
@click.option("--stream", is_flag=True, help="Print text as it arrives.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens to generate (default: the model's).")
@click.option("--temperature", type=click.FloatRange(min=0), default=None,
              help="0 = greedy (default: the model's).")
@click.option("--num-draft-tokens", type=click.IntRange(min=0), default=None,
              help="Draft tokens per step; 0 = no speculation (baseline).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Sampling seed.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per prompt: text, token ids, acceptance statistics.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=600,
              show_default=True, help="Seconds to wait for a response.")
def query(url, protocol, model_name, prompts, prompts_file, stream, max_tokens, temperature,
          num_draft_tokens, seed, as_json, timeout_s) -> None:
    """Send prompts to a served dflash model and print the answers."""
    from dflash_trt.serving.client import GenerateRequest, GenerateResult, connect, generate_once

    if bool(prompts) == bool(prompts_file):
        raise UsageError("give --prompt TEXT (repeatable) or --prompts-file FILE, not both "
                         "and not neither")
    if prompts_file:
        from dflash_trt.prompts import load_prompts

        prompts = tuple(load_prompts(prompts_file))
    client = connect(url, protocol, model_name, timeout_s)
    try:
        for prompt in prompts:
            request = GenerateRequest(prompt=prompt, max_tokens=max_tokens,
                                      temperature=temperature, seed=seed,
                                      num_draft_tokens=num_draft_tokens)
            if stream:
                result = GenerateResult()
                for chunk in client.stream(request):
                    result.add(chunk)
                    if not as_json:
                        click.echo(chunk.text, nl=False)
                        sys.stdout.flush()
            else:
                result = generate_once(client, request)
                if not as_json:
                    click.echo(result.text, nl=False)
            if as_json:
                click.echo(json.dumps({"prompt": prompt, **result.as_dict()}))
            else:
                click.echo()
                click.echo(_stats_line(result), err=True)
    finally:
        client.close()


COMMANDS = [serve, query]
