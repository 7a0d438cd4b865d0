"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`): what one
is (`LoRARequest`, vLLM's), what the engine reads of it (`AdapterInfo`, core side: no tensors) and
its weights (`read_weights`, for the runner).

An adapter's identity is a digest of its two files, not its name: it enters the first block's key
(kvstore/keys.py), so every tier keeps adapters apart, and an adapter whose files changed under the
same name shares nothing with its old entries.

What PEFT can express and this engine does not compute is refused by name (DoRA, per-module rank
or alpha patterns, trained biases, modules saved whole, layer selections, `fan_in_fan_out`), and so
is any tensor in the weights file that is not a `lora_A`/`lora_B` of a supported module: an adapter
is never served partly.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# The projections an adapter may target, by their PEFT (transformers) names, in the order the
# engine's fused layers hold them.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
DIGEST_BYTES = 16

# adapter_config.json fields whose value changes the computation, with the value this engine computes.
_MUST_BE = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
            "use_qalora": False, "target_parameters": None, "trainable_token_indices": None,
            "layer_replication": None, "alora_invocation_tokens": None}
_TENSOR = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def parse_lora_targets(value: str | Sequence[str]) -> tuple[str, ...]:
    """`--lora-target-modules q_proj,v_proj` (or a list): PEFT module names this engine applies."""
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    unknown = sorted(set(names) - set(TARGETS))
    if not names or unknown:
        raise ValueError(f"lora_target_modules: {unknown or value!r} not among {', '.join(TARGETS)}")
    return tuple(dict.fromkeys(names))


def allowed_targets(given: Sequence[str] | None) -> frozenset[str]:
    """The modules adapters may touch: `--lora-target-modules`, or every supported one."""
    return frozenset(given or TARGETS)


def parse_lora_modules(value: str | Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`--lora-modules name=path ...` or vLLM's JSON objects ('{"name": N, "path": P}'): (name, path)
    pairs with distinct names."""
    items = [value] if isinstance(value, str) else list(value)
    out: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            name, path = item
        elif isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: {item!r} is not JSON ({e})") from None
            unknown = sorted(set(obj) - {"name", "path", "base_model_name"}) if isinstance(obj, dict) else ["?"]
            if unknown or "name" not in obj or "path" not in obj:
                raise ValueError(f"lora_modules: {item!r} must be an object with name and path (and base_model_name)")
            name, path = obj["name"], obj["path"]
        elif isinstance(item, str) and "=" in item:
            name, _, path = item.partition("=")
        else:
            raise ValueError(f"lora_modules: {item!r} must be name=path or a JSON object with name and path")
        if not name or not path:
            raise ValueError(f"lora_modules: {item!r} has an empty name or path")
        out.append((str(name), str(path)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: names {names} repeat")
    return tuple(out)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, a positive id, and its folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name must be a non-empty string; got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int; got {self.lora_int_id!r}")


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path
    rank: int
    scaling: float  # lora_alpha / rank (/ sqrt(rank) with use_rslora)
    targets: frozenset[str]
    digest: bytes  # of adapter_config.json and adapter_model.safetensors

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.targets or len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"adapter {self.name!r}: rank {self.rank}, targets {sorted(self.targets)}")


MAX_CONFIG_BYTES = 1 << 20  # PEFT's adapter_config.json is a few hundred bytes


def max_adapter_bytes(num_layers: int, max_rank: int, shapes: dict[str, tuple[int, int]]) -> int:
    """The largest weights file an adapter of rank <= `max_rank` can need on a model whose
    projections have `shapes` (module -> (in, out)): every layer, every module, 8 bytes an element
    (float64 included), plus 1 MiB for the safetensors header."""
    return num_layers * max_rank * sum(i + o for i, o in shapes.values()) * 8 + (1 << 20)


def read_info(name: str, path: str | Path, max_rank: int, allowed: frozenset[str],
              max_bytes: int | None = None) -> AdapterInfo:
    """The adapter at `path`, checked against `max_rank` and the `allowed` target modules;
    ValueError naming what is wrong (a missing file, a setting not computed here, a rank or module
    over the limits, a weights file over `max_bytes`: the engine reads adapters in its step loop,
    so what one request can make it read is bounded before any of it is read)."""
    path = Path(path)
    for f in (CONFIG, WEIGHTS):
        if not (path / f).is_file():
            raise ValueError(f"LoRA adapter {name!r}: {path / f} not found (PEFT's format: {CONFIG} + {WEIGHTS})")
    for f, most in ((CONFIG, MAX_CONFIG_BYTES), (WEIGHTS, max_bytes)):
        size = (path / f).stat().st_size
        if most is not None and size > most:
            raise ValueError(f"LoRA adapter {name!r}: {path / f} is {size} bytes, more than an adapter within "
                             f"--max-lora-rank {max_rank} can be on this model ({most})")
    raw = (path / CONFIG).read_bytes()
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG} is not JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} "
                         "is not LORA")
    for key, want in _MUST_BE.items():
        value = cfg.get(key, want)
        if value != want and (want or value):  # an empty or false value means the default too
            raise ValueError(f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported (only {want!r})")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: r={rank!r}, lora_alpha={alpha!r} must be a positive int and a number")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    targets = _targets(name, cfg.get("target_modules"))
    outside = sorted(targets - allowed)
    if outside:
        raise ValueError(f"LoRA adapter {name!r}: module(s) {outside} outside --lora-target-modules "
                         f"{sorted(allowed)}")
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(len(raw).to_bytes(8, "little") + raw)
    with open(path / WEIGHTS, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    scaling = alpha / (rank ** 0.5 if cfg.get("use_rslora") else rank)
    return AdapterInfo(name, path, rank, float(scaling), targets, h.digest())


def _targets(name: str, value: object) -> frozenset[str]:
    if isinstance(value, str):  # a regex PEFT full-matches against module names: which projections it names
        found = frozenset(t for t in TARGETS if any(
            re.fullmatch(value, f"{pre}layers.{i}.{'self_attn' if t in ATTENTION_TARGETS else 'mlp'}.{t}")
            for pre in ("model.", "base_model.model.model.") for i in (0, 1)))
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        found = frozenset(value)
    else:
        raise ValueError(f"LoRA adapter {name!r}: target_modules {value!r} must be a list of module names")
    unknown = sorted(found - set(TARGETS))
    if unknown or not found:
        raise ValueError(f"LoRA adapter {name!r}: target module(s) {unknown or value!r} not supported "
                         f"(these are: {', '.join(TARGETS)})")
    return found


def read_weights(info: AdapterInfo, num_layers: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """`(layer, module) -> (A [r, in], B [out, r])` of the adapter; ValueError for any other
    tensor, a layer out of range, a module outside its targets, or an A without its B."""
    from safetensors import safe_open

    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(info.path / WEIGHTS), framework="pt") as f:
        for key in f.keys():
            m = _TENSOR.match(key)
            if m is None:
                raise ValueError(f"LoRA adapter {info.name!r}: tensor {key!r} is not a LoRA A/B matrix of a supported "
                                 "module")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= num_layers or module not in info.targets:
                raise ValueError(f"LoRA adapter {info.name!r}: tensor {key!r} is outside the model's {num_layers} "
                                 f"layers or its target modules {sorted(info.targets)}")
            t = f.get_tensor(key)
            if t.dim() != 2 or t.shape[1 if ab == "B" else 0] != info.rank:
                raise ValueError(f"LoRA adapter {info.name!r}: tensor {key!r} has shape {tuple(t.shape)} for rank "
                                 f"{info.rank}")
            found.setdefault((layer, module), {})[ab] = t
    out = {}
    for where, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {info.name!r}: layer {where[0]} {where[1]} has lora_{''.join(ab)} only")
        out[where] = (ab["A"], ab["B"])
    if not out:
        raise ValueError(f"LoRA adapter {info.name!r}: {WEIGHTS} holds no LoRA weights")
    return out
