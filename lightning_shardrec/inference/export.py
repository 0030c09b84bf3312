"""Export a trained model as a quantized serving artifact, and load it back.

::

    python -m lightning_shardrec.inference.export --ckpt last.ckpt --model my_pkg.models:Rec \\
        --dtype int8 --out model.pt [--model-kwargs '{"num_dense": 13}'] [--dense] \\
        [--format state|pt2|aoti] [--example my_pkg.models:example_inputs]

The artifact is one ``torch.save`` file of plain data, loadable with
``torch.load(path, weights_only=True)`` (no pickled code, no process group)::

    format          "lightning_shardrec.quantized"
    version         1
    factory         "my_pkg.models:Rec"    the model's class (or function), by import path
    factory_kwargs  {...}                   its keyword arguments (plain data)
    dtype           "int8" | "int4" | "fp16"
    dense           bool                    nn.Linear layers dynamically quantized (int8)
    collections     {path: {"is_weighted": bool, "tables": [{name, num_embeddings, embedding_dim,
                                                              feature_names, pooling, dynamic}]}}
    sequence_collections  {path: {"need_indices": bool, "tables": [{name, num_embeddings,
                                  embedding_dim, feature_names}]}}   (EmbeddingCollections)
    plain           [path]                  plain nn.Embedding/nn.EmbeddingBag modules, quantized
    state_dict      the quantized model's state dict (uint8 rows + fp16 scale/bias, fp32 dense;
                    a dynamic table's frozen id mapping, ``id_maps.<table>.ids/rows``)

``dynamic`` is ``None`` for a static table, else the table's ``DynamicConfig`` as a
dict of plain values; its raw int64 ids are served as in the float module's ``eval()``.

:func:`load` rebuilds the model from ``factory(**factory_kwargs)`` on the CPU, swaps
its collections for empty quantized ones built from ``collections``, quantizes the
dense layers when ``dense`` is set, and loads ``state_dict`` strictly. The model
code must be importable where the artifact is loaded; the weights need nothing else.

``--format pt2`` / ``aoti`` write a self-contained program instead (``torch.export.load`` /
AOTInductor's ``aoti_load_package``, no model code and no lightning_shardrec import): see
:mod:`lightning_shardrec.inference.program` and docs/serving.md.

Import the functions from this module (``from lightning_shardrec.inference.export
import export, load``): ``lightning_shardrec.inference.export`` names the module.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shardrec.configs import DynamicConfig, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from lightning_shardrec.errors import CheckpointError, unknown_name
from lightning_shardrec.inference.example_inputs import default_example, resolve_example
from lightning_shardrec.inference.lookup import QuantBackend
from lightning_shardrec.inference.program import export_program, metadata, save_program
from lightning_shardrec.inference.quant_embedding_bag_collection import QuantEmbeddingBagCollection, QuantTable
from lightning_shardrec.inference.quant_embedding_collection import QuantEmbeddingCollection
from lightning_shardrec.inference.quant_plain import QuantEmbedding, QuantEmbeddingBag, quantize_plain
from lightning_shardrec.inference.quantize import (
    collection_paths,
    quantize,
    quantize_dense,
    sequence_collection_paths,
    swap_collections,
)
from lightning_shardrec.inference.rowwise import QuantDType
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.modules.plain_embeddings import find_embedding_modules

FORMAT = "lightning_shardrec.quantized"
VERSION = 1
Factory = Callable[..., nn.Module]


FORMATS = ("state", "pt2", "aoti")  #: what export writes: plain data (needs the model code), two programs


def export(
    checkpoint_path: str | Path | None,
    model_factory_or_module: str | Factory | nn.Module | None,
    dtype: str | QuantDType,
    out: str | Path,
    *,
    factory_kwargs: Mapping[str, Any] | None = None,
    dense: bool = False,
    format: str = "state",
    example_inputs: Sequence[Any] | None = None,
    device: str = "cpu",
    submodule: str | None = None,
) -> nn.Module:
    """Quantize a trained model and write the serving artifact to ``out``; returns the quantized model.

    ``checkpoint_path``: a Lightning checkpoint (its ``state_dict`` is the full,
    unsharded one, also when the ``shardrec`` strategy wrote it) or a plain state
    dict; ``None`` exports ``model_factory_or_module`` as it is (a trained module).
    ``model_factory_or_module``: ``"pkg.module:Name"``, a top-level class/function,
    or a module instance (its class is recorded); ``None`` takes the class LightningCLI
    records in the checkpoint (``hyper_parameters["_class_path"]``). ``factory_kwargs``
    default to the checkpoint's ``hyper_parameters`` (minus LightningCLI's ``_``-keys),
    else a module's ``hparams``, else ``{}``.

    ``format``: ``"state"`` (the default: the file described above), ``"pt2"`` (a
    ``torch.export`` program, :mod:`~lightning_shardrec.inference.program`) or ``"aoti"`` (an
    AOTInductor package). Both trace the quantized model on ``example_inputs`` (its positional
    inputs; built for DLRM, DCNv2 and DLRMTask when ``None``), serve a dynamic batch size and id
    count, and load with torch alone. ``device`` (``"cpu"``, ``"cuda"``): where the program's
    weights and inputs live (an ``aoti`` package is compiled for it).

    ``submodule``: export one part of the trained model (e.g. ``"item_tower"`` for an item index):
    the checkpoint's entries under ``"<submodule>."``, the prefix removed, load into the model
    (``model_factory_or_module`` builds that part). ``None``: the whole checkpoint, or, when the
    model's keys are exactly those under one prefix of it, that prefix.
    """
    qdtype, fmt = QuantDType.parse(dtype), str(format).lower()
    if fmt not in FORMATS:
        raise unknown_name("export format", format, list(FORMATS))
    checkpoint = _read_checkpoint(checkpoint_path) if checkpoint_path is not None else {}
    if model_factory_or_module is None:
        model_factory_or_module = _class_path_of(checkpoint, checkpoint_path)
    target, factory = _factory_target(model_factory_or_module)
    if factory_kwargs is None:
        factory_kwargs = _default_kwargs(checkpoint, model_factory_or_module)
    kwargs = dict(factory_kwargs)
    _check_plain(kwargs, "factory_kwargs")
    given = isinstance(model_factory_or_module, nn.Module)
    model = model_factory_or_module if isinstance(model_factory_or_module, nn.Module) else factory(**kwargs)
    if checkpoint_path is not None:
        state = _part(checkpoint.get("state_dict", checkpoint), model, submodule, f"{str(checkpoint_path)!r}", target)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise CheckpointError(f"export: checkpoint {str(checkpoint_path)!r} does not fit {target}: {err}") from None
    if not (collection_paths(model) or sequence_collection_paths(model) or find_embedding_modules(model)):
        raise ValueError(
            f"export: {target} has no EmbeddingBagCollection, EmbeddingCollection, nn.Embedding or nn.EmbeddingBag "
            "to quantize"
        )
    model = quantize(model, qdtype, dense=dense, inplace=not given)
    collections = {path: _describe(model.get_submodule(path)) for path in collection_paths(model)}
    sequences = {path: _describe(model.get_submodule(path)) for path in sequence_collection_paths(model)}
    plain = [n for n, m in model.named_modules() if isinstance(m, (QuantEmbedding, QuantEmbeddingBag))]
    if fmt != "state":
        inputs = default_example(model, target) if example_inputs is None else tuple(example_inputs)
        program, specs = export_program(model, inputs, device=device)
        info = {"factory": target, "dtype": qdtype.value, "collections": collections, "plain": plain,
                "sequence_collections": sequences, "device": str(torch.device(device))}  # fmt: skip
        save_program(program, out, fmt, metadata(specs, info))
        return model
    artifact = {
        "format": FORMAT,
        "version": VERSION,
        "factory": target,
        "factory_kwargs": kwargs,
        "dtype": qdtype.value,
        "dense": dense,
        "collections": collections,
        "sequence_collections": sequences,
        "plain": plain,
        "state_dict": model.state_dict(),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(artifact, out)
    return model


def load(path: str | Path, *, backend: str | QuantBackend = QuantBackend.AUTO) -> nn.Module:
    """Rebuild the quantized model of an artifact written by :func:`export` (eval mode, CPU)."""
    artifact = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(artifact, dict) or artifact.get("format") != FORMAT:
        raise CheckpointError(f"load: {str(path)!r} is not a {FORMAT} artifact (written by inference.export)")
    if artifact.get("version") != VERSION:
        raise CheckpointError(
            f"load: {str(path)!r} has artifact version {artifact.get('version')!r}; this build reads {VERSION}"
        )
    dtype = QuantDType.parse(artifact["dtype"])
    factory = _resolve(artifact["factory"])
    model = factory(**artifact["factory_kwargs"])
    collections: dict[str, dict[str, Any]] = artifact["collections"]
    sequences: dict[str, dict[str, Any]] = artifact.get("sequence_collections", {})  # absent: written before ECs

    def spec(specs: Mapping[str, dict[str, Any]], path: str, kind: str, reads: list[str]) -> dict[str, Any]:
        """The artifact's entry for the collection at ``path``, which must read the same features."""
        if path not in specs:
            raise CheckpointError(
                f"load: {artifact['factory']} has {kind} at {path!r}; the artifact has {sorted(specs)}"
            )
        saved = [f for t in specs[path]["tables"] for f in t["feature_names"]]
        if saved != reads:
            raise CheckpointError(
                f"load: {kind} {path!r} of {artifact['factory']} reads {reads}, the artifact's reads {saved}"
            )
        return specs[path]

    def empty_quantized(path: str, ebc: EmbeddingBagCollection) -> nn.Module:
        entry = spec(collections, path, "an EmbeddingBagCollection", ebc.feature_names())
        tables = [_table(t) for t in entry["tables"]]
        return QuantEmbeddingBagCollection(tables, dtype, entry["is_weighted"], "cpu", backend=backend)

    def empty_sequence(path: str, ec: EmbeddingCollection) -> nn.Module:
        reads = [f for t in ec.embedding_configs() for f in t.feature_names]
        entry = spec(sequences, path, "an EmbeddingCollection", reads)
        tables = [EmbeddingConfig(**t) for t in entry["tables"]]
        return QuantEmbeddingCollection(tables, dtype, "cpu", entry["need_indices"])

    model = swap_collections(model, empty_quantized)
    model = swap_collections(model, empty_sequence, EmbeddingCollection)
    plain = artifact.get("plain", [])  # absent: written before plain modules were quantized
    quantize_plain(model, dtype, copy_weights=False, paths=plain)
    if artifact["dense"]:
        model = quantize_dense(model)
    model.load_state_dict(artifact["state_dict"], strict=True)
    return model.eval()


def _part(state: Mapping[str, Any], model: nn.Module, submodule: str | None, where: str, target: str) -> dict[str, Any]:
    """``state``'s entries under ``submodule.`` (prefix removed); without one, the prefix whose entries are
    exactly ``model``'s keys when the whole ``state`` is not (a sub-module exported: one tower)."""
    if submodule is not None:
        prefix = submodule.rstrip(".") + "."
        part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not part:
            tops = sorted({k.split(".")[0] for k in state})
            raise CheckpointError(f"export: checkpoint {where} has no entries under '{prefix}'; its top-level "
                                  f"modules: {tops}")  # fmt: skip
        return part
    wanted = set(model.state_dict())
    if set(state) == wanted or not wanted:
        return dict(state)
    prefixes = {k[: len(k) - len(w)] for k in state for w in wanted if k.endswith("." + w)}
    fits = sorted(p for p in prefixes if {k[len(p) :] for k in state if k.startswith(p)} == wanted)
    if len(fits) == 1:
        return {k[len(fits[0]) :]: v for k, v in state.items() if k.startswith(fits[0])}
    if fits or prefixes:
        raise CheckpointError(
            f"export: checkpoint {where} holds more than {target} (e.g. a whole model, {target} one part of it); "
            f"name the part with --submodule (shardrec export) or submodule= (export()): candidates "
            f"{sorted(p.rstrip('.') for p in (fits or prefixes))}"
        )
    return dict(state)


def _read_checkpoint(path: str | Path) -> dict[str, Any]:
    if Path(path).is_dir():  # a sharded (DCP) checkpoint: gather it into one file first
        import tempfile

        from lightning_shardrec.checkpoint import convert_to_full

        with tempfile.TemporaryDirectory() as tmp:
            full = Path(tmp) / "full.ckpt"
            convert_to_full(path, full)
            return _read_checkpoint(full)
    if not Path(path).is_file():
        raise FileNotFoundError(f"export: checkpoint {str(path)!r} does not exist")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"export: {str(path)!r} holds a {type(checkpoint).__name__}, not a state dict/checkpoint")
    return checkpoint


def _factory_target(obj: str | Factory | nn.Module) -> tuple[str, Factory]:
    """``"pkg.module:Name"`` for ``obj``, checked to import back to the same thing."""
    if isinstance(obj, str):
        return obj, _resolve(obj)
    factory = type(obj) if isinstance(obj, nn.Module) else obj
    target = f"{factory.__module__}:{factory.__qualname__}"
    try:
        same = _resolve(target) is factory
    except (ImportError, AttributeError, ValueError):
        same = False
    if not same:
        raise ValueError(
            f"export: {target} cannot be imported back by that name; define the model class (or a "
            "factory function) at the top level of an importable module, or pass 'pkg.module:Name'"
        )
    return target, factory


def _resolve(target: str) -> Factory:
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"model factory must look like 'pkg.module:Name', got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model factory {target!r} is a {type(obj).__name__}, not a class or function")
    return obj  # type: ignore[no-any-return]


def _class_path_of(checkpoint: Mapping[str, Any], path: str | Path | None) -> str:
    class_path = checkpoint.get("hyper_parameters", {}).get("_class_path")
    if not isinstance(class_path, str) or "." not in class_path:
        raise ValueError(
            f"export: checkpoint {str(path)!r} does not record the model class (no hyper_parameters['_class_path'], "
            "which LightningCLI writes); pass the model as 'pkg.module:Name' (--model)"
        )
    module, _, name = class_path.rpartition(".")
    return f"{module}:{name}"


def _default_kwargs(checkpoint: Mapping[str, Any], source: object) -> dict[str, Any]:
    if "hyper_parameters" in checkpoint:
        return {k: v for k, v in checkpoint["hyper_parameters"].items() if not str(k).startswith("_")}
    hparams = getattr(source, "hparams", None) if isinstance(source, nn.Module) else None
    return dict(hparams) if hparams else {}


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: object, where: str) -> None:
    """Factory kwargs must load under ``weights_only=True``: str/int/float/bool/None, lists, dicts."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(k, f"{where} key")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise ValueError(
        f"export: {where} is a {type(value).__name__}; the artifact keeps only plain data "
        "(str, int, float, bool, None, lists, dicts). Pass factory_kwargs that rebuild it, or a factory that does"
    )


def _describe(module: nn.Module) -> dict[str, Any]:
    """A quantized collection's artifact entry: its tables, and whether it is weighted / returns indices."""
    if isinstance(module, QuantEmbeddingCollection):
        return {"need_indices": module.need_indices(), "tables": [_table_spec(t) for t in module.embedding_configs()]}
    if not isinstance(module, QuantEmbeddingBagCollection):  # pragma: no cover - quantize() swapped them all
        raise TypeError(f"expected a quantized collection, got {type(module).__name__}")
    tables = [
        _table_spec(t) | {"pooling": t.pooling.value, "dynamic": _dynamic_spec(t.dynamic)}
        for t in module.embedding_bag_configs()
    ]
    return {"is_weighted": module.is_weighted(), "tables": tables}


def _table_spec(t: EmbeddingConfig | EmbeddingBagConfig) -> dict[str, Any]:
    return {"name": t.name, "num_embeddings": t.num_embeddings, "embedding_dim": t.embedding_dim,
            "feature_names": list(t.feature_names)}  # fmt: skip


def _dynamic_spec(config: DynamicConfig | None) -> dict[str, Any] | None:
    if config is None:
        return None
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} | {"eviction": config.eviction.value}


def _table(spec: Mapping[str, Any]) -> EmbeddingBagConfig:
    dynamic = spec.get("dynamic")  # absent in artifacts written before dynamic tables
    return EmbeddingBagConfig(
        num_embeddings=spec["num_embeddings"], embedding_dim=spec["embedding_dim"], name=spec["name"],
        feature_names=list(spec["feature_names"]), pooling=PoolingType(spec["pooling"]),
        dynamic=None if dynamic is None else DynamicConfig(**dynamic),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_shardrec.inference.export`` (and ``shardrec export``)."""
    parser = argparse.ArgumentParser(prog="shardrec export", description="Write a quantized serving artifact.")
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint or state dict (.ckpt/.pt)")
    parser.add_argument("--model", default=None, help="model class or factory, 'pkg.module:Name' (default: the "
                        "class LightningCLI recorded in the checkpoint)")
    parser.add_argument("--model-kwargs", default=None, help="JSON object of factory kwargs (default: the "
                        "checkpoint's hyper_parameters)")
    parser.add_argument("--dtype", default="int8", help=f"one of {', '.join(m.value for m in QuantDType)}")
    parser.add_argument("--dense", action="store_true", help="also quantize nn.Linear layers (torch.ao dynamic int8)")
    parser.add_argument("--out", required=True, help="artifact path, e.g. model.pt (state) or model.pt2")
    parser.add_argument("--format", default="state", choices=FORMATS,
                        help="state: torch.save of plain data (loading needs the model code); pt2: torch.export "
                        "program; aoti: AOTInductor package (both load with torch alone)")
    parser.add_argument("--example", default=None, help="pt2/aoti: 'pkg.module:fn' returning the model's "
                        "positional inputs to trace on (default: built for DLRM, DCNv2, DLRMTask)")
    parser.add_argument("--device", default="cpu", help="pt2/aoti: device of the program, cpu or cuda")
    parser.add_argument("--submodule", default=None, help="export one part of the checkpoint's model, e.g. "
                        "'item_tower' (its entries, prefix removed; --model builds that part)")
    args = parser.parse_args(argv)
    try:
        kwargs = None if args.model_kwargs is None else json.loads(args.model_kwargs)
        example = None if args.example is None else resolve_example(args.example)
        model = export(args.ckpt, args.model, args.dtype, args.out, factory_kwargs=kwargs, dense=args.dense,
                       format=args.format, example_inputs=example, device=args.device, submodule=args.submodule)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        parser.error(str(err))
    size = Path(args.out).stat().st_size
    n = sum(m.nbytes() for m in model.modules() if isinstance(m, (QuantEmbeddingBagCollection, QuantTable)))
    print(f"wrote {args.out} ({args.format}): {size / 2**20:.2f} MiB ({args.dtype} tables {n / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
