#!/usr/bin/env python3
"""ftjob node agent: a process "kubelet" for the local cluster. See README.md.

Usage: ip netns exec ftj-node-N <venv>/bin/python hack/nodeagent/main.py --config agent.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nodeagent.config import ConfigError, load_config
from nodeagent.hostns import join_host_mount_namespace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one node's pods as processes (ftjob local cluster).")
    parser.add_argument("--config", required=True, help="agent.json written by hack/cluster")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"nodeagent: {e}", file=sys.stderr)
        return 2
    logging.getLogger("nodeagent").info("%s: %s", cfg.node_name, join_host_mount_namespace())
    # One pidfd per running container: hundreds of pods outgrow the usual soft limit of 1024 descriptors.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from nodeagent.agent import Agent

    try:
        asyncio.run(Agent(cfg).run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
