"""cffi (API mode) build of ``bladed._codec``: the q8 / q4 KV row codec on the CPU (``bladed_codec.c``).

What ``bladed.kvformat`` calls to encode and decode rows of CPU tensors: libc and pthreads only (no liburing),
since the inference process loads it. The declarations are the CDEF section of ``bladed_codec.h``.

The flags keep the wheel portable (no ``-march``: baseline x86-64 or aarch64; the AVX2 + F16C build of the
loops is chosen at run time) and the arithmetic the torch encoder's, bit for bit: ``-ffp-contract=off`` (no
FMA where torch rounds twice; aarch64 would fuse by default), no ``-ffast-math``. ``-O3`` vectorises the
loops; ``-fno-trapping-math`` lets it turn the branches of a select into blends (results are unchanged).
"""

from __future__ import annotations

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
HEADERS = ("bladed_codec.h", "bladed_codec_kernels.h", "bladed_codec_fused.h")
CFLAGS = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11", "-ffp-contract=off",
          "-fno-trapping-math", "-pthread"]


def cdef() -> str:
    """The CDEF section of ``bladed_codec.h``."""
    text = (HERE / "bladed_codec.h").read_text()
    start = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
    return text[start:text.index("/* CDEF-END */")]


def rel(name: str) -> str:
    """``name`` relative to the project root (setuptools wants relative sources)."""
    return str((HERE / name).relative_to(ROOT))


ffibuilder = FFI()
ffibuilder.cdef(cdef())
ffibuilder.set_source(
    "bladed._codec",
    '#include "bladed_codec.h"\n',
    sources=[rel("bladed_codec.c")],
    include_dirs=[rel(".")],
    depends=[rel(h) for h in HEADERS],
    extra_compile_args=CFLAGS,
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
