"""The dataserver wire protocol, shared by the client, the server front and its workers.

No socket code lives here. Nothing is ever pickled. A message is a list of ZeroMQ frames::

    frame 0    b"DS2"                 magic + protocol version (one ASCII digit)
    frame 1    one byte               MsgType
    frame 2    msgpack map            the header; header["arrays"] = [[dtype, [d0, d1, ...]], ...]
    frame 3..  raw bytes, one frame   per array named in header["arrays"], C order, no padding

- ``wire.py``: the envelope (frames, sizes, array descriptors against buffers).
- ``fields.py``: field types (type and range of one header field, as msgspec constraints).
- ``messages.py``: one msgspec Struct per message type; ``decode`` returns the right one.
- ``batchsizes.py``: ``BatchSizes``, a batch's output, fit and stored sizes as one value
  (a TASK's ``out_hw``, ``fit_hw``, ``source_hw``), from the client's plan to the pipeline.

``decode`` raises ``ProtocolError`` and nothing else, whatever the input; receivers count
and drop it.
"""

from dataserver.protocol.batchsizes import BatchSizes
from dataserver.protocol.fields import (
    MAX_CONTROL_BYTES,
    MAX_CONTROL_DEPTH,
    MAX_INT,
    MAX_SESSION_BYTES,
    control_problem,
)
from dataserver.protocol.messages import (
    MAX_BOXES,
    MAX_IMAGE_SIDE,
    MAX_TASK_IMAGES,
    MAX_TILES,
    MESSAGES,
    Bye,
    Cancelled,
    Control,
    Done,
    ErrorMsg,
    Heartbeat,
    Hello,
    Message,
    Ready,
    Result,
    SampleSizes,
    Stats,
    Tally,
    Task,
    Welcome,
    control_digest,
    decode,
    decode_head,
    sizes_digest,
    wire_control_digest,
)
from dataserver.protocol.wire import (
    ALLOWED_DTYPES,
    MAGIC,
    MAX_ARRAY_BYTES,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    MsgType,
    ProtocolError,
    pack,
)

__all__ = [
    "ALLOWED_DTYPES",
    "MAGIC",
    "MAX_ARRAY_BYTES",
    "MAX_BOXES",
    "MAX_CONTROL_BYTES",
    "MAX_CONTROL_DEPTH",
    "MAX_FRAMES",
    "MAX_HEADER_BYTES",
    "MAX_IMAGE_SIDE",
    "MAX_INT",
    "MAX_SESSION_BYTES",
    "MAX_TASK_IMAGES",
    "MAX_TILES",
    "MESSAGES",
    "PROTOCOL_VERSION",
    "BatchSizes",
    "Bye",
    "Cancelled",
    "Control",
    "Done",
    "ErrorMsg",
    "Heartbeat",
    "Hello",
    "Message",
    "MsgType",
    "ProtocolError",
    "Ready",
    "Result",
    "SampleSizes",
    "Stats",
    "Tally",
    "Task",
    "Welcome",
    "control_digest",
    "control_problem",
    "decode",
    "decode_head",
    "pack",
    "sizes_digest",
    "wire_control_digest",
]
