"""The I/O thread: the loop that owns every socket (``engine``), what it does with each
message (``handlers``; second copies of slow servers' tasks: ``hedges``), how tasks are cut and sent (``dispatch``) and the plan book that
ties an epoch's plan to the batches in flight (``book``); what the engine hands them
(``parts``), its command queue (``mailbox``) and its asks for the dataset's sizes
(``sizes``). The only layer that sees both the network and the buffers.

May import every package below it (``plan``, ``session``, ``net``, ``buffers``) and the
client's shared modules; never the facade (``dataserver_client.client``)."""
