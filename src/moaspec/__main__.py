"""`python -m moaspec ...` runs the command line."""

import sys

from moaspec.cli import main

sys.exit(main())
