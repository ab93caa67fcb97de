"""Engine commands: `init-drafter`, `generate`, `eval`, `profile` (the torch engine, no recipe
needed)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import click

from dflash_trt.errors import DflashTrtError, UsageError

_DEVICES = click.Choice(["auto", "cpu", "cuda"])
_DTYPES = click.Choice(["float32", "bfloat16", "float16"])


def _layer_ids(_ctx, _param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        ids = [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter("expected integers like 1,8,14") from None
    if not ids or min(ids) < 0:
        raise click.BadParameter("expected non-negative integers like 1,8,14")
    return ids


def _load_engine(target: str, drafter: str | None, device: str, dtype: str,
                 block_size: int | None, max_seq_len: int, prompt_lookup: bool = False,
                 draft_length: str = "fixed"):
    from transformers.utils import logging as hf_logging

    from dflash_trt.engines.torch_engine import TorchEngine
    from dflash_trt.stages.resolve import resolve_source

    hf_logging.set_verbosity_error()  # keep stdout/stderr for our own output
    hf_logging.disable_progress_bar()
    target_dir = resolve_source(target)
    drafter_dir = resolve_source(drafter) if drafter else None
    engine = TorchEngine.load(target_dir, drafter_dir, device=device, dtype=dtype,
                              block_size=block_size, max_seq_len=max_seq_len,
                              prompt_lookup=prompt_lookup)
    if draft_length == "adaptive":
        if engine.drafter is None or engine.block_size < 2:
            raise UsageError("--draft-length adaptive needs a drafter (--drafter DIR)")
        from dflash_trt.engines.cost_model import measure

        engine.cost_model = measure(engine)  # this machine's step costs, a few seconds
    return engine


def run_prompt(engine, prompt_ids, params, on_text=None) -> dict:
    """Generate for one prompt; return the --json fields (timings measured around the stream)."""
    start = time.perf_counter()
    first = None
    text, tokens, lengths, drafted, accepted, finish = "", [], [], 0, 0, None
    lookup_steps, draft_lengths, confidences = 0, [], []
    for step in engine.stream(prompt_ids, params):
        if first is None:
            first = time.perf_counter()
        else:
            lengths.append(len(step.token_ids))  # decode steps only (the prefill yields 1 token)
            draft_lengths.append(step.num_draft_tokens)  # drafts verified by this step
            # the drafter's confidences (empty unless it drafted) and the drafts accepted
            confidences.append([list(step.draft_confidence), step.num_accepted_draft_tokens])
        text += step.text
        tokens.extend(step.token_ids)
        drafted += step.num_draft_tokens
        accepted += step.num_accepted_draft_tokens
        lookup_steps += step.draft_source == "lookup"
        finish = step.finish_reason or finish
        if on_text is not None and step.text:
            on_text(step.text)
    end = time.perf_counter()
    decode_s = end - (first or end)
    return {"text": text, "token_ids": tokens, "num_new_tokens": len(tokens),
            "acceptance_lengths": lengths, "draft_lengths": draft_lengths,
            "draft_confidences": confidences,
            "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else 0.0,
            "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
            "num_lookup_steps": lookup_steps, "finish_reason": finish, "prefill_s": (first or end) - start, "decode_s": decode_s,
            "tokens_per_s": len(tokens) / decode_s if decode_s > 0 else 0.0}


@click.command("init-drafter")
@click.option("--target", required=True, metavar="SRC",
              help="Target model: HF dir, .gguf file, pkg:<package>/<file> or hf:<org>/<name>.")
@click.option("--output", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write the drafter checkpoint into.")
@click.option("--layers", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Drafter decoder layers.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(2, 32),
              help="Tokens per drafted block (max_draft_len + 1).")
@click.option("--target-layer-ids", callback=_layer_ids, default=None, metavar="IDS",
              help="Target layers whose outputs feed the drafter, e.g. 1,8,14 "
                   "(default: the reference rule, evenly spaced).")
@click.option("--mask-token-id", type=click.IntRange(0), default=None,
              help="Token id for masked block positions (default: chosen per tokenizer).")
@click.option("--seed", default=0, show_default=True, type=int, help="Initialisation seed.")
def init_drafter(target: str, output: Path, layers: int, block_size: int,
                 target_layer_ids: list[int] | None, mask_token_id: int | None, seed: int) -> None:
    """Write a randomly initialised (untrained) DFlash drafter shaped for TARGET."""
    from dflash_trt.dflash.drafter_init import init_drafter_for_target
    from dflash_trt.stages.resolve import resolve_source

    if output.exists() and any(output.iterdir()):
        raise UsageError(f"--output {output}: directory is not empty; choose a new directory")
    model = init_drafter_for_target(resolve_source(target), num_layers=layers,
                                    block_size=block_size, target_layer_ids=target_layer_ids,
                                    mask_token_id=mask_token_id, seed=seed)
    model.save_pretrained(output)
    click.echo(f"{output}: DFlash drafter, {layers} layer(s), block_size {model.block_size}, "
               f"target_layer_ids {model.target_layer_ids}, mask_token_id {model.mask_token_id}")


def _sampling_options(f):
    for option in reversed([
        click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1)),
        click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0),
                     help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(0),
                     help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True,
                     type=click.FloatRange(0, 1, min_open=True), help="1 = off."),
        click.option("--seed", default=None, type=int, help="Sampling seed."),
    ]):
        f = option(f)
    return f


def _engine_options(f):
    for option in reversed([
        click.option("--block-size", default=None, type=click.IntRange(1),
                     help="Override the drafter's block size."),
        click.option("--device", default="cpu", show_default=True, type=_DEVICES),
        click.option("--dtype", default="float32", show_default=True, type=_DTYPES),
        click.option("--max-seq-len", default=4096, show_default=True, type=click.IntRange(2)),
        click.option("--prompt-lookup", is_flag=True, help="Draft by n-gram lookup in the prompt "
                     "and output where it matches, with the drafter elsewhere (lossless)."),
        click.option("--draft-length", type=click.Choice(["fixed", "adaptive"]), default="fixed",
                     show_default=True, help="adaptive: verify per step only the drafts worth "
                     "their cost (the step costs are measured on this machine at load)."),
    ]):
        f = option(f)
    return f


@click.command("generate")
@click.option("--target", required=True, metavar="SRC", help="Target model source.")
@click.option("--drafter", default=None, metavar="DIR", help="DFlash drafter checkpoint.")
@click.option("--no-draft", is_flag=True, help="Plain target decoding (the baseline).")
@click.option("--prompt", default=None, help="One prompt.")
@click.option("--prompts-file", default=None, metavar="FILE|builtin:SET",
              help=".txt (one prompt per line), .jsonl (field `prompt`), builtin:humaneval or "
              "builtin:chat.")
@click.option("--num-prompts", default=None, type=click.IntRange(1),
              help="Use only the first N prompts.")
@click.option("--chat", is_flag=True, help="Wrap each prompt in the tokenizer's chat template.")
@click.option("--parse-special-tokens", is_flag=True, help="Parse control tokens written in the "
              "prompt (<|im_start|>, ...) as control tokens; trusted prompts only.")
@_sampling_options
@_engine_options
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt.")
def generate(target, drafter, no_draft, prompt, prompts_file, num_prompts, chat,
             parse_special_tokens, max_new_tokens, temperature, top_k, top_p, seed, block_size, device, dtype, max_seq_len,
             prompt_lookup, draft_length, stream, as_json) -> None:
    """Generate text with DFlash speculative decoding (or plain decoding with --no-draft)."""
    from dflash_trt.engines.base import SamplingParams
    from dflash_trt.prompts import load_prompts

    if (prompt is None) == (prompts_file is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompts-file FILE")
    prompts = [prompt] if prompt is not None else load_prompts(prompts_file, num_prompts)
    engine = _load_engine(target, drafter, device, dtype, block_size, max_seq_len, prompt_lookup,
                          draft_length)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, num_draft_tokens=0 if no_draft else None)
    for text_prompt in prompts:
        ids = engine.tokenize(text_prompt, chat=chat, parse_special_tokens=parse_special_tokens)
        echo = (lambda t: click.echo(t, nl=False)) if stream and not as_json else None
        result = run_prompt(engine, ids, params, on_text=echo)
        if as_json:
            click.echo(json.dumps({"prompt": text_prompt, **result}))
            continue
        click.echo("" if stream else result["text"])
        click.echo(f"[{result['num_new_tokens']} tokens, {result['tokens_per_s']:.2f} tokens/s, "
                   f"mean acceptance length {result['mean_acceptance_length']:.2f}, "
                   f"finish {result['finish_reason']}]", err=True)


@click.command("eval")
@click.option("--target", required=True, metavar="SRC", help="Target model source.")
@click.option("--drafter", required=True, metavar="DIR", help="DFlash drafter checkpoint.")
@click.option("--prompts", "prompts_file", required=True, metavar="FILE|builtin:SET",
              help=".txt or .jsonl prompts file, builtin:humaneval or builtin:chat.")
@click.option("--num-prompts", default=None, type=click.IntRange(1),
              help="Use only the first N prompts.")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--chat", is_flag=True, help="Wrap each prompt in the tokenizer's chat template.")
@click.option("--parse-special-tokens", is_flag=True, help="Parse control tokens written in the "
              "prompt (<|im_start|>, ...) as control tokens; trusted prompts only.")
@_engine_options
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the full report (per prompt, histogram, acceptance profile) as JSON to "
              "FILE, and the acceptance profile's plot beside it (FILE with .png).")
def eval_(target, drafter, prompts_file, num_prompts, max_new_tokens, chat, parse_special_tokens,
          block_size, device, dtype, max_seq_len, prompt_lookup, draft_length, report) -> None:
    """Check that speculative output equals plain greedy output for every prompt (exit 1 if not).

    In bfloat16/float16 a divergence where the target's two tokens tie at that precision (logits
    within engines.base.TIE_ULPS units in the last place) is reported as a near-tie, not a
    mismatch; in float32/float64 any divergence is a mismatch."""
    from dflash_trt.dflash.acceptance import acceptance_profile, plot_profile, profile_lines
    from dflash_trt.engines.base import SamplingParams
    from dflash_trt.prompts import load_prompts
    from dflash_trt.stages.verify import full_vocab_lengths
    from dflash_trt.stages.verify import verdict as compare_outputs

    prompts = load_prompts(prompts_file, num_prompts)
    engine = _load_engine(target, drafter, device, dtype, block_size, max_seq_len, prompt_lookup,
                          draft_length)
    engine.draft_backoff = False  # measure the drafter on every step
    rows, lengths, lookup_steps, drafter_steps, all_ids = [], [], 0, [], []
    for number, text_prompt in enumerate(prompts, 1):
        ids = engine.tokenize(text_prompt, chat=chat, parse_special_tokens=parse_special_tokens)
        all_ids.append(ids)
        plain = run_prompt(engine, ids, SamplingParams(max_new_tokens=max_new_tokens,
                                                       num_draft_tokens=0))
        spec = run_prompt(engine, ids, SamplingParams(max_new_tokens=max_new_tokens))
        verdict = compare_outputs(engine, ids, spec["token_ids"], plain["token_ids"])
        lengths.extend(spec["acceptance_lengths"])
        lookup_steps += spec["num_lookup_steps"]
        drafter_steps += spec["draft_confidences"]
        rows.append({"prompt": text_prompt, "identical": verdict["status"] == "identical",
                     **verdict,
                     "num_new_tokens": spec["num_new_tokens"],
                     "mean_acceptance_length": spec["mean_acceptance_length"],
                     "num_lookup_steps": spec["num_lookup_steps"],
                     "plain_tokens_per_s": plain["tokens_per_s"],
                     "speculative_tokens_per_s": spec["tokens_per_s"]})
        status = {"identical": "same", "near-tie": "near-tie", "mismatch": "DIFFERENT"}
        click.echo(f"{number}/{len(prompts)} {status[verdict['status']]}  "
                   f"acceptance {spec['mean_acceptance_length']:.2f}  "
                   f"{plain['tokens_per_s']:.1f} -> {spec['tokens_per_s']:.1f} tokens/s")
    histogram = dict(sorted(Counter(lengths).items()))
    mean = sum(lengths) / len(lengths) if lengths else 0.0
    full_mean = None  # TensorRT-LLM drafts over the whole vocabulary (ignores draft_vocab.json)
    if engine.drafter is not None and engine.drafter.draft_vocab is not None:
        full = full_vocab_lengths(engine, all_ids, max_new_tokens)
        full_mean = sum(full) / len(full) if full else 0.0
    mismatches = sum(r["status"] == "mismatch" for r in rows)
    ties = sum(r["status"] == "near-tie" for r in rows)
    summary = {"num_prompts": len(rows), "num_identical": len(rows) - mismatches - ties,
               "num_near_ties": ties, "num_mismatches": mismatches, "dtype": engine.dtype,
               "mean_acceptance_length": mean, "block_size": engine.block_size,
               "mean_acceptance_length_full_vocab": full_mean,
               "prompt_lookup": prompt_lookup, "num_lookup_steps": lookup_steps,
               "draft_length": draft_length,
               "acceptance_profile": acceptance_profile(drafter_steps),
               "acceptance_histogram": {str(k): v for k, v in histogram.items()}, "prompts": rows}
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(summary, indent=2) + "\n")
        plot_profile(summary["acceptance_profile"], report.with_suffix(".png"),
                     f"{prompts_file}, {engine.dtype}")
    click.echo(f"mean acceptance length {mean:.3f} over {len(lengths)} steps; histogram "
               + " ".join(f"{k}:{v}" for k, v in histogram.items()))
    if full_mean is not None:
        click.echo(f"mean acceptance length drafting the full vocabulary (as TensorRT-LLM "
                   f"drafts): {full_mean:.3f}; with the draft vocabulary: {mean:.3f}")
    for line in profile_lines(summary["acceptance_profile"]):
        click.echo(line)
    if prompt_lookup:
        click.echo(f"prompt lookup drafted {lookup_steps} of {len(lengths)} steps")
    if mismatches:
        raise DflashTrtError(f"{mismatches} of {len(rows)} speculative outputs differ from plain "
                             f"decoding; the engine is not lossless for this pair")
    if ties:
        click.echo(f"{len(rows) - ties} outputs identical, {ties} diverge at a {engine.dtype} tie "
                   "(logit gap within the tie bound at the first difference)")
    else:
        click.echo(f"all {len(rows)} outputs identical")


@click.command("profile")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--device", default=None, type=_DEVICES, help="Default: engine.yaml's device.")
@click.option("--no-write", is_flag=True, help="Print the step costs; keep cost_model.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the cost model as JSON.")
def profile(engine_dir, device, no_write, as_json) -> None:
    """Measure the step costs of a compiled torch engine on this machine (for adaptive draft
    length) and write them to ENGINE_DIR/cost_model.json. Run it where, and as idle as, it serves."""
    from dataclasses import asdict

    from dflash_trt.engines.cost_model import COST_MODEL_FILE, measure
    from dflash_trt.engines.spec import EngineSpec
    from dflash_trt.engines.torch_engine import TorchEngine

    spec = EngineSpec.read(engine_dir)
    if spec.backend != "torch" or spec.drafter is None or spec.block_size < 2:
        raise UsageError(f"{engine_dir}: profile measures a torch engine with a drafter (this is "
                         f"backend {spec.backend}, block_size {spec.block_size}); TensorRT-LLM "
                         "engines choose the draft length by batch size (draft_len_schedule)")
    engine = TorchEngine.load(spec.checkpoint(engine_dir, "target"),
                              spec.checkpoint(engine_dir, "drafter"),
                              device=device or spec.device, dtype=spec.dtype,
                              block_size=spec.block_size, max_seq_len=spec.max_seq_len,
                              max_batch_size=spec.max_batch_size)
    model = measure(engine)  # batch 1, and the batch sizes a batching engine serves
    if as_json:
        click.echo(json.dumps(asdict(model), indent=2))
    else:
        click.echo(f"{model.device_name} ({model.device}, {model.dtype}, {model.threads} threads), "
                   f"context {model.context_tokens} tokens")
        for n, seconds in enumerate(model.costs.verify_s, 1):
            click.echo(f"  target forward, {n} new token{'s' if n > 1 else ' '}  "
                       f"{1000 * seconds:8.1f} ms")
        click.echo(f"  drafter block pass          {1000 * model.costs.draft_s:8.1f} ms")
        for rows, costs in sorted(model.batches.items()):
            widths = " ".join(f"{1000 * s:.0f}" for s in costs.verify_s)
            click.echo(f"  {rows} rows: forward over 1..{len(costs.verify_s)} new tokens each "
                       f"{widths} ms; drafter {1000 * costs.draft_s:.0f} ms")
    if not no_write:
        model.write(engine_dir)
        click.echo(f"wrote {engine_dir / COST_MODEL_FILE}", err=True)


COMMANDS = [init_drafter, generate, eval_, profile]
