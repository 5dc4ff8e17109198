"""Where and with what a number was measured: the record every benchmark JSON and figure carries.

Example:
    >>> env = environment()
    >>> sorted(k for k in ("date_utc", "torch", "gpu") if k in env)
    ['date_utc', 'gpu', 'torch']
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import platform

import torch

__all__ = ["environment", "package_version"]


def package_version(package: str) -> str | None:
    """The installed version of ``package``, or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Where and with what a result was measured: device, versions and UTC date (no host name)."""
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "cuda": torch.version.cuda,
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_sms"] = props.multi_processor_count
        env["gpu_memory_GiB"] = round(props.total_memory / 2**30, 1)
        env["gpu_count"] = torch.cuda.device_count()
    return env
