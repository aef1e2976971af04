"""The selection policies: each one module here, registered under its name in
``proxy.registry.POLICIES``.

A policy is one class (``base.Policy``), built once by the router from the settings
and the router's shared objects (``base.Shared``: random generator, clock, load view,
the units), told of the unit set's events (a unit added, a report about to apply, a
unit's load moved) so that it may keep its own state and index, and asked for one
unit per choice with a view of the request (``request.Want``) and of the candidates
(``base.Candidates``). The router names no policy: it builds the one the settings
name (``base.create``) and calls it.

    lor          index.LeastLoaded, a heap by load (the default)
    prefix       prefix.PrefixIndex and EngineFeedback, and a heap with the fleet's sums
    p2c, random  index.sample_available, draws from every unit
    round_robin  its own cursor over the units
"""
