"""Hidden-state export settings: vLLM's `speculative_config` with method `extract_hidden_states`.

Layer ids follow DESIGN.md: 0 is the embedding output, k the residual stream after decoder
layer k-1, before any final norm; so N (the number of layers) is the last layer's output.
The engine keeps the states of every computed token in a paged G1 tensor beside the KV cache,
`[num_blocks, block_size, len(layer_ids), hidden]`, so prefix hits (G1, or a lower tier where the
offload block carries them) supply them instead of recomputation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHOD = "extract_hidden_states"
FORMAT_VERSION = "1"


@dataclass(frozen=True)
class HiddenStatesSpec:
    layer_ids: tuple[int, ...]  # in the order they are written to the file

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("eagle_aux_hidden_state_layer_ids is empty: name at least one layer id")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids has duplicates: {list(self.layer_ids)}")
        bad = [i for i in self.layer_ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(f"layer ids must be integers >= 0 (0 = embeddings); got {bad}")

    def check_model(self, num_layers: int) -> None:
        too_big = [i for i in self.layer_ids if i > num_layers]
        if too_big:
            raise ValueError(f"layer ids {too_big} exceed the model's {num_layers} layers: ids run from 0 "
                             f"(embeddings) to {num_layers} (the last layer's output, before the final norm)")

    @property
    def capture_order(self) -> tuple[int, ...]:
        """The ids in the order the model produces them (ascending)."""
        return tuple(sorted(self.layer_ids))

    @property
    def file_order(self) -> list[int]:
        """For each file position, the index of its layer in capture order."""
        return [self.capture_order.index(i) for i in self.layer_ids]

    @staticmethod
    def from_speculative_config(cfg: dict[str, Any] | str | None) -> HiddenStatesSpec | None:
        cfg = load_speculative_config(cfg)
        if cfg is None:
            return None
        method = cfg.get("method")
        if method != METHOD:
            raise ValueError(f"speculative_config method {method!r} is not supported; kvtier supports {METHOD!r}")
        if cfg.get("num_speculative_tokens", 1) != 1:
            raise ValueError(f"{METHOD} drafts nothing: num_speculative_tokens must be 1; "
                             f"got {cfg.get('num_speculative_tokens')!r}")
        hf = ((cfg.get("draft_model_config") or {}).get("hf_config") or {})
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(ids, list):
            raise ValueError("speculative_config needs draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids: "
                             "a list of layer ids")
        return HiddenStatesSpec(tuple(ids))


def load_speculative_config(cfg: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """The speculative_config object, from JSON text if given as a string."""
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if cfg is not None and not isinstance(cfg, dict):
        raise ValueError("speculative_config must be a JSON object")
    return cfg


def eagle3_layer_ids(num_layers: int, include_last: bool = False) -> list[int]:
    """EAGLE-3's default aux layers, [2, N//2, N-3], plus N with include_last."""
    ids = [2, num_layers // 2, num_layers - 3]
    if include_last:
        ids.append(num_layers)
    out: list[int] = []
    for i in ids:  # tiny models can make these collide
        if i not in out and 0 <= i <= num_layers:
            out.append(i)
    return out


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    """The vLLM-shaped config for `layer_ids`."""
    return {"method": METHOD, "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
