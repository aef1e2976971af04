"""Settings: one root, a nested section per concern.

Sources, strongest first: command-line flags, environment variables
``UNITPROXY_<SECTION>__<NAME>`` (for example ``UNITPROXY_SIDECAR__CAPACITY=32``),
the TOML file given with ``--config`` (``[sidecar] capacity = 32``), the defaults
below. Every field says its default and unit.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from engine.settings import EngineSettings
from proxy import registry

Role = Literal["sidecar", "follower", "gateway", "up"]
PriorityClass = Literal["interactive", "standard", "batch"]

# The registered policies' names (proxy/registry.py): the setting takes exactly
# those, and so does its flag. (To mypy a str: it cannot read a Literal built here.)
if TYPE_CHECKING:
    PolicyName = str
else:
    PolicyName = Literal[registry.POLICY_NAMES]

DEFAULT_PORTS: dict[str, tuple[int, int]] = {
    # role: (http, grpc)
    "gateway": (8000, 50050),
    "sidecar": (8080, 50051),
    "follower": (8081, 50052),
}


def _digits(text: str) -> bool:
    """Only the ASCII digits 0-9: ``str.isdigit`` also passes "²", which ``int`` refuses."""
    return text.isascii() and text.isdigit()


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ServerSettings(_Section):
    host: str = Field(
        "0.0.0.0", description="Address the HTTP and gRPC servers bind. Default 0.0.0.0."
    )
    advertise_host: str | None = Field(
        None,
        description="Host name or address others reach this process by (in load reports, Redis, logs), e.g. the pod IP. Default: --host, or this machine's host name when --host is a wildcard.",
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="HTTP port; 0 picks a free one. Default by role: gateway 8000, sidecar 8080, follower 8081.",
    )
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="gRPC port; 0 picks a free one. Default by role: gateway 50050, sidecar 50051, follower 50052.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level. Default info."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest request body accepted, in bytes. Default 4 MiB."
    )
    drain_timeout_s: float = Field(
        300.0,
        gt=0,
        description="On SIGTERM or POST /admin/drain, how long in-flight requests may take to finish before exit, in s. Default 300.",
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="API keys accepted on inference routes as 'Authorization: Bearer KEY' (gRPC: metadata authorization). Default none (inference open).",
    )
    api_keys_file: Path | None = Field(
        None,
        description="File with more API keys, one a line (blank lines and # comments ignored). Default none.",
    )
    resume_secret: SecretStr | None = Field(
        None,
        description="Secret shared by a fleet's gateways and sidecars, never by clients: a gateway signs the resume hint of a stream it moves to another unit after its unit failed, and a sidecar takes only hints signed with it (any other is 403), so a client cannot move its prompt tokens into completion tokens. With tenants a gateway also signs the interactive class it sends a unit (x-unitproxy-priority-sig: HMAC over the request id and the class), and a sidecar grants interactive only so signed (else standard). unitproxy up makes one for its cell. Without it a gateway does not move streams after their first byte, and a sidecar refuses every hint and grants no request interactive. A secret: give it in the environment (UNITPROXY_SERVER__RESUME_SECRET) or the config file. Default none.",
    )
    tls_cert_file: Path | None = Field(
        None,
        description="PEM certificate chain: serve HTTP and gRPC over TLS. Needs tls_key_file. Default none (plain).",
    )
    tls_key_file: Path | None = Field(
        None, description="PEM private key of tls_cert_file. Default none."
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Token that /admin routes require as 'Authorization: Bearer TOKEN'. Default none: only loopback clients may call them.",
    )
    head_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest time a request head may take, from its first byte to its end (a new connection's first head: from the connect), in s; past it the client gets 408 and the connection closes (a new connection that sent nothing is closed without an answer). Default 10.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest time a request body may take, from the end of the head to its last byte, in s; past it the client gets 408 and the connection closes. Default 30.",
    )
    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="An idle keep-alive connection (between requests) is closed after this, in s. Default 75.",
    )
    write_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest time a client may leave its response unread while the server has more to send, in s; past it the request ends and its capacity slot is freed (and the unit's stream is cancelled, at a gateway). HTTP: the socket buffer stays full this long, and the connection is aborted. gRPC Generate: a message waits this long on the stream's flow-control window (a client's transport may first take its whole window, a few MB), and the call ends with DEADLINE_EXCEEDED (code write_timeout) behind the messages already sent. Default 60.",
    )
    max_connections: int = Field(
        4096,
        gt=0,
        description="Most client connections open on the HTTP port at once; one more is answered 503 and closed. Fewer where the open-file limit (RLIMIT_NOFILE, raised to its hard limit at start) has no room for about 2 files a connection: a WARNING at start says how many. Default 4096.",
    )
    max_connections_per_client: int | None = Field(
        None,
        ge=0,
        description="Most client connections open on the HTTP port at once from one client address (an IPv4 or IPv6 address); one more is answered 429 and closed. 0: no cap per client. Behind a proxy or load balancer that connects from a few addresses, raise it or give 0. Default by role: gateway 1024; sidecar and follower 0 (their clients are gateways, each with up to gateway.connections_per_unit connections to a unit).",
    )
    max_body_buffer_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Most bytes of request bodies received and not yet whole on the HTTP port, all connections together (counted as they arrive, not by their declared length); a request that comes while it is full, or whose bytes would pass it, gets 503 and the connection closes. Default 64 MiB.",
    )
    max_pipelined_bytes: int = Field(
        16 * 1024 * 1024,
        gt=0,
        description="Most bytes of later requests a client sends behind one being served (pipelined) that the gateway's HTTP port holds, all connections together; past it, or past 64 KiB on one connection, the server stops reading that connection until its request is answered. Default 16 MiB.",
    )
    max_prompt_chars: int = Field(
        1_000_000,
        gt=0,
        description="Largest prompt (all messages together), in characters. Default 1,000,000.",
    )

    def connections_per_client(self, role: str) -> int:
        """max_connections_per_client, or its default for ``role``."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return 1024 if role == "gateway" else 0

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


ProbeKind = Literal["grpc", "grpc-watch", "http", "tcp"]


class FollowerTarget(BaseModel):
    """One follower node as the sidecar sees it: ``NAME=TARGET``."""

    name: str
    target: str  # host:port of its gRPC health, or an http(s):// URL

    @property
    def is_http(self) -> bool:
        return self.target.startswith(("http://", "https://"))

    @classmethod
    def parse(cls, spec: str) -> FollowerTarget:
        name, sep, target = spec.partition("=")
        name, target = name.strip(), target.strip()
        if not sep or not name or not target:
            raise ValueError(f"{spec!r} is not NAME=TARGET (TARGET: host:port or http://...)")
        if not target.startswith(("http://", "https://")):
            host, colon, port = target.rpartition(":")
            if not colon or not host or not _digits(port) or not 0 < int(port) < 65536:
                raise ValueError(f"{spec!r}: TARGET must be host:port or an http:// URL")
        return cls(name=name, target=target)


class RecoverySettings(_Section):
    command: str | None = Field(
        None,
        description="Shell command run when the unit stays NOT_SERVING past the grace period; it gets UNITPROXY_UNIT_ID and UNITPROXY_FAILED_NODES. Default none.",
    )
    url: str | None = Field(
        None,
        description="URL POSTed (JSON: unit_id, failed_nodes) when the unit stays NOT_SERVING past the grace period. Default none.",
    )
    grace_s: float = Field(
        30.0,
        ge=0,
        description="How long the unit must stay NOT_SERVING before the hook runs, in s. Default 30.",
    )
    backoff_initial_s: float = Field(
        30.0,
        gt=0,
        description="Wait after the first run before another, in s; doubles each run. Default 30.",
    )
    backoff_max_s: float = Field(
        600.0, gt=0, description="Longest wait between two runs, in s. Default 600."
    )
    timeout_s: float = Field(
        120.0, gt=0, description="Longest time one run of the hook may take, in s. Default 120."
    )


class SidecarSettings(_Section):
    unit_id: str = Field(
        "unit-0", min_length=1, max_length=64, description="This unit's id. Default unit-0."
    )
    capacity: int | None = Field(
        None,
        gt=0,
        description="Most requests admitted at once (outstanding); more get 429. Gateways send a unit at most this many at once and hold the rest in their fair queue. Default: the engine's slots, the requests it runs at once (engine_slots in the load report: the simulator's and vLLM's max_num_seqs), so that nothing waits in the engine's own FIFO; 64 where the engine does not say (engine openai). A higher class may go over it by priority_headroom.",
    )
    priority_headroom: int | None = Field(
        None,
        ge=0,
        description="Requests a unit at capacity still takes for a higher priority class than the lowest it runs: a request is admitted over capacity, up to capacity + this, while the requests of its class and above number fewer than capacity, and the engine gives it the slot of a running request of a lower class (that stream pauses and resumes, it never fails). The unit reports it; gateways send within it. Interactive is granted only to a request a gateway signed with server.resume_secret. 0: none. Only with an engine that schedules by priority (the simulator; vLLM with scheduling_policy priority), else 0. Default: a quarter of the capacity, at least 1.",
    )
    report_interval_s: float = Field(
        1.0,
        gt=0,
        description="Longest time between two load reports to watchers (heartbeat), in s. Default 1.",
    )
    report_coalesce_s: float = Field(
        0.005,
        ge=0,
        description="Load changes within this long after a report fold into the next one (a change of state goes out at once), in s. Default 0.005.",
    )
    retry_after_s: int = Field(
        1, ge=0, description="The retry-after header sent with 429 and 503, in s. Default 1."
    )
    prefix_report_blocks: int = Field(
        4096,
        ge=0,
        le=65536,
        description="Most prefix blocks (chunks of prompt text) the load reports say the engine holds, the most recently stored kept; 0: none reported. From the engine's KV cache events (the simulator's cache; vLLM's kv_events_config, which engine vllm then turns on). Default 4096.",
    )
    prefix_chunk_chars: int = Field(
        512,
        gt=0,
        description="Characters of prompt text per reported prefix block: must equal the gateways' gateway.prefix_chunk_chars, which ignore a unit's blocks of another size. Default 512.",
    )
    followers: list[FollowerTarget] = Field(
        default_factory=list,
        description="The unit's follower nodes, NAME=TARGET each (TARGET host:port of its grpc health, or http://...). Default none.",
    )
    probe: ProbeKind | None = Field(
        None,
        description="How followers are probed: grpc, grpc-watch, http or tcp. Default grpc-watch for host:port targets, http for URLs.",
    )
    recovery: RecoverySettings = Field(default_factory=RecoverySettings)  # type: ignore[arg-type]

    @field_validator("followers", mode="before")
    @classmethod
    def _parse_followers(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            parsed = [FollowerTarget.parse(v) if isinstance(v, str) else v for v in value]
            names = [f.name if isinstance(f, FollowerTarget) else f.get("name") for f in parsed]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(
                    f"follower names must be unique: {', '.join(map(str, duplicates))}"
                )
            return parsed
        return value


CheckKind = Literal["process", "tcp", "command", "heartbeat"]


class CheckSpec(BaseModel):
    """One follower check, written KIND:ARGS on the command line."""

    kind: CheckKind
    arg: str
    port: int = 0  # tcp
    max_age_s: float = 0.0  # heartbeat

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.arg}" if self.kind != "tcp" else f"tcp:{self.arg}:{self.port}"

    @classmethod
    def parse(cls, spec: str) -> CheckSpec:
        kind, _, rest = spec.partition(":")
        if kind == "process":
            if not _digits(rest) or int(rest) <= 0:
                raise ValueError(f"{spec!r}: process:PID needs a positive pid")
            return cls(kind="process", arg=rest)
        if kind == "tcp":
            host, _, port = rest.rpartition(":")
            if not host or not _digits(port) or not 0 < int(port) < 65536:
                raise ValueError(f"{spec!r}: tcp:HOST:PORT needs a host and a port 1-65535")
            return cls(kind="tcp", arg=host, port=int(port))
        if kind == "command":
            if not rest.strip():
                raise ValueError(f"{spec!r}: command:SHELL_COMMAND needs a command")
            return cls(kind="command", arg=rest)
        if kind == "heartbeat":
            path, _, age = rest.rpartition(":")
            try:
                max_age = float(age)
            except ValueError:
                max_age = -1.0
            if not path or max_age <= 0:
                raise ValueError(
                    f"{spec!r}: heartbeat:PATH:MAX_AGE_S needs a path and a positive age"
                )
            return cls(kind="heartbeat", arg=path, max_age_s=max_age)
        raise ValueError(
            f"{spec!r}: unknown check kind {kind!r} (process, tcp, command, heartbeat)"
        )


class UnitTarget(BaseModel):
    """One unit as a gateway sees it: ``ID=HTTP_URL,GRPC_TARGET``."""

    id: str
    http_url: str
    grpc_target: str

    @classmethod
    def parse(cls, spec: str) -> UnitTarget:
        unit_id, sep, rest = spec.partition("=")
        http_url, comma, grpc_target = rest.partition(",")
        unit_id, http_url, grpc_target = unit_id.strip(), http_url.strip(), grpc_target.strip()
        if not sep or not comma or not unit_id:
            raise ValueError(f"{spec!r} is not ID=HTTP_URL,GRPC_TARGET")
        if not http_url.startswith(("http://", "https://")):
            raise ValueError(f"{spec!r}: HTTP_URL must start with http:// or https://")
        host, colon, port = grpc_target.rpartition(":")
        if not colon or not host or not _digits(port):
            raise ValueError(f"{spec!r}: GRPC_TARGET must be host:port")
        return cls(id=unit_id, http_url=http_url.rstrip("/"), grpc_target=grpc_target)


class GatewaySettings(_Section):
    units: list[UnitTarget] = Field(
        default_factory=list,
        description="The units to route to, ID=HTTP_URL,GRPC_TARGET each. Default none.",
    )
    policy: PolicyName = Field(registry.DEFAULT_POLICY, description=registry.describe_policies())
    prefix_balance: float = Field(
        0.1,
        ge=0,
        description="Policy prefix, bounded load: a unit holding the prompt's prefix is chosen only while its estimated outstanding, this request counted, is at most (1 + this) x the fleet's mean load (outstanding / capacity over the units that can take requests) x its capacity, plus prefix_slack requests; otherwise a shorter match or lor decides. Default 0.1.",
    )
    prefix_slack: int = Field(
        1,
        ge=0,
        description="Policy prefix (and latency): requests a unit holding the prefix may have above (1 + prefix_balance) x the mean (so a nearly idle fleet keeps affinity). Default 1.",
    )
    slo_ttft_s: float = Field(
        0.0,
        ge=0,
        description="The time-to-first-token objective, in s (0: none). Policy latency sheds batch requests that no unit is predicted to start within it (429 shed), and unitproxy_fleet_saturation counts each unit's load against the requests it can hold within it. Default 0.",
    )
    slo_tpot_s: float = Field(
        0.0,
        ge=0,
        description="The time-per-output-token objective, in s (0: none). Policy latency prefers the units predicted to stream within it with this request in their batch, sheds batch requests when none is, and unitproxy_fleet_saturation counts each unit's load against the batch it can hold within it. Default 0.",
    )
    slo_ttft_interactive_s: float = Field(
        0.0,
        ge=0,
        description="The TTFT objective of interactive requests, in s (0: slo_ttft_s). Default 0.",
    )
    slo_ttft_batch_s: float = Field(
        0.0,
        ge=0,
        description="The TTFT objective of batch requests, in s (0: slo_ttft_s): a batch request no unit is predicted to start within it is refused 429 shed (policy latency). Default 0.",
    )
    latency_balance: float = Field(
        1.0,
        ge=0,
        description="Policy latency, bounded load: a unit whose estimated outstanding, this request counted, would pass (1 + this) x the fleet's mean load (outstanding / capacity) x its capacity, plus prefix_slack requests, is not taken however fast it is predicted (a guard against a fit gone wrong; the predictions themselves rise with each request sent). Default 1.",
    )
    latency_goodput: bool = Field(
        False,
        description="Policy latency: a request that no unit is predicted to start within its TTFT objective (slo_ttft_s, per class) goes to the unit predicted slowest within the load bound instead of the fastest, leaving the other units' queues to requests that can still meet it: more requests within the objective under overload, a longer tail for those past it. Default false.",
    )
    latency_half_life_s: float = Field(
        60.0,
        gt=0,
        description="Policy latency: the half-life of what it learnt of a unit's TTFT, in s (older answers weigh half as much per half-life). Default 60.",
    )
    prefix_engine_feedback: bool = Field(
        True,
        description="Policy prefix: correct the index from the prefix-cache counters in the units' load reports (a unit that finds far fewer of its prompts cached than the index expected keeps fewer blocks in it; a unit whose cache was emptied is forgotten). Default true.",
    )
    prefix_chunk_chars: int = Field(
        512,
        gt=0,
        description="Policy prefix: characters of prompt text per block of the prefix index. About 100 tokens of text; a larger block hashes and indexes less per request, a smaller one matches prefixes more finely. Default 512.",
    )
    prefix_max_blocks: int = Field(
        8192,
        gt=0,
        description="Policy prefix: most blocks the index keeps per unit, least recently sent out first (about 200 bytes each). Default 8192.",
    )
    prefix_ttl_s: float = Field(
        600.0,
        gt=0,
        description="Policy prefix: a block not sent to a unit for this long is dropped from its index, in s. Default 600.",
    )
    prefix_engine_blocks: bool = Field(
        True,
        description="Policy prefix: route on the prefix blocks the units report their engines hold (the same on every gateway replica), this gateway's own index filling in between reports; false: on this gateway's index alone. Default true.",
    )
    prefix_free_slots: bool = Field(
        False,
        description="Policy prefix: a unit holding the prompt's prefix also takes it above the bound over the mean load while it has an engine slot free for it (its estimated outstanding, this request counted, at most the engine_slots its reports name): the request starts there at once, and no other unit prefills the prefix again. A unit that reports no slots has none free. It keeps a shared-prefix workload at its ideal hit rate below saturation, and lets the holders run further above the mean (docs/BENCHMARKS.md, The b2b ramp with a holder's free engine slots). Default false.",
    )
    prefix_saturated_balance: float = Field(
        0.5,
        ge=0,
        description="Policy prefix: the bound over the mean load (prefix_balance's) while the fleet is saturated, where it is larger: while the least loaded unit has no engine slot free for the request (its estimated outstanding, this request counted, above the engine_slots it reports), every unit's new request waits for a running one to end, so moving a request off a holder of its prefix saves it little of that wait and costs the fleet a prefill of the prefix again (docs/BENCHMARKS.md, A looser bound while the fleet is saturated). 0: off (prefix_balance always). Default 0.5.",
    )
    prefix_ttft_s: float = Field(
        0.0,
        ge=0,
        description="Policy prefix: the time to first token tolerated for affinity, in s. A unit holding the prefix that is above the bound over the mean load still takes the request while the prompt tokens queued for prefill there, this request's counted, are what it clears within this time (its prefill rate x this); prefix_slack decides instead for a unit whose rate or queue is unknown. 0: off (prefix_weigh_prefill, else prefix_slack). Default 0.",
    )
    prefix_weigh_prefill: bool = Field(
        True,
        description="Policy prefix, with prefix_ttft_s 0: a unit holding the prefix that is above the bound over the mean load still takes the request while the prefill before its first token there (the prompt tokens queued for prefill, named metric prefill_queue_tokens, and this request's tokens it does not hold, at its prefill rate) is no longer than at the least loaded unit (its queue and the prompt's tokens it does not hold, at its rate), unless it has no engine slot free for the request where the least loaded unit has one; a holder with nothing queued and a slot free keeps it whatever the rates: the prefill affinity saves weighed against the queue it adds. prefix_slack decides instead where either unit reports no queue or rate. false: prefix_slack alone. Default true.",
    )
    prefix_prefill_tokens_per_s: float = Field(
        0.0,
        ge=0,
        description="Policy prefix, with prefix_ttft_s or prefix_weigh_prefill: the prompt tokens a unit prefills per second. 0: each unit's own, measured by its engine and reported as the named metric prefill_tokens_per_s. Default 0.",
    )
    load_source: Literal["watch", "watch-http", "poll", "redis"] = Field(
        "watch",
        description="Where unit load comes from: watch (a gRPC WatchLoad stream per unit; over HTTP beyond watch_grpc_max_units units), watch-http (the same reports as server-sent events from GET /load/watch, on the gateway's HTTP client), poll (GET /load), redis. Default watch.",
    )
    watch_grpc_max_units: int = Field(
        64,
        ge=0,
        description="With load_source watch and more configured units than this, the gateway holds each unit's report stream over HTTP (as watch-http) instead of gRPC: a gRPC channel with its stream costs the gateway about 55-70 KB of memory and, in bench/scale, about twice the CPU per report of an HTTP stream (about 15 KB). Default 64.",
    )
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries on another unit before the first byte (connection failure, 429, 503). Default 2.",
    )
    poll_interval_s: float = Field(
        1.0,
        gt=0,
        description="Time between two GET /load of a unit with load_source poll, in s. Default 1.",
    )
    stale_after_s: float = Field(
        5.0,
        gt=0,
        description="A unit whose last report is older than this gets no new requests, in s. Default 5.",
    )
    queue_size: int = Field(
        1024,
        ge=0,
        description="Requests that may wait when every SERVING unit is full; more get 429. Default 1024.",
    )
    queue_timeout_s: float = Field(
        10.0, ge=0, description="Longest wait in that queue before 429, in s. Default 10."
    )
    queue_class_size: dict[PriorityClass, NonNegativeInt] = Field(
        default_factory=dict,
        description="Most requests of one priority class that may wait, by class (interactive, standard, batch), within queue_size: a table in TOML ({batch = 256}), CLASS=N,CLASS=N on the command line. A class not named may fill queue_size. Default none.",
    )
    queue_class_timeout_s: dict[PriorityClass, NonNegativeFloat] = Field(
        default_factory=dict,
        description="Longest wait in the queue by priority class before 429, in s: a table in TOML ({batch = 60}), CLASS=S,CLASS=S on the command line. A class not named waits queue_timeout_s. Default none.",
    )
    eject_after: int = Field(
        3,
        ge=1,
        description="Consecutive failures (connection errors, 5xx) that eject a unit. Default 3.",
    )
    eject_s: float = Field(
        5.0,
        gt=0,
        description="How long an ejected unit gets no requests the first time, in s: a unit ejected again right after its cool-down is ejected for eject_s times the number of its ejections in a row (up to max_eject_s); each eject_s it then answers without an ejection takes one off that number. Default 5.",
    )
    max_eject_s: float = Field(
        300.0,
        gt=0,
        description="The longest one ejection lasts, however many came before it in a row, in s (never below eject_s). Default 300.",
    )
    gave_up_failure_s: float = Field(
        30.0,
        gt=0,
        description="A client that leaves (or whose deadline passes) after waiting at least this long for a unit's first byte (its response head; a gRPC stream's first message) counts as a failure of that unit toward ejection, as response_timeout_s does: a unit that takes requests and never answers is ejected even when clients give up long before response_timeout_s. One that leaves sooner, or after the unit started answering, says nothing about the unit. Raise it where a first token can take longer (very long prompts), in s. Default 30.",
    )
    max_ejection_percent: int = Field(
        50,
        ge=0,
        le=100,
        description="Passive health never ejects more than this share of the SERVING units, in percent, rounded down (at 50: one of 2 or 3 units, none of 1); a unit past it keeps taking requests. Default 50.",
    )
    connections_per_unit: int = Field(
        512,
        gt=0,
        description="Most open HTTP connections from this gateway to one unit. Default 512.",
    )
    grpc_unit_wire: Literal["http", "grpc"] = Field(
        "http",
        description="How gRPC Generate calls reach units: http (the unit's HTTP port, gRPC-Web framing: about half the CPU per streamed message) or grpc (its gRPC port). A unit that does not serve the http form is called over gRPC. Default http.",
    )
    grpc_interval_ms: float = Field(
        5.0,
        ge=0,
        le=1000,
        description="With grpc_unit_wire http: a unit sends the messages of one gRPC Generate stream at most this often, in ms, each carrying every token made since the last (the first at once; a token waits at most this long). Fewer, larger messages cost the unit, this gateway and the client less per token. 0: each token as it comes. Default 5.",
    )
    grpc_messages_per_s: float = Field(
        3000.0,
        ge=0,
        description="With grpc_unit_wire http: about how many messages a second all of this gateway's gRPC Generate streams together should come to. A stream's interval is its share, the streams in flight when it starts over this rate (at 64 streams and 3,000: 21 ms), never below grpc_interval_ms nor above 50 ms; the first message still goes at once. 0: grpc_interval_ms for every stream. Default 3000.",
    )
    response_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a unit to start answering (its first token, when streaming), in s; past it the request gets 504 and the unit a failure toward ejection. Default 300.",
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="Deadline of a request that brings none, in s. Default none."
    )
    migrations: int = Field(
        2,
        ge=0,
        le=10,
        description="Times one request may be continued on another unit after its unit failed under it (connection lost, unit_failed, silent too long). 0 turns migration off. Default 2.",
    )
    stream_idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A streaming unit that sends nothing for this long has failed: the request continues on another unit, in s. Default 60.",
    )
    report_delay_s: float = Field(
        0.0,
        ge=0,
        description="For benchmarks only: apply each load report this much later, in s, to show what stale load costs. Default 0.",
    )
    report_budget_per_s: float = Field(
        250.0,
        ge=0,
        description="Load reports per second this gateway asks of all its configured units together (watch, watch-http, poll): with N units, each reports load changes at most every N/budget s and a heartbeat every N/budget s when that is longer than the unit's own; poll_interval_s and stale_after_s stretch to match (stale: 3 such intervals). Between reports the gateway's own counts keep the estimate current. 0: every unit reports at its own rate. Default 250.",
    )
    report_min_interval_s: float = Field(
        0.05,
        ge=0,
        description="Each unit reports load changes to this gateway at most this often, in s, whatever the fleet's size (watch, watch-http, poll, redis): between reports the gateway's own counts are exact for its own traffic, and only other gateways' traffic waits up to this long. State changes still arrive at once. 0: a small fleet reports at the units' own rate. Default 0.05.",
    )
    tls_ca_file: Path | None = Field(
        None,
        description="CA bundle to verify units by. A unit given as https:// is reached over TLS for HTTP and gRPC alike (plain http:// means plain for both); with this set, every unit must be https://. Default: the system's CAs.",
    )
    unit_api_key: SecretStr | None = Field(
        None,
        description="API key this gateway presents to units. Default: the client's own Authorization is passed on.",
    )
    discover_allow: list[str] = Field(
        default_factory=list,
        description="With load_source redis: the units registered in Redis that this gateway routes to, as shell-style patterns of their HTTP URL (e.g. 'http://10.0.*:8080'); a unit's gRPC target must be on its URL's host. Units given in gateway.units need none. Default none: only configured units.",
    )
    max_units: int = Field(
        256,
        ge=1,
        description="Most units this gateway knows (configured and discovered in Redis); more registered in Redis are refused. Default 256.",
    )
    correct_load: bool = Field(
        True,
        description="Correct each unit's last report by this gateway's own requests: its own in flight in place of the report's count of them (where the report counts them apart), else its starts and finishes since the report. Off only in benchmarks. Default true.",
    )
    tenants_file: Path | None = Field(
        None,
        description="TOML file of tenants ([[tenant]] tables: name, keys or key_sha256, priority, requests_per_minute, tokens_per_minute, max_concurrent, tokens_per_day, models), reloaded on SIGHUP and when it changes; a bad file keeps the last good one. server.api_keys are tenant default. Default none: no tenants, no limits.",
    )
    tenants_poll_s: float = Field(
        1.0,
        gt=0,
        description="How often the tenants file (and, with tenants_redis, Redis) is looked at for changes, in s; a changed file is read once two looks in a row find it the same (a file written in place is never read half written). Default 1.",
    )
    tenants_redis: bool = Field(
        False,
        description="Also read tenants from Redis (keys unitproxy:CLUSTER:tenant:NAME, each a JSON object with the fields of a [[tenant]] table; one there replaces the file's of the same name), so every gateway replica has the same set. Needs redis.url. Default false.",
    )
    access_log: Literal["stderr", "logging", "off"] = Field(
        "stderr",
        description="Where the access log's line a request of a tenant goes (tenant, model, unit, status, tokens, TTFT, duration, priority; never prompt text), written while the unitproxy.access logger is at info: stderr (in the log's format, gathered and written at most every 0.25 s), logging (a record of the unitproxy.access logger a line, for an application's own handlers; several times the CPU), off. Default stderr.",
    )
    max_tenant_labels: int = Field(
        100,
        ge=1,
        description="Most tenant names the per-tenant usage metrics carry as labels, in order of first use; the rest are counted under tenant other. Default 100.",
    )
    tenant_estimate_max_tokens: int = Field(
        256,
        gt=0,
        description="Completion tokens a request that gives no max_tokens is counted as when its tokens are reserved against a tenant's token limits (settled to what it used when it ends), in tokens. Default 256.",
    )
    replicas: int = Field(
        0,
        ge=0,
        description="Gateway replicas that share the tenants' limits. With Redis unreachable, or with no redis.url, each replica enforces limit / replicas from its own counts. 0: as many as were last seen in Redis (1 if none was, or with no Redis). Default 0.",
    )

    @model_validator(mode="after")
    def _units_fit(self) -> GatewaySettings:
        if len(self.units) > self.max_units:
            raise ValueError(
                f"{len(self.units)} units are configured, over max_units {self.max_units}"
            )
        return self

    @model_validator(mode="after")
    def _tls_everywhere(self) -> GatewaySettings:
        if self.tls_ca_file is not None:
            plain = [u.id for u in self.units if not u.http_url.startswith("https://")]
            if plain:
                raise ValueError(
                    f"units {', '.join(plain)} are http:// while tls_ca_file is set: units "
                    "are then reached over TLS only; give https:// URLs (or drop tls_ca_file)"
                )
        return self

    @field_validator("queue_class_size", "queue_class_timeout_s", mode="before")
    @classmethod
    def _parse_by_class(cls, value: Any) -> Any:
        return _by_class(value)

    @field_validator("units", mode="before")
    @classmethod
    def _parse_units(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            parsed = [UnitTarget.parse(v) if isinstance(v, str) else v for v in value]
            ids = [u.id if isinstance(u, UnitTarget) else u.get("id") for u in parsed]
            duplicates = sorted({i for i in ids if ids.count(i) > 1})
            if duplicates:
                raise ValueError(f"unit ids must be unique: {', '.join(map(str, duplicates))}")
            return parsed
        return value


def _by_class(value: Any) -> Any:
    """CLASS=VALUE,CLASS=VALUE (a flag) or a JSON object as a dict; else as given."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        return json.loads(text)
    parsed: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, number = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not CLASS=VALUE (interactive, standard or batch)")
        parsed[name.strip()] = number.strip()
    return parsed


class FollowerSettings(_Section):
    node_name: str = Field(
        "follower-0",
        min_length=1,
        max_length=64,
        description="This node's name. Default follower-0.",
    )
    checks: list[CheckSpec] = Field(
        default_factory=list,
        description="Checks that must pass for the node to be healthy: process:PID, tcp:HOST:PORT, command:SHELL_COMMAND, heartbeat:PATH:MAX_AGE_S. Default none.",
    )
    worker_stop_timeout_s: float = Field(
        30.0,
        gt=0,
        description="After forwarding SIGTERM, how long to wait for the worker before SIGKILL, in s. Default 30.",
    )

    @field_validator("checks", mode="before")
    @classmethod
    def _parse_checks(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [CheckSpec.parse(v) if isinstance(v, str) else v for v in value]
        return value


class UpSettings(_Section):
    units: int = Field(2, ge=1, le=256, description="Units in the local cell. Default 2.")
    followers: int = Field(1, ge=0, le=64, description="Follower nodes per unit. Default 1.")
    state_file: Path = Field(
        Path(".unitproxy/cell.json"),
        description="Where the cell's processes and endpoints are written as JSON; the children's logs go to logs/ beside it. Default .unitproxy/cell.json.",
    )
    base_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="First port of the cell; every port is counted up from it. Default: free ports picked at start.",
    )
    ready_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest wait for the gateway and every sidecar to be ready, in s. Default 60.",
    )
    stop_timeout_s: float = Field(
        10.0,
        gt=0,
        description="After SIGTERM to the children, how long to wait before SIGKILL, in s. Default 10.",
    )
    unit_models: list[str] = Field(
        default_factory=list,
        description="Served model names of the units, in turn: unit i serves the (i mod n)-th (its --served-model-name), so a cell can hold units of different models. Default none: every unit the engine settings' model.",
    )
    restart: bool = Field(
        False,
        description="Start a child that exits again, on the same ports, after a backoff (1 s doubling to 30 s), and rewrite the state file. Default false: a dead child is logged and left so.",
    )

    @property
    def port_count(self) -> int:
        return _port_count(self.units, self.followers)

    @field_validator("base_port")
    @classmethod
    def _ports_fit(cls, value: int | None, info: ValidationInfo) -> int | None:
        units, followers = info.data.get("units"), info.data.get("followers")
        if value is None or units is None or followers is None:
            return value
        needed = _port_count(units, followers)
        if value + needed - 1 > 65535:
            raise ValueError(f"leaves too few ports for {needed}; use at most {65536 - needed}")
        return value


def _port_count(units: int, followers: int) -> int:
    # the gateway, and one sidecar and the followers per unit: an HTTP and a gRPC port each
    return 2 * (1 + units * (1 + followers))


class PlanSettings(_Section):
    rate_per_s: float | None = Field(
        None,
        gt=0,
        description="Requests per second arriving, as a Poisson process, for unitproxy plan. Default none: give this or trace_file.",
    )
    trace_file: Path | None = Field(
        None,
        description='Arrivals to plan for instead of a rate: JSON lines, one request each, {"at_s": 0.25, "prompt_tokens": 812, "output_tokens": 120}, optionally "prefix_group" and "prefix_tokens" (leading prompt tokens shared with its group). Default none.',
    )
    duration_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="Traffic simulated at rate_per_s, in s of virtual time. Default 3600 (an hour).",
    )
    prompt_tokens: str = Field(
        "512",
        description="Prompt length: a number of tokens, or uniform:LO:HI, lognormal:MEAN:SIGMA[:MAX] or exponential:MEAN. Default 512.",
    )
    output_tokens: str = Field(
        "128",
        description="Output length, written as prompt_tokens is. Default 128.",
    )
    prefix_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of each prompt that is its group's prefix (a system prompt), 0 to 1; the units' prefix caches hold them. Default 0: no shared prefixes.",
    )
    prefix_groups: int = Field(
        1, ge=1, description="Groups of requests that share a prefix, picked at random. Default 1."
    )
    slo_ttft_p99_s: float | None = Field(
        None,
        gt=0,
        description="Objective: time to first token at the 99th percentile, in s (queue in the gateway and the unit included). No default: required.",
    )
    slo_tpot_p99_s: float | None = Field(
        None,
        gt=0,
        description="Objective: time per output token after the first at the 99th percentile, in s. Default none: no objective.",
    )
    max_units: int = Field(
        1024, ge=1, description="Largest fleet tried before giving up. Default 1024."
    )
    measure_url: str | None = Field(
        None,
        description="The unit's shape measured from a running unit instead of the engine.sim knobs: the HTTP URL of its sidecar (http://host:8080), idle, to which a short calibration load is sent (about 10-30 s) and whose slots, prefill cost per token and decode step times are fitted (max_num_batched_tokens and the prefix cache stay as set; capacity is the unit's own unless given). Default none.",
    )
    measure_api_key: str | None = Field(
        None,
        description="API key sent to the measured unit (Authorization: Bearer), where its sidecar asks for one. Default none.",
    )
    seed: int = Field(0, description="Seed of the arrivals, lengths and ties. Default 0.")
    json_output: bool = Field(
        False,
        description="Print one JSON object (units, every fleet tried) instead of the table. Default false.",
    )
    plot_file: Path | None = Field(
        None,
        description="Draw TTFT and TPOT p50/p99 against units to this PNG (needs matplotlib). Default none.",
    )

    @field_validator("prompt_tokens", "output_tokens")
    @classmethod
    def _lengths(cls, value: str) -> str:
        from proxy.plan.workload import parse_lengths

        parse_lengths(value)  # ValueError says what is wrong
        return value


class RedisSettings(_Section):
    url: str | None = Field(
        None,
        description="Redis that sidecars publish load reports to and gateways with load_source redis read them from, redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for TLS, unix:// for a socket). Default none: no Redis.",
    )
    cluster: str = Field(
        "default",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name of this fleet in Redis keys (unitproxy:CLUSTER:...); sidecars and gateways that share load use the same one. Default default.",
    )
    timeout_s: float = Field(
        1.0,
        gt=0,
        description="Longest wait to connect to Redis and for one command, in s. Default 1.",
    )
    backoff_initial_s: float = Field(
        0.1,
        gt=0,
        description="First wait before reconnecting after Redis failed, in s; doubles per failed attempt, with jitter. Default 0.1.",
    )
    backoff_max_s: float = Field(
        5.0,
        gt=0,
        description="Longest wait between two attempts to reconnect to Redis, in s. Default 5.",
    )

    @field_validator("url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value


class HealthSettings(_Section):
    interval_s: float = Field(
        1.0, gt=0, description="Time between two probes of a node, in s (+-10 % jitter). Default 1."
    )
    timeout_s: float = Field(1.0, gt=0, description="Longest wait for one probe, in s. Default 1.")
    unhealthy_threshold: int = Field(
        3, ge=1, description="Consecutive failed probes that make a node unhealthy. Default 3."
    )
    healthy_threshold: int = Field(
        2, ge=1, description="Consecutive good probes that make a node healthy again. Default 2."
    )
    stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="The leader is unhealthy when its engine has work and made no token for this long, in s. Default 30.",
    )


class TracingSettings(_Section):
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector to send traces to, over OTLP HTTP/protobuf: spans are posted to ENDPOINT/v1/traces (e.g. http://otel-collector:4318). unitproxy up passes it to every process; a sidecar running vLLM passes it to vLLM too. Default none: no traces (a client's traceparent is still passed on).",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of the requests without a sampled traceparent that are traced, 0 to 1; a request whose traceparent says sampled (or not) is traced (or not) as it says. Default 1.",
    )
    service_name: str | None = Field(
        None,
        description="The service.name of this process's spans. Default: unitproxy-gateway or unitproxy-sidecar.",
    )
    max_queued_spans: int = Field(
        4096,
        gt=0,
        description="Spans held in memory waiting to be sent; past it new spans are dropped and counted (unitproxy_trace_spans_dropped_total). Default 4096.",
    )
    batch_spans: int = Field(
        512, gt=0, description="Most spans in one export request. Default 512."
    )
    export_interval_s: float = Field(
        1.0,
        gt=0,
        description="Longest time a span waits before it is sent (a full batch goes at once), in s. Default 1.",
    )
    export_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Longest wait for the collector to take one export (also what shutdown waits for the last one), in s. Default 5.",
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="UNITPROXY_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)  # type: ignore[arg-type]
    engine: EngineSettings = Field(default_factory=EngineSettings)  # type: ignore[arg-type]
    sidecar: SidecarSettings = Field(default_factory=SidecarSettings)  # type: ignore[arg-type]
    health: HealthSettings = Field(default_factory=HealthSettings)  # type: ignore[arg-type]
    follower: FollowerSettings = Field(default_factory=FollowerSettings)  # type: ignore[arg-type]
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)  # type: ignore[arg-type]
    up: UpSettings = Field(default_factory=UpSettings)  # type: ignore[arg-type]
    plan: PlanSettings = Field(default_factory=PlanSettings)  # type: ignore[arg-type]
    redis: RedisSettings = Field(default_factory=RedisSettings)  # type: ignore[arg-type]
    tracing: TracingSettings = Field(default_factory=TracingSettings)  # type: ignore[arg-type]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # CLI values arrive as init values; load() adds the TOML file below env.
        return (init_settings, env_settings)

    def ports(self, role: str) -> tuple[int, int]:
        http, grpc = DEFAULT_PORTS[role]
        return (
            http if self.server.http_port is None else self.server.http_port,
            grpc if self.server.grpc_port is None else self.server.grpc_port,
        )


class ConfigError(Exception):
    """Invalid configuration: ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def check_role(role: str, settings: Settings) -> None:
    """What one role needs beyond valid values; raises ConfigError."""
    problems = []
    if role == "follower" and settings.redis.url is not None:
        problems.append(
            "redis.url: the follower does not use Redis (its node's health reaches Redis in "
            "its sidecar's load reports); drop --redis-url / UNITPROXY_REDIS__URL here"
        )
    if role == "gateway":
        redis_source = settings.gateway.load_source == "redis"
        if redis_source and settings.redis.url is None:
            problems.append(
                "gateway.load_source: redis needs redis.url; give --redis-url redis://HOST:PORT/DB"
            )
        if redis_source and not settings.gateway.units and not settings.gateway.discover_allow:
            problems.append(
                "gateway.discover_allow: with load_source redis and no units configured, give "
                "the URL patterns of the units to accept from Redis (e.g. http://10.0.*:8080)"
            )
        if settings.gateway.tenants_redis and settings.redis.url is None:
            problems.append(
                "gateway.tenants_redis needs redis.url; give --redis-url redis://HOST:PORT/DB"
            )
        # With Redis, units register themselves; otherwise they must be listed.
        if not settings.gateway.units and not redis_source:
            problems.append(
                "gateway.units: no unit configured; give --unit ID=HTTP_URL,GRPC_TARGET (repeatable)"
            )
    if role == "plan":
        problems += _plan_problems(settings.plan)
    if problems:
        raise ConfigError(problems)


def _plan_problems(plan: PlanSettings) -> list[str]:
    problems = []
    if (plan.rate_per_s is None) == (plan.trace_file is None):
        problems.append(
            "plan.rate_per_s: give either --rate REQUESTS_PER_S or --trace FILE (one of them)"
        )
    if plan.slo_ttft_p99_s is None:
        problems.append("plan.slo_ttft_p99_s: give the objective, --slo-ttft-p99 SECONDS")
    return problems


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError([f"--config: cannot read {path}: {exc.strerror}"]) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"--config: {path} is not valid TOML: {exc}"]) from exc


def load(cli: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Build settings from CLI values (nested dict), env and the optional TOML file."""
    toml = read_toml(config_file) if config_file else {}

    class _WithToml(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, _DictSource(settings_cls, toml))

    try:
        bound = _WithToml(**cli)
    except SettingsError as exc:  # an environment value that is not valid JSON, say
        hint = "list values in UNITPROXY_* variables are JSON, e.g. '[\"f1=host:50052\"]'"
        raise ConfigError([f"environment: {exc}; {hint}"]) from exc
    except ValidationError as exc:
        raise ConfigError([_describe(err) for err in exc.errors()]) from exc
    return Settings.model_construct(
        **{name: getattr(bound, name) for name in Settings.model_fields}
    )


class _DictSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]):
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._data


def _describe(err: Any) -> str:
    where = ".".join(str(part) for part in err["loc"]) or "settings"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown setting"
    shown = err.get("input")
    if isinstance(shown, dict | list) or shown is None:
        return f"{where}: {msg}"
    return f"{where}: {msg} (got {shown!r})"
