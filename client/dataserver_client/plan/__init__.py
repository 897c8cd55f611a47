"""The plan: pure functions and records of what an epoch is and who does what, with no
sockets, threads or tensors. The epoch's order (``order``, ``epoch``), the partners a
stitched image takes (``partners``), the image-size schedule (``sizes``), the pace of
feedback (``pacing``), which server a key goes to (``affinity``), when a task is hedged
(``hedging``), and the saved state a job resumes from (``resume``).

May import: the protocol (``dataserver.protocol``), ``dataserver_client.errors`` and its own
modules. Never torch, zmq or any other client package (``tests/test_layout.py``)."""
