"""The one compiled part of trtspec: the embedded engine's CPU kernels (trtspec/engine/_cpu_kernels.c).

It is optional: where no C compiler is found the install goes on without it and the engine uses oneDNN's
products (slower, see trtspec/engine/kernels.py). Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("trtspec.engine._cpu_kernels", ["trtspec/engine/_cpu_kernels.c"],
                             extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"], optional=True)])
