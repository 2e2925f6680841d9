"""Build hook: compiles the liburing extension (cffi API mode) during pip install."""

from setuptools import setup

setup(cffi_modules=["cffi_build/build_uring.py:ffibuilder"])
