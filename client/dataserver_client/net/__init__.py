"""The client's ZeroMQ side: one link per server (``links``: WELCOME's checks, the same-host
proof, byte accounting, the link's sockets and state; ``linkindex``: links by socket and
address), heartbeats (``beats``), descriptor limits (``fds``), socket events (``watch``),
server discovery (``discovery``), receiving one message straight into its batch
(``receive``) and how often a server's handshake is acted on (``handshakes``).

May import: ``plan``, the client's shared modules (``errors``, ``config``), the protocol and
zmq. Never ``session``, ``buffers``, ``engine`` or torch (``tests/test_layout.py``)."""
