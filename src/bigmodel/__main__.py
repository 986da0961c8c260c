"""``python -m bigmodel``: the ``bigmodel`` command (see :mod:`bigmodel.cli.main`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
