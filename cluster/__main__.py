import sys

from cluster.cli.main import main

sys.exit(main())
