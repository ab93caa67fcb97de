"""Client helpers that need no server: request tensors, JSON bodies, response parsing."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_trt.errors import DflashTrtError
from dflash_trt.serving.client import Chunk, GenerateRequest, GenerateResult, chunk_from, connect


def test_inputs_include_only_what_is_set():
    inputs = GenerateRequest(prompt="hé", max_tokens=4, seed=7, stop_words=("x",)).inputs()
    assert set(inputs) == {"text_input", "max_tokens", "seed", "stop_words"}
    array, kind = inputs["text_input"]
    assert kind == "BYTES" and array.tolist() == ["hé".encode()]
    assert inputs["max_tokens"][0].dtype == np.int32 and inputs["seed"][0].dtype == np.uint64
    assert GenerateRequest(prompt=b"\xff").inputs()["text_input"][0].tolist() == [b"\xff"]


def test_json_body():
    body = GenerateRequest(prompt="p", temperature=0.5, num_draft_tokens=0).json_body(stream=True)
    assert body == {"text_input": "p", "stream": True, "temperature": 0.5, "num_draft_tokens": 0}


def test_chunk_from_json_scalars_and_arrays():
    # Triton's generate endpoint turns one-element outputs into scalars.
    one = chunk_from({"text_output": "a", "output_token_ids": 5, "acceptance_length": 1.5}.get)
    assert one == Chunk("a", (5,), None, None, 1.5)
    many = chunk_from({"text_output": np.array([[b"bc"]], dtype=object),
                       "output_token_ids": np.array([[6, 7]], dtype=np.int32),
                       "total_draft_tokens": np.array([[3]], dtype=np.int32)}.get)
    assert many == Chunk("bc", (6, 7), 3, None, None)
    unknown = chunk_from({"text_output": "a", "total_draft_tokens": -1,
                          "total_accepted_draft_tokens": -1}.get)
    assert unknown.total_draft_tokens is None and unknown.total_accepted_draft_tokens is None


def test_result_gathers_chunks_and_keeps_the_last_stats():
    result = GenerateResult()
    result.add(Chunk("a", (1,), 3, 1, 2.0))
    result.add(Chunk("b", (2, 3), 6, 2, 1.5))
    assert result.as_dict() == {"text": "ab", "token_ids": [1, 2, 3], "total_draft_tokens": 6,
                                "total_accepted_draft_tokens": 2, "acceptance_length": 1.5,
                                "num_responses": 2}


def test_bad_protocol_and_url():
    with pytest.raises(DflashTrtError, match="protocol"):
        connect("localhost:1", "carrier-pigeon")
    with pytest.raises(DflashTrtError, match="HOST:PORT"):
        connect("localhost", "http")
