"""Every private torch or Lightning name the package uses, one module per library.

``torch.py`` and ``lightning.py`` each list, per symbol, what it is, since which release it
exists in that form, and the fallback when a release lacks it: a new release is one file's
work. No other module of the package names a private torch or Lightning symbol.
"""
