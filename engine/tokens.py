"""Token counts that behave like a real BPE tokenizer's, without a tokenizer.

Text is split the way GPT-2-style byte-level BPE tokenizers pre-split it (a word with
its leading space, a run of digits, a run of punctuation, a run of whitespace,
English contractions), and each piece counts as the tokens such vocabularies give
it: a common English word or any word of up to 8 letters is one token, 9 to 12
letters two, 13 to 16 three and so on; digits one token per 3, punctuation one per 2,
letters of other scripts one per 2. That is an estimate for real tokenizers and the exact
tokenizer of the simulator, whose output tokens are the common words with a leading
space (``WORDS``), one token each. Measured against a byte-level BPE with a 50,000
vocabulary trained on 9 M characters of English technical prose
(``bench/sim_tokens.py``): 1.07 times its count on held-out prose, 0.91 times on this
repository's docs; with a 24,000 vocabulary trained on Python's docstrings alone, 1.04
and 0.89. So within ``ACCURACY_PCT`` % on English technical prose: the one figure the
README and ``--help`` give.

Counts add up across a piece boundary: ``count(a + b) == count(a) + count(b)``
whenever ``b`` starts with a space followed by a letter, which every simulator token
does. So the prompt of a resumed request (the original prompt plus the output
delivered so far) counts exactly the original prompt's tokens plus the delivered ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import EngineUnavailable

# How far the built-in count is from a byte-level BPE's on English technical prose, in
# percent: the worst of bench/sim_tokens.py's prose sets (docs 0.89, 2026-11-26).
ACCURACY_PCT = 11

# Common English words, each one token (with a leading space) in the usual BPE
# vocabularies: the simulator's output vocabulary. Order is the token id; append only.
_WORD_LIST = """
    the of and to in is was for that on as with by he at it from his an are were be this
    which or had not but also have one their they first has new its after two been who
    other all time can more when there her she into during some only would most between
    over year years these all about such made many where while under may city state both
    used then three later age team than through school including well around called known
    part before season world since each him same well no out any film up number because
    them being area war people second both against due high following name so what early
    however national work until back several based four released family group series due
    music among life will game album became music small took left long like five end day
    house left united until university set last former did without against could de how
    great found served line music even within member way took day best along place major
    south north east west power main single use much another general public among did down
    river town population played life often show top won led old long year there field
    good take make come go see know get give find think tell become leave feel put bring
    begin keep hold write stand hear let mean meet run pay sit speak lie lead read grow
    lose fall send build understand draw break spend cut rise drive buy wear choose seek
    throw catch deal win forget sell fight teach eat kill open close walk talk turn start
    show try ask need seem help play move live believe happen include continue change
    watch follow stop create learn offer remember love consider appear wait serve die
    expect stay reach remain suggest raise pass report decide pull return explain hope
    develop carry join agree thank receive support produce mention allow provide plan
    water light night money story fact month lot right study book eye job word business
    issue side kind head house service friend father power hour game line end member law
    car city community name president team minute idea kid body information back parent
    face others level office door health person art war history party result change
    morning reason research girl guy moment air teacher force education foot boy age policy
    process music market sense nation plan college interest death experience effect class
    control care field development role effort rate heart drug show leader light voice wife
    police mind price report decision son view relationship town road arm difference value
    building action model season society tax director position player record paper space
    ground form event official matter center couple site project activity star table need
    court oil situation cost industry figure street image phone data picture practice piece
    land product doctor wall patient worker news test movie north love support technology
    step baby computer type attention film tree source organization hair window evidence
    population truth song room mother problem system program question government company
    number point home water student country group woman hand place case week child man day
    thing life world school state family way year time people good little big old different
    small large young important few public bad same able last long great right early other
    next local sure free better true whole real best human late hard major clear recent
    certain personal open red difficult available likely short single medical current wrong
    private past foreign fine common poor natural significant similar hot dead central happy
    serious ready simple left physical general environmental financial blue democratic dark
    various entire close legal religious cold final main green nice huge popular traditional
    cultural quickly often always never really almost together already usually sometimes
    actually probably perhaps simply finally especially exactly certainly recently clearly
    very just still even also much well back only then now here there again away however
"""
# A word may appear twice in the list above; the first one counts, so ids stay stable.
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_LIST.split()))

_COMMON = frozenset(WORDS)
# GPT-2's pre-tokenizer, with \p{L} as [^\W\d_] and \p{N} as \d.
_PIECE = re.compile(r"""'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def _letters(piece: str) -> int:
    word = piece[1:] if piece[0] == " " else piece
    if not word.isascii():
        return (len(word) + 1) // 2
    if word.lower() in _COMMON:
        return 1
    return 1 + max(0, len(word) - 5) // 4


def _piece_tokens(piece: str) -> int:
    last = piece[-1]
    if last.isalpha():
        return _letters(piece)
    if last.isdigit():
        return (len(piece) - (piece[0] == " ") + 2) // 3
    if last.isspace():
        return 1
    if piece[0] == "'" and piece[1:].isalpha():
        return 1  # a contraction
    return (len(piece) + 1) // 2


def count(text: str) -> int:
    """The number of tokens in ``text`` (see the module docstring); 0 for ""."""
    return sum(map(_piece_tokens, _PIECE.findall(text)))


class _PieceCounts(dict[str, int]):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self._limit = limit

    def __missing__(self, piece: str) -> int:
        n = _piece_tokens(piece)
        if len(self) < self._limit:
            self[piece] = n
        return n


class TokenCounter:
    """``count`` for an engine: the same numbers, with the count of each piece kept
    (up to ``cache_size`` pieces), which makes it about twice as fast on real text;
    what remains is mostly the regex split (``re`` in C, a few MB/s)."""

    def __init__(self, cache_size: int = 1 << 16) -> None:
        self._counts = _PieceCounts(cache_size)

    def __call__(self, text: str) -> int:
        return sum(map(self._counts.__getitem__, _PIECE.findall(text)))

    def block_ends(self, text: str, size: int) -> list[int]:
        """Where in ``text`` each full block of ``size`` tokens ends: at the end of the
        piece that fills it (a piece's tokens are not split; the excess counts toward
        the next block, so block k ends near token k * size)."""
        ends: list[int] = []
        counts = self._counts
        n = 0
        for match in _PIECE.finditer(text):
            n += counts[match.group()]
            while n >= size:
                ends.append(match.end())
                n -= size
        return ends


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What the simulator generates (each output token one token of ``count``)."""

    name: str
    texts: tuple[str, ...]  # each output token's text: a word with a leading space
    ids: tuple[int, ...]  # its token id
    count: Callable[[str], int]


def builtin() -> Vocabulary:
    """``WORDS`` as ids 0.., counted by a ``TokenCounter``."""
    texts = tuple(" " + word for word in WORDS)
    return Vocabulary("built-in", texts, tuple(range(len(texts))), TokenCounter())


_WHOLE_WORD = re.compile(r" [a-z]{2,12}")
MAX_WORDS = 4000  # of a real tokenizer: its earliest merges, the most common words
MIN_WORDS = 100
SETTING = "engine.sim.tokenizer"  # what a tokenizer that will not do is a problem of


def from_tokenizer_json(path: Path) -> Vocabulary:
    """A Hugging Face ``tokenizers`` file: its counts, and as output tokens its
    lowercase words with a leading space that it encodes as one token (the lowest ids,
    which byte-level BPE merged first). Blocking: load it off the event loop."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise EngineUnavailable("--sim-tokenizer needs the tokenizers package", SETTING) from exc
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # its errors are plain Exceptions
        raise EngineUnavailable(f"{file}: cannot load the tokenizer: {exc}", SETTING) from exc
    texts, ids = _whole_words(tok)
    if len(texts) < MIN_WORDS:
        raise EngineUnavailable(
            f"{file}: only {len(texts)} words with a leading space are one token each; "
            f"the simulator needs {MIN_WORDS} (a byte-level BPE tokenizer has thousands)",
            SETTING,
        )

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return Vocabulary(str(file), texts, ids, count_tokens)


def _whole_words(tok: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    by_id = sorted(tok.get_vocab(with_added_tokens=False).values())
    candidates = [(tok.decode([i]), i) for i in by_id]
    candidates = [(t, i) for t, i in candidates if _WHOLE_WORD.fullmatch(t)]
    encoded = tok.encode_batch([t for t, _ in candidates], add_special_tokens=False)
    words = [(t, i) for (t, i), e in zip(candidates, encoded, strict=True) if e.ids == [i]]
    words = words[:MAX_WORDS]
    return tuple(t for t, _ in words), tuple(i for _, i in words)
