"""cffi (API mode) build of ``bladed._uring`` against the system liburing.

The declarations are the CDEF section of ``bladed_uring.h``, so the C header
stays the single source of truth for the C surface.
"""

from __future__ import annotations

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent


def _cdef() -> str:
    text = (HERE / "bladed_uring.h").read_text()
    start = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
    end = text.index("/* CDEF-END */")
    return text[start:end]


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "bladed._uring",
    '#include "bladed_uring.h"',
    sources=[str((HERE / "bladed_uring.c").relative_to(HERE.parent))],
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    libraries=["uring"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
