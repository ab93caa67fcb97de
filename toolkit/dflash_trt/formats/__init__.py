"""Checkpoint formats: ModelOpt's quantized formats (NVFP4, FP8, INT4-AWQ) in torch, loading a
(quantized) target or drafter checkpoint in one call (`formats.load`), and the checkpoint linter."""
