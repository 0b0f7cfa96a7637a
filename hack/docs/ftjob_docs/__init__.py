"""The docs site's generated reference pages (docs/reference/), each rendered from the code it documents.

hack/docs/hooks.py hands them to MkDocs at build time; none is ever written into docs/.

  crd_page         the FaultTolerantTrainingJob schema (crds/ftjob.dev_faulttoleranttrainingjobs.yaml)
  metrics_page     the operator's, the lighthouse's and a trainer rank's Prometheus metrics (their registries)
  env_page         the environment variables of ftjob.contract (ftjob.contract.env_vars)
  cli_page         the argparse help of ftjob-operator, ftjob-trainer and its subcommands, kubectl-ftjob
  python_api_page  mkdocstrings directives for the public names of ftjob.ft
  markdown         escaping text into Markdown tables
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = REPO_ROOT / "crds" / "ftjob.dev_faulttoleranttrainingjobs.yaml"
GENERATED_NOTE = (
    "!!! note\n    This page is generated from {source} when the site is built; change the source, not this page.\n"
)
