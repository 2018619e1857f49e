"""GR00T N1.7 (models/groot_n17/model.py), registered as the "groot-n17" family (spec.py)."""

from kilovla.models.family import register
from kilovla.models.groot_n17.model import GrootN17Config, GrootN17Model, QwenViTConfig
from kilovla.models.groot_n17.spec import FAMILY

register(FAMILY)

__all__ = ["FAMILY", "GrootN17Config", "GrootN17Model", "QwenViTConfig"]
