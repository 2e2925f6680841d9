"""cffi (API mode) build of ``bladed._wire``: frames on a socket (``bladed_wire.c``), without liburing.

What a client process loads to talk to the daemon (``bladed.protocol.FrameStream``), so a client needs no
liburing.  The wire's layouts and codes come from ``bladed/protocol.py`` (``wire_layout.py`` writes them as
``bladed_wire_layout.h`` first); the declarations are the CDEF section of ``bladed_wire.h``.
``build_uring.py`` includes this FFI, so the daemon's lane and the client share ``struct bd_stream``.
"""

from __future__ import annotations

import pathlib
import sys
from types import ModuleType

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
CFLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11"]


def sibling(name: str) -> ModuleType:
    """Another script of this directory, run once (setuptools runs these files by path: this directory is not on
    sys.path); compiled without a bytecode cache, so that the build leaves nothing in cffi_build/."""
    if name not in sys.modules:
        path = HERE / f"{name}.py"
        module = ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return sys.modules[name]


def cdef_of(*headers: str) -> str:
    """The CDEF sections of ``headers``: the C headers stay the one source of the C surface."""
    parts = []
    for name in headers:
        text = (HERE / name).read_text()
        start = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
        parts.append(text[start:text.index("/* CDEF-END */")])
    return "\n".join(parts)


def source(*names: str) -> list[str]:
    """``names`` as paths relative to the project root (setuptools wants relative sources)."""
    return [str((HERE / name).relative_to(ROOT)) for name in names]


layout = sibling("wire_layout")
_spec = layout.spec()
#: the generated header's directory
GENERATED = layout.write_header(_spec).parent
INCLUDE_DIRS = [str(HERE.relative_to(ROOT)), str(GENERATED)]
#: what a rebuild depends on beyond the sources
DEPENDS = [*source("bladed_wire.h"), str(GENERATED / layout.HEADER_NAME)]

ffibuilder = FFI()
ffibuilder.cdef(layout.cdef(_spec) + cdef_of("bladed_wire.h"))
ffibuilder.set_source(
    "bladed._wire",
    '#include "bladed_wire.h"\n',
    sources=source("bladed_wire.c"),
    include_dirs=INCLUDE_DIRS,
    depends=DEPENDS,
    extra_compile_args=CFLAGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
