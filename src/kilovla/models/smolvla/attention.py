"""SmolVLA's attention plans: the three calls a layer makes, on the padded or the packed layout.

    prefix(qp, kp, vp)             the prefix alone: images and language see each other, the state
                                   token sees them and itself, no prefix token sees the state
    cross(qs, kp, vp)              a cross-attention layer's actions -> their own sample's prefix
    joint(qp, kp, vp, qs, ks, vs)  a self-attention layer: both streams at once; the actions see their
                                   prefix and the actions up to themselves (causal); qp may be None
                                   (the suffix alone, or a last layer whose prefix only gives keys)

`DenseAttention` (padded, LeRobot's layout): q/k/v (B, T, heads, head_dim) and one additive mask
over [prefix | suffix]. `PackedAttention` (packing): q/k/v (T, heads, head_dim), every sample's
tokens end to end, varlen calls (models/attention.py) whose segments are the samples:

- prefix: the image/language block of each sample (bidirectional), then the state rows to their
  whole prefix;
- cross: suffix segment i reads prefix segment i only;
- joint: each sample's [prefix | suffix] as one causal segment, which gives the state and action
  rows exactly their rule; the image/language rows come from the bidirectional block call.
"""

from __future__ import annotations

import torch

from kilovla.models.attention import VarlenSpec, attend_dense, attend_varlen

_PRE, _SUF, _ALL = "prefix", "suffix", "all"


class DenseAttention:
    def __init__(self, mask: torch.Tensor, n: int, scale: float):
        """mask: additive (B, 1, N, N) over [prefix | suffix]; n: prefix tokens."""
        self.mask, self.scale = mask, scale
        self.part = {_PRE: slice(0, n), _SUF: slice(n, None), _ALL: slice(None)}

    def _attend(self, q, k, v, rows: str, cols: str) -> torch.Tensor:
        mask = self.mask[:, :, self.part[rows], self.part[cols]]
        return attend_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale).transpose(1, 2)

    def prefix(self, qp, kp, vp):
        return self._attend(qp, kp, vp, _PRE, _PRE)

    def cross(self, qs, kp, vp):
        return self._attend(qs, kp, vp, _SUF, _PRE)

    def joint(self, qp, kp, vp, qs, ks, vs):
        k, v = torch.cat([kp, ks], dim=1), torch.cat([vp, vs], dim=1)
        if qp is None:
            return None, self._attend(qs, k, v, _SUF, _ALL)
        out = self._attend(torch.cat([qp, qs], dim=1), k, v, _ALL, _ALL)
        return out[:, :qp.shape[1]], out[:, qp.shape[1]:]


class PackedAttention:
    def __init__(self, pre_len: torch.Tensor, suf_len: torch.Tensor, scale: float, backend: str):
        """pre_len, suf_len (B,): each sample's prefix (its last token the state) and suffix tokens."""
        self.scale, self.backend = scale, backend
        dev = pre_len.device
        n_pre = int(pre_len.sum())
        pre_end = pre_len.cumsum(0)
        self.state_rows = pre_end - 1
        block = torch.ones(n_pre, dtype=torch.bool, device=dev)
        block[self.state_rows] = False
        self.block_rows = block.nonzero(as_tuple=True)[0]
        ones = torch.ones_like(pre_len)
        self.spec_block = VarlenSpec.from_lengths(pre_len - 1, pre_len - 1)
        self.spec_state = VarlenSpec.from_lengths(ones, pre_len)
        self.spec_cross = VarlenSpec.from_lengths(suf_len, pre_len)
        self.spec_joint = VarlenSpec.from_lengths(pre_len + suf_len, pre_len + suf_len, causal=True)
        # rows of cat([prefix, suffix]) in the order [prefix 0 | suffix 0 | prefix 1 | suffix 1 | ...]
        sample = torch.arange(len(pre_len), device=dev)
        key = torch.cat([torch.repeat_interleave(sample * 2, pre_len),
                         torch.repeat_interleave(sample * 2 + 1, suf_len)])
        self.joint_order = torch.argsort(key, stable=True)
        self.n_pre = n_pre

    def _varlen(self, q, k, v, spec):
        return attend_varlen(q, k, v, spec, self.scale, self.backend)

    def _block(self, qp, kp, vp):
        r = self.block_rows
        return self._varlen(qp[r], kp[r], vp[r], self.spec_block)

    def prefix(self, qp, kp, vp):
        out = torch.empty_like(qp)
        out[self.block_rows] = self._block(qp, kp, vp)
        out[self.state_rows] = self._varlen(qp[self.state_rows], kp, vp, self.spec_state)
        return out

    def cross(self, qs, kp, vp):
        return self._varlen(qs, kp, vp, self.spec_cross)

    def joint(self, qp, kp, vp, qs, ks, vs):
        order = self.joint_order
        q_pre = qs.new_zeros(self.n_pre, *qs.shape[1:]) if qp is None else qp
        out_all = self._varlen(torch.cat([q_pre, qs])[order], torch.cat([kp, ks])[order], torch.cat([vp, vs])[order],
                               self.spec_joint)
        out = torch.empty_like(out_all)
        out[order] = out_all  # back to [prefix rows | suffix rows]
        if qp is None:
            return None, out[self.n_pre:]
        out_p = out[:self.n_pre].clone()
        out_p[self.block_rows] = self._block(qp, kp, vp)
        return out_p, out[self.n_pre:]
