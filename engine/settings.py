"""The engines' settings: which engine, its model, and each kind's knobs.

The proxy nests ``EngineSettings`` as the ``engine`` section of its settings root
(``proxy/settings.py``), which reads flags, environment and the config file; an engine
is built from this section alone. Every field says its default and unit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from engine.tokens import ACCURACY_PCT

EngineKind = Literal["sim", "vllm", "openai"]


class _EngineSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class SimSettings(_EngineSection):
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
    max_num_batched_tokens: int = Field(
        2048,
        ge=0,
        description="Tokens one step may process: a token for every decoding sequence, then chunks of prompts to prefill, oldest first (chunked prefill, as vLLM's max_num_batched_tokens). 0: no limit, whole prompts prefilled in the step they are admitted. Default 2048.",
    )
    default_max_tokens: int = Field(
        64,
        gt=0,
        description="Output length when a request gives no max_tokens, in tokens. Default 64.",
    )
    seed: int = Field(0, description="Seed of the generated text. Default 0.")
    prefix_cache_blocks: int = Field(
        4096,
        ge=0,
        description="KV blocks the prefix cache holds (LRU); a prompt's cached leading blocks need no prefill. 0: no prefix cache. Default 4096.",
    )
    block_size: int = Field(
        16, gt=0, description="Tokens per KV block of the prefix cache. Default 16."
    )
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
    embedding_dim: int = Field(
        384,
        gt=0,
        le=8192,
        description="Length of the vectors of /v1/embeddings and /pooling (a function of the seed and the input; texts that share words point alike). Default 384.",
    )
    responses_stored: int = Field(
        1024,
        ge=0,
        description="Responses API answers kept for GET /v1/responses/{id} and previous_response_id, oldest dropped first. 0: none kept. Default 1024.",
    )
    tokenizer: Path | None = Field(
        None,
        description="A byte-level BPE tokenizer.json (Hugging Face tokenizers; or a directory holding one): exact token counts, and output tokens are its whole-word tokens. Needs the tokenizers package. Default: the built-in counter, within about "
        f"{ACCURACY_PCT} % of a real BPE on English prose.",
    )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: Path | None) -> Path | None:
        if (
            value is not None
            and not (value / "tokenizer.json" if value.is_dir() else value).is_file()
        ):
            raise ValueError(f"{value}: no tokenizer.json there")
        return value


class EngineSettings(_EngineSection):
    kind: EngineKind = Field("sim", description="Engine kind. Default sim.")
    model: str | None = Field(
        None, description="Model path or name. Default: the engine's own (sim: 'unitproxy-sim')."
    )
    device: Literal["neuron", "cuda", "cpu"] | None = Field(
        None, description="Device for engine vllm. Default: what vLLM detects."
    )
    upstream_url: str | None = Field(
        None, description="Base URL of the OpenAI-compatible server, for engine openai. No default."
    )
    # -- engine vllm: passed through to vLLM's engine arguments ----------------------
    served_model_name: str | None = Field(
        None,
        description="Model name shown in /v1/models, in load reports and expected in requests, for engines vllm and sim. Default: the model path (sim: --model, else 'unitproxy-sim').",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer path or name, for engine vllm. Default: the model's."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Tensor parallel degree (devices per pipeline stage), for engine vllm. Default 1.",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline parallel stages, for engine vllm. Default 1."
    )
    data_parallel_size: int = Field(
        1, ge=1, description="Data parallel replicas inside the engine, for engine vllm. Default 1."
    )
    max_num_seqs: int | None = Field(
        None, gt=0, description="Most sequences in one batch, for engine vllm. Default: vLLM's."
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt plus output, in tokens, for engine vllm. Default: the model's.",
    )
    dtype: str = Field(
        "auto",
        description="Weight and activation dtype (auto, bfloat16, float16, float32), for engine vllm. Default auto.",
    )
    quantization: str | None = Field(
        None, description="Quantization method (e.g. fp8, awq), for engine vllm. Default none."
    )
    speculative_config: dict[str, Any] | None = Field(
        None,
        description='Speculative decoding config as a JSON object (e.g. {"method": "ngram", "num_speculative_tokens": 4}), for engine vllm. Default none.',
    )
    additional_config: dict[str, Any] | None = Field(
        None,
        description='Platform-specific config as a JSON object (Neuron: {"override_neuron_config": {...}}), for engine vllm. Default none.',
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description='Any other vLLM engine arguments as a JSON object (e.g. {"enforce_eager": true}); they win over the fields above. Default none.',
    )
    # -- engine vllm: vLLM's own OpenAI layer ------------------------------------------
    vllm_serving: bool = Field(
        True,
        description="Serve the HTTP OpenAI routes through vLLM's own serving layer (tools, structured outputs, logprobs, n, /tokenize), for engine vllm; false: unitproxy's own parser. Default true.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template (a file or the template itself), as vllm serve's --chat-template, for engine vllm. Default: the model's.",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description='Let the model call tools on its own (tool_choice "auto"), as vllm serve\'s flag; needs tool_call_parser, for engine vllm. Default false.',
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's parser of the model's tool calls (hermes, llama3_json, mistral, ...), for engine vllm. Default none.",
    )
    reasoning_parser: str | None = Field(
        None,
        description="vLLM's reasoning parser (deepseek_r1, qwen3, ...), for engine vllm. Default none.",
    )
    serve_args: dict[str, Any] = Field(
        default_factory=dict,
        description='Any other flag of vllm serve\'s OpenAI layer as a JSON object of flag name to value (e.g. {"chat-template-content-format": "openai"}; true: a bare flag), for engine vllm. Default none.',
    )
    # -- engine openai ---------------------------------------------------------------
    upstream_api_key: SecretStr | None = Field(
        None,
        description="Bearer token sent to the upstream, for engine openai; a secret: give it in the environment (UNITPROXY_ENGINE__UPSTREAM_API_KEY) or the config file rather than on a command line. Default none.",
    )
    upstream_metrics_interval_s: float = Field(
        1.0,
        gt=0,
        description="Time between two reads of the upstream's /metrics, in s, for engine openai. Default 1.",
    )
    upstream_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest wait to connect to the upstream, and for its /health and /metrics, in s, for engine openai. Default 10.",
    )
    upstream_vllm_extras: bool = Field(
        True,
        description="Ask the upstream for vLLM's stream extras (token ids, usage in every chunk); turn off for servers that reject unknown fields. Default true.",
    )
    sim: SimSettings = Field(default_factory=SimSettings)  # type: ignore[arg-type]

    @field_validator(
        "speculative_config", "additional_config", "engine_args", "serve_args", mode="before"
    )
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        # Flags and TOML strings carry these as JSON text; env values arrive parsed.
        if not isinstance(value, str):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object")
        return parsed
