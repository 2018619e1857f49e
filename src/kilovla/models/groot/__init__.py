"""GR00T N1.5 (models/groot/model.py), registered as the "groot" family (spec.py)."""

from kilovla.models.family import register
from kilovla.models.groot.model import DiTConfig, GrootConfig, GrootModel, flow_time
from kilovla.models.groot.spec import FAMILY
from kilovla.models.layers import CategoryLinear

register(FAMILY)

__all__ = ["FAMILY", "CategoryLinear", "DiTConfig", "GrootConfig", "GrootModel", "flow_time"]
