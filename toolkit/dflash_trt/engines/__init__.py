"""Engines: the protocol (base.py), the torch engine, the TensorRT-LLM adapter, and the loader."""

from __future__ import annotations

from pathlib import Path

from dflash_trt.engines.base import Engine
from dflash_trt.engines.spec import EngineSpec


def load_engine(engine_dir: Path, *, device: str | None = None,
                measure_here: bool = False) -> Engine:
    """Build the engine an `engine/` directory describes (engine.yaml picks the backend).

    `device` overrides engine.yaml's device (the Triton model passes the instance's GPU).
    `measure_here`: a cost model to measure is measured on the calling thread, for a caller
    whose thread already owns its OpenMP team (the build, after quantize and verify): a second
    team on another thread would put the process over its cores, and every forward measured
    would wait on sleeping workers (a build measured one-token forwards at 33.5 ms that take
    21 ms when served).
    """
    engine_dir = Path(engine_dir)
    spec = EngineSpec.read(engine_dir)
    if spec.backend == "tensorrt_llm":
        from dflash_trt.engines.tensorrt_llm import TrtllmEngine  # needs tensorrt_llm at load

        return TrtllmEngine.from_engine_dir(engine_dir)
    from dflash_trt.engines.torch_engine import TorchEngine

    engine = TorchEngine.load(spec.checkpoint(engine_dir, "target"),
                              spec.checkpoint(engine_dir, "drafter"),
                              device=device or spec.device, dtype=spec.dtype,
                              block_size=spec.block_size, max_seq_len=spec.max_seq_len,
                              prompt_lookup=spec.prompt_lookup,
                              max_batch_size=spec.max_batch_size, max_queue=spec.max_queue,
                              queue_timeout_s=spec.queue_timeout_s,
                              prefix_cache_tokens=spec.prefix_cache_tokens)
    if spec.draft_length == "adaptive" and engine.drafter is not None and engine.block_size > 1:
        from dflash_trt.dflash.acceptance import calibrated, read_calibration
        from dflash_trt.engines import cpu_threads
        from dflash_trt.engines.cost_model import CALIBRATION_FILE, cost_model_for

        # The stored cost model when it was measured on this device kind, else measured now;
        # for a batching CPU engine off this thread, which must not start an OpenMP team.
        if engine.device == "cpu" and engine.max_batch_size > 1 and not measure_here:
            engine.cost_model = cpu_threads.apart(engine.threads, cost_model_for, engine,
                                                  engine_dir)
        else:
            engine.cost_model = cost_model_for(engine, engine_dir)
        if (engine_dir / CALIBRATION_FILE).is_file():
            engine.acceptance = calibrated(read_calibration(engine_dir / CALIBRATION_FILE))
    return engine
