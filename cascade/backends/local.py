"""The local backend: every level's worker in this process (the default)."""
from __future__ import annotations

from cascade.build import Backend, build_workers
from cascade.topology import Topology
from workers.base import Worker


class LocalBackend(Backend):
    def __init__(self, workers: dict[str, Worker]):
        self.workers = workers

    @classmethod
    def start(cls, topo: Topology, address: str | None = None, device: str | None = None) -> "LocalBackend":
        return cls(build_workers(topo, device))

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers = {}
