"""``python -m ftjob.lighthouse`` == ``ftjob-trainer lighthouse``."""

import sys

from ftjob.lighthouse.cli import main

sys.exit(main(sys.argv[1:]))
