"""The live-recovery transport over real loopback HTTP: exact round trips, corrupted chunks fetched again, refusals."""

from __future__ import annotations

import itertools
import urllib.error
import urllib.request

import pytest
import torch
from ftjob import contract
from ftjob.contract.recovery_api import RecoveryManifest
from ftjob.ft.recovery.codec import CodecError, chunk_sums, pack, unpack
from ftjob.ft.recovery.transport import RecoveryError, RecoveryServer, fetch_state

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


def zeros_like_state(state: object) -> object:
    """The healer's own state: same structure and shapes, other values."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(zeros_like_state(v) for v in state)
    return state


def test_fetch_lands_in_the_receivers_own_tensors(server: RecoveryServer):
    state = sample_state()
    server.publish(4, state)
    mine = zeros_like_state(state)
    mine["model"]["0.bias"] = torch.zeros(30, dtype=torch.float32)  # another dtype: cannot take the bytes in place
    mine["extra"]["mask"] = torch.zeros(4, dtype=torch.bool)[::2]  # not contiguous: neither
    mine["model"]["1.bias"] = mine["model"]["1.weight"].view(-1)[:5]  # shares memory with another: only one of them
    got, stats = fetch_state(server.address, 4, TOKEN, template=mine, parallel=4)
    assert_same(state, got)
    assert stats.chunks > 4 and stats.retries == 0
    w, exp_avg = got["model"]["0.weight"], got["optim"]["state"][0]["exp_avg"]
    assert w.data_ptr() == mine["model"]["0.weight"].data_ptr()  # received in place: no staging copy
    assert exp_avg.data_ptr() == mine["optim"]["state"][0]["exp_avg"].data_ptr()
    assert not mine["model"]["0.bias"].any() and not mine["extra"]["mask"].any()  # left alone
    assert got["model"]["0.bias"].dtype == torch.float64
    landed = [got["model"][k].data_ptr() == mine["model"][k].data_ptr() for k in ("1.weight", "1.bias")]
    assert landed.count(True) == 1  # the other came through staging, and is right too (assert_same above)


def test_fetch_not_in_place_leaves_the_template_alone(server: RecoveryServer):
    state = sample_state()
    server.publish(4, state)
    mine = zeros_like_state(state)
    got, _ = fetch_state(server.address, 4, TOKEN, template=mine, in_place=False)
    assert_same(state, got)
    assert not mine["model"]["0.weight"].any()


def test_corrupted_chunk_landing_in_place_is_fetched_again(server: RecoveryServer):
    state = sample_state()
    server.publish(5, state)
    server.corrupt_chunks = {0: 1, 2: 2}
    got, stats = fetch_state(server.address, 5, TOKEN, template=zeros_like_state(state))
    assert_same(state, got)
    assert stats.retries == 3


def test_chunk_checksum_adds_up_over_pieces_and_catches_moved_blocks():
    data = torch.randint(0, 256, (3 * 4096 + 24,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    whole = chunk_sums(data.numpy())
    for cuts in ([5, 4100, 9000], [8, 16, 4096, 12288], [1, 2, 3]):  # pieces at any offset, aligned or not
        bounds = [0, *cuts, len(data)]
        parts = [chunk_sums(data.numpy()[a:b], a) for a, b in itertools.pairwise(bounds)]
        assert (sum(p[0] for p in parts) % 2**64, sum(p[1] for p in parts) % 2**64) == whole
    flipped = data.clone()
    flipped[5000] ^= 0x80
    swapped = torch.cat([data[4096:8192], data[:4096], data[8192:]])  # same words, blocks moved
    assert chunk_sums(flipped.numpy()) != whole
    assert chunk_sums(swapped.numpy())[0] == whole[0] and chunk_sums(swapped.numpy()) != whole
