"""Liger's Triton kernels on the CPU, under Triton's interpreter (TRITON_INTERPRET=1).

Far too slow to train with, but it runs the very kernels a GPU runs, so the tests can check the fused path
against the pure-torch one and bench/layer_memory.py can count what the layer kernels allocate, with no GPU.
TRITON_INTERPRET must be set before Triton decorates the kernels, i.e. before liger_kernel is imported.
"""

from __future__ import annotations

import os

_patched = False


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter() -> None:
    """Two gaps between the interpreter and compiled Triton that Liger 0.8.5 falls into (Triton 3.9):

    - a float kernel argument reaches the kernel as a Python float (the interpreter's _implicit_cvt wraps bools,
      ints and pointers only), so `eps.to(tl.float32)` in the RMSNorm and SwiGLU kernels raises
      "'float' object has no attribute 'to'". Compiled Triton specialises such arguments to fp32 scalars:
      wrap them the same way;
    - RMSNorm takes rsqrt from triton.language.extra.libdevice, a CUDA stub the interpreter does not implement
      (it returns None). triton.language.math.rsqrt is the same function and the interpreter patches it in at
      each launch, so look it up then.
    No-op unless the interpreter is on; idempotent.
    """
    global _patched
    if _patched or not interpreter_on():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original(arg)

    interpreter._implicit_cvt = implicit_cvt
    import liger_kernel.ops.rms_norm as liger_rms_norm

    liger_rms_norm.rsqrt = lambda x: tl.math.rsqrt(x)
    _patched = True
