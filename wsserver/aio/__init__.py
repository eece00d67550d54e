"""The asyncio layer: everything that runs on the event loop or talks to sockets.

As websockets keeps its I/O in ``asyncio/`` around a sans-I/O core, this
package drives the core (:mod:`wsserver.protocol`, :mod:`wsserver.session`,
:mod:`wsserver.pacing`, :mod:`wsserver.security`) and the engine seam
(:mod:`wsserver.backends.base`). Dependencies point one way, top to bottom::

    server       listening socket, lifecycle, shutdown; builds the rest
    ├── http, web      plain HTTP on the same port (HttpContext), the chat page
    └── connection     receive loop; the one way out of the session (apply)
        ├── sender         frames to the client, drain watchdog
        ├── peer           the websockets connection class, memory bound
        └── pipeline       one request: acquire → started → submit → pump → finalize
            ├── channel        engine → loop bounded queue (the seam's Sink)
            ├── scheduler      FIFO of requests waiting for the engine's slots
            └── metrics        Prometheus metrics, loop-lag probe

Only this package imports websockets, janus and prometheus_client.
"""

from __future__ import annotations

from .server import Server, run

__all__ = ["Server", "run"]
