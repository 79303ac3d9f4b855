"""The one build step pyproject.toml cannot say: the optional native host repack.

``mpack.convert._repack`` (convert/_repack.c) is a plain C extension. ``optional=True``: where
it cannot be built (no C compiler), the install goes on without it and a conversion on the CPU
uses the torch path (Note [host repack] in convert/host_repack.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mpack.convert._repack",
            sources=["convert/_repack.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
