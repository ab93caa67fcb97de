"""Engine-level benchmark, no server: DFlash against plain decoding and Hugging Face `generate`.

Contenders run the same tokenized prompts with the same token budget, greedily:
- `dflash`: this project's engine with speculation on, verifying the whole block every step;
- `dflash-adaptive` (with adaptive): the same engine verifying per step only the drafts worth
  their cost (dflash.draft_length, step costs measured before the runs);
- `dflash+lookup` (with prompt_lookup): the same engine drafting by prompt lookup where the
  newest n-gram occurred before, with the DFlash drafter elsewhere (dflash.lookup);
- `plain`: the same engine with num_draft_tokens=0 (one token per target forward);
- `hf-generate`: transformers `generate`, greedy (what most users run today);
- `hf-prompt-lookup`: transformers prompt-lookup decoding (`prompt_lookup_num_tokens`), the
  drafter-free speculative baseline transformers ships.

Runs are interleaved (repeat -> prompt -> contender, with the contender order rotated per prompt) so
that a slow phase of a shared machine hits every contender alike. Each repeat gives one tokens/s per
contender (all its tokens over all its time); the report takes medians over repeats and ratios of
medians. At temperature 0 every contender must produce exactly the reference's tokens: any
mismatch is recorded with its prompt and first differing position and makes the report fail.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trt.engines.base import first_mismatch

PLAIN = "plain"
DFLASH = "dflash"
DFLASH_ADAPTIVE = "dflash-adaptive"
DFLASH_CALIBRATED = "dflash-calibrated"  # adaptive, its confidences calibrated on measured acceptance
DFLASH_LOOKUP = "dflash+lookup"
HF_GREEDY = "hf-generate"
# transformers as it ships: its own sdpa attention and matmuls (hf-generate runs the engine's model
# object, with the engine's attention and, on CPU, its oneDNN linears).
HF_STOCK = "hf-generate-stock"
HF_PROMPT_LOOKUP = "hf-prompt-lookup"
PROMPT_LOOKUP_NUM_TOKENS = 10  # transformers' own default for prompt lookup


@dataclass(frozen=True)
class Generation:
    """One contender's output for one prompt."""

    token_ids: list[int]
    target_forwards: int | None = None  # steps of the target (None when the contender can't say)


@dataclass(frozen=True)
class Contender:
    """A named greedy generator: (prompt ids, max_new_tokens) -> Generation."""

    name: str
    generate: Callable[[Sequence[int], int], Generation]


@dataclass(frozen=True)
class Mismatch:
    """A greedy output that differs from the reference's."""

    contender: str
    prompt_index: int
    repeat: int
    first_difference: int  # index of the first differing token (or the shorter length)
    reference_length: int
    length: int


@dataclass
class ContenderSummary:
    """Medians over repeats for one contender."""

    name: str
    tokens_per_s: float  # median over repeats of (all tokens / all seconds)
    tokens_per_s_runs: list[float]
    median_latency_s: float  # median over prompts and repeats of one generation's wall time
    output_tokens: int  # per repeat (identical across repeats when outputs are deterministic)
    acceptance_length: float  # tokens per target forward (NaN when unknown)
    ms_per_target_forward: float  # NaN when unknown
    speedup_vs: dict[str, float] = field(default_factory=dict)  # other contender -> ratio


@dataclass
class OfflineReport:
    """Everything bench-offline measured."""

    num_prompts: int
    max_new_tokens: int
    repeats: int
    reference: str
    contenders: list[ContenderSummary]
    mismatches: list[Mismatch]

    @property
    def identical(self) -> bool:
        return not self.mismatches

    def summary(self, name: str) -> ContenderSummary:
        return next(c for c in self.contenders if c.name == name)

    def to_dict(self) -> dict:
        return {**asdict(self), "identical": self.identical}


first_difference = first_mismatch  # index of the first differing token; None when equal


def run_offline(contenders: Sequence[Contender], prompts: Sequence[Sequence[int]], *,
                max_new_tokens: int, repeats: int = 3, reference: str | None = None,
                warmup: bool = True,
                on_run: Callable[[str, int, int], None] | None = None) -> OfflineReport:
    """Time every contender on every prompt, interleaved; compare outputs with the reference's.

    `reference` names the contender whose greedy tokens are the truth (default: the first).
    `on_run(contender, prompt_index, repeat)` is called after each timed run (progress bars).
    """
    if not contenders or not prompts:
        raise ValueError("run_offline needs at least one contender and one prompt")
    names = [c.name for c in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must be unique: {names}")
    reference = reference or names[0]
    if reference not in names:
        raise ValueError(f"reference {reference!r} is not a contender ({names})")
    if warmup:  # first calls pay for lazy init, allocator growth and kernel selection
        for c in contenders:
            c.generate(prompts[0], min(max_new_tokens, 8))

    # seconds[name][repeat][prompt], outputs[name][repeat][prompt]
    seconds = {n: [[0.0] * len(prompts) for _ in range(repeats)] for n in names}
    outputs: dict[str, list[list[Generation | None]]] = {
        n: [[None] * len(prompts) for _ in range(repeats)] for n in names}
    for r in range(repeats):
        for p, prompt in enumerate(prompts):
            shift = (r * len(prompts) + p) % len(contenders)
            for c in [*contenders[shift:], *contenders[:shift]]:
                t0 = time.perf_counter()
                gen = c.generate(prompt, max_new_tokens)
                seconds[c.name][r][p] = time.perf_counter() - t0
                outputs[c.name][r][p] = gen
                if on_run is not None:
                    on_run(c.name, p, r)

    mismatches = []
    for n in names:
        for r in range(repeats):
            for p in range(len(prompts)):
                want = outputs[reference][0][p].token_ids
                got = outputs[n][r][p].token_ids
                diff = first_difference(want, got)
                if diff is not None:
                    mismatches.append(Mismatch(n, p, r, diff, len(want), len(got)))

    summaries = [_summarize(n, seconds[n], outputs[n]) for n in names]
    for s in summaries:
        s.speedup_vs = {o.name: _ratio(s.tokens_per_s, o.tokens_per_s)
                        for o in summaries if o.name != s.name}
    return OfflineReport(num_prompts=len(prompts), max_new_tokens=max_new_tokens, repeats=repeats,
                         reference=reference, contenders=summaries, mismatches=mismatches)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _summarize(name: str, seconds: list[list[float]],
               outputs: list[list[Generation]]) -> ContenderSummary:
    runs = []
    for secs, gens in zip(seconds, outputs, strict=True):
        tokens = sum(len(g.token_ids) for g in gens)
        runs.append(tokens / sum(secs) if sum(secs) > 0 else math.nan)
    gens = [g for per_repeat in outputs for g in per_repeat]
    forwards = [g.target_forwards for g in gens]
    known = None not in forwards and sum(forwards) > 0
    total_tokens = sum(len(g.token_ids) for g in gens)
    total_seconds = sum(sum(s) for s in seconds)
    return ContenderSummary(
        name=name,
        tokens_per_s=statistics.median(runs),
        tokens_per_s_runs=runs,
        median_latency_s=statistics.median(s for per in seconds for s in per),
        output_tokens=sum(len(g.token_ids) for g in outputs[0]),
        acceptance_length=total_tokens / sum(forwards) if known else math.nan,
        ms_per_target_forward=1000 * total_seconds / sum(forwards) if known else math.nan,
    )


# --- contenders --------------------------------------------------------------------------------


def engine_contender(name: str, engine, num_draft_tokens: int | None,
                     prompt_lookup: bool = False, cost_model=None, acceptance=None) -> Contender:
    """The torch engine at temperature 0; num_draft_tokens=0 turns speculation off; a cost model
    turns on adaptive draft length, `acceptance` calibrates its confidences."""
    from dflash_trt.engines.base import SamplingParams

    def generate(prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        engine.prompt_lookup = prompt_lookup  # contenders share one engine
        engine.cost_model = cost_model
        engine.acceptance = acceptance
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                num_draft_tokens=num_draft_tokens)
        tokens, forwards = [], 0
        for step in engine.stream(list(prompt_ids), params):
            tokens.extend(step.token_ids)
            forwards += 1 if step.token_ids else 0
        return Generation(tokens, forwards)

    return Contender(name, generate)


def hf_contender(name: str, model, *, eos_token_ids: Sequence[int],
                 prompt_lookup_num_tokens: int | None = None) -> Contender:
    """transformers `generate`, greedy; with prompt_lookup_num_tokens, prompt-lookup decoding.

    eos_token_ids must be the engine's stop tokens so both stop at the same place.
    """
    import torch

    device = next(model.parameters()).device
    eos = list(eos_token_ids)
    pad = eos[0] if eos else 0
    extra = {} if prompt_lookup_num_tokens is None else {
        "prompt_lookup_num_tokens": prompt_lookup_num_tokens}

    @torch.inference_mode()
    def generate(prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # (1, P)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, temperature=None, top_p=None, top_k=None,
            eos_token_id=eos or None, pad_token_id=pad, **extra)  # (1, P + N)
        return Generation(out[0, ids.shape[1]:].tolist())

    return Contender(name, generate)


@dataclass
class LoadedContenders:
    """The contenders over one target checkpoint, plus the tokenizer they share."""

    contenders: list[Contender]
    tokenize: Callable[[str, bool], list[int]]
    device: str
    block_size: int
    step_costs_ms: dict | None = None  # the adaptive contender's measured step costs


def load_contenders(target: str, drafter_dir: Path, *, device: str = "auto",
                    dtype: str = "float32", block_size: int | None = None,
                    prompt_lookup_num_tokens: int = PROMPT_LOOKUP_NUM_TOKENS,
                    max_seq_len: int = 4096, prompt_lookup: bool = False,
                    adaptive: bool = False,
                    calibration: list | None = None) -> LoadedContenders:
    """Load the torch engine; the transformers contenders run the engine's own model object.

    Sharing the model guarantees the same weights, dtype, device and attention implementation,
    so greedy outputs are comparable token for token.
    """
    from dflash_trt.engines.torch_engine import TorchEngine
    from dflash_trt.stages.resolve import resolve_source

    engine = TorchEngine.load(resolve_source(target), drafter_dir, device=device, dtype=dtype,
                              block_size=block_size, max_seq_len=max_seq_len)
    eos = list(engine.stop_token_ids)
    contenders = [
        hf_contender(HF_GREEDY, engine.model, eos_token_ids=eos),
        engine_contender(DFLASH, engine, num_draft_tokens=None),
        engine_contender(PLAIN, engine, num_draft_tokens=0),
        hf_contender(HF_PROMPT_LOOKUP, engine.model, eos_token_ids=eos,
                     prompt_lookup_num_tokens=prompt_lookup_num_tokens),
    ]
    stock = _stock_model(resolve_source(target), dtype, engine.device)
    if stock is not None:
        contenders.insert(1, hf_contender(HF_STOCK, stock, eos_token_ids=eos))
    if prompt_lookup:
        contenders.insert(2, engine_contender(DFLASH_LOOKUP, engine, num_draft_tokens=None,
                                              prompt_lookup=True))
    costs_ms = None
    if adaptive:
        from dflash_trt.engines.cost_model import measure

        cost_model = measure(engine)
        costs_ms = {"verify": [round(1000 * s, 2) for s in cost_model.costs.verify_s],
                    "draft": round(1000 * cost_model.costs.draft_s, 2)}
        contenders.insert(2, engine_contender(DFLASH_ADAPTIVE, engine, num_draft_tokens=None,
                                              cost_model=cost_model))
        if calibration:
            from dflash_trt.dflash.acceptance import calibrated

            contenders.insert(3, engine_contender(DFLASH_CALIBRATED, engine,
                                                  num_draft_tokens=None, cost_model=cost_model,
                                                  acceptance=calibrated(calibration)))
    return LoadedContenders(
        contenders=contenders, tokenize=engine.tokenize, device=str(engine.device),
        block_size=engine.block_size, step_costs_ms=costs_ms)


def _stock_model(target_dir: Path, dtype: str, device):
    """The target as transformers loads it (sdpa attention, no oneDNN packing), or None for a
    quantized checkpoint, which transformers cannot run without this project's kernels."""
    from dflash_trt.formats.load import load_target

    if (Path(target_dir) / "hf_quant_config.json").is_file():
        return None
    model = load_target(target_dir, dtype=dtype, device=str(device))
    model.config._attn_implementation = "sdpa"
    return model


# --- where the time goes -----------------------------------------------------------------------

# (file suffix, function) -> label. Cumulative times nest: draft_block includes the drafter's LM
# head, accept_greedy includes the verify logits it asks for.
PROFILE_POINTS = (
    ("dflash/generate.py", "generate_steps", "whole generation (engine side)"),
    ("dflash/generate.py", "draft_block", "drafting (drafter pass + draft logits)"),
    ("dflash/lookup.py", "lookup_drafts", "prompt lookup"),
    ("dflash/target.py", "forward", "target forward (prefill + verify)"),
    ("dflash/target.py", "logits", "LM head (all calls)"),
    ("dflash/generate.py", "accept_greedy", "acceptance (incl. verify logits)"),
    ("", "crop", "cache crop"),
    ("engines/detokenize.py", "push", "detokenize + stop words"),
)


def profile_breakdown(contender: Contender, prompts: Sequence[Sequence[int]],
                      max_new_tokens: int) -> list[dict]:
    """Run a contender under cProfile; cumulative seconds of the DFlash steps, plus the total.

    cProfile adds overhead to every Python call, so the split is indicative; the timed runs above
    are the numbers to quote.
    """
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for prompt in prompts:
        contender.generate(prompt, max_new_tokens)
    profiler.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profiler).stats  # (file, line, func) -> (cc, ncalls, tottime, cumtime, ..)
    rows = [{"what": "wall time under the profiler", "seconds": wall, "calls": len(prompts)}]
    for suffix, func, label in PROFILE_POINTS:
        hits = [(v[1], v[3]) for (file, _, name), v in stats.items()
                if name == func and file.replace("\\", "/").endswith(suffix)]
        if hits:
            rows.append({"what": f"{label} [{func}]", "seconds": sum(h[1] for h in hits),
                         "calls": sum(h[0] for h in hits)})
    return rows


def profile_markdown(rows: list[dict], name: str) -> str:
    """The breakdown as a Markdown table with each row's share of the wall time."""
    wall = rows[0]["seconds"] or math.nan
    lines = [f"## Where the time goes: {name} (cProfile, cumulative, nested)", "",
             "| part | seconds | share of wall | calls |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['seconds']:.3f} | {100 * r['seconds'] / wall:.0f}% "
              f"| {r['calls']} |" for r in rows]
    return "\n".join(lines) + "\n"


# --- outputs -----------------------------------------------------------------------------------


def _fmt(x: float, spec: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(report: OfflineReport, title: str = "Offline benchmark") -> str:
    """A Markdown table: tokens/s, ratios to plain decoding and to HF generate, acceptance."""
    names = [c.name for c in report.contenders]
    lines = [f"## {title}", "",
             f"{report.num_prompts} prompts, max_new_tokens {report.max_new_tokens}, "
             f"{report.repeats} interleaved repeats, greedy; medians over repeats.", "",
             "| contender | tokens/s | vs plain | vs hf-generate | median latency (s) "
             "| acceptance length | ms / target forward |",
             "|---|---|---|---|---|---|---|"]
    for c in report.contenders:
        vs_plain = 1.0 if c.name == PLAIN else c.speedup_vs.get(PLAIN, math.nan)
        vs_hf = 1.0 if c.name == HF_GREEDY else c.speedup_vs.get(HF_GREEDY, math.nan)
        lines.append(f"| {c.name} | {_fmt(c.tokens_per_s)} | {_fmt(vs_plain, '.2f')}x "
                     f"| {_fmt(vs_hf, '.2f')}x | {_fmt(c.median_latency_s, '.3f')} "
                     f"| {_fmt(c.acceptance_length, '.2f')} "
                     f"| {_fmt(c.ms_per_target_forward)} |")
    lines.append("")
    if DFLASH in names and PLAIN in names:
        d, p = report.summary(DFLASH), report.summary(PLAIN)
        if not math.isnan(d.ms_per_target_forward) and not math.isnan(p.ms_per_target_forward):
            # DFlash wins when its tokens per forward exceed its cost per forward in plain forwards.
            lines += [f"Break-even acceptance length for DFlash on this machine: "
                      f"{d.ms_per_target_forward / p.ms_per_target_forward:.2f} "
                      f"(one DFlash step costs {d.ms_per_target_forward:.1f} ms, one plain step "
                      f"{p.ms_per_target_forward:.1f} ms); measured "
                      f"{_fmt(d.acceptance_length, '.2f')}.", ""]
    if report.identical:
        lines.append(f"Outputs: all greedy outputs identical to {report.reference}.")
    else:
        lines.append(f"**OUTPUTS DIFFER: {len(report.mismatches)} greedy outputs differ from "
                     f"{report.reference}** (contender, prompt, repeat, first differing token):")
        lines += [f"- {m.contender} prompt {m.prompt_index} repeat {m.repeat}: token "
                  f"{m.first_difference} (lengths {m.reference_length} vs {m.length})"
                  for m in report.mismatches[:20]]
    return "\n".join(lines) + "\n"


def write_outputs(report: OfflineReport, out_dir: Path, meta: dict) -> list[Path]:
    """offline.json, offline.md and offline.png (tokens/s per contender) under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "offline.json", out_dir / "offline.md", out_dir / "offline.png"]
    paths[0].write_text(json.dumps({"meta": meta, **report.to_dict()}, indent=2, default=str))
    paths[1].write_text(markdown(report))
    _plot(report, paths[2])
    return paths


def _plot(report: OfflineReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [c.name for c in report.contenders]
    values = [c.tokens_per_s for c in report.contenders]
    ax.bar(names, values, color=["C1" if n == DFLASH else "C0" for n in names])
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(f"Offline greedy decoding, {report.num_prompts} prompts, "
                 f"{report.max_new_tokens} new tokens")
    for i, v in enumerate(values):
        ax.text(i, v, _fmt(v), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
