"""bench/routing's workloads: what shares a prefix does, and the same seed repeats; and
bench/prefix_cost.py's smoke run."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.routing import workload  # noqa: E402

sys.path.remove(str(ROOT))


def prompts(name: str, n: int, seed: int = 1) -> list[str]:
    source, rng = workload.WORKLOADS[name].source(), random.Random(seed)
    return [json.loads(source.draw(rng, i)[1])["prompt"] for i in range(n)]


def test_each_chat_turn_resends_the_history_of_its_conversation() -> None:
    drawn = prompts("chat", 600)
    extended = sum(
        any(later.startswith(earlier) for later in drawn[i + 1 :])
        for i, earlier in enumerate(drawn)
    )
    assert extended > 300  # most turns come back as the start of a later one
    assert all(p.startswith("<|system|>\n") and p.endswith("<|assistant|>\n") for p in drawn)


def test_tenants_share_system_prompts_zipf_and_hot() -> None:
    def tenant_shares(name: str) -> list[float]:
        counts = Counter(p.split(":", 1)[0] for p in prompts(name, 4000))
        return [n / 4000 for _, n in counts.most_common()]

    zipf, hot = tenant_shares("tenants"), tenant_shares("tenants-hot")
    assert 0.12 < zipf[0] < 0.26 and zipf[0] > 1.5 * zipf[1]
    assert 0.45 < hot[0] < 0.55
    lengths = [len(p) for p in prompts("tenants", 50)]
    assert min(lengths) > 1000 * 4  # 1-4k tokens of words of about 5 characters


def test_the_same_seed_gives_the_same_requests() -> None:
    for name in workload.WORKLOADS:
        assert prompts(name, 50, seed=3) == prompts(name, 50, seed=3)
        assert prompts(name, 50, seed=3) != prompts(name, 50, seed=4)


@pytest.mark.timeout(120)
def test_prefix_cost_quick_mode_runs() -> None:
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "bench/prefix_cost.py", "--quick", "--chunk-chars", "256,512"]
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    # per workload and fleet size: lor, then prefix at each chunk size
    assert [r[2] for r in rows] == ["lor", "prefix", "prefix"] * 4
    assert all(float(r[-3]) > 0 for r in rows)  # µs per request
    assert all(float(r[-1]) > 0 for r in rows if r[2] == "prefix")  # blocks held
