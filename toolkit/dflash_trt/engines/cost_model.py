"""The step cost model of the torch engine, measured on the device that serves.

`cost_model.json` in an engine directory holds the seconds of a target forward over 1 .. block_size
new tokens and of one drafter block pass (dflash.draft_length.StepCosts), for batch 1 and, for a
batching engine, for batches of 2, 4, ... up to max_batch_size rows (`batches`), with the device,
dtype and versions they were measured with. The compile stage writes it; an engine loaded on another
device kind (or in another dtype) does not trust it and measures again.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trt.atomic import write_atomic
from dflash_trt.dflash.draft_length import StepCosts
from dflash_trt.errors import DflashTrtError

COST_MODEL_FILE = "cost_model.json"
# The drafter's confidence -> measured acceptance (dflash.acceptance.calibration_points), written
# by the compile stage from the verify stage's acceptance profile; the device does not matter.
CALIBRATION_FILE = "acceptance_calibration.json"
CONTEXT_TOKENS = 128  # a typical position for a verify step: the cost grows slowly with context
REPEATS = 5


@dataclass(frozen=True)
class CostModel:
    """Step costs and what they were measured on."""

    costs: StepCosts
    device: str  # "cpu" or "cuda"
    device_name: str  # the CPU model or the GPU name: the "device kind"
    dtype: str
    threads: int
    torch_version: str
    context_tokens: int = CONTEXT_TOKENS
    batches: dict[int, StepCosts] = field(default_factory=dict)  # rows -> costs, rows >= 2

    def identity(self) -> tuple[str, str, str]:
        return self.device, self.device_name, self.dtype

    def step_s(self, rows: int, width: float) -> float:
        """Seconds of a drafter pass plus a verify forward of `width` tokens over `rows` rows."""
        return self.draft_s(rows) + self.verify_s(rows, width)

    def verify_s(self, rows: int, width: float) -> float:
        """A target forward of `width` new tokens in each of `rows` rows: linear between measured
        batch sizes, proportional above the largest. A fractional width is a packed forward of
        rows * width tokens (dflash.slots.PackedView): linear between the whole widths around it."""
        def at_width(costs: StepCosts) -> float:
            table = costs.verify_s
            lo = min(max(int(width), 1), len(table))
            frac = min(max(width - lo, 0.0), 1.0) if lo < len(table) else 0.0
            return table[lo - 1] + (table[lo] - table[lo - 1]) * frac if frac else table[lo - 1]
        return self._at(rows, at_width)

    def draft_s(self, rows: int) -> float:
        """One drafter block pass over `rows` rows."""
        return self._at(rows, lambda costs: costs.draft_s)

    def _at(self, rows: int, part) -> float:
        table = {1: self.costs, **self.batches}
        sizes = sorted(table)
        if rows in table:
            return part(table[rows])
        if rows > sizes[-1]:
            return part(table[sizes[-1]]) * rows / sizes[-1]
        hi = next(n for n in sizes if n > rows)
        lo = max(n for n in sizes if n < rows)
        return part(table[lo]) + (part(table[hi]) - part(table[lo])) * (rows - lo) / (hi - lo)

    def write(self, engine_dir: Path) -> Path:
        path = Path(engine_dir) / COST_MODEL_FILE
        data = asdict(self)
        data["costs"] = _costs_json(self.costs)
        data["batches"] = {str(n): _costs_json(c) for n, c in sorted(self.batches.items())}
        # A new file, not a rewrite: readers never see half of it, and a copy hard-linked from it
        # (the Triton repository's engine/) keeps the cost model it had.
        write_atomic(path, json.dumps(data, indent=2) + "\n")
        return path

    @classmethod
    def read(cls, engine_dir: Path) -> CostModel | None:
        """The engine directory's cost model, or None when it has none."""
        path = Path(engine_dir) / COST_MODEL_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            costs = _costs(data.pop("costs"))
            batches = {int(n): _costs(c) for n, c in (data.pop("batches", None) or {}).items()}
            return cls(costs=costs, batches=batches, **data)
        except (ValueError, KeyError, TypeError) as exc:
            raise DflashTrtError(f"{path}: not a cost model ({exc}); delete it and rebuild the "
                                 "compile stage, or run without it") from None


class OnlineCosts:
    """A CostModel corrected by what the serving batch measures as it runs.

    A stored cost model is measured once, on rows of equal length, and a shared machine drifts
    (on this project's CPU, 8 rows of one new token measured 150 ms at profile time and 124 ms
    while serving). Each verify forward and drafter pass the batch times replaces the estimate for
    its (rows, width) by a moving average (RATE; a packed forward's width is its mean, tokens
    over rows); a width not yet seen is the stored value scaled by what one-token forwards over
    as many rows measured. A width the stored model makes look
    cheap gets chosen, measured and corrected; one it makes look dear stays unchosen."""

    RATE = 0.2

    def __init__(self, model: CostModel):
        self.model = model
        self.verify: dict[tuple[int, float], float] = {}  # (rows, width) -> seconds
        self.draft: dict[int, float] = {}  # rows -> seconds

    def record(self, part: str, rows: int, width: float, seconds: float) -> None:
        """A measured `verify` forward of `width` tokens, or a `draft` pass, over `rows` rows."""
        table, key = (self.verify, (rows, width)) if part == "verify" else (self.draft, rows)
        old = table.get(key)
        table[key] = seconds if old is None else old + self.RATE * (seconds - old)

    def verify_s(self, rows: int, width: float) -> float:
        if (rows, width) in self.verify:
            return self.verify[rows, width]
        scale = self.verify[rows, 1] / self.model.verify_s(rows, 1) if (rows, 1) in self.verify \
            else 1.0
        return self.model.verify_s(rows, width) * scale

    def draft_s(self, rows: int) -> float:
        return self.draft.get(rows, self.model.draft_s(rows))

    def step_s(self, rows: int, width: float) -> float:
        return self.draft_s(rows) + self.verify_s(rows, width)


def _costs_json(costs: StepCosts) -> dict:
    return {"verify_s": list(costs.verify_s), "draft_s": costs.draft_s}


def _costs(data: dict) -> StepCosts:
    return StepCosts(tuple(float(s) for s in data["verify_s"]), float(data["draft_s"]))


def batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes a batching engine measures: 2, 4, 8, ... below it, and itself."""
    sizes, n = [], 2
    while n < max_batch_size:
        sizes.append(n)
        n *= 2
    return [*sizes, max_batch_size] if max_batch_size > 1 else []


def device_identity(device: str, dtype: str) -> tuple[str, str, str]:
    """(device kind, device name, dtype) of where this process computes."""
    import torch

    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    if kind == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = _cpu_name()
    return kind, name, dtype


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_model_for(engine, engine_dir: Path | None) -> CostModel:
    """The engine directory's cost model when it was measured on this device kind and dtype,
    else a fresh measurement (a few seconds)."""
    stored = CostModel.read(engine_dir) if engine_dir is not None else None
    here = device_identity(engine.device, engine.dtype)
    wanted = batch_sizes(getattr(engine, "max_batch_size", 1))
    if stored is not None and stored.identity() == here \
            and len(stored.costs.verify_s) == engine.block_size \
            and set(wanted) <= set(stored.batches):
        return stored
    return measure(engine)


def measure(engine, *, context_tokens: int = CONTEXT_TOKENS, repeats: int = REPEATS) -> CostModel:
    """Time the target over 1 .. block_size new tokens after `context_tokens` of context, and the
    drafter's block pass, on the engine's own device and dtype, at batch 1 and at each batch size
    the engine batches (medians over `repeats`, every shape timed once per round: `timed_rounds`)."""
    import torch

    from dflash_trt.dflash.generate import draft_block
    from dflash_trt.dflash.sampling import Sampler

    target, drafter, block = engine.target, engine.drafter, engine.block_size
    if drafter is None or block < 2:
        raise DflashTrtError("a cost model needs a drafter with block_size >= 2")
    vocab = target.embed_tokens.num_embeddings
    ids = torch.arange(context_tokens + block, device=engine.device)[None] * 7 % vocab  # (1, C+B)
    sync = torch.cuda.synchronize if str(engine.device).startswith("cuda") else (lambda: None)

    with torch.inference_mode():
        cache = target.new_cache()
        _, features = target.forward(ids[:, :context_tokens], cache, True)  # (1, C, k*H)

        def verify(n: int):
            def run():
                hidden, _ = target.forward(ids[:, context_tokens:context_tokens + n], cache, True)
                target.logits(hidden[0])  # (n, V): every row, as a fully accepted step needs
                cache.crop(context_tokens)
            return run

        draft_cache = drafter.new_cache()
        start = context_tokens - 2
        draft_block(target, drafter, 0, features[:, :start], draft_cache, start, block,
                    block - 1, Sampler())  # the context up to the newest two tokens

        def draft():
            draft_block(target, drafter, 0, features[:, start:], draft_cache, context_tokens,
                        block, block - 1, Sampler())
            draft_cache.crop(start)  # a step injects the newly accepted tokens' features

        runs = {1: [*(verify(n) for n in range(1, block + 1)), draft]}  # widths 1..B, the draft
        for rows in batch_sizes(getattr(engine, "max_batch_size", 1)):
            runs[rows] = _batch_runs(engine, rows, ids, context_tokens)
        seconds = iter(timed_rounds([run for group in runs.values() for run in group], repeats,
                                    sync))
    costs = {}
    for rows in runs:
        each = [next(seconds) for _ in range(block + 1)]
        costs[rows] = StepCosts(tuple(each[:block]), each[block])
    kind, name, dtype = device_identity(engine.device, engine.dtype)
    return CostModel(costs=costs.pop(1), device=kind, device_name=name,
                     dtype=dtype, threads=torch.get_num_threads(),
                     torch_version=torch.__version__, context_tokens=context_tokens,
                     batches=costs)


def timed_rounds(runs: Sequence[Callable[[], object]], repeats: int,
                 sync: Callable[[], None] = lambda: None) -> list[float]:
    """The median seconds of each run over `repeats` rounds, each round timing every run once in
    turn after one untimed call of each. A shared machine's speed drifts by 10-30% within a
    minute; timed one shape after another, the drift would land in the ratios between shapes
    (a build measured a 1-row forward slower than an 8-row one), which is what the chooser uses."""
    for run in runs:
        run()  # warm-up: kernels, caches, pages of the weights
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, mine in zip(runs, times, strict=True):
            sync()
            began = time.perf_counter()
            run()
            sync()
            mine.append(time.perf_counter() - began)
    return [statistics.median(mine) for mine in times]


def _batch_runs(engine, rows: int, ids, context_tokens: int) -> list[Callable[[], None]]:
    """[verify runs of 1 .. block_size new tokens, then the draft run] for `rows` rows through dflash.batch's
    caches: each row holds `context_tokens`, verifies, and drafts after 2 new context positions."""
    import torch

    target, drafter, block = engine.target, engine.drafter, engine.block_size
    capacity = context_tokens + block
    kv = target.new_slot_cache(rows, capacity)
    prompt = ids[:, :context_tokens].expand(rows, -1)  # (rows, C)
    _, features = target.forward(prompt, kv.view(0, rows, context_tokens), True)
    kv.lengths[:rows] = [context_tokens] * rows
    dkv = drafter.new_slot_cache(rows, capacity)
    start = context_tokens - 2
    drafter.forward_rows(None, features[:, :start], [start] * rows, dkv.view(0, rows, start))
    dkv.lengths[:rows] = [start] * rows

    def verify(n: int):
        def run():
            hidden, _ = target.forward(ids[:, context_tokens:context_tokens + n].expand(rows, -1),
                                       kv.view(0, rows, n), True)
            target.logits(hidden)  # (rows, n, V): every row, as fully accepted steps need
        return run

    vocab = getattr(drafter, "draft_vocab", None)
    block_ids = torch.zeros(rows, block, dtype=torch.long, device=ids.device)

    def draft():
        hidden = drafter.forward_rows(target.embed(block_ids), features[:, start:],
                                      [2] * rows, dkv.view(0, rows, 2))
        drafted = hidden[:, 1:]  # (rows, B-1, H)
        target.logits(drafted) if vocab is None else target.logits_rows(drafted, vocab)

    return [*(verify(n) for n in range(1, block + 1)), draft]
