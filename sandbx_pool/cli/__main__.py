"""``python -m sandbx_pool.cli``: the same as the ``sandbx-pool`` command."""

import sys

from sandbx_pool.cli.main import main

sys.exit(main())
