"""Where batches are assembled and handed over: the pinned host buffers, their copy to the
device and the regions servers land pixels in (``assembly``), and the hand-off between the
I/O thread and the trainer's thread (``handoff``). The lowest layer that imports torch.

May import: ``plan``, ``session``, the client's shared modules (``batch``, ``config``,
``errors``) and torch. Never ``net`` or ``engine`` (``tests/test_layout.py``)."""
