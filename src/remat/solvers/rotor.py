"""Rotor: the optimal persistent checkpointing schedule of a chain (Beaumont et al., 2019), with
selective regions.

``C[s, t, m]`` is the least forward time to run stages s..t forward and then backward, given their
input and the gradient of stage t's output in memory and ``m`` memory slots above that.  Three
choices at each step:

* keep everything of stage s (``xbar``), then solve s+1..t with what is left, then run B_s;
* checkpoint a segment s..k-1: run it keeping only its output, solve k..t, then free the output
  and solve s..k-1 again (a nested region whose own structure is that sub-solution, without
  selective regions: see solve_table);
* checkpoint s..k-1 keeping its expensive ops' outputs (SAVE_COMPUTE, torch's selective
  checkpointing): its forward also keeps those (``keep_bytes``), k..t is solved with them held, and its
  recomputation runs s..k-1 with everything kept, at the cost of the cheap ops only.

A selective region inside a plain one holds its keeps from the outer forward on (model.py), which
the recursion cannot charge: the plan space leaves such nestings out, and ``solve_table`` then
fills a second, plain table for the recomputations (``nested=False``).  ``rotor_plan`` first solves
one table that admits them (undercharged); its optimum is the restricted space's whenever it nests
none, and only otherwise are the two tables filled.

The table is filled by increasing chain length, vectorized over the start stage, the split point
and the memory slots (torch tensors, CPU).  A separate pass rebuilds the nested regions.  Memory is
discretized into slots with sizes rounded up (and credits rounded down), so every plan the table
admits fits under the exact model in model.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import DEFAULT_SLOTS, FULL, SAVE_COMPUTE, Region
from ..chain import ChainModel
from .model import evaluate

__all__ = ["RotorTable", "solve_table", "rotor_regions", "rotor_plan", "solve_rotor"]

INF = float("inf")


@dataclass
class RotorTable:
    cost: torch.Tensor  # (L, L, S+1) float32: forward time, inf when infeasible
    what: torch.Tensor  # (L, L, S+1) int32: 0 keep stage s, k > 0 checkpoint s..k-1
    selective: torch.Tensor  # (L, L, S+1) bool: that checkpoint keeps its expensive ops' outputs
    slot: float  # bytes per memory slot
    x_slots: torch.Tensor  # xbar of each stage, in slots (for the rebuild)
    out_slots: torch.Tensor  # (L, L): [s, k-1] what a region s..k-1 holds, in slots
    sel_slots: torch.Tensor  # (L, L): [s, k-1] what a selective region s..k-1 holds, in slots
    credit: torch.Tensor  # (L, L): slots credited to the recomputation of s..k-1 (indexed [k, t])
    xfree_slots: torch.Tensor  # (L, L): [s, k-1] the inputs nothing else saves region s..k-1 holds to its backward
    model: ChainModel
    # like ``what``, without selective regions: a plain region's recomputation (None: the table
    # admits selective regions nested in plain ones, and ``what`` serves both)
    what_plain: torch.Tensor | None

    def min_feasible_slot(self) -> int | None:
        row = self.cost[0, len(self.model) - 1]
        ok = torch.nonzero(torch.isfinite(row))
        return None if ok.numel() == 0 else int(ok[0])


def _ceil(t: torch.Tensor, slot: float) -> torch.Tensor:
    return torch.ceil(t / slot - 1e-9).to(torch.int64)


def _floor(t: torch.Tensor, slot: float) -> torch.Tensor:
    return torch.floor(t / slot + 1e-9).to(torch.int64)


def _keep_all_need(x_slots: torch.Tensor, fwd_keep: torch.Tensor, bwd_after: torch.Tensor,
                   bwd_alone: torch.Tensor) -> torch.Tensor:
    """need[s, t]: slots the schedule keeping every stage of s..t needs (the recursion of the
    keep option: stage s's forward and backward, and x_slots[s] less for s+1..t)."""
    n = len(x_slots)
    need = torch.full((n, n), 1 << 40, dtype=torch.int64)
    idx = torch.arange(n)
    need[idx, idx] = torch.maximum(fwd_keep, bwd_alone)
    for d in range(1, n):
        s = torch.arange(n - d)
        t = s + d
        need[s, t] = torch.maximum(torch.maximum(fwd_keep[s], bwd_after[s, t]), x_slots[s] + need[s + 1, t])
    return need


def solve_table(model: ChainModel, memory: int, slots: int = DEFAULT_SLOTS, selective: bool = True,
                nested: bool = False) -> RotorTable:
    """Fill the DP table for ``memory`` bytes (above resident) split into ``slots`` slots;
    ``selective``: also consider regions that keep their expensive ops' outputs; ``nested``: also
    inside plain regions, charged as if they kept nothing before their own forward (a relaxation:
    see rotor_plan)."""
    n = len(model)
    n_slots = slots
    memory -= sum(model.pinned)  # alive the whole step (chain/costs.py): the chain has the rest
    hopeless = memory < 0
    slot = max(memory, 1) / n_slots
    d64 = torch.float64
    dc = torch.float32  # the table itself: half the memory traffic of float64

    def col(values) -> torch.Tensor:
        return torch.tensor(values, dtype=d64)

    t_fwd, y, xbar = col(model.fwd_time), col(model.y), col(model.xbar)
    ftmp, btmp, g, fdis = col(model.ftmp), col(model.btmp), col(model.param_grad), col(model.fdis)
    keep, xfree = col(model.keep_bytes), col(model.xfree)
    gin, gnew = col(model.grad_in), col(model.grad_new)  # input gradients: in all, and new (costs.py)
    t_sel = col([model.recompute_seconds(i, SAVE_COMPUTE) for i in range(n)])
    unsafe = col([0.0 if ok else 1.0 for ok in model.keep_safe])  # stages no selective region may hold
    delta = col([model.delta(i) for i in range(n)])

    def prefix(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=d64), torch.cumsum(v, 0)])

    pf, pg, pk, ps = prefix(t_fwd), prefix(g), prefix(keep), prefix(t_sel)  # sums over s..k-1: p[k] - p[s]
    # torch's early stop (model.py): a stage ending a region's recomputation runs only up to its
    # last save.  Every table entry C[s, t] with t < n - 1 is the rest of some region's
    # recomputation, so its last stage t (never inside a region of that recursion) is that
    # region's last: the leaf C[t, t] is charged without its tail, and a selective region s..k-1
    # its stage k-1's.  Exact where every stage saves; where a last stage saves nothing the stages
    # before it are charged whole (a bound; the simulator counts them exactly).  No credit from
    # the first stage that recomputes without early stop on (a region may hold it).
    bad = [i for i, ok in enumerate(model.early_stop) if not ok]
    credited = torch.arange(n) < min(bad + [n - 1])
    leaf_credit = torch.where(credited, col(model.tail_time), 0.0)
    sel_credit = torch.where(credited, col([model.tail_seconds(i, SAVE_COMPUTE) for i in range(n)]), 0.0)
    pu = prefix(unsafe)

    idx = torch.arange(n)
    s_idx, t_idx = idx[:, None], idx[None, :]
    # forward of stage s with everything kept; backward of a lone stage
    fwd_keep = _ceil(ftmp + xbar, slot)
    # (what only later stages saved, ylate, is released by then: its backward came first)
    late = col(model.ylate)
    bwd_alone = _ceil(xbar - late + btmp + gnew + g, slot)
    # backward of s after s+1..t: xbar_s, grad of s's output, grads of s+1..t, minus consumed delta_t
    bwd_after = _ceil((xbar - late + delta + btmp + gnew + g)[:, None] + (pg[1:][None, :] - pg[1:][:, None]) - delta[None, :], slot)
    # held[s, i]: what a region starting at s holds after its stage i (output, and the skip values
    # over the same cut that the region made: ChainModel.made)
    made = {f: col(model.made_matrix(f)) for f in ("bytes", "free", "keep")}
    held = y[None, :] + made["bytes"]
    # discard forward of s..k-1: peak over its stages of (what it holds before) + fdis
    before = torch.cat([torch.zeros((n, 1), dtype=d64), held[:, :-1]], dim=1)
    inside = t_idx >= s_idx
    # (a region holds its inputs nothing else saves, xfree[s], from its start to its backward)
    w = torch.where(inside, fdis[None, :] + torch.where(t_idx > s_idx, before, 0.0) + xfree[:, None], -INF)
    rng = col(model.region_matrix(model.rng_held))  # [s, k-1]: its stashed RNG state, from its start
    disc = _ceil(torch.cummax(w, dim=1).values + rng, slot)  # disc[s, k-1]: segment s..k-1
    # a selective region also holds what its stages s..i keep
    kept = torch.where(inside, pk[1:][None, :] - pk[:-1][:, None], 0.0)  # kept[s, i]: keep of s..i
    # (its output, where a kept op's, is held once: ``shared``, before and after each stage)
    shared = col(model.y_keep)[None, :] + made["keep"]
    shared_before = torch.cat([torch.zeros((n, 1), dtype=d64), shared[:, :-1]], dim=1)
    w_sel = w + kept - col(model.y_keep)[None, :] - torch.where(t_idx > s_idx, shared_before, 0.0)
    sel_disc = _ceil(torch.cummax(torch.where(inside, w_sel, -INF), dim=1).values + rng, slot)
    # memory credited to the recomputation of s..k-1 once k..t is done (indexed [k, t])
    credit = _floor(delta[None, :] - gin[:, None] - (pg[1:][None, :] - pg[:-1][:, None]), slot)
    x_slots = _ceil(xbar, slot)
    # once its forward is done a region holds its output less what no node saves (model.py)
    done = held - col(model.y_free)[None, :] - made["free"]
    # (past its forward a region holds only the inputs it reads: ChainModel.held_inputs)
    held_in = col(model.region_matrix(model.held_inputs)) + rng
    out_slots = _ceil(done + held_in, slot)
    sel_slots = _ceil(done - shared + kept + held_in, slot)
    xfree_slots = _ceil(held_in, slot)
    # a selective region's kept outputs its recomputation never reaches, held through it (model.py)
    tail_slots = _ceil(col(model.region_matrix(model.cached_tail)), slot)
    need = _keep_all_need(x_slots, fwd_keep, bwd_after, bwd_alone)  # [s, k-1]: recomputing s..k-1 kept

    # Padded rows: padded[s, t, n_slots+1 + m] = C[s, t, m].  Left of it n_slots+1 columns of inf (not
    # enough memory), right of it n_slots+1 copies of C[s, t, n_slots] (more memory than the table holds
    # helps no further).  Every shifted read "C[k, t, m - c] for all m" is then one contiguous slice of a
    # row, taken through an unfold view without building per-element indices.
    fc, pfc, psc, selc = t_fwd.to(dc), pf.to(dc), ps.to(dc), sel_credit.to(dc)
    width = n_slots + 1
    m = torch.arange(width)
    mid = slice(width, 2 * width)

    def new_table() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        padded = torch.full((n, n, 3 * width), INF, dtype=dc)
        # window[s, t, o] = padded[s, t, o:o+width]
        return padded, padded.unfold(2, width, 1), torch.zeros((n, n, width), dtype=torch.int32)

    # Two tables when selective: ``plain`` never uses option 3, and is what a plain region's
    # recomputation is solved with.  torch's selective checkpoint nested in a plain region caches
    # its kept outputs during the outer forward too, holding them to the outer backward (model.py);
    # the recursion cannot see that, so such nestings are outside the plan space.
    padded, window, what = new_table()
    two = selective and not nested
    padded_p, window_p, what_p = new_table() if two else (padded, window, what)
    chosen_sel = torch.zeros((n, n, width), dtype=torch.bool)

    def store(table: torch.Tensor, s: torch.Tensor, t: torch.Tensor, value: torch.Tensor) -> None:
        table[s, t, mid] = value
        table[s, t, 2 * width:] = value[:, -1:]

    ok = (fwd_keep[:, None] <= m) & (bwd_alone[:, None] <= m)
    for table in {id(padded): padded, id(padded_p): padded_p}.values():
        store(table, idx, idx, torch.where(ok, (t_fwd - leaf_credit).to(dc)[:, None], INF))
    out_start = (width - out_slots).clamp(0, 2 * width)  # slice start of C[., ., m - held[s, k-1]]
    sel_start = (width - sel_slots).clamp(0, 2 * width)
    x_start = (width - x_slots).clamp(0, 2 * width)
    for d in range(1, n):
        s = torch.arange(n - d)
        t = s + d
        k = s[:, None] + torch.arange(1, d + 1)[None, :]  # option 2 and 3's splits: (len(s), d)
        tt = t[:, None].expand_as(k)
        ss = s[:, None].expand_as(k)
        first_forward = (pfc[k] - pfc[s][:, None])[..., None]
        room_start = (width + credit[k, tt] - xfree_slots[ss, k - 1]).clamp(0, 2 * width)  # its inputs still held
        inner = window_p[ss, k - 1, room_start]  # a plain region's recomputation, solved plainly

        def keep_or_checkpoint(rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Options 1 and 2 with the chain after s (or k) solved in ``rest``."""
            sub = rest[s + 1, t, x_start[s]]
            ok1 = (fwd_keep[s][:, None] <= m) & (bwd_after[s, t][:, None] <= m)
            best = torch.where(ok1, fc[s][:, None] + sub, INF)
            opt2 = rest[k, tt, out_start[ss, k - 1]].add_(inner).add_(first_forward)  # a gathered copy
            opt2.masked_fill_(disc[ss, k - 1][..., None] > m, INF)
            v2, arg2 = opt2.min(dim=1)
            better = v2 < best
            return torch.where(better, v2, best), torch.where(better, (s[:, None] + 1 + arg2).to(torch.int32), 0)

        if two:
            value_p, choice_p = keep_or_checkpoint(window_p)
            store(padded_p, s, t, value_p)
            what_p[s, t] = choice_p
        value, choice = keep_or_checkpoint(window)
        sel = torch.zeros_like(value, dtype=torch.bool)
        if selective:
            # option 3: the same, keeping the expensive ops' outputs; s..k-1 is then recomputed
            # with everything kept (it must fit once k..t is done), costing only the cheap ops
            sub3 = window[k, tt, sel_start[ss, k - 1]]
            opt3 = sub3.add_(first_forward).add_((psc[k] - psc[s][:, None] - selc[k - 1])[..., None])
            # infeasible below a threshold of m: the forward with its keeps (sel_disc > m), the
            # recomputation once k..t is done (need > min(m + credit - xfree, n_slots)); never for a
            # region over a stage whose kept output a later op overwrites (one compare per cell)
            credit_k = credit[k, tt] - xfree_slots[ss, k - 1]
            need_k = need[ss, k - 1]
            below = torch.maximum(sel_disc[ss, k - 1], need_k - credit_k + tail_slots[ss, k - 1])
            never = (need_k > n_slots) | (pu[k] - pu[s][:, None] > 0)
            below.masked_fill_(never, 2 * width)
            opt3.masked_fill_(m < below[..., None], INF)
            v3, arg3 = opt3.min(dim=1)
            sel = v3 < value
            value = torch.where(sel, v3, value)
            choice = torch.where(sel, (s[:, None] + 1 + arg3).to(torch.int32), choice)
        store(padded, s, t, value)
        what[s, t] = choice
        chosen_sel[s, t] = sel
    cost = padded[:, :, mid]
    if hopeless:
        cost.fill_(INF)
    return RotorTable(cost, what, chosen_sel, slot, x_slots, out_slots, sel_slots, credit, xfree_slots, model,
                      what_p if two else None)


def rotor_regions(table: RotorTable, m: int | None = None) -> tuple[Region, ...] | None:
    """Rebuild the nested regions of the optimal schedule at ``m`` slots (default: all of them)."""
    n = len(table.model)
    n_slots = table.cost.shape[2] - 1
    m = n_slots if m is None else m
    if n == 0:
        return ()
    if not math.isfinite(float(table.cost[0, n - 1, m])):
        return None

    def build(s: int, t: int, m: int, plain: bool = False) -> list[Region]:
        out: list[Region] = []
        plain = plain and table.what_plain is not None  # one table: its choices hold inside regions too
        while s < t:
            k = int((table.what_plain if plain else table.what)[s, t, m])
            if k == 0:
                m -= int(table.x_slots[s])
                s += 1
                continue
            if not plain and bool(table.selective[s, t, m]):
                out.append(Region(s, k, (), SAVE_COMPUTE))
                m -= int(table.sel_slots[s, k - 1])
            else:
                m2 = min(n_slots, m + int(table.credit[k, t]) - int(table.xfree_slots[s, k - 1]))
                out.append(Region(s, k, tuple(build(s, k - 1, m2, plain=True)), FULL))
                m -= int(table.out_slots[s, k - 1])
            s = k
        return out

    return tuple(build(0, n - 1, m))


def _nests_selective(regions: tuple[Region, ...], inside: bool = False) -> bool:
    return any((inside and r.policy != FULL) or _nests_selective(r.children, True) for r in regions)


def rotor_plan(model: ChainModel, memory: int, slots: int = DEFAULT_SLOTS, selective: bool = True,
               least: bool = False) -> tuple[Region, ...] | None:
    """The DP's optimum at ``memory`` bytes (``least``: at the least memory its table admits);
    None when nothing fits.

    The one-table solve admits selective regions inside plain ones, undercharged: it relaxes the
    plan space, so its optimum is a lower bound, and when that plan nests none it is charged
    exactly, fits, and is optimal in the plan space itself (the same holds for its least memory).
    Otherwise the two tables are filled.  Most plans nest none: one table is ~2/3 of the time.
    """
    for nested in ((True, False) if selective else (False,)):
        table = solve_table(model, memory, slots, selective, nested=nested)
        m = table.min_feasible_slot() if least else None
        if least and m is None:
            return None
        regions = rotor_regions(table, m)
        if regions is None or not nested or not _nests_selective(regions):
            return regions
    raise AssertionError("unreachable: the two-table solve returns")


def solve_rotor(model: ChainModel, limit: int, slots: int = DEFAULT_SLOTS, retry: bool = True,
                selective: bool = True) -> tuple[Region, ...] | None:
    """The rotor plan for ``limit`` bytes: nothing when everything fits, else the DP's optimum.

    Sizes are rounded up to slots, so near the smallest feasible memory the table can miss a
    plan that fits exactly; with ``retry`` it is then solved once more with four times the slots
    (16x the time on a long chain: callers that already hold a plan pass ``retry=False``).
    """
    if evaluate(model, ()).peak <= limit:
        return ()
    if limit <= 0:
        return None
    regions = rotor_plan(model, limit, slots, selective)
    if regions is None and retry:
        regions = rotor_plan(model, limit, 4 * slots, selective)
    return regions
