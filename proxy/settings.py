"""Settings: one root, a nested section per concern.

Sources, strongest first: command-line flags, environment variables
``UNITPROXY_<SECTION>__<NAME>`` (for example ``UNITPROXY_SIDECAR__CAPACITY=32``),
the TOML file given with ``--config`` (``[sidecar] capacity = 32``), the defaults
below. Every field says its default and unit.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

Role = Literal["sidecar", "follower", "gateway", "up"]

DEFAULT_PORTS: dict[str, tuple[int, int]] = {
    # role: (http, grpc)
    "gateway": (8000, 50050),
    "sidecar": (8080, 50051),
    "follower": (8081, 50052),
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ServerSettings(_Section):
    host: str = Field(
        "0.0.0.0", description="Address the HTTP and gRPC servers bind. Default 0.0.0.0."
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
    max_prompt_chars: int = Field(
        1_000_000,
        gt=0,
        description="Largest prompt (all messages together), in characters. Default 1,000,000.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class SimSettings(_Section):
    max_num_seqs: int = Field(
        32, gt=0, description="Sequences decoded together in one step (batch slots). Default 32."
    )
    prefill_ms_per_token: float = Field(
        0.05, ge=0, description="Prefill cost per prompt token, in ms. Default 0.05."
    )
    decode_step_ms: float = Field(
        10.0, ge=0, description="Time of one decode step with one sequence, in ms. Default 10."
    )
    decode_ms_per_seq: float = Field(
        0.1,
        ge=0,
        description="Extra time of one decode step per running sequence, in ms. Default 0.1.",
    )
    default_max_tokens: int = Field(
        64,
        gt=0,
        description="Output length when a request gives no max_tokens, in tokens. Default 64.",
    )
    seed: int = Field(0, description="Seed of the generated text. Default 0.")
    error_after_tokens: int | None = Field(
        None, ge=0, description="Fault: every request fails after this many tokens. Default off."
    )
    hang_after_requests: int | None = Field(
        None,
        ge=0,
        description="Fault: the engine stops making progress once this many requests were admitted. Default off.",
    )
    crash_after_requests: int | None = Field(
        None,
        ge=0,
        description="Fault: the engine dies once this many requests were admitted. Default off.",
    )


class EngineSettings(_Section):
    kind: Literal["sim", "vllm", "openai"] = Field("sim", description="Engine kind. Default sim.")
    model: str | None = Field(
        None, description="Model path or name. Default: the engine's own (sim: 'unitproxy-sim')."
    )
    device: Literal["neuron", "cuda", "cpu"] | None = Field(
        None, description="Device for engine vllm. Default: what vLLM detects."
    )
    upstream_url: str | None = Field(
        None, description="Base URL of the OpenAI-compatible server, for engine openai. No default."
    )
    sim: SimSettings = Field(default_factory=SimSettings)  # type: ignore[arg-type]


class SidecarSettings(_Section):
    unit_id: str = Field(
        "unit-0", min_length=1, max_length=64, description="This unit's id. Default unit-0."
    )
    capacity: int = Field(
        64,
        gt=0,
        description="Most requests admitted at once (outstanding); more get 429. Default 64.",
    )
    report_interval_s: float = Field(
        1.0,
        gt=0,
        description="Longest time between two load reports to watchers (heartbeat), in s. Default 1.",
    )
    retry_after_s: int = Field(
        1, ge=0, description="The retry-after header sent with 429 and 503, in s. Default 1."
    )


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
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown setting"
    shown = err.get("input")
    if isinstance(shown, dict | list) or shown is None:
        return f"{where}: {msg}"
    return f"{where}: {msg} (got {shown!r})"
