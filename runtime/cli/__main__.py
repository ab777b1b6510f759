"""``python -m runtime.cli``: the ``elastic-runtime`` command."""

import sys

from runtime.cli.main import main

sys.exit(main())
