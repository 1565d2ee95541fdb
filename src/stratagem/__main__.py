"""``python -m stratagem``: the stratagem command."""

import sys

from stratagem.cli.main import main

sys.exit(main())
