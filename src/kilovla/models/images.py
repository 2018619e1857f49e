"""Camera frames -> model images: resizing and the families' training augmentation.

Resizing (`resize_images`), chosen per policy:

- ``stretch``: bilinear (antialiased) to the model's square resolution, aspect ratio not kept.
  GR00T's Eagle processor does this (it also stretches to 224 x 224).
- ``pad``: openpi's ``resize_with_pad`` - scale to fit, keep the aspect ratio, centre, pad with
  black. Matches openpi_client's PIL version to within a grey level.
- ``pad_top_left``: LeRobot's SmolVLA ``resize_with_pad`` - the same fit, the padding all at the top
  and left (the image in the bottom-right corner), bilinear without antialiasing as LeRobot's.

Augmentation (`ImageAugmentation`, training batches only), values of the published recipes:

- openpi (`OPENPI_AUGMENTATION`): cameras without "wrist" in their slot name get a random crop to 95 %
  of height and width, resized back, and a rotation in +-5 degrees; every camera gets brightness x
  U(0.7, 1.3), contrast U(0.6, 1.4) and saturation U(0.5, 1.5).
- GR00T N1.5 (`GROOT_AUGMENTATION`): random crop to 95 % (a centre crop at inference), colour jitter
  (0.3, 0.4, 0.5, hue 0.08), on every camera.

Parameters are drawn per sample from (seed, step, sample id), like the flow-matching noise, so a run
augments the same way whatever the world size and after a resume. Colour jitter follows
torchvision's definitions in a fixed order (brightness, contrast, saturation, hue), clamped to
[0, 1] after each; openpi's JAX pipeline (augmax, HSV-based) differs in detail.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kilovla.errors import KilovlaError

RESIZE_MODES = ("stretch", "pad", "pad_top_left")


def resize_images(images: torch.Tensor, size: int, mode: str = "stretch") -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] -> (N, 3, size, size)."""
    if mode not in RESIZE_MODES:
        raise KilovlaError(f"image_resize must be one of {RESIZE_MODES}, not {mode!r}")
    h, w = images.shape[-2:]
    if h == size and w == size:
        return images
    if mode == "stretch":
        return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return resize_with_pad(images, size, size, top_left=mode == "pad_top_left")


def resize_with_pad(images: torch.Tensor, height: int, width: int, top_left: bool = False) -> torch.Tensor:
    """openpi_client's `resize_with_pad`: fit inside (height, width) keeping the aspect ratio, centred,
    zero padding. (N, 3, H, W) -> (N, 3, height, width). `top_left`: LeRobot's SmolVLA version, all
    the padding at the top and left, no antialiasing."""
    h, w = images.shape[-2:]
    if (h, w) == (height, width):
        return images
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = F.interpolate(images, size=(rh, rw), mode="bilinear", antialias=not top_left, align_corners=False)
    out = images.new_zeros(*images.shape[:-2], height, width)
    if top_left:
        top, left = height - rh, width - rw
    else:
        top, left = max(0, int((height - rh) / 2)), max(0, int((width - rw) / 2))
    out[..., top: top + rh, left: left + rw] = resized
    return out


@dataclass(frozen=True, kw_only=True)
class ImageAugmentation:
    """Training-time image augmentation; the defaults do nothing."""

    crop_scale: float = 1.0  # random crop to this fraction of height and width, resized back
    rotate_degrees: float = 0.0  # rotation drawn from U(-d, d)
    brightness: float = 0.0  # factor from U(1 - b, 1 + b)
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0  # hue shift from U(-h, h), in turns
    geometric_skip: tuple[str, ...] = ()  # slots whose name contains one of these get no crop / rotation
    center_crop_at_inference: bool = False  # GR00T crops the centre at inference (same scale)

    def __post_init__(self):
        if not 0 < self.crop_scale <= 1:
            raise KilovlaError(f"augmentation crop_scale must be in (0, 1], not {self.crop_scale}")
        if any(v < 0 for v in (self.rotate_degrees, self.brightness, self.contrast, self.saturation, self.hue)):
            raise KilovlaError("augmentation strengths must be >= 0")
        if self.hue > 0.5:
            raise KilovlaError(f"augmentation hue must be <= 0.5, not {self.hue}")

    @classmethod
    def from_dict(cls, data: dict | None) -> ImageAugmentation:
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise KilovlaError(f"unknown augmentation fields {unknown}; fields: {', '.join(sorted(names))}")
        if "geometric_skip" in data:
            data["geometric_skip"] = tuple(data["geometric_skip"])
        return cls(**data)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @property
    def enabled(self) -> bool:
        return self.crop_scale < 1 or any((self.rotate_degrees, self.brightness, self.contrast, self.saturation,
                                           self.hue))

    def geometric_for(self, slot: str) -> bool:
        return not any(s in slot for s in self.geometric_skip)

    def apply(self, images: torch.Tensor, slot: str, rngs: list[np.random.Generator]) -> torch.Tensor:
        """Augment (N, 3, S, S) images of one camera slot in [0, 1], sample i drawing from rngs[i]."""
        out = []
        for img, rng in zip(images, rngs):
            # Draw every parameter whether it is used or not: a slot's switches never shift another's draws.
            top, left, angle = rng.random(), rng.random(), rng.uniform(-1, 1) * self.rotate_degrees
            factors = rng.uniform(-1, 1, 4) * np.array([self.brightness, self.contrast, self.saturation, self.hue])
            x = img[None]
            if self.geometric_for(slot):
                if self.crop_scale < 1:
                    x = _crop_resize(x, self.crop_scale, top, left)
                if self.rotate_degrees:
                    x = _rotate(x, angle)
            out.append(_jitter(x, *factors)[0])
        return torch.stack(out) if out else images

    def inference(self, images: torch.Tensor, slot: str) -> torch.Tensor:
        if self.center_crop_at_inference and self.crop_scale < 1 and self.geometric_for(slot):
            return _crop_resize(images, self.crop_scale, 0.5, 0.5)
        return images


OPENPI_AUGMENTATION = ImageAugmentation(crop_scale=0.95, rotate_degrees=5.0, brightness=0.3, contrast=0.4,
                                        saturation=0.5, geometric_skip=("wrist",))
GROOT_AUGMENTATION = ImageAugmentation(crop_scale=0.95, brightness=0.3, contrast=0.4, saturation=0.5, hue=0.08,
                                       center_crop_at_inference=True)


def _crop_resize(x: torch.Tensor, scale: float, top: float, left: float) -> torch.Tensor:
    """Crop (scale*H, scale*W) at relative offsets top/left in [0, 1], resize back to (H, W)."""
    h, w = x.shape[-2:]
    ch, cw = int(h * scale), int(w * scale)
    i, j = round(top * (h - ch)), round(left * (w - cw))
    return F.interpolate(x[..., i: i + ch, j: j + cw], size=(h, w), mode="bilinear", align_corners=False)


def _rotate(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate about the centre; corners that come from outside the image are black."""
    a = math.radians(degrees)
    theta = x.new_tensor([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]])[None]
    grid = F.affine_grid(theta.expand(len(x), -1, -1), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _gray(x: torch.Tensor) -> torch.Tensor:
    return (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]


def _jitter(x: torch.Tensor, brightness: float, contrast: float, saturation: float, hue: float) -> torch.Tensor:
    """torchvision's ColorJitter operations with factors 1 + b, 1 + c, 1 + s and hue shift h."""
    if brightness:
        x = (x * (1 + brightness)).clamp(0, 1)
    if contrast:
        mean = _gray(x).mean(dim=(-3, -2, -1), keepdim=True)
        x = (mean + (x - mean) * (1 + contrast)).clamp(0, 1)
    if saturation:
        g = _gray(x)
        x = (g + (x - g) * (1 + saturation)).clamp(0, 1)
    if hue:
        h, s, v = _rgb_to_hsv(x)
        x = _hsv_to_rgb((h + hue) % 1.0, s, v)
    return x


def _rgb_to_hsv(x: torch.Tensor):
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    maxc, minc = x.max(dim=1).values, x.min(dim=1).values
    v, delta = maxc, maxc - minc
    s = torch.where(maxc > 0, delta / maxc.clamp(min=1e-12), torch.zeros_like(maxc))
    safe = delta.clamp(min=1e-12)
    h = torch.where(maxc == r, ((g - b) / safe) % 6, torch.where(maxc == g, (b - r) / safe + 2, (r - g) / safe + 4))
    h = torch.where(delta > 0, h / 6.0, torch.zeros_like(h))
    return h, s, v


def _hsv_to_rgb(h, s, v) -> torch.Tensor:
    i = torch.floor(h * 6)
    f = h * 6 - i
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    i = i.long() % 6
    r = torch.stack([v, q, p, p, t, v])
    g = torch.stack([t, v, v, q, p, p])
    b = torch.stack([p, p, t, v, v, q])
    pick = lambda c: c.gather(0, i[None]).squeeze(0)  # noqa: E731
    return torch.stack([pick(r), pick(g), pick(b)], dim=1)
