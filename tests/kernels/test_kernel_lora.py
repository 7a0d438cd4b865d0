"""The batched-LoRA kernel (engine/kernels/lora_sgmv.py) against its reference, one GEMM per
segment; and `LoRALinear` through it against its torch path, on a GPU or under the interpreter."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")

from engine.kernels import reference, sgmv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_sgmv_matches_per_segment_gemms(dtype, accumulate, device):
    gen = torch.Generator().manual_seed(7)
    rows, k, n, slots = 40, 72, 50, 4  # K and N not powers of two
    x_wide = torch.randn(rows, k + 8, generator=gen).to(dtype).to(device)
    x = x_wide[:, 3:3 + k]  # strided rows, as a part's columns of a fused output
    w = torch.randn(slots, k, n, generator=gen).to(dtype).to(device)
    out_wide = torch.randn(rows, n + 6, generator=gen).to(dtype).to(device)
    out = out_wide[:, 2:2 + n]
    # segments: gaps between them (the base model's rows), slots not in order, one longer than 32
    starts, lens, ids = [0, 5, 9, 36], [3, 1, 26, 4], [2, 0, 3, 2]
    seg = [torch.tensor(v, dtype=torch.int32, device=device) for v in (starts, lens, ids)]
    want = reference.sgmv_ref(x, w, out.clone(), *seg, max(lens), accumulate)
    before = out_wide.clone()
    sgmv(x, w, out, *seg, max(lens), accumulate)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(out, want, **tol)
    untouched = [r for r in range(rows) if not any(s <= r < s + n_ for s, n_ in zip(starts, lens))]
    assert torch.equal(out_wide[untouched], before[untouched])
    assert torch.equal(out_wide[:, :2], before[:, :2]) and torch.equal(out_wide[:, 2 + n:], before[:, 2 + n:])


@pytest.mark.parametrize("fused", [False, True], ids=["one-output", "parted-output"])
def test_lora_linear_through_the_kernel_equals_its_torch_path(fused, device):
    from engine.lora.layers import LoRABatch, LoRALinear, plan_step

    gen = torch.Generator().manual_seed(3)
    parts, sizes = ("q_proj", "k_proj", "v_proj"), (24, 8, 8)
    base = torch.nn.Linear(20, 40, bias=False).to(device)

    class Parted(torch.nn.Module):  # a base that returns its output in parts, as a split PackedLinear
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.parts = base, sizes
            self.in_features, self.out_features = 20, 40

        def forward(self, x):
            return self.lin(x)

        def forward_parts(self, x):
            return list(self.lin(x).split(sizes, dim=-1))

    batch = LoRABatch()
    lin = LoRALinear(Parted() if fused else base, parts, sizes, slots=3, rank=4, batch=batch, dtype=torch.float32,
                     device=device)
    for slot in range(3):
        lin.set_slot(slot, {p: (torch.randn(4 - slot % 2, 20, generator=gen), torch.randn(s, 4 - slot % 2, generator=gen))
                            for p, s in zip(parts, sizes) if (slot, p) != (1, "k_proj")}, 0.5 + slot)
    x = torch.randn(30, 20, generator=gen).to(device)
    groups = [(2, slice(0, 4)), (0, slice(6, 20)), (1, slice(20, 21))]  # rows 4-5 and 21-29: the base model

    def run(kernel: bool) -> torch.Tensor:
        batch.step = plan_step(groups, device, kernel=kernel)
        assert (batch.step.segments is not None) == kernel
        with torch.no_grad():
            return torch.cat(lin.forward_parts(x), dim=-1) if fused else lin(x)

    torch.testing.assert_close(run(True), run(False), rtol=1e-4, atol=1e-4)
