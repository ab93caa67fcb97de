"""Checkpoint linter: does a (quantized) checkpoint hold what its config says it holds?

It reads only JSON and safetensors headers (no torch, no tensors loaded), so it is fast on any
checkpoint size. The failures it targets are the ones seen in the field: "NVFP4" files that are not
FP4 (BF16-sized), scales with the wrong dtype or missing, exclude lists that disagree with what is
stored, and drafters that do not fit their target (hidden size, vocabulary, target layers, mask
token, RoPE).
"""

from __future__ import annotations

import fnmatch
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

QUANT_CONFIG_FILE = "hf_quant_config.json"
DRAFTER_ARCHITECTURE = "DFlashDraftModel"
DRAFT_VOCAB_FILE = "draft_vocab.json"  # optional: the tokens a drafter drafts (dflash.drafter)
NVFP4_BLOCK = 16

# safetensors dtype name -> bytes per element
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
FLOAT_SCALE = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Finding:
    """One problem: where (file or tensor) and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its safetensors header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # bytes actually reserved for it in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], list[Finding]]:
    """Tensor infos of one .safetensors file, plus findings about the file's own integrity."""
    findings: list[Finding] = []
    size = path.stat().st_size
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            return {}, [Finding(str(path), "truncated: shorter than a safetensors header")]
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size - 8:
            return {}, [Finding(str(path), "corrupt: header length exceeds the file size")]
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}, [Finding(str(path), "corrupt: the safetensors header is not JSON")]
    header.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    data_end = 0
    for name, meta in header.items():
        start, end = meta["data_offsets"]
        info = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), end - start)
        tensors[name] = info
        data_end = max(data_end, end)
        itemsize = DTYPE_BYTES.get(info.dtype)
        if itemsize is not None and info.numel * itemsize != info.nbytes:
            findings.append(Finding(f"{path.name}:{name}", f"{info.nbytes} bytes stored for "
                                    f"{info.dtype}{list(info.shape)} ({info.numel * itemsize} expected)"))
    if 8 + header_len + data_end != size:
        findings.append(Finding(str(path), f"{size} bytes on disk, header describes "
                                f"{8 + header_len + data_end}: truncated or padded file"))
    return tensors, findings


def read_tensor_infos(ckpt_dir: Path) -> tuple[dict[str, TensorInfo], list[Finding]]:
    """Tensor infos of every *.safetensors in a checkpoint directory."""
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        return {}, [Finding(str(ckpt_dir), "no *.safetensors weights")]
    tensors: dict[str, TensorInfo] = {}
    findings: list[Finding] = []
    for file in files:
        infos, problems = read_safetensors_header(file)
        findings += problems
        for name, info in infos.items():
            if name in tensors:
                findings.append(Finding(f"{file.name}:{name}", f"also stored in {tensors[name].file.name}"))
            tensors[name] = info
    return tensors, findings


def _read_json(path: Path) -> tuple[dict | None, list[Finding]]:
    if not path.is_file():
        return None, [Finding(str(path), "missing")]
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, [Finding(str(path), f"not valid JSON ({exc})")]
    if not isinstance(data, dict):
        return None, [Finding(str(path), "expected a JSON object")]
    return data, []


# --- per-format expectations ----------------------------------------------------------------


def _expect(f: list[Finding], t: dict[str, TensorInfo], key: str, dtypes: tuple[str, ...],
            ndim: int | None, algo: str) -> TensorInfo | None:
    info = t.get(key)
    if info is None:
        f.append(Finding(key, f"missing; {algo} layers store it"))
        return None
    if info.dtype not in dtypes:
        f.append(Finding(key, f"dtype {info.dtype}, {algo} needs {' or '.join(dtypes)}"))
    if ndim is not None and len(info.shape) != ndim:
        want = "a scalar" if ndim == 0 else f"{ndim}-D"
        f.append(Finding(key, f"shape {list(info.shape)}, {algo} needs {want}"))
    return info


def _check_nvfp4(name: str, t: dict[str, TensorInfo], algo: str, act: bool) -> list[Finding]:
    f: list[Finding] = []
    w = _expect(f, t, f"{name}.weight", ("U8",), 2, algo)
    s = _expect(f, t, f"{name}.weight_scale", ("F8_E4M3",), 2, algo)
    _expect(f, t, f"{name}.weight_scale_2", ("F32",), 0, algo)
    if act:
        _expect(f, t, f"{name}.input_scale", ("F32",), 0, algo)
    if w is not None and s is not None and len(w.shape) == len(s.shape) == 2:
        out, in_features = s.shape[0], s.shape[1] * NVFP4_BLOCK  # logical shape from the scales
        expected = out * in_features // 2
        if w.nbytes != expected:
            f.append(Finding(f"{name}.weight", f"{w.nbytes} bytes on disk; {algo} "
                             f"[{out}, {in_features}] packs into {expected} (two 4-bit codes per "
                             f"byte): the weight is not FP4"))
        elif tuple(w.shape) != (out, in_features // 2):
            f.append(Finding(f"{name}.weight", f"shape {list(w.shape)} does not match "
                             f"weight_scale {list(s.shape)} (expected [{out}, {in_features // 2}])"))
    return f


def _check_fp8(name: str, t: dict[str, TensorInfo], algo: str) -> list[Finding]:
    f: list[Finding] = []
    w = _expect(f, t, f"{name}.weight", ("F8_E4M3",), 2, algo)
    _expect(f, t, f"{name}.weight_scale", ("F32",), None, algo)
    _expect(f, t, f"{name}.input_scale", ("F32",), 0, algo)
    if w is not None and w.nbytes != w.numel:
        f.append(Finding(f"{name}.weight", f"{w.nbytes} bytes on disk for {w.numel} FP8 values"))
    return f


def _check_int4_awq(name: str, t: dict[str, TensorInfo], algo: str, group: int | None) -> list[Finding]:
    f: list[Finding] = []
    w = _expect(f, t, f"{name}.weight", ("U8",), 2, algo)
    s = _expect(f, t, f"{name}.weight_scale", FLOAT_SCALE, 2, algo)
    if w is not None and s is not None and len(w.shape) == len(s.shape) == 2:
        if s.shape[0] != 2 * w.shape[0] or (group and s.shape[1] * group != w.shape[1]):
            f.append(Finding(f"{name}.weight_scale", f"shape {list(s.shape)} does not fit weight "
                             f"{list(w.shape)} (int4 rows packed in pairs, group size {group})"))
    return f


def check_layer(name: str, t: dict[str, TensorInfo], algo: str, group: int | None) -> list[Finding]:
    """Findings for one quantized Linear `name` under quant_algo `algo`."""
    if algo == "NVFP4":
        return _check_nvfp4(name, t, algo, act=True)
    if algo == "W4A16_NVFP4":
        return _check_nvfp4(name, t, algo, act=False)
    if algo == "FP8":
        return _check_fp8(name, t, algo)
    if algo == "W4A16_AWQ":
        return _check_int4_awq(name, t, algo, group)
    return []


SUPPORTED_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "W4A16_AWQ")


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def _lint_quantized(ckpt_dir: Path, q: dict, config: dict | None,
                    tensors: dict[str, TensorInfo]) -> list[Finding]:
    findings: list[Finding] = []
    qfile = str(ckpt_dir / QUANT_CONFIG_FILE)
    algo = q.get("quant_algo")
    if algo not in SUPPORTED_ALGOS:
        return [Finding(qfile, f"quant_algo {algo!r} is not one of {', '.join(SUPPORTED_ALGOS)}")]
    exclude = list(q.get("exclude_modules") or [])
    group = q.get("group_size")
    if algo in ("NVFP4", "W4A16_NVFP4") and group not in (None, NVFP4_BLOCK):
        findings.append(Finding(qfile, f"group_size {group}; {algo} uses blocks of 16"))
    if config is not None:
        cq = config.get("quantization_config")
        if isinstance(cq, dict) and cq.get("quant_algo") not in (None, algo):
            findings.append(Finding(str(ckpt_dir / "config.json"), f"quantization_config.quant_algo "
                                    f"{cq.get('quant_algo')!r} disagrees with {QUANT_CONFIG_FILE} ({algo!r})"))

    quantized = sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))
    for name in quantized:
        if _excluded(name, exclude):
            findings.append(Finding(name, "listed in exclude_modules but stores quantized "
                                    "tensors (weight_scale); the runtime will misread it"))
        findings += check_layer(name, tensors, algo, group)
    # Every other matrix weight must be covered by the exclude list, or it would be read as
    # quantized by a runtime that trusts hf_quant_config.json.
    qset = set(quantized)
    for key, info in tensors.items():
        if key.endswith(".weight") and len(info.shape) == 2:
            name = key[: -len(".weight")]
            if name not in qset and not _excluded(name, exclude):
                findings.append(Finding(name, f"stored unquantized ({info.dtype}) but not in "
                                        "exclude_modules; add it there or quantize it"))
    if not quantized:
        findings.append(Finding(qfile, f"says {algo} but no layer stores a weight_scale"))

    kv_algo = q.get("kv_cache_quant_algo")
    kv_keys = [k for k in tensors if k.endswith((".k_scale", ".v_scale"))]
    if kv_algo and not kv_keys:
        findings.append(Finding(qfile, f"kv_cache_quant_algo {kv_algo} but no k_scale/v_scale stored"))
    if not kv_algo and kv_keys:
        findings.append(Finding(kv_keys[0], "KV-cache scale stored but kv_cache_quant_algo is null"))
    for k in kv_keys:
        if tensors[k].dtype != "F32" or tensors[k].shape != ():
            findings.append(Finding(k, f"{tensors[k].dtype}{list(tensors[k].shape)}; KV scales are F32 scalars"))
    return findings


def lint_checkpoint(ckpt_dir: str | Path) -> list[Finding]:
    """Findings for one checkpoint directory (target or drafter); empty when it is clean."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return [Finding(str(ckpt_dir), "not a directory")]
    config, findings = _read_json(ckpt_dir / "config.json")
    tensors, problems = read_tensor_infos(ckpt_dir)
    findings += problems
    qpath = ckpt_dir / QUANT_CONFIG_FILE
    if qpath.exists():
        raw, problems = _read_json(qpath)
        findings += problems
        q = (raw or {}).get("quantization")
        if raw is not None and not isinstance(q, dict):
            findings.append(Finding(str(qpath), "missing the 'quantization' object"))
        elif q is not None and tensors:
            findings += _lint_quantized(ckpt_dir, q, config, tensors)
    else:
        if config and config.get("quantization_config"):
            findings.append(Finding(str(ckpt_dir / "config.json"), "has a quantization_config but "
                                    f"the directory has no {QUANT_CONFIG_FILE}"))
        if any(k.endswith(".weight_scale") for k in tensors):
            findings.append(Finding(str(ckpt_dir), f"stores weight_scale tensors but has no {QUANT_CONFIG_FILE}"))
    return findings


# --- drafter / target compatibility ---------------------------------------------------------


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def _rope(config: dict) -> tuple:
    """(theta, type, scaling) whether RoPE is in rope_parameters (transformers 5) or top level."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta"))
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    factor = params.get("factor", scaling.get("factor"))
    return (None if theta is None else float(theta), kind, factor)


def _logical_in_features(name: str, t: dict[str, TensorInfo]) -> int | None:
    w, s = t.get(f"{name}.weight"), t.get(f"{name}.weight_scale")
    if w is None or len(w.shape) != 2:
        return None
    if w.dtype == "U8" and s is not None and s.dtype == "F8_E4M3" and len(s.shape) == 2:
        return s.shape[1] * NVFP4_BLOCK
    return w.shape[1]


def lint_drafter_compat(drafter_dir: str | Path, target_dir: str | Path) -> list[Finding]:
    """Findings that make a drafter unusable with a target (each checkpoint linted separately)."""
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    dcfg, findings = _read_json(drafter_dir / "config.json")
    tcfg_raw, problems = _read_json(target_dir / "config.json")
    findings += problems
    if dcfg is None or tcfg_raw is None:
        return findings
    tcfg = _text_config(tcfg_raw)
    where = str(drafter_dir / "config.json")
    if DRAFTER_ARCHITECTURE not in (dcfg.get("architectures") or []):
        findings.append(Finding(where, f"architectures {dcfg.get('architectures')} lacks {DRAFTER_ARCHITECTURE}"))
    hidden, vocab = tcfg.get("hidden_size"), tcfg.get("vocab_size")
    layers = tcfg.get("num_hidden_layers")
    if dcfg.get("hidden_size") != hidden:
        findings.append(Finding(where, f"hidden_size {dcfg.get('hidden_size')} != target hidden_size {hidden}"))
    if "vocab_size" in dcfg and vocab is not None and dcfg["vocab_size"] != vocab:
        findings.append(Finding(where, f"vocab_size {dcfg['vocab_size']} != target vocab_size {vocab}"))
    if "num_target_layers" in dcfg and dcfg["num_target_layers"] != layers:
        findings.append(Finding(where, f"num_target_layers {dcfg['num_target_layers']} but the "
                                f"target has {layers} layers"))
    dflash = dcfg.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids") or []
    if not ids:
        findings.append(Finding(where, "dflash_config.target_layer_ids is missing or empty"))
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < (layers or 0)]
    if bad:
        findings.append(Finding(where, f"target_layer_ids {bad} out of range: the target has "
                                f"{layers} layers (valid 0..{(layers or 0) - 1})"))
    mask = dflash.get("mask_token_id")
    if mask is None:
        findings.append(Finding(where, "dflash_config.mask_token_id is missing"))
    elif vocab is not None and not 0 <= mask < vocab:
        findings.append(Finding(where, f"mask_token_id {mask} is outside the target vocabulary ({vocab})"))
    if _rope(dcfg)[0] is not None and _rope(dcfg) != _rope(tcfg):
        findings.append(Finding(where, f"RoPE (theta, type, factor) {_rope(dcfg)} != target {_rope(tcfg)}"))
    block = dcfg.get("block_size")
    if not isinstance(block, int) or block < 2:
        findings.append(Finding(where, f"block_size {block!r}; needs an integer >= 2"))
    findings += _lint_draft_vocab(drafter_dir / DRAFT_VOCAB_FILE, vocab)
    tensors, _ = read_tensor_infos(drafter_dir)
    fc_in = _logical_in_features("fc", tensors)
    if fc_in is not None and hidden and ids and fc_in != len(ids) * hidden:
        findings.append(Finding("fc.weight", f"takes {fc_in} features; {len(ids)} target layers x "
                                f"hidden {hidden} = {len(ids) * hidden}"))
    return findings


def _lint_draft_vocab(path: Path, vocab: int | None) -> list[Finding]:
    if not path.is_file():
        return []
    data, findings = _read_json(path)
    ids = (data or {}).get("token_ids")
    if findings:
        return findings
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)
            and ids[0] >= 0 and all(a < b for a, b in zip(ids, ids[1:], strict=False))):
        return [Finding(str(path), "token_ids must be a non-empty, strictly increasing list of "
                        "token ids")]
    if vocab is not None and ids[-1] >= vocab:
        return [Finding(str(path), f"token id {ids[-1]} is outside the target vocabulary ({vocab})")]
    return []


def lint_pair(target_dir: str | Path, drafter_dir: str | Path | None = None) -> list[Finding]:
    """Lint a target, and when given a drafter, the drafter and its fit to the target."""
    findings = lint_checkpoint(target_dir)
    if drafter_dir is not None:
        findings += lint_checkpoint(drafter_dir)
        findings += lint_drafter_compat(drafter_dir, target_dir)
    return findings
