"""Which rank caused a failed run, and what happened to it (torch-free: the launchers use it).

When one rank dies, the others fail after it: gloo reports "Connection reset by peer", and
torch.distributed.pipelining wraps that into "Failed to run stage backward", which does not look
like a communication error at all. The first death is the cause. The evidence:

* each rank's own ``failed`` event (its exception and the time it was reported);
* torchrun's failure summary in the agent log: every failed rank with its exit code and the time
  the agent saw it (seconds), and its "Root Cause (first observed failure)".

The order of blame:
1. a rank that died by a signal the launcher did not send (anything but SIGTERM, which torchrun
   sends to the survivors; the OOM killer sends SIGKILL) and reported nothing itself, unless a
   rank reported its own (non-communication) exception more than ``AGENT_LAG_S`` before the agent
   saw the death (the agent notices a death up to its monitor interval late and logs whole
   seconds, while the victims' errors follow the death at once) — the earliest such death wins
   over the exceptions that follow it on other ranks;
2. a rank that reported its own exception (communication errors are a victim's words), earliest first;
3. any rank that reported a failure;
4. torchrun's own root cause.
"""

from __future__ import annotations

import re
import signal
import time

#: one entry of torchrun's failure summary: its time, rank and exit code
_SUMMARY_ENTRY = re.compile(r"time\s*:\s*(\S+)\s*\n(?:.*\n)*?\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)")
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
#: how much earlier than torchrun's logged time of a death an exception must be to have come first
AGENT_LAG_S = 3.0
#: a rank reporting one of these is usually a victim of another rank's death, not the cause
SECONDARY = re.compile(r"Connection (reset|closed|refused)|Broken pipe|ProcessGroup|timed out|timeout|"
                       r"Socket|peer", re.I)


def signal_name(code: int) -> str:
    """``-9`` → ``SIGKILL`` (torchrun's negative exit codes are signals)."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def summary_exits(agent_log: str) -> list[tuple[float | None, int, int]]:
    """(time seen or None, rank, exit code) of every entry in torchrun's failure summaries, in log order."""
    out = []
    for m in _SUMMARY_ENTRY.finditer(agent_log):
        try:
            seen: float | None = time.mktime(time.strptime(m.group(1), "%Y-%m-%d_%H:%M:%S"))
        except ValueError:
            seen = None
        out.append((seen, int(m.group(2)), int(m.group(3))))
    return out


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}–{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def blame(rank_events: dict[int, list[dict]], agent_log: str) -> tuple[int | None, str]:
    """The rank that most likely caused a failure, and what happened to it (see the module docstring)."""
    failed = sorted((e.get("time", 0.0), r, e.get("reason", "")) for r, evs in rank_events.items() for e in evs
                    if e.get("event") == "failed")
    reported = {r for _, r, _ in failed}
    primary = [(t, r, why) for t, r, why in failed if not SECONDARY.search(why)]
    deaths = sorted(((seen, r, code) for seen, r, code in summary_exits(agent_log)
                     if code < 0 and -code != signal.SIGTERM and r not in reported),
                    key=lambda x: (x[0] is None, x[0] or 0.0))
    if deaths:
        seen, r, code = deaths[0]
        # an exception reported well before the agent saw the death came first; without the agent's
        # time the order is unknown and the rank's own exception keeps the blame
        earlier = [p for p in primary if seen is None or p[0] < seen - AGENT_LAG_S]
        if not earlier:
            after = sorted({fr for _, fr, _ in failed})
            words = f"was killed by {signal_name(code)}, a signal the launcher did not send"
            if code == -signal.SIGKILL:
                words += " (the kernel's out-of-memory killer sends SIGKILL)"
            if after:
                words += f"; the errors on {_ranks(after)} followed it"
            return r, words
    if primary:
        _, r, why = primary[0]
        return r, f"failed: {why}"
    if failed:
        _, r, why = failed[0]
        return r, f"failed: {why}"
    m = _ROOT_CAUSE.search(agent_log)
    if m:
        r, code = int(m.group(1)), int(m.group(2))
        return r, (f"was killed by {signal_name(code)}" if code < 0 else f"exited with code {code}")
    return None, ""
