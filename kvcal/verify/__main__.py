"""``python -m kvcal.verify``: the command is ``kvcal verify``."""

import sys

sys.exit("use: kvcal verify --help")
