"""dflash-trt: one recipe in, one verified DFlash-accelerated Triton model repository out."""

__version__ = "0.1.0"
