"""The data layer: LeRobot datasets on disk -> plan -> packed, model-ready batches.

Import the public names from here::

    from kilovla.data import LeRobotDataset, DatasetWriter, DataLake, TokenLayout, GlobalBatchPlan
"""

from kilovla.data.lake import DataLake, LakeSource, TokenLayout
from kilovla.data.lerobot import LeRobotDataset
from kilovla.data.meta import DatasetMeta
from kilovla.data.loader import InProcessLoader, RayLoader, TorchLoader, build_loader
from kilovla.data.plan import GlobalBatchPlan, PlanConfig
from kilovla.data.writer import DatasetWriter, convert_v21_to_v30

__all__ = [
    "DataLake",
    "DatasetMeta",
    "DatasetWriter",
    "GlobalBatchPlan",
    "InProcessLoader",
    "LakeSource",
    "LeRobotDataset",
    "PlanConfig",
    "RayLoader",
    "TokenLayout",
    "TorchLoader",
    "build_loader",
    "convert_v21_to_v30",
]
