"""The flat-buffer path of an optimiser's step (:mod:`npformer.nn.flat`), apart from the update rules.

When the parameters live in flat buffers and their grads in the flat gradient buffers, a step updates
each *run*, parameters next to each other in a buffer with the same hyperparameters, weight decay and
step count (for a flattened model usually two a dtype: the decayed parameters and the others), with
one call of the update op over the run, on flat moment buffers of the same layout. :class:`FlatRuns`
finds the runs and keeps the moment buffers, each parameter's state arrays being views of them (so
``state_dict`` is the same either way). The optimisers (:mod:`npformer.training.optim`) read like
their algorithm boxes; this is the speed machinery beside them, off inside ``npformer.kernels.disabled()``,
where the per-parameter loop runs (the same numbers: the update is element-wise).
"""
from __future__ import annotations

from npformer.backend import get_array_module

__all__ = ["FlatRuns"]


class FlatRuns:
    """The runs of a step and the flat moment buffers of one optimiser."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple] = {}    # id(FlatBuffer) -> (buffer, first element, {moment: array})
        self.views: dict[int, tuple] = {}      # parameter index -> (its slot, {moment: view})

    def runs(self, todo: list, state: dict, run_key) -> list | None:
        """[(buffer, start, end, [(i, group, p)])] for ``todo`` [(i, group, _, p)]: maximal runs of
        adjacent slots with one group and one ``run_key(p, state[i], group)``; None when a parameter to
        update is not in a flat buffer or its grad is not its slot's view of the flat gradient buffer."""
        entries, order = [], {}
        for i, group, _, p in todo:
            slot = p.flat
            if slot is None or p.grad is not slot.grad:      # the gradient lives elsewhere
                return None
            order.setdefault(id(slot.buffer), len(order))
            entries.append((order[id(slot.buffer)], slot.start, i, group, p))
        runs: list = []
        last_key = None
        for _, _, i, group, p in sorted(entries, key=lambda e: e[:2]):
            slot = p.flat
            key = (id(group), run_key(p, state.get(i, {}), group))
            if runs and runs[-1][0] is slot.buffer and runs[-1][2] == slot.start and key == last_key:
                buffer, start, _, items = runs[-1]
                runs[-1] = (buffer, start, slot.end, items)
                items.append((i, group, p))
            else:
                runs.append((slot.buffer, slot.start, slot.end, [(i, group, p)]))
            last_key = key
        return runs

    def moments(self, optimizer, buffer, start: int, end: int, items: list, names: tuple) -> dict:
        """{moment: its flat array's elements [start, end)}, after making each parameter's state
        arrays in ``names`` (in ``optimizer.state``) views of the flat moment buffers (copying in what
        they held: a fresh state or a loaded state dict; a missing one starts at zeros)."""
        entry = self.buffers.get(id(buffer))
        if entry is None or any(n not in entry[2] for n in names):
            ids = {id(q) for *_, q in optimizer._indexed()}
            for key, (old, _, _) in list(self.buffers.items()):      # buffers left behind (Module.to)
                if not any(q.flat is slot for q, slot in zip(old.params, old.slots)):
                    del self.buffers[key]
            mine = [slot for q, slot in zip(buffer.params, buffer.slots) if id(q) in ids]
            lo, hi = min(slot.start for slot in mine), max(slot.end for slot in mine)
            xp = get_array_module(buffer.data)
            arrays = dict(entry[2]) if entry is not None else {}
            arrays.update({n: xp.zeros(hi - lo, dtype=buffer.dtype) for n in names if n not in arrays})  # (hi-lo,)
            entry = self.buffers[id(buffer)] = (buffer, lo, arrays)
        _, lo, arrays = entry
        for i, _, p in items:
            slot, state = p.flat, optimizer.state.setdefault(i, {})
            cached = self.views.get(i)
            if cached is None or cached[0] is not slot or any(n not in cached[1] for n in names):
                cached = self.views[i] = (slot, {n: arrays[n][slot.start - lo:slot.stop - lo].reshape(p.shape)
                                                  for n in arrays})
            for n in names:
                view = cached[1][n]
                if state.get(n) is not view:
                    if n in state:
                        view[...] = state[n]
                    else:
                        view.fill(0)
                    state[n] = view
        return {n: arrays[n][start - lo:end - lo] for n in names}
