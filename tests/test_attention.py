"""Every varlen backend that runs here against a per-segment dense reference, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from kilovla.models.attention import CPU_AUTO, VarlenSpec, attend_varlen, resolve_backend

CPU_BACKENDS = ["sdpa_segments", "sdpa_masked", "sdpa_batched", "flex"]


def _case(causal: bool, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_len = torch.tensor([5, 1, 9, 3])
    k_len = q_len if causal else torch.tensor([7, 4, 9, 2])
    q = torch.randn(int(q_len.sum()), heads, dim, generator=g, requires_grad=True)
    k = torch.randn(int(k_len.sum()), kv_heads, dim, generator=g, requires_grad=True)
    v = torch.randn(int(k_len.sum()), kv_heads, dim, generator=g, requires_grad=True)
    return q, k, v, VarlenSpec.from_lengths(q_len, k_len, causal=causal)


def _reference(q, k, v, spec: VarlenSpec, scale: float) -> torch.Tensor:
    """Each segment alone, dense, with the mask written out: query i of a segment sees its keys (<= i if causal)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(spec.cu_q) - 1):
        qi = q[spec.cu_q[i]:spec.cu_q[i + 1]].transpose(0, 1)
        ki = k[spec.cu_k[i]:spec.cu_k[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        vi = v[spec.cu_k[i]:spec.cu_k[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        logits = qi @ ki.transpose(-1, -2) * scale
        if spec.causal:
            logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((F.softmax(logits, -1) @ vi).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_equals_the_dense_reference(backend, causal):
    q, k, v, spec = _case(causal)
    expected = _reference(q, k, v, spec, 0.3)
    if backend == "flex":  # flex has no backward on CPU: forward only
        out = attend_varlen(q.detach(), k.detach(), v.detach(), spec, 0.3, backend)
        torch.testing.assert_close(out, expected.detach(), atol=1e-5, rtol=1e-5)
        return
    out = attend_varlen(q, k, v, spec, 0.3, backend)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_auto_picks_the_measured_cpu_winner_and_cuda_kernels_first():
    assert resolve_backend("auto", "cpu") == CPU_AUTO == "sdpa_batched"
    assert resolve_backend("sdpa_masked", "cpu") == "sdpa_masked"
