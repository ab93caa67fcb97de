"""A client that speaks to Triton the way TensorRT-LLM's stock ensemble clients do.

Written from reading TensorRT-LLM's `triton_backend/inflight_batcher_llm/client/
end_to_end_grpc_client.py` (not copied): every input has a leading batch dimension ([1, 1];
word lists [1, N]); text_input, max_tokens, stream, beam_width, temperature and
exclude_input_in_output are always sent; end_id, pad_id, stop_words and bad_words only when
asked; it always uses the gRPC bidirectional stream, streaming or not, requests `text_output`,
waits for stop_stream() to drain, and reads `result.as_numpy("text_output")[0].decode()`,
appending streamed pieces (deltas) and taking a non-streamed response as the whole text.
"""

from __future__ import annotations

import queue

import numpy as np


def _input(name, array):
    from tritonclient.grpc import InferInput
    from tritonclient.utils import np_to_triton_dtype

    tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def stock_inputs(prompt: str, max_tokens: int, *, stream: bool, temperature: float = 1.0,
                 exclude_input_in_output: bool = False, end_id: int | None = None,
                 pad_id: int | None = None, stop_words=(), bad_words=()):
    inputs = [
        _input("text_input", np.array([[prompt]], dtype=object)),
        _input("max_tokens", np.array([[max_tokens]], dtype=np.int32)),
        _input("stream", np.array([[stream]], dtype=bool)),
        _input("beam_width", np.array([[1]], dtype=np.int32)),
        _input("temperature", np.array([[temperature]], dtype=np.float32)),
        _input("exclude_input_in_output", np.array([[exclude_input_in_output]], dtype=bool)),
    ]
    for name, value in (("end_id", end_id), ("pad_id", pad_id)):
        if value is not None:
            inputs.append(_input(name, np.array([[value]], dtype=np.int32)))
    for name, words in (("stop_words", stop_words), ("bad_words", bad_words)):
        if words:
            inputs.append(_input(name, np.array([list(words)], dtype=object)))
    return inputs


def stock_generate(url: str, prompt: str, max_tokens: int, *, stream: bool,
                   model_name: str = "ensemble", extra=(), **kwargs) -> tuple[str, list]:
    """(text, errors) as the stock client assembles them; `extra` adds (name, array) inputs."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        inputs = stock_inputs(prompt, max_tokens, stream=stream, **kwargs)
        inputs += [_input(name, array) for name, array in extra]
        client.async_stream_infer(model_name, inputs, request_id="1",
                                  outputs=[grpcclient.InferRequestedOutput("text_output")])
        client.stop_stream(cancel_requests=False)  # returns when the server closed the stream
    finally:
        client.close()
    text, errors = "", []
    while not results.empty():
        result, error = results.get()
        if error is not None:
            errors.append(str(error))
            continue
        out = result.as_numpy("text_output")
        if out is None:  # an empty final response
            continue
        piece = out[0].decode("utf-8")
        text = text + piece if stream else piece
    return text, errors
