"""Build hook: compiles the three cffi extensions (API mode) during pip install.

``bladed._wire`` (frames on a socket; what a client loads) needs no liburing; ``bladed._uring`` (the engine
and the lane; the daemon's) links it and includes ``bladed._wire``'s declarations; ``bladed._codec`` (the q8 /
q4 KV row codec on the CPU, loaded by ``bladed.kvformat`` in the inference process) needs no liburing either.
"""

from setuptools import setup

setup(cffi_modules=["cffi_build/build_wire.py:ffibuilder", "cffi_build/build_uring.py:ffibuilder",
                    "cffi_build/build_codec.py:ffibuilder"])
