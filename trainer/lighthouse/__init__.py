"""The per-job lighthouse: the quorum server every replica group asks once per step (no torch).

``quorum`` holds the algorithm as pure logic, ``server`` the aiohttp front end, ``cli`` the
``ftjob-trainer lighthouse`` command (also ``python -m ftjob.lighthouse``). ``integrity`` judges the groups' guard
verdicts and state digests (pure logic), ``audit`` writes the audit trail, ``auditing`` says who did what for it. The
wire messages are ``ftjob.contract.lighthouse_api``.
"""
