"""Build hook: compiles the two cffi extensions (API mode) during pip install.

``bladed._wire`` (frames on a socket; what a client loads) needs no liburing; ``bladed._uring`` (the engine
and the lane; the daemon's) links it and includes ``bladed._wire``'s declarations.
"""

from setuptools import setup

setup(cffi_modules=["cffi_build/build_wire.py:ffibuilder", "cffi_build/build_uring.py:ffibuilder"])
