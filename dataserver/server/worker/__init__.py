"""A worker process: its loop and sockets (``worker``), a task composed from the store or the
dataset (``compose``), its datasets per control state (``controls``), its direct result
connections (``direct``) and the client's landing buffers (``landings``).

May import the modules shared at ``dataserver.server`` (config, conns, counts, memory,
store, running, outbox, beats); never ``dataserver.server.front``: ``tests/test_layout.py``."""
