"""``python -m tpify.cli``: the ``tpify`` command (torchrun runs the ranks this way)."""

import sys

from . import main

sys.exit(main())
