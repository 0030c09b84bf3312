"""The package's compiled pieces, built with the package (``pip install``, ``pip wheel``, or in a
checkout ``python setup.py build_ext --inplace``): dynamic tables' CPU loops, ``native.c``, and the
portable embedding kernel's CPU loops, ``native_rows.c``.

Plain C on raw buffers (no Python or torch headers), loaded with ctypes by
``lightning_shardrec/modules/dynamic/native.py`` and ``lightning_shardrec/kernels/native.py``; nothing
is compiled at run time. Optional: where they cannot be built (no compiler at install time) the
package installs without them and runs the loops' tensor-op twins (same results, or for the kernel
the same to within fp32 rounding; slower on CPU). Everything else about the package is in
``pyproject.toml``.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

LIBRARIES = {  # module -> its one C source
    "lightning_shardrec.modules.dynamic._loops": "lightning_shardrec/modules/dynamic/native.c",
    "lightning_shardrec.kernels._rows": "lightning_shardrec/kernels/native_rows.c",
}


def key(source: str) -> str:
    """The library names its source (the loaders load only a library built from the .c beside them)."""
    return hashlib.sha256((Path(__file__).parent / source).read_bytes()).hexdigest()[:16]


setup(
    ext_modules=[
        Extension(
            module,
            sources=[source],
            define_macros=[("SHARDREC_SOURCE", f'"{key(source)}"')],
            # no FMA contraction: the same roundings as torch (the tests hold the twins equal bit for bit)
            # (no errno from sqrt: no libm to link)
            extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
        for module, source in LIBRARIES.items()
    ]
)
