"""cffi (API mode) build of ``bladed._uring`` against the system liburing: the daemon's side.

The declarations are the CDEF sections of ``bladed_uring.h`` (the I/O engine) and ``bladed_lane.h`` (the
data connections' request loop), so the C headers stay the single source of truth for the C surface.  It
includes ``bladed._wire``'s FFI (``build_wire.py``): the lane reads frames through the same
``struct bd_stream`` as ``bladed.protocol.FrameStream``, and importing ``bladed._uring`` imports
``bladed._wire``.  ``bladed_wire.c`` is compiled into both, for the lane's own calls.
"""

from __future__ import annotations

import pathlib
import sys
from types import ModuleType

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent

if "build_wire" not in sys.modules:   # setuptools runs this file by path: run its sibling the same way
    _path = HERE / "build_wire.py"
    sys.modules["build_wire"] = ModuleType("build_wire")
    sys.modules["build_wire"].__file__ = str(_path)
    exec(compile(_path.read_text(), str(_path), "exec"), sys.modules["build_wire"].__dict__)
wire = sys.modules["build_wire"]

HEADERS = ("bladed_uring.h", "bladed_lane.h")
SOURCES = ("bladed_uring.c", "bladed_lane.c", "bladed_wire.c")

ffibuilder = FFI()
ffibuilder.include(wire.ffibuilder)
ffibuilder.cdef(wire.cdef_of(*HEADERS))
ffibuilder.set_source(
    "bladed._uring",
    "".join(f'#include "{name}"\n' for name in HEADERS),
    sources=wire.source(*SOURCES),
    include_dirs=wire.INCLUDE_DIRS,
    depends=[*wire.DEPENDS, *wire.source(*HEADERS)],
    libraries=["uring"],
    extra_compile_args=wire.CFLAGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
