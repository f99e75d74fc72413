"""The TCP sockets this process's gloo groups opened, so that a rank leaving its groups after a
failure is seen leaving by every peer at once (decision 232).

A gloo group's pairs (one TCP connection per peer) close when the group is destroyed, unless an
operation of the group is still in its worker's hands: FSDP's collectives run there, and after a
peer dies mid-step the worker can sit in one that the remaining peers will never join. The group
object is then gone from Python (`destroy_process_group`, a collection), but its connections stay
open, and a peer waiting on this rank in another collective of the group waits out its
collective timeout: measured, dp2 x tp2 with rank 3 killed, rank 0 (which shares no group with
rank 3) stayed in FSDP's gradient all-reduce with ranks 1 and 2 until their processes exited, 21 s
later, where they had left in 0.1 s; a recovery named it silent and replaced it. gloo has no abort
(`Backend.abort()` and `shutdown()` changed nothing).

So every group is made inside `recording_group_sockets()`, which notes the sockets that appear
meanwhile, and a rank that fails shuts them all down first thing (`cut_group_sockets`): its peers'
reads fail at once ("Connection closed by peer"), as a dead rank's peers' do, before it spends
any time leaving. A shutdown, not a close: the descriptors stay gloo's, which fails its
operations on them and closes them when the group goes. Only sockets that appeared while a group
was being made are touched; Ray's own were there before (a rank makes no Ray call meanwhile).
"""
from __future__ import annotations

import contextlib
import os
import socket

_FD_DIRECTORY = "/proc/self/fd"


class GroupSockets:
    """The inodes of the sockets that appeared while this process made its groups."""

    def __init__(self):
        self.inodes: set[str] = set()

    @contextlib.contextmanager
    def recording(self):
        before = set(_socket_fds().values())
        try:
            yield
        finally:
            self.inodes |= set(_socket_fds().values()) - before

    def cut(self) -> int:
        """Shut down the recorded sockets still open, and forget them all: this process is
        leaving every group it made. Returns how many were shut down."""
        cut = 0
        for fd, inode in _socket_fds().items():
            if inode not in self.inodes:
                continue
            with contextlib.suppress(OSError):  # closed meanwhile, or not a socket any more
                leftover = socket.socket(fileno=fd)
                try:
                    leftover.shutdown(socket.SHUT_WR)
                    cut += 1
                finally:
                    leftover.detach()  # the descriptor stays gloo's to close
        self.inodes.clear()
        return cut


def _socket_fds() -> dict[int, str]:
    """This process's open descriptors that are sockets -> their inode (`socket:[123]`); empty
    where /proc is not there (not Linux): nothing is recorded, nothing cut."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIRECTORY):
            with contextlib.suppress(OSError):  # closed between the listing and the readlink
                target = os.readlink(f"{_FD_DIRECTORY}/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


# One per process, as torch.distributed's groups are. Reached through the two functions below:
# Ray ships a rank actor's class by value (its module attribute is Ray's wrapper), and a module
# global its methods referred to directly would arrive as a copy of its own.
_GROUP_SOCKETS = GroupSockets()


def recording_group_sockets():
    """A context manager: the sockets that appear inside it are this process's groups'."""
    return _GROUP_SOCKETS.recording()


def cut_group_sockets() -> int:
    """`GroupSockets.cut` of this process's groups."""
    return _GROUP_SOCKETS.cut()
