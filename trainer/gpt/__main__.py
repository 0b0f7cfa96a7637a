"""``python -m ftjob.gpt [flags]`` == ``ftjob-trainer train [flags]``."""

import sys

from ftjob.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
