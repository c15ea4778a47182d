"""A module only a client names (test_serve_door.py): importing it would say so on stderr."""
from __future__ import annotations

import sys

from policies.fixed import FixedPolicy

print("door_untrusted imported", file=sys.stderr, flush=True)


class Policy(FixedPolicy):
    """A real Policy subclass: refusing it must not depend on importing it to look."""
