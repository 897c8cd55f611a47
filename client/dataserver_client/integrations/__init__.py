"""Bridges from ``DataServerClient`` to training frameworks, each an optional extra.

- ``dataserver_client.integrations.mmengine`` (``pip install "dataserver[mmengine]"``):
  ``DataServerLoader`` (a ``train_dataloader`` for MMEngine's ``Runner``),
  ``DataServerHook`` and ``StitcherFeedbackHook``.
- ``dataserver_client.integrations.ray`` (``pip install "dataserver[ray]"``): ``DataTier``,
  the data tier as Ray actors; clients inside the cluster use ``ray://NAME``.

Nothing here is imported by ``dataserver_client`` itself, so the core never needs a
framework installed.
"""
