"""The build: the pipeline (manifest, hashing, atomic stages), its progress display, the helpers
stages share (devices, files), and one module per stage, in order:

resolve -> quantize -> verify -> compile -> emit

Import the submodules directly; stage modules import torch, ModelOpt or tritonclient lazily.
"""
