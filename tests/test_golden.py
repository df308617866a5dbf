"""The engine held to its recorded golden corpus (tests/golden/make_corpus.py): every rank's
memory by category, byte for byte, and the step's seconds, for 480 random valid configs over
every preset, strategy, schedule, precision, LoRA and DataParallel, and 128 full-size layouts of the
fake sweep's draw (seeds 20261300-02: mixtures of experts, expert and context parallelism, ZeRO-3's
reshard policy, float8, compile)."""

import gzip
import json
from pathlib import Path

import pytest

from engine import Config, names
from engine.predict import predict

CORPUS = Path(__file__).parent / "golden" / "corpus.json.gz"
ENTRIES = json.load(gzip.open(CORPUS, "rt", encoding="utf-8"))["entries"]


def test_corpus_covers_what_it_claims():
    assert len(ENTRIES) >= 400
    cfgs = [Config.from_dict(e["config"]) for e in ENTRIES]
    assert {c.model.preset for c in cfgs} >= {"tiny", "gpt2-124m", "llama2-7b", "llama3-8b", "llama3-70b",
                                               "llama3-405b"}
    assert {c.parallel.schedule for c in cfgs if c.parallel.pp > 1} == set(names.SCHEDULES)
    assert {c.parallel.zero for c in cfgs} == {0, 1, 2, 3}
    assert {c.training.precision for c in cfgs} == set(names.PRECISIONS)
    assert any(c.training.finetune == "lora" for c in cfgs)
    assert any(c.parallel.dp_mode == "dataparallel" for c in cfgs)
    # the fake sweep's draws (make_corpus.py --add-sweep): what the first generator does not reach
    assert sum(c.parallel.cp > 1 for c in cfgs) >= 10 and sum(c.parallel.ep > 1 for c in cfgs) >= 10
    assert any(c.model.experts for c in cfgs) and any(c.training.float8 != "none" for c in cfgs)
    assert any(c.parallel.pp > 1 and c.parallel.zero == 3 and c.parallel.fsdp_reshard_after_forward == "always"
               for c in cfgs)


@pytest.mark.parametrize("i", range(len(ENTRIES)))
def test_prediction_equals_golden(i):
    entry = ENTRIES[i]
    pred = predict(Config.from_dict(entry["config"]))
    got = [[getattr(r, c) for c in names.MEMORY_CATEGORIES] + [r.total] for r in pred.memory.per_rank]
    assert got == entry["memory"]
    assert pred.step.seconds == entry["step_seconds"]
