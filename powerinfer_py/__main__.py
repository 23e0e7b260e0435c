"""`python -m powerinfer_py COMMAND ...`: the `powerinfer` command (powerinfer_py.pipeline.cli)."""

import sys

from .pipeline.cli import main

sys.exit(main())
