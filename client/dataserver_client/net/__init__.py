"""The client's ZeroMQ side: one link per server (``serverlink``: its sockets, state,
outstanding tasks and landing hand-over; ``links``: all of them, their connection events,
heartbeats and the best link; ``linkindex``: links by free credit, tasks by send time),
WELCOME's check (``welcome``), the same-host proof (``samehost``), the byte accounting of a
connection (``inflow``), the DEALER options and monitor events (``sockets``), heartbeats
(``beats``), descriptor limits (``fds``), socket events (``watch``), server discovery
(``discovery``), receiving one message straight into its batch (``receive``) and how often
a server's handshake is acted on (``handshakes``).

May import: ``plan``, the client's shared modules (``errors``, ``config``), the protocol and
zmq. Never ``session``, ``buffers``, ``engine`` or torch (``tests/test_layout.py``)."""
