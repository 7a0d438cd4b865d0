"""LoRALinear against a plain reference: each row's output is x (W + scaling B A)^T for its slot's
adapter, the fused projections' parts each with their own A and B (or none), with the rows of a
slot side by side (a slice) or scattered (indices)."""
from __future__ import annotations

import pytest
import torch

from engine.lora.layers import LoRABatch, LoRALinear


def _adapters(g: torch.Generator) -> dict[int, tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]]:
    """slot -> ({part: (A, B)}, scaling), for a 12 -> (6, 2, 2) projection with rank 4 slots."""
    return {
        0: ({"q_proj": (torch.randn(4, 12, generator=g), torch.randn(6, 4, generator=g)),
             "v_proj": (torch.randn(4, 12, generator=g), torch.randn(2, 4, generator=g))}, 0.5),
        1: ({"q_proj": (torch.randn(3, 12, generator=g), torch.randn(6, 3, generator=g)),
             "k_proj": (torch.randn(3, 12, generator=g), torch.randn(2, 3, generator=g))}, 1.0),
        2: ({"k_proj": (torch.randn(2, 12, generator=g), torch.randn(2, 2, generator=g))}, 2.0),  # rank 2 < 4
    }


# slot -> its rows, as the runner passes them (a slice when side by side); the rest: the base model.
# Plans 0-1 run a GEMM pair per group (one group; too uneven to pad, rows as indices), 2-5
# batched (equal slices as a view; uneven or scattered rows gathered, padded and scattered back;
# slots not consecutive), 6 is too uneven to batch.
PLANS = [
    [(1, slice(2, 9))],
    [(0, slice(0, 7)), (2, torch.tensor([7, 9]))],
    [(0, slice(0, 3)), (2, torch.tensor([4, 6]))],
    [(0, slice(0, 3)), (1, slice(3, 6)), (2, slice(6, 9))],
    [(0, slice(0, 3)), (1, torch.tensor([4, 7])), (2, slice(8, 10))],
    [(0, slice(1, 3)), (2, slice(4, 6))],
    [(0, slice(0, 9)), (2, slice(9, 10))],
]


@pytest.mark.parametrize("split", [False, True], ids=["one-output", "parted-output"])
@pytest.mark.parametrize("plan", range(len(PLANS)))
def test_rows_get_their_slots_update(plan, split):
    from engine.lora.layers import plan_step
    from engine.models.packed_linear import PackedLinear, packing_available

    if split and not packing_available():
        pytest.skip("oneDNN packing unavailable")
    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(12, 10, bias=True)
    parts, sizes = ("q_proj", "k_proj", "v_proj"), (6, 2, 2)
    wrapped = PackedLinear(base, sizes) if split else base
    batch = LoRABatch()
    lin = LoRALinear(wrapped, parts, sizes, slots=3, rank=4, batch=batch, dtype=torch.float32, device="cpu")
    adapters = _adapters(g)
    for slot, (w, s) in adapters.items():
        lin.set_slot(slot, w, s)
    x = torch.randn(10, 12, generator=g)

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

    groups = PLANS[plan]
    batch.step = plan_step(groups, "cpu")
    assert bool(batch.step.width) == (plan in (2, 3, 4, 5)), batch.step
    with torch.no_grad():
        got = torch.cat(lin.forward_parts(x), dim=-1) if split else lin(x)
    owner = {row: slot for slot, rows in groups
             for row in (range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist())}
    for row in range(10):
        torch.testing.assert_close(got[row], want(row, owner.get(row)), rtol=1e-5, atol=1e-5)
    for slot in adapters:  # emptied: every row is the base model's again
        lin.set_slot(slot, {}, 1.0)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), base(x), rtol=1e-5, atol=1e-5)


def test_a_refused_adapter_leaves_its_slot_as_it_was():
    g = torch.Generator().manual_seed(1)
    lin = LoRALinear(torch.nn.Linear(12, 10), ("q_proj", "k_proj", "v_proj"), (6, 2, 2), slots=1, rank=4,
                     batch=LoRABatch(), dtype=torch.float32, device="cpu")
    lin.set_slot(0, *_adapters(g)[0])
    before = lin.lora_a_t.clone(), lin.lora_b_t.clone()
    with pytest.raises(ValueError, match="k_proj"):
        lin.set_slot(0, {"q_proj": _adapters(g)[0][0]["q_proj"], "k_proj": (torch.randn(4, 12), torch.randn(3, 4))}, 1.0)
    assert torch.equal(lin.lora_a_t, before[0]) and torch.equal(lin.lora_b_t, before[1])


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
