import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Run Liger's Triton kernels on the CPU (tests/test_liger.py). Must be set before Triton decorates them.
os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_passes_floats_as_fp32() -> None:
    """Triton's interpreter hands a float kernel argument to the kernel as a Python float (its _implicit_cvt
    wraps bools, ints and pointers only), so Liger kernels that write `eps.to(tl.float32)` fail there with
    "'float' object has no attribute 'to'". Compiled Triton specialises such arguments to fp32 scalars; wrap
    them the same way, in the tests only.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:
        return
    original = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original(arg)

    interpreter._implicit_cvt = implicit_cvt
    # Liger's RMSNorm takes rsqrt from triton.language.extra.libdevice, a CUDA stub the interpreter does
    # not implement (it returns None); triton.language.math.rsqrt is the same function, and the interpreter
    # patches it in at each launch, so look it up then.
    try:
        import liger_kernel.ops.rms_norm as liger_rms_norm

        liger_rms_norm.rsqrt = lambda x: tl.math.rsqrt(x)
    except Exception:
        pass


if os.environ["TRITON_INTERPRET"] == "1":
    _interpreter_passes_floats_as_fp32()

from tiny import save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (2 layers, hidden 32) with a character-level tokenizer and a chat template."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
