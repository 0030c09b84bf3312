"""Lightning habits that would silently diverge from one process under sharding: made exact or refused.

* Gradient clipping (:func:`fused_clip_value`, :func:`guard_clipping`): by value is applied per
  row inside the fused update (a table's dense gradient is the per-row sum of its ids'
  gradients, which the fused update clamps before its rule: exact); by norm defers the table
  updates to the optimizer step (:mod:`lightning_shardrec.lightning.training.deferred`); a norm clip the
  strategy was not told of at setup (the tables already updated) is refused.
* :class:`ShardedGuard`, installed on every sharded collection:

  - ``state_dict()`` of a sharded collection (so of the LightningModule) raises
    :class:`ShardedStateError`: it would hold one rank's shards under the unsharded names; except
    on rank 0 after a fit whose tables fit in its memory: the strategy gathered them there at the
    end of fit (:mod:`lightning_shardrec.lightning.checkpoints.after_fit`), and the state dict holds the full
    tables under the unsharded names (``torch.save(model.state_dict())`` on rank 0 works);
  - a forward outside ``trainer.fit/validate/test/predict`` raises :class:`CollectiveCallError`
    at once (it is collective: called on one rank it would hang or die in the transport),
    unless every rank enters :meth:`ShardedGuard.collective`;
  - every input distribution's header carries this rank's loop position (:meth:`tag`), and
    :meth:`check` stops every rank with :class:`UnevenBatchesError` at the last batch they
    share when their data ends at different batches, before any rank leaves the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.errors import CollectiveCallError, ShardedStateError, UnevenBatchesError

NORM_CLIPPING = (
    "ShardRecStrategy: clip_gradients(gradient_clip_algorithm='norm') was called in a fit whose table updates run "
    "inside backward (automatic optimization without accumulate_grad_batches, gradient_clip_val by norm or an "
    "overridden configure_gradient_clipping), so the fused embedding tables were updated before the norm over all "
    "parameters existed. Clip through Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm') or in "
    "configure_gradient_clipping: the strategy then defers the table updates to the optimizer step (exact)"
)


def fused_clip_value(trainer: Any) -> float | None:
    """The value the fused updates clamp each row's gradient to (None: no clipping by value).

    Norm clipping is not done here: it defers the table updates (:mod:`lightning_shardrec.lightning.training.deferred`).
    """
    value = trainer.gradient_clip_val
    algorithm = trainer.gradient_clip_algorithm
    if not value or algorithm is None or GradClipAlgorithmType(algorithm) is GradClipAlgorithmType.NORM:
        return None
    return float(value)


def guard_clipping(precision: Any, value: float | None) -> None:
    """Make ``precision.clip_gradients`` refuse what the fused tables cannot match (undo: :func:`unguard_clipping`).

    Used when the table updates run inside backward. Lightning's automatic clipping passes the
    Trainer's value, which the fused updates already apply; a different value or norm clipping
    (e.g. from ``on_before_optimizer_step``, after the tables were updated) raises.
    """
    original = type(precision).clip_gradients.__get__(precision)

    def clip_gradients(
        optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM
    ) -> None:
        if clip_val and clip_val > 0:
            if GradClipAlgorithmType(gradient_clip_algorithm) is GradClipAlgorithmType.NORM:
                raise ValueError(NORM_CLIPPING)
            if value is None or float(clip_val) != value:
                raise ValueError(
                    f"ShardRecStrategy: clip_gradients(gradient_clip_val={clip_val}) comes after backward, when the "
                    f"fused embedding tables have already been updated with gradients clipped at {value}; clip "
                    "through Trainer(gradient_clip_val=...) or in configure_gradient_clipping (the strategy then "
                    "clips the tables alike)"
                )
        original(optimizer, clip_val, gradient_clip_algorithm)

    precision.clip_gradients = clip_gradients


def unguard_clipping(precision: Any) -> None:
    precision.__dict__.pop("clip_gradients", None)


_PHASES = {1: "training", 2: "validation", 3: "test", 4: "predict"}


class ShardedGuard:
    """The checks on the sharded collections of one strategy (see the module docstring)."""

    width = 5  # (phase, epoch, batch, this rank's data ends here, training stops here anyway)

    def __init__(self, sharded: Mapping[str, ShardedCollection], trainer: Callable[[], Any]) -> None:
        self._trainer = trainer
        self._collective = 0
        self._allowed = 0
        self._handles: list[Any] = []
        self.full: dict[str, dict[str, Any]] = {}  # per collection path: its full tables (rank 0, after fit)
        self.full_refused = ""  # why they were not gathered (the arithmetic), for the error
        self.replicas: dict[str, Any] = {}  # per collection path: its forward over the full tables (rank 0)
        self._sharded = dict(sharded)
        for path, coll in sharded.items():
            if isinstance(coll.batch_tag, ShardedGuard):  # an earlier strategy's (a second Trainer): replaced
                coll.batch_tag.remove(sharded)
            self._handles.append(coll.register_forward_pre_hook(self._forward_hook(path)))
            self._handles.append(coll.register_state_dict_pre_hook(self._state_hook(path)))
            self._handles.append(coll.register_state_dict_post_hook(self._full_tables(path)))
            coll.batch_tag = self

    def remove(self, sharded: Mapping[str, ShardedCollection]) -> None:
        self.drop_full()  # a later Trainer's guard takes over: no forward over this guard's stale copy
        for h in self._handles:
            h.remove()
        self._handles = []
        for coll in sharded.values():
            coll.batch_tag = None

    # --- state_dict -----------------------------------------------------------------------------
    @contextmanager
    def allow_state_dict(self) -> Iterator[None]:
        """The strategy's own (shard-aware) reads of the module's state dict."""
        self._allowed += 1
        try:
            yield
        finally:
            self._allowed -= 1

    def _state_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            if not self._allowed and path not in self.full:
                held = self._why_not_full()
                raise ShardedStateError(
                    f"{type(module).__name__} '{path}'.state_dict(): the module is sharded, so its state dict would "
                    "hold only this rank's shards of the tables. Call trainer.strategy.full_state_dict() on every rank "
                    "(collective; the unsharded keys and full tables), or save with trainer.save_checkpoint(path) "
                    f"({held})"
                )

        return hook

    def _why_not_full(self) -> str:
        """Why rank 0 holds no full tables here (the arithmetic of the last fit, or how to get them)."""
        return self.full_refused or (
            "rank 0 holds the full tables after a fit when they fit in its memory: 64 MiB by default, "
            "more with ShardRecStrategy(full_tables_after_fit=True)"
        )

    def _full_tables(self, path: str) -> Callable[..., None]:
        """After fit on rank 0: the collection's entries replaced by its full tables, under the unsharded names."""

        def hook(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            full = self.full.get(path)
            if self._allowed or full is None:
                return
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
            state.update({prefix + name: t for name, t in full.items()})

        return hook

    def drop_full(self) -> None:
        """The tables change (a fit starts): the copy gathered after the last fit is stale."""
        self.full = {}
        for path in self.replicas:
            self._sharded[path].__dict__.pop("forward", None)
        self.replicas = {}

    def alone(self, path: str) -> bool:
        """Whether a call of collection ``path`` is rank 0's own, after fit (outside the loops, not collective)."""
        trainer = self._trainer()
        return path in self.replicas and not self._collective and (trainer is None or not _running(trainer))

    # --- forward --------------------------------------------------------------------------------
    @contextmanager
    def collective(self) -> Iterator[None]:
        """Call the sharded model outside the Trainer's loops: every rank must enter, and call it the same times."""
        self._collective += 1
        try:
            yield
        finally:
            self._collective -= 1

    def _forward_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._collective:
                return
            trainer = self._trainer()
            if (trainer is None or not _running(trainer)) and path not in self.replicas:
                raise CollectiveCallError(
                    f"{type(module).__name__} '{path}' was called outside trainer.fit/validate/test/predict. Its "
                    "forward is collective (every rank takes part in each call), so a call on one rank would hang or "
                    "fail in the transport. Use trainer.predict(model, loader) on every rank; or on every rank, "
                    "`with trainer.strategy.collective(): model(batch)`; or load trainer.strategy.full_state_dict() "
                    f"(every rank) into an unsharded model ({self._why_not_full()})"
                )

        return hook

    # --- the batch position in every input distribution header ------------------------------------
    def tag(self, ahead: bool = False, ended: bool = False) -> list[int]:
        """This rank's loop position: ``[phase, epoch, batch, data ends, training stops after it]``.

        "data ends": 1 after this batch, 2 before it (``ended``: the next batch, which this rank
        lacks, where the others prefetch theirs). ``ahead``: the position of the next batch.
        """
        trainer = self._trainer()
        if self._collective or trainer is None or not _running(trainer):
            return [0] * self.width
        if trainer.training:
            loop = trainer.fit_loop.epoch_loop
            module = trainer.lightning_module
            automatic = module is None or module.automatic_optimization
            stops = automatic and trainer.max_steps not in (-1, None) and trainer.global_step + 1 >= trainer.max_steps
            ends = 2 if ended else 0 if ahead else int(bool(loop.batch_progress.is_last_batch))
            return [1, trainer.current_epoch, loop.batch_idx + int(ahead), ends, int(stops and not ahead)]
        phase = 3 if trainer.testing else 4 if trainer.predicting else 2
        loop = _evaluation_loop(trainer)
        if loop is None:
            return [0] * self.width
        progress = loop.batch_progress
        return [phase, 0, progress.current.ready - 1, int(bool(progress.is_last_batch)), 0]

    def check(self, tags: list[list[int]], rank: int) -> None:
        """Raise on every rank when the ranks are at different batches or their data ends unevenly."""
        if all(t[0] == 0 for t in tags):
            return
        where = [_where(t) for t in tags]
        if len(set(where)) > 1:
            at = "; ".join(f"rank {r} at {w}" for r, w in enumerate(where))
            raise UnevenBatchesError(
                f"rank {rank}: the ranks reached one collective from different batches ({at}): their data loaders "
                "yield different numbers of batches. Every rank must run the same number of batches; stopping all ranks"
            )
        ends = [r for r, t in enumerate(tags) if t[3]]
        if ends and len(ends) < len(tags) and not any(t[4] for t in tags):
            more = [r for r in range(len(tags)) if r not in ends]
            phase, epoch, batch = tags[0][:3]
            count = batch + 1 if tags[ends[0]][3] == 1 else batch  # 2: the batch at `batch` is the one missing
            what = f"{count} batches" + (f" in epoch {epoch}" if phase == 1 else "")
            raise UnevenBatchesError(
                f"rank {rank}: uneven batch counts: the {_PHASES[phase]} data of ranks {ends} ends after {what}, "
                f"while ranks {more} have more (batch {count} is next). Every rank must run the same number of "
                "batches: deal each rank an equal count (drop or pad the remainder), or use a sized dataset and "
                "Lightning's DistributedSampler; stopping all ranks"
            )


def _evaluation_loop(trainer: Any) -> Any:
    """The loop running an evaluation or prediction, from the Trainer's public loops."""
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer.predicting:
        return trainer.predict_loop
    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        return trainer.fit_loop.epoch_loop.val_loop
    if fn == TrainerFn.TESTING:
        return trainer.test_loop
    return trainer.validate_loop if fn == TrainerFn.VALIDATING else None


def _running(trainer: Any) -> bool:
    from lightning.pytorch.trainer.states import TrainerStatus

    return trainer.state.status == TrainerStatus.RUNNING


def _where(tag: list[int]) -> str:
    phase, epoch, batch = tag[:3]
    if phase == 0:
        return "a call outside the loops"
    if phase == 1:
        return f"training batch {batch} of epoch {epoch}"
    return f"{_PHASES[phase]} batch {batch}"
