"""`python -m fourfold.cli`."""

from fourfold.cli.main import main

raise SystemExit(main())
