"""C++ kernels shipped as source (``.cpp`` files in the package) and compiled on first use.

`build` hands a kernel's source to PyTorch's C++ extension loader
(``torch.utils.cpp_extension.load_inline``: a C++ compiler and ninja, ~20 s, then cached on disk
and compiled for the host's own instruction set, ``-march=native``). A kernel that cannot be built
(no compiler, no ninja, a compile error) is None, with one warning saying why and what runs instead:
every caller has a PyTorch path for that case. `paged_ref.attention.cpu_paged` and the CPU
speed-ups in ``paged_ref.fast`` build theirs here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

__all__ = ["FLAGS", "VEXP", "build"]

#: ``vexp(x)``, a float exp the compiler vectorizes: compiled before a source that calls it.
VEXP = Path(__file__).parent / "csrc" / "vexp.h"

#: -O3 and the host's vector width; fast-math lets the compiler reassociate the sums, as any SIMD
#: reduction does; infinities stay IEEE.
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-fno-finite-math-only"]


def build(name: str, sources: list[Path], functions: list[str], instead: str):
    """The extension ``name`` compiled from ``sources`` (files, in order, as one source; ``functions``: the
    ones bound to Python), or None, with one warning saying why and what runs ``instead``, where it
    cannot be built. A missing source file raises (a broken install, not a missing compiler)."""
    text = "\n".join(Path(s).read_text() for s in sources)
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name, cpp_sources=text, functions=functions, extra_cflags=FLAGS)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        warnings.warn(f"{name}: the C++ code could not be built ({why}); {instead}", RuntimeWarning, stacklevel=3)
        return None
