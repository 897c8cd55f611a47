"""Network namespaces as hosts and nodes, for tests/test_netns.py: servers started in a
namespace, a bridged cluster of node namespaces, and the two gloo ranks of
tests/netns_rank.py run in one. Every class here is torn down by the test's fixtures."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from conftest import Server, server_env, wait_until

RANK_SCRIPT = Path(__file__).resolve().parent / "netns_rank.py"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class NsServer(Server):
    """A ``dataserver serve`` started inside a namespace with ``ip netns exec``."""

    def __init__(self, ns: str, *args: str, **kwargs: Any) -> None:
        self.prefix = ["ip", "netns", "exec", ns]
        super().__init__(*args, **kwargs)

    def command(self) -> list[str]:
        return [*self.prefix, *super().command()]


class NodeServer(NsServer):
    """A data node's server; its counters are asked for from inside its namespace."""

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        cmd = [*self.prefix, sys.executable, "-m", "dataserver.cli", "stats", self.address]
        out = subprocess.run(
            [*cmd, "--json", "--timeout", str(timeout)],
            capture_output=True,
            text=True,
            timeout=timeout + 30,
            env=server_env(),
        )
        if out.returncode != 0:
            raise RuntimeError(f"dataserver stats {self.address}: {out.stderr.strip()}")
        return dict(json.loads(out.stdout))


class Cluster:
    """Nodes as network namespaces on one Ethernet segment: a bridge in a namespace of its
    own, each node joined to it by a veth pair (``eth0`` in the node, ``p<node>`` on the
    bridge), node ``name`` at 10.214.N.``nodes[name]``/24. This host's namespace gains
    nothing but the namespaces' names and ``/etc/netns/<node>/`` (a node's hosts file)."""

    def __init__(self, nodes: dict[str, int]) -> None:
        self.tag = secrets.token_hex(3)
        self.net = f"10.214.{int(self.tag, 16) % 250 + 1}"
        self.bridge = f"dsbr{self.tag}"
        self.namespaces: dict[str, str] = {}
        self.etc: list[Path] = []
        self.made_etc = not Path("/etc/netns").exists()
        try:
            self._add_ns("bridge", self.bridge)
            ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge, "link", "set", "br0", "up")
            for name, host in nodes.items():
                self._node(name, host)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str, ns: str) -> None:
        ip("netns", "add", ns)
        self.namespaces[name] = ns

    def _node(self, name: str, host: int) -> None:
        ns, port = f"ds{name}{self.tag}", f"p{name}"
        self._add_ns(name, ns)
        # Both ends are made where they belong: no name ever appears in this namespace.
        ip(*f"link add eth0 netns {ns} type veth peer name {port} netns {self.bridge}".split())
        ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{self.net}.{host}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")

    def ip(self, host: int) -> str:
        return f"{self.net}.{host}"

    def resolver(self, name: str) -> Path:
        """``/etc/netns/<ns>/hosts``, which ``ip netns exec`` bind-mounts over /etc/hosts;
        a resolv.conf beside it keeps any DNS query on the node's own loopback."""
        etc = Path("/etc/netns") / self.namespaces[name]
        etc.mkdir(parents=True, exist_ok=True)
        self.etc.append(etc)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        hosts = etc / "hosts"
        hosts.write_text("127.0.0.1 localhost\n")
        return hosts

    def cut(self, name: str) -> None:
        """Pull the node's cable at the switch: its frames vanish, nobody sends a RST."""
        ip("-n", self.bridge, "link", "set", f"p{name}", "down")

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[name]]

    def close(self) -> None:
        # (deleting a namespace deletes its veth ends, and with them their peers)
        for ns in reversed(self.namespaces.values()):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        for etc in self.etc:
            shutil.rmtree(etc, ignore_errors=True)
        if self.made_etc:
            try:
                Path("/etc/netns").rmdir()  # unless somebody else put a file there since
            except OSError:
                pass


def publish(hosts: Path, name: str, *ips: str) -> None:
    """Rewrite the hosts file in place (one write: the bind mount keeps its inode, and a
    reader never meets half a list)."""
    text = "127.0.0.1 localhost\n" + "".join(f"{a} {name}\n" for a in ips)
    fd = os.open(hosts, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class Ranks:
    """Two gloo ranks of ``tests/netns_rank.py`` (rendezvous on 127.0.0.1 where they run),
    their records as they come, by run ("reference", then "rehearsal") and rank. In the
    rehearsal they hold before the step the go file names."""

    def __init__(
        self,
        address: str,
        reference: str,
        go: Path,
        prefix: list[str],
        master_port: int,
        hold: int,
    ) -> None:
        go.write_text(str(hold))
        self.go = go
        runs = ("reference", "rehearsal")
        self.records: dict[str, list[list[dict[str, Any]]]] = {r: [[], []] for r in runs}
        self.stats: dict[str, list[dict[str, Any] | None]] = {r: [None, None] for r in runs}
        self.times: list[list[float]] = [[], []]  # when each rehearsal record came, by rank
        self.procs: list[subprocess.Popen[str]] = []
        self.errors: list[Any] = []
        self._readers: list[threading.Thread] = []
        for rank in (0, 1):
            env = dict(
                server_env(),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
                GLOO_SOCKET_IFNAME="lo",
                RANK=str(rank),
                WORLD_SIZE="2",
            )
            env.pop("CUDA_VISIBLE_DEVICES", None)
            err = tempfile.TemporaryFile()
            self.errors.append(err)
            cmd = [sys.executable, str(RANK_SCRIPT), address, "--reference", reference]
            proc = subprocess.Popen(
                [*prefix, *cmd, "--go", str(go), "--interval", "0.2"],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            item = json.loads(line)
            if "stats" in item:
                self.stats[item["run"]][item["rank"]] = item["stats"]
            else:
                self.records[item["run"]][item["rank"]].append(item)
                if item["run"] == "rehearsal":
                    self.times[item["rank"]].append(time.monotonic())

    def done(self, step: int) -> bool:
        return all(len(r) > step for r in self.records["rehearsal"])

    def at(self, step: int, timeout: float = 60.0) -> None:
        """Wait until both ranks have delivered the rehearsal's batch of ``step``."""
        dead = lambda: any(p.poll() is not None for p in self.procs)  # noqa: E731
        assert wait_until(lambda: self.done(step) or dead(), timeout), self.stderr()
        assert self.done(step), self.stderr()

    def hold(self, step: int) -> None:
        """Let the ranks go on up to (not including) ``step``."""
        self.go.write_text(str(step))

    def finish(self, timeout: float = 120.0) -> None:
        for p in self.procs:
            p.wait(timeout)
        for r in self._readers:
            r.join(5)
        assert all(p.returncode == 0 for p in self.procs), self.stderr()

    def stderr(self) -> str:
        out = []
        for rank, err in enumerate(self.errors):
            err.seek(0)
            out.append(f"rank {rank}: {err.read().decode(errors='replace')[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for err in self.errors:
            err.close()


def start_node_servers(
    specs: dict[str, tuple[str, str, int]], args: list[str], started: list[Server]
) -> dict[str, Server]:
    """``{name: (namespace, bind, workers)}``: servers of ``serve`` ``args``, started side
    by side; each one that came up is in ``started`` (for the fixture to stop) even when
    another did not."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {
            name: pool.submit(NodeServer, ns, *args, workers=workers, bind=bind)
            for name, (ns, bind, workers) in specs.items()
        }
    servers: dict[str, Server] = {}
    for name, future in futures.items():
        if future.exception() is None:
            servers[name] = future.result()
            started.append(servers[name])
    for future in futures.values():
        future.result()  # raises the first failure
    return servers
