"""Test-session setup shared by every tier."""

import os

# Triton-lang reads TRITON_INTERPRET once, at its first import: set it before any test module
# imports it, so the DFlash plugin kernels run in Triton's CPU interpreter when there is no GPU.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
