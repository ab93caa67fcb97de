"""Request validation of the Triton model (dflash_trt.serving.requests), without a server."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from request_strategies import NAMES, requests

from dflash_trt.engines.base import StepOutput
from dflash_trt.engines.spec import EngineSpec, SamplingDefaults
from dflash_trt.serving.requests import (
    MAX_STOP_WORD_CHARS,
    MAX_STOP_WORDS,
    UINT64_MAX,
    BadRequest,
    CancelCheck,
    ServeRequest,
    Totals,
    output_arrays,
    parse_request,
)

SPEC = EngineSpec(backend="torch", target="target", drafter="drafter", dtype="float32",
                  device="cpu", block_size=4, max_batch_size=1, max_seq_len=64,
                  chat_template=False, defaults=SamplingDefaults(max_tokens=16))


def parse(decoupled=True, **inputs):
    arrays = {k: (v if isinstance(v, np.ndarray) else np.array([v])) for k, v in inputs.items()}
    return parse_request(arrays, spec=SPEC, tokenize=lambda text: list(text.encode()),
                         max_seq_len=SPEC.max_seq_len, block_size=SPEC.block_size,
                         decoupled=decoupled)


def text(s):
    return np.array([s.encode() if isinstance(s, str) else s], dtype=object)


def test_defaults_come_from_engine_yaml():
    req = parse(text_input=text("hi"))
    assert req.prompt_ids == [104, 105]
    assert req.params.max_new_tokens == 16 and req.params.temperature == 0.0
    assert req.params.num_draft_tokens is None and not req.stream


def test_request_values_are_used():
    req = parse(text_input=text("hi"), max_tokens=np.array([5], np.int32),
                temperature=np.array([0.7], np.float32), top_k=np.array([3], np.int32),
                top_p=np.array([0.5], np.float32), seed=np.array([2**63], np.uint64),
                stream=np.array([True]), num_draft_tokens=np.array([0], np.int32),
                stop_words=np.array([b"ab", b"", b"c"], dtype=object))
    p = req.params
    assert (p.max_new_tokens, p.top_k, p.seed, p.num_draft_tokens) == (5, 3, 2**63, 0)
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.5)
    assert p.stop_words == ("ab", "c") and req.stream


def test_max_tokens_is_clamped_to_the_room_left():
    req = parse(text_input=text("x" * 60), max_tokens=np.array([20], np.int32))
    assert req.params.max_new_tokens == 4


@pytest.mark.parametrize("inputs, field", [
    ({}, "text_input"),
    ({"text_input": text("")}, "text_input"),
    ({"text_input": text("   ")}, "text_input"),
    ({"text_input": text(b"\xff\xfe")}, "text_input"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "text_input"),
    ({"text_input": text("x" * 64)}, "text_input"),
    ({"text_input": text("hi"), "max_tokens": np.array([-1], np.int32)}, "max_tokens"),
    ({"text_input": text("hi"), "max_tokens": np.array([0], np.int32)}, "max_tokens"),
    ({"text_input": text("hi"), "max_tokens": np.array([10**6], np.int32)}, "max_tokens"),
    ({"text_input": text("hi"), "temperature": np.array([-0.1], np.float32)}, "temperature"),
    ({"text_input": text("hi"), "temperature": np.array([np.nan], np.float32)}, "temperature"),
    ({"text_input": text("hi"), "top_p": np.array([0.0], np.float32)}, "top_p"),
    ({"text_input": text("hi"), "top_k": np.array([-2], np.int32)}, "top_k"),
    ({"text_input": text("hi"), "num_draft_tokens": np.array([4], np.int32)}, "num_draft_tokens"),
    ({"text_input": text("hi"), "num_draft_tokens": np.array([-1], np.int32)}, "num_draft_tokens"),
    ({"text_input": text("hi"), "stop_words": np.array([b"\xff"], dtype=object)}, "stop_words"),
    ({"text_input": text("hi"), "max_tokens": np.array([1, 2], np.int32)}, "max_tokens"),
    ({"text_input": text("hi"), "temperature": np.array([np.inf], np.float32)}, "temperature"),
    ({"text_input": text("hi"), "temperature": np.array([-np.inf], np.float64)}, "temperature"),
    ({"text_input": text("hi"), "top_p": np.array([np.inf], np.float32)}, "top_p"),
    ({"text_input": text("hi"), "max_tokens": np.array([2.5])}, "max_tokens"),
    ({"text_input": text("hi"), "max_tokens": np.array([b"8"], dtype=object)}, "max_tokens"),
    ({"text_input": text("hi"), "seed": np.array([np.nan])}, "seed"),
    ({"text_input": text("hi"), "seed": np.array([-1], np.int64)}, "seed"),
    ({"text_input": text("hi"), "stream": np.array([b"yes"], dtype=object)}, "stream"),
    ({"text_input": np.array([7], dtype=object)}, "text_input"),
    ({"text_input": text("hi"), "stop_words": np.array([3], dtype=object)}, "stop_words"),
    ({"text_input": text("hi"), "stop_words": np.array([b"s"] * (MAX_STOP_WORDS + 1),
                                                       dtype=object)}, "stop_words"),
    ({"text_input": text("hi"), "stop_words": np.array([b"s" * (MAX_STOP_WORD_CHARS + 1)],
                                                       dtype=object)}, "stop_words"),
])
def test_bad_requests_name_the_field(inputs, field):
    with pytest.raises(BadRequest, match=rf"^{field}:"):
        parse(**inputs)


def test_stream_needs_a_decoupled_model():
    with pytest.raises(BadRequest, match=r"^stream:"):
        parse(decoupled=False, text_input=text("hi"), stream=np.array([True]))


def test_totals_and_outputs():
    totals = Totals(prompt_tokens=30)
    totals.add(StepOutput((7,), "x", 0, 0, cached_tokens=24))  # the prefill's token: not a
    assert totals.acceptance_length == 0.0  # decoding forward; 24 prompt tokens were reused
    assert (totals.prompt_tokens, totals.cached_tokens) == (30, 24)
    totals.add(StepOutput((1, 2, 3), "abc", 3, 2))
    totals.add(StepOutput((4,), "d", 3, 0, finished=True, finish_reason="length"))
    assert totals.text == "xabcd" and totals.token_ids == [7, 1, 2, 3, 4]
    assert totals.acceptance_length == 2.0  # (3 + 1) tokens over 2 decoding forwards
    out = output_arrays("d", [4], totals)
    assert out["text_output"].tolist() == [b"d"] and out["output_token_ids"].dtype == np.int32
    assert out["total_draft_tokens"].tolist() == [6]
    assert out["total_accepted_draft_tokens"].tolist() == [2]
    assert out["acceptance_length"].dtype == np.float32


def test_the_limits_themselves_are_accepted():
    req = parse(text_input=text("hi"),
                stop_words=np.array([b"s" * MAX_STOP_WORD_CHARS] * MAX_STOP_WORDS, dtype=object),
                seed=np.array([UINT64_MAX], np.uint64), temperature=np.array([1e30], np.float64))
    assert len(req.params.stop_words) == MAX_STOP_WORDS and req.params.seed == UINT64_MAX


# --- any request at all: a clean BadRequest or a valid ServeRequest, nothing else ---------------

@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.booleans())
def test_any_request_is_refused_cleanly_or_valid(inputs, decoupled):
    try:
        req = parse_request(inputs, spec=SPEC, tokenize=lambda t: list(t.encode()),
                            max_seq_len=SPEC.max_seq_len, block_size=SPEC.block_size,
                            decoupled=decoupled)
    except BadRequest as exc:
        field = str(exc).split(":", 1)[0]
        assert field in NAMES, str(exc)  # the message starts with the input's name
        return
    assert isinstance(req, ServeRequest)
    p = req.params
    assert 1 <= p.max_new_tokens <= SPEC.max_seq_len - len(req.prompt_ids)
    assert 1 <= len(req.prompt_ids) < SPEC.max_seq_len
    assert math.isfinite(p.temperature) and p.temperature >= 0
    assert 0 < p.top_p <= 1 and p.top_k >= 0
    assert p.seed is None or 0 <= p.seed <= UINT64_MAX
    assert p.num_draft_tokens is None or 0 <= p.num_draft_tokens < SPEC.block_size
    assert len(p.stop_words) <= MAX_STOP_WORDS
    assert all(0 < len(w) <= MAX_STOP_WORD_CHARS for w in p.stop_words)
    assert not req.stream or decoupled


# --- what TensorRT-LLM's ensemble clients send -----------------------------------------------

def test_the_stock_client_inputs_are_accepted_at_their_defaults():
    req = parse(text_input=text("hi"), max_tokens=np.array([5], np.int32),
                stream=np.array([False]), beam_width=np.array([1], np.int32),
                temperature=np.array([0.0], np.float32),
                exclude_input_in_output=np.array([True]), num_return_sequences=np.array([1]),
                repetition_penalty=np.array([1.0], np.float32),
                presence_penalty=np.array([0.0], np.float32),
                frequency_penalty=np.array([0.0], np.float32),
                length_penalty=np.array([0.5], np.float32), min_tokens=np.array([0]),
                pad_id=np.array([3], np.int32), return_perf_metrics=np.array([True]),
                return_log_probs=np.array([False]))
    assert req.params.max_new_tokens == 5 and req.echo == ""


@pytest.mark.parametrize(("name", "value"), [
    ("beam_width", np.array([2], np.int32)), ("num_return_sequences", np.array([3], np.int32)),
    ("repetition_penalty", np.array([1.2], np.float32)), ("min_tokens", np.array([4])),
    ("presence_penalty", np.array([0.5], np.float32)), ("return_log_probs", np.array([True])),
])
def test_what_this_engine_cannot_honour_is_refused_by_name(name, value):
    with pytest.raises(BadRequest, match=f"^{name}: only .* is supported"):
        parse(text_input=text("hi"), **{name: value})


def test_end_id_bad_words_and_the_echoed_prompt():
    req = parse(text_input=text("hi"), end_id=np.array([7], np.int32),
                bad_words=np.array([b"ab", b"", b"c"], dtype=object),
                exclude_input_in_output=np.array([False]))
    assert req.params.end_id == 7
    assert req.params.bad_words == ((97, 98), (99,))
    assert req.echo == "hi"  # non-streamed, exclude_input_in_output false: prompt first
    streamed = parse(text_input=text("hi"), stream=np.array([True]),
                     exclude_input_in_output=np.array([False]))
    assert streamed.echo == ""  # streamed pieces never carry the prompt
    with pytest.raises(BadRequest, match="^end_id: "):
        parse(text_input=text("hi"), end_id=np.array([-1], np.int32))


def test_acceptance_rate_output():
    totals = Totals()
    totals.add(StepOutput((1,), "a", 0, 0))
    assert output_arrays("a", [1], totals)["acceptance_rate"][0] == 0.0  # nothing drafted yet
    totals.add(StepOutput((2, 3), "bc", 4, 1))
    assert output_arrays("bc", [2, 3], totals)["acceptance_rate"][0] == pytest.approx(0.25)
    totals.add(StepOutput((4,), "d", 0, 0, draft_counts_known=False))
    assert output_arrays("d", [4], totals)["acceptance_rate"][0] == -1.0


def test_the_cancel_check_asks_triton_at_most_once_per_interval():
    answers, clock = [False, False, True], [100.0]
    asked = []

    def ask():
        asked.append(clock[0])
        return answers[len(asked) - 1]

    check = CancelCheck(ask, interval_s=0.2, clock=lambda: clock[0])
    assert check() is False and asked == [100.0]  # the first call asks
    clock[0] = 100.15
    assert check() is False and asked == [100.0]  # within the interval: the last answer
    assert check(fresh=True) is False and asked == [100.0, 100.15]  # fresh asks now
    clock[0] = 100.3
    assert check() is False and len(asked) == 2  # 0.15 s since the last ask
    clock[0] = 100.4
    assert check() is True and asked == [100.0, 100.15, 100.4]
    clock[0] = 200.0
    assert check() is True and check(fresh=True) is True and len(asked) == 3  # cancelled stays
