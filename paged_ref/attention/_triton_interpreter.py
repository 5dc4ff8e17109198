"""Running a ``@triton.jit`` kernel in Triton's interpreter for one call, on CPU tensors.

Triton picks compile or interpret mode once, at import; this package picks per call: CUDA
tensors run the compiled kernel, CPU tensors (or any under ``TRITON_INTERPRET=1``) the same
kernel in the interpreter, switched on for that call only (:func:`interpreter`).
"""

import contextlib
import os
import sys
import threading
import types

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # no Triton wheel for this platform: the kernel modules import, calls fail clearly
    triton = types.SimpleNamespace(jit=lambda fn: fn)  # the kernels stay plain functions
    tl = types.SimpleNamespace(constexpr=None)  # only for the `tl.constexpr` annotations
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "interpreted", "interpreter", "runnable", "tl", "triton"]


def interpreted(device: torch.device) -> bool:
    """Whether a call on tensors of ``device`` runs in Triton's interpreter (CPU, or forced)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


_RUNNABLE: dict[tuple[object, bool], object] = {}


def runnable(kernel, interpret: bool):
    """``kernel`` (a ``@triton.jit`` function) in the mode a call needs, built once per mode: an
    InterpretedFunction, or a compiled-mode JITFunction."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    key = (kernel.fn, interpret)
    if key not in _RUNNABLE:
        if interpret:
            _RUNNABLE[key] = InterpretedFunction(kernel.fn)
        else:
            _RUNNABLE[key] = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    return _RUNNABLE[key]


_INTERPRETER_LOCK = threading.Lock()


def _language_state() -> list[tuple[object, dict]]:
    """A copy of the namespace of every triton.language module and class (the interpreter patches
    them and leaves some patches behind)."""
    modules = [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "triton.language" or name.startswith("triton.language."))
    ]
    classes = {
        v
        for m in modules
        for v in list(vars(m).values())
        if isinstance(v, type) and getattr(v, "__module__", "").startswith("triton.language")
    }
    return [(obj, dict(vars(obj))) for obj in (*modules, *classes)]


def _restore(state: list[tuple[object, dict]]) -> None:
    """Put back every attribute ``state`` recorded and remove those added to a class (names added
    to a module stay: the interpreter's cached rewrites look them up later)."""
    for obj, saved in state:
        current = vars(obj)
        if isinstance(obj, type):
            for name in [n for n in current if n not in saved]:
                delattr(obj, name)
        for name, value in saved.items():
            if current.get(name, _restore) is not value:
                setattr(obj, name, value)


@contextlib.contextmanager
def interpreter():
    """Run Triton's interpreter for the duration of one call, then put everything back (a lock
    keeps threads apart).

    triton.language's helpers (``tl.max``, ...) were decorated for compiling and the interpreter
    refuses them: for the call they become interpreted wrappers. ``tl.tensor`` also gets an
    ``__index__`` that squeezes its 1-element array (Triton 3.6 calls ``int(array)``, which numpy
    2.4 refuses for 1-D arrays).
    """
    from triton.runtime import interpreter as triton_interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with _INTERPRETER_LOCK:
        state = _language_state()
        knobs = getattr(triton, "knobs", None)
        knob_scope = knobs.runtime.scope() if knobs is not None else contextlib.nullcontext()
        patch_tensor = getattr(triton_interpreter, "_patch_lang_tensor", None)
        try:
            if patch_tensor is not None:
                triton_interpreter._patch_lang_tensor = _index_by_squeezing(patch_tensor)
            with knob_scope:
                wrappers = {}  # one wrapper per helper object
                for obj, saved in state:
                    for attr, value in saved.items():
                        if isinstance(value, JITFunction):
                            if id(value) not in wrappers:
                                wrappers[id(value)] = InterpretedFunction(value.fn)
                            setattr(obj, attr, wrappers[id(value)])
                if knobs is not None:
                    knobs.runtime.interpret = True
                yield
        finally:
            if patch_tensor is not None:
                triton_interpreter._patch_lang_tensor = patch_tensor
            _restore(state)


def _index_by_squeezing(patch_tensor):
    """The interpreter's ``_patch_lang_tensor(tensor, scope)``, then a squeezing ``__index__``."""

    def patch(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch
