"""The oneDNN-packed bf16 Linear against a PyTorch fp32 reference."""
from __future__ import annotations

import pytest
import torch

from pagedserve.model.linear import Linear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 here")


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_packed_linear_matches_reference(rows: int, bias: bool, with_residual: bool) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 80, bias=bias).to(torch.bfloat16)
    w, b = layer.weight.detach().float(), layer.bias.detach().float() if bias else 0.0
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    residual = torch.randn(rows, 80, dtype=torch.bfloat16) if with_residual else None
    expected = x.float() @ w.T + b + (residual.float() if with_residual else 0.0)
    layer.pack()
    with torch.inference_mode():
        got = layer(x, residual)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_packed_linear_takes_strided_input() -> None:
    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 128, dtype=torch.bfloat16)[:, 64:]
    expected = x.float() @ layer.weight.detach().float().T
    layer.pack()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_fp32_is_never_packed() -> None:
    assert not can_pack(torch.float32, torch.device("cpu"))
