"""``python -m lightning_ft_cli``: the ``lightning-ft`` command, for environments without the console script."""

import sys

from lightning_ft_cli.main import main

sys.exit(main())
