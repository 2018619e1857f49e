"""SmolVLA (models/smolvla/model.py), registered as the "smolvla" family (spec.py)."""

from kilovla.models.family import register
from kilovla.models.smolvla.model import SmolVLAConfig, SmolVLAModel, flow_time
from kilovla.models.smolvla.spec import FAMILY

register(FAMILY)

__all__ = ["FAMILY", "SmolVLAConfig", "SmolVLAModel", "flow_time"]
