"""PaddedBatch and PackedBatch: the one batch representation that data, models and trainer share.

PaddedBatch is openpi's layout: every sample has every camera slot (a blank camera is present with
`image_masks` False) and language padded to a common length (`token_mask` False on padding).
PackedBatch holds only what is real: the images of enabled, present cameras, the real language
tokens laid end to end, and per-sample counts, so the model never computes on padding.

`PaddedBatch.pack(enabled_cameras)` turns one into the other; the equivalence tests run both
through the model and compare.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kilovla.errors import KilovlaError


@dataclass
class PaddedBatch:
    images: torch.Tensor  # (B, C, 3, H, W) float in [0, 1]
    image_masks: torch.Tensor  # (B, C) bool: camera present
    camera_names: tuple[str, ...]
    tokens: torch.Tensor  # (B, L) long
    token_mask: torch.Tensor  # (B, L) bool
    state: torch.Tensor  # (B, S) float, normalised, zero-padded to the model's max_state_dim
    actions: torch.Tensor | None = None  # (B, H, A) float, normalised, zero-padded to max_action_dim
    action_is_pad: torch.Tensor | None = None  # (B, H) bool: past the episode's end (no loss)
    horizon_mask: torch.Tensor | None = None  # (B, H) bool: chunk positions this sample has
    action_dim_mask: torch.Tensor | None = None  # (A,) or (B, A) bool: real action dims
    embodiment_id: torch.Tensor | None = None  # (B,) long: GR00T's per-embodiment encoders (None: 0)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> PaddedBatch:
        return replace(self, **{k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)})

    def select_cameras(self, keep: tuple[str, ...]) -> PaddedBatch:
        """Drop camera slots not in `keep` (pruning before the ViT, padded layout kept otherwise)."""
        missing = [c for c in keep if c not in self.camera_names]
        if missing:
            raise KilovlaError(f"batch has cameras {list(self.camera_names)}, the model needs {missing}")
        idx = [self.camera_names.index(c) for c in keep]
        return replace(self, images=self.images[:, idx], image_masks=self.image_masks[:, idx], camera_names=tuple(keep))

    def trim_language(self) -> PaddedBatch:
        """Dynamic padding: cut language padding to the longest real prompt in the batch."""
        longest = int(self.token_mask.sum(1).max())
        return replace(self, tokens=self.tokens[:, :longest], token_mask=self.token_mask[:, :longest])

    def pack(self, cameras: tuple[str, ...] | None = None) -> PackedBatch:
        """Keep only present images of `cameras` (default: all) and real tokens."""
        b = self.select_cameras(cameras) if cameras is not None else self
        sample_of_image, camera_of_image = b.image_masks.nonzero(as_tuple=True)
        sample_of_token, _ = b.token_mask.nonzero(as_tuple=True)
        return PackedBatch(
            images=b.images[sample_of_image, camera_of_image],
            image_sample=sample_of_image,
            tokens=b.tokens[b.token_mask],
            token_sample=sample_of_token,
            batch_size=b.batch_size,
            state=b.state,
            actions=b.actions,
            action_is_pad=b.action_is_pad,
            horizon_mask=b.horizon_mask,
            action_dim_mask=b.action_dim_mask,
            embodiment_id=b.embodiment_id,
        )


@dataclass
class PackedBatch:
    images: torch.Tensor  # (N_img, 3, H, W): present images of enabled cameras, grouped by sample
    image_sample: torch.Tensor  # (N_img,) sample of each image, non-decreasing
    tokens: torch.Tensor  # (T_lang,) real language tokens, grouped by sample
    token_sample: torch.Tensor  # (T_lang,) sample of each token, non-decreasing
    batch_size: int
    state: torch.Tensor  # (B, S)
    actions: torch.Tensor | None = None  # (B, H, A)
    action_is_pad: torch.Tensor | None = None  # (B, H)
    horizon_mask: torch.Tensor | None = None  # (B, H) chunk positions each sample has (None: all)
    action_dim_mask: torch.Tensor | None = None
    embodiment_id: torch.Tensor | None = None

    def to(self, device) -> PackedBatch:
        return replace(self, **{k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)})


def loss_weight(batch, target: torch.Tensor) -> torch.Tensor:
    """1 where an action element counts in the loss: a chunk position the sample has, not past the
    episode's end (`action_is_pad`), a real action dimension."""
    weight = torch.ones_like(target)
    if batch.horizon_mask is not None:
        weight = weight * batch.horizon_mask[..., None]
    if batch.action_is_pad is not None:
        weight = weight * (~batch.action_is_pad)[..., None]
    if batch.action_dim_mask is not None:
        dims = batch.action_dim_mask
        weight = weight * (dims[None, None, :] if dims.ndim == 1 else dims[:, None, :])
    return weight


def flow_loss(prediction: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked MSE: `loss` over every counted element of the batch, `per_sample` (B,) within each sample.

    The trainer sums `per_sample` over a global batch, which makes gradients independent of how the
    samples are split into rows and ranks.
    """
    err = (prediction - target) ** 2 * weight
    return {"loss": err.sum() / weight.sum().clamp(min=1),
            "per_sample": err.sum((1, 2)) / weight.sum((1, 2)).clamp(min=1), "v_t": prediction}


def pack_prefix(image_tokens: torch.Tensor, image_sample: torch.Tensor, text_tokens: torch.Tensor,
                token_sample: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay each sample's image tokens, then its text tokens, end to end.

    image_tokens (N_img, P, W) with image_sample (N_img,); text_tokens (T, W) with token_sample (T,);
    both grouped by sample. Returns tokens (sum of lengths, W), lengths (B,) and positions that
    restart at 0 for every sample.
    """
    p = image_tokens.shape[1]
    img_sample = image_sample.repeat_interleave(p)
    src = torch.cat([image_tokens.reshape(-1, image_tokens.shape[-1]), text_tokens])
    sample = torch.cat([img_sample, token_sample])
    kind = torch.cat([torch.zeros_like(img_sample), torch.ones_like(token_sample)])
    tokens = src[torch.argsort(sample * 2 + kind, stable=True)]
    lengths = torch.bincount(sample, minlength=batch_size)
    positions = torch.arange(len(tokens), device=tokens.device) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return tokens, lengths, positions


def padded_prefix(image_tokens: torch.Tensor, image_masks: torch.Tensor, text_tokens: torch.Tensor,
                  token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded twin of `pack_prefix`: image tokens (B*C, P, W) of camera slots (B, C), then text
    tokens (B, L, W) -> tokens (B, C*P + L, W) and which are real (B, C*P + L)."""
    b, c = image_masks.shape
    p = image_tokens.shape[1]
    tokens = torch.cat([image_tokens.reshape(b, c * p, -1), text_tokens], dim=1)
    valid = torch.cat([image_masks[:, :, None].expand(b, c, p).reshape(b, c * p), token_mask], dim=1)
    return tokens, valid


def place_images(text: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None, images: torch.Tensor,
                 image_token_id: int) -> torch.Tensor:
    """A chat template's images (Eagle's, Qwen3-VL's): the i-th image's tokens replace the i-th run of
    placeholders `image_token_id` among the real tokens (in sample order, then camera order).
    text (..., W) embeddings of tokens (...); images (N, P, W) the present images' tokens."""
    slots = tokens == image_token_id
    if valid is not None:
        slots &= valid
    if int(slots.sum()) != images.shape[0] * images.shape[1]:
        raise KilovlaError(f"the prompts hold {int(slots.sum())} image placeholders, the batch has "
                           f"{images.shape[0]} images of {images.shape[1]} tokens")
    return text.masked_scatter(slots[..., None], images.to(text.dtype))
