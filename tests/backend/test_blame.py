"""Root cause of a failed run: the first death wins over the errors that follow it on other ranks."""

from __future__ import annotations

import time

from backend.blame import blame, summary_exits

SUMMARY = """\
Failures:
[1]:
  time      : 2026-12-01_06:52:20
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 7707)
  error_file: <N/A>
[3]:
  time      : 2026-12-01_06:52:20
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 7709)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_06:52:20
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 7706)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 7706
"""
SEEN = time.mktime(time.strptime("2026-12-01_06:52:20", "%Y-%m-%d_%H:%M:%S"))


def failed(t, why):
    return [{"event": "failed", "time": t, "reason": why}]


def test_summary_entries_are_read_with_their_times():
    assert summary_exits(SUMMARY) == [(SEEN, 1, 1), (SEEN, 3, 1), (SEEN, 0, -9)]


def test_a_sigkilled_rank_wins_over_the_pipeline_error_that_follows_it():
    # the default dp2 × pp2: rank 0 killed mid-backward; rank 3's pipeline stage wraps gloo's error
    events = {1: failed(SEEN + 0.3, "RuntimeError: Connection reset by peer"),
              3: failed(SEEN + 0.2, "RuntimeError: Failed to run stage backward")}
    rank, why = blame(events, SUMMARY)
    assert rank == 0
    assert why.startswith("was killed by SIGKILL, a signal the launcher did not send")
    assert "out-of-memory killer" in why and "ranks 1, 3 followed it" in why


def test_an_exception_well_before_the_death_keeps_the_blame():
    events = {3: failed(SEEN - 5.0, "ValueError: bad batch")}
    assert blame(events, SUMMARY) == (3, "failed: ValueError: bad batch")


def test_the_agent_seeing_a_death_late_does_not_shift_the_blame():
    # the victim's pipeline error is logged in the second before torchrun's summary time of the death
    events = {1: failed(SEEN - 0.6, "RuntimeError: Failed to run stage backward")}
    assert blame(events, SUMMARY)[0] == 0


def test_sigterm_is_the_launchers_own_and_never_blamed():
    log = SUMMARY.replace("exitcode  : -9 (pid: 7706)  (SIGKILL)", "exitcode  : -15 (pid: 7706)  (SIGTERM)")
    events = {3: failed(SEEN + 0.2, "RuntimeError: Failed to run stage backward")}
    assert blame(events, log) == (3, "failed: RuntimeError: Failed to run stage backward")


def test_without_rank_words_the_root_cause_is_used():
    assert blame({}, SUMMARY)[0] == 0
    assert blame({}, "") == (None, "")
    assert blame({}, "Root Cause\n rank : 2\n exitcode : 7") == (2, "exited with code 7")
