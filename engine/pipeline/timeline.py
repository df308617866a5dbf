"""Timeline simulation: when every pipeline action starts and ends, with real durations.

Each pipeline rank runs its plan's actions in order (:mod:`engine.pipeline.schedules`); an action also
waits for its data:

* ``F(s, mb)`` after ``F(s-1, mb)`` ends, plus the p2p time when stage s-1 is on another rank;
* ``B``/``I(s, mb)`` after ``B``/``I(s+1, mb)`` ends (+ p2p), or on the last stage after ``F(s, mb)``;
* ``W(s, mb)`` after ``I(s, mb)``.

A transfer is modelled as a delay on the dependency edge (latency + bytes / bandwidth): it does
not occupy the sender, links do not contend, and torch's fused send/recv waits are not
modelled. ``start = max(end of the previous action on the rank, end of the data dependency +
p2p)`` — the ranks take turns running what their data allows (see ``_run``).

Bubble conventions (both are always given, ``conventions.bubble`` says which to show):
``bubble_fraction`` = idle / (pp · makespan), the share of total time (GPipe paper);
``bubble_relative_to_ideal`` = idle / busy, relative to the ideal time (Narayanan 2021).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from engine.config import Config
from engine.pipeline.schedules import ACTION_KINDS, PipelinePlan, pipeline_actions, single_rank_plan
from engine.time.durations import StageDurations, stage_durations

_F, _B, _I, _W = range(4)
_KIND_NAMES = np.array(ACTION_KINDS)


# --------------------------------------------------------------------------- plan -> graph


@dataclass(frozen=True, eq=False)
class _Graph:
    """A plan as flat arrays (rank-major, each rank in execution order) plus its dependency graph."""

    offsets: np.ndarray  # rank r's actions are [offsets[r], offsets[r+1])
    rank: np.ndarray
    kind: np.ndarray  # codes into ACTION_KINDS
    stage: np.ndarray
    microbatch: np.ndarray
    dep: np.ndarray  # index of the data dependency, or n (sentinel) when none
    cross: np.ndarray  # dependency on another rank (a p2p transfer)
    boundary: np.ndarray  # stage boundary crossed by that transfer (s -> s+1 is boundary s)
    alloc: np.ndarray  # [num_stages, m]: index of F(s, mb)
    release: np.ndarray  # [num_stages, m]: index of the action after which activations are freed
    dep_list: list = field(repr=False)  # dep as a Python list (the simulation loop's input)
    runs: list = field(default_factory=lambda: [0], repr=False)  # how often it was simulated (a counter)

    @cached_property
    def waves(self) -> tuple | None:
        """The actions in waves: wave k holds the actions whose longest chain of predecessors (on their
        rank and through their data) has k actions, so each depends only on earlier waves. As
        ``(order, bounds, prev, dep)``: the actions of wave k are ``order[bounds[k]:bounds[k+1]]``,
        ``prev``/``dep`` their previous action on the rank and their data dependency (n: none), in
        ``order``. None when the plan deadlocks."""
        n = len(self.kind)
        try:
            level = _run(self, [1.0] * n, [0.0] * n)[:n].astype(np.int64)  # unit durations: the wave, from 1
        except ValueError:
            return None
        order = np.argsort(level, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(level)[1:])]).tolist()
        return order, bounds, _previous_on_rank(self)[order], self.dep[order]


_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _graph(plan: PipelinePlan) -> _Graph:
    g = _GRAPHS.get(plan)
    if g is None:
        g = _GRAPHS[plan] = _build_graph(plan)
    return g


def _build_graph(plan: PipelinePlan) -> _Graph:
    S, m, p = plan.num_stages, plan.microbatches, plan.pp
    offsets, kind, stage, mb = plan.arrays  # ValueError for a kind outside ACTION_KINDS
    n = len(kind)
    if len(offsets) != p + 1:
        raise ValueError(f"plan lists {len(offsets) - 1} ranks, pp is {p}")
    if n and (stage.min() < 0 or stage.max() >= S or mb.min() < 0 or mb.max() >= m):
        raise ValueError("plan has an action outside its stages or microbatches")
    rank = np.repeat(np.arange(p, dtype=np.int64), np.diff(offsets))

    where = np.full((4, S + 1, m), n, dtype=np.int64)  # where[kind, stage, mb] -> index (n: absent)
    where[kind, stage, mb] = np.arange(n)
    if np.count_nonzero(where[:, :S] < n) != n:
        raise ValueError("plan repeats an action")
    if np.any(where[_F, :S] == n):
        raise ValueError("plan misses a forward")
    back_in = np.minimum(where[_B], where[_I])  # B or I of (s, mb), whichever the plan has
    release = np.where(where[_B, :S] < n, where[_B, :S], where[_W, :S])
    if np.any(release == n):
        raise ValueError("plan misses a backward")

    # the data dependency of each action, by kind: F(s-1) for F (none on stage 0); B/I(s+1)
    # for B/I (F(s) on the last stage); I(s) for W
    dep_f = np.vstack([np.full((1, m), n, dtype=np.int64), where[_F, : S - 1]])
    dep_b = np.vstack([back_in[1:S], where[_F, S - 1 : S]])
    dep_of = np.stack([dep_f, dep_b, dep_b, back_in[:S]])  # [kind, stage, mb]
    dep = dep_of[kind, stage, mb]
    if np.any(dep[kind == _W] == n):
        raise ValueError("plan has W without its I")
    owner = np.asarray(plan.stage_to_rank, dtype=np.int64)
    cross = np.zeros(n, dtype=bool)
    has = dep < n
    cross[has] = owner[stage[dep[has]]] != rank[has]
    boundary = np.where(kind == _F, stage - 1, stage)  # F crosses s-1 -> s; B/I crosses s -> s+1
    return _Graph(offsets, rank, kind, stage, mb, dep, cross, boundary, where[_F, :S], release, dep.tolist())


def _previous_on_rank(g: _Graph) -> np.ndarray:
    """Index of each action's predecessor on its rank; n (the sentinel, ending at 0) for a rank's first."""
    n = len(g.kind)
    prev = np.arange(-1, n - 1, dtype=np.int64)
    prev[g.offsets[:-1][np.diff(g.offsets) > 0]] = n
    return prev


#: a plan of this many actions or more, simulated more than once, with at least WAVE_MIN_WIDTH actions per
#: wave on average, runs wave by wave in numpy (``_run_waves``); others action by action (``_run``), which
#: is faster below ~10 actions a wave (measured: 1F1B pp 16 × m 128, 14 a wave: 0.45 vs 0.61 ms; pp 64 ×
#: m 256, 51 a wave: 1.3 vs 6.3 ms; interleaved pp 8 × m 64, 8 a wave: 0.43 vs 0.30 ms). Same bits.
WAVE_MIN_ACTIONS = 2048
WAVE_MIN_WIDTH = 12


def _run_waves(g: _Graph, dur: np.ndarray, comm: np.ndarray) -> np.ndarray:
    """``_run``'s end times computed a wave at a time (``_Graph.waves``): the same float operations on
    the same operands — max(end of the previous action, end of the data + p2p) + duration — so the
    same bits, in numpy calls per wave instead of Python steps per action."""
    order, bounds, prev, dep = g.waves
    end = np.zeros(len(dur) + 1)
    dur_o, comm_o = dur[order], comm[order]
    for a, b in zip(bounds[:-1], bounds[1:]):
        end[order[a:b]] = np.maximum(end[prev[a:b]], end[dep[a:b]] + comm_o[a:b]) + dur_o[a:b]
    return end


def _run(g: _Graph, dur: list, comm: list) -> np.ndarray:
    """End of every action: the ranks take turns, each running its next actions while their
    data is there (a sweep down the ranks, then one back up, so that forwards and backwards
    both travel a whole pipeline per round). Any order that respects the data and the ranks'
    orders gives the same times, bit for bit. A round in which no rank can move is a deadlock."""
    n = len(dur)
    dep = g.dep_list
    end = [-1.0] * n + [0.0]  # -1: not run yet; index n: the sentinel "nothing", ends at 0
    ptr = g.offsets[:-1].tolist()
    stop = g.offsets[1:].tolist()
    last = [0.0] * len(ptr)  # end of each rank's latest action
    live = [r for r in range(len(ptr)) if ptr[r] < stop[r]]
    left = n
    while left:
        moved = 0
        for r in live + live[::-1]:
            j0 = j = ptr[r]
            e = stop[r]
            t = last[r]
            while j < e:
                u = end[dep[j]]
                if u < 0.0:
                    break
                u += comm[j]
                if u > t:
                    t = u
                t += dur[j]
                end[j] = t
                j += 1
            if j != j0:
                ptr[r] = j
                last[r] = t
                moved += j - j0
        if not moved:
            stuck = {r: ptr[r] for r in live}
            raise ValueError(f"pipeline plan deadlocks: ranks wait on each other at {stuck}")
        left -= moved
        live = [r for r in live if ptr[r] < stop[r]]
    return np.fromiter(end, dtype=np.float64, count=n + 1)


# --------------------------------------------------------------------------- the timeline


@dataclass(frozen=True, eq=False)
class Timeline:
    """Start and end of every compute action on every pipeline rank, and what follows from them.

    Flat arrays, one entry per action, grouped by pipeline rank in execution order:
    ``rank`` (pipeline rank), ``kind`` ("F"/"B"/"I"/"W"), ``stage``, ``microbatch``,
    ``start_s``, ``end_s``. ``busy_s``/``idle_s`` are per pipeline rank.
    """

    schedule: str
    pp: int
    num_stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    global_ranks: tuple[int, ...]  # global rank of (dp=0, tp=0) on each pipeline rank
    rank: np.ndarray
    kind_code: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    start_s: np.ndarray
    end_s: np.ndarray
    makespan_s: float
    busy_s: np.ndarray
    idle_s: np.ndarray
    durations: StageDurations = field(repr=False)
    _graph: _Graph = field(repr=False)

    # ----------------------------------------------------------------- bubble

    @property
    def bubble_fraction(self) -> float:
        """Idle share of total rank-time: idle / (pp · makespan)."""
        total = self.pp * self.makespan_s
        return float(self.idle_s.sum() / total) if total > 0 else 0.0

    @property
    def bubble_relative_to_ideal(self) -> float:
        """Idle time relative to the ideal (busy) time: idle / busy."""
        busy = float(self.busy_s.sum())
        return float(self.idle_s.sum() / busy) if busy > 0 else 0.0

    def bubble(self, convention: str = "share-of-total") -> float:
        """The bubble in one of ``engine.names.BUBBLE_CONVENTIONS``."""
        if convention == "share-of-total":
            return self.bubble_fraction
        if convention == "relative-to-ideal":
            return self.bubble_relative_to_ideal
        raise ValueError(f"unknown bubble convention {convention!r}; allowed: share-of-total | relative-to-ideal")

    # ----------------------------------------------------------------- actions

    @cached_property
    def kind(self) -> np.ndarray:
        """Kind letters ("F", "B", "I", "W") of every action."""
        return _KIND_NAMES[self.kind_code]

    def rank_slice(self, rank: int) -> slice:
        o = self._graph.offsets
        return slice(int(o[rank]), int(o[rank + 1]))

    def actions_of_rank(self, rank: int) -> list[tuple[str, int, int, float, float]]:
        """[(kind, stage, microbatch, start_s, end_s), ...] of one pipeline rank, in execution order."""
        sl = self.rank_slice(rank)
        return list(zip(self.kind[sl].tolist(), self.stage[sl].tolist(), self.microbatch[sl].tolist(),
                        self.start_s[sl].tolist(), self.end_s[sl].tolist()))

    # ----------------------------------------------------------------- activations

    @cached_property
    def _activation_events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per stage: sorted event times and the live count after each (one concatenated run)."""
        g = self._graph
        S, m = self.num_stages, self.microbatches
        t = np.concatenate([self.start_s[g.alloc].ravel(), self.end_s[g.release].ravel()])
        delta = np.concatenate([np.ones(S * m, dtype=np.int64), -np.ones(S * m, dtype=np.int64)])
        stage = np.concatenate([np.repeat(np.arange(S), m)] * 2)
        order = np.lexsort((delta, t, stage))  # by stage, then time; a release before an allocation
        counts = np.cumsum(delta[order])  # each stage nets to zero, so segments don't leak
        bounds = np.arange(S + 1) * (2 * m)
        return t[order], counts, bounds, stage[order]

    def activations_in_flight(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """(times_s, live): after time ``times_s[k]`` the stage holds ``live[k]`` microbatches'
        activations (from the start of F until the end of B — or of W for a split backward)."""
        t, counts, bounds, _ = self._activation_events
        sl = slice(int(bounds[stage]), int(bounds[stage + 1]))
        return t[sl].copy(), counts[sl].copy()

    @cached_property
    def peak_activations(self) -> np.ndarray:
        """Most microbatches whose activations a stage holds at once, per stage."""
        _, counts, bounds, _ = self._activation_events
        return np.maximum.reduceat(counts, bounds[:-1])

    def peak_activations_of_rank(self, rank: int, stage_bytes=None) -> tuple[tuple[int, ...], float]:
        """The rank's activation peak over all its local stages at once.

        ``stage_bytes[s]`` weighs one microbatch of stage ``s`` (default 1 each). Returns the
        live microbatches per local stage (increasing stage order) at the moment the weighted
        sum peaks, and that sum.
        """
        t, counts, bounds, _ = self._activation_events
        local = [s for s, r in enumerate(self.stage_to_rank) if r == rank]
        weight = np.ones(self.num_stages) if stage_bytes is None else np.asarray(stage_bytes, dtype=np.float64)
        times, deltas, which = [], [], []
        for k, s in enumerate(local):
            sl = slice(int(bounds[s]), int(bounds[s + 1]))
            times.append(t[sl])
            deltas.append(np.diff(counts[sl], prepend=0))
            which.append(np.full(sl.stop - sl.start, k))
        times_a, delta_a, which_a = np.concatenate(times), np.concatenate(deltas), np.concatenate(which)
        order = np.lexsort((delta_a, times_a))
        delta_a, which_a = delta_a[order], which_a[order]
        w = np.asarray([weight[s] for s in local])[which_a]
        total = np.cumsum(delta_a * w)
        at = int(np.argmax(total))
        per_stage = tuple(int(np.sum(delta_a[: at + 1] * (which_a[: at + 1] == k))) for k in range(len(local)))
        return per_stage, float(total[at])

    # ----------------------------------------------------------------- communication

    @cached_property
    def transfers(self) -> dict[str, np.ndarray]:
        """The p2p transfers between ranks as flat arrays: ``kind`` ("F": activations,
        "B": gradients), ``src_rank``, ``dst_rank``, ``stage`` (the receiving stage),
        ``microbatch``, ``start_s``, ``end_s``."""
        g = self._graph
        idx = np.flatnonzero(g.cross)
        src = g.dep[idx]
        return {
            "kind": np.where(g.kind[idx] == _F, "F", "B"),
            "src_rank": g.rank[src], "dst_rank": g.rank[idx], "stage": g.stage[idx],
            "microbatch": g.microbatch[idx], "start_s": self.end_s[src],
            "end_s": self.end_s[src] + _comm_seconds(g, self.durations)[idx],
        }

    # ----------------------------------------------------------------- output

    def to_json(self, convention: str | None = None) -> dict:
        """The ``"pipeline"`` block of ``shardscope predict --json``.

        ``per_rank`` has one entry per *pipeline* rank: ``pp_rank``, and ``rank`` = the global
        rank of its (dp = 0, tp = 0) member (every dp/tp replica runs the same timeline).
        """
        out = {
            "schedule": self.schedule,
            "pp": self.pp,
            "num_stages": self.num_stages,
            "microbatches": self.microbatches,
            "stage_to_pp_rank": list(self.stage_to_rank),
            "makespan_s": self.makespan_s,
            "bubble_fraction": self.bubble_fraction,
            "bubble_relative_to_ideal": self.bubble_relative_to_ideal,
            "peak_activations_per_stage": self.peak_activations.tolist(),
            "per_rank": [
                {"pp_rank": r, "rank": self.global_ranks[r], "busy_s": float(self.busy_s[r]),
                 "idle_s": float(self.idle_s[r]), "actions": [list(a) for a in self.actions_of_rank(r)]}
                for r in range(self.pp)
            ],
        }
        if convention is not None:
            out["bubble_convention"] = convention
            out["bubble"] = self.bubble(convention)
        return out


def _comm_seconds(g: _Graph, durations: StageDurations) -> np.ndarray:
    p2p = np.append(durations.p2p_s, 0.0)  # index -1 (F of stage 0) never crosses; pad anyway
    return np.where(g.cross, p2p[np.clip(g.boundary, 0, len(p2p) - 1)], 0.0)


def simulate(plan: PipelinePlan, durations: StageDurations,
             global_ranks: list[int] | tuple[int, ...] | None = None) -> Timeline:
    """Start/end of every action of ``plan`` with ``durations``; see the module doc for the rules."""
    if durations.num_stages != plan.num_stages:
        raise ValueError(f"durations cover {durations.num_stages} stages, the plan has {plan.num_stages}")
    g = _graph(plan)
    n = len(g.kind)
    dur = durations.table()[g.kind, g.stage]
    comm = _comm_seconds(g, durations)
    g.runs[0] += 1
    # a plan seen again (a slider moving the model, not the schedule) with wide waves: numpy per wave
    waves = g.runs[0] > 1 and n >= WAVE_MIN_ACTIONS and g.waves
    if waves and n >= WAVE_MIN_WIDTH * (len(waves[1]) - 1):
        end = _run_waves(g, dur, comm)
    else:
        end = _run(g, dur.tolist(), comm.tolist())  # end[n] = 0: the sentinel "nothing"
    # start = max(end of the previous action on the rank, end of the data + p2p): the same
    # float operations as the loop, so the same bits
    prev = _previous_on_rank(g)
    start_s = np.maximum(end[prev], end[g.dep] + comm)
    end_s = end[:n]
    makespan = float(end_s.max()) if n else 0.0
    busy = np.bincount(g.rank, weights=dur, minlength=plan.pp)
    ranks = tuple(range(plan.pp)) if global_ranks is None else tuple(int(r) for r in global_ranks)
    return Timeline(
        schedule=plan.schedule, pp=plan.pp, num_stages=plan.num_stages, microbatches=plan.microbatches,
        stage_to_rank=plan.stage_to_rank, global_ranks=ranks, rank=g.rank, kind_code=g.kind, stage=g.stage,
        microbatch=g.microbatch, start_s=start_s, end_s=end_s, makespan_s=makespan, busy_s=busy,
        idle_s=makespan - busy, durations=durations, _graph=g,
    )


def pipeline_plan(cfg: Config) -> PipelinePlan:
    """The plan for the config (pp = 1: gradient accumulation, F then B per microbatch)."""
    par = cfg.parallel
    if par.pp == 1:
        return single_rank_plan(par.schedule, par.microbatches)
    return pipeline_actions(par.schedule, par.pp, par.microbatches, par.virtual_stages)


def pipeline_prediction(cfg: Config, durations: StageDurations | None = None) -> Timeline:
    """Plan + durations (analytic unless given) + simulation for ``cfg``."""
    plan = pipeline_plan(cfg)
    if durations is None:
        durations = stage_durations(cfg)
    par = cfg.parallel
    return simulate(plan, durations, [r * par.dp * par.cp * par.tp for r in range(plan.pp)])
