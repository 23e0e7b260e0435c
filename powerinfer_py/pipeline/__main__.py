"""`python -m powerinfer_py.pipeline COMMAND ...` is the `powerinfer` command."""

import sys

from .cli import main

sys.exit(main())
