"""pi0 and pi0.5 (models/pi05/model.py), registered as the "pi05" family (spec.py)."""

from kilovla.models.family import register
from kilovla.models.pi05.model import OPENPI_CAMERAS, Pi05Config, Pi05Model, flow_time
from kilovla.models.pi05.spec import FAMILY

register(FAMILY)

__all__ = ["FAMILY", "OPENPI_CAMERAS", "Pi05Config", "Pi05Model", "flow_time"]
