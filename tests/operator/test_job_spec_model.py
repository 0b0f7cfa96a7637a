"""The CRD's spec schema and the operator's spec models (ftjob.operator.state.job_spec) agree: the same fields, the
same defaults, the same bounds and enums. Either one changing alone fails here, naming the field. (The chart's copy of
the CRD is held to crds/ by tests/chart/test_chart_crd_sync.py.)"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Union

import pytest
import yaml
from ftjob.operator.state.job_spec import DEFAULT_NODE_CONDITIONS, JobSpec, SpecModel
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "ftjob.dev_faulttoleranttrainingjobs.yaml"
# Parts of the spec the models take as they are: the pod template is the Pod API's, the apiserver checks it.
PASSED_THROUGH = {"spec.template"}
# CRD objects with declared properties that a model field checks with a validator of its own rather than a model.
CHECKED_BY_VALIDATOR = {"spec.lighthouse.imagePullSecrets"}
# The schema keywords both sides may declare; the CRD's OpenAPI v3.0 `exclusiveMinimum: true` becomes the JSON
# Schema form pydantic writes (`exclusiveMinimum: <bound>`).
BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "enum", "maxItems", "minLength", "maxLength")
# A CEL rule that bounds one number of its object: `!has(self.x) || self.x > 0.0`.
CEL_BOUND = re.compile(r"^!has\(self\.(\w+)\) \|\| self\.\1 (>=|>) (-?[\d.]+)$")


def crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def fields_by_alias(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {info.alias or name: info for name, info in model.model_fields.items()}


def field_type(info: FieldInfo) -> Any:
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


def inner_model(annotation: Any) -> type[SpecModel] | None:
    """The spec model a field holds: itself, X | None, or the items of a tuple of models."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return inner_model(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType, tuple, list, frozenset):
        found = [m for a in typing.get_args(annotation) if a is not type(None) and (m := inner_model(a))]
        return found[0] if found else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, SpecModel) else None


def model_bounds(info: FieldInfo) -> dict[str, Any]:
    """The field's JSON schema (X | None: the X branch), limited to BOUNDS, and its items' bounds."""
    schema = TypeAdapter(field_type(info)).json_schema()
    branches = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    schema = branches[0] if len(branches) == 1 else schema
    out = {k: v for k, v in schema.items() if k in BOUNDS}
    items = {k: v for k, v in (schema.get("items") or {}).items() if k in BOUNDS}
    return {**out, **({"items": items} if items else {})}


def crd_bounds(node: dict[str, Any], cel: dict[str, Any]) -> dict[str, Any]:
    """The CRD field's bounds in JSON Schema form, with the bounds its object's CEL rules put on it."""
    out = {k: v for k, v in node.items() if k in BOUNDS}
    if out.pop("exclusiveMinimum", False) is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if out.pop("exclusiveMaximum", False) is True:
        out["exclusiveMaximum"] = out.pop("maximum")
    out.update(cel)
    items = {k: v for k, v in (node.get("items") or {}).items() if k in BOUNDS}
    return {**out, **({"items": items} if items else {})}


def cel_bounds(node: dict[str, Any]) -> dict[str, dict[str, float]]:
    """field -> {minimum or exclusiveMinimum: bound} from the object's `!has(self.x) || self.x > N` rules."""
    out: dict[str, dict[str, float]] = {}
    for rule in node.get("x-kubernetes-validations") or []:
        if m := CEL_BOUND.match(rule["rule"]):
            key = "exclusiveMinimum" if m.group(2) == ">" else "minimum"
            out.setdefault(m.group(1), {})[key] = float(m.group(3))
    return out


def as_crd_value(value: Any) -> Any:
    """A model default as YAML would write it."""
    if isinstance(value, tuple | list | frozenset):
        return [as_crd_value(v) for v in value]
    return value


def disagreements(node: dict[str, Any], model: type[SpecModel], path: str) -> list[str]:
    """Every difference between a CRD object schema and a spec model, recursively, one line each."""
    problems: list[str] = []
    props = node.get("properties") or {}
    fields = fields_by_alias(model)
    for key in sorted(props.keys() - fields.keys()):
        if f"{path}.{key}" not in PASSED_THROUGH:
            problems.append(f"{path}.{key}: in the CRD, unknown to {model.__name__}")
    for key in sorted(fields.keys() - props.keys()):
        problems.append(f"{path}.{key}: a field of {model.__name__} the CRD lacks")
    cel = cel_bounds(node)
    for key in sorted(props.keys() & fields.keys()):
        sub, info, where = props[key], fields[key], f"{path}.{key}"
        default = info.get_default(call_default_factory=True)
        if "default" in sub:
            if isinstance(default, BaseModel):
                ok = type(default).model_validate(sub["default"]) == default
            else:
                ok = not info.is_required() and as_crd_value(default) == sub["default"]
            if not ok:
                problems.append(f"{where}: CRD default {sub['default']!r}, model default {default!r}")
        theirs, ours = crd_bounds(sub, cel.get(key, {})), model_bounds(info)
        if theirs != ours:
            problems.append(f"{where}: CRD bounds {theirs}, model bounds {ours}")
        nested = sub if "properties" in sub else sub.get("items") or {}
        inner = inner_model(info.annotation)
        if inner is not None:
            problems += disagreements(nested, inner, where)
        elif "properties" in nested and where not in CHECKED_BY_VALIDATOR | PASSED_THROUGH:
            problems.append(f"{where}: the CRD declares its properties, the model takes it unchecked")
    return problems


def test_the_crd_spec_and_the_model_agree():
    problems = disagreements(crd_spec_schema(), JobSpec, "spec")
    assert not problems, "\n".join(problems)


def test_the_walk_sees_a_default_a_bound_and_a_field_that_differ():
    # the check itself: a CRD edited alone is caught, field by field
    schema = crd_spec_schema()
    lighthouse = schema["properties"]["lighthouse"]["properties"]
    lighthouse["joinTimeoutSeconds"]["default"] = 2
    schema["properties"]["podsPerReplica"]["maximum"] = 512
    schema["properties"]["failurePolicy"]["properties"]["rules"]["items"]["properties"]["action"]["enum"].pop()
    schema["properties"]["integrity"]["properties"]["gradientGuard"]["properties"]["minSteps"] = {"type": "integer"}
    del schema["properties"]["tls"]["properties"]["enabled"]
    schema["properties"]["nodeHealth"]["properties"]["cordoned"]["default"] = False
    found = "\n".join(disagreements(schema, JobSpec, "spec"))
    assert "spec.lighthouse.joinTimeoutSeconds: CRD default 2, model default 1.0" in found
    assert "spec.podsPerReplica: CRD bounds {'minimum': 1, 'maximum': 512}" in found
    assert "spec.failurePolicy.rules.action: CRD bounds {'enum': ['RestartGroup', 'FailJob']}" in found
    assert "spec.integrity.gradientGuard.minSteps: in the CRD, unknown to GradientGuard" in found
    assert "spec.tls.enabled: a field of TlsSpec the CRD lacks" in found
    assert "spec.nodeHealth.cordoned: CRD default False, model default True" in found


def test_the_crd_names_the_default_node_conditions_the_model_applies():
    # no schema default (the list is the running operator's), so the CRD states it in words: the same list
    words = crd_spec_schema()["properties"]["nodeHealth"]["properties"]["conditions"]["description"]
    listed = re.search(r"\(default ([^;)]+), each with status True\)", words)
    assert listed, words
    assert listed.group(1).split(", ") == [c.type for c in DEFAULT_NODE_CONDITIONS]
    assert {c.status for c in DEFAULT_NODE_CONDITIONS} == {"True"}


# --- the spec the operator reads ----------------------------------------------------------------------------------
TEMPLATE = {"spec": {"containers": [{"name": "trainer", "image": "img"}]}}


def test_an_empty_spec_reads_the_crd_defaults_and_null_reads_as_unset():
    bare = JobSpec.from_dict({"template": TEMPLATE})
    nulls = JobSpec.from_dict({"template": TEMPLATE, "failurePolicy": None, "lighthouse": {"command": None}})
    assert bare == nulls
    assert (bare.replicas, bare.failure_policy.backoff_max_s, bare.lighthouse.command) == (
        1,
        60,
        ("ftjob-trainer", "lighthouse"),
    )
    assert bare.node_health.migrate and bare.node_health.conditions[0] == ("KernelDeadlock", "True")


def test_camel_case_names_map_to_the_attributes_callers_read():
    s = JobSpec.from_dict(
        {
            "template": TEMPLATE,
            "spareReplicas": 2,
            "failurePolicy": {
                "backoff": {"baseSeconds": 2},
                "rules": [{"action": "FailJob", "onExitCodes": {"values": [3], "containerName": "trainer"}}],
            },
            "nodeHealth": {"conditions": [{"type": "GpuBad"}], "taints": [{"key": "bad", "effect": "NoExecute"}]},
        }
    )
    assert (s.spare_replicas, s.total_groups, s.failure_policy.backoff_base_s) == (2, 3, 2.0)
    assert s.failure_policy.action_for_exit("trainer", 3) == "FailJob"
    assert s.failure_policy.action_for_exit("sidecar", 3) == "RestartGroup"
    assert s.node_health.conditions == (("GpuBad", "True"),) and s.node_health.taints == (("bad", "NoExecute"),)


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ({"replicas": "3"}, "spec.replicas must be an integer >= 1, got '3'"),
        ({"replicas": 2, "minReplicas": 3}, "spec.minReplicas must be <= replicas"),
        ({"spareReplicas": 65}, "spec.spareReplicas must be an integer in 0..64, got 65"),
        (
            {"failurePolicy": {"rules": [{"action": "Retry", "onExitCodes": {"values": [1]}}]}},
            "spec.failurePolicy.rules[0].action must be one of RestartGroup, FailJob, Ignore, got 'Retry'",
        ),
        (
            {"failurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"values": [0, 3]}}]}},
            "spec.failurePolicy.rules[0].onExitCodes.values must not contain 0 with operator In",
        ),
        (
            {"failurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"values": [300]}}]}},
            "spec.failurePolicy.rules[0].onExitCodes.values must be a list of integers in 0..255, got [300]",
        ),
        ({"failurePolicy": {"backoff": {"baseSeconds": 90}}}, "spec.failurePolicy.backoff.baseSeconds must be <="),
        (
            {"lighthouse": {"heartbeatTimeoutSeconds": 0}},
            "spec.lighthouse.heartbeatTimeoutSeconds must be a number > 0",
        ),
        ({"nodeHealth": {"taints": [{"effect": "NoExecute"}]}}, "spec.nodeHealth.taints[0].key is required"),
        ({"nodeHealth": {"migrate": "yes"}}, "spec.nodeHealth.migrate must be true or false, got 'yes'"),
    ],
)
def test_a_bad_value_names_the_field_path_and_the_rule(extra, line):
    with pytest.raises(ValueError) as e:
        JobSpec.from_dict({"template": TEMPLATE, **extra})
    assert line in str(e.value)
    assert "\n" not in str(e.value) and "pydantic" not in str(e.value), "one readable line per field, no URL"


def test_every_bad_field_is_named_once():
    with pytest.raises(ValueError) as e:
        JobSpec.from_dict({"template": TEMPLATE, "replicas": 0, "integrity": {"digestEverySteps": -1}})
    assert str(e.value).split("; ") == [
        "spec.replicas must be an integer >= 1, got 0",
        "spec.integrity.digestEverySteps must be an integer >= 0, got -1",
    ]
