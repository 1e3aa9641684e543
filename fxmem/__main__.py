"""``python -m fxmem analyze ...`` (see :mod:`fxmem.cli`)."""
from .cli import main

raise SystemExit(main())
