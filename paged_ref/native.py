"""C++ kernels shipped as source (``.cpp`` files in the package) and compiled on first use.

`build` hands a kernel's source to PyTorch's C++ extension loader
(``torch.utils.cpp_extension.load_inline``: a C++ compiler and ninja, ~20 s, then cached on disk
under a name carrying a hash of its source and flags, so that two versions of a kernel never share
a build; compiled for the host's own instruction set, ``-march=native``). A kernel that cannot be built
(no compiler, no ninja, a compile error) is None, with one warning saying why and what runs instead:
every caller has a PyTorch path for that case. `paged_ref.attention.cpu_paged` and the CPU
speed-ups in ``paged_ref.fast`` build theirs here.

Every source is compiled after `CHECKS`, the argument checks each op runs before it touches memory
(a ``RuntimeError`` naming the op, the argument, what it must be and what it is). With the
environment variable ``PAGED_REF_SANITIZE=1`` the kernels are built under AddressSanitizer and
UndefinedBehaviorSanitizer (`SANITIZE_FLAGS`); the process must
then start with ``libasan`` (and ``libstdc++``, for its interceptor of C++ exceptions) preloaded:
``LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["CHECKS", "FLAGS", "OPENMP", "SANITIZE_FLAGS", "VEXP", "build"]

#: ``vexp(x)``, a float exp the compiler vectorizes: compiled before a source that calls it.
VEXP = Path(__file__).parent / "csrc" / "vexp.h"
#: ``check_tensor`` and ``check_no_overlap``: compiled before every source.
CHECKS = Path(__file__).parent / "csrc" / "checks.h"

#: -O3 and the host's vector width; fast-math lets the compiler reassociate the sums, as any SIMD
#: reduction does; infinities stay IEEE. Where torch runs its threads with OpenMP (Linux), ``-fopenmp``:
#: ``at::parallel_for`` is inline in the kernel and splits its loop over ``torch.get_num_threads()`` threads
#: only when the kernel is compiled with OpenMP (else it runs the whole loop on the calling thread). Not
#: linked with ``-fopenmp``: its calls resolve to the OpenMP runtime torch has loaded, one runtime, the one
#: ``torch.set_num_threads`` sets.
OPENMP = ["-fopenmp"] if sys.platform == "linux" and torch.backends.openmp.is_available() else ["-fopenmp-simd"]
FLAGS = ["-O3", "-march=native", *OPENMP, "-ffast-math", "-fno-finite-math-only"]
#: ``PAGED_REF_SANITIZE=1``: every out-of-bounds access or undefined behaviour reported (and fatal).
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]


def build(name: str, sources: list[Path], functions: list[str], instead: str):
    """The extension ``name`` compiled from `CHECKS` and ``sources`` (files, in order, as one source;
    ``functions``: the ones bound to Python), or None, with one warning saying why and what runs
    ``instead``, where it cannot be built. A missing source file raises (a broken install, not a missing
    compiler)."""
    text = "\n".join(Path(s).read_text() for s in [CHECKS, *sources])
    sanitize = os.environ.get("PAGED_REF_SANITIZE") == "1"
    flags, ldflags = (FLAGS + SANITIZE_FLAGS, SANITIZE_FLAGS[:1]) if sanitize else (FLAGS, [])
    try:
        from torch.utils.cpp_extension import load_inline

        digest = hashlib.sha256("\0".join([text, *functions, *flags]).encode()).hexdigest()[:12]
        unique = f"{name}_{'sanitized_' if sanitize else ''}{digest}"  # one build per source and flags
        return load_inline(unique, cpp_sources=text, functions=functions, extra_cflags=flags, extra_ldflags=ldflags)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        warnings.warn(f"{name}: the C++ code could not be built ({why}); {instead}", RuntimeWarning, stacklevel=3)
        return None
