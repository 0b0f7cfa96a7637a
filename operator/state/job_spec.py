"""The spec of one FaultTolerantTrainingJob as the operator reads it: every field parsed and checked, defaults applied.

One pydantic model per object of the CRD's spec, with the camelCase names as aliases and the CRD's defaults and
bounds declared once, on the fields (tests/operator/test_job_spec_model.py holds the CRD and these models to each
other). The apiserver applies the same defaults and bounds; parsing here again keeps the planner's unit tests honest
and refuses what an older CRD let in. Plain data with no Kubernetes client, so the planner built on it is
unit-testable.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, ClassVar, Literal, Union

import annotated_types
from ftjob import contract
from ftjob.operator.planning.node_health import NodeHealthPolicy
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

ACTION_RESTART_GROUP = "RestartGroup"
ACTION_FAIL_JOB = "FailJob"
ACTION_IGNORE = "Ignore"

# The error type of a check that spans several fields of one object; its message names them relative to that object
# (the error's location), which the readable error puts in front.
RULE_ERROR = "spec_rule"
# The error type of a field check that words its own expectation ("a list of {name: <secret>}").
VALUE_ERROR = "spec_value"


def _rule(message: str) -> PydanticCustomError:
    return PydanticCustomError(RULE_ERROR, message)


class SpecModel(BaseModel):
    """A spec object: immutable, read by its camelCase names (aliases), unknown keys ignored (the apiserver prunes
    them under a structural schema)."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")
    # keys whose explicit null is refused rather than read as unset
    null_refused: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, raw: Any) -> Any:
        # The apiserver prunes a null and applies the default; a spec an older CRD let in reads the same here.
        if isinstance(raw, dict):
            return {k: v for k, v in raw.items() if v is not None or k in cls.null_refused}
        return raw


# --- spec.failurePolicy -------------------------------------------------------------------------------------------
class OnExitCodes(SpecModel):
    """`failurePolicy.rules[].onExitCodes`."""

    container_name: StrictStr | None = Field(None, alias="containerName")
    operator: Literal["In", "NotIn"] = "In"
    values: frozenset[Annotated[StrictInt, Field(ge=0, le=255)]] = Field(max_length=255)

    @model_validator(mode="after")
    def _codes_can_fail(self) -> OnExitCodes:
        if not self.values:
            raise _rule("values must list at least one exit code")
        if self.operator == "In" and 0 in self.values:
            raise _rule("values must not contain 0 with operator In: exit code 0 is success, never a failure")
        return self


class ExitCodeRule(SpecModel):
    """`failurePolicy.rules[]`: when a container exits with one of these codes (or not, for NotIn), do `action`."""

    action: Literal["RestartGroup", "FailJob", "Ignore"]
    on_exit_codes: OnExitCodes = Field(alias="onExitCodes")

    @property
    def operator(self) -> str:
        """The match: In or NotIn."""
        return self.on_exit_codes.operator

    @property
    def values(self) -> frozenset[int]:
        """The exit codes the rule lists."""
        return self.on_exit_codes.values

    @property
    def container_name(self) -> str | None:
        """Only exits of this container match; None: any container."""
        return self.on_exit_codes.container_name

    def matches(self, container: str, exit_code: int) -> bool:
        """Whether this rule covers `container` exiting with `exit_code`."""
        if self.container_name and self.container_name != container:
            return False
        return (exit_code in self.values) == (self.operator == "In")


class Backoff(SpecModel):
    """`failurePolicy.backoff`: the k-th failure of a group within its window waits baseSeconds * 2^(k-2)."""

    base_s: StrictFloat = Field(1.0, alias="baseSeconds", ge=0)
    max_s: StrictFloat = Field(60.0, alias="maxSeconds", ge=0)

    @model_validator(mode="after")
    def _base_within_max(self) -> Backoff:
        if self.base_s > self.max_s:
            raise _rule("baseSeconds must be <= maxSeconds")
        return self


class FailurePolicy(SpecModel):
    """`spec.failurePolicy`: how failed replica groups are handled and when the job gives up."""

    max_restarts_per_group: StrictInt = Field(3, alias="maxRestartsPerGroup", ge=0)
    restart_window_s: StrictInt = Field(600, alias="restartWindowSeconds", ge=1)
    max_total_restarts: StrictInt = Field(20, alias="maxTotalRestarts", ge=0)
    backoff: Backoff = Backoff()
    rules: tuple[ExitCodeRule, ...] = Field((), max_length=32)
    # opt-in: fail the job when pods cannot be scheduled this long
    unschedulable_timeout_s: StrictInt | None = Field(None, alias="unschedulableTimeoutSeconds", ge=1)

    @property
    def backoff_base_s(self) -> float:
        """failurePolicy.backoff.baseSeconds."""
        return self.backoff.base_s

    @property
    def backoff_max_s(self) -> float:
        """failurePolicy.backoff.maxSeconds."""
        return self.backoff.max_s

    def action_for_exit(self, container: str, exit_code: int) -> str:
        """The first matching rule's action; RestartGroup when no rule matches."""
        for rule in self.rules:
            if rule.matches(container, exit_code):
                return rule.action
        return ACTION_RESTART_GROUP


# --- spec.lighthouse ----------------------------------------------------------------------------------------------
def _pull_secrets(value: Any) -> Any:
    """imagePullSecrets as the pod takes them: [{name: <secret>}], other keys dropped."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in value):
        raise PydanticCustomError(VALUE_ERROR, "a list of {name: <secret>}")
    return tuple({"name": s["name"]} for s in value)


class LighthouseSpec(SpecModel):
    """`spec.lighthouse`. Of the placement fields, None means unset: imagePullSecrets and priorityClassName then
    come from the worker template (builders.lighthouse_pod), nodeSelector, tolerations and affinity stay empty."""

    image: StrictStr | None = None
    command: tuple[StrictStr, ...] = Field(("ftjob-trainer", "lighthouse"), max_length=64)
    resources: dict[str, Any] = {}  # empty: builders.LIGHTHOUSE_DEFAULT_RESOURCES
    join_timeout_s: StrictFloat = Field(1.0, alias="joinTimeoutSeconds", ge=0)
    heartbeat_timeout_s: StrictFloat = Field(5.0, alias="heartbeatTimeoutSeconds", gt=0)
    stall_factor: StrictFloat = Field(3.0, alias="stallFactor", ge=0)  # ftjob.lighthouse.core.stall; 0: off
    stall_floor_s: StrictFloat = Field(1.0, alias="stallFloorSeconds", gt=0)
    node_selector: dict[StrictStr, StrictStr] = Field({}, alias="nodeSelector")
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] = {}
    priority_class_name: StrictStr | None = Field(None, alias="priorityClassName")
    image_pull_secrets: Annotated[tuple[dict[str, str], ...] | None, BeforeValidator(_pull_secrets)] = Field(
        None, alias="imagePullSecrets"
    )

    @model_validator(mode="before")
    @classmethod
    def _empty_command_is_unset(cls, raw: Any) -> Any:
        # an empty command would start nothing: it reads as the default
        if isinstance(raw, dict) and raw.get("command") == []:
            return {k: v for k, v in raw.items() if k != "command"}
        return raw


# --- spec.integrity -----------------------------------------------------------------------------------------------
class GradientGuard(SpecModel):
    """`spec.integrity.gradientGuard`: a step whose gradient is non-finite or whose norm is over normRatio x the
    median is refused; a group refused maxOffences times within windowSeconds is evicted."""

    enabled: StrictBool = True
    # must be > 1: a lower ratio refuses healthy groups
    norm_ratio: StrictFloat = Field(100.0, alias="normRatio", gt=1)
    max_offences: StrictInt = Field(3, alias="maxOffences", ge=1)
    window_s: StrictInt = Field(600, alias="windowSeconds", ge=1)


class IntegritySpec(SpecModel):
    """`spec.integrity`: the gradient guard (trainer: refuse a step; lighthouse: evict after maxOffences within
    windowSeconds) and the replicas' state-digest check every digestEverySteps committed steps (0: off)."""

    gradient_guard: GradientGuard = Field(GradientGuard(), alias="gradientGuard")
    digest_every_steps: StrictInt = Field(100, alias="digestEverySteps", ge=0)

    @property
    def guard_enabled(self) -> bool:
        """gradientGuard.enabled."""
        return self.gradient_guard.enabled

    @property
    def norm_ratio(self) -> float:
        """gradientGuard.normRatio."""
        return self.gradient_guard.norm_ratio

    @property
    def max_offences(self) -> int:
        """gradientGuard.maxOffences."""
        return self.gradient_guard.max_offences

    @property
    def window_s(self) -> int:
        """gradientGuard.windowSeconds."""
        return self.gradient_guard.window_s


# --- spec.tls -----------------------------------------------------------------------------------------------------
class TlsSpec(SpecModel):
    """`spec.tls`: the lighthouse API and the recovery servers serve TLS with certificates from a per-job CA (the
    Secret `<job>-tls`). `enabled: false` is plain HTTP, for local development only."""

    enabled: StrictBool = True


# --- spec.nodeHealth ----------------------------------------------------------------------------------------------
class NodeCondition(SpecModel):
    """`nodeHealth.conditions[]`: a node condition that means "degrading"."""

    type: StrictStr = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"] = "True"


class NodeTaint(SpecModel):
    """`nodeHealth.taints[]`: a node taint that means "degrading", by key (and effect, when given)."""

    key: StrictStr = Field(min_length=1, max_length=316)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


# node-problem-detector's default problem conditions, and the GPU-health conditions common health agents set. The CRD
# names them in its description and declares no default: a job that sets none follows the list of the operator that
# runs it, not a copy the apiserver stored at creation.
DEFAULT_NODE_CONDITIONS: tuple[NodeCondition, ...] = tuple(
    NodeCondition(type=name)
    for name in (
        "KernelDeadlock",
        "ReadonlyFilesystem",
        "FrequentKubeletRestart",
        "FrequentContainerdRestart",
        "FrequentDockerRestart",
        "CorruptDockerOverlay2",
        "GpuUnhealthy",
        "XidCriticalError",
    )
)


class NodeHealthSpec(SpecModel):
    """`spec.nodeHealth`, checked as the CRD does, with the defaults the planner's policy gets; `policy()` is what the
    planner reads."""

    migrate: StrictBool = True
    # unset (or null): DEFAULT_NODE_CONDITIONS; []: conditions never mean "degrading"
    conditions: tuple[NodeCondition, ...] = Field(DEFAULT_NODE_CONDITIONS, max_length=64)
    taints: tuple[NodeTaint, ...] = Field((), max_length=64)
    no_execute_taints: StrictBool = Field(True, alias="noExecuteTaints")
    cordoned: StrictBool = True

    def policy(self) -> NodeHealthPolicy:
        """The planner's view: (type, status) and (key, effect) pairs."""
        return NodeHealthPolicy(
            migrate=self.migrate,
            conditions=tuple((c.type, c.status) for c in self.conditions),
            taints=tuple((t.key, t.effect or "") for t in self.taints),
            no_execute_taints=self.no_execute_taints,
            cordoned=self.cordoned,
        )


# --- spec ---------------------------------------------------------------------------------------------------------
class JobSpec(SpecModel):
    """`.spec` of a FaultTolerantTrainingJob. `template` (the pod template of one rank) stays a free-form dict."""

    replicas: StrictInt = Field(1, ge=1)
    min_replicas: StrictInt = Field(1, alias="minReplicas", ge=1)
    pods_per_replica: StrictInt = Field(1, alias="podsPerReplica", ge=1, le=1024)
    # rank processes in each pod (one per GPU), started by `ftjob-trainer supervise`; at most
    # contract.MAX_RANKS_PER_POD, the local ranks the per-rank ports (contract.rank_port) are laid out for
    ranks_per_pod: StrictInt = Field(1, alias="ranksPerPod", ge=1, le=contract.MAX_RANKS_PER_POD)
    spare_replicas: StrictInt = Field(0, alias="spareReplicas", ge=0, le=64)
    suspend: StrictBool = False
    ttl_seconds_after_finished: StrictInt | None = Field(None, alias="ttlSecondsAfterFinished", ge=0)
    template: dict[str, Any] = {}
    node_health_spec: NodeHealthSpec = Field(NodeHealthSpec(), alias="nodeHealth")
    integrity: IntegritySpec = IntegritySpec()
    failure_policy: FailurePolicy = Field(FailurePolicy(), alias="failurePolicy")
    lighthouse: LighthouseSpec = LighthouseSpec()
    tls: TlsSpec = TlsSpec()

    null_refused: ClassVar[frozenset[str]] = frozenset({"ranksPerPod"})
    _node_health: NodeHealthPolicy = PrivateAttr()

    def model_post_init(self, context: Any, /) -> None:
        """Builds the planner's node-health policy once: it is read on every reconcile."""
        self._node_health = self.node_health_spec.policy()

    @model_validator(mode="after")
    def _spec_rules(self) -> JobSpec:
        # The CRD's cross-field rules (x-kubernetes-validations on spec), for specs an older CRD let in.
        if self.min_replicas > self.replicas:
            raise _rule("minReplicas must be <= replicas: lower minReplicas or raise replicas")
        if self.replicas + self.spare_replicas > 4096:
            raise _rule("replicas + spareReplicas must be <= 4096 replica groups")
        containers = (self.template.get("spec") or {}).get("containers") or [{}]
        if self.ranks_per_pod > 1 and not containers[0].get("command"):
            # an image's ENTRYPOINT is not in the pod spec, so there is nothing to wrap
            raise _rule(
                "ranksPerPod > 1 needs spec.template.spec.containers[0].command: the operator runs it under "
                "`ftjob-trainer supervise`, which cannot wrap an image's ENTRYPOINT"
            )
        return self

    @property
    def node_health(self) -> NodeHealthPolicy:
        """`spec.nodeHealth` as the planner reads it."""
        return self._node_health

    @property
    def total_groups(self) -> int:
        """Contributing groups plus warm spares: the groups that get pods."""
        return self.replicas + self.spare_replicas

    @property
    def ranks_per_group(self) -> int:
        """The ranks of one replica group: its torch.distributed WORLD_SIZE (podsPerReplica x ranksPerPod)."""
        return self.pods_per_replica * self.ranks_per_pod

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> JobSpec:
        """Parse `.spec` with the CRD's defaults. A bad value raises ValueError whose lines each name the field's
        path and what it must be (the reconciler's error log and metric show it)."""
        try:
            return cls.model_validate(spec)
        except ValidationError as e:
            raise ValueError(spec_errors(e, spec)) from None


# --- readable errors ----------------------------------------------------------------------------------------------
def spec_errors(error: ValidationError, raw: Any) -> str:
    """One line per problem: `spec.<path> must be <what>, got <value>`, in the CRD's camelCase names."""
    lines = []
    for item in error.errors():
        if item["type"] == RULE_ERROR:
            lines.append(f"{_path(item['loc'])}.{item['msg']}")
            continue
        loc, field = _field_at(JobSpec, item["loc"])
        path = _path(loc)
        if item["type"] == "missing":
            lines.append(f"{path} is required")
            continue
        expected = item["msg"] if item["type"] == VALUE_ERROR else _describe(field)
        lines.append(f"{path} must be {expected}, got {_value_at(raw, loc)!r}")
    return "; ".join(dict.fromkeys(lines))  # one line per field, however many of its checks failed


def _path(loc: tuple[int | str, ...]) -> str:
    """spec.failurePolicy.rules[0].action."""
    return "spec" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in loc)


def _field_at(model: type[SpecModel], loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], Any]:
    """The error's location cut after the deepest model field it names, and that field's annotation: a bad item
    of `nodeSelector` reports the field, whose description says what it takes."""
    current: Any = model
    cut: tuple[int | str, ...] = ()
    annotation: Any = None
    for depth, key in enumerate(loc):
        inner = _unwrap(current)
        if isinstance(inner, type) and issubclass(inner, SpecModel) and isinstance(key, str):
            info = next((f for n, f in inner.model_fields.items() if key in (n, f.alias)), None)
            if info is None:
                break
            annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            cut = loc[: depth + 1]
            current = info.annotation
        elif isinstance(key, int) and typing.get_origin(inner) in (tuple, list, frozenset):
            current = typing.get_args(inner)[0]
        else:
            break
    return cut, annotation


def _unwrap(annotation: Any) -> Any:
    """The type behind Annotated[...] and X | None."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


_KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("a string", "strings")}  # fmt: skip


def _describe(annotation: Any, plural: bool = False) -> str:
    """What a field takes, in words: "an integer in 1..16", "a number > 1", "a list of objects"."""
    bounds = _bounds(annotation)
    inner = _unwrap(annotation)
    origin = typing.get_origin(inner)
    if origin is Literal:
        words = "one of " + ", ".join(str(v) for v in typing.get_args(inner))
    elif origin in (tuple, list, frozenset):
        words = ("lists of " if plural else "a list of ") + _describe(typing.get_args(inner)[0], plural=True)
    elif origin is dict or inner is dict:
        value = typing.get_args(inner)[1] if typing.get_args(inner) else Any
        words = "objects" if plural else "an object"
        words += f" of {_describe(value, plural=True)}" if value is not Any else ""
    elif isinstance(inner, type) and issubclass(inner, SpecModel):
        words = "objects" if plural else "an object"
    else:
        singular, many = _KINDS.get(inner, ("a value", "values"))
        words = many if plural else singular
    return f"{words} {bounds}" if bounds else words


def _bounds(annotation: Any) -> str:
    """The numeric bounds pydantic keeps as annotated_types metadata, in words."""
    found: dict[str, float] = {}
    for meta in _metadata(annotation):
        for kind in ("gt", "ge", "lt", "le"):
            if isinstance(meta, annotated_types.BaseMetadata) and getattr(meta, kind, None) is not None:
                found[kind] = getattr(meta, kind)
    if "ge" in found and "le" in found:
        return f"in {found['ge']:g}..{found['le']:g}"
    signs = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
    return " and ".join(f"{sign} {found[kind]:g}" for kind, sign in signs if kind in found)


def _metadata(annotation: Any) -> list[Any]:
    """The Annotated metadata around a type and its X | None, a Field(...)'s own constraints included."""
    out: list[Any] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation, *metadata = typing.get_args(annotation)
            for meta in metadata:
                out.extend(meta.metadata if isinstance(meta, FieldInfo) else [meta])
        elif origin in (Union, types.UnionType) and type(None) in typing.get_args(annotation):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return out
            annotation = args[0]
        else:
            return out


def _value_at(raw: Any, loc: tuple[int | str, ...]) -> Any:
    """The value the spec holds at `loc` (the default's None where it holds none)."""
    for key in loc:
        try:
            raw = raw[key]
        except (KeyError, IndexError, TypeError):
            return None
    return raw
