"""dataserver: a data service for PyTorch detection training.

The server side (this package) never imports torch. See ``dataserver serve --help`` and,
for the trainer side, ``dataserver_client.DataServerClient``.
"""

__version__ = "0.1.0"
