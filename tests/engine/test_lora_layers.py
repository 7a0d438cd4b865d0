"""LoRALinear against a plain reference: each row's output is x (W + scaling B A)^T for its slot's
adapter, the fused projections' parts each with their own A and B (or none), with the rows of a
slot side by side (a slice) or scattered (indices)."""
from __future__ import annotations

import pytest
import torch

from engine.lora.layers import LoRABatch, LoRALinear


def test_rows_get_their_slots_update_as_slices_or_indices():
    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(12, 10, bias=True)
    parts, sizes = ("q_proj", "k_proj", "v_proj"), (6, 2, 2)
    batch = LoRABatch()
    lin = LoRALinear(base, parts, sizes, slots=3, rank=4, batch=batch, dtype=torch.float32, device="cpu")
    adapters = {  # slot -> {part: (A, B)}, scaling
        0: ({"q_proj": (torch.randn(4, 12, generator=g), torch.randn(6, 4, generator=g)),
             "v_proj": (torch.randn(4, 12, generator=g), torch.randn(2, 4, generator=g))}, 0.5),
        2: ({"k_proj": (torch.randn(2, 12, generator=g), torch.randn(2, 2, generator=g))}, 2.0),  # rank 2 < 4
    }
    for slot, (w, s) in adapters.items():
        lin.set_slot(slot, w, s)
    x = torch.randn(7, 12, generator=g)

    def want(row: int, slot: int | None) -> torch.Tensor:
        w = base.weight.detach().clone()
        if slot is not None:
            weights, s = adapters[slot]
            lo = 0
            for part, size in zip(parts, sizes):
                if part in weights:
                    a, b = weights[part]
                    w[lo:lo + size] += s * b @ a
                lo += size
        return x[row] @ w.T + base.bias.detach()

    plan = {0: [0, 1, 2], 2: [4, 6]}  # rows 3 and 5: the base model
    batch.groups = [(0, slice(0, 3)), (2, torch.tensor([4, 6]))]
    with torch.no_grad():
        got = lin(x)
    for row in range(7):
        slot = next((s for s, rows in plan.items() if row in rows), None)
        torch.testing.assert_close(got[row], want(row, slot), rtol=1e-5, atol=1e-5)
    lin.set_slot(0, {}, 1.0)  # emptied: slot 0's rows are the base model's again
    with torch.no_grad():
        torch.testing.assert_close(lin(x)[:3], base(x)[:3])


def test_a_regex_target_names_the_projections_peft_would_match(tmp_path):
    import json

    from engine.lora.adapter import TARGETS, read_info

    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    for regex, want in ((r".*\.(q_proj|v_proj)", {"q_proj", "v_proj"}), (r".*mlp\..*", {"gate_proj", "up_proj", "down_proj"}),
                        (r".*_proj", set(TARGETS))):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": regex}))
        assert read_info("x", tmp_path, 16, frozenset(TARGETS)).targets == want
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": "q_proj"}))
    with pytest.raises(ValueError, match="not supported"):  # PEFT full-matches: a bare name targets nothing
        read_info("x", tmp_path, 16, frozenset(TARGETS))
