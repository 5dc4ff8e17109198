"""Where and with what a number was measured: the record every benchmark JSON and figure carries.

`environment` makes the record a benchmark stores; `describe` turns a stored result back into
the one line a figure or a table prints under it.

Example:
    >>> env = environment()
    >>> sorted(k for k in ("date_utc", "torch", "gpu") if k in env)
    ['date_utc', 'gpu', 'torch']
    >>> describe({"environment": {"cpu": "x86_64", "torch": "2.13.0", "date_utc": "2026-12-02T13:00:00+00:00"},
    ...           "quick": True, "command": "python -m paged_ref.lab.bench alloc --quick"})
    'Measured on CPU x86_64 (quick mode), torch 2.13.0, 2026-12-02 (UTC); python -m paged_ref.lab.bench alloc --quick.'
    >>> describe({"environment": {"cpu": "x86_64", "cpu_model": "AMD EPYC", "date_utc": "2026-12-06"}})
    'Measured on CPU AMD EPYC (x86_64), 2026-12-06 (UTC).'
    >>> describe({"environment": {"cpu": "x86_64", "cpu_model": "AMD EPYC", "cpu_features": ["avx2", "fma"]}})
    'Measured on CPU AMD EPYC (x86_64; avx2, fma), ? (UTC).'
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import platform

import torch

__all__ = ["FEATURES", "cpu_features", "cpu_model", "environment", "package_version", "describe"]

#: the CPU's vector extensions a record names where the CPU has them (their names in /proc/cpuinfo): they decide
#: which kernels a build of torch, oneDNN and the package's C++ runs, so one model name can be two speeds
FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "asimd", "sve")


def package_version(package: str) -> str | None:
    """The installed version of ``package``, or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's model name as the kernel reports it (Linux's ``/proc/cpuinfo``), or None elsewhere.

    Example:
        >>> model = cpu_model()
        >>> model is None or isinstance(model, str)
        True
    """
    return next((value for key, value in _cpuinfo(cpuinfo) if key == "model name" and value), None)


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> list[str] | None:
    """Which of `FEATURES` the CPU has (the first ``flags`` or ``Features`` line of Linux's ``/proc/cpuinfo``),
    or None where it is not listed."""
    lines = (value.split() for key, value in _cpuinfo(cpuinfo) if key in ("flags", "Features"))
    return next(([name for name in FEATURES if name in flags] for flags in lines), None)


def _cpuinfo(cpuinfo: str):
    """``(key, value)`` of each ``key : value`` line of ``cpuinfo``, both stripped; none where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                yield key.strip(), value.strip()
    except OSError:
        return


def environment() -> dict:
    """Where and with what a result was measured: device, versions and UTC date (no host name)."""
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
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


def describe(data: dict) -> str:
    """One line: where, with what and when the benchmark result ``data`` was measured.

    Reads ``data["environment"]`` (as `environment` made it; the CPU's model where it records one) and,
    where present, the run's
    ``torch_threads`` (in ``data`` or its environment), quick mode (``quick`` true or
    ``mode == "quick"``), ``command`` and ``clock``; versions not installed are left out.
    """
    env = data.get("environment") or {}
    cpu = env.get("cpu") or "unknown"
    if env.get("cpu_features"):
        cpu = f"{cpu}; {', '.join(env['cpu_features'])}"
    if env.get("cpu_model"):
        cpu = f"{env['cpu_model']} ({cpu})"
    where = f"GPU {env['gpu']}" if env.get("gpu") else f"CPU {cpu}"
    threads = data.get("torch_threads") or env.get("torch_threads")
    if threads:
        where += f" ({threads} thread{'s' if threads != 1 else ''})"
    if data.get("quick") or data.get("mode") == "quick":
        where += " (quick mode)"
    names = (("torch", "torch"), ("transformers", "transformers"), ("triton", "triton"), ("CUDA", "cuda"))
    versions = [f"{name} {env[key]}" for name, key in names if env.get(key)]
    line = ", ".join([f"Measured on {where}", *versions, f"{str(env.get('date_utc', '?'))[:10]} (UTC)"])
    if data.get("command"):
        line += f"; {data['command']}"
    if data.get("clock"):
        line += f"; clock: {data['clock']}"
    return line + "."
