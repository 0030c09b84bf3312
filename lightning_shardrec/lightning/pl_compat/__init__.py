"""The private Lightning names the Lightning layer needs, each with what it is, since when, and the fallback.

Inside the Lightning layer, so nothing below it imports Lightning; may import ``lightning`` and the
layers below the Lightning layer, never another room of it.

Checked against Lightning 2.5 and 2.6 (the declared range). Every use here acts on one
trainer's own objects, from the strategy's setup to its teardown; importing this module
changes nothing. Where a name is missing the feature it serves degrades as stated, or the
caller gets a clear error; nothing here raises ``AttributeError`` from Lightning's internals.

Not here, because they are members of the class the strategy extends rather than names it
imports: ``DDPStrategy._timeout``, ``_ddp_kwargs``, ``_get_process_group_backend()`` and
``_register_ddp_hooks()`` (2.0 to 2.6), used by ``lightning/strategies/strategy.py`` as Lightning's own
subclasses use them. No fallback: a release that renames them fails the strategy's tests at setup.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch import LightningModule

try:
    # ``_PrefetchDataFetcher`` / ``_DataFetcher``: the fit loop's batch fetcher (``lightning.pytorch.loops.fetchers``,
    # 2.0 to 2.6). ``ShardRecStrategy(pipeline=True)`` turns the running fit loop's fetcher into one that always
    # holds the next batch. Fallback when missing: the pipeline finds no fetcher to look ahead in and runs each
    # step's input distribution in the step (identical results, no overlap).
    from lightning.pytorch.loops.fetchers import _DataFetcher as DataFetcher
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher as PrefetchDataFetcher

    HAVE_FETCHERS = True
except ImportError:  # pragma: no cover - a Lightning outside the declared range

    class DataFetcher:  # type: ignore[no-redef]
        """Stand-in: never the type of a real fetcher, so nothing is adopted."""

    class PrefetchDataFetcher(DataFetcher):  # type: ignore[no-redef]
        """Stand-in: never the type of a real fetcher, so nothing is adopted."""

    HAVE_FETCHERS = False


def fit_data_fetcher(trainer: Any) -> Any:
    """``trainer.fit_loop._data_fetcher``: the running fit loop's fetcher (2.0 to 2.6; set in
    ``_FitLoop.setup_data``, dropped in its teardown). Fallback: None (no look-ahead, see above)."""
    return getattr(trainer.fit_loop, "_data_fetcher", None)


#: ``_TrainingEpochLoop._broadcast_sigterm_tensor``: the fit loop's per-batch broadcast of rank 0's SIGTERM
#: flag (2.4 to 2.6). :class:`~lightning_shardrec.lightning.failures.sigterm.LaggedSigterm` shadows it on one loop
#: instance while training. Fallback when missing: nothing is shadowed (Lightning's own check stays).
SIGTERM_LOOP_CHECK = "_broadcast_sigterm_tensor"


def signal_connector(trainer: Any) -> Any:
    """``trainer._signal_connector`` (2.0 to 2.6): registers the composed SIGTERM handler at fit start,
    restores the old handlers at teardown. Fallback: None (the handler list is left as Lightning made it)."""
    return getattr(trainer, "_signal_connector", None)


def sigterm_notifier(connector: Any) -> Any:
    """``_SignalConnector._sigterm_notifier_fn`` (2.0 to 2.6): the handler in the composed SIGTERM list that
    marks the trainer, kills launched ranks and (2.4+) broadcasts on the default group. Fallback: None."""
    return getattr(connector, "_sigterm_notifier_fn", None)


def attached_trainer(module: LightningModule | None) -> Any:
    """``LightningModule._trainer`` (1.x to 2.6): the module's Trainer, or None when detached (the public
    ``module.trainer`` raises then). Fallback: the public property, None when it raises."""
    if module is None:
        return None
    if "_trainer" in vars(module):
        return vars(module)["_trainer"]
    try:
        return module.trainer
    except RuntimeError:
        return None


def load_state(cls: type[LightningModule], checkpoint: dict[str, Any], strict: bool | None, **kwargs: Any) -> Any:
    """Lightning's private ``_load_state`` (module ``lightning.pytorch.core.saving``, 1.x to 2.6): the second half
    of ``load_from_checkpoint`` (the module built from the checkpoint's hyperparameters, ``on_load_checkpoint``,
    ``load_state_dict``).

    Fallback when missing: the module built from the saved hyperparameters the ``__init__`` accepts
    (``kwargs`` win), then ``on_load_checkpoint`` and ``load_state_dict``.
    """
    try:
        from lightning.pytorch.core.saving import _load_state
    except ImportError:  # pragma: no cover - a Lightning outside the declared range
        return _load_state_fallback(cls, checkpoint, strict, **kwargs)
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def _load_state_fallback(
    cls: type[LightningModule], checkpoint: dict[str, Any], strict: bool | None, **kwargs: Any
) -> LightningModule:
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    saved = dict(checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}))
    args = {k: v for k, v in {**saved, **kwargs}.items() if accepts_any or k in params}
    model = cls(**args)
    model.on_load_checkpoint(checkpoint)
    model.load_state_dict(checkpoint["state_dict"], strict=True if strict is None else strict)
    return model


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """What Lightning's private ``_optimizers_to_device`` (``lightning.fabric.utilities.optimizer``, 2.0 to 2.6)
    does, written on public names: every optimizer's state tensors moved to ``device``, ``"step"`` left where it
    is (torch keeps it on the CPU for most optimizers). No fallback needed: nothing private is used."""
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            if not isinstance(state, MutableMapping):
                optimizer.state[param] = move_data_to_device(state, device)
                continue
            for key, value in state.items():
                if key != "step":
                    state[key] = move_data_to_device(value, device)


def summarize_through(trainer: Any, build: Callable[[LightningModule, int], Any]) -> None:
    """The trainer's summary callbacks summarize through ``build(module, max_depth)`` (undo: :func:`summarize_plain`).

    ``ModelSummary._summary(trainer, pl_module)`` (``lightning.pytorch.callbacks``, 2.0 to 2.6; ``RichModelSummary``
    inherits it): the method its ``on_fit_start`` calls for the summary it prints, shadowed on the callback instance;
    ``ModelSummary._max_depth`` (2.0 to 2.6) its depth. Fallback when missing: nothing is shadowed (the summary counts
    only the parameters a rank holds: the sharded tables as 0).
    """
    from lightning.pytorch.callbacks import ModelSummary

    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummary) and callable(getattr(type(callback), "_summary", None)):
            depth = int(getattr(callback, "_max_depth", 1))
            # shadowed on the instance: the class's method stays Lightning's
            callback._summary = lambda _trainer, module, depth=depth: build(module, depth)  # type: ignore[method-assign,misc]


def summarize_plain(trainer: Any) -> None:
    """Undo :func:`summarize_through` (the callbacks' own ``_summary`` again); ``trainer`` may be None."""
    for callback in [] if trainer is None else trainer.callbacks:
        vars(callback).pop("_summary", None)


def _fabric_setup_takes_scheduler() -> bool:
    from lightning.fabric.strategies import Strategy

    return "scheduler" in inspect.signature(Strategy.setup_module_and_optimizers).parameters


#: Public, but its shape moved: Lightning 2.6's ``Fabric.setup`` passes an LR scheduler through
#: ``Strategy.setup_module_and_optimizers(module, optimizers, scheduler)`` and unpacks three values back;
#: Lightning 2.5 passes ``(module, optimizers)`` and unpacks two. ``ShardRecFabricStrategy`` answers in the
#: shape of the Lightning it runs under.
FABRIC_SETUP_TAKES_SCHEDULER = _fabric_setup_takes_scheduler()


__all__ = [
    "FABRIC_SETUP_TAKES_SCHEDULER",
    "HAVE_FETCHERS",
    "SIGTERM_LOOP_CHECK",
    "DataFetcher",
    "PrefetchDataFetcher",
    "attached_trainer",
    "fit_data_fetcher",
    "load_state",
    "optimizers_to_device",
    "summarize_plain",
    "summarize_through",
    "sigterm_notifier",
    "signal_connector",
]
