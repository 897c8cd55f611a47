"""dataserver_client: the trainer side of dataserver.

from dataserver_client import DataServerClient

with DataServerClient("tcp://127.0.0.1:5555", batch_size=16) as client:
    for epoch in range(epochs):
        client.set_epoch(epoch)
        for batch in client:
            loss, small_ratio = train_step(batch.images, batch.targets)
            client.feedback(small_ratio)
"""

from dataserver_client.batch import Batch, content_mask
from dataserver_client.client import DataServerClient, iterate_epochs
from dataserver_client.errors import DataServerError, NotAuthorized, ServerUnreachable
from dataserver_client.plan.sizes import MultiScale, StepSizes

__all__ = [
    "Batch",
    "DataServerClient",
    "DataServerError",
    "MultiScale",
    "NotAuthorized",
    "ServerUnreachable",
    "StepSizes",
    "content_mask",
    "iterate_epochs",
]
__version__ = "0.1.0"
