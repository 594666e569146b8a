"""`python -m vlmserve.cli ...` is the `vlmserve` command."""

import sys

from vlmserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
