"""What the Triton model does with a request, without Triton: validate inputs, build outputs.

`triton_repo/dflash/1/model.py` is the thin Python-backend glue around this module, so the request
contract (README.md, "The served model") is unit-tested without a server. Every bad request raises
BadRequest whose message starts with the offending input's name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from dflash_trt.engines.base import SamplingParams, StepOutput
from dflash_trt.engines.spec import EngineSpec

INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed",
          "stop_words", "num_draft_tokens",
          # what TensorRT-LLM's ensemble clients send (end_to_end_grpc_client.py, genai-perf)
          "beam_width", "num_return_sequences", "exclude_input_in_output", "end_id", "pad_id",
          "bad_words", "min_tokens", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "length_penalty", "return_log_probs", "return_context_logits",
          "return_generation_logits", "return_perf_metrics")
# Inputs accepted only at the value that changes nothing here, with why.
NEUTRAL = {
    "beam_width": (1, "beam search is not supported; DFlash verifies one sequence"),
    "num_return_sequences": (1, "one sequence per request; send the request again for more"),
    "min_tokens": (0, "a minimum output length is not supported"),
    "repetition_penalty": (1.0, "penalties are not supported by this engine"),
    "presence_penalty": (0.0, "penalties are not supported by this engine"),
    "frequency_penalty": (0.0, "penalties are not supported by this engine"),
    "return_log_probs": (False, "log probabilities are not returned"),
    "return_context_logits": (False, "logits are not returned"),
    "return_generation_logits": (False, "logits are not returned"),
}
UINT64_MAX = 2**64 - 1
# Stop words are matched against the text after every step: bound how much matching a request
# can ask for (far above any real use).
MAX_STOP_WORDS = 256
MAX_STOP_WORD_CHARS = 256
# How often a streaming request asks Triton whether its client cancelled. Each ask is a round trip
# to the Triton process; asked before every step, 4 streams' asks cost the served engine 5-10% of
# its speed on 2 cores (docs/benchmarks.md, session 17). A cancelled request so runs at most this
# much longer (plus a step) before its batch row frees.
CANCEL_CHECK_INTERVAL_S = 0.2


class BadRequest(Exception):
    """A request the model refuses; the message names the input (`field: what is wrong`)."""


@dataclass(frozen=True)
class ServeRequest:
    """A validated request, ready for Engine.stream."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echo: str = ""  # text_input, when exclude_input_in_output=false asks for it in the output


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


def _words(inputs, name: str = "stop_words") -> tuple[str, ...]:
    stop = inputs.get(name)
    if stop is None:
        return ()
    flat = np.asarray(stop, dtype=object).reshape(-1)
    if flat.size > MAX_STOP_WORDS:
        raise BadRequest(f"{name}: at most {MAX_STOP_WORDS} words, got {flat.size}")
    words = tuple(w for w in (_text(v, name) for v in flat) if w)
    long = [w for w in words if len(w) > MAX_STOP_WORD_CHARS]
    if long:
        raise BadRequest(f"{name}: each word at most {MAX_STOP_WORD_CHARS} characters, got "
                         f"one of {len(long[0])}")
    return words


def _bool(inputs, name: str) -> bool | None:
    value = _scalar(inputs, name)
    if value is not None and not isinstance(value, (bool, np.bool_, int)):
        raise BadRequest(f"{name}: must be a boolean, got {value!r}")
    return None if value is None else bool(value)


def _check_neutral(inputs) -> None:
    for name, (neutral, why) in NEUTRAL.items():
        if inputs.get(name) is None:
            continue
        if isinstance(neutral, bool):
            value = _bool(inputs, name)
        elif isinstance(neutral, int):
            value = _int(inputs, name, neutral)
        else:
            value = _float(inputs, name, neutral)
        if value != neutral:
            raise BadRequest(f"{name}: only {neutral} is supported, got {value} ({why})")


def parse_request(inputs: Mapping[str, np.ndarray | None], *, spec: EngineSpec,
                  tokenize: Callable[[str], list[int]], max_seq_len: int, block_size: int,
                  decoupled: bool,
                  tokenize_word: Callable[[str], list[int]] | None = None) -> ServeRequest:
    """Validate the Triton inputs of one request (batch dimension already removed or 1).
    tokenize_word: a bad word's token ids as inside text (prompts.encode_word: no BOS, no
    template); default tokenize."""
    tokenize_word = tokenize_word or tokenize
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
    stream = bool(_bool(inputs, "stream"))
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
    stop_words = _words(inputs)
    _check_neutral(inputs)
    end_id = _int(inputs, "end_id", None)
    if end_id is not None and end_id < 0:
        raise BadRequest(f"end_id: must be a token id >= 0, got {end_id}")
    _int(inputs, "pad_id", None)  # padding pads nothing with one sequence: checked, unused
    _float(inputs, "length_penalty", 1.0)  # scores beams only: no effect on one sequence
    _bool(inputs, "return_perf_metrics")  # the draft counters are always returned
    bad_words = tuple(tuple(ids) for ids in (tokenize_word(w) for w in _words(inputs, "bad_words"))
                      if ids)
    exclude = _bool(inputs, "exclude_input_in_output")

    # 3. the prompt must leave room for at least one new token
    prompt_ids = tokenize(prompt)
    if len(prompt_ids) >= max_seq_len:
        raise BadRequest(f"text_input: the prompt is {len(prompt_ids)} tokens, max_seq_len is "
                         f"{max_seq_len}; shorten it")
    params = SamplingParams(
        max_new_tokens=min(max_tokens, max_seq_len - len(prompt_ids)),
        temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, stop_words=stop_words,
        num_draft_tokens=num_draft, end_id=end_id, bad_words=bad_words)
    # TensorRT-LLM's ensemble returns the prompt ahead of a non-streamed output unless told not
    # to; streamed pieces never carry it. Without the input this model returns the output only.
    echo = prompt if exclude is False and not stream else ""
    return ServeRequest(prompt_ids=prompt_ids, params=params, stream=stream, echo=echo)


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
    prompt_tokens: int = 0  # the request's prompt
    cached_tokens: int = 0  # of those, reused from an earlier request's (StepOutput.cached_tokens)

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
        self.cached_tokens += step.cached_tokens

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
        # accepted / drafted, as TensorRT-LLM's Triton models report it; -1 when unknown
        "acceptance_rate": np.array([accepted / drafted if drafted > 0 else
                                     0.0 if drafted == 0 else -1.0], dtype=np.float32),
    }


# Outputs with no batch dimension even in a batched model: TensorRT-LLM's postprocessing returns
# text_output 1-D ([1]), and its clients read it as `as_numpy("text_output")[0].decode()`.
UNBATCHED_OUTPUTS = frozenset({"text_output"})


class CancelCheck:
    """Whether a request's client cancelled: `ask()` (a round trip to Triton) at most every
    `interval_s`, the last answer in between; once cancelled, always. `fresh=True` asks now."""

    def __init__(self, ask: Callable[[], bool], interval_s: float = CANCEL_CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._ask, self.interval_s, self._clock = ask, interval_s, clock
        self._asked_at: float | None = None
        self._cancelled = False

    def __call__(self, fresh: bool = False) -> bool:
        if self._cancelled:
            return True
        now = self._clock()
        if fresh or self._asked_at is None or now - self._asked_at >= self.interval_s:
            self._asked_at = now
            self._cancelled = bool(self._ask())
        return self._cancelled
