"""A process's file descriptor limit: the soft ``RLIMIT_NOFILE`` raised to the hard one at
start, for the server (its sessions' connections) and the client (its servers' sockets)
alike. No sockets, no threads."""

from __future__ import annotations

import logging
import resource


def raise_fd_limit(log: logging.Logger) -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (where the hard one is
    unlimited: the kernel's cap on descriptors a process may open, ``/proc/sys/fs/nr_open``).
    A refusal is logged on ``log`` and leaves the limit as it was. Returns (soft, hard) as
    they are after (soft may be ``RLIM_INFINITY``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, hard
    target = hard if hard != resource.RLIM_INFINITY else max(soft, nr_open())
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft, hard


def nr_open() -> int:
    """The kernel's cap on a process's descriptors (1 << 20 where it cannot be read)."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20
