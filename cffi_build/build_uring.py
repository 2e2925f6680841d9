"""cffi (API mode) build of ``bladed._uring`` against the system liburing.

The declarations are the CDEF sections of ``bladed_uring.h`` (the I/O engine)
and ``bladed_lane.h`` (the data connections' request loop), so the C headers
stay the single source of truth for the C surface.
"""

from __future__ import annotations

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent


HEADERS = ("bladed_uring.h", "bladed_lane.h")
SOURCES = ("bladed_uring.c", "bladed_lane.c")


def _cdef() -> str:
    parts = []
    for name in HEADERS:
        text = (HERE / name).read_text()
        start = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
        parts.append(text[start:text.index("/* CDEF-END */")])
    return "\n".join(parts)


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "bladed._uring",
    "".join(f'#include "{name}"\n' for name in HEADERS),
    sources=[str((HERE / name).relative_to(HERE.parent)) for name in SOURCES],
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    libraries=["uring"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
