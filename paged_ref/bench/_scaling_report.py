"""Re-exports :mod:`paged_ref.bench.scaling_report` for notebook 06, which imports this path."""

from .scaling_report import *  # noqa: F403
from .scaling_report import __all__  # noqa: F401
