"""``python -m mstar.cli``: the ``mstar-kv`` command."""

from mstar.cli.commands import main

raise SystemExit(main())
