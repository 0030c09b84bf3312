"""``str()`` of the sparse types in TorchRec's layout (a JSON-like dict of bags).

::

    KeyedJaggedTensor({
        "product": [[1, 2], [], [3]],
        "user": {
            "values": [[4], [5], [6]],
            "weights": [[1.0], [0.5], [2.0]]
        }
    })

Each value prints as ``str(x.item())``; ``[N, D]`` values print one list per row; values
of more dimensions raise ``ValueError`` (as TorchRec). ``repr()`` stays the compact
debugging form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from lightning_shardrec.sparse.jagged_tensor import JaggedTensor
    from lightning_shardrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
    from lightning_shardrec.sparse.keyed_tensor import KeyedTensor


def _row(values: Tensor) -> str:
    """``[a, b, c]`` of a 1-D tensor, each element as Python prints its ``item()``."""
    return "[" + ", ".join(str(x) for x in values.tolist()) + "]"


def values_string(values: Tensor) -> str:
    """One bag: ``[1.0, 2.0]`` (``[N]``) or ``[[1.0, 2.0], [3.0, 4.0]]`` (``[N, D]``)."""
    if values.dim() == 1:
        return _row(values)
    if values.dim() == 2:
        return "[" + ", ".join(_row(v) for v in values) + "]"
    raise ValueError(f"cannot print values of {values.dim()} dimensions (shape {tuple(values.shape)}); at most 2")


def bags_string(values: Tensor, offsets: list[int], first: int, last: int) -> str:
    """Bags ``first..last-1`` of ``values`` cut at ``offsets``."""
    return "[" + ", ".join(values_string(values[offsets[i] : offsets[i + 1]]) for i in range(first, last)) + "]"


def jagged_tensor_str(jt: JaggedTensor) -> str:
    offsets = jt.offsets().tolist()
    bags = max(len(offsets) - 1, 0)
    weights = jt.weights_or_none()
    if weights is None:
        return "JaggedTensor({\n    " + bags_string(jt.values(), offsets, 0, bags) + "\n})\n"
    return (
        'JaggedTensor({\n    "values": '
        + bags_string(jt.values(), offsets, 0, bags)
        + ',\n    "weights": '
        + bags_string(weights, offsets, 0, bags)
        + "\n})\n"
    )


def keyed_jagged_tensor_str(kjt: KeyedJaggedTensor) -> str:
    if not kjt.keys() or (kjt.lengths_or_none() is None and kjt.offsets_or_none() is None):
        return "KeyedJaggedTensor()\n"
    offsets = kjt.offsets().tolist()
    lopk = kjt.lengths_offset_per_key()
    weights = kjt.weights_or_none()
    parts = []
    for i, key in enumerate(kjt.keys()):  # noqa: SIM118 (a KJT, not a dict)
        bags = bags_string(kjt.values(), offsets, lopk[i], lopk[i + 1])
        if weights is None:
            parts.append(f'    "{key}": {bags}')
        else:
            wbags = bags_string(weights, offsets, lopk[i], lopk[i + 1])
            parts.append(f'    "{key}": {{\n        "values": {bags},\n        "weights": {wbags}\n    }}')
    return "KeyedJaggedTensor({\n" + ",\n".join(parts) + "\n})\n"


def keyed_tensor_str(kt: KeyedTensor) -> str:
    if not kt.keys():
        return "KeyedTensor()\n"
    parts = [f'    "{key}": ' + "[" + ", ".join(values_string(v) for v in kt[key]) + "]" for key in kt.keys()]  # noqa: SIM118
    return "KeyedTensor({\n" + ",\n".join(parts) + "\n})\n"


def keyed_jagged_tensor_repr(kjt: KeyedJaggedTensor) -> str:
    """Compact debugging form: stride, keys and each key's bags (elided when large)."""
    keys = kjt.keys()
    if not keys:
        return f"KeyedJaggedTensor(keys=[], stride={kjt.stride()})"
    lines = [f"KeyedJaggedTensor(stride={kjt.stride()}, keys={keys})"]
    if kjt.values().device.type == "meta":  # no data to show
        lines.append(f"  values={kjt.values()}, lengths={kjt.lengths()}")
        return "\n".join(lines)
    for k in keys:
        jt = kjt[k]
        w = f", weights={jt.weights().tolist()}" if kjt.weights_or_none() is not None else ""
        bags = [b.tolist() for b in jt.to_dense()] if jt.values().numel() <= 64 else "..."
        lines.append(f"  '{k}': {bags}{w}")
    return "\n".join(lines)
