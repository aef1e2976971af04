"""bench/routing's workloads: what shares a prefix does, and the same seed repeats."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

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
