"""The gateway's own HTTP/1.1, on both sides of it; a reader of the routing can skip it.

``front``: client connections. Plain inference requests are parsed by httptools and
served without request objects; anything else is handed to aiohttp on the same
connection. ``pool``: kept-alive connections to units, their answers parsed by
httptools and spliced into the client's connection.

What the rest of the gateway uses: ``front.Front`` and ``front.Response`` (the
``forward.Downstream`` of the lean path), ``pool.Pool`` and ``pool.UnitConnection``
with the errors ``ConnectFailed`` and ``Broken``.
"""
