"""The Triton model's prelude: settings that only work if made before torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parents[3] / "triton_repo" / "dflash" / "1" / "model.py"

# Imports model.py in a fresh interpreter with a stand-in for the stub's pb_utils module, and
# prints GOMP_SPINCOUNT as it was when torch was first imported (libgomp reads it then, once).
PROBE = """
import importlib.abc, importlib.util, os, sys, types
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
        return None
sys.meta_path.insert(0, Watch())
sys.modules["triton_python_backend_utils"] = types.SimpleNamespace(
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)
spec = importlib.util.spec_from_file_location("dflash_model", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
import torch  # in case nothing above imported it
print(seen[0])
"""


def probe(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, str(MODEL)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def bare_env() -> dict[str, str]:
    """This environment less the variables the prelude looks at (a CI runner may set them)."""
    return {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}


def test_the_openmp_spin_count_is_set_before_torch_loads():
    env = bare_env()
    assert probe(env) == "10000"


def test_the_server_environment_overrides_the_spin_count():
    env = bare_env()
    assert probe({**env, "GOMP_SPINCOUNT": "300000"}) == "300000"
    # libgomp lets an explicit count override the wait policy, so a policy leaves it unset
    assert probe({**env, "OMP_WAIT_POLICY": "PASSIVE"}) == "None"
