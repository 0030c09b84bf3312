"""The package's one compiled piece, built with the package (``pip install``, ``pip wheel``, or in a
checkout ``python setup.py build_ext --inplace``): dynamic tables' CPU loops, ``native.c``.

Plain C on raw buffers (no Python or torch headers), loaded with ctypes by
``lightning_shardrec/modules/dynamic/native.py``; nothing is compiled at run time. Optional: where
it cannot be built (no compiler at install time) the package installs without it and dynamic
tables run the loops' tensor-op twins (same results, slower on CPU). Everything else about the
package is in ``pyproject.toml``.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "lightning_shardrec/modules/dynamic/native.c"
# the library names its source (native.py loads only a library built from the native.c beside it)
KEY = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()[:16]

setup(
    ext_modules=[
        Extension(
            "lightning_shardrec.modules.dynamic._loops",
            sources=[SOURCE],
            define_macros=[("SHARDREC_SOURCE", f'"{KEY}"')],
            # no FMA contraction: the same roundings as torch (the tests hold the twins equal bit for bit)
            extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
