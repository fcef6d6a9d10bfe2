"""The note of a re-formed elastic job (``launch/membership.py``): the previous attempt's value in the
rendezvous store is read as untrusted."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lockstep.runtime.launch import membership

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("written", [b"not-a-number\nhost-a", b"\xff\xfe\x00", b"", b"9" * 70000, b"2\n" * 5000])
def test_a_damaged_or_forged_previous_attempt_reads_as_none_and_is_written_again(written):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set(membership._KEY, written)
    address = f"127.0.0.1:{store.port}"
    same_node = lambda label: [label, label]  # noqa: E731 - two ranks on this node
    assert membership.membership_change(address, 0, 2, same_node) == ""  # no error: as if there were no attempt
    assert membership.membership_change(address, 0, 4, same_node) == (
        "the job re-formed: same nodes; world size 2 -> 4 on 1 node(s)")


def test_a_forged_label_is_shown_printable_and_short():
    size, nodes = membership._previous(b"3\nnode-\x1b[31mred\n" + b"y" * 500)
    assert size == 3 and nodes[0] == "node-[31mred" and len(nodes[1]) == 128


def test_an_elastic_rendezvous_hosted_here_listens_on_its_endpoint_only_and_torch_takes_it():
    """``--nodes MIN:MAX``: the c10d store is bound to the endpoint's address (torch's own would listen on
    every interface); torch's agent in this process takes it; a second agent on the node is a client."""
    import socket

    from lockstep.runtime.launch.plan import _elastic_store

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    store = _elastic_store("127.0.0.1", port)
    assert store is not None and _elastic_store("127.0.0.1", port) is None
    listening = [line.split() for line in open("/proc/net/tcp").read().splitlines()[1:]]
    bound = [local for local, state in ((row[1], row[3]) for row in listening) if state == "0A"
             and int(local.split(":")[1], 16) == port]
    assert bound == ["0100007F:" + f"{port:04X}"], bound  # 127.0.0.1, not 0.0.0.0
    torchs = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))  # what torch's c10d backend makes: the same server
    torchs.set("k", "v")
    assert store.get("k") == b"v"
