"""Model hosts behind one small interface (:class:`workers.base.Worker`)."""
from workers.base import Draft, Worker

__all__ = ["Draft", "Worker"]
