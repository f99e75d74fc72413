"""`python -m rayshard ...`: the same entry point as the `rayshard` console script."""
import sys

from rayshard.cluster.cli.main import main

sys.exit(main())
