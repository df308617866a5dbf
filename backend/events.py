"""A run's events in words: the one sentence the CLI, the cluster follower and the window print.

Every event a run emits (``backend.records`` lists them; each is a dict with ``event`` and
``time``) has a sentence here, for a local run, a simulation on a fake process group and a
Slurm or hosts run alike. ``events.jsonl`` keeps the JSON as it was; only what is shown to a
person goes through :func:`describe`. A field an event lacks is left out of its sentence
rather than failing, and an event kind this module does not know is still printed as words
(its fields as ``name value``), never as a JSON dict. No torch and no Qt here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MIB = 2**20


def _ms(seconds: Any) -> str:
    return f"{float(seconds) * 1000:.1f} ms" if isinstance(seconds, (int, float)) else ""


def _words(value: Any) -> str:
    """A field's value as plain words: lists joined by commas, mappings as ``name value``."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_words(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_words(v) for v in value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _join(*parts: str) -> str:
    return "  ".join(p for p in parts if p)


def _started(ev: dict) -> str:
    world, steps = ev.get("world"), ev.get("steps")
    where = f" -> {ev['run_dir']}" if ev.get("run_dir") else ""
    if ev.get("simulated"):
        ranks = ev.get("ranks")
        which = f"ranks {_words(ranks)} of {world}" if ranks else f"{world} ranks"
        return f"simulating {which} on a fake process group (memory only){where}"
    how = f", {steps} steps" if steps is not None else ""
    if ev.get("processes") is not None and ev["processes"] != world:
        return (f"started {ev['processes']} process driving {world} GPUs "
                f"({'nn.DataParallel' if ev.get('dp_mode') == 'dataparallel' else ev.get('dp_mode')}){how}{where}")
    if ev.get("nodes") is not None:
        target = f" ({ev['target']})" if ev.get("target") else ""
        return f"started {world} ranks on {ev['nodes']} node(s){target}{how}{where}"
    return f"started {world if world is not None else 'the'} ranks{how}{where}"


def _rank_ready(ev: dict) -> str:
    stages = ev.get("stages")
    return f"rank {ev.get('rank')} ready" + (f" (stages {_words(stages)})" if stages is not None else "")


def _step(ev: dict) -> str:
    k, n = ev.get("k", ev.get("step")), ev.get("n", ev.get("steps"))
    loss = ev.get("loss")
    loss_text = "" if loss is None else (f"loss {loss:.4f}" if isinstance(loss, (int, float)) else f"loss {loss}")
    return _join(f"step {k}/{n}", loss_text, _ms(ev.get("seconds")))


def _measurement(ev: dict) -> str:
    mib = ", ".join(f"{b / MIB:.1f}" for b in ev.get("total_bytes") or [])
    path = f"  ({ev['path']})" if ev.get("path") else ""
    nodes = [n for n in ev.get("nodes") or [] if n]
    on = f"; nodes {', '.join(map(str, nodes))}" if nodes else ""
    if ev.get("simulated") and ev.get("step_seconds") is None:
        return f"simulated: MiB per rank: {mib}{on}{path}"
    step = f"step {_ms(ev['step_seconds'])}; " if ev.get("step_seconds") is not None else ""
    return f"measured: {step}MiB per rank: {mib}{on}{path}"


def _finished(ev: dict) -> str:
    seconds = ev.get("seconds")
    return f"finished in {seconds:.1f} s" if isinstance(seconds, (int, float)) else "finished"


def _failed(ev: dict) -> str:
    where = f" (rank {ev['rank']})" if ev.get("rank") is not None else ""
    text = f"FAILED{where}: {ev.get('reason') or 'the run failed'}"
    if ev.get("log_tail"):
        text += "\n--- log tail ---\n" + ev["log_tail"]
    return text


def _cancelled(ev: dict) -> str:
    return f"CANCELLED: {ev.get('reason') or 'cancelled by the user'}"


def _rank_failed(ev: dict) -> str:
    return f"rank {ev.get('rank')} reported a failure: {ev.get('reason') or 'no reason given'}"


def _rank_started(ev: dict) -> str:
    return f"rank {ev.get('rank')} started" + (f" (pid {ev['pid']})" if ev.get("pid") is not None else "")


def _rank_done(ev: dict) -> str:
    seconds = ev.get("seconds")
    return f"rank {ev.get('rank')} done" + (f" in {seconds:.1f} s" if isinstance(seconds, (int, float)) else "")


def _submitted(ev: dict) -> str:
    script = f" ({ev['script']})" if ev.get("script") else ""
    return f"submitted Slurm job {ev.get('job_id')}{script}"


def _job_state(ev: dict) -> str:
    why = f" ({ev['reason']})" if ev.get("reason") and ev["reason"] != "None" else ""
    where = f" on {ev['nodes']}" if ev.get("nodes") and ev.get("state") == "RUNNING" else ""
    return f"job {ev.get('job_id')}: {ev.get('state')}{why}{where}"


def _rank_node(ev: dict) -> str:
    node_rank = f" (node rank {ev['node_rank']})" if ev.get("node_rank") is not None else ""
    return f"rank {ev.get('rank')} on {ev.get('node')}{node_rank}"


def _node_command(ev: dict) -> str:
    head = ", the rendezvous host" if ev.get("node") == 0 else ""
    return f"# on {ev.get('host')} (node {ev.get('node')}{head}):\n{ev.get('shell', '')}"


def _waiting(ev: dict) -> str:
    return str(ev.get("message") or "waiting")


def _phase(ev: dict) -> str:
    return str(ev.get("message") or "working")


def _log(ev: dict) -> str:
    return str(ev.get("text", ""))


#: every event kind a run emits, and its sentence
SENTENCES: dict[str, Callable[[dict], str]] = {
    # a run's events.jsonl (local, simulated and cluster runs)
    "started": _started,
    "rank_ready": _rank_ready,
    "step": _step,
    "measurement": _measurement,
    "finished": _finished,
    # what a local run is doing when it has said nothing for a while (backend.launch.HEARTBEAT_S)
    "phase": _phase,
    "failed": _failed,
    "cancelled": _cancelled,
    # a rank's own failure, forwarded by the launcher while the run winds down
    "rank_failed": _rank_failed,
    # what each rank writes under ranks/ (rank{r}.events.jsonl)
    "rank_started": _rank_started,
    "rank_done": _rank_done,
    # cluster runs (backend.cluster)
    "submitted": _submitted,
    "job_state": _job_state,
    "rank_node": _rank_node,
    "node_command": _node_command,
    "waiting": _waiting,
    # a line a child process printed that is not an event (the window's log)
    "log": _log,
}

#: fields every event carries that say nothing to a person
_BOOKKEEPING = ("event", "time")


def describe(event: dict) -> str:
    """One line (a failure adds its log tail, a host command its shell line) for ``event``."""
    kind = event.get("event")
    sentence = SENTENCES.get(kind)
    if sentence is not None:
        return sentence(event)
    rest = {k: v for k, v in event.items() if k not in _BOOKKEEPING}
    return _join(str(kind or "event"), _words(rest))
