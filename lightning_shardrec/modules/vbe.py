"""Variable batch per feature (TorchRec's "VBE") in the embedding collections.

A VBE KJT gives each feature its own number of bags ``s_f`` (``stride_per_key()``),
e.g. one user row per request next to many item rows, and ``inverse_indices =
(keys, [K, B] tensor)`` maps each of the ``B`` samples to its feature's bag::

    keys ["user", "item"], stride_per_key [1, 3], inverse_indices [[0, 0, 0], [0, 1, 2]]
    -> pooled "user" row 0 serves all 3 samples

* :func:`inverse_rows`: the inverse row of each collection slot (by input feature name).
* :func:`expand_vbe`: the fixed-batch KJT whose sample ``b`` of feature ``f`` is bag
  ``inverse[f][b]``; pooling it equals pooling the VBE KJT and expanding the rows.
* :func:`pad_vbe`: a fixed batch of ``max(s_f)`` bags per feature (empty bags appended),
  for sequence lookups whose outputs keep each feature's own ``s_f`` bags.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardrec.sparse import KeyedJaggedTensor


def inverse_rows(features: KeyedJaggedTensor, sources: list[str], owner: str) -> Tensor:
    """``[len(sources), B]`` long: the inverse-index row of each slot's input feature."""
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(
            f"{owner} got a variable-batch KeyedJaggedTensor (stride_per_key {features.stride_per_key()} for keys "
            f"{features.keys()}) without inverse_indices; pass inverse_indices=(keys, [len(keys), B] tensor) so "
            "pooled rows can be expanded to the batch"
        )
    keys, table = inverse
    index = {k: i for i, k in enumerate(keys)}
    missing = sorted({f for f in sources if f not in index})
    if missing:
        raise KeyError(f"{owner}: inverse_indices keys {list(keys)} lack features {missing}")
    rows = torch.tensor([index[f] for f in sources], dtype=torch.long, device=table.device)
    return table.index_select(0, rows).long()


def expand_vbe(kjt: KeyedJaggedTensor, rows: Tensor) -> KeyedJaggedTensor:
    """The fixed-batch KJT of ``B = rows.shape[1]`` samples: key ``k``'s bag ``b`` is bag ``rows[k, b]``.

    ``kjt`` is variable-batch with one inverse row per key (``rows`` from :func:`inverse_rows`).
    """
    spk = kjt.stride_per_key()
    num_keys, batch = rows.shape
    rows = rows.to(kjt.device())
    bad = [
        (k, int(rows[k].min()), int(rows[k].max()))
        for k in range(num_keys)
        if batch and (int(rows[k].min()) < 0 or int(rows[k].max()) >= spk[k])
    ]
    if bad:
        k, lo, hi = bad[0]
        raise ValueError(
            f"inverse_indices of feature '{kjt.keys()[k]}' span [{lo}, {hi}], outside its {spk[k]} bags [0, {spk[k]})"
        )
    starts = torch.tensor(kjt.lengths_offset_per_key()[:-1], dtype=torch.long, device=rows.device)
    bags = (rows + starts.unsqueeze(1)).reshape(-1)  # [K * B] source bag of each new bag
    lengths = kjt.lengths().long()
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
    offsets[1:] = torch.cumsum(lengths, 0)
    new_lengths = lengths.index_select(0, bags)
    total = int(new_lengths.sum())
    new_starts = torch.cumsum(new_lengths, 0) - new_lengths
    shift = torch.repeat_interleave(offsets.index_select(0, bags) - new_starts, new_lengths, output_size=total)
    index = torch.arange(total, device=lengths.device) + shift
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor._trusted(
        list(kjt.keys()),
        kjt.values().index_select(0, index),
        None if weights is None else weights.index_select(0, index),
        new_lengths.to(kjt.lengths().dtype),
        batch,
        new_lengths.view(num_keys, batch).sum(1).tolist() if num_keys else [],
    )


def pad_vbe(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A fixed batch of ``max(stride_per_key)`` bags per key: each key's bags, then empty ones."""
    spk = kjt.stride_per_key()
    batch = max(spk, default=0)
    lengths = kjt.lengths()
    padded = torch.zeros(len(spk) * batch, dtype=lengths.dtype, device=lengths.device)
    starts = kjt.lengths_offset_per_key()
    target = torch.cat(
        [torch.arange(k * batch, k * batch + s, device=lengths.device) for k, s in enumerate(spk)]
        or [torch.empty(0, dtype=torch.long, device=lengths.device)]
    )
    padded[target] = lengths[: starts[-1]]
    total = kjt.offset_per_key()[-1]
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor._trusted(
        list(kjt.keys()),
        kjt.values()[:total],
        None if weights is None else weights[:total],
        padded,
        batch,
        list(kjt.length_per_key()),
    )
