"""Kept importable for notebook 07 until it imports :mod:`paged_ref.viz.eviction_report`."""

from ..viz.eviction_report import *  # noqa: F403
from ..viz.eviction_report import __all__  # noqa: F401
