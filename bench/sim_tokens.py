"""How the simulator's token counts compare with a real byte-level BPE tokenizer's.

No tokenizer is downloaded: one is trained here, with the ``tokenizers`` package, the
way GPT-2-style tokenizers are (byte-level BPE, GPT-2's pre-tokenizer), on the
docstrings of this Python's standard library (and the text files under each
``--corpus DIR``: .md, .rst, .txt, .html with its tags taken out), every tenth file
held out. Then each
text set is counted by both, and the table shows the simulator's count over the BPE
count (1.00: the same; the README's and --help's claim, ``engine.tokens.ACCURACY_PCT``,
is the worst prose set's distance from 1.00):

    heldout   the held-out files (English technical prose)
    docs      this repository's README.md and docs/*.md (not seen in training)
    sim       the simulator's own output (each token one word; the BPE should agree)

    .venv/bin/pip install tokenizers && .venv/bin/python bench/sim_tokens.py   # ~20 s
    .venv/bin/python bench/sim_tokens.py --corpus /usr/share/doc/rust/html/book
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import html
import json
import re
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import tokens
from engine.base import EngineRequest, SamplingParams
from engine.settings import SimSettings
from engine.sim import SimEngine

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "sim_tokens.json"


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    return [d for n in nodes if (d := ast.get_docstring(n))]


TEXT_SUFFIXES = (".md", ".rst", ".txt", ".html", ".htm")
TAG = re.compile(r"<script.*?</script>|<style.*?</style>|<[^>]+>", re.S | re.I)


def file_texts(path: Path) -> list[str]:
    if path.suffix == ".py":
        return docstrings(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix in (".html", ".htm"):
        text = re.sub(r"\n\s*\n+", "\n\n", html.unescape(TAG.sub(" ", text)))
    return [text]


def corpus(extra: list[Path]) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): every tenth file held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts
    )
    for folder in extra:
        files += sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES)
    train: list[str] = []
    heldout: list[str] = []
    for i, path in enumerate(files):
        (heldout if i % 10 == 0 else train).extend(file_texts(path))
    return train, heldout


def train_bpe(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


async def sim_text(n_tokens: int) -> str:
    settings = SimSettings(decode_step_ms=0, decode_ms_per_seq=0, prefill_ms_per_token=0)
    async with SimEngine(settings) as engine:
        request = EngineRequest("t", prompt="Once", sampling=SamplingParams(max_tokens=n_tokens))
        return "".join([d.text async for d in engine.generate(request)])


def compare(name: str, texts: list[str], bpe: Any) -> dict[str, Any]:
    chars = sum(len(t) for t in texts)
    real = sum(len(e.ids) for e in bpe.encode_batch(texts, add_special_tokens=False))
    started = time.perf_counter()
    counter = tokens.TokenCounter()  # as the simulator counts: with its piece cache
    sim = sum(map(counter, texts))
    elapsed = time.perf_counter() - started
    return {
        "set": name,
        "texts": len(texts),
        "chars": chars,
        "bpe_tokens": real,
        "sim_tokens": sim,
        "ratio": sim / real,
        "chars_per_bpe_token": chars / real,
        "sim_count_us_per_kchar": elapsed / chars * 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=50_000)
    parser.add_argument("--corpus", type=Path, action="append", default=[])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    train, heldout = corpus(args.corpus)
    started = time.perf_counter()
    bpe = train_bpe(train, args.vocab_size)
    trained_s = time.perf_counter() - started
    docs = [p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]]
    rows = [
        compare("heldout", heldout, bpe),
        compare("docs", docs, bpe),
        compare("sim", [asyncio.run(sim_text(5000))], bpe),
    ]
    print(f"byte-level BPE, vocabulary {bpe.get_vocab_size()}, trained on "
          f"{sum(len(t) for t in train) / 1e6:.1f} M chars in {trained_s:.0f} s")  # fmt: skip
    print(
        f"{'set':8} {'chars':>10} {'bpe':>9} {'sim':>9} {'sim/bpe':>8} {'chars/tok':>9} {'us/kchar':>9}"
    )
    for r in rows:
        print(f"{r['set']:8} {r['chars']:>10} {r['bpe_tokens']:>9} {r['sim_tokens']:>9} "
              f"{r['ratio']:>8.3f} {r['chars_per_bpe_token']:>9.2f} {r['sim_count_us_per_kchar']:>9.1f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "vocab_size": bpe.get_vocab_size(),
        "train_chars": sum(map(len, train)),
        "corpus": ["stdlib docstrings", *map(str, args.corpus)],
        "rows": rows,
    }
    args.out.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
