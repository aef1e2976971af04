"""Routing policies compared on a simulated heterogeneous fleet: ``python -m bench.routing.run``."""
