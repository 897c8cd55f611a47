"""The batches in flight: the record of each (``inflight``), the tasks asked of servers and
who owes what (``ledger``), how a batch is cut into tasks (``cutting``), the batches served
ahead for a mode not yet asked for (``lookahead``), a batch rebuilt after a steer
(``rebuild``), what a server's answer means (``answers``) and the fetch of the dataset's
sizes (``announce``). Bookkeeping only: no sockets, threads or tensors.

May import: ``plan``, the client's shared modules (``errors``, ``counts``, ``config``) and
the protocol. Never ``net``, ``buffers`` or ``engine`` at run time (their types only under
``if TYPE_CHECKING:``), never torch or zmq (``tests/test_layout.py``)."""
