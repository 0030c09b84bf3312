"""``ShardRecStrategy(pipeline=True)``: batch ``i + 1``'s input distribution behind batch ``i``'s compute.

TorchRec's ``TrainPipelineSparseDist`` without a user-written loop. Per training step
``i`` (the user's ``training_step`` is unchanged)::

    strategy.training_step      peek batch i+1 in the fit loop's fetcher, move it to the device
                                (side stream on CUDA), prefetch its KJT on every sharded collection
                                whose features it holds: routing + async header all-to-all
    user forward (batch i)      the collections find batch i's handle (started at step i-1): wait, no
                                input dist; the header of i+1 travels meanwhile
    strategy.pre_backward       progress: header of i+1 read, its id all-to-alls issued (async) ...
    backward + optimizer step   ... and hidden behind them
    fit loop: batch_to_device   returns the batch already moved at step i (the same KJT object)

Only communication is cached; the batch itself flows through Lightning's loop, so
validation in between, the last (partial) batch, ``max_steps`` and resume behave as
without the pipeline. Lightning's fetcher does not look ahead when the loader has a
length, so the fit loop's fetcher is made to (:class:`LookaheadFetcher`, on that trainer's
fetcher only, from the first training step until training ends, when its class is Lightning's
again); the checkpointed loader state is the one from before the look-ahead batch was pulled.

Rank agreement: prefetching and matching depend only on the batch structure and on
object identity, which every rank shares when every rank runs the same code. A
``training_step`` that hands a collection a new KJT (a copy, a permutation) just
misses the prefetched one; it is drained and the step redoes the input distribution.
Ids are routed one step early: a ``training_step`` that edits its batch's KJT in place
(after the prefetch) would train on the ids as they were, so the collection compares the KJT's
tensors and their in-place versions with those it sent and raises
:class:`~lightning_shardrec.errors.PrefetchedBatchEditedError` naming the way out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_shardrec.distributed.comm.collectives import ShardingEnv, on_stream
from lightning_shardrec.distributed.sharded.batch_dist import EndOfData, PrefetchHandle
from lightning_shardrec.distributed.sharded.collection import ShardedCollection
from lightning_shardrec.lightning.pl_compat import DataFetcher, PrefetchDataFetcher, fit_data_fetcher
from lightning_shardrec.lightning.training.handover import hand_over, tensors_in
from lightning_shardrec.sparse import KeyedJaggedTensor


class LookaheadFetcher(PrefetchDataFetcher):
    """Lightning's training fetcher, always holding the next batch (also for loaders with a length).

    ``done`` is true exactly when no batch is left after the one just returned.
    ``loader_states`` are the stateful loaders' states from before the held batch was
    pulled: what a checkpoint must record so that resume neither skips nor repeats it.
    """

    loader_states: list[dict[str, Any]] | None = None
    #: the class Lightning made the fetcher with (restored by :meth:`release`)
    original: type[PrefetchDataFetcher] = PrefetchDataFetcher

    @classmethod
    def adopt(cls, fetcher: PrefetchDataFetcher) -> LookaheadFetcher:
        """Turn Lightning's fetcher (which the running epoch loop holds) into one, in place (:meth:`release` undoes)."""
        original = type(fetcher)
        fetcher.__class__ = cls
        assert isinstance(fetcher, LookaheadFetcher)
        fetcher.original = original
        if fetcher.iterator is not None and not fetcher.done:
            fetcher._fill()
        return fetcher

    def release(self) -> None:
        """Lightning's class again (end of training); a held batch stays where Lightning's fetcher keeps it."""
        original = self.original
        vars(self).pop("original", None)
        vars(self).pop("loader_states", None)
        self.__class__ = original  # type: ignore[assignment]

    def __iter__(self) -> LookaheadFetcher:
        DataFetcher.__iter__(self)  # a new iterator; reset() empties ``batches``
        self._fill()
        return self

    def __next__(self) -> Any:
        if not self.batches:
            self.done = True
            raise StopIteration
        batch = self.batches.pop(0)
        self._fill()
        return batch

    def _fill(self) -> None:
        if self.batches:
            return
        self.loader_states = loader_states(self.combined_loader)
        with contextlib.suppress(StopIteration):
            self.batches.append(DataFetcher.__next__(self))
        self.done = not self.batches

    def peek(self) -> Any:
        """The batch the next ``next()`` returns (None at the end of the epoch)."""
        return self.batches[0][0] if self.batches else None


@dataclass
class PipelineStats:
    """How many prefetched input distributions a forward used (hits) or had to redo (misses)."""

    prefetched: int = 0
    hits: int = 0
    misses: int = 0


class TrainPipeline:
    """The strategy's pipeline state: collections, the pre-moved next batch, handles in flight."""

    def __init__(
        self, sharded: dict[str, ShardedCollection], env: ShardingEnv, device: torch.device, by_default: bool = False
    ) -> None:
        self.sharded, self.env = sharded, env
        #: on by default (not asked for): a collection whose forward missed its prefetch is not prefetched again
        self.by_default = by_default
        self._missed: set[int] = set()  # id() of those collections
        for c in sharded.values():
            c.enable_prefetch(env)
        self.stats = PipelineStats()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: tuple[Any, Any] | None = None  # (batch as fetched, batch on the device)
        self._current: list[tuple[ShardedCollection, PrefetchHandle]] = []  # for the batch being trained
        self._ahead: list[tuple[ShardedCollection, PrefetchHandle]] = []  # for the next batch
        self._warned = False
        self._fetcher: Any = None  # the fit loop's (a LookaheadFetcher while training), kept past its teardown
        self._loader_states: list[dict[str, Any]] | None = None  # its last, once training ended
        self._ended: list[EndOfData] = []  # this rank's "no next batch" headers, checked after backward
        self._closed = False

    # --- per step -------------------------------------------------------------------------------
    def before_step(self, trainer: Any, move: Any) -> None:
        """Called at the start of ``training_step``: prefetch the batch after this one."""
        self._retire(self._current)  # started for the previous batch: its forward had its chance
        self._current, self._ahead = self._ahead, []
        for _, handle in self._current:  # a rank without this batch said so in its header (UnevenBatchesError)
            if handle.failure is not None:
                raise handle.failure
        fetcher = _lookahead(trainer)
        self._fetcher = fetcher or self._fetcher
        nxt = None if fetcher is None else fetcher.peek()
        if trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps:
            return  # end of training on every rank: nothing to overlap with
        if fetcher is None:
            return  # the user fetches the batches (dataloader_iter): nothing to look ahead at
        if nxt is None:  # end of this rank's epoch: where other ranks prefetch a next batch, tell them there is none
            self._ended = [e for e in (c.announce_end() for c in self.sharded.values()) if e is not None]
            return
        with on_stream(self._stream):
            moved = move(nxt)
            kjts = [t for t in tensors_in(moved) if isinstance(t, KeyedJaggedTensor)]  # also in custom batch types
            for coll in self.sharded.values():
                kjt = None if id(coll) in self._missed else _input_of(coll, kjts)
                if kjt is not None:
                    self._ahead.append((coll, coll.prefetch(kjt)))
        self.stats.prefetched += len(self._ahead)
        self._next = (nxt, moved)

    def moved(self, batch: Any) -> Any | None:
        """The device copy made by :meth:`before_step` when ``batch`` is the batch it peeked at."""
        if self._next is None or self._next[0] is not batch:
            return None
        moved, self._next = self._next[1], None
        if self._stream is not None:
            hand_over(moved, self._stream)  # every tensor of the batch, custom batch types included
        return moved

    def after_backward(self) -> None:
        """This rank's data ended at this batch: raise here (its collectives done) unless every rank's did."""
        ended, self._ended = self._ended, []
        for e in ended:
            e.wait()

    def progress(self) -> None:
        """Before backward: issue the next batch's id all-to-alls (every collection, fixed order)."""
        for coll in self.sharded.values():
            coll.progress_prefetched()

    def drain(self) -> None:
        """End of training: finish and drop whatever was started and not consumed (every rank); the fit loop's
        fetcher is Lightning's again (:meth:`LookaheadFetcher.release`)."""
        if isinstance(self._fetcher, LookaheadFetcher):
            self._loader_states = self._fetcher.loader_states  # what a checkpoint saved after fit records
            self._fetcher.release()
        self._retire(self._current)  # the last step's: consumed unless its forward missed them
        self._current, self._ahead, self._next = [], [], None  # the next batch's: never trained, not a miss
        for coll in self.sharded.values():
            coll.drop_prefetched()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """After training (every rank): drain, turn prefetch off on the collections and close the prefetch
        group's shared-memory transport; the group can then be destroyed. A closed pipeline still patches
        checkpoints (:meth:`patch_loader_states`)."""
        self.drain()
        for coll in self.sharded.values():
            coll.disable_prefetch()
        if self.env.transport is not None:
            self.env.transport.close()
        self._closed = True

    def _retire(self, started: list[tuple[ShardedCollection, PrefetchHandle]]) -> None:
        for coll, handle in started:
            if coll.is_prefetched(handle):
                self.stats.misses += 1
                coll.drop_prefetched(handle)
                if self.by_default:  # every rank alike: a miss depends on the code, not the data
                    self._missed.add(id(coll))
                    rank_zero_info(
                        f"ShardRecStrategy: {type(coll).__name__} over {coll.feature_names()} is not called with the "
                        "batch's own KeyedJaggedTensor (training_step builds or copies one), so its input "
                        "distribution runs inside the step from now on (no overlap; pipeline=False says so up front)."
                    )
                elif not self._warned:
                    self._warned = True
                    rank_zero_warn(
                        f"ShardRecStrategy(pipeline=True): {type(coll).__name__} was not called with the prefetched "
                        "KeyedJaggedTensor of the batch (training_step passed a copy?); that step redid the input "
                        "distribution. Pass the batch's KJT itself to overlap its communication."
                    )
            else:
                self.stats.hits += 1

    def patch_loader_states(self, checkpoint: dict[str, Any]) -> None:
        """Record the loader states from before the look-ahead batch was pulled (in place)."""
        fetcher = self._fetcher
        states = fetcher.loader_states if isinstance(fetcher, LookaheadFetcher) else self._loader_states
        state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
        if states is not None and state is not None and "combined_loader" in state:
            state["combined_loader"] = states


def loader_states(combined_loader: Any) -> list[dict[str, Any]]:
    """The states of the stateful loaders of a ``CombinedLoader`` (``flattened``), in order, as
    Lightning's fit loop records them in a checkpoint (``CombinedLoader._state_dicts``)."""
    return [
        loader.state_dict()
        for loader in combined_loader.flattened
        if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    ]


def _lookahead(trainer: Any) -> LookaheadFetcher | None:
    fetcher = fit_data_fetcher(trainer)
    if isinstance(fetcher, LookaheadFetcher):
        return fetcher
    if type(fetcher) is PrefetchDataFetcher:  # not dataloader_iter: the user fetches the batches then
        return LookaheadFetcher.adopt(fetcher)
    return None


def _input_of(coll: ShardedCollection, kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor | None:
    """The one KJT of the batch that holds all of ``coll``'s features (None: none, or ambiguous)."""
    need = set(coll.feature_names())
    found = [k for k in kjts if need <= set(k.keys())]
    return found[0] if len(found) == 1 else None


def prefetch_line(sharded: dict[str, ShardedCollection], default: bool = False) -> str:
    """What ``pipeline=True`` prefetches for this model (the fit-start line): the collections fed a KJT of the
    batch; plain ``nn.Embedding``/``nn.EmbeddingBag`` modules build theirs in forward, so theirs is not."""
    plain = sorted(n for n, m in sharded.items() if hasattr(m, "spec"))
    kjt = sorted(n for n in sharded if n not in plain)
    parts = []
    if kjt:
        parts.append(f"the next batch's input distribution is prefetched for {kjt} (the KJTs in the batch)")
    if plain:
        parts.append(
            f"plain modules {plain} build their KJT from their call's ids inside forward, so their input "
            "distribution runs in the step as without the pipeline (same results, no overlap)"
        )
    head = (
        "ShardRecStrategy: pipeline on (the default on 2+ ranks; pipeline=False turns it off): "
        if default
        else "ShardRecStrategy(pipeline=True): "
    )
    return head + "; ".join(parts)
