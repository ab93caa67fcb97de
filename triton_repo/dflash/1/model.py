"""DFlash speculative decoding as a Triton Python-backend model (emitted by dflash-trt).

The engine comes from `engine/` next to this file (engine.yaml picks torch or tensorrt_llm). With the
decoupled transaction policy each request runs on a worker thread and streams one response per
target forward (new text only); without it, or with stream=false, one response carries everything.
Request validation lives in dflash_trt.serving.requests so it is unit-tested without a server.
"""

import json
import os
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Set before torch loads libgomp, which reads it once: how many times an idle OpenMP worker spins
# before it sleeps (libgomp's default: 300,000). This process shares its cores with tritonserver
# and often a client; a worker spinning between steps holds a core they need, and spinning beside
# a busy core stalls every kernel (docs/benchmarks.md, session 15). The server's environment
# overrides it, with GOMP_SPINCOUNT or OMP_WAIT_POLICY (which an explicit count would override).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import triton_python_backend_utils as pb_utils

from dflash_trt.engines import load_engine
from dflash_trt.engines.spec import EngineSpec
from dflash_trt.errors import DflashTrtError
from dflash_trt.prompts import encode_word
from dflash_trt.serving.requests import (
    INPUTS,
    UNBATCHED_OUTPUTS,
    BadRequest,
    CancelCheck,
    Totals,
    output_arrays,
    parse_request,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE_DIR = Path(__file__).resolve().parent / "engine"
MIN_WORKERS = 8  # requests beyond the engine's batch wait in the engine, not in Triton


class Metrics:
    """Acceptance counters on Triton's /metrics endpoint (when the backend supports them)."""

    def __init__(self, model: str, version: str):
        self.enabled = hasattr(pb_utils, "MetricFamily")
        if not self.enabled:
            return
        labels = {"model": model, "version": version}

        def counter(name, description, **extra):
            family = pb_utils.MetricFamily(name=name, description=description,
                                           kind=pb_utils.MetricFamily.COUNTER)
            return family, family.Metric(labels={**labels, **extra})

        # Keep the families alive: a Metric must not outlive its family.
        self._families = []
        metrics = {}
        for key, name, description in (
            ("tokens", "dflash_output_tokens_total", "Tokens generated"),
            ("forwards", "dflash_target_forwards_total", "Target forward passes that emitted tokens"),
            ("draft", "dflash_draft_tokens_total", "Tokens proposed by the drafter"),
            ("accepted", "dflash_accepted_draft_tokens_total", "Draft tokens the target accepted"),
            ("prompt", "dflash_prompt_tokens_total", "Prompt tokens of requests the engine took"),
            ("cached", "dflash_cached_prompt_tokens_total",
             "Of those, reused from an earlier request's keys and values (torch engine)"),
        ):
            family, metric = counter(name, description)
            self._families.append(family)
            metrics[key] = metric
        family = pb_utils.MetricFamily(name="dflash_requests_total",
                                       description="Requests by outcome",
                                       kind=pb_utils.MetricFamily.COUNTER)
        self._families.append(family)
        for outcome in ("success", "error", "cancelled"):
            metrics[outcome] = family.Metric(labels={**labels, "outcome": outcome})
        self._metrics = metrics

    def record(self, outcome: str, totals: Totals | None = None) -> None:
        if not self.enabled:
            return
        self._metrics[outcome].increment(1)
        if totals is not None:
            self._metrics["tokens"].increment(len(totals.token_ids or []))
            self._metrics["forwards"].increment(totals.forwards)
            self._metrics["draft"].increment(totals.draft_tokens)
            self._metrics["accepted"].increment(totals.accepted_draft_tokens)
            self._metrics["prompt"].increment(totals.prompt_tokens)
            self._metrics["cached"].increment(totals.cached_tokens)


class TritonPythonModel:
    """Triton's entry points: initialize, execute, finalize."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.batched = config.get("max_batch_size", 0) > 0
        device = None
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self.spec = EngineSpec.read(ENGINE_DIR)
        self.engine = load_engine(ENGINE_DIR, device=device)
        self.metrics = Metrics(args["model_name"], args["model_version"])
        # A worker per batch row and per queue place: the engine's queue, not the pool's, bounds
        # how many wait (and says so when it is full).
        workers = self.spec.max_batch_size + self.spec.max_queue
        self.pool = ThreadPoolExecutor(max_workers=max(MIN_WORKERS, workers),
                                       thread_name_prefix="dflash")
        self.closing = threading.Event()
        # One thread at a time talks to the Triton process (responses, cancellation checks,
        # metrics): with batching many requests stream at once, and concurrent sends from a
        # stub's threads crashed Triton 2.51's Python backend here (std::bad_alloc in
        # libtriton_python.so, 4 concurrent streams).
        self.ipc = threading.Lock()
        pb_utils.Logger.log_info(f"dflash: {self.spec.backend} engine from {ENGINE_DIR}, "
                                 f"block_size {self.engine.block_size}, decoupled {self.decoupled}")

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self.pool.submit(self._serve_decoupled, request)
            return None
        # Not decoupled: one response per request, returned in order.
        futures = [self.pool.submit(self._single_response, r) for r in requests]
        return [f.result() for f in futures]

    def finalize(self):
        self.closing.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # --- one request ------------------------------------------------------------------------

    def _parse(self, request):
        inputs = {}
        for name in INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                array = tensor.as_numpy()
                if self.batched:
                    if array.shape[0] != 1:
                        raise BadRequest(f"{name}: batch size {array.shape[0]} is not supported; "
                                         "send one prompt per request")
                    array = array[0]
                inputs[name] = array
        return parse_request(
            inputs, spec=self.spec, max_seq_len=self.engine.max_seq_len,
            block_size=self.engine.block_size, decoupled=self.decoupled,
            tokenize=lambda text: self.engine.tokenize(
                text, chat=self.spec.chat_template,
                parse_special_tokens=self.spec.parse_special_tokens),
            tokenize_word=lambda word: encode_word(self.engine.tokenizer, word))

    def _response(self, text, token_ids, totals):
        tensors = []
        for name, array in output_arrays(text, token_ids, totals).items():
            batch = self.batched and name not in UNBATCHED_OUTPUTS
            tensors.append(pb_utils.Tensor(name, array[None, ...] if batch else array))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _responses(self, request):
        """Yield (response, is_final); ends early when the client cancels."""
        is_cancelled = self._is_cancelled(request)
        try:
            req = self._parse(request)
        except BadRequest as exc:
            self._record("error")
            yield _error(str(exc)), True
            return
        if is_cancelled():
            self._record("cancelled")
            return
        totals = Totals(prompt_tokens=len(req.prompt_ids))
        finished = False
        steps = self.engine.stream(req.prompt_ids, req.params)
        outcome = "error"
        try:
            for step in steps:
                if is_cancelled() or self.closing.is_set():
                    outcome = "cancelled"
                    return
                totals.add(step)
                if req.stream:
                    yield self._response(step.text, list(step.token_ids), totals), step.finished
                finished = step.finished
                if finished:
                    break
            if not req.stream:
                yield self._response(req.echo + totals.text, totals.token_ids or [], totals), True
            elif not finished:  # the engine ended without a final step: close the stream
                yield None, True
            outcome = "success"
        except DflashTrtError as exc:
            yield _error(exc.message), True
        finally:
            steps.close()  # frees the engine (and its lock) when the client went away
            if outcome == "error" and is_cancelled(fresh=True):
                outcome = "cancelled"  # the client left while a response was being sent
            self._record(outcome, totals)

    def _is_cancelled(self, request):
        """A CancelCheck of `request` (asks Triton at most every CANCEL_CHECK_INTERVAL_S)."""
        check = getattr(request, "is_cancelled", None)
        if check is None:
            return lambda fresh=False: False

        def locked():
            with self.ipc:
                return check()
        return CancelCheck(locked)

    def _record(self, outcome, totals=None):
        with self.ipc:
            self.metrics.record(outcome, totals)

    def _send(self, sender, response=None, flags=0):
        with self.ipc:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)

    def _serve_decoupled(self, request):
        sender = request.get_response_sender()
        final_sent = False
        try:
            for response, final in self._responses(request):
                self._send(sender, response, FINAL if final else 0)
                final_sent = final
        except Exception as exc:  # noqa: BLE001 - report it to the client, keep serving
            if self._is_cancelled(request)():
                return  # the client is gone; nobody to tell
            pb_utils.Logger.log_error(f"dflash: request failed: {traceback.format_exc()}")
            if not final_sent:
                self._send(sender, _error(f"internal error: {exc}"), FINAL)
                final_sent = True
        if not final_sent:  # cancelled: close the stream without a response
            self._send(sender, None, FINAL)

    def _single_response(self, request):
        try:
            last = None
            for response, _ in self._responses(request):
                last = response
            return last if last is not None else _error("request cancelled")
        except Exception as exc:  # noqa: BLE001
            pb_utils.Logger.log_error(f"dflash: request failed: {traceback.format_exc()}")
            return _error(f"internal error: {exc}")


def _error(message):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
