"""docs/reference/env.md: every environment variable of ftjob.contract, from its table (ftjob.contract.env_vars)."""

from __future__ import annotations

from ftjob_docs import GENERATED_NOTE
from ftjob_docs.markdown import code, table, text

# The sections of the page, by the side that reads a variable (EnvVar.reader's first word)
READERS = (
    ("trainer", "Trainer (every worker rank)"),
    ("lighthouse", "Lighthouse (`ftjob-trainer lighthouse`; each flag overrides its variable)"),
    ("supervisor", "In-pod supervisor (`ftjob-trainer supervise`, spec.ranksPerPod > 1)"),
)


def render() -> str:
    """The page's Markdown; raises while a variable of the contract has no entry in its table."""
    from ftjob.contract import env_vars

    problems = env_vars.undescribed()
    if problems:
        raise RuntimeError(f"ftjob.contract.env_vars.ENV_VARS does not describe: {', '.join(problems)}")
    constant_of = {value: name for name, value in env_vars.contract_env_names().items()}
    out = [
        "# Environment reference\n",
        GENERATED_NOTE.format(source="`ftjob.contract.env_vars` (trainer/contract/env_vars.py)"),
        "The operator and the trainer agree on these variables through `ftjob.contract`; the operator sets them on "
        "the pods it makes, the local launcher on the processes it starts. Each row names the constant of "
        "`ftjob.contract` that code uses for the variable.\n",
    ]
    for reader, title in READERS:
        rows = [
            [
                f"{code(v.name)}<br><small>{code('contract.' + constant_of[v.name])}</small>",
                text(v.meaning),
                text(v.set_by),
                text(v.default),
                text(v.reader),
            ]
            for v in env_vars.ENV_VARS
            if v.reader.split(",")[0] == reader
        ]
        out += [f"## {title}\n", table(["Variable", "Meaning", "Set by", "When unset", "Read by"], rows)]
    listed = {v.name for v in env_vars.ENV_VARS if v.reader.split(",")[0] in dict(READERS)}
    if listed != {v.name for v in env_vars.ENV_VARS}:
        raise RuntimeError(f"env_vars.ENV_VARS: readers outside {[r for r, _ in READERS]}")
    return "\n".join(out)
