"""Drafter training by self-distillation (the DFlash recipe), reusing the drafter's own modules.

One step:
1. Take the next batch of sequences (a seeded permutation per epoch) with their target features
   and the target's argmax labels; under torchrun each process takes every world-th row.
2. Draw `anchors_per_seq` random anchor positions per sequence (at or after its train_start),
   seeded per (step, row).
3. Each block is [anchor token, MASK x (block_size-1)] at positions a..a+B-1; it attends to the
   target features strictly before the anchor (KV injection) and to its whole block, non-causally.
   All blocks of a sequence run in one pass with a block-diagonal mask.
4. Block position k (1..B-1) predicts the target's argmax at a+k-1; cross-entropy weighted by
   w_k = exp(-(k-1)/gamma), through the target's frozen LM head (optionally restricted to the most
   frequent labels, which is most of the cost saved on CPU). With distill_topk = K the label is
   soft instead: the target's top-K next-token distribution (renormalised over the tokens the head
   keeps), from the feature store.
5. AdamW, linear warm-up then cosine decay, gradient clipping. Losses are whole-batch sums over
   whole-batch weights, so N processes (DistributedDataParallel) step as one process would.

Every random draw is a function of (seed, step), so a run resumed from a checkpoint continues
bit for bit. No printing: progress goes to a callback as StepStats / EvalStats.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash_trt.errors import DflashTrtError, UsageError

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one run (saved in checkpoints; a resume must match them)."""

    steps: int = 2000
    batch_size: int = 8
    lr: float = 6e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio, not zero
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    block_size: int = 8
    anchors_per_seq: int = 16
    gamma: float = 7.0
    seed: int = 0
    vocab_limit: int = 0  # > 0: softmax over the most frequent labels only (0 = full vocabulary)
    distill_topk: int = 0  # > 0: soft labels, the target's top-k distribution (0 = its argmax)
    checkpoint_every: int = 200
    eval_every: int = 200


@dataclass
class StepStats:
    step: int  # steps done, after this one
    loss: float
    lr: float
    grad_norm: float
    first_token_accuracy: float  # block position 1 argmax == label, over the batch
    block_tokens: int  # supervised positions in this step
    seconds: float


@dataclass
class EvalStats:
    step: int
    acceptance_length: float  # from training.estimate (held-out)
    first_token_accuracy: float


@dataclass
class CheckpointSaved:
    step: int
    path: Path


@dataclass
class TrainHistory:
    """Everything the report and the resume need about the run so far."""

    steps: list[StepStats] = field(default_factory=list)
    evals: list[EvalStats] = field(default_factory=list)
    wall_seconds: float = 0.0


# --- the training forward ----------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _attention(attn, x, context, cos, sin, mask):
    """DFlashAttention's computation with an explicit mask (many blocks in one pass)."""
    b, t, _ = x.shape  # x: (B, T, H) all blocks; context: (B, L, H)
    hd = attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(b, t, -1, hd)).transpose(1, 2)  # (B, nh, T, hd)
    kv_in = torch.cat([context, x], dim=1)  # (B, L+T, H)
    s = kv_in.shape[1]
    k = attn.k_norm(attn.k_proj(kv_in).view(b, s, -1, hd)).transpose(1, 2)  # (B, nkv, L+T, hd)
    v = attn.v_proj(kv_in).view(b, s, -1, hd).transpose(1, 2)  # (B, nkv, L+T, hd)
    q = q * cos[:, :, -t:] + _rotate_half(q) * sin[:, :, -t:]
    k = k * cos + _rotate_half(k) * sin
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                         enable_gqa=attn.num_heads != attn.num_kv_heads)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # (B, T, H)


def draft_hidden(drafter, embed: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Drafter hidden states of every block: (B, N, block_size, H).

    embed: (V, H) the target's embedding; features: (B, L, k*H); tokens: (B, L);
    anchors: (B, N) positions. Equal to DFlashDraftModel.forward on each block separately with
    the features of positions < anchor as its context.
    """
    b, length, _ = features.shape
    n = anchors.shape[1]
    t = n * block_size
    dev = features.device
    offsets = torch.arange(block_size, device=dev)
    block_ids = torch.full((b, n, block_size), drafter.mask_token_id, dtype=torch.long, device=dev)
    block_ids[..., 0] = tokens.gather(1, anchors)  # (B, N, Bs): [anchor token, MASK...]
    x = F.embedding(block_ids.view(b, t), embed)  # (B, T, H)
    context = drafter.hidden_norm(drafter.fc(features))  # (B, L, H)
    block_pos = (anchors[..., None] + offsets).view(b, t)  # (B, T)
    positions = torch.cat([torch.arange(length, device=dev).expand(b, length), block_pos],
                          dim=1)  # (B, L+T)
    cos, sin = drafter.rotary_emb(x, positions)  # (B, L+T, hd) each
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, L+T, hd)
    # A block query sees context strictly before its anchor, and every position of its own block.
    block_anchor = anchors.repeat_interleave(block_size, dim=1)  # (B, T)
    sees_context = torch.arange(length, device=dev)[None, None, :] < block_anchor[..., None]
    block_of = torch.arange(t, device=dev) // block_size  # (T,)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(b, t, t)  # (B, T, T)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # (B, 1, T, L+T)
    for layer in drafter.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), context, cos, sin, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(b, n, block_size, -1)  # (B, N, Bs, H)


def sample_anchors(lengths: torch.Tensor, train_start: torch.Tensor, count: int,
                   seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` distinct random anchors per sequence in [max(train_start, 1), length - 1].

    Row j's anchors are drawn from a generator seeded with seeds[j] alone, so a row gets the same
    anchors whichever batch or process it is in (data-parallel training equals one process).
    Returns anchors (B, N) and a validity mask (B, N): short sequences get fewer real anchors.
    """
    lo = train_start.clamp(min=1)  # (B,)
    room = (lengths - lo).clamp(min=0)  # (B,) positions an anchor may take
    n = max(1, min(count, int(room.max())))
    anchors = torch.zeros(len(seeds), n, dtype=torch.long)
    ok = torch.zeros(len(seeds), n, dtype=torch.bool)
    for j, seed in enumerate(seeds):
        k = min(n, int(room[j]))
        pick = torch.randperm(int(room[j]), generator=torch.Generator().manual_seed(seed))[:k]
        anchors[j, :k], ok[j, :k] = pick + lo[j], True
    return anchors, ok


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..block_size-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)  # (Bs-1,)


@dataclass
class LossSums:
    """A batch's loss terms as sums, so that shards of one batch add up to the whole batch."""

    weighted_ce: torch.Tensor  # sum of w * CE (with grad)
    weight: float  # sum of w
    first_hits: int  # block position 1 argmax == label
    first_count: int
    supervised: int  # supervised positions


def soft_cross_entropy(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
                       label_map: torch.Tensor | None) -> torch.Tensor:
    """-sum_j p_j log q(t_j) per position: p is the target's top-k distribution renormalised over
    the tokens `logits` covers (rows of label_map >= 0), q the drafter's softmax.

    logits (..., K); top_ids, top_logp (..., k); returns (...).
    """
    if label_map is not None:
        top_ids = label_map[top_ids]
        top_logp = top_logp.masked_fill(top_ids < 0, -math.inf)
    p = torch.softmax(top_logp, -1).nan_to_num(0.0)  # a position with no kept token: all zero
    logq = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    logq = logq.gather(-1, top_ids.clamp(min=0))
    return -(p * logq).sum(-1)


def block_loss(drafter, embed, head: torch.Tensor, label_map: torch.Tensor | None, batch,
               anchors: torch.Tensor, anchor_ok: torch.Tensor, block_size: int,
               gamma: float, topk: int = 0) -> LossSums:
    """Position-weighted cross-entropy over all blocks, with first-position hits, as sums.

    head: (K, H) LM-head rows of the kept labels (all V rows when label_map is None);
    label_map: (V,) token id -> row of `head`, -1 for labels outside it (ignored).
    topk > 0: against the batch's top-k soft labels (its first topk of each position) instead of
    the argmax labels.
    """
    hidden = draft_hidden(drafter, embed, batch.features, batch.tokens, anchors, block_size)
    hidden = hidden[:, :, 1:]  # (B, N, Bs-1, H): the MASK positions
    b, n = anchors.shape
    label_pos = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)
    valid = (label_pos < batch.lengths[:, None, None]) & anchor_ok[..., None]  # (B, N, Bs-1)
    width = batch.labels.shape[1]
    labels = batch.labels.gather(1, label_pos.clamp(max=width - 1).view(b, -1)).view(label_pos.shape)
    if label_map is not None:
        labels = label_map[labels]  # (B, N, Bs-1)
        valid &= labels >= 0
    logits = hidden @ head.T  # (B, N, Bs-1, K)
    if topk:
        flat = label_pos.clamp(max=width - 1).view(b, -1, 1).expand(-1, -1, topk)
        top = [t[..., :topk].gather(1, flat).view(*label_pos.shape, topk)
               for t in (batch.topk_ids, batch.topk_logp)]
        ce = soft_cross_entropy(logits, *top, label_map)  # (B, N, Bs-1)
    else:
        ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.clamp(min=0).flatten(),
                             reduction="none").view(labels.shape)  # (B, N, Bs-1)
    w = position_weights(block_size, gamma).to(valid.device) * valid  # (B, N, Bs-1)
    with torch.no_grad():
        first_ok = valid[..., 0]
        hits = (logits[..., 0, :].argmax(-1) == labels[..., 0]) & first_ok
    return LossSums((ce * w).sum(), float(w.sum()), int(hits.sum()), int(first_ok.sum()),
                    int(valid.sum()))


class _BlockLoss(torch.nn.Module):
    """block_loss as a module around the drafter, for DistributedDataParallel to wrap."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of w * CE, [weight, first hits, first count, supervised] as float64)."""
        sums = block_loss(self.drafter, *args)
        return sums.weighted_ce, torch.tensor(
            [sums.weight, sums.first_hits, sums.first_count, sums.supervised], dtype=torch.float64)


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) unless torch.distributed is initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --- schedule, data order ----------------------------------------------------------------------


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at config.steps."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_sequences: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(num_sequences, generator=gen).tolist())


def batch_indices(step: int, num_sequences: int, config: TrainConfig) -> list[int]:
    """The sequences of one step: consecutive slices of a seeded permutation per epoch."""
    out = []
    for j in range(config.batch_size):
        epoch, offset = divmod(step * config.batch_size + j, num_sequences)
        out.append(_epoch_order(config.seed, epoch, num_sequences)[offset])
    return out


def frequent_labels(counts: np.ndarray, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `limit` most frequent label ids (sorted) and the id -> row map (-1 elsewhere)."""
    order = np.argsort(-counts, kind="stable")[:limit]
    keep = torch.from_numpy(np.sort(order)).long()  # (K,)
    label_map = torch.full((counts.shape[0],), -1, dtype=torch.long)
    label_map[keep] = torch.arange(keep.shape[0])
    return keep, label_map


# --- the trainer -------------------------------------------------------------------------------


class Trainer:
    """Owns the optimizer, schedule and checkpoints of one drafter training run."""

    def __init__(self, drafter, embed: torch.Tensor, lm_head: torch.Tensor, data, config: TrainConfig,
                 out_dir: Path, *, evaluate: Callable[[object], EvalStats] | None = None,
                 callback: Callable[[object], None] | None = None, pad_id: int = 0):
        if config.block_size != drafter.block_size:
            raise DflashTrtError(f"block_size {config.block_size} differs from the drafter's "
                                 f"{drafter.block_size}")
        if list(data.target_layer_ids) != list(drafter.target_layer_ids):
            raise DflashTrtError(f"features were extracted from target layers "
                                 f"{data.target_layer_ids} but the drafter reads "
                                 f"{drafter.target_layer_ids}")
        if config.distill_topk > getattr(data, "topk", 0):
            raise DflashTrtError(f"distill_topk {config.distill_topk}: the features hold the "
                                 f"target's top {getattr(data, 'topk', 0)} only; extract them "
                                 "with topk >= distill_topk")
        self.drafter, self.data, self.config = drafter.train(), data, config
        self.embed = embed.detach()  # (V, H) frozen, shared with the target
        self.device = self.embed.device  # the drafter, head and batches live where the target does
        self.out_dir = Path(out_dir)
        self.evaluate, self.callback, self.pad_id = evaluate, callback or (lambda event: None), pad_id
        vocab = lm_head.shape[0]
        if config.vocab_limit and config.vocab_limit < vocab:
            keep, label_map = frequent_labels(data.label_counts(vocab), config.vocab_limit)
            self.head = lm_head.detach()[keep.to(self.device)].clone()  # (K, H)
            self.label_map = label_map.to(self.device)
        else:
            keep, self.head, self.label_map = None, lm_head.detach(), None  # (V, H)
        drafter.set_draft_vocab(keep)  # it drafts what it learned: saved as draft_vocab.json
        decay = [p for name, p in drafter.named_parameters() if p.ndim >= 2]
        no_decay = [p for name, p in drafter.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config))
        self.step = 0
        self.history = TrainHistory()
        # Data parallel under torchrun: each process takes every world-th row of the global batch;
        # DistributedDataParallel (gloo on CPU, nccl on GPU) averages the gradients.
        self.rank, self.world = world()
        if config.batch_size < self.world:
            raise DflashTrtError(f"--batch-size {config.batch_size} is smaller than the "
                                 f"{self.world} processes; give each process at least one row")
        self.loss_module = _BlockLoss(drafter)
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.loss_module = DistributedDataParallel(self.loss_module, device_ids=ids)

    @property
    def is_writer(self) -> bool:
        """The one process that evaluates and writes checkpoints."""
        return self.rank == 0

    def train_step(self) -> StepStats:
        """One optimizer step on the batch that belongs to self.step (this process's rows)."""
        import time

        t0 = time.perf_counter()
        config = self.config
        indices = batch_indices(self.step, len(self.data), config)
        mine = range(self.rank, len(indices), self.world)
        batch = self.data.batch([indices[j] for j in mine], self.pad_id)
        seeds = [(config.seed * 1_000_003 + self.step) * 4_099 + j for j in mine]
        anchors, ok = sample_anchors(batch.lengths, batch.train_start, config.anchors_per_seq,
                                     seeds)
        batch, anchors, ok = batch.to(self.device), anchors.to(self.device), ok.to(self.device)
        weighted_ce, counts = self.loss_module(self.embed, self.head, self.label_map, batch,
                                               anchors, ok, config.block_size, config.gamma,
                                               config.distill_topk)
        totals = torch.cat([weighted_ce.detach().double().view(1).cpu(), counts])
        totals = totals.to(self.device)  # whole-batch sums (nccl reduces on the GPU)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(totals)
        ce_sum, weight, hits, first, supervised = totals.tolist()
        weight = max(weight, 1e-6)
        self.optimizer.zero_grad(set_to_none=True)
        (weighted_ce * (self.world / weight)).backward()  # DDP divides by the world size
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), config.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return StepStats(self.step, ce_sum / weight, lr, float(grad_norm), hits / max(first, 1),
                         int(supervised), time.perf_counter() - t0)

    def run(self) -> TrainHistory:
        """Train to config.steps; checkpoint every N steps, at the end, and on KeyboardInterrupt."""
        import time

        config = self.config
        started = time.perf_counter()
        base_wall = self.history.wall_seconds
        try:
            while self.step < config.steps:
                stats = self.train_step()
                self.history.steps.append(stats)
                self.history.wall_seconds = base_wall + time.perf_counter() - started
                self.callback(stats)
                if self.evaluate is not None and self.is_writer and config.eval_every and \
                        (self.step % config.eval_every == 0 or self.step == config.steps):
                    ev = self.evaluate(self)
                    self.history.evals.append(ev)
                    self.callback(ev)
                if config.checkpoint_every and self.step % config.checkpoint_every == 0 \
                        and self.step < config.steps:
                    self._checkpoint()
        except KeyboardInterrupt:
            self.history.wall_seconds = base_wall + time.perf_counter() - started
            self._checkpoint()
            raise
        self.history.wall_seconds = base_wall + time.perf_counter() - started
        self._checkpoint()
        return self.history

    def _checkpoint(self) -> None:
        if self.is_writer:
            self.callback(CheckpointSaved(self.step, self.save_checkpoint()))

    # --- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write out_dir/checkpoint.pt (atomic) and the drafter of this step, reference format."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step, "config": asdict(self.config),
            "model": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
            "history": {"steps": [asdict(s) for s in self.history.steps],
                        "evals": [asdict(e) for e in self.history.evals],
                        "wall_seconds": self.history.wall_seconds},
        }
        path = self.out_dir / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        step_dir = self.out_dir / "checkpoints" / f"step-{self.step:06d}"
        self.drafter.save_pretrained(step_dir)  # before the checkpoint that moves past it
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, path: Path | None = None) -> int:
        """Restore a run saved by save_checkpoint; the hyperparameters must match (but steps)."""
        path = Path(path or self.out_dir / CHECKPOINT)
        if not path.is_file():
            raise UsageError(f"--resume: no checkpoint at {path}; start without --resume")
        # Tensors and plain containers only: a checkpoint cannot run code when it is loaded.
        state = torch.load(path, map_location=self.device, weights_only=True)
        saved = dict(state["config"])
        now = asdict(self.config)
        differ = [k for k in now if k not in ("steps", "checkpoint_every", "eval_every")
                  and saved.get(k) != now[k]]
        if differ:
            raise UsageError(f"--resume: settings differ from the checkpoint "
                                 f"({', '.join(f'{k}: {saved.get(k)} -> {now[k]}' for k in differ)});"
                                 " resume with the same settings or start a new --output")
        self.drafter.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"].cpu())
        self.step = int(state["step"])
        hist = state["history"]
        self.history = TrainHistory([StepStats(**s) for s in hist["steps"]],
                                    [EvalStats(**e) for e in hist["evals"]],
                                    hist["wall_seconds"])
        return self.step
