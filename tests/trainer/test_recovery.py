"""The live-recovery transport over real loopback HTTP: exact round trips, corrupted chunks fetched again, refusals."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch
from ftjob import contract
from ftjob.contract.recovery_api import RecoveryManifest
from ftjob.ft.recovery import RecoveryError, RecoveryServer, fetch_state
from ftjob.ft.recovery_codec import CodecError, pack, unpack

TOKEN = "recovery-token"


def sample_state() -> dict:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5)).to(torch.float64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 40, dtype=torch.float64)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),  # int keys, tuples (betas), 0-dim step tensors
        "data": {"cursor": 123, "name": "shard-a", "weights": [0.5, None, True]},
        "extra": {
            "bf16": torch.arange(7, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False]),
            "empty": torch.empty(0),
        },
    }


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # bitwise
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)  # same keys, same types (int stays int), same order
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


@pytest.fixture
def server():
    srv = RecoveryServer(TOKEN, "127.0.0.1", 0, chunk_bytes=4096)  # small chunks: many parallel requests
    yield srv
    srv.close()


def test_codec_round_trip_is_exact_and_json_only():
    state = sample_state()
    packed = pack(state)
    manifest = RecoveryManifest(step=0, total_bytes=0, chunks=[], tensors=packed.tensors, state=packed.state)
    travelled = RecoveryManifest.model_validate_json(manifest.model_dump_json())  # what travels is plain JSON
    assert_same(state, unpack(travelled.state, travelled.tensors, packed.buffer))


def test_codec_rejects_objects_it_would_have_to_pickle():
    with pytest.raises(CodecError, match=r"state/data/fn is a builtins.function"):
        pack({"data": {"fn": lambda: 0}})


def test_fetch_is_bitwise_exact_over_many_chunks(server: RecoveryServer):
    state = sample_state()
    server.publish(17, state)
    got, stats = fetch_state(server.address, 17, TOKEN, parallel=4)
    assert_same(state, got)
    assert stats.chunks > 4 and stats.retries == 0 and server.chunks_served == stats.chunks


def test_snapshot_is_a_copy_taken_at_publish(server: RecoveryServer):
    weight = torch.zeros(1000)
    server.publish(1, {"w": weight})
    weight.add_(1.0)  # training goes on after the step boundary
    got, _ = fetch_state(server.address, 1, TOKEN)
    assert torch.equal(got["w"], torch.zeros(1000))


def test_corrupted_chunk_is_detected_and_fetched_again(server: RecoveryServer):
    state = sample_state()
    server.publish(5, state)
    server.corrupt_chunks = {1: 1, 3: 2}  # chunk 1 bad once, chunk 3 bad twice
    got, stats = fetch_state(server.address, 5, TOKEN, max_attempts=3)
    assert_same(state, got)
    assert stats.retries == 3


def test_persistently_corrupted_chunk_fails_cleanly(server: RecoveryServer):
    server.publish(5, sample_state())
    server.corrupt_chunks = {2: 10}
    with pytest.raises(RecoveryError, match=r"chunk 2 .* failed its checksum 3 times"):
        fetch_state(server.address, 5, TOKEN, max_attempts=3)


def test_wrong_token_and_stale_step_are_refused(server: RecoveryServer):
    server.publish(9, {"w": torch.ones(3)})
    with pytest.raises(RecoveryError, match="401"):
        fetch_state(server.address, 9, "wrong-token")
    with pytest.raises(RecoveryError, match="moved on to step 9"):
        fetch_state(server.address, 8, TOKEN)
    with pytest.raises(RecoveryError, match="no snapshot of step 10"):
        fetch_state(server.address, 10, TOKEN, timeout_s=0.2)
    req = urllib.request.Request(f"http://{server.address}{contract.PATH_RECOVERY}/9/manifest")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401
