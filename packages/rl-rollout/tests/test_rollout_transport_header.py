"""The weight-sync frame header is checked before anything is allocated from it.

Two ranks of a real gloo weight group in this process (threads): rank 0 broadcasts
forged headers with raw broadcasts, rank 1 reads them with ``recv_header``. A metadata
length of 2**40 must fail at once with the bound in the message, not try to allocate
a terabyte; the sender refuses to send metadata over the bound in the first place.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from rl_rollout.transport import _BUCKET, MAX_META_BYTES, WeightGroup, WeightSyncError

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def pair():
    port, groups = free_port(), {}

    def join(rank):
        groups[rank] = WeightGroup("127.0.0.1", port, rank, 2, backend="gloo", timeout_s=30)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    yield groups[0], groups[1]
    for g in groups.values():
        g.close()


@pytest.mark.parametrize("header", [[_BUCKET, 1 << 40, 0], [_BUCKET, -1, 0], [7, 10, 0], [_BUCKET, 10, -5]])
def test_a_forged_header_is_refused_before_any_allocation(pair, header):
    sender, receiver = pair
    t = threading.Thread(target=sender.broadcast_, args=(torch.tensor(header, dtype=torch.int64),))
    t.start()
    with pytest.raises(WeightSyncError, match=r"frame header .* is not valid .*MAX_META_BYTES=67108864"):
        receiver.recv_header()
    t.join(30)


def test_a_valid_header_passes_and_the_sender_refuses_oversized_metadata(pair):
    sender, receiver = pair
    t = threading.Thread(target=lambda: [w.wait() for w, _ in sender.send_frame(_BUCKET, b"\x90", [])])
    t.start()
    assert receiver.recv_header() == (_BUCKET, b"\x90", 0)
    t.join(30)
    with pytest.raises(WeightSyncError, match="exceeds MAX_META_BYTES=.*lower bucket_bytes"):
        sender.send_frame(_BUCKET, bytes(MAX_META_BYTES + 1), [])
