"""``shardrec``: LightningCLI with ``strategy="shardrec"`` by default.

::

    shardrec fit --config examples/dlrm/config.yaml
    shardrec validate --config examples/dlrm/config.yaml --ckpt_path=lightning_logs/version_0/checkpoints/last.ckpt
    python -m lightning_shardrec.cli fit --config examples/dlrm/config.yaml --trainer.accelerator=gpu \
        --trainer.devices=1

Importing this module imports :mod:`lightning_shardrec`, which registers the
``"shardrec"`` strategy alias, so YAML can say ``trainer.strategy: shardrec`` (or
``class_path: lightning_shardrec.ShardRecStrategy`` with ``init_args``). Model and
data are any LightningModule / LightningDataModule given by ``class_path``.

Loggers: unless the config names some (``trainer.logger``), a ``CSVLogger`` in
``trainer.default_root_dir``, plus a ``TensorBoardLogger`` when tensorboard is
installed. The ``curves`` section configures :class:`TrainingCurves` (PNG of loss,
AUROC and NE written at the end of ``fit``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
from jsonargparse.typing import get_registered_type, register_type
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from typing_extensions import override

import lightning_shardrec  # noqa: F401  (registers strategy="shardrec")
from lightning_shardrec.lightning.reports.curves import TrainingCurves
from lightning_shardrec.planner.plans.types import EmbeddingComputeKernel, ShardingType, parse_enum


def _register_plan_enums() -> None:
    """Parse ``ShardingType`` / ``EmbeddingComputeKernel`` from their values, as the Python API does.

    jsonargparse alone takes only member names (``ROW_WISE``), not the documented ``row_wise``,
    and its error does not list the values; this makes ``sharding_types: [row_wise]`` work in
    YAML and ``[diagonal]`` fail with "unknown sharding type 'diagonal'; available: ...".
    """
    for kind, what in ((ShardingType, "sharding type"), (EmbeddingComputeKernel, "compute kernel")):
        if get_registered_type(kind) is None:
            register_type(
                kind,
                serializer=lambda member: member.value,
                deserializer=lambda value, kind=kind, what=what: parse_enum(kind, value, what),
            )


_register_plan_enums()


def default_loggers(root_dir: str) -> list[Logger]:
    """CSV always; TensorBoard too when it is installed."""
    loggers: list[Logger] = [CSVLogger(root_dir, name="lightning_logs")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    loggers.append(TensorBoardLogger(root_dir, name="tensorboard"))
    return loggers


class ShardRecCLI(LightningCLI):
    """LightningCLI with the ``curves`` callback and the default loggers above."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(TrainingCurves, "curves")

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> L.Trainer:
        if config.get("logger") in (None, True):
            config = {**config, "logger": default_loggers(config.get("default_root_dir") or os.getcwd())}
        return super()._instantiate_trainer(config, callbacks)


DESCRIPTION = (
    "shardrec: Lightning's fit / validate / test / predict with strategy='shardrec' by default, "
    "and export, which writes a quantized serving artifact."
)
EPILOG = (
    "export: shardrec export --ckpt CKPT --out model.pt [--dtype int8|int4|fp16] [--model pkg.mod:Class] "
    "[--dense] [--format state|pt2|aoti]: a quantized serving artifact, loaded with "
    "lightning_shardrec.inference.load (state) or torch alone (pt2, aoti; see shardrec export --help)"
)


def run_cli(args: list[str] | None = None, run: bool = True) -> ShardRecCLI:
    """The CLI on ``args`` (default ``sys.argv[1:]``); ``run=False`` only parses and builds (no subcommand)."""
    return ShardRecCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"strategy": "shardrec"},
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION, "epilog": EPILOG},
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    """The ``shardrec`` console script: LightningCLI subcommands, plus ``shardrec export``."""
    given = sys.argv[1:] if args is None else args
    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script's path lacks the working directory:
        sys.path.insert(0, os.getcwd())  # a class_path of a module here imports, as under ``python -m``
    if given[:1] == ["export"]:  # quantized serving artifact: see lightning_shardrec.inference.export
        from lightning_shardrec.inference.export import main as export_main

        raise SystemExit(export_main(given[1:]))
    run_cli(args)  # None: LightningCLI reads sys.argv itself (and does not warn about both)


if __name__ == "__main__":
    main()
