"""``python -m elastic_runtime.cli``: the ``elastic-runtime`` command."""

import sys

from elastic_runtime.cli.main import main

sys.exit(main())
