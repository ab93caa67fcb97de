"""What the Triton model does with a request, without Triton: validate inputs, build outputs.

`triton_repo/dflash/1/model.py` is the thin Python-backend glue around this module, so the request
contract (README.md, "The served model") is unit-tested without a server. Every bad request raises
BadRequest whose message starts with the offending input's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from dflash_trt.engines.base import SamplingParams, StepOutput
from dflash_trt.engines.spec import EngineSpec

INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed",
          "stop_words", "num_draft_tokens")
UINT64_MAX = 2**64 - 1
# Stop words are matched against the text after every step: bound how much matching a request
# can ask for (far above any real use).
MAX_STOP_WORDS = 256
MAX_STOP_WORD_CHARS = 256


class BadRequest(Exception):
    """A request the model refuses; the message names the input (`field: what is wrong`)."""


@dataclass(frozen=True)
class ServeRequest:
    """A validated request, ready for Engine.stream."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool


def _scalar(inputs: Mapping[str, np.ndarray | None], name: str):
    array = inputs.get(name)
    if array is None:
        return None
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise BadRequest(f"{name}: expected one value per request, got {flat.size}")
    return flat[0].item() if hasattr(flat[0], "item") else flat[0]


def _text(value, name: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, bytearray, np.bytes_)):
        raise BadRequest(f"{name}: expected UTF-8 text (BYTES), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{name}: not valid UTF-8 (byte {exc.start}); send UTF-8 text") from None


def _int(inputs, name: str, default: int | None) -> int | None:
    value = _scalar(inputs, name)
    if value is None:
        return default
    if isinstance(value, (str, bytes, np.bytes_)) or (
            isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise BadRequest(f"{name}: must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{name}: must be an integer, got {value!r}") from None


def _float(inputs, name: str, default: float) -> float:
    value = _scalar(inputs, name)
    if value is None:
        return default
    if isinstance(value, (str, bytes, np.bytes_)):
        raise BadRequest(f"{name}: must be a number, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{name}: must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise BadRequest(f"{name}: must be a finite number, got {value}")
    return value


def _stop_words(inputs) -> tuple[str, ...]:
    stop = inputs.get("stop_words")
    if stop is None:
        return ()
    flat = np.asarray(stop, dtype=object).reshape(-1)
    if flat.size > MAX_STOP_WORDS:
        raise BadRequest(f"stop_words: at most {MAX_STOP_WORDS} words, got {flat.size}")
    words = tuple(w for w in (_text(v, "stop_words") for v in flat) if w)
    long = [w for w in words if len(w) > MAX_STOP_WORD_CHARS]
    if long:
        raise BadRequest(f"stop_words: each word at most {MAX_STOP_WORD_CHARS} characters, got "
                         f"one of {len(long[0])}")
    return words


def parse_request(inputs: Mapping[str, np.ndarray | None], *, spec: EngineSpec,
                  tokenize: Callable[[str], list[int]], max_seq_len: int, block_size: int,
                  decoupled: bool) -> ServeRequest:
    """Validate the Triton inputs of one request (batch dimension already removed or 1)."""
    # 1. the prompt
    array = inputs.get("text_input")
    if array is None:
        raise BadRequest("text_input: required input is missing")
    flat = np.asarray(array, dtype=object).reshape(-1)
    if flat.size != 1:
        raise BadRequest(f"text_input: expected one prompt per request, got {flat.size}; send "
                         "prompts as separate requests")
    prompt = _text(flat[0], "text_input")
    if not prompt.strip():
        raise BadRequest("text_input: the prompt is empty")

    # 2. sampling parameters, each checked against its own limits
    stream = _scalar(inputs, "stream")
    if stream is not None and not isinstance(stream, (bool, np.bool_, int)):
        raise BadRequest(f"stream: must be a boolean, got {stream!r}")
    stream = bool(stream)
    if stream and not decoupled:
        raise BadRequest("stream: streaming needs a decoupled model; emit the repository with "
                         "triton.decoupled: true or send stream=false")
    max_tokens = _int(inputs, "max_tokens", spec.defaults.max_tokens)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens: must be >= 1, got {max_tokens}")
    if max_tokens >= max_seq_len:
        raise BadRequest(f"max_tokens: {max_tokens} does not fit max_seq_len {max_seq_len} "
                         "(prompt plus output); ask for fewer tokens")
    temperature = _float(inputs, "temperature", spec.defaults.temperature)
    if temperature < 0:
        raise BadRequest(f"temperature: must be >= 0 (0 = greedy), got {temperature}")
    top_p = _float(inputs, "top_p", spec.defaults.top_p)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p: must be in (0, 1], got {top_p}")
    top_k = _int(inputs, "top_k", spec.defaults.top_k)
    if top_k < 0:
        raise BadRequest(f"top_k: must be >= 0 (0 = off), got {top_k}")
    seed = _int(inputs, "seed", None)
    if seed is not None and not 0 <= seed <= UINT64_MAX:
        raise BadRequest(f"seed: must be an unsigned 64-bit integer, got {seed}")
    num_draft = _int(inputs, "num_draft_tokens", None)
    if num_draft is not None:
        if not 0 <= num_draft <= block_size - 1:
            raise BadRequest(f"num_draft_tokens: must be in [0, {block_size - 1}] "
                             f"(block_size - 1; 0 = no speculation), got {num_draft}")
    stop_words = _stop_words(inputs)

    # 3. the prompt must leave room for at least one new token
    prompt_ids = tokenize(prompt)
    if len(prompt_ids) >= max_seq_len:
        raise BadRequest(f"text_input: the prompt is {len(prompt_ids)} tokens, max_seq_len is "
                         f"{max_seq_len}; shorten it")
    params = SamplingParams(
        max_new_tokens=min(max_tokens, max_seq_len - len(prompt_ids)),
        temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, stop_words=stop_words,
        num_draft_tokens=num_draft)
    return ServeRequest(prompt_ids=prompt_ids, params=params, stream=stream)


@dataclass
class Totals:
    """Running statistics of one response (what the final output tensors report)."""

    text: str = ""
    token_ids: list[int] | None = None
    steps: int = 0  # engine steps seen; the first is the prefill's token
    forwards: int = 0  # decoding forwards that produced tokens (the prefill not counted)
    decoded_tokens: int = 0  # tokens from those forwards
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_counts_known: bool = True  # as of the latest step (see StepOutput.draft_counts_known)

    def add(self, step: StepOutput) -> None:
        self.text += step.text
        self.token_ids = (self.token_ids or []) + list(step.token_ids)
        if self.steps > 0 and step.token_ids:
            self.forwards += 1
            self.decoded_tokens += len(step.token_ids)
        self.steps += 1
        self.draft_tokens += step.num_draft_tokens
        self.accepted_draft_tokens += step.num_accepted_draft_tokens
        self.draft_counts_known = step.draft_counts_known

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per decoding forward so far, as `dflash-trt eval` reports it."""
        return self.decoded_tokens / self.forwards if self.forwards else 0.0


def output_arrays(text: str, token_ids: list[int], totals: Totals) -> dict[str, np.ndarray]:
    """The model's output tensors (no batch dimension): this response's text/ids, running stats.
    Draft counts the runtime did not report are -1 (unknown), never 0 of 0."""
    drafted, accepted = ((totals.draft_tokens, totals.accepted_draft_tokens)
                         if totals.draft_counts_known else (-1, -1))
    return {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_token_ids": np.array(token_ids, dtype=np.int32),
        "total_draft_tokens": np.array([drafted], dtype=np.int32),
        "total_accepted_draft_tokens": np.array([accepted], dtype=np.int32),
        "acceptance_length": np.array([totals.acceptance_length], dtype=np.float32),
    }
