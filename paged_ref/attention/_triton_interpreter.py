"""Running a ``@triton.jit`` kernel in Triton's interpreter for one call, on CPU tensors.

Triton chooses compile or interpret mode when ``@triton.jit`` decorates a function, which
happens once, at import. This package decides per call instead: tensors on a CUDA device run
the compiled kernel, CPU tensors (or any tensors under ``TRITON_INTERPRET=1``) run the same
kernel function (the JITFunction's ``.fn``) in the interpreter. Nothing is set for the
process: :func:`interpreter` switches the interpreter on for the duration of one call and puts
everything back afterwards.
"""

import contextlib
import os
import sys
import threading

import torch

__all__ = ["interpreted", "interpreter", "runnable"]


def interpreted(device: torch.device) -> bool:
    """Whether a call on tensors of ``device`` runs in Triton's interpreter (CPU, or forced)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


_RUNNABLE: dict[tuple[object, bool], object] = {}


def runnable(kernel, interpret: bool):
    """``kernel`` (a ``@triton.jit`` function) in the mode a call needs, built once per mode:
    its function wrapped in an InterpretedFunction, or a compiled-mode JITFunction (the kernel
    itself, unless ``TRITON_INTERPRET=1`` at import made it an interpreted one)."""
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
    """A copy of the namespace of every triton.language module and of every class defined there.

    Triton's interpreter patches these while it runs (builtins, ``tensor`` methods, ``range``),
    and leaves some patches behind after a kernel calls a ``@jit`` helper; taking a copy before
    an interpreted call lets :func:`interpreter` put every attribute back afterwards.
    """
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
    """Put back every attribute that ``state`` recorded and remove those added to a class.
    Names the interpreter *added* to a module stay: its cached rewrites of triton.language's
    helpers look them up later."""
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
    """Run Triton's interpreter for the duration of one call, then put everything back.

    Triton's own helpers in triton.language (``tl.max``, ``tl.sum``, ``tl.cdiv``, ...) were
    decorated for compiling when triton was imported, and the interpreter refuses to call
    those. For the call they are swapped for interpreted wrappers and the interpreter knob is
    switched on; afterwards every attribute of triton.language (and the knob, and the
    TRITON_INTERPRET variable that setting the knob writes) is restored. A lock keeps two
    threads from interleaving.

    The interpreter holds a scalar as a 1-element array, and some Triton versions (3.6) turn
    it into a Python int with ``int(array)``, which numpy 2.4 and later refuse ("only
    0-dimensional arrays can be converted to Python scalars": ``range(start, end, BLOCK_N)``
    in a kernel needs it). For the call, the interpreter's patching of ``tl.tensor`` also
    gives it an ``__index__`` that squeezes the array first; both go when the call returns.
    """
    import triton
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
    """The interpreter's ``_patch_lang_tensor(tensor, scope)``, then an ``__index__`` that
    reads a 1-element array of any shape (``int(array.squeeze())``; numpy 2.4 refuses
    ``int`` of a 1-D array)."""

    def patch(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch
