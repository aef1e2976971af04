"""The command-line flags: which flag sets which settings key, for which command.

``unitproxy`` (``proxy/cli.py``) builds its parser from these tables, and ``unitproxy up``
(``proxy/up.py``) passes the values that were set on to its children as the same flags.
A flag's help text is its setting's description, and a flag whose setting is a
``Literal`` takes exactly that setting's values: nothing here repeats the settings.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from proxy.settings import Settings


@dataclass(frozen=True)
class Flag:
    flag: str
    key: str  # dotted settings path
    metavar: str | None = None
    choices: Sequence[str] | None = None  # None: the setting's Literal values, if it has them
    many: bool = False  # repeatable: each use adds one value
    switch: bool = False  # takes no value: given means true


COMMON = (
    Flag("--host", "server.host"),
    Flag("--advertise-host", "server.advertise_host", "HOST"),
    Flag("--http-port", "server.http_port", "PORT"),
    Flag("--grpc-port", "server.grpc_port", "PORT"),
    Flag("--log-level", "server.log_level"),
    Flag("--max-body-bytes", "server.max_body_bytes", "BYTES"),
    Flag("--redis-url", "redis.url", "URL"),
    Flag("--redis-cluster", "redis.cluster", "NAME"),
)
# Sidecar and gateway: the processes that serve inference.
SERVING = (
    Flag("--api-keys-file", "server.api_keys_file", "PATH"),
    Flag("--tls-cert-file", "server.tls_cert_file", "PATH"),
    Flag("--tls-key-file", "server.tls_key_file", "PATH"),
    Flag("--head-timeout", "server.head_timeout_s", "SECONDS"),
    Flag("--body-timeout", "server.body_timeout_s", "SECONDS"),
    Flag("--keepalive-timeout", "server.keepalive_timeout_s", "SECONDS"),
    Flag("--write-timeout", "server.write_timeout_s", "SECONDS"),
    Flag("--max-connections", "server.max_connections", "N"),
    Flag("--max-connections-per-client", "server.max_connections_per_client", "N"),
    Flag("--drain-timeout", "server.drain_timeout_s", "SECONDS"),
)
# Sidecar, gateway and up (which passes them to both).
TRACING = (
    Flag("--otlp-endpoint", "tracing.otlp_endpoint", "URL"),
    Flag("--trace-sample-ratio", "tracing.sample_ratio", "RATIO"),
)
ENGINE = (
    Flag("--engine", "engine.kind"),
    Flag("--model", "engine.model"),
    Flag("--device", "engine.device"),
    Flag("--upstream-url", "engine.upstream_url", "URL"),
    Flag("--sim-max-num-seqs", "engine.sim.max_num_seqs", "N"),
    Flag("--sim-prefill-ms-per-token", "engine.sim.prefill_ms_per_token", "MS"),
    Flag("--sim-max-num-batched-tokens", "engine.sim.max_num_batched_tokens", "TOKENS"),
    Flag("--sim-decode-step-ms", "engine.sim.decode_step_ms", "MS"),
    Flag("--sim-decode-ms-per-seq", "engine.sim.decode_ms_per_seq", "MS"),
    Flag("--sim-default-max-tokens", "engine.sim.default_max_tokens", "N"),
    Flag("--sim-seed", "engine.sim.seed", "N"),
    Flag("--sim-prefix-cache-blocks", "engine.sim.prefix_cache_blocks", "N"),
    Flag("--sim-block-size", "engine.sim.block_size", "TOKENS"),
    Flag("--sim-error-after-tokens", "engine.sim.error_after_tokens", "N"),
    Flag("--sim-hang-after-requests", "engine.sim.hang_after_requests", "N"),
    Flag("--sim-crash-after-requests", "engine.sim.crash_after_requests", "N"),
    Flag("--sim-tokenizer", "engine.sim.tokenizer", "PATH"),
    Flag("--sim-embedding-dim", "engine.sim.embedding_dim", "N"),
    Flag("--sim-responses-stored", "engine.sim.responses_stored", "N"),
    Flag("--served-model-name", "engine.served_model_name", "NAME"),
    Flag("--tokenizer", "engine.tokenizer", "PATH"),
    Flag("--tensor-parallel-size", "engine.tensor_parallel_size", "N"),
    Flag("--pipeline-parallel-size", "engine.pipeline_parallel_size", "N"),
    Flag("--data-parallel-size", "engine.data_parallel_size", "N"),
    Flag("--max-num-seqs", "engine.max_num_seqs", "N"),
    Flag("--max-model-len", "engine.max_model_len", "TOKENS"),
    Flag("--dtype", "engine.dtype"),
    Flag("--quantization", "engine.quantization", "METHOD"),
    Flag("--speculative-config", "engine.speculative_config", "JSON"),
    Flag("--additional-config", "engine.additional_config", "JSON"),
    Flag("--engine-args", "engine.engine_args", "JSON"),
    Flag("--vllm-serving", "engine.vllm_serving", "{true,false}"),
    Flag("--chat-template", "engine.chat_template", "TEMPLATE"),
    Flag("--enable-auto-tool-choice", "engine.enable_auto_tool_choice", switch=True),
    Flag("--tool-call-parser", "engine.tool_call_parser", "NAME"),
    Flag("--reasoning-parser", "engine.reasoning_parser", "NAME"),
    Flag("--serve-args", "engine.serve_args", "JSON"),
    Flag("--upstream-api-key", "engine.upstream_api_key", "KEY"),
    Flag("--upstream-metrics-interval", "engine.upstream_metrics_interval_s", "SECONDS"),
    Flag("--upstream-timeout", "engine.upstream_timeout_s", "SECONDS"),
    Flag("--upstream-vllm-extras", "engine.upstream_vllm_extras", "{true,false}"),
)
SIDECAR = (
    Flag("--unit-id", "sidecar.unit_id", "ID"),
    Flag("--capacity", "sidecar.capacity", "N"),
    Flag("--priority-headroom", "sidecar.priority_headroom", "N"),
    Flag("--report-interval", "sidecar.report_interval_s", "SECONDS"),
    Flag("--report-prefix-blocks", "sidecar.prefix_report_blocks", "N"),
    Flag("--report-chunk-chars", "sidecar.prefix_chunk_chars", "N"),
    Flag("--stall-timeout", "health.stall_timeout_s", "SECONDS"),
    Flag("--follower", "sidecar.followers", "NAME=TARGET", many=True),
    Flag("--probe", "sidecar.probe"),
    Flag("--recovery-command", "sidecar.recovery.command", "SHELL_COMMAND"),
    Flag("--recovery-url", "sidecar.recovery.url", "URL"),
    Flag("--recovery-grace", "sidecar.recovery.grace_s", "SECONDS"),
    Flag("--recovery-backoff", "sidecar.recovery.backoff_initial_s", "SECONDS"),
    Flag("--recovery-backoff-max", "sidecar.recovery.backoff_max_s", "SECONDS"),
)
HEALTH = (
    Flag("--health-interval", "health.interval_s", "SECONDS"),
    Flag("--health-timeout", "health.timeout_s", "SECONDS"),
    Flag("--unhealthy-threshold", "health.unhealthy_threshold", "N"),
    Flag("--healthy-threshold", "health.healthy_threshold", "N"),
)
GATEWAY = (
    Flag("--unit", "gateway.units", "ID=HTTP_URL,GRPC_TARGET", many=True),
    Flag("--policy", "gateway.policy"),
    Flag("--prefix-balance", "gateway.prefix_balance", "RATIO"),
    Flag("--prefix-slack", "gateway.prefix_slack", "N"),
    Flag("--prefix-engine-feedback", "gateway.prefix_engine_feedback", choices=("true", "false")),
    Flag("--prefix-chunk-chars", "gateway.prefix_chunk_chars", "N"),
    Flag("--prefix-max-blocks", "gateway.prefix_max_blocks", "N"),
    Flag("--prefix-ttl", "gateway.prefix_ttl_s", "SECONDS"),
    Flag("--slo-ttft", "gateway.slo_ttft_s", "SECONDS"),
    Flag("--slo-tpot", "gateway.slo_tpot_s", "SECONDS"),
    Flag("--slo-ttft-interactive", "gateway.slo_ttft_interactive_s", "SECONDS"),
    Flag("--slo-ttft-batch", "gateway.slo_ttft_batch_s", "SECONDS"),
    Flag("--latency-half-life", "gateway.latency_half_life_s", "SECONDS"),
    Flag("--latency-balance", "gateway.latency_balance", "FRACTION"),
    Flag("--latency-goodput", "gateway.latency_goodput", choices=("true", "false")),
    Flag("--prefix-engine-blocks", "gateway.prefix_engine_blocks", choices=("true", "false")),
    Flag("--prefix-ttft", "gateway.prefix_ttft_s", "SECONDS"),
    Flag("--prefix-free-slots", "gateway.prefix_free_slots", choices=("true", "false")),
    Flag("--prefix-saturated-balance", "gateway.prefix_saturated_balance", "FRACTION"),
    Flag("--prefix-weigh-prefill", "gateway.prefix_weigh_prefill", choices=("true", "false")),
    Flag("--prefix-prefill-rate", "gateway.prefix_prefill_tokens_per_s", "TOKENS_PER_S"),
    Flag("--load-source", "gateway.load_source"),
    Flag("--retries", "gateway.retries", "N"),
    Flag("--tls-ca-file", "gateway.tls_ca_file", "PATH"),
    Flag("--poll-interval", "gateway.poll_interval_s", "SECONDS"),
    Flag("--stale-after", "gateway.stale_after_s", "SECONDS"),
    Flag("--queue-size", "gateway.queue_size", "N"),
    Flag("--queue-timeout", "gateway.queue_timeout_s", "SECONDS"),
    Flag("--queue-class-size", "gateway.queue_class_size", "CLASS=N,..."),
    Flag("--queue-class-timeout", "gateway.queue_class_timeout_s", "CLASS=SECONDS,..."),
    Flag("--eject-after", "gateway.eject_after", "N"),
    Flag("--eject-time", "gateway.eject_s", "SECONDS"),
    Flag("--max-eject-time", "gateway.max_eject_s", "SECONDS"),
    Flag("--gave-up-failure", "gateway.gave_up_failure_s", "SECONDS"),
    Flag("--max-ejection-percent", "gateway.max_ejection_percent", "PERCENT"),
    Flag("--discover-allow", "gateway.discover_allow", "URL_PATTERN", many=True),
    Flag("--max-units", "gateway.max_units", "N"),
    Flag("--request-timeout", "gateway.request_timeout_s", "SECONDS"),
    Flag("--response-timeout", "gateway.response_timeout_s", "SECONDS"),
    Flag("--migrations", "gateway.migrations", "N"),
    Flag("--stream-idle-timeout", "gateway.stream_idle_timeout_s", "SECONDS"),
    Flag("--report-delay", "gateway.report_delay_s", "SECONDS"),
    Flag("--correct-load", "gateway.correct_load", choices=("true", "false")),
    Flag("--report-budget", "gateway.report_budget_per_s", "PER_S"),
    Flag("--report-min-interval", "gateway.report_min_interval_s", "SECONDS"),
    Flag("--watch-grpc-max-units", "gateway.watch_grpc_max_units", "N"),
    Flag("--tenants-file", "gateway.tenants_file", "PATH"),
    Flag("--tenants-poll", "gateway.tenants_poll_s", "SECONDS"),
    Flag("--tenants-redis", "gateway.tenants_redis", choices=("true", "false")),
    Flag("--access-log", "gateway.access_log"),
    Flag("--max-tenant-labels", "gateway.max_tenant_labels", "N"),
    Flag("--tenant-estimate-max-tokens", "gateway.tenant_estimate_max_tokens", "TOKENS"),
    Flag("--replicas", "gateway.replicas", "N"),
)
UP = (
    Flag("--units", "up.units", "N"),
    Flag("--followers", "up.followers", "N"),
    Flag("--state-file", "up.state_file", "PATH"),
    Flag("--base-port", "up.base_port", "PORT"),
    Flag("--ready-timeout", "up.ready_timeout_s", "SECONDS"),
    Flag("--stop-timeout", "up.stop_timeout_s", "SECONDS"),
    Flag("--restart", "up.restart", switch=True),
    Flag("--unit-model", "up.unit_models", "NAME", many=True),
)
PLAN = (
    Flag("--rate", "plan.rate_per_s", "PER_S"),
    Flag("--trace", "plan.trace_file", "FILE"),
    Flag("--duration", "plan.duration_s", "SECONDS"),
    Flag("--prompt-tokens", "plan.prompt_tokens", "N_OR_DISTRIBUTION"),
    Flag("--output-tokens", "plan.output_tokens", "N_OR_DISTRIBUTION"),
    Flag("--prefix-share", "plan.prefix_share", "FRACTION"),
    Flag("--prefix-groups", "plan.prefix_groups", "N"),
    Flag("--slo-ttft-p99", "plan.slo_ttft_p99_s", "SECONDS"),
    Flag("--slo-tpot-p99", "plan.slo_tpot_p99_s", "SECONDS"),
    Flag("--max-units", "plan.max_units", "N"),
    Flag("--measure", "plan.measure_url", "URL"),
    Flag("--measure-api-key", "plan.measure_api_key", "KEY"),
    Flag("--seed", "plan.seed", "N"),
    Flag("--json", "plan.json_output", switch=True),
    Flag("--plot", "plan.plot_file", "PNG"),
)
# The unit's shape for the planner: the simulator's model knobs and the admission limit.
PLAN_UNIT = ("--sim-max-num-seqs", "--sim-prefill-ms-per-token", "--sim-max-num-batched-tokens",
             "--sim-decode-step-ms", "--sim-decode-ms-per-seq", "--sim-prefix-cache-blocks",
             "--sim-block-size", "--capacity")  # fmt: skip
FOLLOWER = (
    Flag("--node-name", "follower.node_name", "NAME"),
    Flag("--check", "follower.checks", "KIND:ARGS", many=True),
    Flag("--worker-stop-timeout", "follower.worker_stop_timeout_s", "SECONDS"),
)


def field_of(key: str) -> FieldInfo:
    """The settings field a dotted key (``gateway.policy``) names."""
    model: type[BaseModel] = Settings
    *sections, name = key.split(".")
    for section in sections:
        annotation = model.model_fields[section].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return model.model_fields[name]


def choices_of(flag: Flag) -> Sequence[str] | None:
    """The values a flag takes: its own list, else its setting's Literal values."""
    if flag.choices is not None:
        return flag.choices
    values = _literal_values(field_of(flag.key).annotation)
    return values or None


def _literal_values(annotation: Any) -> tuple[str, ...]:
    if typing.get_origin(annotation) is Literal:
        return tuple(str(v) for v in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # Literal[...] | None
        return tuple(v for arg in typing.get_args(annotation) for v in _literal_values(arg))
    return ()
