"""LiteLLM proxy's ``general_settings.custom_auth`` for bench/tenants/limits.py: one key
with per-key limits and no database.

LiteLLM keeps per-key TPM/RPM on virtual keys, which its key API makes in its Postgres;
a custom auth function may instead return the key's ``UserAPIKeyAuth`` itself, limits
included, and the proxy's rate limiter (its ``parallel_request_limiter`` hook) enforces
them as for a virtual key, counting in the proxy's coordination Redis when it has one.

Runs inside LiteLLM's proxy (its own venv, bench/.venvs/litellm), not in unitproxy: the
bench copies this file next to the proxy's config, whose ``custom_auth:
litellm_auth.user_api_key_auth`` loads it from there. The key and its limits come from
the environment the bench starts the proxy with: BENCH_LITELLM_KEY,
BENCH_LITELLM_TPM (0: none), BENCH_LITELLM_RPM (0: none).
"""

from __future__ import annotations

import os

from fastapi import Request  # type: ignore[import-not-found]
from litellm.proxy._types import (  # type: ignore[import-not-found]
    ProxyErrorTypes,
    ProxyException,
    UserAPIKeyAuth,
)

KEY = os.environ["BENCH_LITELLM_KEY"]
TPM = int(os.environ.get("BENCH_LITELLM_TPM", "0")) or None
RPM = int(os.environ.get("BENCH_LITELLM_RPM", "0")) or None


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    if api_key != KEY:
        raise ProxyException(
            message="unknown key",
            type=ProxyErrorTypes.auth_error,
            param="api_key",
            code=401,
        )
    return UserAPIKeyAuth(api_key=api_key, key_alias="bench", tpm_limit=TPM, rpm_limit=RPM)
