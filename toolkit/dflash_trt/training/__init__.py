"""Drafter training: the corpus and prompt sets, target features, the trainer, the acceptance
estimate. Import the submodules directly: most import torch."""
