"""A continuous-batching simulator of an LLM engine: tests, demos, benchmarks, capacity planning.

It models what a router can see of a vLLM-like engine: ``max_num_seqs`` batch slots, a
waiting queue in order of priority (``EngineRequest.priority``, lower first, as vLLM's
priority scheduling) then arrival, a prefill cost per prompt token, and a decode step
whose time grows with the batch; every running sequence gets one token per step. The
text is common English words, each one token of the simulator's tokenizer
(``engine.tokens``, which counts like a real BPE tokenizer): token k is a function of the engine seed, the
request's seed and the whole context before it (prompt or chat template, then the
output so far), so the same request gives the same text in any process, and a
request resumed with its output so far appended continues exactly as it would have.
A prefix cache (``engine.prefix_cache``: KV blocks, LRU) makes prefill cost only the
prompt tokens not already cached, shared across requests; its hit rate is in
``stats()``. As vLLM under ``--scheduling-policy priority``, a waiting request of a
higher priority takes the slot of the running request of the lowest priority (the
latest of them) when every slot is taken: that one goes back to the head of its class
in the waiting queue, its stream paused, and resumes where it was once a slot frees
(re-prefilling its prompt and output, less what the prefix cache holds); it never
fails. Requests of one priority never preempt each other. The scheduling and the step
times are ``engine.sim_model.StepModel``'s, the capacity planner's model too; this
class drives it on the event loop and makes the text. Fault knobs make every request
fail after N tokens (error), the scheduler stop stepping (hang) or the whole engine
die (crash).

The hang and crash knobs count requests admitted since ``start()`` (``generate()``
calls that began); a knob of N trips as the N-th begins, and 0 trips at ``start()``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from engine import tokens
from engine.base import Engine, EngineRequest, EngineStats, TokenDelta
from engine.errors import EngineDeadError, EngineError
from engine.kv_events import KVEvents
from engine.prefix_cache import PrefixCache
from engine.settings import SimSettings
from engine.sim_api import SimFrontend
from engine.sim_model import State, StepModel

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "unitproxy-sim"
# Undelivered deltas a sequence may hold before it stops decoding until its reader catches up.
MAX_BACKLOG = 256

# Behind schedule by more than this (a paused loop), the debt is dropped instead of
# being paid back as a burst of instant steps.
_MAX_LAG_S = 0.1


@dataclass(frozen=True, slots=True)
class _Tables:
    """A vocabulary as the decode loop reads it: built once, no allocation per token."""

    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    text_bytes: tuple[bytes, ...]  # what a token adds to the context hash after text
    id_bytes: tuple[bytes, ...]  # and after a prompt of token ids
    count: Callable[[str], int]

    @classmethod
    def of(cls, vocab: tokens.Vocabulary) -> _Tables:
        return cls(
            vocab.texts,
            tuple((i,) for i in vocab.ids),
            tuple(t.encode() for t in vocab.texts),
            tuple(i.to_bytes(4, "little") for i in vocab.ids),
            vocab.count,
        )


# The chat template: the context a list of messages stands for, and what it costs.
_ASSISTANT_OPENING = "<|assistant|>\n"
_MESSAGE_OPENING_TOKENS = 3  # "<|", role, "|>\n" as special tokens
_MESSAGE_CLOSING_TOKENS = 1  # "<|end|>\n"


def chat_context(request: EngineRequest) -> str:
    """The text the simulator's chat template makes of ``request.messages``.

    Every message is ``<|role|>\\ncontent<|end|>\\n``; then the assistant's turn opens.
    With ``continue_final_message`` the final message stays open instead, so a
    continued assistant message is the same context as the request that produced it
    plus that message's content.
    """
    messages = request.messages or ()
    closed = messages[:-1] if request.continue_final_message else messages
    parts = [f"<|{m.role}|>\n{m.content}<|end|>\n" for m in closed]
    if request.continue_final_message and messages:
        last = messages[-1]
        parts.append(f"<|{last.role}|>\n{last.content}")
    elif request.add_generation_prompt:
        parts.append(_ASSISTANT_OPENING)
    return "".join(parts)


def count_prompt_tokens(
    request: EngineRequest, count_tokens: Callable[[str], int] = tokens.count
) -> int:
    """The simulator's prompt length: ids as given, else the tokens of the context text.

    A chat message costs its content's tokens plus 4 for the template, the opened
    assistant turn 3; a continued final message costs its content plus 3, so that it
    counts exactly the tokens its content adds to the context.
    """
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    if request.messages is None:
        return max(1, count_tokens(request.prompt or ""))
    messages = request.messages
    per_message = _MESSAGE_OPENING_TOKENS + _MESSAGE_CLOSING_TOKENS
    closed = messages[:-1] if request.continue_final_message else messages
    n = sum(count_tokens(m.content) + per_message for m in closed)
    if request.continue_final_message:
        n += _MESSAGE_OPENING_TOKENS + count_tokens(messages[-1].content)
    elif request.add_generation_prompt:
        n += _MESSAGE_OPENING_TOKENS
    return n


def _context_text(request: EngineRequest) -> str:
    """The prompt as text (the chat template's for messages); "" for token ids."""
    if request.messages is not None:
        return chat_context(request)
    return request.prompt or ""


def _context_hash(engine_seed: int, request: EngineRequest, text: str) -> hashlib.blake2b:
    """The hash of (seeds, context) that picks the next token; tokens extend it."""
    # hashlib, not hash(): str hashes are salted per process
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{engine_seed}/{request.sampling.seed}/".encode())
    if request.prompt_token_ids is not None:
        h.update(b"ids:" + b"".join(i.to_bytes(4, "little") for i in request.prompt_token_ids))
    else:
        h.update(b"text:" + text.encode(errors="surrogatepass"))
    return h


class _StopFilter:
    """Holds back text that may begin a stop string, so no stop string is ever emitted."""

    __slots__ = ("_longest", "_pending", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._longest = max(len(s) for s in stops)
        self._pending = ""

    def feed(self, piece: str, *, check: bool, final: bool) -> tuple[str, bool]:
        """The text to emit now, and whether a stop string ended the output."""
        text = self._pending + piece
        self._pending = ""
        if not check:
            return text, False
        cut = self._first_stop(text)
        if cut >= 0:
            return text[:cut], True
        keep = 0 if final else self._partial_stop_len(text)
        if keep:
            self._pending = text[-keep:]
            text = text[:-keep]
        return text, False

    def _first_stop(self, text: str) -> int:
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(hits, default=-1)

    def _partial_stop_len(self, text: str) -> int:
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0


@dataclass(slots=True, eq=False)  # eq=False: hashed by identity, a key of the running dict
class _Seq:
    prompt_tokens: int
    max_tokens: int
    min_tokens: int
    context: hashlib.blake2b  # seeds, prompt and output so far
    tables: _Tables
    by_ids: bool  # the prompt was token ids: the context goes on in ids
    stop: _StopFilter | None
    blocks: list[int]  # the prompt's KV blocks (chained hashes), for the prefix cache
    pooling: bool = False  # prefill only: done, with no output, once the prompt is in
    priority: int = 1  # lower goes first (EngineRequest.priority)
    arrival: int = 0  # its order of arrival in the engine (set by StepModel.add)
    preempted: int = 0  # times it gave its slot to a request of a higher priority
    state: State = "waiting"
    prefill_left: int = 0  # running: prompt tokens still to prefill (0: decoding)
    completion_tokens: int = 0
    deltas: deque[TokenDelta] = field(default_factory=deque)
    waiter: asyncio.Future[None] | None = None
    error: EngineError | None = None

    def next_delta(self) -> TokenDelta:
        # The next token is a function of the seeds and the whole context before it,
        # so a request resumed with its output so far continues the same way.
        context, tables = self.context, self.tables
        # digest() leaves the hash open: no copy needed
        k = int.from_bytes(context.digest(), "little") % len(tables.texts)
        context.update(tables.id_bytes[k] if self.by_ids else tables.text_bytes[k])
        self.completion_tokens = n = self.completion_tokens + 1
        finish = "length" if n >= self.max_tokens else None
        text = tables.texts[k]
        if self.stop is not None:
            text, stopped = self.stop.feed(
                text, check=n >= self.min_tokens, final=finish is not None
            )
            if stopped:
                finish = "stop"
        return TokenDelta(text, tables.ids[k], self.prompt_tokens, n, finish)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class SimEngine(Engine):
    """A simulated vLLM-like engine; says it is one in its log line and ``is_simulator``."""

    is_simulator = True

    def __init__(self, settings: SimSettings, model_name: str | None = None) -> None:
        self.model_name = model_name or DEFAULT_MODEL_NAME
        self._settings = settings
        self._model: StepModel[_Seq] = StepModel(settings)  # slots, queue, cache, step times
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = "engine not started"
        self._hung = False
        self._admitted = 0
        self._last_progress = 0.0
        self._tables = _Tables.of(tokens.builtin())
        self.frontend = SimFrontend(self, settings)  # the routes beyond chat and completions

    @property
    def last_progress(self) -> float:
        """``loop.time()`` of the last step that produced tokens (or of ``start()``)."""
        return self._last_progress

    @property
    def has_work(self) -> bool:
        return self._model.has_work

    @property
    def preemptions(self) -> int:
        """Running sequences that gave their slot to a request of a higher priority."""
        return self._model.preemptions

    async def start(self) -> None:
        if self._task is not None:
            return
        if self._settings.tokenizer is not None:
            vocab = await asyncio.to_thread(tokens.from_tokenizer_json, self._settings.tokenizer)
            self._tables = _Tables.of(vocab)
            logger.info("engine sim: tokenizer %s, %d output words", vocab.name, len(vocab.ids))
        self._loop = loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._dead, self._hung, self._admitted = None, False, 0
        self._last_progress = loop.time()
        logger.info(
            "engine sim: a SIMULATOR, no real model runs; model name %r, knobs %s",
            self.model_name,
            self._settings.model_dump(),
        )
        self._task = loop.create_task(self._run(), name="sim-engine-scheduler")
        self._check_faults()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if self._dead is None:
            self._die("engine stopped")
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def count_tokens(self, text: str) -> int:
        return self._tables.count(text)

    async def check_health(self) -> None:
        # A hung engine passes on purpose: only a progress watchdog can tell.
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def slots(self) -> int:
        return self._settings.max_num_seqs

    def takes_priority(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        model = self._model
        running, cache = model.running, model.cache
        return EngineStats(
            running=running,
            waiting=len(model.waiting),
            kv_cache_usage=running / self._settings.max_num_seqs,
            prefix_cache_hit_rate=-1.0 if cache is None else cache.hit_rate,
            prefix_cache_queries=0 if cache is None else cache.queries,
            prefix_cache_hits=0 if cache is None else cache.hits,
            prefix_cache_resets=0 if cache is None else cache.resets,
            named_metrics=self._prefill_metrics(),
        )

    def _prefill_metrics(self) -> dict[str, float]:
        """``prefill_queue_tokens``: prompt tokens not yet prefilled (a waiting request's
        whole prompt: what its cache holds is known only once it runs);
        ``prefill_tokens_per_s``: prompt tokens prefilled over the time of the steps
        that prefilled them, once some were (gateways bound prefix affinity by them)."""
        model = self._model
        metrics = {"prefill_queue_tokens": float(model.prefill_queue_tokens())}
        if model.prefill_s > 0:
            metrics["prefill_tokens_per_s"] = model.prefilled / model.prefill_s
        return metrics

    def subscribe_kv_events(self, listener: KVEvents) -> bool:
        cache = self._model.cache
        if cache is None:
            return False
        cache.listener = listener
        return True

    def prompt_blocks(self, request: EngineRequest) -> tuple[str, list[tuple[int, int]]]:
        cache = self._model.cache
        if cache is None or request.prompt_token_ids is not None:
            return "", []
        text = _context_text(request)
        return text, cache.text_spans(text)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (None when ``prefix_cache_blocks`` is 0)."""
        return self._model.cache

    async def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        seq = self._accept(request)
        try:
            while True:
                while seq.deltas:
                    delta = seq.deltas.popleft()
                    yield delta
                    if delta.finish_reason is not None:
                        return
                if seq.error is not None:
                    raise seq.error
                seq.waiter = self._new_future()
                await seq.waiter
        finally:
            # Runs on cancel and aclose too: the slot frees at once.
            self._discard(seq)

    # -- requests ---------------------------------------------------------------------

    def _accept(self, request: EngineRequest) -> _Seq:
        if self._dead is None:
            self._admitted += 1
            self._check_faults()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        seq = self._new_seq(request)
        if seq.max_tokens <= 0 and not seq.pooling:
            seq.state = "done"
            seq.deltas.append(TokenDelta("", (), seq.prompt_tokens, 0, "length"))
        else:
            self._model.add(seq)
            self._wake.set()
        return seq

    def _new_seq(self, request: EngineRequest) -> _Seq:
        sampling = request.sampling
        stops = tuple(s for s in sampling.stop if s)
        max_tokens = sampling.max_tokens
        text = _context_text(request)
        return _Seq(
            prompt_tokens=count_prompt_tokens(request, self._tables.count),
            max_tokens=self._settings.default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=sampling.min_tokens,
            context=_context_hash(self._settings.seed, request, text),
            tables=self._tables,
            by_ids=request.prompt_token_ids is not None,
            stop=_StopFilter(stops) if stops else None,
            blocks=self._blocks(request, text),
            pooling=request.pooling,
            priority=request.priority,
        )

    def _blocks(self, request: EngineRequest, text: str) -> list[int]:
        cache = self._model.cache
        if cache is None:
            return []
        if request.prompt_token_ids is not None:
            return cache.id_blocks(request.prompt_token_ids)
        return cache.text_blocks(text)

    def _new_future(self) -> asyncio.Future[None]:
        assert self._loop is not None  # set by start(), before any request is accepted
        return self._loop.create_future()

    def _discard(self, seq: _Seq) -> None:
        self._model.discard(seq)

    # -- faults -----------------------------------------------------------------------

    def _check_faults(self) -> None:
        s = self._settings
        if s.crash_after_requests is not None and self._admitted >= s.crash_after_requests:
            logger.warning("engine sim: simulated crash after %d requests", self._admitted)
            self._die(f"simulated crash after {s.crash_after_requests} requests")
        elif (
            s.hang_after_requests is not None
            and not self._hung
            and self._admitted >= s.hang_after_requests
        ):
            logger.warning("engine sim: simulated hang after %d requests", self._admitted)
            self._hung = True

    def _die(self, reason: str) -> None:
        self._dead = reason
        for seq in self._model.clear():
            seq.error = EngineDeadError(reason)
            seq.wake()
        self._wake.set()  # let an idle scheduler see it and end

    # -- scheduler --------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._schedule()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("engine sim: scheduler failed; the engine is dead")
            self._die("simulator scheduler failed")

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        model = self._model
        while self._dead is None:
            if not model.has_work:
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()  # idle time is not owed to the next step
                continue
            if self._hung:
                await loop.create_future()  # never done: only stop() ends a hung engine
            deadline += model.plan_step()
            now = loop.time()
            if deadline < now - _MAX_LAG_S:
                deadline = now
            # sleep(0) when costs are 0: still yields to the loop every step
            await asyncio.sleep(max(0.0, deadline - now))
            if self._dead is None and not self._hung:
                self._decode(loop)

    def _decode(self, loop: asyncio.AbstractEventLoop) -> None:
        model = self._model
        if not model.running:
            return  # every sequence was aborted during the step
        finished = [seq for seq in model.decoding if self._advance(seq)]
        for seq in finished:
            model.discard(seq)
        self._last_progress = loop.time()

    def _advance(self, seq: _Seq) -> bool:
        """One token (or the simulated error) for ``seq``; true when it is finished."""
        if len(seq.deltas) >= MAX_BACKLOG:
            # Its reader is behind (a client that stopped reading): the sequence keeps
            # its slot but makes no token, so memory stays bounded (backpressure).
            return False
        fail_after = self._settings.error_after_tokens
        if seq.pooling:
            seq.deltas.append(TokenDelta("", (), seq.prompt_tokens, 0, "stop"))
            done = True
        elif fail_after is not None and seq.completion_tokens >= fail_after:
            seq.error = EngineError(f"simulated engine error after {fail_after} tokens")
            done = True
        else:
            delta = seq.next_delta()
            seq.deltas.append(delta)
            done = delta.finish_reason is not None
        seq.wake()
        return done
