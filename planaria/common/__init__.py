"""What the daemon, the frontend and the engines share, below all of them.

- ``envelope``: the admin protocol's request and reply envelope and its error codes;
- ``errors``: the admin error tree and the one place exceptions become codes (``to_reply``)
  and codes exceptions again (``from_reply``);
- ``admin_client``: the one blocking admin client (DEALER over ipc or TCP+CurveZMQ), used by
  the CLI for the daemon's control socket and by the daemon for a frontend's admin socket;
- ``sockets``: the one Unix-socket path limit, endpoint spelling, well-known socket names;
- ``logging``: the structlog setup every process uses (JSON lines in the daemon's logs).

``planaria.daemon`` and ``planaria.frontend`` both import this package and never each other;
it imports nothing from other planaria packages (tests/test_layers.py checks both).
"""
