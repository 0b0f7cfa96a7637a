"""The gradient guard's pure parts: the verdict rule (ftjob.ft.integrity.guard), its configuration from the env
contract, the fault-injection spec (ftjob.ft.integrity.fault_injection) and the digest of what replicas must hold
equal."""

from __future__ import annotations

import math

import pytest
import torch
from ftjob import contract
from ftjob.contract.lighthouse_api import GuardOffence
from ftjob.ft.integrity.digest import local_digest, replica_tensors
from ftjob.ft.integrity.fault_injection import FaultInjection, flip_lowest_bit
from ftjob.ft.integrity.guard import GuardConfig, contributions, describe, judge, whole_groups

NAN, INF = float("nan"), float("inf")


def kinds(offences: list[GuardOffence]) -> dict[str, str]:
    return {o.group: o.kind for o in offences}


def test_healthy_groups_pass() -> None:
    assert judge({"0": 1.0, "1": 1.3, "2": 0.8}) == []
    assert judge({"0": 4.0}) == []  # one contributor: only the non-finite check


def test_nan_and_inf_are_refused_with_no_norm_and_the_others_median() -> None:
    offences = judge({"0": 4.0, "1": NAN, "2": 9.0, "3": INF})
    assert kinds(offences) == {"1": "nonfinite", "3": "nonfinite"}
    assert all(o.norm is None for o in offences)
    assert offences[0].median == pytest.approx(2.5)  # median of the finite others' norms: 2 and 3
    assert kinds(judge({"0": NAN})) == {"0": "nonfinite"}  # alone, still caught


def test_two_groups_the_high_one_is_the_outlier_never_the_low_one() -> None:
    offences = judge({"0": 1.0, "1": 1000.0**2})  # norms 1 and 1000
    assert kinds(offences) == {"1": "norm_outlier"}
    assert offences[0].norm == pytest.approx(1000.0) and offences[0].median == pytest.approx(1.0)


def test_leave_one_out_median_and_high_side_only() -> None:
    # norms 1, 1, 1, 500, 0.001: the outlier does not drag its own yardstick; a tiny gradient is never a fault
    sumsqs = {"0": 1.0, "1": 1.0, "2": 1.0, "3": 500.0**2, "4": 1e-6}
    assert kinds(judge(sumsqs)) == {"3": "norm_outlier"}


def test_threshold_edge_is_exclusive() -> None:
    at = {"0": 1.0, "1": 1.0, "2": (10.0) ** 2}  # norm exactly 10 x the others' median 1
    assert judge(at, norm_ratio=10.0) == []
    above = {"0": 1.0, "1": 1.0, "2": (10.0 * (1 + 1e-9)) ** 2}
    assert kinds(judge(above, norm_ratio=10.0)) == {"2": "norm_outlier"}
    assert kinds(judge(at, norm_ratio=9.99)) == {"2": "norm_outlier"}


def test_a_zero_median_judges_nobody() -> None:
    assert judge({"0": 0.0, "1": 0.0, "2": 5.0}) == []


def test_the_table_rows_of_non_contributors_are_not_judged() -> None:
    table = [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [7.0, 1.0, 1e6], [3.0, 1.0, 1.2]]  # row 1: a spare's zero row
    assert contributions(table) == {"0": 1.0, "7": 1e6, "3": 1.2}
    assert kinds(judge(contributions(table))) == {"7": "norm_outlier"}


def test_a_sharded_group_is_judged_on_its_whole_gradient_never_one_shard() -> None:
    """Rows summed over 2 shards (the vote's all-reduce). Seen in a run: shard 1 of two healthy groups 144x apart
    while their whole gradients were within 10x; a group whose shards did not all contribute is not judged."""
    shard0 = [[0.0, 1.0, 0.6**2], [1.0, 1.0, 0.7**2], [0.0, 0.0, 0.0]]
    shard1 = [[0.0, 1.0, 0.0287**2], [1.0, 1.0, 4.13**2], [2.0, 1.0, 9.0]]  # group 2 failed on shard 0
    summed = [[a + b for a, b in zip(r0, r1, strict=True)] for r0, r1 in zip(shard0, shard1, strict=True)]
    assert judge(contributions(shard1[:2])) != []  # judged shard by shard, group 1 would be refused
    whole = whole_groups(summed, 2)
    assert contributions(whole) == {"0": 0.6**2 + 0.0287**2, "1": 0.7**2 + 4.13**2}
    assert judge(contributions(whole)) == []
    nan = [[0.0, 2.0, 1.0], [2.0, 2.0, NAN]]  # a NaN in any shard makes the group's sum NaN
    assert kinds(judge(contributions(whole_groups(nan, 2)))) == {"1": "nonfinite"}
    assert whole_groups([[3.0, 1.0, 4.0]], 1) == [[3.0, 1.0, 4.0]]  # one rank per group: its row is the whole


def test_describe_names_the_groups_and_what_was_seen() -> None:
    text = describe(judge({"0": 1.0, "1": 1e6, "2": NAN}), 10.0)
    assert "group 1: gradient norm 1000 > 10 x 1" in text and "group 2: gradient not finite" in text


def test_config_from_the_env_contract() -> None:
    assert GuardConfig.from_environ({}) == GuardConfig(enabled=True, norm_ratio=100.0)
    env = {contract.ENV_GUARD: "0", contract.ENV_GUARD_NORM_RATIO: "4.5"}
    assert GuardConfig.from_environ(env) == GuardConfig(enabled=False, norm_ratio=4.5)
    for bad in ("1", "0.5", "nan", "inf"):
        with pytest.raises(ValueError, match="> 1"):
            GuardConfig.from_environ({contract.ENV_GUARD_NORM_RATIO: bad})
    with pytest.raises(ValueError, match="not a number"):
        GuardConfig.from_environ({contract.ENV_GUARD_NORM_RATIO: "ten"})


def test_fault_injection_spec_group_and_generation() -> None:
    env = {contract.ENV_FAULT_INJECTION: "group=1,kind=scale,factor=1000,step=20,count=3"}
    fault = FaultInjection.from_environ("1", env)
    assert fault == FaultInjection(group="1", kind="scale", step=20, count=3, factor=1000.0)
    assert FaultInjection.from_environ("0", env) is None  # another group
    assert FaultInjection.from_environ("1", {**env, contract.ENV_GENERATION: "1"}) is None  # its replacement
    assert FaultInjection.from_environ("1", {**env, contract.ENV_GENERATION: "0"}) is not None
    for bad in ("group=1,kind=melt,step=2", "group=1,step=2", "group=1,kind=nan,step=x",
                "group=1,kind=nan,step=2,count=0", "kind=nan,kind=nan,group=1,step=1",
                "group=1,kind=nan,step=2,colour=red"):  # fmt: skip
        with pytest.raises(ValueError, match=contract.ENV_FAULT_INJECTION):
            FaultInjection.parse(bad)


def test_gradient_faults_count_contributing_attempts_from_their_step() -> None:
    fault = FaultInjection.parse("group=1,kind=nan,step=5,count=2")
    assert fault.corruption(4, True) is None  # before its step
    assert fault.corruption(5, False) is None  # not contributing: nothing sent, not counted
    flat = torch.ones(4)
    poison = fault.corruption(5, True)
    assert poison is not None
    poison(flat)
    assert math.isnan(flat[0]) and torch.isfinite(flat[1:]).all()
    assert fault.corruption(5, True) is not None  # the retry of the refused step: the second attempt
    assert fault.corruption(6, True) is None  # count spent
    scale = FaultInjection.parse("group=1,kind=scale,factor=1000,step=0").corruption(0, True)
    assert scale is not None
    flat = torch.ones(3)
    scale(flat)
    assert flat.tolist() == [1000.0, 1000.0, 1000.0]


def test_bitflip_flips_the_lowest_mantissa_bit_once() -> None:
    fault = FaultInjection.parse("group=2,kind=bitflip,step=15")
    assert fault.corruption(20, True) is None  # no gradient fault
    assert not fault.flip_due(14)
    assert fault.flip_due(16)  # the first boundary at or after its step (e.g. after a heal past it)
    assert not fault.flip_due(17)
    p = torch.nn.Parameter(torch.tensor([0.0, 0.75, -2.0, 1.75]))  # exact in float32
    before = local_digest([p])
    flip_lowest_bit([p])  # -2.0 sits furthest below the next power of two (4): an update cannot round it away
    assert p.tolist() == [0.0, 0.75, -(2.0 + 2.0**-22), 1.75]  # float32's last mantissa bit at exponent 1
    assert local_digest([p]) != before


def test_replica_tensors_cover_parameters_and_optimizer_state_not_buffers() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert len(replica_tensors(model, opt)) == 4  # 4 parameters, no state before the first step
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    tensors = replica_tensors(model, opt)
    assert len(tensors) == 4 + 4 * 3  # step, exp_avg, exp_avg_sq per parameter
    digest = local_digest(tensors)
    model[1].running_mean.add_(1.0)  # a buffer: each group's own statistics
    assert local_digest(replica_tensors(model, opt)) == digest
    opt.state[model[0].weight]["exp_avg"][0, 0] += 1e-3
    assert local_digest(replica_tensors(model, opt)) != digest


def test_under_loss_scaling_an_overflow_is_the_scalers_business_and_no_yardstick() -> None:
    sumsqs = {"0": INF, "1": 1.0, "2": 1.2, "3": 900.0**2}
    assert kinds(judge(sumsqs, loss_scaling=True)) == {"3": "norm_outlier"}
    assert judge({"0": INF, "1": NAN}, loss_scaling=True) == []
    assert kinds(judge(sumsqs)) == {"0": "nonfinite", "3": "norm_outlier"}
