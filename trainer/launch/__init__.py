"""The local launcher (``ftjob-trainer launch``): a lighthouse plus N replica groups as local processes running any
training command, with fault injection, and a report checked from the groups' run records. Also the in-pod
supervisor (``supervisor``, ``ftjob-trainer supervise``) that starts a pod's rank processes, one per GPU."""
