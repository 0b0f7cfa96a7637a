"""``python -m ftjob.cli`` == ``ftjob-trainer``."""

import sys

from ftjob.cli import main

sys.exit(main())
