"""`dflash-trt train-drafter`: self-distill a DFlash drafter for a target on this machine.

Stages (each a small function): load the target, build or load the drafter, collect the data
(answering prompts with the target where needed, cached), extract target features into an on-disk
store, train with periodic held-out acceptance estimates, write the drafter, training_report.json
and training_curves.png. Heavy imports happen inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path

import click

from dflash_trt.atomic import replacing_dir, write_atomic
from dflash_trt.errors import DflashTrtError, UsageError
from dflash_trt.prompts import SELF_CHAT


def _parse_ids(value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--target-layer-ids {value!r}: expected comma-separated integers "
                         "such as 1,14,27") from None


def copy_target_layers(drafter, target_model) -> list[int]:
    """Start from the target itself: drafter layer i := target layer (last id + 1 + i).

    The context features of the last chosen layer are exactly the input that target layer reads,
    so `fc` starts as a selector of that layer's features and `hidden_norm` as that layer's input
    norm; the final norm is the target's. Returns the copied target layer indices.
    """
    import torch

    layers = target_model.model.layers
    first = min(drafter.target_layer_ids[-1] + 1, len(layers) - len(drafter.layers))
    copied = []
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            src = layers[first + i]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            layer.input_layernorm.weight.copy_(src.input_layernorm.weight)
            layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
            copied.append(first + i)
        hidden = drafter.config.hidden_size
        k = len(drafter.target_layer_ids)
        fc = torch.zeros(hidden, k * hidden)
        fc[:, (k - 1) * hidden:] = torch.eye(hidden)  # (H, k*H): pass the last layer through
        drafter.fc.weight.copy_(fc + drafter.fc.weight * 0.1)  # keep a little of the others
        drafter.hidden_norm.weight.copy_(layers[first].input_layernorm.weight)
        drafter.norm.weight.copy_(target_model.model.norm.weight)
    return copied


def _content_key(target_dir: Path, layer_ids: list[int], seqs) -> str:
    """What a feature store holds (target, layers, every sequence's ids and training start), not
    where it came from: a store is reused only for the same content."""
    raw = json.dumps([str(target_dir), layer_ids, [(list(q.ids), q.train_start) for q in seqs]])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _reusable(store_dir: Path, key: str, topk: int = 0) -> bool:
    meta = store_dir / "meta.json"
    if not meta.is_file():
        return False
    got = json.loads(meta.read_text())
    return got.get("key") == key and got.get("topk", 0) >= topk


def answer_pending(samples, specs, model, tokenizer, cache: Path, *, max_new_tokens: int,
                   on_progress, temperature: float = 0.0, seed: int = 0):
    """The samples, with prompts that lack a response answered by the target (cached)."""
    from dflash_trt.training import corpus

    pending = [s.prompt for s in samples if s.needs_answer]
    answered = {}
    if pending:
        key = hashlib.sha256("\0".join(specs).encode()).hexdigest()[:12]
        for s in corpus.answer_prompts(model, tokenizer, pending, cache / f"answers-{key}.jsonl",
                                       max_new_tokens=max_new_tokens, temperature=temperature,
                                       seed=seed, on_batch=on_progress):
            answered[s.prompt] = s
    return [replace(answered[s.prompt], source=s.source) if s.needs_answer and s.prompt in answered
            else s for s in samples]  # answered samples keep their source's name in the report


def prepare_data(progress, model, tokenizer, target, samples, held_samples, cache: Path, *,
                 data: list[str], heldout: list[str], target_dir: Path, self_chat: int,
                 max_samples: int | None, max_len: int, max_new_tokens: int,
                 answer_temperature: float, seed: int, pad_id: int, topk: int = 0) -> dict:
    """Answer what needs answering, extract target features into stores (reused when the same
    data comes again); returns {"train": store dir, "heldout": store dir or None}."""
    from dflash_trt.training import corpus
    from dflash_trt.training.features import build_store

    answer_task = progress.add_task("answering prompts", total=None, info="", visible=False)
    answer_rate = {"tokens": 0, "since": time.time()}

    def answered(done, total, new_tokens=0):
        answer_rate["tokens"] += new_tokens
        rate = answer_rate["tokens"] / max(time.time() - answer_rate["since"], 1e-9)
        progress.update(answer_task, completed=done, total=total, visible=True,
                        info=f"{rate:,.0f} new tok/s")

    if SELF_CHAT in data:
        write_task = progress.add_task("writing prompts", total=self_chat, info="")
        turns = corpus.write_user_turns(
            model, tokenizer, min(self_chat, max_samples or self_chat),
            cache / f"self-chat-{seed}.jsonl", seed=seed,
            exclude=[s.prompt for s in held_samples if s.prompt],
            on_batch=lambda done, total: progress.update(write_task, completed=done))
        samples = samples + [corpus.Sample(SELF_CHAT, prompt=t) for t in turns]
    answer_rate["since"] = time.time()
    samples = answer_pending(samples, data, model, tokenizer, cache,
                             max_new_tokens=max_new_tokens, on_progress=answered,
                             temperature=answer_temperature, seed=seed)
    # What the target wrote itself may quote an evaluation prompt (a common signature such as
    # `def is_prime(n):` in an answer): such samples are dropped, never trained on.
    samples = [s for s in samples if s.source != SELF_CHAT or not corpus.holds_eval_prompt(s)]
    held_samples = answer_pending(held_samples, heldout, model, tokenizer, cache,
                                  max_new_tokens=max_new_tokens, on_progress=answered)
    train_prompts = {s.prompt for s in samples if s.prompt is not None}
    if any(s.prompt in train_prompts for s in held_samples):
        raise UsageError("--heldout shares prompts with --data; held-out text must be unseen")

    stats = corpus.CorpusStats()
    seqs = list(corpus.tokenize_samples(samples, tokenizer, max_len=max_len, stats=stats))
    key = _content_key(target_dir, target.layer_ids, seqs)
    store_dir = cache / f"features-{key}"
    if not _reusable(store_dir, key, topk):  # reused unless it lacks the top-k asked for
        feat_task = progress.add_task("target features", total=sum(len(s.ids) for s in seqs),
                                      info="tokens")
        build_store(target, seqs, store_dir, pad_id=pad_id, sources=data, topk=topk, key=key,
                    extra_files={"corpus.json": json.dumps(asdict(stats)) + "\n"},
                    on_progress=lambda n: progress.advance(feat_task, n))
    held_dir = None
    if held_samples:
        held_seqs = list(corpus.tokenize_samples(held_samples, tokenizer,
                                                 max_len=max_len + max_new_tokens))
        held_dir = cache / "heldout-features"
        held_key = _content_key(target_dir, target.layer_ids, held_seqs)
        if not _reusable(held_dir, held_key):
            build_store(target, held_seqs, held_dir, pad_id=pad_id, dtype="float32",  # exact replay
                        key=held_key)
    return {"train": str(store_dir), "heldout": str(held_dir) if held_dir else None}


def start_distributed(device: str):
    """(rank, world size, torch device of this process). Under torchrun (WORLD_SIZE > 1) it joins
    the process group first, with a timeout long enough for rank 0 to prepare the data: nccl and
    GPU LOCAL_RANK with --device cuda, gloo on CPU."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    size = int(os.environ.get("WORLD_SIZE", "1"))
    where = torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible; use --device cpu")
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                timeout=datetime.timedelta(hours=12))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), where
    return 0, 1, where


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def write_curves(history, path: Path) -> None:
    """Loss per step and held-out acceptance per evaluation, as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [s.step for s in history.steps]
    ax1.plot(steps, [s.loss for s in history.steps], lw=0.6)
    ax1.set(xlabel="step", ylabel="weighted CE loss", title="training loss")
    if history.evals:
        ax2.plot([e.step for e in history.evals], [e.acceptance_length for e in history.evals], "o-")
    ax2.set(xlabel="step", ylabel="tokens per target forward", title="held-out acceptance (estimate)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@click.command("train-drafter")
@click.option("--target", "target_src", required=True, help="Target model source (dir, .gguf, pkg:, hf:).")
@click.option("--drafter", "drafter_src", type=click.Path(file_okay=False, exists=True),
              help="Start from this drafter (reference format) instead of a new one.")
@click.option("--layers", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Layers of a new drafter.")
@click.option("--target-layer-ids", help="Comma-separated target layers feeding a new drafter.")
@click.option("--init-from-target", is_flag=True, help="Copy target decoder layers into a new drafter.")
@click.option("--mask-token-id", type=int, help="MASK token id of a new drafter (default: per tokenizer).")
@click.option("--data", "data", multiple=True, required=True,
              help="Text/.jsonl file, builtin:python-stdlib, builtin:code-prompts, "
                   "builtin:method-prompts, builtin:restated-prompts or builtin:self-chat "
                   "(repeatable).")
@click.option("--self-chat", "self_chat", default=1024, show_default=True,
              type=click.IntRange(1), help="Prompts the target writes for builtin:self-chat.")
@click.option("--answer-temperature", default=0.0, show_default=True,
              type=click.FloatRange(0, 2), help="The target answers prompts greedily (0) or "
              "samples at this temperature (a temperature > 0 deployment's outputs).")
@click.option("--heldout", multiple=True, help="Held-out prompts (.txt/.jsonl/builtin:chat) the "
              "target answers; the acceptance estimate replays decoding on them.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--steps", default=2000, show_default=True, type=click.IntRange(1))
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=6e-4, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--warmup-steps", default=50, show_default=True, type=click.IntRange(0))
@click.option("--block-size", default=8, show_default=True, type=click.IntRange(2, 32))
@click.option("--anchors-per-seq", default=16, show_default=True, type=click.IntRange(1))
@click.option("--gamma", default=7.0, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--vocab-limit", default=8192, show_default=True, type=click.IntRange(0),
              help="Softmax over the N most frequent labels while training; the drafter then "
                   "drafts only those tokens (draft_vocab.json). 0: the full vocabulary.")
@click.option("--distill-topk", default=0, show_default=True, type=click.IntRange(0, 256),
              help="Soft labels: train on the target's top-K next-token distribution (stored "
                   "with the features) instead of its argmax; 0 = argmax labels.")
@click.option("--max-len", default=512, show_default=True, type=click.IntRange(16),
              help="Tokens per training sequence.")
@click.option("--max-samples", type=click.IntRange(1), help="At most N samples per data source.")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1),
              help="Length of the target's answers to prompts, and of the replayed decoding.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume", is_flag=True, help="Continue from OUTPUT/checkpoint.pt (same settings).")
@click.option("--checkpoint-every", default=200, show_default=True, type=click.IntRange(0))
@click.option("--eval-every", default=200, show_default=True, type=click.IntRange(0))
@click.option("--save-dtype", default="bfloat16", show_default=True,
              type=click.Choice(["float32", "bfloat16", "float16"]),
              help="dtype of the written drafter weights: bfloat16, what TensorRT-LLM's DFlash "
              "attention takes (bf16/fp16 only) and half the size; float32 for exact replay.")
@click.option("--keep-best", is_flag=True, help="Write the drafter of the evaluation with the "
              "best held-out acceptance, not the last step's (early stopping, against "
              "memorising a small corpus); checkpoints still hold every step.")
@click.option("--threads", type=click.IntRange(1), help="torch threads (default: torch's choice).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="Where the target and drafter run; under torchrun, cuda means GPU LOCAL_RANK.")
def train_drafter(target_src, drafter_src, layers, target_layer_ids, init_from_target,
                  mask_token_id, data, self_chat, answer_temperature, heldout, output, steps, batch_size, lr, warmup_steps,
                  block_size, anchors_per_seq, gamma, vocab_limit, distill_topk, max_len, max_samples,
                  max_new_tokens, seed, resume, checkpoint_every, eval_every, save_dtype, keep_best,
                  threads, device):
    """Train a DFlash drafter on the target's own predictions (self-distillation)."""
    import torch
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_trt.commands.progress_lines import LoggedProgress
    from dflash_trt.dflash.drafter import DFlashDraftModel
    from dflash_trt.dflash.drafter_init import init_drafter_for_target
    from dflash_trt.dflash.target import HFTarget
    from dflash_trt.stages.resolve import resolve_source
    from dflash_trt.training import corpus
    from dflash_trt.training.estimate import estimate_acceptance
    from dflash_trt.training.features import FeatureStore
    from dflash_trt.training.train import (
        CheckpointSaved,
        EvalStats,
        StepStats,
        TrainConfig,
        Trainer,
    )

    if threads:
        torch.set_num_threads(threads)
    out = Path(output)
    if (out / "checkpoint.pt").exists() and not resume:
        raise UsageError(f"{out} already holds a training run; pass --resume to continue it or "
                         "choose another --output")
    ids = _parse_ids(target_layer_ids)
    started = time.time()
    # Bad or empty data fails here, before minutes of model loading.
    files_and_sets = [d for d in data if d != SELF_CHAT]
    samples = corpus.load_samples(files_and_sets, limit_per_source=max_samples) \
        if files_and_sets else []
    held_samples = corpus.load_samples(list(heldout), heldout=True) if heldout else []
    rank, _, where = start_distributed(device)
    target_dir = resolve_source(target_src)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(where)
    for p in model.parameters():
        p.requires_grad_(False)

    # 1. The drafter: loaded, resumed (architecture from the checkpoint's export), or new.
    info: dict = {}
    if drafter_src:
        drafter = DFlashDraftModel.from_pretrained(drafter_src)
        if drafter.block_size != block_size:
            raise UsageError(f"--block-size {block_size} differs from the drafter's "
                             f"{drafter.block_size}")
        info["init"] = {"from": str(drafter_src)}
    else:
        drafter = init_drafter_for_target(target_dir, num_layers=layers, block_size=block_size,
                                          target_layer_ids=ids, mask_token_id=mask_token_id,
                                          seed=seed)
        info["init"] = {"layers": layers, "seed": seed}
        if init_from_target:
            info["init"]["copied_target_layers"] = copy_target_layers(drafter, model)
    drafter = drafter.float().to(where)
    target = HFTarget(model, drafter.target_layer_ids)
    pad_id = tokenizer.pad_token_id or 0

    with LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                        TimeRemainingColumn(), transient=False, disable=rank != 0) as progress:
        # 2-3. Data and target features: one writer (rank 0) under torchrun, the others wait.
        cache = out / "cache"
        if rank == 0:
            stores = prepare_data(
                progress, model, tokenizer, target, samples, held_samples, cache, data=list(data),
                heldout=list(heldout), target_dir=target_dir, self_chat=self_chat,
                max_samples=max_samples, max_len=max_len, max_new_tokens=max_new_tokens,
                answer_temperature=answer_temperature, seed=seed, pad_id=pad_id,
                topk=distill_topk)
            write_atomic(cache / "stores.json", json.dumps(stores) + "\n")
        barrier()
        stores = json.loads((cache / "stores.json").read_text())
        store = FeatureStore(Path(stores["train"]))
        stats = corpus.CorpusStats(**json.loads((store.root / "corpus.json").read_text()))
        held_store = FeatureStore(Path(stores["heldout"])) if stores["heldout"] and rank == 0 \
            else None

        # 4. Train.
        config = TrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
                             block_size=block_size, anchors_per_seq=anchors_per_seq, gamma=gamma,
                             seed=seed, vocab_limit=vocab_limit, distill_topk=distill_topk,
                             checkpoint_every=checkpoint_every,
                             eval_every=eval_every if stores["heldout"] else 0)
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

        def evaluate(trainer) -> EvalStats:
            est = estimate_acceptance(trainer.drafter, embed, head, held_store,
                                      max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
            recent = trainer.history.steps[-20:]
            return EvalStats(trainer.step, est.mean_acceptance_length,
                             sum(s.first_token_accuracy for s in recent) / max(len(recent), 1))

        train_task = progress.add_task("training", total=steps, info="")
        last_eval = {"tau": None}
        best = {"tau": None, "step": None, "state": None}  # --keep-best: the best evaluation

        def on_event(event) -> None:
            if isinstance(event, StepStats):
                tps = event.block_tokens / max(event.seconds, 1e-9)
                tau = last_eval["tau"]
                progress.update(train_task, completed=event.step, info=(
                    f"loss {event.loss:.3f}  {tps:,.0f} tok/s"
                    + (f"  accept {tau:.2f}" if tau is not None else "")))
            elif isinstance(event, EvalStats):
                last_eval["tau"] = event.acceptance_length
                better = best["tau"] is None or event.acceptance_length > best["tau"]
                if keep_best and better:
                    best.update(tau=event.acceptance_length, step=event.step,
                                state={k: v.detach().clone() for k, v in drafter.state_dict().items()})
                    _save_best(out / BEST, drafter, best)  # outlives the process, for --resume
                progress.console.log(f"held-out acceptance {event.acceptance_length:.3f} at step "
                                     f"{event.step}" + ("  (best, kept)" if keep_best and better
                                                        else ""))
            elif isinstance(event, CheckpointSaved):
                progress.console.log(f"checkpoint at step {event.step}: {event.path}")

        trainer = Trainer(drafter, embed, head, store, config, out, evaluate=evaluate if held_store
                          else None, callback=on_event, pad_id=pad_id)
        if resume:
            trainer.load_checkpoint()
            progress.update(train_task, completed=trainer.step)
            if keep_best:
                best.update(_load_best(out / BEST, trainer.step))
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            history = trainer.run()
        except KeyboardInterrupt:
            raise DflashTrtError(f"interrupted at step {trainer.step}; checkpoint saved in {out}; "
                                 "continue with the same command plus --resume") from None
        finally:
            signal.signal(signal.SIGTERM, previous)

    if rank != 0:
        return  # one writer
    # 5. Outputs: the drafter (reference format), the report and the curves.
    import copy

    if best["state"] is not None:
        drafter.load_state_dict(best["state"])  # the written drafter is the best evaluated one
    final = estimate_acceptance(drafter, embed, head, held_store, max_new_tokens=max_new_tokens,
                                stop_token_ids=stop_ids) if held_store is not None else None
    report = {
        "target": target_src, "drafter": info, "config": asdict(config),
        "target_layer_ids": drafter.target_layer_ids, "mask_token_id": drafter.mask_token_id,
        "data": {"sources": list(data), "samples": stats.samples, "sequences": stats.sequences,
                 "tokens": stats.tokens, "feature_tokens": store.num_tokens},
        "heldout": {"sources": list(heldout), "sequences": len(held_store) if held_store else 0},
        "steps": trainer.step, "processes": trainer.world, "wall_seconds_training": round(history.wall_seconds, 1),
        "wall_seconds_total": round(time.time() - started, 1),
        "loss_curve": [[s.step, round(s.loss, 4)] for s in history.steps],
        "acceptance_curve": [[e.step, round(e.acceptance_length, 4)] for e in history.evals],
        "heldout_acceptance": asdict(final) if final else None,
        "written_step": best["step"] if best["state"] is not None else trainer.step,
    }
    with replacing_dir(out / "drafter") as written:  # in place with its report and curves, or not
        copy.deepcopy(drafter).cpu().to(getattr(torch, save_dtype)).eval().save_pretrained(written)
        (written / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        write_curves(history, written / "training_curves.png")
    if best["state"] is not None:
        click.echo(f"best held-out acceptance {best['tau']:.2f} at step {best['step']}")
    click.echo(f"drafter written to {out / 'drafter'}"
               + (f"; held-out acceptance {final.mean_acceptance_length:.2f}" if final else ""))


BEST = "best"  # OUTPUT/best/: the best evaluated drafter so far (--keep-best), with best.json


def _save_best(path: Path, drafter, best: dict) -> None:
    with replacing_dir(path) as tmp:  # the drafter and best.json go in place together
        drafter.save_pretrained(tmp)
        (tmp / "best.json").write_text(json.dumps({"step": best["step"], "tau": best["tau"]}) + "\n")


def _load_best(path: Path, step: int) -> dict:
    """The best evaluation before a resumed run's step (none if it was saved after it)."""
    from safetensors.torch import load_file

    if not (path / "best.json").is_file():
        return {}
    saved = json.loads((path / "best.json").read_text())
    if saved["step"] > step:  # evaluated after the checkpoint resumed from: it will come again
        return {}
    return {"tau": saved["tau"], "step": saved["step"], "state": load_file(path / "model.safetensors")}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


COMMANDS = [train_drafter]
