"""DFlash, in torch only: the drafter model, the target adapter, generation and sampling.

Import the submodules directly (`dflash_trt.dflash.generate`, ...): they import torch.
"""
