"""Old home of :mod:`paged_ref.viz.scaling_report`, kept importable until notebook 06 imports the new one."""

from ..viz.scaling_report import *  # noqa: F403
from ..viz.scaling_report import __all__  # noqa: F401
