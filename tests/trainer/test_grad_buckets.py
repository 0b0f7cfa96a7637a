"""The gradient bucket layout and the launcher that starts bucket all-reduces from the backward pass (pure logic:
the 'collective' here records what it was handed)."""

from __future__ import annotations

import torch
from ftjob.ft.allreduce.grad_buckets import FIRST_BUCKET_BYTES, BackwardLauncher, plan_buckets, unflatten_into


def test_layout_is_reverse_order_split_by_size_and_dtype_with_a_small_first_bucket() -> None:
    mib = 1024 * 1024 // 4  # float32 elements per MiB
    params = [torch.zeros(mib), torch.zeros(mib), torch.zeros(10, dtype=torch.float64), torch.zeros(mib)]
    buckets = plan_buckets(params, bucket_bytes=3 * FIRST_BUCKET_BYTES)
    assert buckets[0] == [3]  # the last parameter's gradient is final first; the first bucket is 1 MiB
    assert sorted(i for b in buckets for i in b) == [0, 1, 2, 3]
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1
    assert [1, 0] in buckets and [2] in buckets
    assert plan_buckets(params, 3 * FIRST_BUCKET_BYTES) == buckets  # a pure function: every group agrees


def test_buckets_start_during_backward_in_layout_order_and_unused_params_send_zeros() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    unused = torch.nn.Parameter(torch.ones(3))
    params = [unused, *model.parameters()]
    buckets = plan_buckets(params, bucket_bytes=1, first_bucket_bytes=1)  # one parameter per bucket
    launcher = BackwardLauncher(params, buckets)
    started: list[int] = []

    def launch(flat: torch.Tensor) -> int:
        started.append(flat.numel())
        return len(started)

    launcher.arm(launch)
    model(torch.randn(2, 4)).sum().backward()
    assert len(started) == len(params) - 1, "every used parameter's bucket starts before the backward returns"
    flats, works, error = launcher.finish()
    assert error is None and works == list(range(1, len(params) + 1))
    assert started == [sum(params[i].numel() for i in b) for b in buckets]  # strictly in layout order
    assert unused.grad is not None and torch.equal(flats[-1], torch.zeros(3))
    assert not launcher.armed

    launcher.arm(launch)  # each step starts afresh; a disarmed launcher ignores the backward
    launcher.disarm()
    model(torch.randn(2, 4)).sum().backward()
    assert len(started) == len(params)
    launcher.remove()


def test_unflatten_divides_by_the_contributors_into_the_grads() -> None:
    grads = [torch.zeros(2), torch.zeros(3)]
    unflatten_into(torch.arange(5, dtype=torch.float32) * 3, grads, divisor=3)
    assert torch.equal(grads[0], torch.tensor([0.0, 1.0])) and torch.equal(grads[1], torch.tensor([2.0, 3.0, 4.0]))


def _shares_memory(grad: torch.Tensor, flats: list[torch.Tensor]) -> bool:
    return any(f.data_ptr() <= grad.data_ptr() < f.data_ptr() + f.numel() * f.element_size() for f in flats)


def test_grads_are_views_of_the_buckets_and_a_released_step_leaves_them_to_the_collective() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    params = list(model.parameters())
    launcher = BackwardLauncher(params, plan_buckets(params, bucket_bytes=64, first_bucket_bytes=32))
    x = torch.randn(2, 4)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in params]  # one backward's gradient, computed without the launcher
    model.zero_grad(set_to_none=True)

    def step() -> list[torch.Tensor]:
        launcher.arm(lambda flat: flat.mul_(2))  # a "collective" of two identical groups: the sum doubles
        model(x).sum().backward()
        flats, _, error = launcher.finish()
        assert error is None
        return flats

    flats = step()
    launcher.average(2)
    for p, e in zip(params, expected, strict=True):
        assert torch.equal(p.grad, e) and _shares_memory(p.grad, flats), "averaged in place, in the buckets"
    model.zero_grad(set_to_none=False)  # the usual loop: zeroed in place, the next backward accumulates there
    assert all(n is f for n, f in zip(step(), flats, strict=True)), "the same buckets, step after step"
    launcher.average(2)
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))

    model.zero_grad(set_to_none=False)
    flats = step()
    launcher.release()  # abandoned: the collective may still write into the buckets
    for p in params:
        assert not _shares_memory(p.grad, flats)
    model.zero_grad(set_to_none=False)
    new = step()
    assert not any(n.data_ptr() == f.data_ptr() for n, f in zip(new, flats, strict=True)), "fresh buckets"
    launcher.average(2)
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))

    model.zero_grad(set_to_none=False)
    step()  # started, never averaged nor released (no one waited): the next step must not reuse its buckets
    unsettled = launcher.flats
    assert not any(n.data_ptr() == f.data_ptr() for n, f in zip(step(), unsettled, strict=True))
    launcher.remove()
