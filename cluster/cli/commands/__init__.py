"""What each `rayshard` subcommand does. The parsers in cluster/cli/ name these functions as
"module:function" and `cluster/cli/main.py` imports one only when it runs, so `rayshard --help`
and the catalog commands never import torch or Ray."""
