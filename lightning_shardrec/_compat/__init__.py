"""Where the library touches the private names of the libraries it stands on, and nowhere else.

torch and Lightning change their private modules between minor releases; a use scattered through
the package breaks it at the next release in places nobody looks. Every private name the package
needs lives here, one module per library (:mod:`.torch` here; Lightning's in the Lightning layer,
:mod:`lightning_shardrec.lightning.pl_compat`), each with
what it is, since which release it exists in that form, and what happens where it is missing
(a public fallback, or a clear error naming the feature). Everything else in the package uses
public APIs or these wrappers; ``tests/test_private_symbols.py`` parses every module and fails
when a private torch or Lightning name appears outside these two, so supporting the next
release is this package's work only.

Importing it is cheap: only modules ``import torch`` has already loaded are imported at the top;
the heavy ones (``torch.distributed._shard``, ``torch._inductor``) load on first use.
"""
