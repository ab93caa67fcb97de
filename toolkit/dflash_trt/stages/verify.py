"""The `verify` stage: quality gates on the quantized build, run with the torch engine.

(a) Lossless: on the quantized target at temperature 0, speculative output == plain greedy output.
(b) Acceptance: mean acceptance length of the quantized drafter + target, against the unquantized
    pair from `resolve`; gates `verify.min_acceptance_length` and `verify.max_acceptance_drop`.
(c) Target quantization error against the unquantized target on held-out text (the verify prompts
    with the unquantized model's own continuations; never calibration data): top-1 agreement and
    mean KL(unquantized || quantized) per position.
Writes reports/verify.json, verify.md and acceptance.png, then fails the stage if a gate failed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trt.dflash.acceptance import acceptance_profile, plot_profile, profile_lines
from dflash_trt.engines.base import classify_outputs
from dflash_trt.errors import DflashTrtError

REPORT_JSON = "verify.json"
REPORT_MD = "verify.md"
REPORT_PNG = "acceptance.png"
PROFILE_PNG = "acceptance_profile.png"
ACT_QUANT_FORMATS = ("nvfp4", "fp8")  # formats that quantize activations at run time


@dataclass
class PromptResult:
    """One prompt through the quantized pair (and the unquantized pair for acceptance)."""

    prompt_tokens: int
    lossless: bool  # speculative == plain greedy on the quantized target, up to a proven tie
    first_mismatch: int | None  # index of the first differing new token
    acceptance_lengths: list[int]  # quantized pair, tokens per target forward
    baseline_acceptance_lengths: list[int]  # unquantized pair
    status: str = "identical"  # identical | near-tie (bf16/fp16 only) | mismatch


@dataclass
class QuantError:
    """Quantized vs unquantized target on the same token sequences."""

    positions: int
    top1_agreement: float
    mean_kl: float


@dataclass
class VerifyReport:
    prompts: str
    num_prompts: int
    max_new_tokens: int
    target_format: str
    drafter_format: str
    block_size: int
    results: list[PromptResult] = field(default_factory=list)
    quant_error: QuantError | None = None
    lossless_dtype: str = "float32"  # dtype the quantized engine ran the lossless check in
    acceptance_profile: dict | None = None  # quantized pair (dflash.acceptance)
    # The quantized pair drafting over the whole vocabulary, as TensorRT-LLM drafts (it ignores
    # draft_vocab.json); None when the drafter has no draft vocabulary (then it is the same run).
    full_vocab_acceptance_lengths: list[int] | None = None
    full_vocab_acceptance_profile: dict | None = None  # the same run's profile (TensorRT-LLM's)
    gate_on_full_vocab: bool = False  # tensorrt_llm builds: min_acceptance_length gates this one
    failures: list[str] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return _mean([a for r in self.results for a in r.acceptance_lengths])

    @property
    def baseline_acceptance_length(self) -> float:
        return _mean([a for r in self.results for a in r.baseline_acceptance_lengths])

    @property
    def full_vocab_acceptance_length(self) -> float:
        if self.full_vocab_acceptance_lengths is None:
            return self.acceptance_length
        return _mean(self.full_vocab_acceptance_lengths)

    @property
    def lossless(self) -> bool:
        return all(r.lossless for r in self.results)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(acceptance_length=self.acceptance_length,
                    full_vocab_acceptance_length=self.full_vocab_acceptance_length,
                    baseline_acceptance_length=self.baseline_acceptance_length,
                    acceptance_drop=self.baseline_acceptance_length - self.acceptance_length,
                    lossless=self.lossless, passed=not self.failures)
        return data


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def gate_failures(report: VerifyReport, min_acceptance_length: float,
                  max_acceptance_drop: float) -> list[str]:
    """The gates: lossless output, minimum acceptance, maximum acceptance drop."""
    failures = []
    noisy = report.target_format in ACT_QUANT_FORMATS and report.lossless_dtype != "float64"
    for i, r in enumerate(report.results):
        if not r.lossless:
            cause = (f"checked in {report.lossless_dtype}, whose rounding noise {report.target_format} "
                     "activation quantization amplifies; the torch engine needs float64 support"
                     if noisy else "the lossless invariant is broken; this is a bug, please report it")
            failures.append(f"prompt {i}: speculative output differs from plain greedy decoding "
                            f"at new token {r.first_mismatch} on the quantized target ({cause})")
    acc, base = report.acceptance_length, report.baseline_acceptance_length
    gated = report.full_vocab_acceptance_length if report.gate_on_full_vocab else acc
    if gated < min_acceptance_length:
        which = (" over the full vocabulary (as TensorRT-LLM drafts: it ignores "
                 "draft_vocab.json)" if report.gate_on_full_vocab else "")
        failures.append(f"mean acceptance length{which} {gated:.2f} < "
                        f"verify.min_acceptance_length {min_acceptance_length:g}: the drafter "
                        "does not fit the target (train it, use a matching drafter, or lower the "
                        "gate)")
    if base - acc > max_acceptance_drop:
        failures.append(f"quantization lowers the mean acceptance length by {base - acc:.2f} "
                        f"({base:.2f} -> {acc:.2f}) > verify.max_acceptance_drop "
                        f"{max_acceptance_drop:g}; try quantize.drafter.format: fp8 or none")
    return failures


# --- measurement ----------------------------------------------------------------------------


def run_prompts(engine, prompt_ids: list[list[int]], max_new_tokens: int, plain: bool,
                drafter_steps: list | None = None):
    """(token ids, acceptance lengths) per prompt at temperature 0; plain = no speculation.
    drafter_steps, when given, gets (drafter confidences, drafts accepted) of every step."""
    from dflash_trt.engines.base import SamplingParams, collect

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            num_draft_tokens=0 if plain else None)
    if hasattr(engine, "draft_backoff"):
        engine.draft_backoff = False  # the gates measure the drafter on every step
    out = []
    for ids in prompt_ids:
        steps = list(engine.stream(ids, params))
        if drafter_steps is not None:
            drafter_steps += [(s.draft_confidence, s.num_accepted_draft_tokens) for s in steps]
        result = collect(iter(steps))
        out.append((list(result.token_ids), list(result.acceptance_lengths)))
    return out


def quantization_error(quantized, reference, sequences: list[list[int]], device) -> QuantError:
    """Top-1 agreement and mean KL(reference || quantized) over every position of the sequences."""
    import torch
    import torch.nn.functional as F

    agree, kl_sum, n = 0, 0.0, 0
    with torch.inference_mode():
        for seq in sequences:
            ids = torch.tensor([seq], device=device)  # (1, T)
            lq = quantized(input_ids=ids).logits[0].float()  # (T, V)
            lr = reference(input_ids=ids).logits[0].float()  # (T, V)
            agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
            log_q, log_r = F.log_softmax(lq, -1), F.log_softmax(lr, -1)
            kl_sum += float((log_r.exp() * (log_r - log_q)).sum())  # sum over positions
            n += ids.shape[1]
    return QuantError(positions=n, top1_agreement=agree / max(n, 1), mean_kl=kl_sum / max(n, 1))


# --- reports --------------------------------------------------------------------------------


def write_histogram(report: VerifyReport, path: Path) -> None:
    """Side-by-side acceptance-length histograms, unquantized vs quantized (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = [x - 0.5 for x in range(1, report.block_size + 2)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    base = [a for r in report.results for a in r.baseline_acceptance_lengths]
    quant = [a for r in report.results for a in r.acceptance_lengths]
    ax.hist([base, quant], bins=bins, label=[
        f"unquantized (mean {report.baseline_acceptance_length:.2f})",
        f"{report.target_format}/{report.drafter_format} (mean {report.acceptance_length:.2f})"])
    ax.set_xlabel("tokens per target forward (acceptance length)")
    ax.set_ylabel("steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_markdown(report: VerifyReport) -> str:
    """verify.md: the numbers a reviewer needs, and the verdict."""
    d = report.to_dict()
    lines = [
        "# Verify report", "",
        f"Prompts: `{report.prompts}` x {report.num_prompts}, {report.max_new_tokens} new tokens, "
        f"temperature 0, block size {report.block_size}.",
        f"Target format: {report.target_format}; drafter format: {report.drafter_format}; "
        f"lossless check in {report.lossless_dtype}.", "",
        "| check | result |", "|---|---|",
        f"| lossless (speculative == plain greedy, quantized target) | "
        f"{sum(r.lossless for r in report.results)}/{len(report.results)} prompts"
        f"{_ties(report)} |",
        f"| mean acceptance length, unquantized pair | {d['baseline_acceptance_length']:.3f} |",
        f"| mean acceptance length, quantized pair | {d['acceptance_length']:.3f} |",
        *([f"| mean acceptance length, quantized pair, full vocabulary (TensorRT-LLM drafts so)"
           f"{' (gated)' if report.gate_on_full_vocab else ''} | "
           f"{d['full_vocab_acceptance_length']:.3f} |"]
          if report.full_vocab_acceptance_lengths is not None else []),
        f"| acceptance drop | {d['acceptance_drop']:.3f} |",
    ]
    if report.quant_error is not None:
        q = report.quant_error
        lines += [f"| target top-1 agreement vs unquantized ({q.positions} positions) | "
                  f"{q.top1_agreement:.4f} |",
                  f"| target mean KL(unquantized ‖ quantized) | {q.mean_kl:.5f} |"]
    else:
        lines.append("| target quantization error | target not quantized |")
    if report.acceptance_profile is not None:
        lines += ["", "Acceptance profile, quantized pair:", ""]
        lines += [f"- {line}" for line in profile_lines(report.acceptance_profile)]
        lines += ["", f"![acceptance profile]({PROFILE_PNG})"]
    lines += ["", f"![acceptance lengths]({REPORT_PNG})", "",
              "**PASSED**" if not report.failures else "**FAILED**"]
    lines += [f"- {f}" for f in report.failures]
    return "\n".join(lines) + "\n"


def _ties(report: VerifyReport) -> str:
    ties = sum(r.status == "near-tie" for r in report.results)
    return f" ({ties} diverge at a {report.lossless_dtype} tie)" if ties else ""


def write_reports(report: VerifyReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_JSON).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (out / REPORT_MD).write_text(render_markdown(report))
    write_histogram(report, out / REPORT_PNG)
    if report.acceptance_profile is not None:
        plot_profile(report.acceptance_profile, out / PROFILE_PNG,
                     f"{report.prompts}, {report.target_format}/{report.drafter_format}")


# --- the stage ------------------------------------------------------------------------------


def _load_quantized_engine(engine_cls, quant_dir: Path, recipe, load: dict):
    """The engine for the quantized pair, in float64 when the target quantizes activations.

    A plain decode step (1 token) and a verify pass (k+1 tokens) run different GEMM shapes, whose
    float32 results differ in the last bits. Activation quantization turns such a difference into
    a whole quantization step whenever a value sits near a rounding boundary, so in float32 the
    greedy outputs drift apart within a few tokens (measured on SmolLM2 NVFP4: 0/4 prompts equal
    in float32, 4/4 in float64). Float64 makes both paths quantize the same values.
    """
    if recipe.quantize.target.format in ACT_QUANT_FORMATS:
        return engine_cls.load(quant_dir / "target", quant_dir / "drafter",
                               **{**load, "dtype": "float64"}), "float64"
    return engine_cls.load(quant_dir / "target", quant_dir / "drafter", **load), load["dtype"]


def full_vocab_lengths(engine, prompt_ids: list[list[int]], max_new_tokens: int,
                       drafter_steps: list | None = None) -> list[int]:
    """Acceptance lengths with the drafter drafting over the whole vocabulary (its draft
    vocabulary set aside for the run, then restored); drafter_steps as in run_prompts."""
    vocab = engine.drafter.draft_vocab
    engine.drafter.set_draft_vocab(None)
    try:
        runs = run_prompts(engine, prompt_ids, max_new_tokens, plain=False,
                           drafter_steps=drafter_steps)
    finally:
        engine.drafter.draft_vocab = vocab
    return [n for _, lengths in runs for n in lengths]


def verdict(engine, prompt_ids: list[int], spec: list[int], plain: list[int]) -> dict:
    """identical, near-tie or mismatch (engines.base.classify_outputs) for one prompt's outputs."""
    return classify_outputs(spec, plain, engine.dtype,
                            lambda i: engine.next_token_logits(prompt_ids + plain[:i]))


def run_verify_stage(ctx) -> dict:
    """Pipeline stage `verify`: measure, write reports, fail on a broken gate."""
    from dflash_trt.engines.torch_engine import TorchEngine
    from dflash_trt.formats.load import load_target, torch_dtype
    from dflash_trt.prompts import load_prompts
    from dflash_trt.stages.devices import (
        check_fits_one_gpu,
        engine_dtype,
        loaded_bytes,
        torch_device,
    )

    recipe, v = ctx.recipe, ctx.recipe.verify
    quant_dir, base_dir = ctx.stage_dir("quantize"), ctx.stage_dir("resolve")
    device = torch_device(recipe)
    # The dtype the engine serves in; a CPU with no dtype set verifies in float32 (bf16 matmuls
    # are slow on one without bf16 instructions).
    dtype = engine_dtype(recipe) if recipe.engine.dtype else (
        "float32" if device.type == "cpu" else recipe.target.dtype)
    quantized_build = (recipe.quantize.target.format, recipe.quantize.drafter.format) != ("none", "none")
    prompts = load_prompts(v.prompts, v.num_prompts)
    load = dict(device=device.type, dtype=dtype, block_size=recipe.drafter.block_size,
                max_seq_len=recipe.engine.max_seq_len)

    # The quantized target (dequantized weights) and, for the quantization error, the reference
    # are on the device together.
    copies = 2 if recipe.quantize.target.format != "none" else 1
    check_fits_one_gpu(copies * loaded_bytes(base_dir / "target", torch_dtype(dtype)), device,
                       "verify")
    engine, lossless_dtype = _load_quantized_engine(TorchEngine, quant_dir, recipe, load)
    prompt_ids = [engine.tokenize(p, chat=recipe.target.chat_template,
                                  parse_special_tokens=recipe.target.parse_special_tokens)
                  for p in prompts]
    with ctx.progress("verify: quantized, speculative vs plain", total=2) as task:
        drafter_steps: list = []
        spec = run_prompts(engine, prompt_ids, v.max_new_tokens, plain=False,
                           drafter_steps=drafter_steps)
        task.advance()
        plain = run_prompts(engine, prompt_ids, v.max_new_tokens, plain=True)
        task.advance()
    verdicts = [verdict(engine, ids, s_tok, p_tok)
                for ids, (s_tok, _), (p_tok, _) in zip(prompt_ids, spec, plain, strict=True)]
    full_vocab, full_vocab_steps = None, []
    if engine.drafter is not None and engine.drafter.draft_vocab is not None:
        with ctx.progress("verify: quantized, drafting the full vocabulary", total=1) as task:
            full_vocab = full_vocab_lengths(engine, prompt_ids, v.max_new_tokens,
                                            drafter_steps=full_vocab_steps)
            task.advance()
    del engine
    if quantized_build:
        with ctx.progress("verify: unquantized acceptance", total=1) as task:
            base_engine = TorchEngine.load(base_dir / "target", base_dir / "drafter", **load)
            base = run_prompts(base_engine, prompt_ids, v.max_new_tokens, plain=False)
            del base_engine
            task.advance()
    else:
        base = spec

    report = VerifyReport(prompts=v.prompts, num_prompts=len(prompts),
                          max_new_tokens=v.max_new_tokens,
                          target_format=recipe.quantize.target.format,
                          drafter_format=recipe.quantize.drafter.format,
                          block_size=recipe.drafter.block_size, lossless_dtype=lossless_dtype,
                          acceptance_profile=acceptance_profile(drafter_steps),
                          full_vocab_acceptance_lengths=full_vocab,
                          full_vocab_acceptance_profile=(acceptance_profile(full_vocab_steps)
                                                         if full_vocab is not None else None),
                          gate_on_full_vocab=recipe.engine.backend == "tensorrt_llm")
    for ids, out, (_, s_acc), (_, b_acc) in zip(prompt_ids, verdicts, spec, base, strict=True):
        report.results.append(PromptResult(len(ids), out["status"] != "mismatch",
                                           out["first_difference"], s_acc, b_acc, out["status"]))

    if recipe.quantize.target.format != "none":
        with ctx.progress("verify: target quantization error", total=1) as task:
            held_out = [ids + tok for ids, (tok, _) in zip(prompt_ids, base, strict=True)]
            quantized = load_target(quant_dir / "target", dtype=dtype, device=str(device))
            reference = load_target(base_dir / "target", dtype=dtype, device=str(device))
            report.quant_error = quantization_error(quantized, reference, held_out, device)
            task.advance()

    report.failures = gate_failures(report, v.min_acceptance_length, v.max_acceptance_drop)
    write_reports(report, ctx.out)
    if report.failures:
        raise DflashTrtError("verify failed: " + "; ".join(report.failures))
    summary = {k: report.to_dict()[k] for k in ("acceptance_length", "baseline_acceptance_length",
                                                 "acceptance_drop", "lossless", "lossless_dtype")}
    if report.quant_error is not None:
        summary["quant_error"] = asdict(report.quant_error)
    return summary
