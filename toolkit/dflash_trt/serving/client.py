"""Clients for the served `dflash` model: tritonclient gRPC (streaming) and HTTP, and Triton's
HTTP generate / generate_stream endpoints. Used by `dflash-trt query` and the served benchmark.

No torch here. tritonclient is imported inside the classes that need it.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_trt.errors import DflashTrtError

DEFAULT_MODEL = "dflash"
DEFAULT_TIMEOUT_S = 600.0


class TritonRequestError(DflashTrtError):
    """The server refused or failed a request (the message is the server's)."""


class TritonTimeoutError(TritonRequestError):
    """No response within the client's timeout."""


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt and its optional sampling inputs (None = the model's default)."""

    prompt: str | bytes
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_words: tuple[str, ...] = ()
    num_draft_tokens: int | None = None

    def inputs(self) -> dict[str, tuple[np.ndarray, str]]:
        """name -> (value without batch dim, Triton dtype), optional inputs only when set."""
        prompt = self.prompt if isinstance(self.prompt, bytes) else self.prompt.encode("utf-8")
        out = {"text_input": (np.array([prompt], dtype=np.object_), "BYTES")}
        scalars = (("max_tokens", self.max_tokens, np.int32, "INT32"),
                   ("temperature", self.temperature, np.float32, "FP32"),
                   ("top_p", self.top_p, np.float32, "FP32"),
                   ("top_k", self.top_k, np.int32, "INT32"),
                   ("seed", self.seed, np.uint64, "UINT64"),
                   ("num_draft_tokens", self.num_draft_tokens, np.int32, "INT32"))
        for name, value, dtype, triton_type in scalars:
            if value is not None:
                out[name] = (np.array([value], dtype=dtype), triton_type)
        if self.stop_words:
            words = [w.encode("utf-8") for w in self.stop_words]
            out["stop_words"] = (np.array(words, dtype=np.object_), "BYTES")
        return out

    def json_body(self, stream: bool) -> dict:
        """The body of a generate / generate_stream request."""
        if isinstance(self.prompt, bytes):
            raise TritonRequestError("text_input: the generate endpoint takes JSON text only")
        body = {"text_input": self.prompt, "stream": stream}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "num_draft_tokens"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.stop_words:
            body["stop_words"] = list(self.stop_words)
        return body


@dataclass(frozen=True)
class Chunk:
    """One response: new text and token ids, plus the running statistics of the request."""

    text: str
    token_ids: tuple[int, ...]
    total_draft_tokens: int | None = None
    total_accepted_draft_tokens: int | None = None
    acceptance_length: float | None = None


@dataclass
class GenerateResult:
    """A whole answer gathered from its chunks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    total_draft_tokens: int | None = None
    total_accepted_draft_tokens: int | None = None
    acceptance_length: float | None = None
    num_responses: int = 0

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.num_responses += 1
        for name in ("total_draft_tokens", "total_accepted_draft_tokens", "acceptance_length"):
            if getattr(chunk, name) is not None:
                setattr(self, name, getattr(chunk, name))

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "total_draft_tokens": self.total_draft_tokens,
                "total_accepted_draft_tokens": self.total_accepted_draft_tokens,
                "acceptance_length": self.acceptance_length, "num_responses": self.num_responses}


def collect(chunks: Iterator[Chunk]) -> GenerateResult:
    """Drain a chunk stream into one result."""
    result = GenerateResult()
    for chunk in chunks:
        result.add(chunk)
    return result


def _flat(value) -> list:
    if value is None:
        return []
    return np.asarray(value).reshape(-1).tolist()


def _first(value, cast):
    flat = _flat(value)
    return cast(flat[0]) if flat else None


def _count(value) -> int | None:
    """A served draft count; -1 means the runtime did not report it (None: unknown)."""
    return None if int(value) < 0 else int(value)


def chunk_from(get) -> Chunk:
    """A Chunk from `get(name)` -> array/JSON value or None (works for both protocols)."""
    texts = _flat(get("text_output"))
    text = "".join(t.decode("utf-8", errors="replace") if isinstance(t, bytes) else str(t)
                   for t in texts)
    return Chunk(text=text, token_ids=tuple(int(t) for t in _flat(get("output_token_ids"))),
                 total_draft_tokens=_first(get("total_draft_tokens"), _count),
                 total_accepted_draft_tokens=_first(get("total_accepted_draft_tokens"), _count),
                 acceptance_length=_first(get("acceptance_length"), float))


def _host_port(url: str) -> str:
    url = url.removeprefix("http://").removeprefix("https://").removeprefix("grpc://").rstrip("/")
    if ":" not in url:
        raise DflashTrtError(f"--url {url!r}: expected HOST:PORT, e.g. localhost:8001")
    return url


class _Model:
    """Shape knowledge shared by both protocols: a batched model takes [1, ...] inputs."""

    batched: bool | None = None

    def _shape(self, array: np.ndarray) -> np.ndarray:
        return array[None, ...] if self.batched else array


class GrpcClient(_Model):
    """gRPC: each request is sent on a bidirectional stream (the only way to reach a decoupled
    model over gRPC); stream=False asks the model for one final response."""

    def __init__(self, url: str, model_name: str = DEFAULT_MODEL,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url, self.model_name, self.timeout_s = _host_port(url), model_name, timeout_s
        self._client = grpcclient.InferenceServerClient(self.url)
        try:
            config = self._client.get_model_config(model_name, as_json=True)["config"]
        except Exception as exc:  # noqa: BLE001 - tritonclient raises its own exception types
            raise TritonRequestError(f"cannot reach model {model_name!r} at {self.url} over "
                                     f"gRPC: {exc}") from None
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled"))

    def stream(self, request: GenerateRequest, *, stream: bool = True) -> Iterator[Chunk]:
        """Send one request; yield its responses. Closing the iterator early cancels it."""
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        cancel = True
        try:
            inputs = []
            values = request.inputs()
            values["stream"] = (np.array([stream]), "BOOL")
            for name, (array, triton_type) in values.items():
                array = self._shape(array)
                tensor = self._grpc.InferInput(name, list(array.shape), triton_type)
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            self._client.async_stream_infer(self.model_name, inputs,
                                            enable_empty_final_response=True)
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise TritonTimeoutError(f"no response from {self.url} within "
                                             f"{self.timeout_s:.0f} s") from None
                if error is not None:
                    cancel = False
                    raise TritonRequestError(_grpc_message(error))
                params = result.get_response().parameters
                final = "triton_final_response" in params and \
                    params["triton_final_response"].bool_param
                if result.get_response().outputs:
                    yield chunk_from(result.as_numpy)
                if final:
                    cancel = False
                    return
        finally:
            self._client.stop_stream(cancel_requests=cancel)

    def generate(self, request: GenerateRequest, *, stream: bool = False) -> GenerateResult:
        """The whole answer (stream=True still gathers the streamed chunks)."""
        return collect(self.stream(request, stream=stream))

    def close(self) -> None:
        self._client.close()


def _grpc_message(error) -> str:
    message = error.message() if hasattr(error, "message") else str(error)
    return str(message).removeprefix("[StatusCode.INVALID_ARGUMENT] ")


class HttpClient(_Model):
    """HTTP: tritonclient's KServe v2 infer (non-decoupled models) and the generate endpoints."""

    def __init__(self, url: str, model_name: str = DEFAULT_MODEL,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.url, self.model_name, self.timeout_s = _host_port(url), model_name, timeout_s
        config = self._get_json(f"/v2/models/{model_name}/config")
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled"))
        self._client = None

    def _get_json(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(f"http://{self.url}{path}", timeout=30) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise TritonRequestError(f"cannot reach model {self.model_name!r} at {self.url} "
                                     f"over HTTP: {exc}") from None

    def infer(self, request: GenerateRequest) -> GenerateResult:
        """KServe v2 /infer with tritonclient.http (Triton refuses it for decoupled models)."""
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        if self._client is None:
            self._client = httpclient.InferenceServerClient(
                self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s)
        inputs = []
        for name, (array, triton_type) in request.inputs().items():
            array = self._shape(array)
            tensor = httpclient.InferInput(name, list(array.shape), triton_type)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = self._client.infer(self.model_name, inputs)
        except InferenceServerException as exc:
            raise TritonRequestError(exc.message()) from None
        out = GenerateResult()
        out.add(chunk_from(result.as_numpy))
        return out

    def _post(self, endpoint: str, body: dict):
        req = urllib.request.Request(
            f"http://{self.url}/v2/models/{self.model_name}/{endpoint}",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise TritonRequestError(_json_error(exc.read())) from None
        except TimeoutError:
            raise TritonTimeoutError(f"no response from {self.url} within "
                                     f"{self.timeout_s:.0f} s") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            raise TritonRequestError(f"cannot reach {self.url}: {exc}") from None

    def generate(self, request: GenerateRequest) -> GenerateResult:
        """POST .../generate: one JSON answer."""
        with self._post("generate", request.json_body(stream=False)) as resp:
            data = json.loads(resp.read())
        out = GenerateResult()
        out.add(chunk_from(data.get))
        return out

    def stream(self, request: GenerateRequest) -> Iterator[Chunk]:
        """POST .../generate_stream: server-sent events, one per streamed response."""
        with self._post("generate_stream", request.json_body(stream=True)) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = json.loads(line[len("data:"):])
                if "error" in data:
                    raise TritonRequestError(str(data["error"]))
                yield chunk_from(data.get)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _json_error(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", errors="replace")[:300]


def connect(url: str, protocol: str = "grpc", model_name: str = DEFAULT_MODEL,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> GrpcClient | HttpClient:
    """A client for `protocol` ("grpc" or "http")."""
    if protocol == "grpc":
        return GrpcClient(url, model_name, timeout_s)
    if protocol == "http":
        return HttpClient(url, model_name, timeout_s)
    raise DflashTrtError(f"--protocol {protocol!r}: choose grpc or http")


def generate_once(client: GrpcClient | HttpClient, request: GenerateRequest) -> GenerateResult:
    """One non-streamed answer: gRPC stream=False; HTTP generate (decoupled) or infer."""
    if isinstance(client, GrpcClient):
        return client.generate(request)
    return client.generate(request) if client.decoupled else client.infer(request)
