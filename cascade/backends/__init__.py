"""Backends: where a topology's levels run, behind one interface (:class:`cascade.build.Backend`).

- ``local`` (:mod:`cascade.backends.local`): every worker in this process.
- ``ray`` (:mod:`cascade.backends.ray`): every level in a Ray actor, placed as one placement group.

``Cascade.from_topology`` looks a backend up by name in :data:`cascade.build.BACKENDS`.
"""
