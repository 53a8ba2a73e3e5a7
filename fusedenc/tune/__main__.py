"""``python -m fusedenc.tune``."""

import sys

from . import main

sys.exit(main())
