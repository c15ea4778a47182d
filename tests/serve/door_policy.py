"""Policy plug-ins for the door tests (tests/serve/test_serve_door.py). Each says on stderr when it
is imported, so the server's log shows whether a module was: ``DoorPolicy`` is the one its
operator allows (``--allow-policy door_policy:DoorPolicy``); ``door_untrusted`` only a client
names, and must never be imported."""
from __future__ import annotations

import sys

from policies.fixed import FixedPolicy

print("door_policy imported", file=sys.stderr, flush=True)


class DoorPolicy(FixedPolicy):
    """The fixed policy under another name."""
