"""``python -m remat.cli``: the ``remat`` command."""
import sys

from .main import main

sys.exit(main())
