"""The plug-ins by name: the gateway's selection policies, listed once.

Each policy is one module in ``proxy/gateway/policies/`` (see its ``__init__``) that
defines ``POLICY``, its class; ``POLICIES`` maps its name to that module and a few
words on how it chooses. Everything that lists the policies takes them from here: the
setting ``gateway.policy`` (its values and its description), the ``--policy`` flag,
the router (which builds the one named), and the tests that check that each name is
documented. Adding a policy is its module and one line below (and its sentence in the
docs, which a test asks for).

A shared module that imports nothing, so that the settings may read it: the policies'
modules are imported only by the gateway, when its router builds one.
"""

from __future__ import annotations

from typing import NamedTuple


class Registered(NamedTuple):
    module: str  # defines POLICY, the policy's class
    summary: str  # how it chooses, in a few words (the setting's description)


POLICIES: dict[str, Registered] = {
    "lor": Registered("proxy.gateway.policies.lor", "least outstanding / capacity"),
    "prefix": Registered(
        "proxy.gateway.policies.prefix",
        "the unit most likely to hold the prompt's prefix in its KV cache, "
        "within a bound on its load, else lor",
    ),
    "latency": Registered(
        "proxy.gateway.policies.latency",
        "the least predicted time to first token, learnt per unit from the TTFTs it "
        "gave against its load and the prompt's uncached length",
    ),
    "p2c": Registered("proxy.gateway.policies.p2c", "power of two choices"),
    "round_robin": Registered("proxy.gateway.policies.round_robin", ""),
    "random": Registered("proxy.gateway.policies.random", ""),
}
DEFAULT_POLICY = "lor"
POLICY_NAMES = tuple(POLICIES)


def describe_policies() -> str:
    """The policies, each with its summary: the setting's description."""
    named = (f"{name} ({p.summary})" if p.summary else name for name, p in POLICIES.items())
    return f"How a unit is chosen: {', '.join(named)}. Default {DEFAULT_POLICY}."
