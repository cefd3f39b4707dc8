"""``python -m k3.cli`` (what `k3 serve --replicas` starts for each replica): the ``k3`` command."""

import sys

from k3.cli import main

sys.exit(main())
