"""kilovla: train Vision-Language-Action robot policies fast, from one CPU box to a GPU cluster."""

__version__ = "0.1.0"
