"""Per action: the fake run's peak inside it against the engine's moments of the same action, for one rank.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fake_actions.py CONFIG RANK [--explain K [--top N]] [--save F.pkl]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/fake_actions.py --load F.pkl CONFIG RANK [--explain K]

``fake_sweep.py`` says which rank misses and by how much at its peak; this says at which action and with what.
It simulates RANK of CONFIG in this process as ``measure --fake`` does (``backend.fake_worker.simulate_rank``:
the backend's real training code on fake tensors, the same allocation events the fake's replay reads), recording
beside each allocation the aten op that made it, MemTracker's reference type (ACT, TEMP, UNSHARDED_PARAM, ...),
the innermost module running and whether autograd was in the backward; and the event index where each pipeline
action (F, B, I, W of a stage and microbatch: the fake trainer's chunk calls) starts and ends. It prints, per action
in the rank's order, the most bytes alive inside it (tracked: the events the caching-allocator replay reads, the DDP
buckets and receive buffers first) beside the most the engine lays at that action's moments (its own, its loss
moment, its B end, a late moment: ``engine.memory.lifetimes``) and the difference. ``--explain K``: what is alive
at action K's fake peak, grouped by (reference type, op, module, forward/backward), largest first.

Diagnostic only: it monkeypatches MemTracker's dispatch, the fake worker's recorder and its chunk calls for the run.
Unpipelined ranks have no chunk calls: their whole step is one row. Simulating takes what ``measure --fake`` of
the rank takes (seconds to minutes); ``--save`` / ``--load`` keep the recording.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def record(cfg, rank: int) -> dict:
    """Simulate ``rank`` of ``cfg`` with the recording described in the module docstring."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from backend import fake_worker as fw

    cur = {"op": "-", "module": "", "backward": False}
    info: dict = {}
    marks: list = []
    out: dict = {}
    recorder: dict = {}

    def with_op(cls) -> None:
        orig = cls.__dict__["__torch_dispatch__"]

        def dispatch(self, func, types, args=(), kwargs=None):
            prev = dict(cur)
            cur["op"] = str(func).replace("aten.", "")
            mt = getattr(self, "_mod_tracker", None)
            if mt is not None:
                cur["module"] = max(mt.parents, key=len, default="")
                cur["backward"] = bool(mt.is_bw)
            try:
                return orig(self, func, types, args, kwargs)
            finally:
                cur.update(prev)
        cls.__torch_dispatch__ = dispatch

    patches = [(MemTracker, "__torch_dispatch__"), (fw.AllocationRecorder, "_alloc"),
               (fw.AllocationRecorder, "__enter__"), (fw, "replay_allocations")]
    patches += [(fw._FakeTrainer, name) for name in ("_forward_chunk", "_backward_chunk", "_weight_chunk")]
    if "__torch_dispatch__" in FSDPMemTracker.__dict__:
        patches.append((FSDPMemTracker, "__torch_dispatch__"))
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    try:
        for owner, name in patches:
            if name == "__torch_dispatch__":
                with_op(owner)
        alloc, enter, replay = fw.AllocationRecorder._alloc, fw.AllocationRecorder.__enter__, fw.replay_allocations

        def _alloc(self, winfo):
            n = len(self.events)
            alloc(self, winfo)
            if len(self.events) > n:
                info[self.events[-1][1]] = (cur["op"], getattr(winfo.reftype, "name", str(winfo.reftype)),
                                            cur["module"], cur["backward"])

        def _enter(self):
            recorder["r"] = self
            return enter(self)

        def _replay(events, **kw):
            out["events"] = list(events)
            return replay(events, **kw)
        fw.AllocationRecorder._alloc, fw.AllocationRecorder.__enter__, fw.replay_allocations = _alloc, _enter, _replay

        def chunk(name: str, kind: str | None):
            orig = getattr(fw._FakeTrainer, name)

            def run(self, st, mod, *a):
                s, mb, k = (a[0], a[1], kind) if kind else (a[1], a[2], a[0])
                r = recorder.get("r")
                if r is not None:
                    marks.append((len(r.events), k, s, mb))
                try:
                    return orig(self, st, mod, *a)
                finally:
                    if r is not None:
                        marks.append((len(r.events), "end", s, mb))
            setattr(fw._FakeTrainer, name, run)
        chunk("_forward_chunk", "F")
        chunk("_backward_chunk", None)  # (kind "B" or "I", stage, microbatch)
        chunk("_weight_chunk", "W")
        rec = fw.simulate_rank(cfg, rank)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    events = out["events"]
    offset = len(events) - len(recorder["r"].events)  # the buckets and receive buffers laid first
    return {"events": events, "info": info, "marks": [(i + offset, k, s, mb) for i, k, s, mb in marks],
            "max_allocated": rec["allocator"]["max_allocated"]}


def fake_actions(doc: dict) -> list[tuple[tuple, int, int]]:
    """Per action of the recording: ((kind, stage, microbatch), most live bytes inside it, the event index there); an
    unpipelined rank's whole step as ("step", 0, 0)."""
    events, marks = doc["events"], doc["marks"] or [(0, "step", 0, 0), (len(doc["events"]), "end", 0, 0)]
    starts = {}
    for i, kind, s, mb in marks:
        starts.setdefault(i, []).append((kind, s, mb))
    live, cur, rows, open_ = {}, 0, [], None
    for i in range(len(events) + 1):
        for kind, s, mb in starts.get(i, ()):
            if kind == "end":
                if open_ is not None:
                    rows.append(tuple(open_))
                open_ = None
            else:
                open_ = [(kind, s, mb), cur, i]
        if i == len(events):
            break
        e = events[i]
        if e[0] == "alloc":
            live[e[1]] = e[2]
            cur += e[2]
        else:
            cur -= live.pop(e[1], 0)
        if open_ is not None and cur > open_[1]:
            open_[1], open_[2] = cur, i
    return rows


def engine_actions(cfg, rank: int) -> list[tuple[tuple, int]]:
    """Per action of the engine's timeline of ``rank``: ((kind, stage, microbatch), most live tracked bytes over its
    moments but the end of the backward and the optimizer step)."""
    from engine.memory.lifetimes import ACTION_KINDS, END, REDUCE, STEP, _live_bytes, sig_moments
    from engine.memory.per_rank import memory_per_rank

    body = next(r for r in memory_per_rank(cfg).per_rank if r.rank == rank)._body
    sig = body.timeline.signature
    mo = sig_moments(sig)
    live = _live_bytes(sig) + sig.step_bytes
    rows: list[list] = []
    for i in range(len(live)):
        if int(mo.phase[i]) in (END, STEP, REDUCE):
            continue
        key = (ACTION_KINDS[int(mo.kind[i])], int(mo.stage[i]), int(mo.microbatch[i]))
        if rows and rows[-1][0] == key:
            rows[-1][1] = max(rows[-1][1], int(live[i]))
        else:
            rows.append([key, int(live[i])])
    return [tuple(r) for r in rows]


def explain(doc: dict, at: int, top: int) -> list[tuple[int, int, tuple]]:
    """(bytes, tensors, (reference type, op, module, F/BW)) alive at event ``at``, largest first."""
    live: dict = {}
    for e in doc["events"][:at + 1]:
        if e[0] == "alloc":
            live[e[1]] = e[2]
        else:
            live.pop(e[1], None)
    size, count = collections.Counter(), collections.Counter()
    for key, nbytes in live.items():
        op, ref, module, bw = doc["info"].get(key, ("-", "before the step", "", False))
        group = (ref, op, module, "BW" if bw else "FW")
        size[group] += nbytes
        count[group] += 1
    return [(nbytes, count[g], g) for g, nbytes in size.most_common(top)]


def render(fake: list, engine: list) -> str:
    gib = 2**30
    lines = [f"{'#':>3}  {'action':14} {'fake GiB':>9} {'engine GiB':>10} {'engine − fake':>13}"]
    for k, (key, most, _) in enumerate(fake):
        name = "step" if key[0] == "step" else f"{key[0]} st{key[1]} mb{key[2]}"
        e = next((x for x in engine if x[0] == key), None) if key[0] != "step" else (None, max(x[1] for x in engine))
        lines.append(f"{k:>3}  {name:14} {most / gib:9.3f} " + (f"{e[1] / gib:10.3f} {(e[1] - most) / gib:+13.3f}"
                                                                  if e else f"{'—':>10} {'—':>13}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from engine.config import Config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("rank", type=int)
    ap.add_argument("--explain", type=int, metavar="K", help="what is alive at action K's fake peak")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--save", metavar="F.pkl", help="keep the recording")
    ap.add_argument("--load", metavar="F.pkl", help="read a kept recording instead of simulating")
    args = ap.parse_args(argv)
    cfg = Config.load(args.config)
    if args.load:
        doc = pickle.loads(Path(args.load).read_bytes())
    else:
        doc = record(cfg, args.rank)
        if args.save:
            Path(args.save).write_bytes(pickle.dumps(doc))
    fake = fake_actions(doc)
    print(f"rank {args.rank}: the fake's max_allocated {doc['max_allocated'] / 2**30:.3f} GiB")
    print(render(fake, engine_actions(cfg, args.rank)))
    if args.explain is not None:
        key, most, at = fake[args.explain]
        print(f"\nalive at action {args.explain}'s fake peak ({most / 2**30:.3f} GiB, event {at}):")
        for nbytes, n, (ref, op, module, phase) in explain(doc, at, args.top):
            print(f"  {nbytes / 2**30:8.3f} GiB ×{n:<4} {ref:16} {op:40} {phase} {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
