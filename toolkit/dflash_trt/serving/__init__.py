"""Serving: the tritonserver runner, tritonclient wrappers, and the Triton model's request parsing."""
