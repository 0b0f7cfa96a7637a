"""What every pod worker shares: the agent's config, API client and node-wide services."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .config import AgentConfig
from .dns import DnsWriter
from .kubeapi import KubeClient
from .network import IpAllocator
from .podstatus import StatusSyncer
from .volumes import ObjectSource


@dataclass
class NodeContext:
    config: AgentConfig
    client: KubeClient
    objects: ObjectSource
    dns: DnsWriter
    status: StatusSyncer
    ips: IpAllocator
    # Bounds concurrent pod network setups: a burst of pods must not fork hundreds of `ip` at once on a small box.
    setup_slots: asyncio.Semaphore
