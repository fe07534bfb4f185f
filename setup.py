"""The one compiled part of trtspec: the embedded engine's CPU kernels (trtspec/engine/_cpu_kernels.c).

It is optional: where no C compiler is found the install goes on without it and the engine uses oneDNN's
products (slower, see trtspec/engine/kernels.py). Everything else is declared in pyproject.toml.
-ffp-contract=off: GCC would otherwise fuse a multiply and an add into one rounding in some inlined copies of a
kernel and not in others, and a row's bits would depend on the tile that computed it."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trtspec.engine._cpu_kernels",
            ["trtspec/engine/_cpu_kernels.c"],
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
