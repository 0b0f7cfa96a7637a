"""The reference trainer: a small byte-level GPT on the standard library's own sources, trained through the
fault-tolerant Manager (``ftjob-trainer train``, also ``python -m ftjob.gpt``)."""
