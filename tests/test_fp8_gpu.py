"""FP8 GEMM kernels on a GPU against the emulation (the reference every path must equal).

The weights have blocks of very different magnitudes (2^-6 .. 2^6, a different one per block), so a
scale applied to the wrong block (a transposed or unpadded scale layout) changes the output by far
more than FP8 rounding does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kilovla.quant import fp8
from kilovla.quant.fp8 import Fp8BlockLinear, sqnr_db

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _layer(n: int, k: int, seed: int = 0) -> tuple[nn.Linear, Fp8BlockLinear]:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02, generator=g)
        nb, kb = -(-n // 128), -(-k // 128)
        exponents = torch.randint(-6, 7, (nb, kb), generator=g).float()
        lin.weight.mul_((2.0**exponents).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k])
    return lin.cuda(), Fp8BlockLinear.from_module(lin).cuda()


def _check_against_emulation(kernel: str, n: int, k: int, m: int) -> None:
    lin, layer = _layer(n, k)
    why = fp8.kernel_unavailable(kernel, layer, torch.device("cuda"))
    if why is not None:
        pytest.skip(f"{kernel} {why}")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = fp8._GEMMS[kernel](layer, x).float()
    want = fp8._emulate(layer, x.float())
    assert got.shape == (m, n)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.9999
    assert sqnr_db(want, got) > 35  # bf16 output rounding only, not a misplaced block scale
    assert sqnr_db(lin(x.float()).detach(), got) > 25


@cuda
@pytest.mark.parametrize("n, k", [(256, 512), (384, 1280), (2048, 256)])  # K/128 = 4, 10 (padded to 12), 2
@pytest.mark.parametrize("m", [1, 3, 64, 130])
def test_scaled_mm_block_path_matches_the_emulation(n, k, m):
    _check_against_emulation("scaled_mm", n, k, m)


@cuda
@pytest.mark.parametrize("n, k", [(256, 512), (200, 384)])
@pytest.mark.parametrize("m", [1, 64])
def test_torchao_block_path_matches_the_emulation(n, k, m):
    _check_against_emulation("torchao", n, k, m)


@cuda
def test_auto_runs_a_gpu_kernel_where_one_is_available():
    _, layer = _layer(256, 512)
    device = torch.device("cuda")
    runnable = [k for k in ("scaled_mm", "torchao") if fp8.kernel_unavailable(k, layer, device) is None]
    if not runnable:
        pytest.skip("no FP8 block GEMM on this GPU")
    out = layer(torch.randn(8, 512, device="cuda"))
    assert layer.kernel_used["cuda"] in runnable and out.dtype == torch.float32


@cuda
def test_a_layer_the_kernels_cannot_take_falls_back_to_emulation():
    _, layer = _layer(100, 200)  # neither dimension a multiple of 128
    layer.kernel = "scaled_mm"
    x = torch.randn(4, 200, device="cuda")
    torch.testing.assert_close(layer(x), fp8._emulate(layer, x))
    assert layer.kernel_used["cuda"] == "emulate"


@cuda
def test_token_tables_and_per_embodiment_stacks_run_on_the_gpu_as_on_the_cpu():
    from kilovla.models.groot import CategoryLinear
    from kilovla.quant.fp8 import Fp8BlockCategoryLinear, Fp8BlockEmbedding

    table = Fp8BlockEmbedding.from_module(nn.Embedding(300, 200))
    ids = torch.tensor([[0, 127, 128, 299], [5, 256, 255, 1]])
    want = table(ids)
    got = table.cuda().to(torch.bfloat16)(ids.cuda())
    assert got.dtype == torch.bfloat16 and table.weight.dtype == fp8.FP8
    assert sqnr_db(want, got.float().cpu()) > 40  # bf16 rounding of the product only
    stack = Fp8BlockCategoryLinear.from_module(CategoryLinear(4, 200, 140))
    x, cat = torch.randn(3, 5, 200), torch.tensor([2, 0, 2])
    want = stack(x, cat)
    got = stack.cuda()(x.cuda().to(torch.bfloat16), cat.cuda())
    assert sqnr_db(want, got.float().cpu()) > 35
