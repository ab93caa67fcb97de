"""Target features for drafter training: the chosen layers' outputs and the target's argmax labels.

A FeatureStore is a directory of flat memory-mapped arrays, written chunk by chunk, so neither
building nor reading it holds more than one batch in memory, whatever the corpus size:

    tokens.bin    int32 (N,)        all sequences' token ids, back to back
    labels.bin    int32 (N,)        labels[j] = argmax of the target's logits at j (predicts j+1)
    topk_ids.bin  int32 (N, K)      optional (K = meta "topk" > 0): the target's K most likely
    topk_logp.bin float16 (N, K)    next tokens at j and their log-probabilities (soft labels)
    features.bin  float16 (N, k*H)  hidden_states[id + 1] of each target layer id, concatenated
                                    (float32 on request: exact replays for the estimator)
    index.npy     int64 (S, 3)      per sequence: offset, length, train_start
    meta.json     target layer ids, hidden size, counts, sources

`OnTheFlyFeatures` serves the same batches by running the target per batch (no disk).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_trt.dflash.target import HFTarget
from dflash_trt.errors import DflashTrtError
from dflash_trt.training.corpus import TokenSequence


@dataclass
class FeatureBatch:
    """A right-padded batch of sequences with their target features and labels."""

    tokens: torch.Tensor  # (B, L) long
    labels: torch.Tensor  # (B, L) long: the target's argmax at each position
    features: torch.Tensor  # (B, L, k*H) float32
    lengths: torch.Tensor  # (B,) long
    train_start: torch.Tensor  # (B,) long: first position anchors may take
    topk_ids: torch.Tensor | None = None  # (B, L, K) long: the target's K most likely next tokens
    topk_logp: torch.Tensor | None = None  # (B, L, K) float32: their log-probabilities

    def to(self, device) -> FeatureBatch:
        return FeatureBatch(*(None if t is None else t.to(device) for t in (
            self.tokens, self.labels, self.features, self.lengths, self.train_start,
            self.topk_ids, self.topk_logp)))


@dataclass
class Extracted:
    """What one target pass gives per position: features, argmax labels, optional top-k."""

    features: torch.Tensor  # (B, L, k*H)
    labels: torch.Tensor  # (B, L) long
    topk_ids: torch.Tensor | None = None  # (B, L, K) long
    topk_logp: torch.Tensor | None = None  # (B, L, K) float32


@torch.no_grad()  # not inference_mode: the features feed a graph that trains
def extract(target: HFTarget, ids: torch.Tensor, chunk: int = 256, topk: int = 0) -> Extracted:
    """Features, argmax labels and (topk > 0) the top-k log-probabilities of right-padded ids.

    Right padding needs no attention mask: attention is causal, so real positions never see it.
    The LM head runs in chunks of positions to keep the (chunk, V) logits small.
    """
    ids = ids.to(target.model.device)
    hidden, features = target.forward(ids, None, True)  # (B, L, H), (B, L, k*H)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (B*L, H)
    labels, top_ids, top_logp = [], [], []
    for i in range(0, flat.shape[0], chunk):
        logits = target.logits(flat[i:i + chunk]).float()  # (chunk, V)
        labels.append(logits.argmax(-1))
        if topk:
            logp, idx = torch.log_softmax(logits, -1).topk(topk, dim=-1)  # (chunk, K)
            top_ids.append(idx)
            top_logp.append(logp)
    shape = ids.shape
    if not topk:
        return Extracted(features, torch.cat(labels).view(shape))
    return Extracted(features, torch.cat(labels).view(shape), torch.cat(top_ids).view(*shape, topk),
                     torch.cat(top_logp).view(*shape, topk))


def _pad(seqs: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [pad_id] * (width - len(s)) for s in seqs])  # (B, L)


def build_store(target: HFTarget, sequences: Iterable[TokenSequence], out_dir: Path, *,
                batch_size: int = 8, pad_id: int = 0, sources: Sequence[str] = (),
                dtype: str = "float16", topk: int = 0, key: str | None = None,
                extra_files: dict[str, str] | None = None,
                on_progress: Callable[[int], None] | None = None) -> FeatureStore:
    """Run the target over the sequences and write a FeatureStore at out_dir (atomically);
    topk > 0 also stores the target's top-k next tokens and log-probabilities per position; key
    (if given) is recorded in meta.json, for callers that reuse a store made from the same data;
    extra_files ({name: text}) are the caller's own, written into the store with it."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index, offset, dim = [], 0, None
    with contextlib.ExitStack() as files:
        ft, fl, ff = (files.enter_context(open(tmp / name, "wb"))
                      for name in ("tokens.bin", "labels.bin", "features.bin"))
        fi, fp = (files.enter_context(open(tmp / name, "wb"))
                  for name in ("topk_ids.bin", "topk_logp.bin")) if topk else (None, None)

        def flush(batch: list[TokenSequence]) -> None:
            nonlocal offset, dim
            got = extract(target, _pad([s.ids for s in batch], pad_id), topk=topk)
            feats, labels = got.features.cpu(), got.labels.cpu()
            dim = feats.shape[-1]
            for row, seq in enumerate(batch):
                n = len(seq.ids)
                np.asarray(seq.ids, dtype=np.int32).tofile(ft)
                labels[row, :n].numpy().astype(np.int32).tofile(fl)
                feats[row, :n].to(getattr(torch, dtype)).numpy().tofile(ff)
                if topk:
                    got.topk_ids[row, :n].cpu().numpy().astype(np.int32).tofile(fi)
                    got.topk_logp[row, :n].cpu().numpy().astype(np.float16).tofile(fp)
                index.append((offset, n, seq.train_start))
                offset += n
            if on_progress is not None:
                on_progress(sum(len(s.ids) for s in batch))

        # Sequences of similar length share a batch; order within the store does not matter.
        pending: list[TokenSequence] = []
        for seq in sequences:
            pending.append(seq)
            if len(pending) == batch_size * 8:
                pending.sort(key=lambda s: len(s.ids))
                for b in range(0, len(pending), batch_size):
                    flush(pending[b:b + batch_size])
                pending = []
        pending.sort(key=lambda s: len(s.ids))
        for b in range(0, len(pending), batch_size):
            flush(pending[b:b + batch_size])
    if not index:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DflashTrtError("no training sequences: the data is empty or every sample is "
                             "shorter than 8 tokens")
    np.save(tmp / "index.npy", np.asarray(index, dtype=np.int64))
    meta = {"target_layer_ids": target.layer_ids, "feature_dim": dim, "dtype": dtype,
            "num_tokens": offset, "topk": topk,
            "num_sequences": len(index), "sources": list(sources)}
    if key is not None:
        meta["key"] = key
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return FeatureStore(out_dir)


class FeatureStore:
    """Read side of a store directory (memory-mapped; see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        meta_file = self.root / "meta.json"
        if not meta_file.is_file():
            raise DflashTrtError(f"{self.root}: not a feature store (no meta.json)")
        self.meta = json.loads(meta_file.read_text())
        self.index = np.load(self.root / "index.npy")  # (S, 3)
        n, dim = self.meta["num_tokens"], self.meta["feature_dim"]
        self.tokens = np.memmap(self.root / "tokens.bin", dtype=np.int32, mode="r", shape=(n,))
        self.labels = np.memmap(self.root / "labels.bin", dtype=np.int32, mode="r", shape=(n,))
        self.features = np.memmap(self.root / "features.bin", mode="r",
                                  dtype=np.dtype(self.meta.get("dtype", "float16")),
                                  shape=(n, dim))
        self.topk = int(self.meta.get("topk", 0))
        if self.topk:
            self.topk_ids = np.memmap(self.root / "topk_ids.bin", dtype=np.int32, mode="r",
                                      shape=(n, self.topk))
            self.topk_logp = np.memmap(self.root / "topk_logp.bin", dtype=np.float16, mode="r",
                                       shape=(n, self.topk))

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.meta["target_layer_ids"])

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """tokens (n,), labels (n,), features (n, k*H) as stored, train_start of sequence i."""
        offset, n, start = (int(v) for v in self.index[i])
        return (self.tokens[offset:offset + n], self.labels[offset:offset + n],
                self.features[offset:offset + n], start)

    def batch(self, indices: Sequence[int], pad_id: int = 0) -> FeatureBatch:
        """Right-padded batch of the given sequences (features as float32)."""
        rows = [self.sequence(int(i)) for i in indices]
        width = max(len(r[0]) for r in rows)
        b, dim = len(rows), self.features.shape[1]
        tokens = torch.full((b, width), pad_id, dtype=torch.long)
        labels = torch.full((b, width), pad_id, dtype=torch.long)
        feats = torch.zeros(b, width, dim)
        for j, (tok, lab, feat, _) in enumerate(rows):
            n = len(tok)
            tokens[j, :n] = torch.from_numpy(np.asarray(tok, dtype=np.int64))
            labels[j, :n] = torch.from_numpy(np.asarray(lab, dtype=np.int64))
            feats[j, :n] = torch.from_numpy(np.array(feat, dtype=np.float32))
        lengths = torch.tensor([len(r[0]) for r in rows])
        starts = torch.tensor([r[3] for r in rows])
        top_ids = top_logp = None
        if self.topk:
            top_ids = torch.zeros(b, width, self.topk, dtype=torch.long)
            top_logp = torch.full((b, width, self.topk), -math.inf)
            for j, i in enumerate(indices):
                offset, n, _ = (int(v) for v in self.index[int(i)])
                top_ids[j, :n] = torch.from_numpy(self.topk_ids[offset:offset + n].astype(np.int64))
                top_logp[j, :n] = torch.from_numpy(self.topk_logp[offset:offset + n].astype(np.float32))
        return FeatureBatch(tokens, labels, feats, lengths, starts, top_ids, top_logp)

    def label_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id is a label, over positions anchors can train on."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for offset, n, start in self.index:
            lab = np.asarray(self.labels[offset + max(start - 1, 0):offset + n])
            counts += np.bincount(lab, minlength=vocab_size)[:vocab_size]
        return counts


class OnTheFlyFeatures:
    """The FeatureStore interface over in-memory sequences, running the target per batch."""

    def __init__(self, target: HFTarget, sequences: Sequence[TokenSequence], topk: int = 0):
        if not sequences:
            raise DflashTrtError("no training sequences: the data is empty")
        self.target, self.sequences, self.topk = target, list(sequences), topk
        self.target_layer_ids = list(target.layer_ids)
        self.num_tokens = sum(len(s.ids) for s in self.sequences)

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, indices: Sequence[int], pad_id: int = 0) -> FeatureBatch:
        seqs = [self.sequences[int(i)] for i in indices]
        tokens = _pad([s.ids for s in seqs], pad_id)  # (B, L)
        got = extract(self.target, tokens, topk=self.topk)
        lengths = torch.tensor([len(s.ids) for s in seqs])
        top_ids = top_logp = None
        if self.topk:  # padding gets no soft label, as in FeatureStore.batch
            pad = torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]  # (B, L)
            top_ids = got.topk_ids.cpu().masked_fill(pad[..., None], 0)
            top_logp = got.topk_logp.cpu().masked_fill(pad[..., None], -math.inf)
        return FeatureBatch(tokens, got.labels.cpu(), got.features.float().cpu(), lengths,
                            torch.tensor([s.train_start for s in seqs]), top_ids, top_logp)

    def label_counts(self, vocab_size: int) -> np.ndarray:
        counts = np.zeros(vocab_size, dtype=np.int64)
        for b in range(0, len(self.sequences), 8):
            batch = self.batch(range(b, min(b + 8, len(self.sequences))))
            for j in range(batch.tokens.shape[0]):
                lab = batch.labels[j, max(int(batch.train_start[j]) - 1, 0):int(batch.lengths[j])]
                counts += np.bincount(lab.numpy(), minlength=vocab_size)[:vocab_size]
        return counts
