"""The TensorRT-LLM engine adapter, without TensorRT-LLM.

Pure mappings are tested directly. Where a stand-in for `tensorrt_llm` is needed it is minimal and
checks one thing only: that our calls use the documented constructor and method names/kwargs
(DFlashDecodingConfig, KvCacheConfig, SamplingParams, LLM.generate_async(..., streaming=True),
RequestOutput.outputs[0].{token_ids_diff, text_diff, finish_reason, stop_reason,
request_perf_metrics.speculative_decoding}, RequestOutput.{finished, abort}).
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from dflash_trt.engines.base import Engine, SamplingParams, collect
from dflash_trt.engines.tensorrt_llm import (
    AsyncBridge,
    EngineFiles,
    Snapshot,
    StepCounter,
    TrtllmEngine,
    finish_reason,
    import_tensorrt_llm,
    llm_kwargs,
    map_error,
    read_engine_dir,
    sampling_kwargs,
    snapshot,
    steps,
)
from dflash_trt.engines.trtllm_options import load_option_names
from dflash_trt.errors import DflashTrtError

# tensorrt_llm.SamplingParams fields we may use (from its documented dataclass fields).
DOCUMENTED_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                              "return_perf_metrics", "end_id", "stop_token_ids",
                              "bad_token_ids"}


# ---- sampling parameters ------------------------------------------------------------------------

def test_end_id_and_single_token_bad_words_map_and_longer_ones_are_refused():
    kwargs = sampling_kwargs(SamplingParams(end_id=2, bad_words=((5,), (9,))), max_draft_len=15)
    assert kwargs["stop_token_ids"] == [2] and kwargs["bad_token_ids"] == [5, 9]
    assert set(kwargs) <= DOCUMENTED_SAMPLING_FIELDS
    with pytest.raises(DflashTrtError, match="^bad_words: 1 word"):
        sampling_kwargs(SamplingParams(bad_words=((5, 6),)), max_draft_len=15)


def test_greedy_leaves_sampling_to_the_documented_greedy_default():
    kwargs = sampling_kwargs(SamplingParams(max_new_tokens=7, top_k=5, top_p=0.5), max_draft_len=15)
    assert kwargs == {"max_tokens": 7, "return_perf_metrics": True}


def test_sampling_maps_every_field():
    params = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=20, top_p=0.9, seed=3,
                            stop_words=("\n\n", "END"))
    assert sampling_kwargs(params, max_draft_len=15) == {
        "max_tokens": 9, "return_perf_metrics": True, "temperature": 0.7, "top_k": 20,
        "top_p": 0.9, "seed": 3, "stop": ["\n\n", "END"]}
    assert set(sampling_kwargs(params, 15)) <= DOCUMENTED_SAMPLING_FIELDS


def test_off_switches_are_not_sent():
    kwargs = sampling_kwargs(SamplingParams(temperature=1.0, top_k=0, top_p=1.0), 15)
    assert "top_k" not in kwargs and "top_p" not in kwargs


@pytest.mark.parametrize("k", [None, 15, 20])
def test_num_draft_tokens_at_or_above_the_engine_draft_length_is_accepted(k):
    kwargs = sampling_kwargs(SamplingParams(num_draft_tokens=k), max_draft_len=15)
    # The engine's draft length is fixed at build time: nothing per-request is sent for it.
    assert not any("draft" in key for key in kwargs)


@pytest.mark.parametrize("k", [0, 3])
def test_num_draft_tokens_below_the_engine_draft_length_is_refused(k):
    with pytest.raises(DflashTrtError, match=f"num_draft_tokens={k} is not supported"):
        sampling_kwargs(SamplingParams(num_draft_tokens=k), max_draft_len=15)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_new_tokens=0), "max_new_tokens must be at least 1"),
    (SamplingParams(temperature=-0.1), "temperature must be >= 0"),
])
def test_bad_sampling_values(params, message):
    with pytest.raises(DflashTrtError, match=message):
        sampling_kwargs(params, 15)


@pytest.mark.parametrize("reason, stop_reason, ours", [
    ("length", None, "length"),
    ("stop", None, "eos"),
    ("stop", 151645, "eos"),
    ("stop", "\n\n", "stop"),
    ("cancelled", None, "cancelled"),
    ("timeout", None, "cancelled"),
    (None, None, None),
])
def test_finish_reasons(reason, stop_reason, ours):
    assert finish_reason(reason, stop_reason) == ours


# ---- streamed outputs ---------------------------------------------------------------------------

def _snap(ids, text="", finished=False, reason=None, drafted=None, accepted=None):
    return Snapshot(tuple(ids), text, finished, reason, drafted, accepted)


def test_draft_counters_become_per_step_deltas():
    out = list(steps([
        _snap([10], "a", drafted=0, accepted=0),          # prefill: one token, no drafts
        _snap([11, 12, 13], "bcd", drafted=15, accepted=2),
        _snap([], "", drafted=15, accepted=2),              # nothing new: skipped
        _snap([14], "e", drafted=30, accepted=2),
        _snap([15, 16], "fg", True, "length", drafted=45, accepted=3),
    ]))
    assert [s.token_ids for s in out] == [(10,), (11, 12, 13), (14,), (15, 16)]
    assert [(s.num_draft_tokens, s.num_accepted_draft_tokens) for s in out] == [
        (0, 0), (15, 2), (15, 0), (15, 1)]
    assert [s.finish_reason for s in out] == [None, None, None, "length"]
    result = collect(iter(out))
    assert result.text == "abcdefg"
    assert result.total_draft_tokens == 45 and result.total_accepted_draft_tokens == 3
    assert result.acceptance_lengths == [3, 1, 2]  # the prefill step is not a decoding step


def test_without_runtime_counters_steps_report_zero_not_a_guess():
    out = list(steps([_snap([1, 2, 3], "x"), _snap([4], "y", True, "eos")]))
    assert [(s.num_draft_tokens, s.num_accepted_draft_tokens) for s in out] == [(0, 0), (0, 0)]
    assert collect(iter(out)).acceptance_lengths == [1]  # the first step is the prefill


def test_the_last_text_ends_before_an_unfinished_character_like_the_torch_engine():
    out = list(steps([_snap([1], "\ufffd"), _snap([2], "ok \ufffd", True, "length")]))
    # Mid-stream text is the runtime's; the final piece drops a trailing unfinished character.
    assert [s.text for s in out] == ["\ufffd", "ok "]


def test_a_finished_snapshot_without_tokens_still_ends_the_stream():
    counter = StepCounter()
    step = counter.step(_snap([], "", True, "eos"))
    assert step is not None and step.finished and step.finish_reason == "eos"


# Shapes of tensorrt_llm's CompletionOutput / RequestOutput, reduced to what snapshot() reads.
@dataclass
class _SpecMetrics:
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    acceptance_rate: float = 0.0


@dataclass
class _PerfMetrics:
    speculative_decoding: _SpecMetrics


@dataclass
class _Completion:
    token_ids_diff: list
    text_diff: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    request_perf_metrics: _PerfMetrics | None = None


@dataclass
class _RequestOutput:
    outputs: list
    finished: bool = False


def test_snapshot_reads_the_documented_fields():
    out = _RequestOutput([_Completion([5, 6], "hi", "stop", "END",
                                      _PerfMetrics(_SpecMetrics(30, 7)))], finished=True)
    assert snapshot(out) == Snapshot((5, 6), "hi", True, "stop", 30, 7)
    bare = _RequestOutput([_Completion([5], "h")])
    assert snapshot(bare) == Snapshot((5,), "h", False, None, None, None)


def test_a_zeroed_perf_section_is_unknown_and_spec_dec_totals_win():
    zeroed = _RequestOutput([_Completion([5, 6, 7], "abc", None, None,
                                         _PerfMetrics(_SpecMetrics(0, 0)))])
    snap = snapshot(zeroed)
    assert (snap.total_draft_tokens, snap.total_accepted_draft_tokens) == (None, None)
    step = StepCounter().step(snap)
    assert step.draft_counts_known is False and step.num_draft_tokens == 0
    # newer TensorRT-LLM: spec_dec_totals = (accepted, drafted), on the completion or the output
    newer = _Completion([5, 6, 7], "abc", None, None, _PerfMetrics(_SpecMetrics(0, 0)))
    newer.spec_dec_totals = (4, 14)
    snap = snapshot(_RequestOutput([newer]))
    assert (snap.total_draft_tokens, snap.total_accepted_draft_tokens) == (14, 4)
    on_output = _RequestOutput([_Completion([5], "a")])
    on_output.spec_dec_totals = (1, 7)
    assert snapshot(on_output).total_draft_tokens == 7


def test_unknown_draft_counts_are_served_as_minus_one_not_zero():
    from dflash_trt.engines.base import StepOutput
    from dflash_trt.serving.requests import Totals, output_arrays

    totals = Totals()
    totals.add(StepOutput((1,), "a", 0, 0))
    totals.add(StepOutput((2, 3), "bc", 0, 0, draft_counts_known=False))
    arrays = output_arrays("abc", [1, 2, 3], totals)
    assert arrays["total_draft_tokens"][0] == arrays["total_accepted_draft_tokens"][0] == -1
    assert arrays["acceptance_length"][0] == 2.0  # measured from the tokens, known either way
    totals.add(StepOutput((4,), "d", 7, 2))  # a later step with counters: known again
    assert output_arrays("abcd", [1, 2, 3, 4], totals)["total_draft_tokens"][0] == 7


# ---- errors -------------------------------------------------------------------------------------

class OutOfMemoryError(RuntimeError):
    pass


class RequestError(RuntimeError):
    pass


@pytest.mark.parametrize("exc, message", [
    (OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
     "ran out of GPU memory while loading.*kv_cache_free_gpu_memory_fraction"),
    (ValueError("max_draft_len must be > 0\nmore"), "rejected the configuration while loading: "
     "max_draft_len must be > 0; check llm_api_options.yaml"),
    (RequestError("prompt too long"), "rejected the request: prompt too long"),
    (RuntimeError(""), "failed while loading: RuntimeError: RuntimeError"),
])
def test_errors_become_one_line(exc, message):
    err = map_error(exc, during="loading")
    assert isinstance(err, DflashTrtError)
    assert "\n" not in err.message
    assert __import__("re").search(message, err.message)


# ---- import guard -------------------------------------------------------------------------------

def test_missing_tensorrt_llm_names_version_and_container(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import raises ImportError
    names = load_option_names()
    with pytest.raises(DflashTrtError) as err:
        import_tensorrt_llm()
    assert f">= {names.tensorrt_llm_version}" in err.value.message
    assert names.container in err.value.message
    assert "\n" not in err.value.message


def test_too_old_tensorrt_llm_is_refused(monkeypatch):
    old = types.ModuleType("tensorrt_llm")
    old.__version__ = "1.2.1"
    old.llmapi = types.ModuleType("tensorrt_llm.llmapi")  # no DFlashDecodingConfig
    monkeypatch.setitem(sys.modules, "tensorrt_llm", old)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", old.llmapi)
    with pytest.raises(DflashTrtError, match="tensorrt_llm 1.2.1 has no DFlashDecodingConfig"):
        import_tensorrt_llm()


# ---- async bridge -------------------------------------------------------------------------------

def test_bridge_yields_items_and_raises_errors():
    bridge = AsyncBridge()
    try:
        async def numbers():
            for i in range(3):
                await asyncio.sleep(0)
                yield i

        assert list(bridge.iterate(numbers)) == [0, 1, 2]

        async def broken():
            yield 1
            raise RuntimeError("boom")

        it = bridge.iterate(broken)
        assert next(it) == 1
        with pytest.raises(RuntimeError, match="boom"):
            next(it)
    finally:
        bridge.close()


def test_closing_the_iterator_early_cancels_the_producer():
    bridge = AsyncBridge()
    stopped = asyncio.Event()
    try:
        async def endless():
            try:
                i = 0
                while True:
                    await asyncio.sleep(0.001)
                    yield i
                    i += 1
            finally:
                stopped.set()

        it = bridge.iterate(endless)
        assert next(it) == 0
        it.close()
        bridge.run(asyncio.wait_for(stopped.wait(), timeout=5))
        assert stopped.is_set()
    finally:
        bridge.close()


# ---- engine dir and LLM construction ------------------------------------------------------------

def _engine_dir(tmp_path: Path) -> Path:
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "engine.yaml").write_text(yaml.safe_dump(
        {"backend": "tensorrt_llm", "target": "../quantized/target", "max_seq_len": 4096}))
    (engine / "llm_api_options.yaml").write_text(yaml.safe_dump({
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": 15,
                               "speculative_model": "../quantized/drafter",
                               "mask_token_id": 151669, "target_layer_ids": [1, 9],
                               "attention_backend": "TRTLLM"},
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "dtype": "fp8"},
        "max_batch_size": 32, "max_seq_len": 8192, "tensor_parallel_size": 1}))
    return engine


def test_read_engine_dir_resolves_paths_against_it(tmp_path):
    files = read_engine_dir(_engine_dir(tmp_path))
    assert files.target == (tmp_path / "quantized" / "target").resolve()
    assert files.options["speculative_config"]["speculative_model"] == str(
        (tmp_path / "quantized" / "drafter").resolve())
    assert files.block_size == 16
    assert files.max_seq_len == 8192  # llm_api_options wins over engine.yaml


@pytest.mark.parametrize(("file", "key", "path"), [
    ("engine.yaml", "target", "/etc"), ("engine.yaml", "target", "../../x"),
    ("llm_api_options.yaml", "speculative_model", "../../x"),
    ("llm_api_options.yaml", "speculative_model", "/etc")])
def test_read_engine_dir_refuses_paths_that_leave_its_parent(tmp_path, file, key, path):
    (tmp_path / "build").mkdir()
    engine = _engine_dir(tmp_path / "build")
    data = yaml.safe_load((engine / file).read_text())
    (data.get("speculative_config") or data)[key] = path
    (engine / file).write_text(yaml.safe_dump(data))
    with pytest.raises(DflashTrtError, match=f"{key} path .* points outside"):
        read_engine_dir(engine)


def test_read_engine_dir_refuses_another_backend(tmp_path):
    engine = _engine_dir(tmp_path)
    (engine / "engine.yaml").write_text("backend: torch\ntarget: x\n")
    with pytest.raises(DflashTrtError, match="not tensorrt_llm"):
        read_engine_dir(engine)


class _Recorder:
    """Stands in for a TensorRT-LLM config class: records its keyword arguments."""

    allowed: frozenset = frozenset()

    def __init__(self, **kwargs):
        unknown = set(kwargs) - self.allowed
        assert not unknown, f"{type(self).__name__} got undocumented kwargs {unknown}"
        self.kwargs = kwargs


def _fake_llmapi():
    names = load_option_names()
    # decoding_type is implied by the class, so the constructor must not receive it twice.
    dflash = type("DFlashDecodingConfig", (_Recorder,),
                  {"allowed": names.speculative_config - {"decoding_type"}})
    kv = type("KvCacheConfig", (_Recorder,), {"allowed": names.kv_cache_config})
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.DFlashDecodingConfig, llmapi.KvCacheConfig = dflash, kv
    return llmapi


def test_llm_kwargs_use_the_documented_classes_and_names(tmp_path):
    files = read_engine_dir(_engine_dir(tmp_path))
    kwargs = llm_kwargs(files, _fake_llmapi())
    assert kwargs["model"] == str(files.target)
    assert type(kwargs["speculative_config"]).__name__ == "DFlashDecodingConfig"
    assert kwargs["speculative_config"].kwargs["max_draft_len"] == 15
    assert kwargs["kv_cache_config"].kwargs == {"free_gpu_memory_fraction": 0.85, "dtype": "fp8"}
    assert set(kwargs) - {"model", "speculative_config", "kv_cache_config"} <= (
        load_option_names().top_level)


@dataclass
class _Stream:
    """An async-iterable stand-in for the GenerationResult that generate_async returns."""

    outputs: list
    aborted: bool = False
    calls: list = field(default_factory=list)

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for out in self.outputs:
            await asyncio.sleep(0)
            yield out

    def abort(self):
        self.aborted = True


class _FakeLLM:
    def __init__(self, outputs):
        self.stream = _Stream(outputs)
        self.calls = []

    def generate_async(self, inputs, sampling_params=None, *, streaming=False):
        self.calls.append((inputs, sampling_params, streaming))
        return self.stream

    def shutdown(self):
        pass


class _SamplingParams(_Recorder):
    allowed = frozenset(DOCUMENTED_SAMPLING_FIELDS)


def _engine(outputs) -> tuple[TrtllmEngine, _FakeLLM]:
    llm = _FakeLLM(outputs)
    files = EngineFiles(target=Path("/t"), options={}, block_size=16, max_seq_len=64)
    trtllm = types.ModuleType("tensorrt_llm")
    trtllm.SamplingParams = _SamplingParams
    return TrtllmEngine(llm, tokenizer=None, files=files, bridge=AsyncBridge(), trtllm=trtllm), llm


def test_stream_calls_generate_async_streaming_and_maps_outputs():
    metrics = lambda d, a: _PerfMetrics(_SpecMetrics(d, a))  # noqa: E731
    engine, llm = _engine([
        _RequestOutput([_Completion([7], "A", request_perf_metrics=metrics(0, 0))]),
        _RequestOutput([_Completion([8, 9], "BC", "stop", None, metrics(15, 1))], finished=True),
    ])
    try:
        assert isinstance(engine, Engine)
        result = collect(engine.stream([1, 2, 3], SamplingParams(max_new_tokens=5)))
    finally:
        engine.close()
    inputs, sampling, streaming = llm.calls[0]
    assert inputs == [1, 2, 3] and streaming is True
    assert sampling.kwargs == {"max_tokens": 5, "return_perf_metrics": True}
    assert result.token_ids == [7, 8, 9] and result.text == "ABC"
    assert (result.total_draft_tokens, result.total_accepted_draft_tokens) == (15, 1)
    assert result.finish_reason == "eos"
    assert llm.stream.aborted is False


def test_a_client_that_stops_reading_aborts_the_request():
    engine, llm = _engine([_RequestOutput([_Completion([i], str(i))]) for i in range(50)])
    try:
        it = engine.stream([1], SamplingParams(max_new_tokens=50))
        next(it)
        it.close()
        engine._bridge.run(asyncio.sleep(0.05))
    finally:
        engine.close()
    assert llm.stream.aborted is True


def test_prompt_too_long_for_max_seq_len_is_refused():
    engine, _ = _engine([])
    try:
        with pytest.raises(DflashTrtError, match="exceeds max_seq_len 64"):
            list(engine.stream(list(range(60)), SamplingParams(max_new_tokens=10)))
    finally:
        engine.close()


@pytest.mark.parametrize("exc, message", [
    (ValueError("The sum of prompt length (9000) and query length should not exceed "
                "max_num_tokens (8192)"), "rejected the request: The sum of prompt length"),
    (RuntimeError("executor is shut down"), "failed while submitting the request: RuntimeError"),
])
def test_errors_at_submit_are_request_errors(exc, message):
    engine, llm = _engine([])

    def refuse(*args, **kwargs):
        raise exc

    llm.generate_async = refuse
    try:
        with pytest.raises(DflashTrtError, match=message) as err:
            list(engine.stream([1, 2], SamplingParams(max_new_tokens=4)))
        assert "configuration" not in str(err.value)
    finally:
        engine.close()


def test_engine_yaml_written_by_hand_round_trips_json_paths(tmp_path):
    # engine.yaml may hold an absolute target path too (e.g. a mounted volume).
    engine = _engine_dir(tmp_path)
    spec = yaml.safe_load((engine / "engine.yaml").read_text())
    spec["target"] = str(tmp_path / "abs" / "target")
    (engine / "engine.yaml").write_text(json.dumps(spec))  # JSON is valid YAML
    assert read_engine_dir(engine).target == tmp_path / "abs" / "target"
