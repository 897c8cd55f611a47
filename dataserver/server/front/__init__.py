"""The front: the one process a server's clients connect to. Its loop and sockets
(``front``), the clients' messages (``clients``, the digests naming a task: ``digests``), sessions and the fair queue
(``sessions``), routing tasks to workers (``routing``), the worker processes (``pool``),
the bounded outlet of results (``outlet``), fetching ahead (``prefetch``), the dataset's
sizes (``announce``), the session cap (``capacity``), STATS and metrics (``view``,
``statsview``, ``metrics``, ``scrape``) and a first index build (``indexing``).

May import the modules shared at ``dataserver.server`` (config, conns, counts, memory,
store, running, outbox, beats); never ``dataserver.server.worker`` (it starts workers as
processes, ``python -m dataserver.server.worker.worker``): ``tests/test_layout.py``."""
