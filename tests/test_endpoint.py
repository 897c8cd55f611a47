"""The one endpoint parser both sides use (``dataserver/endpoint.py``): a server binds and may
take any free port (``*``); a client connects, and is told plainly that ``*`` is no port."""

from __future__ import annotations

import pytest

from dataserver.endpoint import TcpEndpoint, endpoint_problem, tcp_endpoint, tcp_port
from dataserver.server.config import ConfigError, ServerConfig
from dataserver_client.config import ClientConfig


def test_parts_as_written() -> None:
    assert tcp_endpoint("tcp://10.0.0.5:5555") == TcpEndpoint("10.0.0.5", "5555")
    v6 = tcp_endpoint("tcp://[::1]:7")
    assert v6 == TcpEndpoint("[::1]", "7") and v6.address == "::1"
    for bad in ("tcp://h", "tcp://::1:5", "ipc:///x", "h:5", "tcp://h:5/x"):
        assert tcp_endpoint(bad) is None and tcp_endpoint(bad, bind=True) is None


def test_any_port_only_to_bind() -> None:
    assert tcp_endpoint("tcp://h:*") is None
    assert tcp_endpoint("tcp://h:*", bind=True) == TcpEndpoint("h", "*")
    assert endpoint_problem("tcp://h:*", bind=True) is None
    assert "one port" in (endpoint_problem("tcp://h:*") or "")


def test_problems() -> None:
    assert endpoint_problem("ipc:///tmp/x") is None
    assert endpoint_problem("ipc://") == "expected tcp://HOST:PORT or ipc://PATH"
    assert endpoint_problem("tcp://h:65536", bind=True) == "port out of range"
    assert endpoint_problem("tcp://h:0", bind=True) is None


def test_announced_port_whatever_the_host() -> None:
    assert tcp_port("tcp://0.0.0.0:4000") == "4000"
    assert tcp_port("tcp://[::]:4000") == "4000"
    assert tcp_port("tcp://h:*") is None and tcp_port("ipc:///x") is None


def test_each_side_names_the_bad_endpoint() -> None:
    ServerConfig(bind="tcp://0.0.0.0:*").validate()
    with pytest.raises(ConfigError, match=r"--bind 'tcp://h:70000': port out of range"):
        ServerConfig(bind="tcp://h:70000").validate()
    with pytest.raises(ValueError, match=r"server address 'tcp://h:\*': a client connects"):
        ClientConfig(("tcp://h:*",)).validate()
    with pytest.raises(ValueError, match=r"server address 'tcp://h': expected tcp://HOST:PORT"):
        ClientConfig(("tcp://h",)).validate()
