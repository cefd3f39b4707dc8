"""``python -m k3`` (what ``torchrun -m k3 train`` runs on every rank): the ``k3`` command."""

import sys

from k3.cli import main

sys.exit(main())
