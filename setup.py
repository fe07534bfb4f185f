"""The one compiled part of trtspec: the embedded engine's CPU linear kernel (trtspec/engine/_linear.c).

It is optional: where no C compiler is found the install goes on without it and the engine uses oneDNN's
products (slower, see trtspec/engine/kernels.py). Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("trtspec.engine._linear", ["trtspec/engine/_linear.c"],
                             extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"], optional=True)])
