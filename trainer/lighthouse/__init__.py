"""The per-job lighthouse: the quorum server every replica group asks once per step (no torch).

``quorum`` holds the algorithm as pure logic, ``server`` the aiohttp front end, ``cli`` the
``ftjob-trainer lighthouse`` command (also ``python -m ftjob.lighthouse``). The wire messages are
``ftjob.contract.lighthouse_api``.
"""
