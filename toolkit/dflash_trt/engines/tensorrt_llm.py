"""The TensorRT-LLM engine adapter: DFlash served by TensorRT-LLM's PyTorch backend.

`TrtllmEngine.from_engine_dir(dir)` reads `engine.yaml` (the target checkpoint path) and
`llm_api_options.yaml` (written by the compile stage, see `trtllm_options.py`) and builds
`tensorrt_llm.LLM(model=target, speculative_config=DFlashDecodingConfig(...), **options)`.
Requests stream through `LLM.generate_async(..., streaming=True)`; `stream()` bridges that async
stream to the synchronous `Engine` protocol, `astream()` exposes it directly.

`tensorrt_llm` is imported only inside functions: this module imports anywhere, and the mapping
functions (sampling parameters, finish reasons, draft counters, errors) are plain Python that the
unit tests cover without TensorRT-LLM.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dflash_trt.engines.base import SamplingParams, StepOutput
from dflash_trt.engines.detokenize import complete_text
from dflash_trt.engines.spec import inside_engine_tree
from dflash_trt.engines.trtllm_options import (
    load_option_names,
    read_llm_api_options,
    resolve_option_paths,
)
from dflash_trt.errors import DflashTrtError

ENGINE_FILE = "engine.yaml"


def import_tensorrt_llm() -> Any:
    """Import tensorrt_llm, or raise one line naming the minimum version and the container."""
    names = load_option_names()
    need = (
        f"dflash-trt needs TensorRT-LLM >= {names.tensorrt_llm_version} (with "
        f"DFlashDecodingConfig); run inside the NGC container {names.container}"
    )
    try:
        import tensorrt_llm
        from tensorrt_llm import llmapi
    except ImportError as exc:
        raise DflashTrtError(f"tensorrt_llm is not importable ({exc}); {need}") from None
    if not hasattr(llmapi, "DFlashDecodingConfig"):
        version = getattr(tensorrt_llm, "__version__", "unknown")
        raise DflashTrtError(f"tensorrt_llm {version} has no DFlashDecodingConfig; {need}")
    return tensorrt_llm


# ---- pure mappings (unit-tested without tensorrt_llm) -------------------------------------------


def sampling_kwargs(params: SamplingParams, max_draft_len: int) -> dict[str, Any]:
    """Map our SamplingParams to `tensorrt_llm.SamplingParams(**kwargs)`.

    Greedy (temperature 0) leaves temperature/top_k/top_p unset: TensorRT-LLM's documented default
    is greedy. TensorRT-LLM sets the draft length for the whole batch (by batch size,
    speculative_config.draft_len_schedule), never per request, so a per-request
    `num_draft_tokens` below `max_draft_len` (including 0, the no-speculation baseline) cannot be
    honoured and is refused rather than silently ignored.
    """
    if params.max_new_tokens < 1:
        raise DflashTrtError(f"max_new_tokens must be at least 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise DflashTrtError(f"temperature must be >= 0, got {params.temperature}")
    k = params.num_draft_tokens
    if k is not None and k < max_draft_len:
        raise DflashTrtError(
            f"num_draft_tokens={k} is not supported by the tensorrt_llm backend: TensorRT-LLM "
            f"drafts up to {max_draft_len} tokens per step, chosen per batch size for the whole "
            "engine, never per request; for a "
            "no-speculation baseline deploy the same recipe with engine.backend: torch, or a "
            "second engine built without a drafter"
        )
    kwargs: dict[str, Any] = {"max_tokens": params.max_new_tokens, "return_perf_metrics": True}
    if params.temperature > 0:
        kwargs["temperature"] = params.temperature
        if params.top_k > 0:
            kwargs["top_k"] = params.top_k
        if params.top_p < 1.0:
            kwargs["top_p"] = params.top_p
    if params.seed is not None:
        kwargs["seed"] = params.seed
    if params.stop_words:
        kwargs["stop"] = list(params.stop_words)
    if params.end_id is not None:  # one more end token, as in the torch engine (end_id itself
        kwargs["stop_token_ids"] = [params.end_id]  # would replace the model's own EOS)
    if params.bad_words:
        longer = [w for w in params.bad_words if len(w) > 1]
        if longer:
            raise DflashTrtError(
                f"bad_words: {len(longer)} word(s) of several tokens; the tensorrt_llm backend "
                "maps single-token bad words only (SamplingParams.bad_token_ids)")
        kwargs["bad_token_ids"] = [w[0] for w in params.bad_words]
    return kwargs


def finish_reason(reason: str | None, stop_reason: int | str | None) -> str | None:
    """Map CompletionOutput.finish_reason/stop_reason to ours ("length"|"stop"|"eos"|"cancelled").

    TensorRT-LLM says "stop" both for an end token and for a stop string; the stop string is in
    `stop_reason`, so a string there means a stop word and anything else means end of sequence.
    """
    if reason is None:
        return None
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    if reason in ("cancelled", "timeout"):
        return "cancelled"
    return reason


@dataclass(frozen=True)
class Snapshot:
    """What one streamed RequestOutput says, reduced to the fields we use."""

    token_ids: tuple[int, ...]  # new tokens since the previous snapshot
    text: str  # new text since the previous snapshot
    finished: bool
    finish_reason: str | None  # already mapped with finish_reason()
    total_draft_tokens: int | None  # cumulative; None when the runtime does not report them
    total_accepted_draft_tokens: int | None


def draft_totals(output: Any, completion: Any) -> tuple[int | None, int | None]:
    """(drafted, accepted) so far, or (None, None) when the runtime does not say.

    Newer TensorRT-LLM fills `spec_dec_totals` = (accepted, drafted); the perf-metrics section
    `speculative_decoding` is older, and its PyTorch flow delivered it zeroed even while drafting
    ran (upstream backfills it from spec_dec_totals now). So: spec_dec_totals where it exists, the
    section where it counts drafts, and a zeroed section is unknown, never 0 of 0.
    """
    for holder in (completion, output):
        totals = getattr(holder, "spec_dec_totals", None)
        if totals is not None:
            accepted, drafted = (int(x) for x in totals)
            return drafted, accepted
    metrics = getattr(completion, "request_perf_metrics", None)
    spec = getattr(metrics, "speculative_decoding", None) if metrics is not None else None
    if spec is not None and int(spec.total_draft_tokens) > 0:
        return int(spec.total_draft_tokens), int(spec.total_accepted_draft_tokens)
    return None, None


def snapshot(output: Any) -> Snapshot:
    """Read a streamed `tensorrt_llm` RequestOutput (documented attribute names only)."""
    completion = output.outputs[0]
    totals = draft_totals(output, completion)
    return Snapshot(
        token_ids=tuple(completion.token_ids_diff),
        text=completion.text_diff,
        finished=bool(output.finished),
        finish_reason=finish_reason(completion.finish_reason, completion.stop_reason),
        total_draft_tokens=totals[0],
        total_accepted_draft_tokens=totals[1],
    )


class StepCounter:
    """Turns cumulative snapshots into per-step outputs (draft counters become per-step deltas).

    When the runtime reports no counters the step says so (draft_counts_known False) rather than
    guess; the acceptance length is still measured from the tokens per step. A later snapshot
    with counters carries everything drafted since the last known totals.
    """

    def __init__(self) -> None:
        self._drafted = 0
        self._accepted = 0

    def step(self, snap: Snapshot) -> StepOutput | None:
        """The step for one snapshot, or None when it carries nothing new."""
        drafted = accepted = 0
        known = snap.total_draft_tokens is not None and snap.total_accepted_draft_tokens is not None
        if known:
            drafted = max(snap.total_draft_tokens - self._drafted, 0)
            accepted = max(snap.total_accepted_draft_tokens - self._accepted, 0)
            self._drafted = snap.total_draft_tokens
            self._accepted = snap.total_accepted_draft_tokens
        if not snap.token_ids and not snap.text and not snap.finished:
            return None  # a metrics-only update
        return StepOutput(
            token_ids=snap.token_ids,
            # The last text ends like the torch engine's: before an unfinished character.
            text=complete_text(snap.text) if snap.finished else snap.text,
            num_draft_tokens=drafted,
            num_accepted_draft_tokens=accepted,
            finished=snap.finished,
            finish_reason=snap.finish_reason if snap.finished else None,
            draft_counts_known=known,
        )


def steps(snapshots: Iterable[Snapshot]) -> Iterator[StepOutput]:
    """Per-step outputs for a whole sequence of snapshots (see StepCounter)."""
    counter = StepCounter()
    for snap in snapshots:
        step = counter.step(snap)
        if step is not None:
            yield step


def map_error(exc: BaseException, *, during: str) -> DflashTrtError:
    """Turn a TensorRT-LLM failure into one line saying what to do."""
    name = type(exc).__name__
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if isinstance(exc, DflashTrtError):
        return exc
    if name == "OutOfMemoryError" or "out of memory" in detail.lower():
        hint = (
            "lower engine.kv_cache_free_gpu_memory_fraction, max_num_tokens or max_batch_size, "
            "or raise tensor_parallel_size"
        )
        return DflashTrtError(f"TensorRT-LLM ran out of GPU memory while {during}: {hint}")
    if name in ("ValidationError", "ValueError", "TypeError"):
        return DflashTrtError(
            f"TensorRT-LLM rejected the configuration while {during}: {detail}; check "
            "llm_api_options.yaml against the pinned TensorRT-LLM version"
        )
    if name == "RequestError":
        return DflashTrtError(f"TensorRT-LLM rejected the request: {detail}")
    return DflashTrtError(f"TensorRT-LLM failed while {during}: {name}: {detail}")


def map_request_error(exc: BaseException) -> DflashTrtError:
    """A failure while submitting one request: a request error when TensorRT-LLM refused its
    values, else what map_error says."""
    if type(exc).__name__ in ("ValidationError", "ValueError", "TypeError", "RequestError"):
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return DflashTrtError(f"TensorRT-LLM rejected the request: {detail}")
    return map_error(exc, during="submitting the request")


# ---- async -> sync bridge ------------------------------------------------------------------------

_DONE = object()


class AsyncBridge:
    """Runs one asyncio loop in a daemon thread and iterates async streams from sync code.

    Each `iterate()` call gets its own queue, so concurrent callers do not interfere. Closing the
    sync iterator early (a cancelled request) cancels the async task, which lets the producer abort
    its TensorRT-LLM request.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def iterate(self, make_stream: Callable[[], AsyncIterator[Any]]) -> Iterator[Any]:
        """Yield the items of the async iterator `make_stream()` (created on the loop thread)."""
        items: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for item in make_stream():
                    items.put(item)
            except BaseException as exc:  # noqa: B036 - handed to the consumer thread
                items.put(exc)
            finally:
                items.put(_DONE)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = items.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()

    def run(self, coro: Any) -> Any:
        """Run one coroutine on the loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


# ---- the engine ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineFiles:
    """What the adapter needs from an engine directory, paths already absolute."""

    target: Path
    options: dict[str, Any]  # llm_api_options.yaml with absolute paths
    block_size: int
    max_seq_len: int


def read_engine_dir(engine_dir: Path) -> EngineFiles:
    """Read engine.yaml + llm_api_options.yaml; relative paths resolve against `engine_dir`."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_FILE
    if not path.is_file():
        raise DflashTrtError(f"{path} is missing; build the engine with `dflash-trt build RECIPE`")
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict):
        raise DflashTrtError(f"{path}: expected a mapping")
    if spec.get("backend") != "tensorrt_llm":
        raise DflashTrtError(
            f"{path}: backend is {spec.get('backend')!r}, not tensorrt_llm; load it with its own "
            "engine"
        )
    if not spec.get("target"):
        raise DflashTrtError(f"{path}: no `target` checkpoint path")
    options = resolve_option_paths(read_llm_api_options(engine_dir), engine_dir)
    target = inside_engine_tree(engine_dir, str(spec["target"]), "engine.yaml: target")
    max_draft_len = options["speculative_config"]["max_draft_len"]
    max_seq_len = options.get("max_seq_len", spec.get("max_seq_len"))
    if not isinstance(max_seq_len, int):
        raise DflashTrtError(f"{engine_dir}: max_seq_len is set in neither file")
    return EngineFiles(
        target=target, options=options, block_size=max_draft_len + 1, max_seq_len=max_seq_len
    )


def llm_kwargs(files: EngineFiles, llmapi: Any) -> dict[str, Any]:
    """The keyword arguments for `tensorrt_llm.LLM(...)`, with the documented config classes."""
    options = dict(files.options)
    kwargs: dict[str, Any] = {"model": str(files.target)}
    spec = dict(options.pop("speculative_config"))
    spec.pop("decoding_type", None)  # implied by the class; the YAML form needs it, the class not
    kwargs["speculative_config"] = llmapi.DFlashDecodingConfig(**spec)
    if "kv_cache_config" in options:
        kwargs["kv_cache_config"] = llmapi.KvCacheConfig(**options.pop("kv_cache_config"))
    kwargs.update(options)
    return kwargs


class TrtllmEngine:
    """DFlash through `tensorrt_llm.LLM`; safe for concurrent callers (TensorRT-LLM batches them)."""

    def __init__(
        self, llm: Any, tokenizer: Any, files: EngineFiles, bridge: AsyncBridge, trtllm: Any
    ) -> None:
        self._llm = llm
        self.tokenizer = tokenizer
        self._bridge = bridge
        self._trtllm = trtllm  # the imported tensorrt_llm module (for its SamplingParams)
        self.max_seq_len = files.max_seq_len
        self.block_size = files.block_size
        self.max_draft_len = files.block_size - 1

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> TrtllmEngine:
        """Build the LLM from an engine directory written by the compile stage."""
        files = read_engine_dir(engine_dir)
        trtllm = import_tensorrt_llm()
        bridge = AsyncBridge()
        try:
            llm = trtllm.LLM(**llm_kwargs(files, trtllm.llmapi))
        except Exception as exc:
            bridge.close()
            raise map_error(exc, during=f"loading {files.target}") from exc
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(files.target))
        return cls(llm, tokenizer, files, bridge, trtllm)

    def tokenize(self, prompt: str, chat: bool = False,
                 parse_special_tokens: bool = False) -> list[int]:
        """Token ids of `prompt` (see prompts.encode_prompt)."""
        from dflash_trt.prompts import encode_prompt

        return encode_prompt(self.tokenizer, prompt, chat,
                             parse_special_tokens=parse_special_tokens)

    async def astream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Stream steps from `LLM.generate_async(..., streaming=True)` on the caller's loop."""
        kwargs = sampling_kwargs(params, self.max_draft_len)
        if len(prompt_ids) + params.max_new_tokens > self.max_seq_len:
            raise DflashTrtError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds max_seq_len {self.max_seq_len}"
            )
        try:  # upstream validates a request when it is submitted (e.g. a prompt longer than
            # max_num_tokens without chunked prefill): that is the request's fault, not the engine's
            sampling = self._trtllm.SamplingParams(**kwargs)
            result = self._llm.generate_async(list(prompt_ids), sampling, streaming=True)
        except Exception as exc:
            raise map_request_error(exc) from exc

        counter = StepCounter()
        finished = False
        try:
            async for output in result:
                step = counter.step(snapshot(output))
                if step is None:
                    continue
                finished = step.finished
                yield step
        except DflashTrtError:
            raise
        except Exception as exc:
            raise map_error(exc, during="generating") from exc
        finally:
            if not finished:
                result.abort()  # the client went away: free the slot and the KV cache

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Synchronous `Engine.stream`: the async stream, pumped on the adapter's loop thread."""
        return self._bridge.iterate(lambda: self.astream(prompt_ids, params))

    def close(self) -> None:
        """Shut TensorRT-LLM's executor down and stop the loop thread."""
        try:
            self._llm.shutdown()
        finally:
            self._bridge.close()

