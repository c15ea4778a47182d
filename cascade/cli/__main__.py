"""``python -m cascade.cli ...`` runs the ``cascade`` command (no console script needed)."""
import sys

from cascade.cli import main

sys.exit(main())
